"""One request per connection, as bytes: read one newline-terminated line, then require EOF.

Every byte read is charged to the daemon's :class:`ByteBudget` (shared by all connections),
so many large requests at once cannot make the daemon's memory grow without bound.
"""

from __future__ import annotations

import anyio
from anyio.abc import ByteReceiveStream

from coldsnap_runtime.errors import RequestRejected

__all__ = ("MAX_MESSAGE_BYTES", "Account", "ByteBudget", "FramingError", "read_request_line")

MAX_MESSAGE_BYTES = 64 << 20
_CHUNK = 1 << 20


class FramingError(RequestRejected):
    """The bytes on the connection are not one newline-terminated request followed by EOF."""

    def __init__(self, message: str, *, partial: bytes | bytearray = b"") -> None:
        super().__init__(message)
        self.partial = partial


class ByteBudget:
    """The total of request and reply bytes the daemon holds at once, across every connection."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def account(self) -> Account:
        return Account(self)


class Account:
    """One connection's share of the budget; :meth:`close` gives all of it back."""

    def __init__(self, budget: ByteBudget) -> None:
        self._budget = budget
        self.held = 0

    def take(self, size: int) -> None:
        """Charge `size` bytes, or refuse when the daemon already holds its limit."""
        budget = self._budget
        if budget.used + size > budget.limit:
            raise FramingError(
                f"host-provider is holding its limit of {budget.limit} buffered bytes; retry later")
        self.hold(size)

    def hold(self, size: int) -> None:
        """Charge bytes that already exist (a built reply): counted, never refused."""
        self._budget.used += size
        self.held += size

    def close(self) -> None:
        self._budget.used -= self.held
        self.held = 0


async def read_request_line(stream: ByteReceiveStream, account: Account) -> bytearray:
    """Return the request line (without its newline); the Go client half-closes after it."""
    buf = bytearray()
    newline = -1
    while newline < 0:
        try:
            chunk = await stream.receive(_CHUNK)
        except anyio.EndOfStream:
            if not buf:
                raise FramingError("host-provider request is empty") from None
            raise FramingError("host-provider request is not newline-terminated", partial=buf) from None
        try:
            account.take(len(chunk))
        except FramingError as exc:
            raise FramingError(str(exc), partial=_head(buf or chunk)) from exc
        start = len(buf)
        buf += chunk
        newline = buf.find(b"\n", start)
        if newline < 0 and len(buf) >= MAX_MESSAGE_BYTES:
            raise FramingError(f"host-provider request exceeds {MAX_MESSAGE_BYTES} bytes", partial=_head(buf))
    if newline + 1 > MAX_MESSAGE_BYTES:  # the delimiter may arrive in the chunk that passes the cap
        raise FramingError(f"host-provider request exceeds {MAX_MESSAGE_BYTES} bytes", partial=_head(buf))
    trailing = len(buf) > newline + 1
    del buf[newline:]
    if not buf or buf.isspace():
        raise FramingError("host-provider request is empty")
    if trailing:
        raise FramingError("host-provider request has trailing data", partial=buf)
    try:
        await stream.receive(1)
    except anyio.EndOfStream:
        return buf
    raise FramingError("host-provider request has trailing data", partial=buf)


def _head(buf: bytes | bytearray) -> bytes:
    """The start of a refused request: enough for the reply to echo its id, no more."""
    return bytes(buf[:4096])

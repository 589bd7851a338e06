"""One request per connection, as bytes: read one newline-terminated line, then require EOF.

Every byte read is charged to the daemon's :class:`ByteBudget` (shared by all connections),
so many large requests at once cannot make the daemon's memory grow without bound.
"""

from __future__ import annotations

from collections import Counter
from contextvars import ContextVar

import anyio
from anyio.abc import ByteReceiveStream

from coldsnap_runtime.errors import RequestRejected

__all__ = (
    "MAX_MESSAGE_BYTES",
    "Account",
    "ByteBudget",
    "FramingError",
    "OverBudget",
    "charge",
    "current_account",
    "read_request_line",
)

MAX_MESSAGE_BYTES = 64 << 20
_CHUNK = 1 << 20


class FramingError(RequestRejected):
    """The bytes on the connection are not one newline-terminated request followed by EOF."""

    def __init__(self, message: str, *, partial: bytes | bytearray = b"") -> None:
        super().__init__(message)
        self.partial = partial


class OverBudget(FramingError):
    """Taking more bytes would pass the daemon's or the peer's share of the byte budget."""


class ByteBudget:
    """The request, reply and output bytes the daemon holds at once: in all, and per peer uid.

    A peer is refused past its own share; past the total, every peer is refused except root
    and the daemon's uid (trusted: capped only by their own share), so no other peer can
    starve them.
    """

    def __init__(self, limit: int, *, per_uid: int) -> None:
        self.limit = limit
        self.per_uid = per_uid
        self.used = 0
        self.by_uid: Counter[int] = Counter()

    def account(self, uid: int, *, trusted: bool) -> Account:
        return Account(self, uid, trusted=trusted)


class Account:
    """One connection's share of the budget; :meth:`close` gives all of it back."""

    def __init__(self, budget: ByteBudget, uid: int, *, trusted: bool) -> None:
        self._budget = budget
        self._uid = uid
        self._trusted = trusted
        self.held = 0

    def take(self, size: int) -> None:
        """Charge `size` bytes, or refuse (OverBudget) when that would pass a limit."""
        budget = self._budget
        if budget.by_uid[self._uid] + size > budget.per_uid:
            raise OverBudget(f"host-provider is holding its limit of {budget.per_uid} buffered bytes "
                             f"for uid {self._uid}; retry later")
        if not self._trusted and budget.used + size > budget.limit:
            raise OverBudget(f"host-provider is holding its limit of {budget.limit} buffered bytes; retry later")
        self.hold(size)

    def hold(self, size: int) -> None:
        """Charge bytes that already exist (a built reply): counted, never refused."""
        self._budget.used += size
        self._budget.by_uid[self._uid] += size
        self.held += size

    def close(self) -> None:
        budget = self._budget
        budget.used -= self.held
        budget.by_uid[self._uid] -= self.held
        if not budget.by_uid[self._uid]:
            del budget.by_uid[self._uid]
        self.held = 0


# The account of the connection whose request is being answered: what an operation collects
# for its reply (exec output) is charged to it, wherever in the task tree it is collected.
current_account: ContextVar[Account | None] = ContextVar("current_account", default=None)


def charge(size: int) -> None:
    """Charge `size` bytes of collected output to the current request (OverBudget past a limit)."""
    if (account := current_account.get()) is not None:
        account.take(size)


async def read_request_line(stream: ByteReceiveStream, account: Account, *,
                            limit: int = MAX_MESSAGE_BYTES, what: str = "host-provider request") -> bytearray:
    """Return the request line (without its newline); the Go client half-closes after it."""
    buf = bytearray()
    newline = -1
    while newline < 0:
        try:
            chunk = await stream.receive(_CHUNK)
        except anyio.EndOfStream:
            if not buf:
                raise FramingError(f"{what} is empty") from None
            raise FramingError(f"{what} is not newline-terminated", partial=buf) from None
        try:
            account.take(len(chunk))
        except FramingError as exc:
            raise FramingError(str(exc), partial=_head(buf or chunk)) from exc
        start = len(buf)
        buf += chunk
        newline = buf.find(b"\n", start)
        if newline < 0 and len(buf) >= limit:
            raise FramingError(f"{what} exceeds {limit} bytes", partial=_head(buf))
    if newline + 1 > limit:  # the delimiter may arrive in the chunk that passes the cap
        raise FramingError(f"{what} exceeds {limit} bytes", partial=_head(buf))
    trailing = len(buf) > newline + 1
    del buf[newline:]
    if not buf or buf.isspace():
        raise FramingError(f"{what} is empty")
    if trailing:
        raise FramingError(f"{what} has trailing data", partial=buf)
    try:
        await stream.receive(1)
    except anyio.EndOfStream:
        return buf
    raise FramingError(f"{what} has trailing data", partial=buf)


def _head(buf: bytes | bytearray) -> bytes:
    """The start of a refused request: enough for the reply to echo its id, no more."""
    return bytes(buf[:4096])

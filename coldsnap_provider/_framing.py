"""The daemon side's JSON-line channel, both ends: one request per connection, as bytes.

The protocol of the session and control sockets (the Go client's, ``docs/conformance.md``): the asker sends one
newline-terminated JSON line and half-closes; the server reads that line, requires EOF, answers and closes; the
asker reads the answer to EOF. The server's end is :func:`read_request_line` (and, for a refused peer,
:func:`read_head`, :func:`discard_briefly`, :func:`discard_rest`); the asker's is :func:`exchange`. Nothing else
in the daemon reads or writes these sockets' bytes (``tests/test_architecture.py``).

Every byte the server reads is charged to the daemon's :class:`ByteBudget` (shared by all connections),
so many large requests at once cannot make the daemon's memory grow without bound.

The capsule side speaks the same shape of protocol in ``coldsnap_probe/jsonline.py`` (descriptors may ride with
a request there, and the asker need not half-close). The two cannot share code: the probe runs on a capsule's own
python3 with the standard library only and must not import the daemon, and the daemon's end is anyio's, never a
blocking socket on its event loop.
"""

from __future__ import annotations

import os
from collections import Counter
from contextvars import ContextVar

import anyio
from anyio.abc import ByteReceiveStream, ByteStream

from coldsnap_runtime.errors import RequestRejected

from ._errors import ProtocolError

__all__ = (
    "MAX_MESSAGE_BYTES",
    "Account",
    "ByteBudget",
    "FramingError",
    "OverBudget",
    "charge",
    "current_account",
    "discard_briefly",
    "discard_rest",
    "exchange",
    "read_head",
    "read_request_line",
)

MAX_MESSAGE_BYTES = 64 << 20
_CHUNK = 1 << 20
# A refused peer: how long, and how many bytes, it may still write before the connection closes (so it reads
# our reply, not a reset), and how much of its request is read to echo its id.
_DISCARD_S = 0.5
_DISCARD_BYTES = 64 << 10


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


async def discard_briefly(stream: ByteStream) -> None:
    """Let a refused peer finish writing (so it reads our reply, not EPIPE), within small bounds."""
    discarded = 0
    with anyio.move_on_after(_DISCARD_S):
        try:
            await stream.send_eof()
            while discarded < _DISCARD_BYTES:
                discarded += len(await stream.receive(_DISCARD_BYTES))
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass


async def read_head(stream: ByteReceiveStream) -> bytes:
    """Up to the first line of a request, within small bounds (enough to echo its id)."""
    head = b""
    with anyio.move_on_after(_DISCARD_S):
        try:
            while len(head) < _DISCARD_BYTES and b"\n" not in head:
                head += await stream.receive(_DISCARD_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
    return head.split(b"\n", 1)[0]


async def discard_rest(stream: ByteReceiveStream) -> None:
    """Read a refused request to its end without keeping it, so the peer can read our reply."""
    try:
        while await stream.receive(1 << 20):
            pass
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        pass


async def exchange(socket_path: str | os.PathLike[str], payload: bytes) -> bytes:
    """Send raw bytes, half-close, and return everything until EOF (bounded)."""
    async with await anyio.connect_unix(os.fspath(socket_path)) as stream:
        await stream.send(payload)
        await stream.send_eof()
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                chunk = await stream.receive()
            except anyio.EndOfStream:
                break
            total += len(chunk)
            if total > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"response exceeds {MAX_MESSAGE_BYTES} bytes")
            chunks.append(chunk)
    return b"".join(chunks)

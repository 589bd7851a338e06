"""One request per connection: read one newline-terminated line, then require EOF."""

from __future__ import annotations

import anyio
from anyio.abc import ByteReceiveStream
from anyio.streams.buffered import BufferedByteReceiveStream

from coldsnap_runtime.errors import RequestRejected

from ._envelope import MAX_MESSAGE_BYTES

__all__ = ("FramingError", "read_request_line")


class FramingError(RequestRejected):
    """The bytes on the connection are not one newline-terminated request followed by EOF."""

    def __init__(self, message: str, *, partial: bytes = b"") -> None:
        super().__init__(message)
        self.partial = partial


async def read_request_line(stream: ByteReceiveStream) -> bytes:
    """Return the request line (without its newline); the Go client half-closes after it."""
    reader = BufferedByteReceiveStream(stream)
    try:
        line = await reader.receive_until(b"\n", MAX_MESSAGE_BYTES - 1)
    except anyio.DelimiterNotFound:
        raise FramingError(f"host-provider request exceeds {MAX_MESSAGE_BYTES} bytes") from None
    except anyio.IncompleteRead:
        partial = bytes(reader.buffer)
        if not partial:
            raise FramingError("host-provider request is empty") from None
        raise FramingError("host-provider request is not newline-terminated", partial=partial) from None
    if len(line) + 1 > MAX_MESSAGE_BYTES:  # the delimiter may arrive in the chunk that passes the cap
        raise FramingError(f"host-provider request exceeds {MAX_MESSAGE_BYTES} bytes")
    if not line.strip():
        raise FramingError("host-provider request is empty")
    if reader.buffer:
        raise FramingError("host-provider request has trailing data", partial=line)
    try:
        extra = await reader.receive(1)
    except anyio.EndOfStream:
        return line
    raise FramingError("host-provider request has trailing data", partial=line + extra)

"""Docker's hijacked HTTP connections (attach, exec start) with a real stdin half-close.

aiodocker's ``Stream.close()`` half-closes *and* drops the connection, so a program
fed on stdin could never be read to completion through it. Here we speak the few lines
of HTTP/1.1 the upgrade needs over our own Unix socket and keep the raw stream.
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import anyio
from anyio.abc import SocketStream

from ._translate import demux

__all__ = ("HijackError", "Hijacked", "hijack")

_MAX_HEADER = 64 << 10


class HijackError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Hijacked:
    """The raw multiplexed stream after the upgrade; an async context manager."""

    def __init__(self, stream: SocketStream, leftover: bytes) -> None:
        self._stream = stream
        self._buffer = bytearray(leftover)
        self._eof = False

    async def write_stdin(self, data: bytes) -> None:
        try:
            if data:
                await self._stream.send(data)
            await self._stream.send_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the program exited without reading: not our failure

    async def read_frames(self, *, limit: int) -> list[tuple[int, bytes]]:
        """All (stream, payload) frames until the engine closes the connection."""
        frames: list[tuple[int, bytes]] = []
        total = 0
        while True:
            frames.extend(demux(self._buffer))
            if self._eof:
                return frames
            try:
                chunk = await self._stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                self._eof = True
                continue
            total += len(chunk)
            if total > limit:
                raise OverflowError(limit)
            self._buffer += chunk

    async def communicate(self, stdin: bytes | None, *, limit: int) -> list[tuple[int, bytes]]:
        """Feed `stdin` (None: nothing attached) while reading every frame until EOF."""
        async with anyio.create_task_group() as tg:
            if stdin is not None:
                tg.start_soon(self.write_stdin, stdin)
            frames = await self.read_frames(limit=limit)
        return frames

    async def __aenter__(self) -> Hijacked:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stream.aclose()


async def hijack(socket_path: str, path: str, *, query: dict[str, str] | None = None,
                 body: dict[str, object] | None = None) -> Hijacked:
    """POST `path` with Upgrade: tcp and return the hijacked stream (caller closes it)."""
    payload = json.dumps(body).encode() if body is not None else b""
    target = path + ("?" + urlencode(query) if query else "")
    head = (
        f"POST {target} HTTP/1.1\r\nHost: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    stream = await anyio.connect_unix(socket_path)
    try:
        await stream.send(head + payload)
        data = b""
        while b"\r\n\r\n" not in data:
            if len(data) > _MAX_HEADER:
                raise HijackError(502, "engine sent an oversized response header")
            try:
                data += await stream.receive()
            except anyio.EndOfStream:
                raise HijackError(502, "engine closed the connection during the upgrade") from None
        header, _, rest = data.partition(b"\r\n\r\n")
        status_line, *header_lines = header.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        if status not in (101, 200):
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
            length = int(headers.get("content-length", "0") or 0)
            while len(rest) < length:
                try:
                    rest += await stream.receive()
                except anyio.EndOfStream:
                    break
            try:
                message = str(json.loads(rest).get("message", rest.decode(errors="replace")))
            except ValueError:
                message = rest.decode(errors="replace").strip()
            raise HijackError(status, message)
        return Hijacked(stream, rest)
    except BaseException:
        await anyio.aclose_forcefully(stream)
        raise

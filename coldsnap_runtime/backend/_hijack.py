"""Docker's hijacked HTTP connections (attach, exec start) with a real stdin half-close.

aiodocker's ``Stream.close()`` half-closes *and* drops the connection, so a program
fed on stdin could never be read to completion through it. Here we speak the few lines
of HTTP/1.1 the upgrade needs over our own Unix socket and keep the raw stream.

Errors are already ours: an error status is :class:`EngineRejected` and output past the
limit is :class:`OutputTooLarge`; socket failures are left to the backend's one
translation point (``docker_errors``).
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import anyio
from anyio.abc import SocketStream

from ..errors import EngineRejected, OutputTooLarge
from ._translate import demux

__all__ = ("Hijacked", "hijack")

_MAX_HEADER = 64 << 10


class Hijacked:
    """The raw multiplexed stream after the upgrade; an async context manager."""

    def __init__(self, stream: SocketStream, leftover: bytes, *, action: str) -> None:
        self._stream = stream
        self._buffer = bytearray(leftover)
        self._eof = False
        self._action = action

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
                raise OutputTooLarge(action=self._action, limit=limit)
            self._buffer += chunk

    async def communicate(self, stdin: bytes | None, *, limit: int) -> list[tuple[int, bytes]]:
        """Feed `stdin` (None: nothing attached) while reading every frame until EOF.

        A failure of the read is raised as itself, not inside an exception group: the
        writer never fails (see :meth:`write_stdin`), so it is simply cancelled.
        """
        frames: list[tuple[int, bytes]] = []
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            if stdin is not None:
                tg.start_soon(self.write_stdin, stdin)
            try:
                frames = await self.read_frames(limit=limit)
            except Exception as exc:
                failure = exc
                tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return frames

    async def __aenter__(self) -> Hijacked:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stream.aclose()


async def hijack(socket_path: str, path: str, *, action: str, query: dict[str, str] | None = None,
                 body: dict[str, object] | None = None) -> Hijacked:
    """POST `path` with Upgrade: tcp and return the hijacked stream (caller closes it).

    `path` must already be quoted; the backend builds it from engine ids and validated names.
    """
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
                raise EngineRejected(action=action, status=502, detail="engine sent an oversized response header")
            try:
                data += await stream.receive()
            except anyio.EndOfStream as exc:
                raise EngineRejected(action=action, status=502,
                                     detail="engine closed the connection during the upgrade") from exc
        header, _, rest = data.partition(b"\r\n\r\n")
        status_line, *header_lines = header.decode("latin-1").split("\r\n")
        try:
            status = int(status_line.split(" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise EngineRejected(action=action, status=502,
                                 detail=f"engine sent a malformed status line {status_line[:80]!r}") from exc
        if status not in (101, 200):
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
            length = int(headers.get("content-length", "0") or 0) if headers.get(
                "content-length", "0").isdigit() else 0
            while len(rest) < min(length, _MAX_HEADER):
                try:
                    rest += await stream.receive()
                except anyio.EndOfStream:
                    break
            try:
                message = str(json.loads(rest).get("message", rest.decode(errors="replace")))
            except (ValueError, AttributeError):
                message = rest.decode(errors="replace").strip()
            raise EngineRejected(action=action, status=status, detail=message)
        return Hijacked(stream, rest, action=action)
    except BaseException:
        await anyio.aclose_forcefully(stream)
        raise

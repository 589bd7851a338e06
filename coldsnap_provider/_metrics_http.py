"""The metrics endpoint: `GET /metrics` over a small, bounded HTTP/1.1 reader on the daemon's own loop.

Not prometheus_client's threaded WSGI server: that one reads without bounds or deadlines in
threads the daemon does not own. Here every connection is a task of the endpoint's task group,
and a hostile peer costs at most one of ``MAX_CONNECTIONS`` slots for ``HEAD_DEADLINE_S``:

    accept ─► a slot free? (else close at once) ─► read the request head (≤ MAX_HEAD_BYTES,
    within HEAD_DEADLINE_S) ─► GET/HEAD /metrics ─► render (Accept: OpenMetrics or text)
    ─► write (within WRITE_DEADLINE_S) ─► close

One request per connection (``Connection: close``); no body is ever read.
"""

from __future__ import annotations

import errno
import functools
from pathlib import Path

import anyio
import anyio.abc
import structlog
from anyio.abc import ByteStream, SocketListener, TaskStatus
from anyio.streams.buffered import BufferedByteReceiveStream

from ._errors import ConfigError
from ._metrics import Metrics

__all__ = ("MetricsEndpoint", "open_listener", "parse_address", "parse_head")

log = structlog.get_logger(__name__)

MAX_CONNECTIONS = 32  # scrapers are few; the rest are closed unread
MAX_HEAD_BYTES = 8192  # request line and headers: a scrape sends a few hundred bytes
HEAD_DEADLINE_S = 5.0  # the whole head must arrive within this (slow-header peers are dropped)
WRITE_DEADLINE_S = 10.0  # a scraper that does not read its answer is dropped
DISCARD_S, DISCARD_BYTES = 0.5, 256 << 10  # after the answer: what a peer still sends, read and dropped


def parse_address(address: str) -> tuple[str, int] | Path:
    """``host:port`` (``[v6]:port``) or ``unix:/absolute/path``; ValueError naming the rule otherwise."""
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        if not path.startswith("/") or "\x00" in path:
            raise ValueError(f"metrics.address {address!r}: a unix socket needs an absolute path (unix:/path)")
        return Path(path)
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"metrics.address {address!r}: expected host:port (port 1-65535) or unix:/path")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def open_listener(address: str) -> list[SocketListener]:
    """Bind the configured address (a name may give IPv4 and IPv6 sockets); a unix socket is created
    0660 (its directory decides who may scrape)."""
    where = parse_address(address)
    try:
        if isinstance(where, Path):
            where.unlink(missing_ok=True)
            return [await anyio.create_unix_listener(where, mode=0o660)]
        multi = await anyio.create_tcp_listener(local_host=where[0], local_port=where[1])
        return [listener for listener in multi.listeners if isinstance(listener, SocketListener)]
    except OSError as exc:
        raise ConfigError(f"metrics.address {address!r}: cannot listen: {exc.strerror or exc}") from exc


class MetricsEndpoint:
    """Serves its listeners (one, or IPv4 and IPv6 of one name) until cancelled; owns every connection task."""

    def __init__(self, listeners: list[SocketListener], metrics: Metrics) -> None:
        self._listeners = listeners
        self._metrics = metrics
        self._active = 0  # Invariant: connection tasks alive, never above MAX_CONNECTIONS

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for listener in self._listeners:
                    tg.start_soon(functools.partial(self._accept, listener, task_group=tg))
                task_status.started()
        finally:
            for listener in self._listeners:
                await anyio.aclose_forcefully(listener)

    async def _accept(self, listener: SocketListener, *, task_group: anyio.abc.TaskGroup) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # capacity (EMFILE...) or a peer gone before accept: never fatal here
                log.error("metrics accept failed; backing off", error=errno.errorcode.get(exc.errno or 0, str(exc)))
                await anyio.sleep(0.1)
                continue
            if self._active >= MAX_CONNECTIONS:  # every slot taken: the excess is closed unread
                await anyio.aclose_forcefully(stream)
                continue
            self._active += 1
            task_group.start_soon(self._connection, stream)

    async def _connection(self, stream: ByteStream) -> None:
        try:
            async with stream:
                answer = None
                with anyio.move_on_after(HEAD_DEADLINE_S):
                    answer = await self._answer(stream)
                if answer is None:  # the peer left, or was too slow: close without a word
                    return
                with anyio.move_on_after(WRITE_DEADLINE_S):
                    await stream.send(answer)
                    await stream.send_eof()
                await _discard_unread(stream)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the scraper went away: nothing to tell it
        finally:
            self._active -= 1

    async def _answer(self, stream: ByteStream) -> bytes | None:
        reader = BufferedByteReceiveStream(stream)
        try:
            head = await reader.receive_until(b"\r\n\r\n", MAX_HEAD_BYTES)
        except anyio.DelimiterNotFound:
            return _response(431, b"request head exceeds 8192 bytes\n")
        except (anyio.IncompleteRead, anyio.EndOfStream):
            return None
        asked = parse_head(head)
        if isinstance(asked, bytes):
            return asked
        method, accept = asked
        # In a worker thread: rendering is milliseconds of pure Python the loop's sockets should not wait behind.
        body, content_type = await anyio.to_thread.run_sync(self._metrics.render, accept)
        return _response(200, body, content_type=content_type, head_only=method == b"HEAD")


def parse_head(head: bytes) -> tuple[bytes, str] | bytes:
    """A request head (up to its blank line, which is not in `head`): the method (GET or HEAD) and the Accept
    header's value of a request for /metrics, or the whole refusal to send (431, 400, 405 or 404). No I/O.

    The size is checked here, not only by the reader's bound: `receive_until` returns a head it finds in one
    read however long it is (a 9 KiB head that arrived at once was answered 200)."""
    if len(head) + 4 > MAX_HEAD_BYTES:
        return _response(431, b"request head exceeds 8192 bytes\n")
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return _response(400, b"malformed request line\n")
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        return _response(405, b"only GET and HEAD\n", extra=b"Allow: GET, HEAD\r\n")
    if target != b"/metrics":
        return _response(404, b"the metrics are at /metrics\n")
    accept = b""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"accept":
            accept = value.strip()
    return method, accept.decode("latin-1")


async def _discard_unread(stream: ByteStream) -> None:
    """Read (bounded) what a refused peer still sends, so that closing does not reset the answer away."""
    left = DISCARD_BYTES
    with anyio.move_on_after(DISCARD_S):
        while left > 0:
            try:
                left -= len(await stream.receive(65536))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


def _response(status: int, body: bytes, *, content_type: str = "text/plain; charset=utf-8", extra: bytes = b"",
              head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + extra + b"\r\n"
    return head if head_only else head + body

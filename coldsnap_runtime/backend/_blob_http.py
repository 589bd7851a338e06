"""One lane of a capture's push or pull (``_capture_registry.py``): a worker thread's kept-alive HTTP/1.1 connection
to the registry, used for blob after blob (``_blob_upload.py``, ``_blob_fetch.py``), and every wait on it bounded by
the current blob's deadline and the transfer's cancel.

Why our own few lines of HTTP/1.1 and not ``http.client``: a capture is thousands of ~190 KiB blobs, and each costs
round trips, not bytes. Measured on the 2-core machine against docker-registry on 127.0.0.1 (one thread, HEADs of
absent blobs): 934 us of our CPU a HEAD with a fresh ``http.client`` connection each (the daemon's push before), 549
with one kept alive (its headers parsed by the ``email`` package), 154 here. That CPU holds the GIL, so it was the
serial part of every push and pull, ~1.7 ms a blob whatever the width on the H200 machine. Every read and write
checks the blob's deadline and the cancel at least every POLL_S, so a registry that answers a byte at a time, sends
an endless body or says nothing holds no thread (before, a watcher thread per blob cut the connection).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple
from urllib.parse import urlsplit

__all__ = ("IDLE_S", "POLL_S", "Answer", "Bound", "Connection", "Lane", "origin")

IDLE_S = 30.0  # a connect, or one read, that waits longer than this is a silent registry
POLL_S = 0.5  # a cancel or the deadline is noticed within this, whatever the connection waits on
WINDOW = 1 << 20  # a body's bytes received at a time, at most (into one buffer per connection, used again)
_HEAD = 64 << 10  # an answer's status line and headers at most
_LINE = 4096  # a chunked body's size line at most
# A chunked body's chunks at most: this many, and one more a KiB of the bytes read. Each chunk costs Python work under
# the GIL, not bytes: a registry sending 1-byte chunks (or an endless trailer, or endless 1xx answers) held a lane's
# thread at a full core, the daemon's event loop with it, until the blob's deadline (review17). Registries send blobs
# with a Content-Length, or chunks of KiBs (Go's net/http: 32 KiB).
_CHUNKS = 64
_INTERIM = 8  # 1xx answers before the answer, at most


def origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


class Bound(NamedTuple):
    """What ends a blob's waits: its `deadline` (then `late` is raised) and the transfer's `stop` (`cancelled`)."""

    deadline: float
    stop: threading.Event
    late: OSError
    cancelled: OSError

    def left(self, progressed: float) -> float:
        """Raise if the blob must end now (cancelled, late, or IDLE_S since `progressed`); else the seconds one wait
        may take before it checks again."""
        now = time.monotonic()
        if self.stop.is_set():
            raise self.cancelled
        if now > self.deadline:
            raise self.late
        if now - progressed > IDLE_S:
            raise TimeoutError(f"the registry sent or took nothing for {IDLE_S:.0f} s")
        return min(POLL_S, self.deadline - now)


class Answer(NamedTuple):
    """An answer's status and headers (names in lower case)."""

    status: int
    headers: dict[str, str]


class Connection:
    """One HTTP/1.1 connection to one origin, opened on first use and again after the registry closed it; one request
    at a time, its answer read whole (`body`, `stream`) before the next."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) address: {url!r}")
        self.origin = (parts.scheme, parts.netloc)
        self._prefix = f"{parts.scheme}://{parts.netloc}"
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._sock: socket.socket | None = None
        self._buffer = bytearray()  # received, not yet consumed
        self._window = memoryview(bytearray(1 << 16))  # grown to WINDOW for a body of more (a lane of large blobs)
        self._answered = 0  # answers read on the current socket (a reused one may have been closed meanwhile)
        self._closing = False  # the current answer said `Connection: close`
        self._method = ""
        self._status = 0  # the current answer's
        self.truncated = False  # the last `stream` ended before its body's end
        self._framing = ""  # the current answer's body: "length", "chunked", "close" or "" (read, none left)
        self._left = 0  # of a "length" body, the bytes not yet consumed
        self.bound = Bound(float("inf"), threading.Event(), TimeoutError("late"), ConnectionAbortedError("stop"))

    def target(self, url: str) -> str | None:
        """`url`'s path and query when it names this connection's origin (a request line's target), else None."""
        if url.startswith(self._prefix) and url[len(self._prefix):len(self._prefix) + 1] in ("/", "?"):
            return url[len(self._prefix):]
        return None

    @property
    def sock(self) -> socket.socket:
        """The open socket (a PUT's body goes straight to it)."""
        if self._sock is None:
            raise ConnectionAbortedError("the connection is closed")
        return self._sock

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self._buffer.clear()
        self._framing = ""
        if sock is not None:
            sock.close()

    # --- requests -----------------------------------------------------------------------

    def exchange(self, method: str, target: str, headers: dict[str, str],
                 body: Callable[[socket.socket], None] | None = None) -> Answer:
        """Send a request (its head, then `body` writes the bytes its Content-Length announced to the socket) and read
        its answer's status and headers, the body then ready to read. Sent once more, on a fresh connection, when a
        connection that answered before turns out closed (the registry dropped it while idle)."""
        for again in (False, True):
            if self._framing:
                self.close()  # the last answer's body was left unread: its bytes would be read as the next answer
            reused = self._sock is not None and self._answered > 0 and not again
            if self._sock is None:
                self._open()
            lines = [f"{method} {target} HTTP/1.1", f"Host: {self.origin[1]}"]
            lines += [f"{name}: {value}" for name, value in headers.items()]
            if method in ("POST", "PUT", "DELETE") and "Content-Length" not in headers:
                lines.append("Content-Length: 0")
            self._method = method
            try:
                self._send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
                if body is not None:
                    body(self.sock)
                return self.answer()
            except (ConnectionResetError, BrokenPipeError):
                self.close()
                if not reused:
                    raise
        raise AssertionError("unreachable")

    def answer(self) -> Answer:
        """The next answer's status and headers (1xx skipped, _INTERIM of them at most), its body then ready to read."""
        for _ in range(_INTERIM + 1):
            while (end := self._buffer.find(b"\r\n\r\n")) < 0:
                if len(self._buffer) > _HEAD:
                    raise ConnectionError(f"the registry answered a header of more than {_HEAD} bytes")
                if not self._receive():
                    self.close()
                    raise ConnectionResetError("the registry closed the connection before it answered")
            lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
            del self._buffer[:end + 4]
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            # isdigit() alone takes "²" (latin-1), which int() refuses: a ValueError the push did not name (review17)
            if not version.startswith("HTTP/1.") or len(code) != 3 or not (code.isascii() and code.isdigit()):
                raise ConnectionError(f"the registry answered something else than HTTP/1.1: {lines[0][:80]!r}")
            headers = {}
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if not colon:
                    raise ConnectionError(f"the registry answered a malformed header line: {line[:80]!r}")
                headers[name.strip().lower()] = value.strip()
            status = int(code)
            if 100 <= status < 200:
                continue
            self._answered, self._status = self._answered + 1, status
            self._frame(status, headers, version)
            return Answer(status, headers)
        raise ConnectionError(f"the registry answered more than {_INTERIM} interim (1xx) answers")

    def _frame(self, status: int, headers: dict[str, str], version: str) -> None:
        connection = headers.get("connection", "").lower()
        # Closed once this answer is read: asked by the registry, or an HTTP/1.0 answer that does not keep it alive.
        self._closing = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
        if self._method == "HEAD" or status in (204, 304):
            self._framing, self._left = "length", 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._framing = "chunked"
        elif (length := headers.get("content-length", "")).isascii() and length.isdigit():
            self._framing, self._left = "length", int(length)
        elif length:
            raise ConnectionError(f"the registry answered a Content-Length that is no number: {length[:40]!r}")
        else:
            self._framing = "close"
        if self._framing == "length" and self._left == 0:
            self._done()

    # --- bodies -------------------------------------------------------------------------

    def body(self, keep: int, drain: int) -> bytes:
        """The answer's body: its first `keep` bytes, the rest read and dropped so the connection serves the next
        request; more than `drain` bytes beyond them is a registry to leave (ConnectionError, the connection
        closed). A body cut short is what came of it."""
        kept, drained = bytearray(), 0
        for piece in self._pieces(keep + drain + 1):
            room = max(0, keep - len(kept))
            kept += piece[:room]
            drained += len(piece) - min(room, len(piece))
        if drained > drain:
            raise ConnectionError(f"the registry answered {self._status} with a body of more than {drain} bytes")
        return bytes(kept)

    def stream(self, most: int) -> Iterator[memoryview]:
        """The body's bytes, at most `most` of them, each view valid until the next; ends early (`truncated` then
        says so) when the body is shorter than its framing said."""
        yield from self._pieces(most)

    def _pieces(self, most: int) -> Iterator[memoryview]:
        """The body's bytes, at most `most`; when the connection closes before the body's end they stop there and
        `truncated` says so (a truncated blob, a connection cut)."""
        self.truncated = False
        if self._framing == "length":
            yield from self._raw(min(self._left, most), self._left <= most)
        elif self._framing == "close":
            yield from self._raw(most, False, until_close=True)
        elif self._framing == "chunked":
            chunks, read = 0, 0
            while most > 0:
                chunks += 1
                if chunks > _CHUNKS + read // 1024:
                    raise ConnectionError(f"the registry sent a chunked body in more than {chunks - 1} chunks for "
                                          f"{read} bytes")
                if (head := self._line()) is None:
                    return
                line = head.split(b";")[0].strip()
                try:
                    size = int(line, 16)
                except ValueError as exc:
                    raise ConnectionError(f"the registry sent a malformed chunk size: {line[:40]!r}") from exc
                if size < 0:
                    raise ConnectionError(f"the registry sent a malformed chunk size: {line[:40]!r}")
                if size == 0:
                    trailer = 0
                    while field := self._line():  # the trailer (None: cut short), as bounded as a head
                        if (trailer := trailer + len(field) + 2) > _HEAD:
                            raise ConnectionError(f"the registry sent a chunked body's trailer of more than {_HEAD} "
                                                  "bytes")
                    if field is not None:
                        self._done()
                    return
                self._framing, self._left = "length", size
                yield from self._raw(min(size, most), False)
                most, read = most - size, read + size
                if self._left or self.truncated:
                    break
                self._framing = "chunked"
                if end := self._line():
                    raise ConnectionError("the registry sent a chunk longer than its size")
                if end is None:
                    return
        if self._framing:  # stopped before the body's end: this connection cannot serve another request
            self.close()

    def _raw(self, count: int, ends: bool, *, until_close: bool = False) -> Iterator[memoryview]:
        """`count` bytes of the body (fewer at its close when `until_close`); `ends`: they are the body's last."""
        while count > 0:
            if self._buffer:
                piece = memoryview(bytes(self._buffer[:count]))
                del self._buffer[:len(piece)]
            else:
                if len(self._window) < min(count, WINDOW):
                    self._window = memoryview(bytearray(WINDOW))
                got = self._receive_into(self._window[:min(count, WINDOW)])
                if not got:
                    self.close()
                    self.truncated = not until_close
                    return
                piece = self._window[:got]
            count -= len(piece)
            self._left -= len(piece)
            yield piece
        if ends and not until_close:
            self._done()

    def _line(self) -> bytes | None:
        """A line of a chunked body, None when the connection closed first (`truncated` then says so)."""
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > _LINE:
                raise ConnectionError("the registry sent a chunked body's line of more than 4096 bytes")
            if not self._receive():
                self.close()
                self.truncated = True
                return None
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 2]
        return line

    def _done(self) -> None:
        self._framing = ""
        if self._closing:
            self.close()

    # --- the socket, every wait bounded ---------------------------------------------------

    def _open(self) -> None:
        last: OSError = ConnectionError(f"{self._host} has no address")
        for family, kind, protocol, _, address in socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, protocol)
            try:
                self._connect(sock, address)
            except BaseException as exc:
                sock.close()
                if not isinstance(exc, OSError) or isinstance(exc, TimeoutError) or exc in self.bound[2:]:
                    raise  # the deadline, the cancel or a silent registry: not an address to pass over
                last = exc
                continue
            self._sock, self._answered, self._closing = sock, 0, False
            if self.origin[0] == "https":
                self._sock = self._handshake(sock)
            return
        raise last

    def _connect(self, sock: socket.socket, address: tuple[object, ...]) -> None:
        """Connect without blocking, so the deadline and the cancel are checked while the registry is silent."""
        progressed = time.monotonic()
        sock.setblocking(False)
        if (code := sock.connect_ex(address)) not in (0, errno.EINPROGRESS):
            raise OSError(code, os.strerror(code))  # the errno's own class: ConnectionRefusedError...
        while not select.select([], [sock], [], self.bound.left(progressed))[1]:
            pass
        if code := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            raise OSError(code, os.strerror(code))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request's head is one write

    def _handshake(self, sock: socket.socket) -> ssl.SSLSocket:
        progressed = time.monotonic()
        try:
            secured = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host,
                                                               do_handshake_on_connect=False)
        except BaseException:
            sock.close()
            raise
        self._sock = secured
        while True:
            secured.settimeout(self.bound.left(progressed))
            try:
                secured.do_handshake()
                return secured
            except TimeoutError:
                continue
            except BaseException:
                self.close()
                raise

    def _send(self, data: bytes) -> None:
        view, progressed = memoryview(data), time.monotonic()
        while view:
            self._wait(progressed)
            try:
                sent = self.sock.send(view)
            except TimeoutError:
                continue
            view, progressed = view[sent:], time.monotonic()

    def _receive(self) -> int:
        got = self._receive_into(self._window[:1 << 16])
        self._buffer += self._window[:got]
        return got

    def _receive_into(self, view: memoryview) -> int:
        progressed = time.monotonic()
        while True:
            self._wait(progressed)
            try:
                return self.sock.recv_into(view)
            except TimeoutError:
                continue

    def _wait(self, progressed: float) -> None:
        """The socket's next wait ends within POLL_S, or at the deadline (a timeout set only when it changes: a
        system call)."""
        if (timeout := self.bound.left(progressed)) != self.sock.gettimeout():
            self.sock.settimeout(timeout)


class Lane:
    """A lane thread's connections: to the registry's origin, and to the last other origin a blob's GET was sent to
    (a registry that keeps its blobs in a bucket or behind a CDN redirects every one there)."""

    def __init__(self, base: str) -> None:
        self.registry = Connection(base)
        self._other: Connection | None = None

    def to(self, url: str) -> Connection:
        """The connection for `url`'s origin (another origin than the last other one: a fresh connection)."""
        if self.registry.target(url) is not None:
            return self.registry
        if self._other is None or self._other.origin != origin(url):
            if self._other is not None:
                self._other.close()
            self._other = Connection(url)
        self._other.bound = self.registry.bound
        return self._other

    def bind(self, bound: Bound) -> None:
        """Every wait of the lane's connections ends by `bound` (the current blob's)."""
        self.registry.bound = bound
        if self._other is not None:
            self._other.bound = bound

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.registry.close()
        if self._other is not None:
            with contextlib.suppress(OSError):
                self._other.close()

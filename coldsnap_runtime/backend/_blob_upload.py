"""One blob of a capture's push, in a worker thread (``_capture_registry.py``): asked for first (HEAD), and only
when the registry lacks it, uploaded from the node's store (POST, then one monolithic PUT whose body the kernel
sends from the file: ``sendfile``, no copy through Python).

Why a thread with the standard library's HTTP client and not aiohttp on the daemon's event loop: on the loop every
body byte went through the one loop thread, after the whole 64 MiB blob was read into a ``bytes``. On the H200
machine a 10.6 GB push took 21.8 s (0.49 GB/s) while the registry link took 1.39 GB/s (8 blobs at a time,
``scripts/device store``); ``bench/store_push.py`` measures both ways side by side. Through TLS the body is read
and sent by the thread (the kernel's sendfile would bypass the encryption). A monolithic PUT per blob, not
chunked PATCHes: a blob is at most 64 MiB, so an interrupted push resumes at blob granularity (the HEAD).

The deadline and the cancel bound every wait of the thread, not only the body's: a registry may answer a byte at a
time (each read within the socket's timeout) or send an endless body, and a thread held by it would hold its
upload slot and, being no daemon thread, the daemon's exit. A watcher (`_Watch`) cuts the connection then.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import BinaryIO, NamedTuple
from urllib.parse import urljoin, urlsplit

from ._blob_fetch import IDLE_S, connect, origin

__all__ = ("PIECE", "Uploaded", "upload_blob")

PIECE = 16 << 20  # at most this much handed to one sendfile (it sends what the socket takes at once)
TLS_PIECE = 1 << 20  # read and sent at a time through TLS
POLL_S = 0.5  # a cancel or the deadline is noticed within this, even while the registry reads nothing
CANCEL_S = 2.0  # what the best-effort DELETE of an unfinished upload may wait
_ERROR_BODY = 4096  # what a refusal's body is read for its message
_DRAIN = 1 << 20  # an answer's body read at most (to reuse the connection): more is a registry to leave


class Uploaded(NamedTuple):
    """What the registry answered for one blob: the status of the last request (200: it had the blob already,
    201: uploaded), a refusal's first bytes, whether the blob was there before (nothing was sent), and a 401's
    challenge (the caller answers it on its session, then asks again: a token for HEAD may not allow the POST)."""

    status: int
    body: bytes
    present: bool
    challenge: str = ""


class _Registry:
    """One connection to the registry's origin, the credentials sent only there; the requests of one blob."""

    def __init__(self, base: str, authorization: str) -> None:
        self.base = base
        self.origin = origin(base)
        self.authorization = authorization
        self.connection = connect(base, IDLE_S)
        self.cut_off = False

    def close(self) -> None:
        self.connection.close()

    def cut(self) -> None:
        """From the watcher's thread: whatever this connection's thread waits on fails now, and it sends no more.
        The plain socket's shutdown, also under TLS (SSLSocket's own would drop its state under the reader)."""
        self.cut_off = True
        if (sock := self.connection.sock) is not None:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def to(self, url: str) -> str:
        """`url`'s path and query on the registry's own connection (an upload location elsewhere is refused)."""
        if origin(url) != self.origin:
            raise ConnectionError(f"the registry sent the upload to another origin: {url!r}")
        parts = urlsplit(url)
        return parts.path + (f"?{parts.query}" if parts.query else "")

    def send(self, method: str, url: str, headers: dict[str, str] | None = None) -> None:
        if self.cut_off:
            raise ConnectionAbortedError("the upload's connection was cut")
        sent = {**(headers or {}), **({"Authorization": self.authorization} if self.authorization else {})}
        if method in ("POST", "DELETE"):
            sent.setdefault("Content-Length", "0")
        self.connection.putrequest(method, self.to(url), skip_accept_encoding=True)
        for name, value in sent.items():
            self.connection.putheader(name, value)
        self.connection.endheaders()

    def answer(self) -> tuple[int, bytes, str]:
        """The status, the body's first bytes (the rest drained, so the connection serves the next request) and
        the Location header (a 401's: its challenge)."""
        response = self.connection.getresponse()
        body, drained = response.read(_ERROR_BODY), 0
        while piece := response.read(1 << 16):
            if (drained := drained + len(piece)) > _DRAIN:
                raise ConnectionError(f"the registry answered {response.status} with a body of more than {_DRAIN} "
                                      "bytes")
        if self.cut_off:  # what came before the cut is no answer (a header or a body cut short)
            raise ConnectionAbortedError("the upload's connection was cut")
        header = "WWW-Authenticate" if response.status == 401 else "Location"
        return response.status, body, response.getheader(header, "")

    def request(self, method: str, url: str) -> tuple[int, bytes, str]:
        self.send(method, url)
        return self.answer()


def upload_blob(base: str, *, authorization: str, digest: str, size: int, source: BinaryIO, within_s: float,
                stop: threading.Event, offset: int = 0) -> Uploaded:
    """HEAD `base`/blobs/`digest`; when absent, POST an upload and PUT `size` bytes of `source` from `offset` (the
    caller opened the chunk's home: its blob, or a capture's file it is a part of) to it as `digest`.
    The whole blob must go `within_s` (a registry that reads slowly is cut, not waited on), and `stop` (set by a
    cancelled caller) ends the body at the next piece; an upload left unfinished is cancelled (DELETE, best
    effort). Network failures raise OSError (an HTTP protocol error or a bad location as ConnectionError, a cut as
    TimeoutError), naming the blob."""
    deadline = time.monotonic() + within_s
    registry = _Registry(base, authorization)
    watch = _Watch(registry, deadline, stop, (TimeoutError(f"blob {digest} was not sent within {within_s:.0f} s"),
                                              ConnectionAbortedError(f"blob {digest}: its push was cancelled")))
    location = ""
    try:
        status, body, challenge = registry.request("HEAD", f"{base}/blobs/{digest}")
        if status == 200:
            return Uploaded(200, b"", True)
        if status != 404:
            return Uploaded(status, body, False, challenge if status == 401 else "")
        status, body, location = registry.request("POST", f"{base}/blobs/uploads/")
        if status != 202 or not location:
            return Uploaded(status, body, False, location if status == 401 else "")
        location = urljoin(base, location)
        status, body = _put(registry, location, digest, (source, offset, size), deadline, within_s, stop)
        if status == 201:
            location = ""
        return Uploaded(status, body, False)
    except OSError as exc:
        if watch.fired is not None:  # cut by the watcher: its reason, not the socket's
            raise watch.fired from exc
        raise
    except http.client.HTTPException as exc:
        raise watch.fired or ConnectionError(f"{type(exc).__name__}: {exc}") from exc
    except ValueError as exc:  # a location that does not parse: named, not an internal error
        raise ConnectionError(f"blob {digest}: the registry answered an upload location that does not parse: "
                              f"{exc}") from exc
    finally:
        watch.close()
        registry.close()
        if location:
            _cancel(base, authorization, location)


class _Watch:
    """Cuts `registry`'s connection once `deadline` passes or `stop` is set (checked every POLL_S, and again until
    closed: a cut while the connection was still being made finds no socket), whatever its thread waits on; `fired`
    is then the one of `reasons` (the deadline's, the cancel's) that applied."""

    def __init__(self, registry: _Registry, deadline: float, stop: threading.Event | None,
                 reasons: tuple[OSError, OSError]) -> None:
        self.fired: OSError | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(registry, deadline, stop, reasons), daemon=True,
                         name="coldsnap-upload-watch").start()

    def _run(self, registry: _Registry, deadline: float, stop: threading.Event | None,
             reasons: tuple[OSError, OSError]) -> None:
        while not self._done.wait(POLL_S):
            if self.fired is None and stop is not None and stop.is_set():
                self.fired = reasons[1]
            elif self.fired is None and time.monotonic() > deadline:
                self.fired = reasons[0]
            if self.fired is not None:
                registry.cut()

    def close(self) -> None:
        self._done.set()


def _put(registry: _Registry, location: str, digest: str, part: tuple[BinaryIO, int, int], deadline: float,
         within_s: float, stop: threading.Event) -> tuple[int, bytes]:
    """The PUT that completes the upload, its body `part` of a file (the file, an offset, a size)."""
    size = part[2]
    separator = "&" if "?" in location else "?"
    registry.send("PUT", f"{location}{separator}digest={digest}",
                  {"Content-Type": "application/octet-stream", "Content-Length": str(size)})
    sock = registry.connection.sock

    def check(sent: int, progressed: float) -> float:
        now = time.monotonic()
        if stop.is_set():
            raise ConnectionAbortedError(f"blob {digest}: its push was cancelled")
        if now > deadline:
            raise TimeoutError(f"blob {digest} was not sent within {within_s:.0f} s")
        if now - progressed > IDLE_S:
            raise TimeoutError(f"blob {digest}: the registry read nothing for {IDLE_S:.0f} s ({sent} bytes sent)")
        return deadline - now

    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, part, check)
    else:
        _send_file(sock, part, check)
    sock.settimeout(IDLE_S)
    status, body, _ = registry.answer()
    return status, body


def _send_file(sock: socket.socket, part: tuple[BinaryIO, int, int], check: Callable[[int, float], float]) -> None:
    """The kernel sends the file (`os.sendfile`, the socket non-blocking: a registry that stops reading is noticed
    within POLL_S, not after a whole piece)."""
    (source, offset, size), sent, progressed = part, 0, time.monotonic()
    sock.setblocking(False)
    with selectors.DefaultSelector() as selector:
        selector.register(sock, selectors.EVENT_WRITE)
        while sent < size:
            if not selector.select(min(POLL_S, check(sent, progressed))):
                continue
            try:
                piece = os.sendfile(sock.fileno(), source.fileno(), offset + sent, min(PIECE, size - sent))
            except BlockingIOError:
                continue
            if not piece:
                raise ConnectionError(f"the blob's file in the node's store ended at {sent} of {size} bytes")
            sent, progressed = sent + piece, time.monotonic()


def _send_tls(sock: ssl.SSLSocket, part: tuple[BinaryIO, int, int], check: Callable[[int, float], float]) -> None:
    """Through TLS the bytes must pass the socket's encryption (sendfile would bypass it): read and sent TLS_PIECE
    at a time, each send waiting at most IDLE_S or what is left of the deadline."""
    (source, offset, size), sent = part, 0
    while sent < size:
        sock.settimeout(max(0.1, min(IDLE_S, check(sent, time.monotonic()))))
        if not (piece := os.pread(source.fileno(), min(TLS_PIECE, size - sent), offset + sent)):
            raise ConnectionError(f"the blob's file in the node's store ended at {sent} of {size} bytes")
        sock.sendall(piece)
        sent += len(piece)


def _cancel(base: str, authorization: str, location: str) -> None:
    """Best effort: the registry drops an unfinished upload now rather than at its own expiry."""
    try:
        registry = _Registry(base, authorization)
        reason = TimeoutError(f"the upload's cancel took more than {CANCEL_S:.0f} s")
        watch = _Watch(registry, time.monotonic() + CANCEL_S, None, (reason, reason))
        try:
            registry.connection.timeout = CANCEL_S
            registry.request("DELETE", location)
        finally:
            watch.close()
            registry.close()
    except (OSError, http.client.HTTPException, ValueError):
        pass

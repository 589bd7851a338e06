"""One blob of a capture's push, in a worker thread (``_capture_registry.py``): asked for first (HEAD), and only
when the registry lacks it, uploaded from the node's store (POST, then one monolithic PUT whose body the kernel
sends from the file: ``sendfile``, no copy through Python).

Why a thread with the standard library's HTTP client and not aiohttp on the daemon's event loop: on the loop every
body byte went through the one loop thread, after the whole 64 MiB blob was read into a ``bytes``. On the H200
machine a 10.6 GB push took 21.8 s (0.49 GB/s) while the registry link took 1.39 GB/s (8 blobs at a time,
``scripts/device store``); ``bench/store_push.py`` measures both ways side by side. Through TLS the body is read
and sent by the thread (the kernel's sendfile would bypass the encryption). A monolithic PUT per blob, not
chunked PATCHes: a blob is at most 64 MiB, so an interrupted push resumes at blob granularity (the HEAD).

The thread is a lane (``_blob_http.py``): it pushes blob after blob on one kept-alive connection. The deadline and
the cancel bound every wait of it, not only the body's: a registry may answer a byte at a time or send an endless
body, and a thread held by it would hold its upload slot and, being no daemon thread, the daemon's exit.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import threading
import time
from typing import BinaryIO, NamedTuple
from urllib.parse import urljoin

from ._blob_http import IDLE_S, POLL_S, Bound, Connection, Lane

__all__ = ("PIECE", "Uploaded", "mounts", "upload_blob")

PIECE = 16 << 20  # at most this much handed to one sendfile (it sends what the socket takes at once)
TLS_PIECE = 1 << 20  # read and sent at a time through TLS
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


def _ask(registry: Connection, method: str, url: str, headers: dict[str, str]) -> tuple[int, bytes, dict[str, str]]:
    """One request without a body on the registry's own connection (a location elsewhere is refused): its status,
    its body's first bytes and its headers."""
    status, answered = registry.exchange(method, _target(registry, url), headers)
    return status, registry.body(_ERROR_BODY, _DRAIN), answered


def _target(registry: Connection, url: str) -> str:
    """`url`'s path and query, on the registry's own connection (an upload location elsewhere is refused)."""
    if (path := registry.target(url)) is None:
        raise ConnectionError(f"the registry sent the upload to another origin: {url!r}")
    return path


def upload_blob(base: str, *, authorization: str, digest: str, size: int, source: BinaryIO, within_s: float,
                stop: threading.Event, lane: Lane | None = None, mount: str = "", offset: int = 0) -> Uploaded:
    """Ask for `base`/blobs/`digest` (HEAD; with `mount`, the repository `base` names, a POST that mounts it from
    there: one round trip fewer); when absent, POST an upload (or use the one that POST began) and PUT `size` bytes
    of `source` from `offset` (the caller opened the chunk's home: its blob, or a capture's file it is a part of) to
    it as `digest`, on `lane`'s connection (None: a lane of its own, closed after). The whole blob must go
    `within_s` (a registry that reads slowly is cut, not waited on), and `stop` (set by a cancelled caller) ends it
    within POLL_S; an upload left unfinished is cancelled (DELETE, best effort). Network failures raise OSError (an
    HTTP protocol error or a bad location as ConnectionError, a cut as TimeoutError), naming the blob."""
    own, location = lane is None, ""
    lane = lane or Lane(base)
    registry, sent = lane.registry, {"Authorization": authorization} if authorization else {}
    lane.bind(Bound(time.monotonic() + within_s, stop,
                    TimeoutError(f"blob {digest} was not sent within {within_s:.0f} s"),
                    ConnectionAbortedError(f"blob {digest}: its push was cancelled")))
    try:
        if mount:
            status, body, answered = _ask(registry, "POST", f"{base}/blobs/uploads/?mount={digest}&from={mount}", sent)
            if status == 201:  # mounted from its own repository: it was there
                return Uploaded(200, b"", True)
        else:
            status, body, answered = _ask(registry, "HEAD", f"{base}/blobs/{digest}", sent)
            if status == 200:
                return Uploaded(200, b"", True)
            if status != 404:
                return Uploaded(status, body, False, answered.get("www-authenticate", "") if status == 401 else "")
            status, body, answered = _ask(registry, "POST", f"{base}/blobs/uploads/", sent)
        if status != 202 or not answered.get("location"):
            return Uploaded(status, body, False, answered.get("www-authenticate", "") if status == 401 else "")
        location = urljoin(base, answered["location"])
        status, body = _put(registry, location, digest, (source, offset, size), sent)
        if status == 201:
            location = ""
        return Uploaded(status, body, False)
    except BaseException:
        registry.close()  # whatever it was in the middle of: the lane's next blob starts on a fresh connection
        raise
    finally:
        if own:
            lane.close()
        if location:
            _cancel(base, authorization, location)


def mounts(base: str, *, authorization: str, digest: str, repository: str, lane: Lane, stop: threading.Event) -> bool:
    """Whether the registry mounts a blob from the repository it is in (`digest`, just uploaded there): then a push
    may ask for each blob with that POST instead of a HEAD (`upload_blob`'s `mount`). A registry that does not (OCI
    says it SHOULD) answers 202 and begins an upload, cancelled here; it is then asked with HEADs."""
    registry, location = lane.registry, ""
    lane.bind(Bound(time.monotonic() + IDLE_S, stop, TimeoutError("the registry's mount was not answered"),
                    ConnectionAbortedError("the push was cancelled")))
    try:
        status, _, answered = _ask(registry, "POST", f"{base}/blobs/uploads/?mount={digest}&from={repository}",
                                   {"Authorization": authorization} if authorization else {})
        if status == 202 and answered.get("location"):
            location = urljoin(base, answered["location"])
        return status == 201
    except BaseException:
        registry.close()
        raise
    finally:
        if location:
            _cancel(base, authorization, location)


def _put(registry: Connection, location: str, digest: str, part: tuple[BinaryIO, int, int],
         sent: dict[str, str]) -> tuple[int, bytes]:
    """The PUT that completes the upload, its body `part` of a file (the file, an offset, a size)."""
    size = part[2]
    separator = "&" if "?" in location else "?"
    headers = {**sent, "Content-Type": "application/octet-stream", "Content-Length": str(size)}

    def body(sock: socket.socket) -> None:
        if isinstance(sock, ssl.SSLSocket):
            _send_tls(sock, part, registry.bound)
        else:
            _send_file(sock, part, registry.bound)

    status, _ = registry.exchange("PUT", _target(registry, f"{location}{separator}digest={digest}"), headers, body)
    return status, registry.body(_ERROR_BODY, _DRAIN)


def _send_file(sock: socket.socket, part: tuple[BinaryIO, int, int], bound: Bound) -> None:
    """The kernel sends the file (`os.sendfile`, the socket non-blocking: a registry that stops reading is noticed
    within POLL_S, not after a whole piece)."""
    (source, offset, size), sent, progressed = part, 0, time.monotonic()
    sock.setblocking(False)
    try:
        while sent < size:
            try:
                piece = os.sendfile(sock.fileno(), source.fileno(), offset + sent, min(PIECE, size - sent))
            except BlockingIOError:
                select.select([], [sock], [], bound.left(progressed))
                continue
            if not piece:
                raise ConnectionError(f"the blob's file in the node's store ended at {sent} of {size} bytes")
            sent, progressed = sent + piece, time.monotonic()
    finally:
        sock.settimeout(POLL_S)


def _send_tls(sock: ssl.SSLSocket, part: tuple[BinaryIO, int, int], bound: Bound) -> None:
    """Through TLS the bytes must pass the socket's encryption (sendfile would bypass it): read and sent TLS_PIECE
    at a time, each send waiting at most IDLE_S or what is left of the deadline."""
    (source, offset, size), sent = part, 0
    while sent < size:
        bound.left(time.monotonic())  # cancelled or late: raised here, between pieces
        sock.settimeout(max(0.1, min(IDLE_S, bound.deadline - time.monotonic())))
        if not (piece := os.pread(source.fileno(), min(TLS_PIECE, size - sent), offset + sent)):
            raise ConnectionError(f"the blob's file in the node's store ended at {sent} of {size} bytes")
        sock.sendall(piece)
        sent += len(piece)


def _cancel(base: str, authorization: str, location: str) -> None:
    """Best effort: the registry drops an unfinished upload now rather than at its own expiry."""
    connection = Connection(base)
    reason = TimeoutError(f"the upload's cancel took more than {CANCEL_S:.0f} s")
    connection.bound = Bound(time.monotonic() + CANCEL_S, threading.Event(), reason, reason)
    try:
        _ask(connection, "DELETE", location, {"Authorization": authorization} if authorization else {})
    except (OSError, ValueError):
        pass
    finally:
        connection.close()

"""One registry blob fetched in a worker thread, for a capture's pull (``_capture_registry.py``): the body is streamed
into its place in the capture's partial files (``store_pull.py``) and hashed on the way; it counts only if it is
exactly the blob's bytes (the files are fsynced once, whole, before they are named).

Why a thread with the standard library's HTTP client and not aiohttp on the daemon's event loop: a pull reads
its chunks several at once, and on the loop every body byte goes through the one loop thread (and was then copied
whole into a 64 MiB ``bytes``). Measured on the 2-core machine, 8 chunks of 64 MiB at once from the registry on
127.0.0.1: 0.22 GB/s received on the loop, 0.54 GB/s with a thread each (socket reads, SHA-256 and file writes
release the GIL, so the threads spread over a machine's cores). Each thread is a lane (``_blob_http.py``): it fetches
blob after blob on one kept-alive connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urljoin, urlsplit

from ._blob_http import Bound, Connection, Lane

__all__ = ("Fetched", "fetch_blob")

REDIRECTS = 5  # a registry may send a blob's GET to its storage (a CDN, a bucket): followed this many times
_ERROR_BODY = 4096  # what a refusal's body is read for its message
_DRAIN = 1 << 20  # a refusal's or a redirect's body read at most (to reuse the connection): more, the connection closed
PIECE = 8 << 20  # bytes written between two starts of their writeback


class Fetched(NamedTuple):
    """What a GET gave: its status, a refusal's first bytes, and for a 200 the bytes read (at most the blob's size
    + 1: a longer body shows without being read whole) and whether they were the blob's (then it is kept); a 401's
    challenge (the caller answers it on the loop, then asks again)."""

    status: int
    body: bytes
    read: int
    kept: bool
    challenge: str = ""


def fetch_blob(url: str, *, authorization: str, digest: str, size: int, into: Path, within_s: float,
               stop: threading.Event, lane: Lane | None = None, at: int = 0) -> Fetched:
    """GET `url` on `lane`'s connections (None: a lane of its own, closed after; redirects followed, the credentials
    only to the registry's own origin) and stream a 200's body into `into` from offset `at` (created if absent; never
    more than `size` bytes written there: a longer body shows without spilling past the blob's place; `kept` says the
    bytes there are the blob's). The whole blob must come `within_s` (a registry that trickles is cut, not waited on),
    and `stop` (set by a cancelled caller) ends the read within POLL_S. Network failures raise OSError (an HTTP
    protocol error or a bad redirect as ConnectionError, a cut as TimeoutError), naming what failed."""
    where, own = url, lane is None
    try:
        lane = lane or Lane(url)
        lane.bind(Bound(time.monotonic() + within_s, stop,
                        TimeoutError(f"blob {digest} did not arrive within {within_s:.0f} s"),
                        ConnectionAbortedError(f"blob {digest}: its pull was cancelled")))
        for _ in range(REDIRECTS + 1):
            connection = lane.to(url)  # a redirect's address that does not parse fails here: named below
            home = connection is lane.registry
            headers = {"Authorization": authorization} if authorization and home else {}
            parts = urlsplit(url)
            status, answered = connection.exchange("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                                                   headers)
            if status in (301, 302, 303, 307, 308) and answered.get("location"):
                connection.body(0, _DRAIN)
                where = answered["location"]
                url = urljoin(url, where)
                continue
            if status != 200:
                body = connection.body(_ERROR_BODY, _DRAIN)
                return Fetched(status, body, 0, False, answered.get("www-authenticate", "") if status == 401 else "")
            read, matches = _stream(connection, (into, at), digest, size)
            return Fetched(200, b"", read, matches)
        raise ConnectionError(f"more than {REDIRECTS} redirects for blob {digest}")
    except (ValueError, UnicodeError) as exc:  # e.g. a redirect to `http://[::1/x`: named, not an internal error
        raise ConnectionError(f"blob {digest}: the registry sent it to {where!r}: {exc}") from exc
    finally:
        if own and lane is not None:
            lane.close()


def _stream(connection: Connection, into: tuple[Path, int], digest: str, size: int) -> tuple[int, bool]:
    """The body into its place (`into`: a file and an offset), hashed on the way, at most `size` + 1 bytes read and
    `size` written (no fsync: the files are fsynced once, whole)."""
    hasher, read, begun = hashlib.sha256(), 0, 0  # begun: the bytes whose writeback has been started
    fd = os.open(into[0], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        for piece in connection.stream(size + 1):
            hasher.update(piece)
            keep, written = piece[:max(0, size - read)], 0  # never past the blob's place
            while written < len(keep):
                written += os.pwrite(fd, keep[written:], into[1] + read + written)
            read += len(piece)
            if min(read, size) - begun >= PIECE:  # a socket read is ~64 KiB: the writeback started per PIECE
                _write_back(fd, into[1] + begun, min(read, size) - begun)
                begun = min(read, size)
        _write_back(fd, into[1] + begun, min(read, size) - begun)
    finally:
        os.close(fd)
    return read, not connection.truncated and read == size and "sha256:" + hasher.hexdigest() == digest


def _write_back(fd: int, offset: int, length: int) -> None:
    """Start writing the piece to the disk now (Linux: FADV_DONTNEED starts the range's writeback, then drops what is
    clean): the files are fsynced once, when whole, and without this every byte of a 10 GB pull would wait in the
    page cache (dirty_ratio of a large host's memory) until that fsync, the disk idle while the link runs."""
    if length:
        with contextlib.suppress(OSError):  # not a file (the null device a checked-only fetch writes to)
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

"""One registry blob fetched in a worker thread, for a capture's pull (``_capture_registry.py``): the body is streamed
into its place in the capture's partial files (``store_pull.py``) and hashed on the way; it counts only if it is
exactly the blob's bytes (the files are fsynced once, whole, before they are named).

Why a thread with the standard library's HTTP client and not aiohttp on the daemon's event loop: a pull reads
its chunks several at once, and on the loop every body byte goes through the one loop thread (and was then copied
whole into a 64 MiB ``bytes``). Measured on the 2-core machine, 8 chunks of 64 MiB at once from the registry on
127.0.0.1: 0.22 GB/s received on the loop, 0.54 GB/s with a thread each (socket reads, SHA-256 and file writes
release the GIL, so the threads spread over a machine's cores).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urljoin, urlsplit

__all__ = ("IDLE_S", "Fetched", "connect", "fetch_blob", "origin")

PIECE = 8 << 20  # bytes read, hashed and written at a time
IDLE_S = 30.0  # a connect, or one read, that waits longer than this is a silent registry
REDIRECTS = 5  # a registry may send a blob's GET to its storage (a CDN, a bucket): followed this many times
_ERROR_BODY = 4096  # what a refusal's body is read for its message


class Fetched(NamedTuple):
    """What a GET gave: its status, a refusal's first bytes, and for a 200 the bytes read (at most the blob's size
    + 1: a longer body shows without being read whole) and whether they were the blob's (then it is kept)."""

    status: int
    body: bytes
    read: int
    kept: bool


def connect(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.netloc, timeout=timeout, context=ssl.create_default_context())
    return http.client.HTTPConnection(parts.netloc, timeout=timeout)


def origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


def fetch_blob(url: str, *, authorization: str, digest: str, size: int, into: Path, within_s: float,
               stop: threading.Event, at: int = 0) -> Fetched:
    """GET `url` (redirects followed; the credentials go only to the registry's own origin) and stream a 200's body
    into `into` from offset `at` (created if absent; never more than `size` bytes written there: a longer body shows
    without spilling past the blob's place; `kept` says the bytes there are the blob's). The whole blob must
    come `within_s` (a registry that trickles is cut, not waited on), and `stop` (set by a cancelled caller) ends
    the read at the next piece. Network failures raise OSError (an HTTP protocol error or a bad redirect as
    ConnectionError, a cut as TimeoutError), naming what failed."""
    home, deadline = origin(url), time.monotonic() + within_s
    for _ in range(REDIRECTS + 1):
        where = url  # what the last redirect named, for a failure's message
        connection: http.client.HTTPConnection | None = None
        try:
            connection = connect(url, IDLE_S)  # a redirect's bad port fails here: named below
            headers = {"Authorization": authorization} if authorization and origin(url) == home else {}
            parts = urlsplit(url)
            connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers)
            response = connection.getresponse()
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                where = response.getheader("Location", "")
                url = urljoin(url, where)
                continue
            if response.status != 200:
                return Fetched(response.status, response.read(_ERROR_BODY), 0, False)
            read, matches = _stream(response, (into, at), digest, size,
                                    lambda: _cut(digest, within_s, deadline, stop))
            return Fetched(200, b"", read, matches)
        except http.client.HTTPException as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
        except (ValueError, UnicodeError) as exc:  # e.g. a redirect to `http://[::1/x`: named, not an internal error
            raise ConnectionError(f"blob {digest}: the registry sent it to {where!r}: {exc}") from exc
        finally:
            if connection is not None:
                connection.close()
    raise ConnectionError(f"more than {REDIRECTS} redirects for blob {digest}")


def _cut(digest: str, within_s: float, deadline: float, stop: threading.Event) -> None:
    if stop.is_set():
        raise ConnectionAbortedError(f"blob {digest}: its pull was cancelled")
    if time.monotonic() > deadline:
        raise TimeoutError(f"blob {digest} did not arrive within {within_s:.0f} s")


def _stream(response: http.client.HTTPResponse, into: tuple[Path, int], digest: str, size: int,
            check: Callable[[], None]) -> tuple[int, bool]:
    """The body into its place (`into`: a file and an offset), hashed on the way, at most `size` + 1 bytes read and
    `size` written. `check` runs before each piece (it raises to cut the read)."""
    hasher, read = hashlib.sha256(), 0
    fd = os.open(into[0], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        while read <= size:
            check()
            # read1: what one socket read gives (readinto would wait to fill the whole piece, and a registry
            # that trickles would never reach the check)
            if not (piece := response.read1(min(PIECE, size + 1 - read))):
                break
            hasher.update(piece)
            keep, written = memoryview(piece)[:max(0, size - read)], 0  # never past the blob's place
            while written < len(keep):
                written += os.pwrite(fd, keep[written:], into[1] + read + written)
            _write_back(fd, into[1] + read, written)
            read += len(piece)
    except http.client.IncompleteRead:  # the body ended before its Content-Length: a truncated blob
        return read, False
    finally:
        os.close(fd)
    return read, read == size and "sha256:" + hasher.hexdigest() == digest


def _write_back(fd: int, offset: int, length: int) -> None:
    """Start writing the piece to the disk now (Linux: FADV_DONTNEED starts the range's writeback, then drops what is
    clean): the files are fsynced once, when whole, and without this every byte of a 10 GB pull would wait in the
    page cache (dirty_ratio of a large host's memory) until that fsync, the disk idle while the link runs."""
    if length:
        with contextlib.suppress(OSError):  # not a file (the null device a checked-only fetch writes to)
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

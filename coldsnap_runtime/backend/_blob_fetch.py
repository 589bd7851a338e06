"""One registry blob fetched in a worker thread, for a capture's pull (``_capture_registry.py``): the body is streamed
into a temporary file of the node's store and hashed on the way, then kept (fsynced) only if it is exactly the
blob's bytes.

Why a thread with the standard library's HTTP client and not aiohttp on the daemon's event loop: a pull reads
its chunks several at once, and on the loop every body byte goes through the one loop thread (and was then copied
whole into a 64 MiB ``bytes``). Measured on the 2-core machine, 8 chunks of 64 MiB at once from the registry on
127.0.0.1: 0.22 GB/s received on the loop, 0.54 GB/s with a thread each (socket reads, SHA-256 and file writes
release the GIL, so the threads spread over a machine's cores).
"""

from __future__ import annotations

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
               stop: threading.Event) -> Fetched:
    """GET `url` (redirects followed; the credentials go only to the registry's own origin) and stream a 200's body
    into `into` (created here; the caller names it when `kept`, and removes it in any case). The whole blob must
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
            read, matches = _stream(response, into, digest, size, lambda: _cut(digest, within_s, deadline, stop))
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


def _stream(response: http.client.HTTPResponse, into: Path, digest: str, size: int,
            check: Callable[[], None]) -> tuple[int, bool]:
    """The body into `into`, hashed on the way, at most `size` + 1 bytes; fsynced only when it is the blob.
    `check` runs before each piece (it raises to cut the read)."""
    hasher, read = hashlib.sha256(), 0
    with open(into, "xb") as out:
        try:
            while read <= size:
                check()
                # read1: what one socket read gives (readinto would wait to fill the whole piece, and a registry
                # that trickles would never reach the check)
                if not (piece := response.read1(min(PIECE, size + 1 - read))):
                    break
                hasher.update(piece)
                out.write(piece)
                read += len(piece)
        except http.client.IncompleteRead:  # the body ended before its Content-Length: a truncated blob
            return read, False
        matches = read == size and "sha256:" + hasher.hexdigest() == digest
        if matches:
            out.flush()
            os.fsync(out.fileno())
    return read, matches

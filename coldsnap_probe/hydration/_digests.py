"""The digests of weight regions and device dumps, per 64 MiB chunk (no CUDA): `region_digest` (``sha256-64m:``, a
content address) and `crc_digest` (``crc32-64m:``, the interposer's fast dump digest; interposer/digest.c computes
both in C, constants.h's twins are checked by tests/probe/test_interposer_constants.py).

A module of its own, apart from the weights' regions and manifest (`_weights.py`): a restore worker checks the
interposer's dump records before CRIU with these shapes alone, without the memory contracts' types (issue 35
item 2).
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

from ..errors import HydrationError

__all__ = ("CRC_PREFIX", "DIGEST_CHUNK", "DIGEST_PREFIX", "chunk_digests", "combine_digests", "crc_digest",
           "digest_like", "is_dump_digest", "is_region_digest", "region_digest")

DIGEST_CHUNK = 64 << 20
DIGEST_PREFIX = "sha256-64m:"
CRC_PREFIX = "crc32-64m:"  # the interposer's fast dump digest (interposer/crc32.c computes it in C)


def _sha256(data: memoryview) -> bytes:
    import hashlib  # here: OpenSSL's load (3-4 ms) is off a restore's path to CRIU (issue 35 item 2)
    return hashlib.sha256(data).digest()


def _crc32(data: memoryview) -> bytes:
    return zlib.crc32(data).to_bytes(4, "big")  # zlib lets go of the GIL over large buffers, as hashlib does


def chunk_digests(path: str | Path, offset: int, size: int, *, threads: int = 0, crc: bool = False) -> list[bytes]:
    """SHA-256 (with `crc`: CRC-32, 4 bytes big-endian) of each 64 MiB chunk of the region, computed by
    parallel threads over a shared mapping."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        have = os.fstat(fd).st_size
        if have < offset + size:
            raise HydrationError(f"source {path} is truncated: {have} bytes, the region needs {offset + size}")
        if size == 0:
            return []
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        view = mmap.mmap(fd, offset + size - base, mmap.MAP_SHARED, mmap.PROT_READ, offset=base)
    finally:
        os.close(fd)
    try:
        memory = memoryview(view)
        end = offset - base + size

        chunk = _crc32 if crc else _sha256

        def one(start: int) -> bytes:
            return chunk(memory[start:min(start + DIGEST_CHUNK, end)])

        from concurrent.futures import ThreadPoolExecutor  # only here: off a restore's path to CRIU (issue 35)

        with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1)) as pool:
            parts = list(pool.map(one, range(offset - base, end, DIGEST_CHUNK)))
        memory.release()
    finally:
        view.close()
    return parts


def combine_digests(parts: Sequence[bytes]) -> str:
    """The region digest from its chunk digests (so a region that is a 64 MiB-aligned prefix reuses them)."""
    import hashlib  # here: OpenSSL's load (3-4 ms) is off a restore's path to CRIU (issue 35 item 2)
    return DIGEST_PREFIX + hashlib.sha256(b"".join(parts)).hexdigest()


def is_region_digest(text: str) -> bool:
    """Shaped as `region_digest` writes it: DIGEST_PREFIX and 64 characters (a weight region's, a dump segment's)."""
    return text.startswith(DIGEST_PREFIX) and len(text) == len(DIGEST_PREFIX) + 64


def region_digest(path: str | Path, offset: int, size: int, *, threads: int = 0) -> str:
    """``sha256-64m:`` + SHA-256 of the concatenated SHA-256 of each 64 MiB chunk of the region (parallel)."""
    return combine_digests(chunk_digests(path, offset, size, threads=threads))


def crc_digest(path: str | Path, offset: int, size: int, *, threads: int = 0) -> str:
    """``crc32-64m:`` + each 64 MiB chunk's CRC-32 (zlib's), 8 hex digits a chunk, in order: the interposer's
    dump digest on the release's critical path; it finds corruption and says which chunk, it is no content
    address (a publisher computes `region_digest` for that)."""
    return CRC_PREFIX + "".join(part.hex() for part in chunk_digests(path, offset, size, threads=threads, crc=True))


def is_dump_digest(text: str, size: int) -> bool:
    """Shaped as a device dump segment's digest of `size` bytes: `region_digest`'s or `crc_digest`'s."""
    chunks = -(-size // DIGEST_CHUNK)
    return is_region_digest(text) or (text.startswith(CRC_PREFIX) and len(text) == len(CRC_PREFIX) + 8 * chunks
                                      and all(c in "0123456789abcdef" for c in text[len(CRC_PREFIX):]))


def digest_like(expected: str, path: str | Path, offset: int, size: int) -> str:
    """The region's digest of the kind `expected` is (by its prefix): what a check compares it with."""
    return (crc_digest if expected.startswith(CRC_PREFIX) else region_digest)(path, offset, size)

"""The copy engine's choice of reads that needs no GPU: whether a source is mostly absent from the page cache (a
store's dump file after a pull or a cache drop), which decides O_DIRECT for a staged dump. Real files on the
real page cache (ext4 under tmp_path; tmpfs holds every page, so it always counts as cached)."""

from __future__ import annotations

import os
from pathlib import Path

from coldsnap_probe.hydration._copy import mostly_uncached

MIB = 1 << 20


def written(path: Path, size: int) -> int:
    """A file of random bytes, fsynced (so that its pages can be dropped), opened read-only."""
    with path.open("wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    return os.open(path, os.O_RDONLY)


def test_a_file_dropped_from_the_page_cache_is_mostly_uncached_and_cached_once_read(tmp_path: Path) -> None:
    fd = written(tmp_path / "dump.bin", 16 * MIB)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert mostly_uncached(fd)
        assert mostly_uncached(fd), "judging it must not read it into the cache"
        while os.read(fd, 4 * MIB):
            pass
        assert not mostly_uncached(fd)
    finally:
        os.close(fd)


def test_a_file_whose_first_quarter_alone_is_cached_is_still_mostly_uncached(tmp_path: Path) -> None:
    fd = written(tmp_path / "dump.bin", 16 * MIB)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly the pages read are cached
        os.pread(fd, 4 * MIB, 0)
        assert mostly_uncached(fd)
        os.pread(fd, 8 * MIB, 4 * MIB)
        assert not mostly_uncached(fd)  # three quarters cached: read through the cache, which holds them
    finally:
        os.close(fd)


def test_an_empty_file_and_a_tmpfs_file_count_as_cached(tmp_path: Path) -> None:
    empty = os.open(tmp_path / "empty", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert not mostly_uncached(empty)
    finally:
        os.close(empty)
    shm = Path("/dev/shm") / f"cs-copy-test-{os.getpid()}"
    try:
        fd = written(shm, 4 * MIB)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # tmpfs keeps its pages: they are the file
            assert not mostly_uncached(fd)
        finally:
            os.close(fd)
    finally:
        shm.unlink(missing_ok=True)

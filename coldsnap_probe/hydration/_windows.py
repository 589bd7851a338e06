"""Registered windows: how a stage that misses the RAM tier reads a dump's files without a CPU copy
(`_copy.Registered`, the reader; this module is what it needs without CUDA). The runs of each file a stage reads
are cut into windows (`plan_windows`); each window is mapped (MAP_SHARED, read-only, from the descriptor the peer
opened: `map_window`) and page-locked where it lies (cuMemHostRegister, the RAM tier's `_vmm.Mapped`), its DMA
reads the page cache's own pages, and it is unlocked and unmapped once its DMA is done: no reader thread copies a
byte into a staging buffer (the ring, `_copy.Pread`, copies every byte once on the CPU: 24-38 GB/s out of tmpfs
on the H200, against ~54 GB/s for the link from page-locked memory).

Where it pays is the filesystem's page size: page-locking costs per page. A page-cache file of ext4 (large folios)
pinned 8 GiB in 0.18 s on the H200 (~47 GB/s), a tmpfs of 4 KiB pages 2.6 s (~3.3 GB/s: slower than the ring), a
`huge=always` tmpfs has 2 MiB pages. So `ring_reason` sends a file on a tmpfs of small pages to the ring before
anything is pinned, and the reader times each window it pins: one slower than MIN_PIN_RATE sends the rest of its
filesystem's windows to the ring too (a filesystem not recognised here is decided by that measurement alone). A
window not wholly in the page cache (`in_page_cache`: a cold disk, issue 34) goes to the ring as well: the pinning
would fault it in from the disk a page at a time, where the ring's 16 readers read in parallel.

Faults (a dump file is the peer's own: it may truncate it while the hydrator reads it): nothing here reads a
mapping with the CPU, so no SIGBUS can reach the hydrator, which serves every tenant. A window is mapped only
within the size the descriptor has then (`map_window`); the kernel faults its pages in for cuMemHostRegister
(get_user_pages), which answers a page beyond the file's end (a truncation since) with an error, not a signal: the
window then goes to the ring, whose read of it ends short and fails the stage cleanly. A page already pinned stays
the DMA's after a truncation (the bytes as they were); the reader checks the files' sizes after its copy
(`check_whole`), as the ring's short read does. Every copy is at least a DUMP_ALIGN piece (2 MiB), never one small
enough for the driver to inline through the CPU.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ..errors import HydrationError
from ._peer_files import Runs, merge_runs
from ._vmm import Mapped

__all__ = ("MIN_PIN_RATE", "PIN_THREADS", "WINDOW", "Window", "check_whole", "in_page_cache", "map_window",
           "plan_windows", "ring_reason", "slow_pin")

WINDOW = 512 << 20  # bytes of a file pinned at once: large enough for the link, small enough to pipeline
PIN_THREADS = 4  # windows pinned at once (each thread: one being pinned while its previous one's DMA runs)
# A window pinned slower than this (bytes a second, one thread) sends its filesystem to the ring: PIN_THREADS of
# them pinning at once then feed the link no faster than the ring's reader threads (24-38 GB/s on the H200).
MIN_PIN_RATE = 8e9
_MEASURED = 32 << 20  # a window smaller than this is not timed (the driver call's fixed cost would decide)
_PAGE = 4096
_TMPFS_MAGIC = 0x01021994
_HUGE = ("huge=always", "huge=within_size")  # "advise" is huge only where the writer asked (the release does not)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


_Copy = tuple[int, str, int, int]  # dst, source, offset, size: a `_copy.Piece` (that module imports this one)


class Window(NamedTuple):
    """The copies of `pieces` (all of one file, `source`) from the runs `runs` of it, page-locked together."""

    source: str
    runs: Runs
    pieces: tuple[_Copy, ...]


def plan_windows(pieces: Sequence[_Copy], window: int) -> list[Window]:
    """The pieces (dst, source, offset, size: none of ZEROS) cut at the file offsets that are multiples of `window`
    and grouped into one window per (file, multiple of `window`), in the order their files first appear; each
    window's runs page-aligned (a start rounded down, an end up: the caller's mapping covers the pages)."""
    if window <= 0 or window % _PAGE:
        raise HydrationError(f"a window must be a positive multiple of {_PAGE} bytes, not {window}")
    grouped: dict[tuple[str, int], list[_Copy]] = {}
    for dst, source, offset, size in pieces:
        at = offset
        while at < offset + size:
            end = min(offset + size, (at // window + 1) * window)
            grouped.setdefault((source, at // window), []).append((dst + at - offset, source, at, end - at))
            at = end
    order = {source: index for index, source in enumerate(dict.fromkeys(p[1] for p in pieces))}
    windows = []
    for (source, _index), found in sorted(grouped.items(), key=lambda item: (order[item[0][0]], item[0][1])):
        runs = merge_runs((offset - offset % _PAGE, -(-(offset + size) // _PAGE) * _PAGE - offset + offset % _PAGE)
                          for _dst, _source, offset, size in found)
        windows.append(Window(source, runs, tuple(found)))
    return windows


def map_window(fd: int, window: Window) -> Mapped:
    """`window`'s file (open as `fd`) mapped read-only and shared, only within the size the descriptor has now
    (a run's last page ends there: never a page beyond the file, whose touch would be a SIGBUS), not yet pinned;
    a file shorter than its runs is a HydrationError naming it."""
    size = os.fstat(fd).st_size
    if size < (read := max(offset + n for _dst, _source, offset, n in window.pieces)):
        raise HydrationError(f"source {window.source} holds {size} bytes: its stage reads to {read}")
    runs = tuple((offset, min(n, size - offset)) for offset, n in window.runs if offset < size)
    return Mapped(window.source, fd=fd, length=runs[-1][0] + runs[-1][1], ranges=runs)


def ring_reason(fd: int) -> str:
    """Why the file open as `fd` is read through the ring without trying to pin it ("" to try): it lives on a
    tmpfs whose pages are 4 KiB (pinning 8 GiB of them took 2.6 s on the H200). A tmpfs is of huge pages when its
    mount says `huge=always` or `huge=within_size` (this process's mountinfo, which holds the bind mount the file
    was opened through), or the node forces them (`shmem_enabled`); a tmpfs mounted out of this view is
    left to the timing."""
    buffer = ctypes.create_string_buffer(256)  # struct statfs (120 bytes on x86-64 and arm64): f_type first
    if _libc.fstatfs(fd, buffer) != 0 or ctypes.c_long.from_buffer(buffer).value != _TMPFS_MAGIC:
        return ""
    forced = _shmem_forced()
    if forced:
        return "" if forced == "force" else "tmpfs of 4 KiB pages (huge pages denied on this node)"
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as lines:
            options = [line.split(" - ", 1)[1].split() for line in lines
                       if line.split()[2:3] == [device] and " - " in line]
    except OSError:
        return ""
    if not options:
        return ""  # not in this view: the first window's timing decides
    if any(option in _HUGE for fields in options for option in fields[-1].split(",")):
        return ""
    return "tmpfs of 4 KiB pages"


def _shmem_forced() -> str:
    """`force` or `deny` when the node overrides every tmpfs's huge= option, else ""."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled", encoding="ascii") as setting:
            chosen = setting.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return ""
    return chosen if chosen in ("force", "deny") else ""


def in_page_cache(mapped: Mapped) -> bool:
    """Whether every page of `mapped`'s ranges is in the page cache (mincore: the kernel's answer, no page touched).
    One that is not would be read from the disk by the pinning's page faults, a page at a time, where the ring's
    16 readers read it in parallel (a cold disk: issue 34): such a window goes to the ring."""
    for offset, n in mapped.ranges:
        pages = -(-n // _PAGE)
        vector = ctypes.create_string_buffer(pages)
        if _libc.mincore(mapped.address + offset, n, vector) != 0:
            return False  # ENOMEM: a page beyond the file's end now (truncated): the ring says so
        if vector.raw.translate(None, bytes(range(1, 256, 2))) != b"":  # a byte with bit 0 clear: not resident
            return False
    return True


def slow_pin(size: int, seconds: float) -> str:
    """Why a window of `size` bytes pinned in `seconds` sends its filesystem to the ring ("" when it does not): a
    rate below MIN_PIN_RATE; a window too small to say (the driver call's own cost) is not judged."""
    if size < _MEASURED or size >= MIN_PIN_RATE * seconds:
        return ""
    return f"pinned at {size / seconds / 1e9:.1f} GB/s (below {MIN_PIN_RATE / 1e9:.0f}): the ring is faster"


def check_whole(opened: Mapping[str, int], ends: Mapping[str, int]) -> None:
    """After a copy from pinned windows: each file still holds the bytes it was read to (`ends`), as the ring's
    short read would have found; a file truncated meanwhile is a HydrationError naming it."""
    for source, end in sorted(ends.items()):
        if (size := os.fstat(opened[source]).st_size) < end:
            raise HydrationError(f"source {source} ended at {size} while its stage read to {end}")

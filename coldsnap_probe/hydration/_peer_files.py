"""What a node hydrator's peer may have read: the permission rule (`readable_by`), a file opened as the peer
could open it (`open_readable`), and a `stage-dump` request's parts (`dump_layout`, `open_dump_parts`).

The hydrator runs as root for peers that may not be: it hands out a file's bytes only to a peer that could read
the file itself, and it copies from descriptors it opened after the checks, never from what a path names later.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from .. import jsonline
from ..errors import HydrationError
from ._weights import WeightRegion

__all__ = ("DUMP_ALIGN", "STAGE_ALLOCATIONS", "DumpLayout", "dump_layout", "open_dump_parts", "open_readable",
           "readable_by")

DUMP_ALIGN = 2 << 20  # a device dump's parts are whole VMM regions: multiples of the allocation granularity
# Allocations one stage-dump may create (one per released region): torch's caching allocator makes hundreds for
# an 8B model; the bound keeps a peer from asking for millions of driver objects (and as many descriptors).
STAGE_ALLOCATIONS = 4096
_PART_KEYS = frozenset({"file", "bytes", "region"})

DumpLayout = tuple[tuple[str, int, int], ...]  # (file as named, bytes, region index) per part, in order


def readable_by(path: str, st: os.stat_result, peer: jsonline.Peer, *, search: bool | None = None) -> bool:
    """Whether `peer` could open the file `path` (`st`: the held file's status) itself: read permission on
    it and search permission on every directory above it, as the kernel checks mode bits for one uid and
    gid. The hydrator hands out a source's bytes only to a peer that could read them anyway; a world-readable
    file in another tenant's 0700 directory is not readable by the others. With `search` given, only `st`
    itself is checked (search permission of a held directory, or read permission of a held file): the caller
    walked the path by descriptors."""
    if peer.uid == 0:
        return True
    if search is not None:
        return _permits(st, peer, *((stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH) if search else
                                    (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)))
    if not _permits(st, peer, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH):
        return False
    directory = os.path.dirname(path)
    while True:
        try:
            above = os.stat(directory)
        except OSError:
            return False
        if not _permits(above, peer, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
            return False
        if directory == os.path.dirname(directory):
            return True
        directory = os.path.dirname(directory)


def _permits(st: os.stat_result, peer: jsonline.Peer, user: int, group: int, other: int) -> bool:
    if st.st_uid == peer.uid:
        return bool(st.st_mode & user)
    if st.st_gid == peer.gid:
        return bool(st.st_mode & group)
    return bool(st.st_mode & other)


def open_readable(real: str, named: str, size: int, peer: jsonline.Peer) -> int:
    """Open `real` (a resolved absolute path) for reading as `peer` could: one component at a time, never
    following a link (a link there now was swapped in since `realpath`), each directory searchable by the peer
    and the file a regular one it may read, of at least `size` bytes; opened O_PATH first, so that no FIFO
    or device is ever opened for reading. The descriptor (O_RDONLY)."""
    names = [n for n in real.split("/") if n]
    if not names:
        raise HydrationError(f"dump file {named} is not a regular file of at least {size} bytes")
    path_flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    held = os.open("/", path_flags | os.O_DIRECTORY)
    try:
        for index, name in enumerate(names):
            if not readable_by("/", os.fstat(held), peer, search=True):
                raise HydrationError(f"peer uid {peer.uid} may not read {named}")
            flags = path_flags | (os.O_DIRECTORY if index < len(names) - 1 else 0)
            try:
                opened = os.open(name, flags, dir_fd=held)
            except OSError as exc:
                raise HydrationError(f"dump file {named}: {exc.strerror} (at {name})") from exc
            os.close(held)
            held = opened
        st = os.fstat(held)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise HydrationError(f"dump file {named} is not a regular file of at least {size} bytes")
        if not readable_by("/", st, peer, search=False):
            raise HydrationError(f"peer uid {peer.uid} may not read {named}")
        return os.open(f"/proc/self/fd/{held}", os.O_RDONLY | os.O_CLOEXEC)  # the same inode, for reading
    finally:
        os.close(held)


def dump_layout(value: Any) -> tuple[DumpLayout, tuple[int, ...]]:
    """A `stage-dump` (or its `adopt`) request's `parts`, checked without touching a file: each part is
    {file: an absolute path, bytes: a positive multiple of DUMP_ALIGN, region: its region's index}, the regions
    numbered from 0 in order (a part's region is its predecessor's or the next one), at most STAGE_ALLOCATIONS.
    The parts as given, and each region's size (the sum of its parts: one allocation each)."""
    if not isinstance(value, list) or not value:
        raise HydrationError("parts must be a non-empty list of {file, bytes, region}")
    layout: list[tuple[str, int, int]] = []
    sizes: list[int] = []
    for index, part in enumerate(value):
        if not isinstance(part, dict) or set(part) != _PART_KEYS or not isinstance(part["file"], str) \
                or not _whole(part["bytes"]) or part["bytes"] <= 0 or part["bytes"] % DUMP_ALIGN \
                or not os.path.isabs(part["file"]) or not _whole(part["region"]):
            raise HydrationError(f"parts[{index}] must be {{file: an absolute path, bytes: a positive multiple "
                                 f"of {DUMP_ALIGN}, region: an integer}}")
        region = part["region"]
        if region != len(sizes) - 1 and region != len(sizes):
            raise HydrationError(f"parts[{index}].region is {region}: regions are numbered from 0 in order, a "
                                 f"part's region is its predecessor's or the next ({max(len(sizes) - 1, 0)} or "
                                 f"{len(sizes)})")
        if region == len(sizes):
            if len(sizes) == STAGE_ALLOCATIONS:
                raise HydrationError(f"parts name more than {STAGE_ALLOCATIONS} regions (one allocation each)")
            sizes.append(0)
        sizes[region] += part["bytes"]
        layout.append((part["file"], part["bytes"], region))
    return tuple(layout), tuple(sizes)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def open_dump_parts(layout: DumpLayout, peer: jsonline.Peer) -> tuple[tuple[WeightRegion, ...], dict[str, int]]:
    """The parts of a checked `layout` as regions of the staged range (address: the offset in it; the regions'
    allocations are mapped back to back): each a whole regular file (not a link) `peer` could read, holding at
    least its bytes; and each file open (by resolved path), so that the copy reads the very file checked, not
    what the path names by then (the peer may own a directory on it and swap a symlink or a FIFO in)."""
    parts: list[WeightRegion] = []
    fds: dict[str, int] = {}
    at = 0
    try:
        for index, (named, size, _region) in enumerate(layout):
            # The directory resolved (links above the dump are the node's own), the file itself never a link:
            # the dump's directory belongs to the engine, which may plant one there.
            real = os.path.join(os.path.realpath(os.path.dirname(named)), os.path.basename(named))
            if real not in fds:
                fds[real] = open_readable(real, named, size, peer)
            elif os.fstat(fds[real]).st_size < size:
                raise HydrationError(f"dump file {named} is not a regular file of at least {size} bytes")
            parts.append(WeightRegion(f"part-{index}", at, size, real, 0, ""))
            at += size
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return tuple(parts), fds

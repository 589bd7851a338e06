"""What a node hydrator's peer may have read: the held sources a peer names (`held_sources`), and a `stage-dump`
request's parts (`dump_layout`, `open_dump_parts`).

The hydrator runs as root for peers that may not be: it hands out a file's bytes only to a peer that could read
the file itself, as the kernel decides in the peer's own view (`_peer_view.PeerView`: its root, its credentials),
and it copies from descriptors opened there, never from what a path names later.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import HydrationError
from ._digests import DIGEST_CHUNK
from ._peer_view import PeerView
from ._weights import WeightRegion

__all__ = ("DUMP_ALIGN", "STAGE_ALLOCATIONS", "DumpLayout", "Runs", "dump_layout", "dump_lengths", "dump_reads",
           "held_sources", "merge_runs", "open_dump_parts")

DUMP_ALIGN = 2 << 20  # a device dump's parts are whole VMM regions: multiples of the allocation granularity
# Allocations one stage-dump may create (one per released region): torch's caching allocator makes hundreds for
# an 8B model; the bound keeps a peer from asking for millions of driver objects (and as many descriptors).
STAGE_ALLOCATIONS = 4096
_PART_KEYS = frozenset({"file", "bytes", "region"})

# (file as named, bytes, region index, zero mask) per part, in order
DumpLayout = tuple[tuple[str, int, int, int], ...]
Runs = tuple[tuple[int, int], ...]  # (offset, bytes) of a file, in order, neither touching nor overlapping


def held_sources(view: PeerView, named: Iterable[str], held: Mapping[tuple[int, int], str]) -> dict[str, str]:
    """Each source path as `view`'s peer names it, mapped to the held source it is (`held`: (device, inode) of
    each file the hydrator holds, to its path here): opened as the peer could open it in its own view (links
    followed there, as the peer's own open would), so a path the peer cannot see or read is refused, and a path
    that names another file there than the one held here is not this hydrator's to serve."""
    fds = view.open([(path, 0) for path in sorted(set(named))], what="source", follow=True)
    try:
        found: dict[str, str] = {}
        for path, fd in fds.items():
            st = os.fstat(fd)
            if (real := held.get((st.st_dev, st.st_ino))) is None:
                raise HydrationError(f"this hydrator does not hold {path} (the file peer uid {view.peer.uid} sees "
                                     "there)")
            found[path] = real
        return found
    finally:
        for fd in fds.values():
            os.close(fd)


def dump_layout(value: Any) -> tuple[DumpLayout, tuple[int, ...]]:
    """A `stage-dump` (or its `adopt`) request's `parts`, checked without touching a file: each part is
    {file: an absolute path, bytes: a positive multiple of DUMP_ALIGN, region: its region's index, and optionally
    zero: the mask of the part's DIGEST_CHUNK chunks that are all zeros, the manifest's `zero`}, the regions
    numbered from 0 in order (a part's region is its predecessor's or the next one), at most STAGE_ALLOCATIONS.
    The parts as given, and each region's size (the sum of its parts: one allocation each). A chunk the mask marks
    is set on the device, never read: the stager's word for it, which can only cost its own engine its bytes."""
    if not isinstance(value, list) or not value:
        raise HydrationError("parts must be a non-empty list of {file, bytes, region}")
    layout: list[tuple[str, int, int, int]] = []
    sizes: list[int] = []
    for index, part in enumerate(value):
        if not isinstance(part, dict) or not _PART_KEYS <= set(part) <= _PART_KEYS | {"zero"} \
                or not isinstance(part["file"], str) \
                or not _whole(part["bytes"]) or part["bytes"] <= 0 or part["bytes"] % DUMP_ALIGN \
                or not os.path.isabs(part["file"]) or not _whole(part["region"]):
            raise HydrationError(f"parts[{index}] must be {{file: an absolute path, bytes: a positive multiple "
                                 f"of {DUMP_ALIGN}, region: an integer, optionally zero: a chunk mask}}")
        zero, chunks = part.get("zero", 0), -(-part["bytes"] // DIGEST_CHUNK)
        if not _whole(zero) or zero >> chunks:
            raise HydrationError(f"parts[{index}].zero must be a mask of the part's {chunks} chunks of "
                                 f"{DIGEST_CHUNK} bytes (a non-negative integer below {1 << chunks}), not {zero!r:.40}")
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
        layout.append((part["file"], part["bytes"], region, zero))
    return tuple(layout), tuple(sizes)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def dump_lengths(layout: DumpLayout) -> dict[str, int]:
    """Each file a layout names, to the bytes of it that its parts read (from its start: its largest part)."""
    needed: dict[str, int] = {}
    for named, size, _region, _zero in layout:
        needed[named] = max(needed.get(named, 0), size)
    return needed


def dump_reads(layout: DumpLayout) -> dict[str, Runs]:
    """Each file a layout names, to the runs of it that its parts read: every part's chunks but those its mask
    marks as zeros (set on the device, never read: the file's holes), merged over the parts naming the file."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for named, size, _region, zero in layout:
        spans.setdefault(named, []).extend(_unmasked(size, zero))
    return {named: merge_runs(found) for named, found in spans.items() if found}


def _unmasked(size: int, zero: int) -> Iterator[tuple[int, int]]:
    """The runs of a part of `size` bytes that `zero` does not mask, found from the mask's bits, never chunk by
    chunk: a part's bytes are the peer's word (a sparse file on a tmpfs may say exbibytes: 2**36 chunks would
    hold the hydrator's thread for days), its mask is bounded by the request's line."""
    chunks = -(-size // DIGEST_CHUNK)
    bits = format(zero, "b")[::-1][:chunks] + "0" * (chunks > zero.bit_length())  # "0": the read tail, if any
    for run in re.finditer("0+", bits):
        start = run.start() * DIGEST_CHUNK
        yield start, min(size, run.end() * DIGEST_CHUNK if run.end() < len(bits) else size) - start


def merge_runs(runs: Iterable[tuple[int, int]]) -> Runs:
    """(offset, bytes) runs sorted, those that touch or overlap made one."""
    merged: list[tuple[int, int]] = []
    for offset, n in sorted(runs):
        if merged and offset <= merged[-1][0] + merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][0] + merged[-1][1], offset + n) - merged[-1][0])
        else:
            merged.append((offset, n))
    return tuple(merged)


def open_dump_parts(layout: DumpLayout, view: PeerView) -> tuple[tuple[WeightRegion, ...], dict[str, int]]:
    """The parts of a checked `layout` as regions of the staged range (address: the offset in it; the regions'
    allocations are mapped back to back): each a whole regular file, not itself a link, that `view`'s peer could
    read in its own view, holding at least its bytes; each file opened once (PeerView.open), so that the copy
    reads the very file checked, not what the path names by then (the peer may own a directory on it and swap a
    symlink or a FIFO in)."""
    fds = view.open(list(dump_lengths(layout).items()), what="dump file", follow=False)
    parts: list[WeightRegion] = []
    at = 0
    for index, (named, size, _region, _zero) in enumerate(layout):
        parts.append(WeightRegion(f"part-{index}", at, size, named, 0, ""))
        at += size
    return tuple(parts), fds

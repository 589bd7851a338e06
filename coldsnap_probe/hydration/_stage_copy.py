"""A node hydrator's stage-dump copy (issue 35): the dump's pieces (`dump_pieces`) and the copies that fill one
stage at once (`at_once`): what the RAM tier holds pinned, by DMA from its mappings (`_copy.Pinned`), beside the rest
read from the files through the ring (`_copy.Pread`): a stage that joins a capture's warm still being loaded reads
only what the warm has not pinned yet, and never waits for it (`_ram_tier.Lease.split`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._copy import ZEROS, Piece, region_pieces, zero_split
from ._digests import DIGEST_CHUNK
from ._peer_files import DumpLayout
from ._vmm import cucall
from ._weights import WeightRegion

__all__ = ("at_once", "dump_pieces", "weights_pieces")

Copy = Callable[[int], object]  # a copy into the range mapped at its argument; done (nothing in flight) on return


def dump_pieces(parts: Sequence[WeightRegion], layout: DumpLayout, at: int) -> list[Piece]:
    """A stage-dump's copy, the staged range at `at`: each part's chunks of zeros (its layout's mask, from the
    manifest) set on the device, the rest read from its file."""
    return [piece for region, (_file, _bytes, _region, zero) in zip(region_pieces(parts, at), layout, strict=True)
            for piece in zero_split(region, zero, DIGEST_CHUNK)]


def weights_pieces(size: int, pieces: Sequence[Piece]) -> list[Piece]:
    """A weights stage's copy into its allocation of `size` bytes: `pieces` (of the held sources, neither
    overlapping), and every byte between them set on the device (ZEROS). Why: cuMemCreate's bytes are unspecified,
    and within the hydrator's one process they may be an earlier allocation's, another tenant's dump; the engine
    zeroes its discarded regions only after it adopted them, and the device tier keeps the whole allocation for
    every later stage of these weights, whatever its uid."""
    out: list[Piece] = []
    at = 0
    for piece in sorted(pieces):
        if piece.dst > at:
            out.append(Piece(at, ZEROS, 0, piece.dst - at))
        out.append(piece)
        at = max(at, piece.dst + piece.size)
    if size > at:
        out.append(Piece(at, ZEROS, 0, size - at))
    return out


def at_once(driver: Any, context: Any, copies: Sequence[Copy]) -> Copy:
    """`copies` into the same range at once, each but the last on a thread of its own (`context` made current
    there), the last on the caller's: done when all are (a failed one waits for the others: nothing of theirs
    is in flight once the caller unmaps the range; the first failure is raised); the last one's result."""
    def copy(va: int) -> object:
        failed: list[BaseException] = []

        def side(one: Copy) -> None:
            try:
                cucall(driver, "cuCtxSetCurrent", context)
                one(va)
            except BaseException as exc:  # raised on the caller's thread, below
                failed.append(exc)
        threads = [threading.Thread(target=side, args=(one,), name="coldsnap-stage-copy") for one in copies[:-1]]
        for thread in threads:
            thread.start()
        try:
            done = copies[-1](va) if copies else None
        finally:
            for thread in threads:
                thread.join()
        if failed:
            raise failed[0]
        return done
    return copy

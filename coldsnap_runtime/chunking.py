r"""Where a file's chunks end when its content shifts between captures: cut by content, at any byte.

CRIU writes a process's present pages in address order into ``pages-<n>.img``. Two captures of the same model
hold mostly the same bytes there, but at offsets that move by whatever lies before them (a heap a few pages
larger, a thread stack touched), and inside the heap by a few bytes (a string one byte longer moves every object
malloc places after it): chunks cut every 64 MiB from the file's start then share nothing. A chunk here ends just
after an *anchor*, two bytes that match :data:`ANCHOR` (one position in 2^16 of random bytes: 64 KiB apart on
average), never before :data:`MIN_BYTES`, always at :data:`MAX_BYTES`; a run of at least :data:`ZERO_RUN_BYTES` of
zeros is a chunk of its own (never stored, moved or read), from where the data before it is :data:`MIN_BYTES` long
(the zeros before that finish the data's chunk), so a file has at most two chunks per MIN_BYTES whatever its zeros.
The same bytes give the same cuts wherever they sit, so after a change the cuts fall in step again at the next
anchor. The regular expression engine finds the anchors
(C, ~1 GB/s on the 2-core machine): a rolling hash over every byte in Python would not keep up with a disk.

How long a chunk is on average sets what a changed page costs: a second capture of a restored server differs in a
few pages at hundreds of places, and each place makes the chunk around it new. The registry fixes the floor: a
capture's artifact manifest lists each distinct chunk (156 bytes) and a registry takes 4 MiB, so 3 GiB of page images
must average at least ~120 KiB a chunk *whatever their bytes*, which only MIN_BYTES guarantees (3 GiB / 128 KiB =
24,576 chunks, 3.8 MB). Within that bound the spread is what is left to choose: a chunk is MIN_BYTES plus the distance
to the next anchor, so anchors a little denser than MIN_BYTES cut ~190 KiB on average with little spread, where a
small minimum and sparse anchors of the same mean make more long chunks (a changed place most likely falls in one).
Anchors much denser than the shifts between captures lose step for long stretches (one in 256 bytes, ``\xa7``: 99 %
of a moved heap's chunks new), and so do cuts at MAX_BYTES, which follow no content: at 256 KiB (two anchor gaps past
MIN_BYTES) one shifted heap in ten cost 1.9 MiB of chunks before the cuts met again, at 512 KiB each cost 127 KiB (200
runs). MAX_BYTES also bounds the chunks of bytes without anchors (pointers, text): 512 KiB for a changed byte there,
not 4 MiB.

Measured (``bench/capture_pair.py --criu C --touch 135``): two CRIU captures of an engine-shaped process (1 GiB of the
same weights, 32 MiB of fresh state, a 200 MiB heap of seeded objects, 100 libraries; a 1.3 GB page image): the first,
then that capture restored, serving one request that writes 4 pages at 135 places of its heap and state (the H200's
second capture of a restored server: ~600 places per GiB), captured again; beside it a second run of the process (its
heap a few bytes apart). New MiB of the second's page image; the floor is its pages the first's lack (2.5 and 59.1):

    anchor, MIN / MAX KiB              chunks  mean KiB  restored + 1 request  another run
    \xa7\x3c[\x00-\x1f], 128 / 4096      2,038       651                 111.3         63.3   (before)
    \xa7\x3c[\x00-\x7f], 128 / 512       5,248       253                  47.0         60.8
    \xa7\x3c, 128 / 512                   6,833       194                  35.0         61.0   (kept)
    \xa7\x3c, 128 / 256                   7,184       185                  31.3         60.9
    \xa7[\x3c\x3d], 128 / 256             8,260       161                  28.4         60.4
    \xa7[\x38-\x3f], 128 / 256            9,666       137                  24.9         69.4
    \xa7, 128 / 256                       10,334       128                  23.0      1,287.0
    \xa7\x3c, 64 / 512 (over the bound)   10,163       131                  30.3         60.5
    \xa7\x3c, 32 / 256 (over the bound)   13,852        96                  24.8         60.2

``\xa7[\x3c\x3d]`` is denser but no literal: 64 MiB of 0xa7 bytes took 1.1 s to cut (``\xa7\x3c``: 147 ms).

What more chunks cost (``bench/store_push.py --mib 1024 --chunks-kib 651,194``: a 1 GiB page image through
docker-registry on 127.0.0.1, tmpfs, 8 at a time, this 2-core machine, where the registry itself takes 1.8 ms a HEAD,
4.6 ms an upload and 3.4 ms a GET of a 161 KiB blob with 8 keep-alive clients; one run, 2026-12-02):

    chunks    blobs  manifest MB  push s  pull s  push again s (HEAD only)
    651 KiB   1,612         0.25    14.5    12.0                       4.7
    194 KiB   5,407         0.84    39.3    26.8                      15.1

~5-7 ms a blob here, the registry's own share most of it: a first push and a pull of 1 GiB of page image take ~25 and
~15 s longer on this machine, a second push ~10 s more in HEADs; against that, a second capture's new bytes: ~60 MiB
fewer per GiB of page image in the CPU case above, ~500 MiB per GiB new before on the H200 (its own figures, push and
pull included: ``scripts/device store 16 second-restored``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ("ANCHOR", "CHUNK_BYTES", "CUT_MAX_BYTES", "MAX_BYTES", "MIN_BYTES", "PAGE_CUTS", "ZERO_RUN_BYTES", "Cuts",
           "content_cuts")

CHUNK_BYTES = 64 << 20  # the dumps' sha256-64m chunk: the largest blob, one unit of dedupe for fixed files
# 2^-16: bytes that are rare in pointers, text and zeros; a literal, which the engine finds fast whatever the bytes
# (64 MiB of 0xa7 bytes: 147 ms; ``\xa7[\x3c\x3d]``, twice as dense, took 1.1 s)
ANCHOR = re.compile(rb"\xa7\x3c")
MIN_BYTES = 128 << 10  # the bound on chunks per file, whatever its bytes (see above): never smaller
# Bytes that hold no anchor for long (a pattern, text) are cut every MAX_BYTES, never one 64 MiB chunk that a
# single changed byte makes new.
MAX_BYTES = 512 << 10  # > MIN_BYTES + 5 anchor gaps: few cuts follow no content
# A capture's page images are cut by content up to this many bytes in all; the rest keep 64 MiB chunks. Anchors cut
# at most size / MIN_BYTES + 1 data chunks per file (24,576 at 3 GiB: 3.8 MB of artifact manifest, 156 bytes each,
# against the 4 MiB a registry takes; ~2.3 MB of data document, 81 bytes a data chunk and 12 a zero one); a page
# image is ~1.1 GB beside 9 GB of device memory (16 layers), ~2 GB at the 8B shape. The bound is the capture's, not
# a file's: two 3 GiB page images of one capture cut by content would list ~49,000 chunks. A run of zeros ends a
# data chunk only once it is MIN_BYTES long: a few bytes then 64 KiB of zeros, again and again, made a chunk per
# 64 KiB before (review13: 4,095 stored chunks per 255 MiB, ~7 MB of manifest at 3 GiB).
CUT_MAX_BYTES = 3 << 30
ZERO_RUN_BYTES = 64 << 10  # shorter runs of zeros stay inside their chunk
_ZERO_RUN = bytes(ZERO_RUN_BYTES)
_NONZERO = re.compile(rb"[^\x00]")


class Cuts(NamedTuple):
    """How a file is cut by content: its anchors (each `anchor_bytes` long, two never overlapping) and the bounds on
    a data chunk's length (bench/capture_pair.py compares others)."""

    anchor: re.Pattern[bytes]
    anchor_bytes: int
    min_bytes: int
    max_bytes: int


PAGE_CUTS = Cuts(ANCHOR, 2, MIN_BYTES, MAX_BYTES)  # CRIU's page images

def _zero_runs(data: bytes | bytearray) -> list[tuple[int, int]]:
    """Each run of at least ZERO_RUN_BYTES zeros in `data`: (start, end)."""
    runs, at = [], 0
    while (start := data.find(_ZERO_RUN, at)) >= 0:
        end = _zeros_end(data, start + ZERO_RUN_BYTES)
        runs.append((start, end))
        at = end
    return runs


def _zeros_end(data: bytes | bytearray, at: int) -> int:
    """Where the zeros from `at` end: compared ZERO_RUN_BYTES at a time (memcmp), the regular expression engine only
    within the last piece. It scans zeros at 70 MB/s holding the GIL: ~1 s of a 64 MiB window of zeros, the daemon's
    event loop stopped meanwhile (review13)."""
    while at + ZERO_RUN_BYTES <= len(data) and data[at:at + ZERO_RUN_BYTES] == _ZERO_RUN:
        at += ZERO_RUN_BYTES
    end = min(at + ZERO_RUN_BYTES, len(data))
    after = _NONZERO.search(data, at, end)
    return after.start() if after else end


def _next_anchor(data: bytes | bytearray, at: int, end: int, cuts: Cuts) -> int | None:
    """The end of the first anchor in `data[at:end]`, looked for max_bytes at a time: one search call holds the GIL
    (bytes without anchors: 88 ms per 64 MiB, 264 ms of 0xa7 bytes)."""
    while at < end:
        step = min(at + cuts.max_bytes, end)
        if found := cuts.anchor.search(data, at, step):
            return found.end()
        at = step - (cuts.anchor_bytes - 1)  # an anchor across the step's end is found by the next
        if step == end:
            return None
    return None


def content_cuts(data: bytes | bytearray, *, final: bool, cuts: Cuts = PAGE_CUTS) -> list[tuple[int, bool]]:
    """The chunks at the start of `data`, in order: (length, all zeros). Without `final`, what the bytes after
    `data` could still change is left out (the last chunk, anchors and zeros within ZERO_RUN_BYTES of the end): it
    is seen again, with what follows, at the next call, so the cuts never depend on how the file was read. A caller
    that is not at the end passes more than CHUNK_BYTES + 2 * ZERO_RUN_BYTES, so each call ends at least one chunk."""
    size, start = len(data), 0
    least, most = cuts.min_bytes, cuts.max_bytes
    pieces: list[tuple[int, bool]] = []
    limit = size if final else size - ZERO_RUN_BYTES  # past it, a run of zeros could start unseen
    at = 0  # where the next anchor is looked for
    for run_start, run_end in [*_zero_runs(data), (size, size)]:
        # Only an anchor min_bytes past the chunk's start can end it: those before are never looked at, so bytes
        # made of anchors cost a search per chunk, not a Python object per anchor (793 MiB and 19 s a window).
        while (anchor := _next_anchor(data, max(at, start + least - cuts.anchor_bytes), min(run_start, limit), cuts)):
            at = anchor
            start = _up_to(pieces, start, at, cuts)
        if run_start == size and not final:  # the data to the window's end may go on: only certain max_bytes pieces
            while limit - start > most:
                pieces.append((most, False))
                start += most
            return pieces
        if run_start < size:
            while run_start - start > most:  # as `_up_to` cuts them: certain whatever the run does
                pieces.append((most, False))
                start += most
            # A run of zeros ends the data before it only once that is min_bytes long (zeros finish it): a few bytes
            # between runs, again and again, are a chunk per min_bytes, never one per run (review of issue 34, item 2).
            zeros = max(run_start, start + least) if run_start > start else run_start
            if run_end - zeros < ZERO_RUN_BYTES:  # what is left of the run stays in the chunk, as a short run does
                if run_end == size and not final:  # unless more zeros follow: seen again at the next call
                    return pieces
                continue
            run_start = zeros
        start = _up_to(pieces, start, run_start, cuts, cut=True)
        while run_end - start > (0 if final or run_end < size else CHUNK_BYTES + ZERO_RUN_BYTES - 1):
            n = min(CHUNK_BYTES, run_end - start)  # a run reaching the window's end keeps at least ZERO_RUN_BYTES
            pieces.append((n, True))
            start += n
        if start < run_end:
            return pieces
    return pieces


def _up_to(pieces: list[tuple[int, bool]], start: int, end: int, cuts: Cuts, *, cut: bool = False) -> int:
    """Data chunks from `start` to a cut at `end` (an anchor: only once min_bytes are reached; `cut`: always),
    max_bytes at most each; where the next chunk starts."""
    while end - start > cuts.max_bytes:
        pieces.append((cuts.max_bytes, False))
        start += cuts.max_bytes
    if end > start and (cut or end - start >= cuts.min_bytes):
        pieces.append((end - start, False))
        return end
    return start

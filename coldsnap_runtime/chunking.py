"""Where a file's chunks end when its content shifts between captures: cut by content, at any byte.

CRIU writes a process's present pages in address order into ``pages-<n>.img``. Two captures of the same model
hold mostly the same bytes there, but at offsets that move by whatever lies before them (a heap a few pages
larger, a thread stack touched), and inside the heap by a few bytes (a string one byte longer moves every object
malloc places after it): chunks cut every 64 MiB from the file's start then share nothing. A chunk here ends just
after an *anchor*, three bytes that match :data:`ANCHOR` (one position in 2^19 of random bytes: 512 KiB apart on
average), never before :data:`MIN_BYTES`, always at :data:`MAX_BYTES`; a run of at least :data:`ZERO_RUN_BYTES` of
zeros is a chunk of its own (never stored, moved or read), from where the data before it is :data:`MIN_BYTES` long
(the zeros before that finish the data's chunk), so a file has at most two chunks per MIN_BYTES whatever its zeros.
The same bytes give the same cuts wherever they sit, so after a change the cuts fall in step again at the next
anchor. The regular expression engine finds the anchors
(C, ~1 GB/s on the 2-core machine): a rolling hash over every byte in Python would not keep up with a disk.

Measured (bench/capture_pair.py; two CRIU captures of two runs of an engine-shaped process: 1 GiB of the same
weights, 32 MiB of fresh state, a 200 MiB heap of seeded objects, 100 libraries; 1.3 GB of page image; the runs'
heaps a few bytes apart): of the second capture's page image, 100 % of its 64 MiB chunks were new, 21 % of its
pages (cutting at page boundaries by content cannot do better: 21.1 %), 4.9 % of its chunks cut at anchors.
"""

from __future__ import annotations

import re

__all__ = ("ANCHOR", "CHUNK_BYTES", "CUT_MAX_FILE_BYTES", "MAX_BYTES", "MIN_BYTES", "ZERO_RUN_BYTES",
           "content_cuts")

CHUNK_BYTES = 64 << 20  # the dumps' sha256-64m chunk: the largest blob, one unit of dedupe for fixed files
ANCHOR = re.compile(rb"\xa7\x3c[\x00-\x1f]")  # 2^-16 * 2^-3: bytes that are rare in pointers, text and zeros
MIN_BYTES = 128 << 10
# Bytes that hold no anchor for long (a pattern, text) are cut every MAX_BYTES, never one 64 MiB chunk that a
# single changed byte makes new.
MAX_BYTES = 4 << 20
# A larger file keeps 64 MiB chunks: anchors cut at most size / MIN_BYTES chunks (24,576 at 3 GiB, ~3.2 MB of artifact
# manifest against the 4 MiB a registry takes); a page image is ~2 GB at 16 GiB of device memory, the device dump the
# rest. A run of zeros ends a data chunk only once it is MIN_BYTES long: a few bytes then 64 KiB of zeros, again and
# again, made a chunk per 64 KiB before (review13: 4,095 stored chunks per 255 MiB, ~7 MB of manifest at 3 GiB).
CUT_MAX_FILE_BYTES = 3 << 30
ZERO_RUN_BYTES = 64 << 10  # shorter runs of zeros stay inside their chunk
_ZERO_RUN = bytes(ZERO_RUN_BYTES)
_NONZERO = re.compile(rb"[^\x00]")
_ANCHOR_BYTES = 3  # every match of ANCHOR; two never overlap


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


def _next_anchor(data: bytes | bytearray, at: int, end: int) -> int | None:
    """The end of the first anchor in `data[at:end]`, looked for MAX_BYTES at a time: one search call holds the GIL
    (bytes without anchors: 88 ms per 64 MiB, 264 ms of 0xa7 bytes)."""
    while at < end:
        step = min(at + MAX_BYTES, end)
        if found := ANCHOR.search(data, at, step):
            return found.end()
        at = step - (_ANCHOR_BYTES - 1)  # an anchor across the step's end is found by the next
        if step == end:
            return None
    return None


def content_cuts(data: bytes | bytearray, *, final: bool) -> list[tuple[int, bool]]:
    """The chunks at the start of `data`, in order: (length, all zeros). Without `final`, what the bytes after
    `data` could still change is left out (the last chunk, anchors and zeros within ZERO_RUN_BYTES of the end): it
    is seen again, with what follows, at the next call, so the cuts never depend on how the file was read. A caller
    that is not at the end passes more than CHUNK_BYTES + 2 * ZERO_RUN_BYTES, so each call ends at least one chunk."""
    size, start = len(data), 0
    pieces: list[tuple[int, bool]] = []
    limit = size if final else size - ZERO_RUN_BYTES  # past it, a run of zeros could start unseen
    at = 0  # where the next anchor is looked for
    for run_start, run_end in [*_zero_runs(data), (size, size)]:
        # Only an anchor MIN_BYTES past the chunk's start can end it: those before are never looked at, so bytes
        # made of anchors cost a search per chunk, not a Python object per 3 bytes (793 MiB and 19 s a window).
        while (anchor := _next_anchor(data, max(at, start + MIN_BYTES - _ANCHOR_BYTES), min(run_start, limit))):
            at = anchor
            start = _up_to(pieces, start, at)
        if run_start == size and not final:  # the data to the window's end may go on: only certain MAX_BYTES pieces
            while limit - start > MAX_BYTES:
                pieces.append((MAX_BYTES, False))
                start += MAX_BYTES
            return pieces
        if run_start < size:
            while run_start - start > MAX_BYTES:  # as `_up_to` cuts them: certain whatever the run does
                pieces.append((MAX_BYTES, False))
                start += MAX_BYTES
            # A run of zeros ends the data before it only once that is MIN_BYTES long (zeros finish it): a few bytes
            # between runs, again and again, are a chunk per MIN_BYTES, never one per run (review of issue 34, item 2).
            zeros = max(run_start, start + MIN_BYTES) if run_start > start else run_start
            if run_end - zeros < ZERO_RUN_BYTES:  # what is left of the run stays in the chunk, as a short run does
                if run_end == size and not final:  # unless more zeros follow: seen again at the next call
                    return pieces
                continue
            run_start = zeros
        start = _up_to(pieces, start, run_start, cut=True)
        while run_end - start > (0 if final or run_end < size else CHUNK_BYTES + ZERO_RUN_BYTES - 1):
            n = min(CHUNK_BYTES, run_end - start)  # a run reaching the window's end keeps at least ZERO_RUN_BYTES
            pieces.append((n, True))
            start += n
        if start < run_end:
            return pieces
    return pieces


def _up_to(pieces: list[tuple[int, bool]], start: int, end: int, *, cut: bool = False) -> int:
    """Data chunks from `start` to a cut at `end` (an anchor: only once MIN_BYTES are reached; `cut`: always),
    MAX_BYTES at most each; where the next chunk starts."""
    while end - start > MAX_BYTES:
        pieces.append((MAX_BYTES, False))
        start += MAX_BYTES
    if end > start and (cut or end - start >= MIN_BYTES):
        pieces.append((end - start, False))
        return end
    return start

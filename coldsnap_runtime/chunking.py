"""Where a file's chunks end when its content shifts between captures: cut by content, at page boundaries.

CRIU writes a process's present pages in address order into ``pages-<n>.img``. Two captures of the same model
hold mostly the same pages there, but at offsets that move by whatever lies before them (a heap a few pages
larger, a thread stack touched): chunks cut every 64 MiB from the file's start then share nothing. Measured on
two CRIU captures of two runs of an engine-shaped process (bench/engine_shape_target.py: 1 GiB of the same
weights, 32 MiB of fresh state, a 200 MiB Python heap, 100 libraries; 1.3 GB of page image, 4.5 % of its pages
new): 100 % of the second capture's 64 MiB chunks were new. Cut by content, 11.0 % at 1 MiB on average, 4.9 % at
512 KiB, 4.7 % at 256 KiB, 4.6 % at 128 KiB: what changes between runs (relocated library data, the heap's
pointers, the state) is spread over the non-weight pages, so a chunk much larger than that spacing is new
whatever its cut; 512 KiB is within 0.4 % of the pages' own share with a quarter of 128 KiB's blobs.

The rule sees only whole pages (a shift in a page image is whole pages): a chunk ends after a page whose CRC-32
has its low bits zero (one page in :data:`AVERAGE_PAGES`), never before :data:`MIN_BYTES`, always at
:data:`CHUNK_BYTES` (one registry blob, as before). A run of at least :data:`ZERO_RUN_PAGES` pages of zeros is
a chunk of its own (never stored, moved or read), so zero-skipping is as good as with fixed chunks. The same
pages give the same cuts wherever they sit, so after a change the cuts fall in step again within a chunk or two.
"""

from __future__ import annotations

import zlib

__all__ = ("AVERAGE_PAGES", "CHUNK_BYTES", "CUT_MAX_FILE_BYTES", "MIN_BYTES", "PAGE", "ZERO_RUN_PAGES", "content_cuts")

CHUNK_BYTES = 64 << 20  # the dumps' sha256-64m chunk: the largest blob, one unit of dedupe for fixed files
PAGE = 4096
AVERAGE_PAGES = 128  # 512 KiB on average (above: the share new by the average's size)
MIN_BYTES = 128 << 10
# A larger file keeps 64 MiB chunks: 8 GiB is ~16,000 chunks, ~2 MiB of artifact manifest, half the 4 MiB a registry
# takes (a page image is a few GB at 64 GiB of device memory: the device dump is the large part).
CUT_MAX_FILE_BYTES = 8 << 30
ZERO_RUN_PAGES = 16  # 64 KiB of zeros: shorter runs stay inside their chunk
_MASK = AVERAGE_PAGES - 1
_ZERO_PAGE = bytes(PAGE)
_ZERO_CRC = zlib.crc32(_ZERO_PAGE)


def content_cuts(view: memoryview, *, final: bool) -> list[tuple[int, bool]]:
    """The chunks at the start of `view`, in order: (length, all zeros). Without `final`, the last chunk (not yet
    ended by a cut) is left out: its bytes are seen again, with what follows, at the next call."""
    pieces: list[tuple[int, bool]] = []
    size, start, at, zeros, zero_chunk = len(view), 0, 0, 0, False
    while at < size:
        end = min(at + PAGE, size)
        if end - at < PAGE and not final:
            break  # a partial page: the rest comes with the next read
        page = view[at:end]
        crc = zlib.crc32(page)
        is_zero = end - at == PAGE and crc == _ZERO_CRC and bytes(page) == _ZERO_PAGE
        at = end
        if zero_chunk:
            if is_zero and at - start <= CHUNK_BYTES:
                continue
            pieces.append((at - PAGE - start, True))  # the zero run ended before this page (or filled a chunk)
            start, zeros, zero_chunk = at - PAGE, 0, False
        zeros = zeros + 1 if is_zero else 0
        if zeros == ZERO_RUN_PAGES:  # a run of zeros: the data before it is a chunk, the run another
            run_start = at - ZERO_RUN_PAGES * PAGE
            if run_start > start:
                pieces.append((run_start - start, False))
            start, zero_chunk = run_start, True
        elif at - start >= CHUNK_BYTES or (at - start >= MIN_BYTES and not crc & _MASK):
            pieces.append((at - start, False))
            start, zeros = at, 0
    if final and start < size:
        pieces.append((size - start, zero_chunk))
    return pieces

"""How fast this machine fills fresh anonymous memory from a tmpfs file (the work of a CRIU restore), and writes
files there (the work of the interposer's release).

    python bench/page_fill.py [--gib 1.5] [--dir /dev/shm] [--out DIR]

CRIU's restorer reads each process's pages with `preadv` from the images into freshly mapped anonymous
memory: page faults, zeroing and the copy, on one thread per process. This measures the same thing
outside CRIU: one thread and several (each its own slice), with 4 KiB pages (`MADV_NOHUGEPAGE`) and with
transparent huge pages (`MADV_HUGEPAGE`); and, for reference, the copy into memory already faulted in.
Best of 3; a table on stdout, JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table


def fill(fd: int, size: int, threads: int, advice: int, prefault: bool) -> float:
    """Seconds to preadv `size` bytes into a fresh anonymous mapping, split over `threads`."""
    area = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(advice)
        if prefault:
            area.write(bytes(size))  # every page present: what is left is the copy
        view = memoryview(area)
        step = -(-size // threads // mmap.PAGESIZE) * mmap.PAGESIZE

        def one(start: int) -> None:
            end = min(size, start + step)
            done = start
            while done < end:
                got = os.preadv(fd, [view[done:end]], done)
                if got == 0:
                    raise EOFError(f"the source ended at {done} bytes")
                done += got

        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, size, step)))
        seconds = time.perf_counter() - started
        view.release()
        return seconds
    finally:
        area.close()


def write(directory: str, size: int, threads: int) -> float:
    """Seconds for `threads` threads to write `size` bytes in all into files of their own in `directory` (4 MiB
    writes): the work of the interposer's release, which writes one file per segment. The files are removed."""
    block = os.urandom(4 << 20)
    step = -(-size // threads // len(block)) * len(block)
    paths = [Path(directory, f"coldsnap-write-ceiling-{os.getpid()}-{n}.bin") for n in range(threads)]

    def one(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for offset in range(0, step, len(block)):
                os.pwrite(fd, block, offset)
        finally:
            os.close(fd)

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, paths))
        return time.perf_counter() - started
    finally:
        for path in paths:
            path.unlink(missing_ok=True)


def ceilings(directory: str, size: int, threads: int) -> dict[str, float]:
    """GB/s, best of 3, with `threads` threads over `size` bytes in `directory`: writing files (the release's
    dump), and filling fresh anonymous memory from a file with 4 KiB pages and with huge pages (a restore)."""
    rates = {f"write x{threads}": size / min(write(directory, size, threads) for _ in range(3)) / 1e9}
    with tempfile.NamedTemporaryFile(dir=directory) as source:
        chunk = os.urandom(64 << 20)
        for start in range(0, size, len(chunk)):
            source.write(chunk[:size - start])
        source.flush()
        for pages, advice in (("4 KiB", mmap.MADV_NOHUGEPAGE), ("THP", mmap.MADV_HUGEPAGE)):
            best = min(fill(source.fileno(), size, threads, advice, False) for _ in range(3))
            rates[f"fill {pages} x{threads}"] = size / best / 1e9
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // mmap.PAGESIZE * mmap.PAGESIZE
    with tempfile.NamedTemporaryFile(dir=args.dir) as source:
        chunk = os.urandom(64 << 20)
        for start in range(0, size, len(chunk)):
            source.write(chunk[:size - start])
        source.flush()
        rows, results = [], []
        for pages, advice in (("4 KiB", mmap.MADV_NOHUGEPAGE), ("huge (THP)", mmap.MADV_HUGEPAGE)):
            for threads, prefault in ((1, False), (4, False), (16, False), (1, True)):
                best = min(fill(source.fileno(), size, threads, advice, prefault) for _ in range(3))
                results.append({"pages": pages, "threads": threads, "prefaulted": prefault, "seconds": best,
                                "gbps": size / best / 1e9})
                rows.append([pages, threads, "yes" if prefault else "no", f"{best:.3f}", f"{size / best / 1e9:.1f}"])
    for threads in (1, 4, 16):
        best = min(write(args.dir, size, threads) for _ in range(3))
        results.append({"write": True, "threads": threads, "seconds": best, "gbps": size / best / 1e9})
        rows.append(["(writing files)", threads, "-", f"{best:.3f}", f"{size / best / 1e9:.1f}"])
    print(f"{size / 1e9:.2f} GB from {args.dir}")
    print(table(["pages", "threads", "already faulted in", "seconds", "GB/s"], rows))
    if args.out:
        Path(args.out, "page_fill.json").write_text(json.dumps({"bytes": size, "runs": results}, indent=1))


if __name__ == "__main__":
    main()

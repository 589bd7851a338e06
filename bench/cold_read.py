"""A capture store's files read with a cold page cache (issue 34 item 2): the ways side by side, in one run.

    python bench/cold_read.py [--dir /var/tmp] [--mib 4096] [--threads 16] [--out FILE.json]

A capture of `--mib` MiB of random bytes goes into a real `CaptureStore` on `--dir`'s disk (as image-build puts
it there), then each row runs after the page cache is dropped (root):

1. the capture's files made from its chunks (`CaptureStore.tree`: what workload-run does on a capture's first use);
2. the tree's file read through the page cache by one thread (how CRIU and `cat` read);
3. read through the page cache by `--threads` readers of 8 MiB (the node hydrator's stage-dump ring);
4. read with O_DIRECT by `--threads` readers of 8 MiB into aligned buffers (measured, and rejected for the ring:
   slower on the disks measured, CPU and H200 machines alike);
5. the disk's own rates: O_DIRECT by one reader (`capsule_transfer.direct_read_gbps`), O_DIRECT writes.

Each row says the seconds, the rate and the share of the file the page cache holds afterwards: bytes read once and
kept there are memory the restored engine does not get, and a second copy of bytes the GPU already holds. The ring
here is the hydrator's (`_hydrator.DUMP_THREADS` readers of `DUMP_CHUNK`) without the device: the bytes land in
aligned host buffers (mmap) instead of page-locked ones.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import drop_caches, table
from coldsnap_probe.hydration import DUMP_CHUNK, DUMP_THREADS
from coldsnap_runtime.store import CaptureData, CaptureStore, artifact_manifest

ALIGN = 4096
SAMPLES = 256  # pages the cached share is judged by


def cached_share(path: Path) -> float:
    """The share of `path`'s pages in the page cache, by SAMPLES one-byte RWF_NOWAIT reads spread over it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size, probe, hits = os.fstat(fd).st_size, bytearray(1), 0
        for k in range(SAMPLES):
            try:
                os.preadv(fd, [probe], size * k // SAMPLES, os.RWF_NOWAIT)
                hits += 1
            except BlockingIOError:
                pass
        return hits / SAMPLES
    finally:
        os.close(fd)


def write_direct(path: Path, size: int, chunk: int = 8 << 20) -> float:
    """The disk's O_DIRECT write rate (GB/s): `size` bytes of random data from one aligned buffer, then fsync."""
    buffer = mmap.mmap(-1, chunk)
    buffer.write(os.urandom(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    started = time.perf_counter()
    try:
        for _ in range(size // chunk):
            os.write(fd, buffer)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size // chunk * chunk / (time.perf_counter() - started) / 1e9


def read_parallel(path: Path, *, threads: int = DUMP_THREADS, chunk: int = DUMP_CHUNK, direct: bool) -> float:
    """`threads` readers of `chunk` bytes each (every thread its own stripe of chunks, as the hydrator's ring),
    through the page cache or with O_DIRECT into aligned buffers; GB/s."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))

    def reader(worker: int) -> int:
        buffer, got = mmap.mmap(-1, chunk + ALIGN), 0
        for offset in range(worker * chunk, size, threads * chunk):
            length = -(-min(chunk, size - offset) // ALIGN) * ALIGN
            got += os.preadv(fd, [memoryview(buffer)[:length]], offset)
        return got

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(reader, range(threads)))
    finally:
        os.close(fd)
    if total != size:
        raise SystemExit(f"{path}: read {total} of {size} bytes")
    return size / (time.perf_counter() - started) / 1e9


def read_one_thread(path: Path, chunk: int = 1 << 20) -> float:
    """One reader through the page cache, 1 MiB at a time; GB/s."""
    buffer, size = bytearray(chunk), path.stat().st_size
    started = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return size / (time.perf_counter() - started) / 1e9


def store_capture(store: CaptureStore, work: Path, mib: int) -> tuple[str, Path]:
    """A capture of `mib` MiB of random bytes in `store`; its id and its file in the made tree's place."""
    source = work / "pages.img"
    with source.open("wb") as out:
        for _ in range(mib // 8):
            out.write(os.urandom(8 << 20))
    with source.open("rb") as data:
        stored = store.ingest("images/pages.img", source.stat().st_size, 0o644, data)
    source.unlink()
    document = json.dumps({"files": [{"path": stored.path, "size": stored.size, "mode": stored.mode,
                                      "chunks": stored.chunks}], "format": 1}, sort_keys=True).encode()
    capture = store.record(artifact_manifest(document, CaptureData(files=[stored]).files), document)
    return capture, store.root / "trees" / capture.removeprefix("sha256:") / stored.path


def rows_for(store: CaptureStore, capture: str, tree_file: Path, threads: int) -> list[tuple[str, float, float]]:
    """(way, GB/s, cached share after) for each way, each from a cold page cache."""
    rows = []
    if not drop_caches():
        raise SystemExit("dropping the page cache needs root")
    started = time.perf_counter()
    store.tree(capture)
    size = tree_file.stat().st_size
    rows.append(("files made from the chunks (CaptureStore.tree, workload-run's first use)",
                 size / (time.perf_counter() - started) / 1e9, cached_share(tree_file)))
    ways = [("read through the page cache, 1 thread (CRIU, cat)", lambda: read_one_thread(tree_file)),
            (f"read through the page cache, {threads} readers x 8 MiB (the stage ring)",
             lambda: read_parallel(tree_file, threads=threads, direct=False)),
            (f"read with O_DIRECT, {threads} readers x 8 MiB (rejected)",
             lambda: read_parallel(tree_file, threads=threads, direct=True)),
            ("disk: O_DIRECT, 1 reader x 8 MiB", lambda: read_parallel(tree_file, threads=1, direct=True))]
    for name, way in ways:
        drop_caches()
        rate = way()
        rows.append((name, rate, cached_share(tree_file)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="on the disk to measure (not tmpfs)")
    parser.add_argument("--mib", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=DUMP_THREADS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cs-cold-read-", dir=args.dir))
    try:
        store = CaptureStore(work / "store")
        store.open()
        capture, tree_file = store_capture(store, work, args.mib)
        rows = rows_for(store, capture, tree_file, args.threads)
        write = write_direct(work / "write.bin", min(args.mib, 4096) << 20)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows.append(("disk: O_DIRECT write, 1 writer x 8 MiB, fsync", write, 0.0))
    print(f"capture: {args.mib} MiB of random bytes, store on {args.dir} ({os.cpu_count()} CPUs)")
    print(table(["way (page cache dropped before each)", "GB/s", "page cache holds after"],
                [[name, f"{rate:.3f}", f"{share:.0%}"] for name, rate, share in rows]))
    if args.out:
        args.out.write_text(json.dumps({"mib": args.mib, "threads": args.threads,
                                        "rows": [{"way": n, "gbps": r, "cached_share": s} for n, r, s in rows]},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()

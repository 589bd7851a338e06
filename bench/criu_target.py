"""A process for CRIU to dump and restore that checks its own memory afterwards (bench and tests).

    python bench/criu_target.py --dir DIR --mib 512 [--seed 7] [--thp-mib 64] [--nothp-mib 16] [--shared-mib 16]
                                [--file-mib 8] [--repeat] [--fork]

It maps `--mib` MiB of private anonymous memory filled with distinct pseudo-random pages (a stream seeded
with `--seed`), and optionally a region advised `MADV_HUGEPAGE`, one advised `MADV_NOHUGEPAGE`, a `MAP_SHARED`
anonymous region and a private mapping of a file in DIR with half of its pages overwritten. Then it writes
DIR/regions.json (each region's address and length) and DIR/ready (its pid) and waits. Each time DIR/verify
appears it regenerates every region's expected bytes from the seed, compares, removes DIR/verify and writes
DIR/result (JSON: `ok`, the bytes checked, the regions that differ). DIR/exit ends it. With `--fork` a child
(its pid in DIR/child) shares all of it copy-on-write and answers DIR/child-verify with DIR/child-result.
Standard library only: the GPU machine runs it with its own Python.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20
MIB = 1 << 20


REPEAT = False  # --repeat: one seeded 64 MiB block over and over (fast to make at 16 GiB; for the benchmark)


def stream(seed: int, size: int) -> Iterator[bytes]:
    """`size` bytes of the seeded stream, a MiB at a time."""
    rng = random.Random(seed)
    block = rng.randbytes(64 * MIB) if REPEAT else b""
    left = size
    while left:
        n = min(CHUNK, left)
        if REPEAT:
            at = (size - left) % len(block)
            yield block[at:at + n]
        else:
            yield rng.randbytes(n)
        left -= n


def fill(area: mmap.mmap, seed: int, start: int = 0, size: int | None = None) -> None:
    off = start
    for block in stream(seed, size if size is not None else len(area) - start):
        area[off:off + len(block)] = block
        off += len(block)


def differs(area: mmap.mmap, seed: int, start: int = 0, size: int | None = None) -> bool:
    off = start
    for block in stream(seed, size if size is not None else len(area) - start):
        if area[off:off + len(block)] != block:
            return True
        off += len(block)
    return False


def regions(args: argparse.Namespace, workdir: Path) -> dict[str, tuple[mmap.mmap, int, int, int]]:
    """name -> (mapping, seed, first checked byte, checked bytes), filled."""
    out: dict[str, tuple[mmap.mmap, int, int, int]] = {}
    private = mmap.mmap(-1, args.mib * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fill(private, args.seed)
    out["private"] = (private, args.seed, 0, len(private))
    if args.thp_mib:
        thp = mmap.mmap(-1, args.thp_mib * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        thp.madvise(mmap.MADV_HUGEPAGE)
        fill(thp, args.seed + 1)
        out["thp"] = (thp, args.seed + 1, 0, len(thp))
    if args.nothp_mib:
        nothp = mmap.mmap(-1, args.nothp_mib * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        nothp.madvise(mmap.MADV_NOHUGEPAGE)
        fill(nothp, args.seed + 5)
        out["nothp"] = (nothp, args.seed + 5, 0, len(nothp))
    if args.shared_mib:
        shared = mmap.mmap(-1, args.shared_mib * MIB, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        fill(shared, args.seed + 2)
        out["shared"] = (shared, args.seed + 2, 0, len(shared))
    if args.file_mib:
        path = workdir / "mapped.bin"
        size = args.file_mib * MIB
        with path.open("wb") as f:
            for block in stream(args.seed + 3, size):
                f.write(block)
        with path.open("r+b") as f:
            mapped = mmap.mmap(f.fileno(), size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        fill(mapped, args.seed + 4, size // 2, size // 2)  # dirty private copies of the upper half
        out["file-clean"] = (mapped, args.seed + 3, 0, size // 2)
        out["file-dirty"] = (mapped, args.seed + 4, size // 2, size // 2)
    return out


def address(area: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(area))


def verify(found: dict[str, tuple[mmap.mmap, int, int, int]]) -> dict[str, object]:
    bad = [name for name, (area, seed, start, size) in found.items() if differs(area, seed, start, size)]
    return {"ok": not bad, "bad": bad, "bytes": sum(size for _, _, _, size in found.values()), "pid": os.getpid()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--thp-mib", type=int, default=0)
    parser.add_argument("--nothp-mib", type=int, default=0)
    parser.add_argument("--shared-mib", type=int, default=0)
    parser.add_argument("--file-mib", type=int, default=0)
    parser.add_argument("--repeat", action="store_true")
    parser.add_argument("--fork", action="store_true")
    args = parser.parse_args()
    global REPEAT
    REPEAT = args.repeat
    workdir = Path(args.dir)
    found = regions(args, workdir)
    spans = {name: [address(area) + start, size] for name, (area, _, start, size) in found.items()}
    (workdir / "regions.json").write_text(json.dumps(spans))
    child = os.fork() if args.fork else -1
    if child == 0:
        serve(workdir, found, "child-")
        os._exit(0)
    if child > 0:
        (workdir / "child").write_text(str(child))
    (workdir / "ready").write_text(str(os.getpid()))
    serve(workdir, found, "")
    if child > 0:
        os.waitpid(child, 0)
    sys.exit(0)


def serve(workdir: Path, found: dict[str, tuple[mmap.mmap, int, int, int]], prefix: str) -> None:
    """Answers DIR/<prefix>verify with DIR/<prefix>result until DIR/exit appears."""
    while not (workdir / "exit").exists():
        if (workdir / f"{prefix}verify").exists():
            result = json.dumps(verify(found))
            (workdir / f"{prefix}verify").unlink()
            (workdir / f"{prefix}result.tmp").write_text(result)
            os.replace(workdir / f"{prefix}result.tmp", workdir / f"{prefix}result")
        time.sleep(0.05)


if __name__ == "__main__":
    main()

"""A process for CRIU to dump and restore that checks its own memory afterwards (bench and tests).

    python bench/criu_target.py --dir DIR --mib 512 [--seed 7] [--thp-mib 64] [--nothp-mib 16] [--shared-mib 16]
                                [--file-mib 8] [--zero-mib 16] [--repeat] [--fork] [--threads 0] [--libs 0]

It maps `--mib` MiB of private anonymous memory filled with distinct pseudo-random pages (a stream seeded
with `--seed`), and optionally a region advised `MADV_HUGEPAGE`, one advised `MADV_NOHUGEPAGE`, a `MAP_SHARED`
anonymous region and a private mapping of a file in DIR with half of its pages overwritten. Then it writes
DIR/regions.json (each region's address and length) and DIR/ready (its pid) and waits. Each time DIR/verify
appears it regenerates every region's expected bytes from the seed, compares, removes DIR/verify and writes
DIR/result (JSON: `ok`, the bytes checked, the regions that differ). DIR/exit ends it. With `--fork` a child
(its pid in DIR/child) shares all of it copy-on-write and answers DIR/child-verify with DIR/child-result.
With `--zero-mib` pages written with zeros (what a dump that leaves out pages of zeros must bring back as
zeros): a private region of that size about 60 % zeros (single pages, runs, whole MiBs, and pages of zeros
but for one byte), the same pattern over the file mapping's dirty half (a private page of zeros over the
file's data), and with `--fork` pages of the private region that the child, and others that the parent,
overwrite with zeros after the fork (each then holds zeros where the other still holds data).
With `--threads N` N more threads wait in it and with `--libs N` it loads up to N of its Python's extension
libraries (each a few mappings): the shape of a server's process for CRIU (bench/criu_dump_threads.py).
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
import sysconfig
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

CHUNK = 1 << 20
MIB = 1 << 20
PAGE = 4096


@dataclass(frozen=True)
class Zeros:
    """Pages of a region overwritten with zeros after it was filled, per MiB of it: the pages `pages` (0 to 255),
    the pages `almost` but for one byte (page -> offset of a byte 1: a page of zeros must be told from one that
    differs late), and every MiB whose index modulo `every` is `whole` entirely (`every` 0: none)."""
    pages: frozenset[int] = frozenset()
    almost: tuple[tuple[int, int], ...] = ()
    every: int = 0
    whole: int = 0

    def apply(self, block: bytes, mib: int) -> bytes:
        """`block` (the region's MiB number `mib`, or its start) as it reads after the zeros were written."""
        if self.every and mib % self.every == self.whole:
            return bytes(len(block))
        out = bytearray(block)
        for page in self.pages:
            out[page * PAGE:(page + 1) * PAGE] = bytes(len(out[page * PAGE:(page + 1) * PAGE]))
        for page, at in self.almost:
            if (page + 1) * PAGE <= len(out):
                out[page * PAGE:(page + 1) * PAGE] = bytes(PAGE)
                out[page * PAGE + at] = 1
        return bytes(out)

    def write(self, area: mmap.mmap, start: int, size: int) -> None:
        """Overwrites the pages this pattern names in area[start:start + size] (present pages, written)."""
        for mib, off in enumerate(range(start, start + size, MIB)):
            end = min(off + MIB, start + size)
            area[off:end] = self.apply(area[off:end], mib)


NO_ZEROS = Zeros()
REGION_ZEROS = Zeros(frozenset({1, 4, 5, *range(128, 256)}), ((2, PAGE - 1), (3, PAGE // 2)), 4, 3)
CHILD_ZEROS = Zeros(frozenset({7, 8}), (), 8, 5)  # zeroed by the child over data its parent keeps
PARENT_ZEROS = Zeros(frozenset({9}), (), 8, 6)  # and by the parent over data its child keeps


@dataclass(frozen=True)
class Region:
    """A mapping, the seed of its bytes, the checked part of it and the pages written with zeros after the fill."""
    area: mmap.mmap
    seed: int
    start: int
    size: int
    zeros: Zeros = NO_ZEROS


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


def differs(region: Region) -> bool:
    off = region.start
    for mib, block in enumerate(stream(region.seed, region.size)):
        if region.area[off:off + len(block)] != region.zeros.apply(block, mib):
            return True
        off += len(block)
    return False


def regions(args: argparse.Namespace, workdir: Path) -> dict[str, Region]:
    """name -> its region, filled."""
    out: dict[str, Region] = {}
    private = mmap.mmap(-1, args.mib * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fill(private, args.seed)
    out["private"] = Region(private, args.seed, 0, len(private))
    if args.thp_mib:
        thp = mmap.mmap(-1, args.thp_mib * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        thp.madvise(mmap.MADV_HUGEPAGE)
        fill(thp, args.seed + 1)
        out["thp"] = Region(thp, args.seed + 1, 0, len(thp))
    if args.nothp_mib:
        nothp = mmap.mmap(-1, args.nothp_mib * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        nothp.madvise(mmap.MADV_NOHUGEPAGE)
        fill(nothp, args.seed + 5)
        out["nothp"] = Region(nothp, args.seed + 5, 0, len(nothp))
    if args.shared_mib:
        shared = mmap.mmap(-1, args.shared_mib * MIB, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        fill(shared, args.seed + 2)
        out["shared"] = Region(shared, args.seed + 2, 0, len(shared))
    if args.zero_mib:
        zeros = mmap.mmap(-1, args.zero_mib * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        fill(zeros, args.seed + 6)
        REGION_ZEROS.write(zeros, 0, len(zeros))
        out["zeros"] = Region(zeros, args.seed + 6, 0, len(zeros), REGION_ZEROS)
    if args.file_mib:
        path = workdir / "mapped.bin"
        size = args.file_mib * MIB
        with path.open("wb") as f:
            for block in stream(args.seed + 3, size):
                f.write(block)
        with path.open("r+b") as f:
            mapped = mmap.mmap(f.fileno(), size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        fill(mapped, args.seed + 4, size // 2, size // 2)  # dirty private copies of the upper half
        dirty = REGION_ZEROS if args.zero_mib else NO_ZEROS  # private pages of zeros over the file's data
        dirty.write(mapped, size // 2, size // 2)
        out["file-clean"] = Region(mapped, args.seed + 3, 0, size // 2)
        out["file-dirty"] = Region(mapped, args.seed + 4, size // 2, size // 2, dirty)
    return out


def address(area: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(area))


def verify(found: dict[str, Region]) -> dict[str, object]:
    bad = [name for name, region in found.items() if differs(region)]
    return {"ok": not bad, "bad": bad, "bytes": sum(r.size for r in found.values()), "pid": os.getpid()}


def server_shape(threads: int, libs: int) -> list[ctypes.CDLL]:
    """`threads` threads that wait (a server's pool) and up to `libs` shared libraries loaded (its mappings)."""
    for _ in range(threads):
        threading.Thread(target=time.sleep, args=(1 << 30,), daemon=True).start()
    found = sorted(Path(sysconfig.get_config_var("DESTSHARED") or "/nonexistent").glob("*.so"))
    loaded = []
    for path in found[:libs]:
        try:
            loaded.append(ctypes.CDLL(str(path)))
        except OSError:  # one that needs a library this host lacks: the others still make the shape
            continue
    return loaded


def zero_after_fork(found: dict[str, Region], zeros: Zeros) -> None:
    """This process (the child or the parent) overwrites pages of its copy-on-write private region with zeros."""
    private = found["private"]
    zeros.write(private.area, private.start, private.size)
    found["private"] = replace(private, zeros=zeros)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--thp-mib", type=int, default=0)
    parser.add_argument("--nothp-mib", type=int, default=0)
    parser.add_argument("--shared-mib", type=int, default=0)
    parser.add_argument("--file-mib", type=int, default=0)
    parser.add_argument("--zero-mib", type=int, default=0)
    parser.add_argument("--repeat", action="store_true")
    parser.add_argument("--fork", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--libs", type=int, default=0)
    args = parser.parse_args()
    global REPEAT
    REPEAT = args.repeat
    workdir = Path(args.dir)
    found = regions(args, workdir)
    libraries = server_shape(args.threads, args.libs) if args.threads or args.libs else []
    spans = {name: [address(r.area) + r.start, r.size] for name, r in found.items()}
    (workdir / "regions.json").write_text(json.dumps(spans))
    child = os.fork() if args.fork else -1
    if child == 0:
        if args.zero_mib:
            zero_after_fork(found, CHILD_ZEROS)
        (workdir / "child-ready").write_text(str(os.getpid()))
        serve(workdir, found, "child-")
        os._exit(0)
    if child > 0:
        if args.zero_mib:
            zero_after_fork(found, PARENT_ZEROS)
        while not (workdir / "child-ready").exists():  # the child's zeros are written before anything dumps it
            time.sleep(0.01)
        (workdir / "child").write_text(str(child))
    (workdir / "ready").write_text(str(os.getpid()))
    serve(workdir, found, "")
    del libraries
    if child > 0:
        os.waitpid(child, 0)
    sys.exit(0)


def serve(workdir: Path, found: dict[str, Region], prefix: str) -> None:
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

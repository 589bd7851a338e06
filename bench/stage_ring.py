"""What bounds a node hydrator's stage that misses the RAM tier (issue 35: a 64 GiB dump staged at 15-40 GB/s
against the link's ~54): the ring (reader threads `pread` the dump files into page-locked buffers, each buffer's
DMA running while the other is read) by reader threads and read size, beside the CPU's part alone, in one run.

    python bench/stage_ring.py [--gib 64] [--mounts never,always] [--rings 16x8M,8x8M,16x2M,...] [--budget 170]
                               [--out DIR]

Each mount (root): a tmpfs mounted here with that `huge=` option (`never`: 4 KiB pages, as /dev/shm; `always`: 2 MiB
pages, as the daemon rows' IMAGES_HUGE=always), holding a dump of `--gib` one-GiB segment files (one region each, as
the CUDA interposer writes them; a random 64 MiB block repeated), unmounted after its rows. Rows, in this order:

* `ring TxC` stages (a staging hydrator per ring, `serve --staging --ram-tier-bytes 0 --dump-threads T
  --dump-chunk C`, every stage a miss, discarded after its answer): the first ring right after the dump is written
  and again last (what the moments after a large write cost: reclaim, compaction), each other ring once;
* `pread TxC`: the same reads with no device (T threads `pread` C bytes into an ordinary buffer): the CPU's and
  memory's part alone.

Each row: GB/s (bytes / the copy's seconds), the copy's seconds, the readers' thread-seconds reading and waiting for
the device, and what the kernel did meanwhile (`/proc/vmstat` deltas: pages scanned for reclaim by kswapd and
directly, compaction stalls, THP allocations that fell back). Rows past `--budget` seconds are skipped and named.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import table
from coldsnap_probe.jsonline import request

GIB, BLOCK = 1 << 30, 64 << 20
KEY = "sha256:" + hashlib.sha256(b"bench-stage-ring").hexdigest()
RINGS = "16x8M,8x8M,16x2M,8x2M,16x1M,32x2M,16x32M"  # the first: the hydrator's default ring
VMSTAT = ("pgscan_kswapd", "pgscan_direct", "compact_stall", "thp_file_fallback", "thp_fault_fallback")
HEAD = ("tmpfs", "row", "GB/s", "copy s", "read thread-s", "device-wait thread-s", "reclaim scanned (k pages)",
        "compact stalls", "THP fallbacks")


def parse_ring(text: str) -> tuple[int, str]:
    threads, chunk = text.lower().split("x")
    return int(threads), chunk.upper()


def chunk_bytes(chunk: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(chunk[:-1]) * units[chunk[-1]] if chunk[-1] in units else int(chunk)


def vmstat() -> dict[str, int]:
    with open("/proc/vmstat", encoding="ascii") as lines:
        return {k: int(v) for k, v in (line.split() for line in lines) if k in VMSTAT}


@contextlib.contextmanager
def mounted(huge: str, gib: int) -> Iterator[Path]:
    """A tmpfs of `gib` GiB (and one to spare) with `huge=huge`, mounted in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix=f"cs-stage-ring-{huge}-") as point:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={gib + 1}g,huge={huge}", "cs-stage-ring", point],
                       check=True, capture_output=True, text=True)
        try:
            yield Path(point)
        finally:
            subprocess.run(["umount", "-l", point], check=False, capture_output=True, text=True)


def write_dump(directory: Path, gib: int) -> list[dict[str, Any]]:
    """`gib` segment files of 1 GiB, one region each: a stage-dump's parts."""
    block = os.urandom(BLOCK)

    def one(index: int) -> dict[str, Any]:
        path = directory / f"seg-{index}.bin"
        with path.open("wb") as f:
            for _ in range(GIB // BLOCK):
                f.write(block)
        return {"file": str(path), "bytes": GIB, "region": index}
    with ThreadPoolExecutor(min(16, os.cpu_count() or 4)) as pool:
        return list(pool.map(one, range(gib)))


@contextlib.contextmanager
def hydrators(work: Path, rings: list[tuple[int, str]]) -> Iterator[dict[tuple[int, str], tuple[str, str]]]:
    """One staging hydrator per ring, the RAM tier off, started together: each ring's socket and device UUID."""
    procs, sockets = [], {}
    try:
        for threads, chunk in rings:
            control = str(work / f"{threads}x{chunk}.sock")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control, "--staging",
                 "--ram-tier-bytes", "0", "--dump-threads", str(threads), "--dump-chunk", chunk],
                stdout=subprocess.PIPE, cwd=ROOT))
            sockets[(threads, chunk)] = control
        out = {}
        for ring, proc in zip(rings, procs, strict=True):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise SystemExit(f"the hydrator for ring {ring} exited {proc.wait()} before its ready line")
            out[ring] = (sockets[ring], json.loads(line)["device_uuid"])
        yield out
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def stage_row(huge: str, label: str, served: tuple[str, str], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage-dump of `parts` on a hydrator, discarded after: its row."""
    control, uuid = served
    before = vmstat()
    answer = request(control, {"op": "stage-dump", "key": KEY, "parts": parts, "device_uuid": uuid}, timeout=300.0)
    after = vmstat()
    if not answer.get("ok"):
        return {"tmpfs": huge, "row": label, "error": str(answer.get("error"))}
    request(control, {"op": "discard", "key": KEY, "ticket": answer["ticket"]}, timeout=60.0)
    copy = answer.get("copy") or {}
    return {"tmpfs": huge, "row": label, "gbps": answer["copied_bytes"] / answer["copy_s"] / 1e9,
            "copy_s": answer["copy_s"], "read_thread_s": copy.get("read_thread_s"),
            "device_thread_s": copy.get("device_thread_s"), **{k: after[k] - before[k] for k in before}}


def pread_row(huge: str, threads: int, chunk: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The ring's reads with no device: `threads` threads, each its stripe of `chunk`-byte reads over the files."""
    size = chunk_bytes(chunk)
    reads = [(part["file"], offset) for part in parts for offset in range(0, part["bytes"], size)]
    fds = {part["file"]: os.open(part["file"], os.O_RDONLY) for part in parts}
    spent: list[float] = []

    def reader(worker: int) -> int:
        buffer, got, started = mmap.mmap(-1, size), 0, time.thread_time()
        for path, offset in reads[worker::threads]:
            got += os.preadv(fds[path], [buffer], offset)
        spent.append(time.thread_time() - started)
        return got

    before, started = vmstat(), time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(reader, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)
    seconds, after = time.perf_counter() - started, vmstat()
    return {"tmpfs": huge, "row": f"pread {threads}x{chunk}", "gbps": total / seconds / 1e9, "copy_s": seconds,
            "read_thread_s": sum(spent), "device_thread_s": None, **{k: after[k] - before[k] for k in before}}


def cells(r: dict[str, Any]) -> list[str]:
    def f(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"
    if "error" in r:
        return [f"huge={r['tmpfs']}", r["row"], "failed: " + r["error"][:80], *["-"] * 6]
    return [f"huge={r['tmpfs']}", r["row"], f(r["gbps"], 1), f(r["copy_s"]), f(r["read_thread_s"]),
            f(r["device_thread_s"]), str((r["pgscan_kswapd"] + r["pgscan_direct"]) // 1000), str(r["compact_stall"]),
            str(r["thp_file_fallback"] + r["thp_fault_fallback"])]


def mount_rows(huge: str, gib: int, rings: list[tuple[int, str]], served: dict[tuple[int, str], tuple[str, str]],
               started: float, budget: float, skipped: list[str]) -> list[dict[str, Any]]:
    """One mount's rows (module docstring), in order; those past the budget named in `skipped`."""
    rows: list[dict[str, Any]] = []
    with mounted(huge, gib) as point:
        t = time.perf_counter()
        parts = write_dump(point, gib)
        print(f"huge={huge}: {gib} GiB written in {time.perf_counter() - t:.1f} s", flush=True)
        first = rings[0]
        plan: list[tuple[str, Any]] = [("stage", first), *[("stage", r) for r in rings[1:]],
                                       ("pread", first), ("pread", (8, first[1])), ("stage", first)]
        for kind, (threads, chunk) in plan:
            label = f"{'ring' if kind == 'stage' else 'pread'} {threads}x{chunk}"
            if time.perf_counter() - started > budget:
                skipped.append(f"huge={huge} {label}")
                continue
            row = stage_row(huge, f"ring {threads}x{chunk}", served[(threads, chunk)], parts) if kind == "stage" \
                else pread_row(huge, threads, chunk, parts)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=64)
    parser.add_argument("--mounts", type=lambda text: text.split(","), default=["never", "always"])
    parser.add_argument("--rings", type=lambda text: [parse_ring(r) for r in text.split(",")],
                        default=[parse_ring(r) for r in RINGS.split(",")],
                        help="reader threads x read size, the first the hydrator's default (16x8M)")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds after which no row is started")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    started, rows, skipped = time.perf_counter(), [], []
    host = {"cpus": os.cpu_count(), "numa_nodes": len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))}
    with tempfile.TemporaryDirectory(prefix="cs-stage-ring-") as sockets, \
            hydrators(Path(sockets), args.rings) as served:
        for huge in args.mounts:
            rows += mount_rows(huge, args.gib, args.rings, served, started, args.budget, skipped)
    text = table(HEAD, [cells(r) for r in rows]) + f"\n\nhost: {json.dumps(host)}"
    if skipped:
        text += f"\nskipped (past --budget {args.budget:.0f} s): {', '.join(skipped)}"
    print(text, flush=True)
    if args.out:
        Path(args.out, "stage-ring.txt").write_text(text + "\n")
        Path(args.out, "stage-ring.json").write_text(json.dumps({"host": host, "rows": rows, "skipped": skipped},
                                                                indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

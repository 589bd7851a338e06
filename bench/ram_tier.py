"""The node hydrator's RAM tier against its disk tier (issue 34 item 3, issue 35's staged copy at the link's rate):
the same device dump staged again and again through real hydrators, side by side, in one run.

    python bench/ram_tier.py [--gib 16] [--stages 3] [--dir /dev/shm] [--out DIR]

A dump of `--gib` one-GiB segment files (one region each, as the CUDA interposer writes them; a random 64 MiB
block repeated, so no byte is zero) goes into `--dir`. Then two real hydrator processes (`serve --staging`) stage
it `--stages` times each (every stage-dump filled, then discarded, as a restore that adopted it would leave it):

* `ram tier on`: the first stage misses (`tier: disk`, read through the ring of page-locked buffers) and queues the
  dump for the tier; the row says how long the tier took to hold it (off the restore's path: measured from the
  miss's answer to `status` listing it), and every later stage is a hit (`tier: ram`), one DMA per piece from the
  pinned files;
* `ram tier off` (`--ram-tier-bytes 0`): every stage reads the files through the ring, as before.

Each stage's row: its tier, its seconds (the hydrator's `stage_s`: allocations and copy) and the copy's alone, the
copy's rate, and the ring's thread-seconds (what its reader threads spent copying from the page cache: 0 on a hit).
The link's own rate is ~55 GB/s host to device on the H200 (issue 35); the disk tier's copy ran at 24-38 GB/s there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import table
from coldsnap_probe.jsonline import request

GIB, BLOCK = 1 << 30, 64 << 20
KEY = "sha256:" + hashlib.sha256(b"bench-ram-tier").hexdigest()
HEAD = ("hydrator", "stage", "tier", "GB", "stage s", "copy s", "copy GB/s", "ring thread-s", "tier held it after s")


def write_dump(directory: Path, gib: int) -> list[dict[str, Any]]:
    """`gib` segment files of 1 GiB, one region each: the stage-dump's parts."""
    block = os.urandom(BLOCK)

    def one(index: int) -> dict[str, Any]:
        path = directory / f"seg-{index}.bin"
        with path.open("wb") as f:
            for _ in range(GIB // BLOCK):
                f.write(block)
        return {"file": str(path), "bytes": GIB, "region": index}
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(gib)))


def held_after(control: str, since: float, limit: float = 120.0) -> float | None:
    """Seconds from `since` until the hydrator's RAM tier holds an entry (None: not within `limit`)."""
    while time.perf_counter() - since < limit:
        if request(control, {"op": "status"}, timeout=10.0)["ram_tier"]["entries"] >= 1:
            return time.perf_counter() - since
        time.sleep(0.02)
    return None


def stage_rows(label: str, parts: list[dict[str, Any]], stages: int, budget: str, work: Path) -> list[dict[str, Any]]:
    """One hydrator process (its RAM tier's budget `budget`), `stages` stage-dumps of `parts`, each discarded."""
    control = str(work / f"{label.replace(' ', '-')}.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--ram-tier-bytes", budget], stdout=subprocess.PIPE, cwd=ROOT)
    rows: list[dict[str, Any]] = []
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        for n in range(1, stages + 1):
            answer = request(control, {"op": "stage-dump", "key": KEY, "parts": parts,
                                       "device_uuid": ready["device_uuid"]}, timeout=300.0)
            answered = time.perf_counter()
            if not answer.get("ok"):
                raise RuntimeError(f"{label}, stage {n}: {answer.get('error')}")
            request(control, {"op": "discard", "key": KEY, "ticket": answer["ticket"]}, timeout=60.0)
            copy = answer.get("copy") or {}
            row = {"hydrator": label, "stage": n, "tier": answer.get("tier"), "bytes": answer["bytes"],
                   "stage_s": answer["stage_s"], "copy_s": answer["copy_s"],
                   "copy_gbps": answer["bytes"] / answer["copy_s"] / 1e9, "ring_thread_s": copy.get("read_thread_s"),
                   "held_after_s": None}
            if answer.get("tier") == "disk" and budget != "0":
                row["held_after_s"] = held_after(control, answered)
            rows.append(row)
            print(json.dumps(row), flush=True)
        rows[-1]["status"] = request(control, {"op": "status"}, timeout=10.0)["ram_tier"]
    finally:
        proc.kill()
        proc.wait()
    return rows


def cells(row: dict[str, Any]) -> list[str]:
    def f(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"
    return [row["hydrator"], str(row["stage"]), str(row["tier"]), f(row["bytes"] / 1e9), f(row["stage_s"]),
            f(row["copy_s"]), f"{row['copy_gbps']:.1f}", f(row["ring_thread_s"]) if row["ring_thread_s"] else "0",
            f(row["held_after_s"])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.gib < 1 or args.stages < 2:
        parser.error("--gib must be at least 1 and --stages at least 2 (a miss, then hits)")
    work = Path(tempfile.mkdtemp(prefix="cs-ram-tier-", dir=args.dir))
    try:
        started = time.perf_counter()
        parts = write_dump(work, args.gib)
        print(f"dump: {args.gib} GiB in {work} written in {time.perf_counter() - started:.1f} s", flush=True)
        rows = stage_rows("ram tier on", parts, args.stages, f"{args.gib + 1}G", work)
        rows += stage_rows("ram tier off", parts, 2, "0", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(HEAD, [cells(r) for r in rows])
    print(text + f"\n\nRAM tier after the run: {json.dumps(rows[args.stages - 1].get('status'))}", flush=True)
    if args.out:
        Path(args.out, "ram-tier.txt").write_text(text + "\n")
        Path(args.out, "ram-tier.json").write_text(json.dumps({"gib": args.gib, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The node hydrator's RAM tier against its disk tier (issue 34 item 3, issue 35's staged copy at the link's rate):
the same device dump staged again and again through real hydrators, side by side, in one run.

    python bench/ram_tier.py [--gib 16] [--stages 3] [--dir /dev/shm] [--out DIR] [--dump-threads 16,8,4]
                             [--warm-delay 0.5] [--rows on,warmed,off,zeros]

A dump of `--gib` one-GiB segment files (one region each, as the CUDA interposer writes them; a random 64 MiB
block repeated, so no byte is zero) goes into `--dir`. Then real hydrator processes (`serve --staging`) stage
it, each as its row says (every stage-dump filled, then discarded, as a restore that adopted it would leave it):

* `ram tier on`: the first stage misses (`tier: disk`, read through the ring of page-locked buffers) and queues the
  dump for the tier; the row says how long the tier took to hold it (off the restore's path: measured from the
  miss's answer to `status` listing it), and every later stage is a hit (`tier: ram`), one DMA per piece from the
  pinned files;
* `warmed, stage at once`, `warmed, stage after N s` and `warmed, then held`: a capture's `warm` (the capture
  worker offers the dump once the tree is dumped, hydration/_warm.py), then the first stage at once (nothing
  pinned yet: it reads the files, the loader paused beside it), after `--warm-delay` seconds (the tier still
  pinning: the stage joins the load, `tier: joined`, copying what is pinned from RAM, `ram GB`, and reading the
  rest; the loader paused meanwhile), or once the tier holds the dump (`tier: ram`). No stage may take longer
  than the tier-off rows' (issue 35: a stage never waits for a warm);
* `ram tier off, N readers` (`--ram-tier-bytes 0 --dump-threads N`, N from `--dump-threads`): every stage reads the
  files through the ring, as before, with 16, 8 and 4 reader threads (what fewer cost the stage alone);
* `half zeros, budget below the dump`: another dump of `--gib` GiB whose every other 64 MiB chunk is a hole marked
  zero (as JAX's: 17 of its 35 GB), with a budget below its size and above its data: held, its second stage a hit.

Each stage's row: its tier, the bytes it copied (chunks of zeros are set on the device), its seconds (the
hydrator's `stage_s`: allocations and copy) and the copy's alone, the copy's rate, and the ring's thread-seconds
(what its reader threads spent copying from the page cache: 0 on a hit).
The link's own rate is ~55 GB/s host to device on the H200 (issue 35); the disk tier's copy ran at 24-38 GB/s there.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
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
KEY = "sha256:" + hashlib.sha256(b"bench-ram-tier").hexdigest()
HEAD = ("hydrator", "stage", "tier", "GB copied", "pinned at stage GB", "ram GB", "stage s", "copy s", "copy GB/s",
        "ring thread-s", "tier held it after s", "warm answer s")
ROWS = ("on", "warmed", "off", "zeros")  # `--rows`: the groups of rows the docstring lists, in that order


def write_dump(directory: Path, gib: int, *, zeros: bool = False) -> list[dict[str, Any]]:
    """`gib` segment files of 1 GiB, one region each: the stage-dump's parts. With `zeros`, every other 64 MiB
    chunk is left a hole and marked zero (as the interposer writes a chunk of zeros: JAX's dump is half zeros)."""
    block = os.urandom(BLOCK)
    mask = sum(1 << c for c in range(1, GIB // BLOCK, 2)) if zeros else 0

    def one(index: int) -> dict[str, Any]:
        path = directory / f"{'zero' if zeros else 'seg'}-{index}.bin"
        with path.open("wb") as f:
            f.truncate(GIB)
            for chunk in range(GIB // BLOCK):
                if not mask >> chunk & 1:
                    f.seek(chunk * BLOCK)
                    f.write(block)
        return {"file": str(path), "bytes": GIB, "region": index, **({"zero": mask} if mask else {})}
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(gib)))


def held_after(control: str, since: float, limit: float = 120.0) -> float | None:
    """Seconds from `since` until the hydrator's RAM tier holds an entry (None: not within `limit`)."""
    while time.perf_counter() - since < limit:
        if request(control, {"op": "status"}, timeout=10.0)["ram_tier"]["entries"] >= 1:
            return time.perf_counter() - since
        time.sleep(0.02)
    return None


@contextlib.contextmanager
def hydrator(label: str, budget: str, work: Path, threads: int = 16) -> Iterator[tuple[str, dict[str, Any]]]:
    """A staging hydrator process (its RAM tier's budget `budget`, `threads` readers for a stage from the files):
    its socket and ready line."""
    control = str(work / f"{label.replace(' ', '-').replace(',', '')}.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--ram-tier-bytes", budget, "--dump-threads", str(threads),
                             "--warm-captures"],
                            stdout=subprocess.PIPE, cwd=ROOT)
    try:
        yield control, json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()


def stage(control: str, ready: dict[str, Any], parts: list[dict[str, Any]], label: str, n: int) -> dict[str, Any]:
    """One stage-dump of `parts`, discarded (as a restore that adopted it would leave it): its row."""
    pinned = request(control, {"op": "status"}, timeout=10.0)["ram_tier"]["loading_pinned_bytes"]  # a load's
    answer = request(control, {"op": "stage-dump", "key": KEY, "parts": parts, "device_uuid": ready["device_uuid"]},
                     timeout=300.0)
    if not answer.get("ok"):
        raise RuntimeError(f"{label}, stage {n}: {answer.get('error')}")
    request(control, {"op": "discard", "key": KEY, "ticket": answer["ticket"]}, timeout=60.0)
    copy = answer.get("copy") or {}
    copied = answer.get("copied_bytes", answer["bytes"])
    return {"hydrator": label, "stage": n, "tier": answer.get("tier"), "bytes": copied,
            "ram_bytes": answer.get("ram_bytes", copied if answer.get("tier") == "ram" else 0), "pinned_before": pinned,
            "stage_s": answer["stage_s"], "copy_s": answer["copy_s"], "copy_gbps": copied / answer["copy_s"] / 1e9,
            "ring_thread_s": copy.get("read_thread_s"), "held_after_s": None}


def stage_rows(label: str, parts: list[dict[str, Any]], stages: int, budget: str, work: Path,
               threads: int = 16) -> list[dict[str, Any]]:
    """One hydrator process (its RAM tier's budget `budget`, `threads` readers), `stages` stage-dumps of `parts`,
    each discarded."""
    rows: list[dict[str, Any]] = []
    with hydrator(label, budget, work, threads) as (control, ready):
        for n in range(1, stages + 1):
            rows.append(row := stage(control, ready, parts, label, n))
            if row["tier"] == "disk" and budget != "0":
                row["held_after_s"] = held_after(control, time.perf_counter())
            print(json.dumps(row), flush=True)
        rows[-1]["status"] = request(control, {"op": "status"}, timeout=10.0)["ram_tier"]
    return rows


def warmed_rows(parts: list[dict[str, Any]], budget: str, work: Path, delay: float) -> list[dict[str, Any]]:
    """A capture's `warm` (hydration/_warm.py), as the capture worker sends it once the tree is dumped: on one
    hydrator the first stage comes at once (nothing pinned yet: `disk`, the loader paused beside it), on another
    `delay` seconds after the warm's answer (the tier still pinning: `joined`), each hydrator's second stage once
    the tier holds it; on a third the first stage comes once it is held (`ram`: the first restore after a
    capture). `held after` counts from the warm's answer."""
    rows: list[dict[str, Any]] = []
    for label, wait, after in (("warmed, stage at once", False, 0.0),
                               (f"warmed, stage after {delay:g} s", False, delay), ("warmed, then held", True, 0.0)):
        with hydrator(label, budget, work) as (control, ready):
            asked = time.perf_counter()
            warmed = request(control, {"op": "warm", "key": KEY, "parts": parts, "device_uuid": ready["device_uuid"]},
                             timeout=30.0)
            answered = time.perf_counter()
            if not warmed.get("queued"):
                raise RuntimeError(f"{label}: the warm was not queued: {warmed}")
            time.sleep(after)
            held = held_after(control, answered) if wait else None
            rows.append(row := stage(control, ready, parts, label, 1))
            row |= {"warm_answer_s": answered - asked, "held_after_s": held}
            if not wait:
                row["held_after_s"] = held_after(control, answered)
                rows.append(stage(control, ready, parts, label, 2))
            rows[-1]["status"] = request(control, {"op": "status"}, timeout=10.0)["ram_tier"]
            for done in rows[-2 if not wait else -1:]:
                print(json.dumps(done), flush=True)
    return rows


def cells(row: dict[str, Any]) -> list[str]:
    def f(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"
    return [row["hydrator"], str(row["stage"]), str(row["tier"]), f(row["bytes"] / 1e9),
            f(row["pinned_before"] / 1e9), f(row["ram_bytes"] / 1e9),
            f(row["stage_s"]),
            f(row["copy_s"]), f"{row['copy_gbps']:.1f}", f(row["ring_thread_s"]) if row["ring_thread_s"] else "0",
            f(row["held_after_s"]), f"{row['warm_answer_s']:.4f}" if "warm_answer_s" in row else "-"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--out", default="")
    parser.add_argument("--warm-delay", type=float, default=0.5,
                        help="seconds from a warm's answer to the stage that joins its load (a restore's start)")
    parser.add_argument("--dump-threads", type=lambda text: [int(n) for n in text.split(",")], default=[16, 8, 4],
                        help="the tier-off hydrators' readers (serve --dump-threads), one hydrator each: 16,8,4")
    parser.add_argument("--rows", type=lambda text: text.split(","), default=list(ROWS),
                        help=f"the groups of rows to run (default all: {','.join(ROWS)})")
    args = parser.parse_args()
    if set(args.rows) - set(ROWS):
        parser.error(f"--rows must name some of {','.join(ROWS)}, not {','.join(args.rows)}")
    if args.gib < 2 or args.stages < 2:
        parser.error("--gib must be at least 2 and --stages at least 2 (a miss, then hits)")
    work = Path(tempfile.mkdtemp(prefix="cs-ram-tier-", dir=args.dir))
    try:
        started = time.perf_counter()
        parts = write_dump(work, args.gib)
        print(f"dump: {args.gib} GiB in {work} written in {time.perf_counter() - started:.1f} s", flush=True)
        rows = stage_rows("ram tier on", parts, args.stages, f"{args.gib + 1}G", work) if "on" in args.rows else []
        if "warmed" in args.rows:
            rows += warmed_rows(parts, f"{args.gib + 1}G", work, args.warm_delay)
        for threads in args.dump_threads if "off" in args.rows else []:  # fewer readers may cost a restore less
            rows += stage_rows(f"ram tier off, {threads} readers", parts, 2, "0", work, threads)
        if "zeros" in args.rows:  # its data fit a budget its whole size does not (JAX's)
            zeros = write_dump(work, args.gib, zeros=True)
            rows += stage_rows("half zeros, budget below the dump", zeros, 2, f"{args.gib // 2 + 1}G", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(HEAD, [cells(r) for r in rows])
    print(text + f"\n\nRAM tier after the run: {json.dumps(rows[-1].get('status'))}", flush=True)
    if args.out:
        Path(args.out, "ram-tier.txt").write_text(text + "\n")
        Path(args.out, "ram-tier.json").write_text(json.dumps({"gib": args.gib, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

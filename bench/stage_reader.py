"""A node hydrator's stage that misses the RAM tier, by reader, side by side (issues 34 and 35: the first restore
after a capture, and every restore of a dump too large for the tier): the ring (reader threads copy each byte
from the page cache into page-locked buffers, then the DMA) against registered windows (the files page-locked
where they lie, a window at a time, the DMA reading them: hydration/_windows.py), and `auto` (what the hydrator
does by default: registered where the filesystem pins fast, the ring elsewhere).

    python bench/stage_reader.py [--gib 16,64] [--mounts always,never] [--stages 2] [--budget 190] [--out DIR]

Each mount (root): a tmpfs mounted here with that `huge=` option (`always`: 2 MiB pages, as the daemon rows'
images mount `IMAGES_HUGE=always`; `never`: 4 KiB pages, as /dev/shm), unmounted after its rows. In it, a dump
of each size in `--gib`: one-GiB segment files, one region each, as the CUDA interposer writes them (a random
64 MiB block repeated: no chunk of zeros). Three hydrator processes (`serve --staging --ram-tier-bytes 0
--stage-reader R`, so every stage misses) stage it `--stages` times each, every stage discarded after its
answer, as a restore that adopted it leaves it. Each row: the reader asked and the one that ran (the answer's
`reader`), its rate (`reader_gbps`: bytes copied / the copy's seconds), the seconds spent page-locking
(`pin_s`: the windows' thread-seconds; the ring's set-up), the copy's and the stage's seconds (allocations
included), the ring's reader thread-seconds, and why a window went to the ring (`fallback`). Rows are skipped
(and said so) once `--budget` seconds have passed. The link's own rate is ~54 GB/s (H200, page-locked memory).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
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
READERS = ("ring", "registered", "auto")
KEY = "sha256:" + hashlib.sha256(b"bench-stage-reader").hexdigest()
HEAD = ("tmpfs", "GiB", "reader asked", "ran", "stage", "GB/s", "pin s", "copy s", "stage s", "ring thread-s",
        "fallback")


@contextlib.contextmanager
def mounted(huge: str, gib: int) -> Iterator[Path]:
    """A tmpfs of `gib` GiB (and one to spare) with `huge=huge`, mounted in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix=f"cs-stage-reader-{huge}-") as point:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={gib + 1}g,huge={huge}", "cs-stage-reader", point],
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
def hydrators(work: Path) -> Iterator[dict[str, tuple[str, dict[str, Any]]]]:
    """One staging hydrator per reader, the RAM tier off: each reader's socket and ready line."""
    procs, out = [], {}
    try:
        for reader in READERS:
            control = str(work / f"{reader}.sock")
            procs.append(proc := subprocess.Popen(
                [sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control, "--staging",
                 "--ram-tier-bytes", "0", "--stage-reader", reader], stdout=subprocess.PIPE, cwd=ROOT))
            out[reader] = (control, json.loads(proc.stdout.readline()))  # type: ignore[union-attr]
        yield out
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def stage(control: str, ready: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage-dump of `parts`, discarded after: its answer."""
    answer = request(control, {"op": "stage-dump", "key": KEY, "parts": parts, "device_uuid": ready["device_uuid"]},
                     timeout=300.0)
    if not answer.get("ok"):
        raise RuntimeError(f"stage-dump: {answer.get('error')}")
    request(control, {"op": "discard", "key": KEY, "ticket": answer["ticket"]}, timeout=60.0)
    return answer


def row(huge: str, gib: int, reader: str, n: int, answer: dict[str, Any]) -> dict[str, Any]:
    copy = answer.get("copy") or {}
    ring = copy.get("ring", copy)
    return {"tmpfs": f"huge={huge}", "gib": gib, "asked": reader, "reader": answer.get("reader"), "stage": n,
            "gbps": answer.get("reader_gbps"), "pin_s": answer.get("pin_s"), "copy_s": answer["copy_s"],
            "stage_s": answer["stage_s"], "ring_thread_s": ring.get("read_thread_s"),
            "fallback": copy.get("fallback", ""), "copy": copy}


def cells(r: dict[str, Any]) -> list[str]:
    def f(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"
    return [r["tmpfs"], str(r["gib"]), r["asked"], str(r["reader"]), str(r["stage"]), f(r["gbps"], 1), f(r["pin_s"]),
            f(r["copy_s"]), f(r["stage_s"]), f(r["ring_thread_s"]), (r["fallback"] or "-")[:60]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=lambda text: [int(n) for n in text.split(",")], default=[16, 64])
    parser.add_argument("--mounts", type=lambda text: text.split(","), default=["always", "never"])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--budget", type=float, default=190.0, help="seconds after which no row is started")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    started, rows, skipped = time.perf_counter(), [], []
    with tempfile.TemporaryDirectory(prefix="cs-stage-reader-") as sockets, hydrators(Path(sockets)) as served:
        for huge in args.mounts:
            for gib in args.gib:
                if time.perf_counter() - started > args.budget:
                    skipped.append(f"huge={huge} {gib} GiB")
                    continue
                with mounted(huge, gib) as point:
                    t = time.perf_counter()
                    parts = write_dump(point, gib)
                    print(f"huge={huge}: {gib} GiB written in {time.perf_counter() - t:.1f} s", flush=True)
                    for reader in READERS:
                        for n in range(1, args.stages + 1):
                            if time.perf_counter() - started > args.budget:
                                skipped.append(f"huge={huge} {gib} GiB {reader} stage {n}")
                                continue
                            try:
                                answer = stage(*served[reader], parts)
                            except (RuntimeError, OSError) as exc:  # said in its row; the others still run
                                answer = {"reader": "failed", "copy_s": None, "stage_s": None,
                                          "copy": {"fallback": str(exc)}}
                            rows.append(r := row(huge, gib, reader, n, answer))
                            print(json.dumps({k: v for k, v in r.items() if k != "copy"}), flush=True)
    text = table(HEAD, [cells(r) for r in rows])
    if skipped:
        text += f"\n\nskipped (past --budget {args.budget:.0f} s): {', '.join(skipped)}"
    print(text, flush=True)
    if args.out:
        Path(args.out, "stage-reader.txt").write_text(text + "\n")
        Path(args.out, "stage-reader.json").write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

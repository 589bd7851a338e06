"""What a CRIU dump writes for a process shaped like a released CUDA server (issue 35 item 3), and what it would
save by skipping pages of zeros: run on any machine with CRIU, no GPU.

    python bench/criu_dump_shape.py --criu PATH [--data-mib 2048] [--zero-mib 1024] [--dir /dev/shm] [--out DIR]

After the interposer's release and the CUDA checkpoint, the CRIU dump of an unchanged server holds the process's
own anonymous memory (Python, the engine's host side) and the device state the driver copied into host memory.
The target here maps `--data-mib` MiB of random bytes and `--zero-mib` MiB written with zeros (present pages
holding zeros: what CRIU dumps, since only never-written pages and the kernel's zero page are skipped), then
the same with the zero part read only (the kernel's zero page) and released (`MADV_DONTNEED`): the dump a
zero-page skip would give. Each is dumped by CRIU into `--dir` (as the worker invokes it: `dump --tree`), timed;
the pages images are sized and their 4 KiB pages of zeros counted. A table on stdout, JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import criu_zero_pages, table


def criu_environment(criu: str) -> dict[str, str]:
    """CRIU kept with its own libraries (scripts/criu/build's directory) finds them."""
    return {**os.environ, "LD_LIBRARY_PATH": str(Path(criu).resolve().parent.parent / "lib/x86_64-linux-gnu")}

TARGET = r"""
import mmap, os, sys, time
data_mib, zero_mib, how, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
data = mmap.mmap(-1, data_mib << 20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
block = os.urandom(64 << 20)
for at in range(0, data_mib << 20, 64 << 20):
    data[at:at + (64 << 20)] = block[:min(64 << 20, (data_mib << 20) - at)]
zero = mmap.mmap(-1, zero_mib << 20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if how == "written":  # present pages that hold zeros
    for at in range(0, zero_mib << 20, 4096):
        zero[at] = 0
        zero[at + 1] = 1
        zero[at + 1] = 0
elif how == "read":  # every page read: mapped to the kernel's zero page
    sum(zero[at] for at in range(0, zero_mib << 20, 4096))
elif how == "released":  # written, then given back (what a skip of zero pages leaves)
    for at in range(0, zero_mib << 20, 4096):
        zero[at + 1] = 1
    zero.madvise(mmap.MADV_DONTNEED)
open(ready, "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""


def one(criu: str, root: Path, data_mib: int, zero_mib: int, how: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=root, prefix="criu-shape-") as scratch:
        images, ready = Path(scratch) / "images", Path(scratch) / "ready"
        images.mkdir()
        target = subprocess.Popen([sys.executable, "-c", TARGET, str(data_mib), str(zero_mib), how, str(ready)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            while not ready.exists():
                if target.poll() is not None:
                    raise RuntimeError(f"the target exited {target.returncode}")
                time.sleep(0.05)
            started = time.perf_counter()
            done = subprocess.run([criu, "dump", "--tree", str(target.pid), "--images-dir", str(images),
                                   "--work-dir", scratch, "--log-file", "dump.log", "-v2"], capture_output=True,
                                  text=True, check=False, env=criu_environment(criu))
            seconds = time.perf_counter() - started
            if done.returncode != 0:
                log = (Path(scratch) / "dump.log").read_text()[-800:]
                raise RuntimeError(f"criu dump exited {done.returncode}: {log}")
            size, zeros = criu_zero_pages(images)
        finally:
            target.kill()
            target.wait()
    return {"zero_pages": how, "dump_s": seconds, "pages_bytes": size, "zero_page_bytes": zeros}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--criu", required=True)
    parser.add_argument("--data-mib", type=int, default=2048)
    parser.add_argument("--zero-mib", type=int, default=1024)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    rows = []
    for how in ("written", "read", "released"):
        best: dict[str, Any] = {}
        for _ in range(2):
            got = one(args.criu, Path(args.dir), args.data_mib, args.zero_mib, how)
            if not best or got["dump_s"] < best["dump_s"]:
                best = got
        rows.append(best)
    print(table(["zero part", "CRIU dump s", "pages GB", "of it zeros GB", "GB/s"],
                [[r["zero_pages"], f"{r['dump_s']:.2f}", f"{r['pages_bytes'] / 1e9:.2f}",
                  f"{r['zero_page_bytes'] / 1e9:.2f}", f"{r['pages_bytes'] / r['dump_s'] / 1e9:.2f}"] for r in rows]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"criu-dump-shape-{os.uname().nodename[:24]}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps({"data_mib": args.data_mib, "zero_mib": args.zero_mib, "rows": rows}, indent=2) + "\n")
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

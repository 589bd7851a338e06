"""What a CRIU dump writes and a restore reads for a process shaped like a released CUDA server (issue 35 item 3),
with and without `third_party/criu/zero-pages.patch`, side by side in one run: any machine with CRIU, no GPU.

    python bench/criu_dump_shape.py --criu PATH [--data-mib 920] [--zero-mib 1128] [--dir /dev/shm] [--out DIR]

After the interposer's release and the CUDA checkpoint, the CRIU dump of an unchanged server holds the process's
own anonymous memory (Python, the engine's host side) and the device state the driver copied into host memory;
on the H200 0.96 of its 1.74 GB were 4 KiB pages of zeros. The target here maps `--data-mib` MiB of random bytes
and `--zero-mib` MiB written with zeros (present pages holding zeros; the defaults: 2 GiB, 55 % zeros). Rows:
  - `write`: CRIU_DUMP_ZERO_PAGES=write, every page written (stock CRIU's behaviour, same binary);
  - `skip`: the patch's default, pages of zeros neither written nor read back;
  - `released`: the zero part given back (`MADV_DONTNEED`) before the dump: nothing to scan or skip, the floor.
Each row: a fresh target dumped by CRIU into `--dir` as the worker invokes it (`dump --tree`), the pages images
sized and their pages of zeros counted, then restored (`restore --restore-detached`, `CRIU_RESTORE_THREADS`
unset: the CPUs), the restored target checks its memory (CRC-32 of every byte against the one it took before
the dump, timed: pages left out are faulted in by that first read) and ends. The rows take turns, `--repeat`
rounds; each row's best dump (and its restore). A table on stdout, JSON in --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import criu_environment, criu_zero_pages, run_criu, table
from coldsnap_probe import dump_stats

TARGET = r"""
import mmap, os, signal, sys, time, zlib
data_mib, zero_mib, how, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
data = mmap.mmap(-1, data_mib << 20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
block = os.urandom(64 << 20)
for at in range(0, data_mib << 20, 64 << 20):
    data[at:at + (64 << 20)] = block[:min(64 << 20, (data_mib << 20) - at)]
zero = mmap.mmap(-1, zero_mib << 20, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for at in range(0, zero_mib << 20, 4096):  # present pages that hold zeros
    zero[at + 1] = 1
    zero[at + 1] = 0
if how == "released":
    zero.madvise(mmap.MADV_DONTNEED)
def crc():
    return zlib.crc32(zero, zlib.crc32(data))
before = crc()
def check(*_):
    started = time.perf_counter()
    same = crc() == before
    open(ready + ".part", "w").write(f"{'same' if same else 'differs'} {time.perf_counter() - started:.4f}")
    os.rename(ready + ".part", ready + ".checked")
signal.signal(signal.SIGUSR1, check)
import ctypes
spans = [(ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)) for m in (data, zero)]
open(ready + ".part", "w").write(" ".join(str(n) for n in (os.getpid(), *spans[0], *spans[1])))
os.rename(ready + ".part", ready)
while True:
    time.sleep(1)
"""


def wait_for(path: Path, what: subprocess.Popen[bytes] | None = None, seconds: float = 120) -> str:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if what is not None and what.poll() is not None:
            raise RuntimeError(f"the target exited {what.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {seconds:.0f} s")
        time.sleep(0.02)
    return path.read_text()


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def copy_out_seconds(pid: int, spans: list[tuple[int, int]]) -> float:
    """Seconds to copy every page of `spans` out of process `pid` into one 4 MiB buffer (`process_vm_readv`):
    what looking at the bytes costs from outside the process (CRIU reading the pipe, or the target, before a
    scan), where the parasite reads them in place."""
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(4 << 20)
    local = IoVec(ctypes.addressof(buffer), len(buffer))
    started = time.perf_counter()
    for start, length in spans:
        for at in range(start, start + length, len(buffer)):
            remote = IoVec(at, min(len(buffer), start + length - at))
            if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != remote.len:
                raise OSError(ctypes.get_errno(), f"process_vm_readv of {pid} at {at:#x}")
    return time.perf_counter() - started


def end(pid: int) -> None:
    """Kills the restored target (a child of this subreaper) and reaps it."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def one(criu: str, root: Path, data_mib: int, zero_mib: int, row: str) -> dict[str, Any]:
    how, zero_pages = ("released", "skip") if row == "released" else ("written", row)
    env = criu_environment(criu, CRIU_DUMP_ZERO_PAGES=zero_pages)
    with tempfile.TemporaryDirectory(dir=root, prefix="criu-shape-") as scratch:
        images, ready = Path(scratch) / "images", Path(scratch) / "ready"
        images.mkdir()
        target = subprocess.Popen([sys.executable, "-c", TARGET, str(data_mib), str(zero_mib), how, str(ready)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            numbers = [int(n) for n in wait_for(ready, target).split()]
            copy_s = copy_out_seconds(target.pid, [(numbers[1], numbers[2]), (numbers[3], numbers[4])])
            dump_s = run_criu(criu, ["dump", "--tree", str(target.pid), "--images-dir", str(images), "--work-dir",
                                     scratch], Path(scratch) / "dump.log", env, "-v2")
        finally:
            if target.poll() is None:
                target.kill()
            target.wait()
        size, zeros = criu_zero_pages(images)
        stats = dump_stats(Path(scratch))
        restore_s = run_criu(criu, ["restore", "--images-dir", str(images), "--work-dir", scratch,
                                    "--restore-detached"], Path(scratch) / "restore.log", env, "-v2")
        try:
            os.kill(target.pid, signal.SIGUSR1)
            checked, read_s = wait_for(Path(f"{ready}.checked"), seconds=60).split()
        finally:
            end(target.pid)
    return {"row": row, "copy_out_s": copy_s, "dump_s": dump_s, "pages_bytes": size, "zero_page_bytes": zeros,
            "restore_s": restore_s, "memory": checked, "first_read_s": float(read_s), **stats}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--criu", required=True)
    parser.add_argument("--data-mib", type=int, default=920)
    parser.add_argument("--zero-mib", type=int, default=1128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the restored targets are ours to reap
    names = ("write", "skip", "released")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(args.repeat):  # the rows take turns: a busy moment of the machine falls on all of them
        for name in names:
            runs[name].append(one(args.criu, Path(args.dir), args.data_mib, args.zero_mib, name))
    rows = [min(runs[name], key=lambda r: r["dump_s"]) | {"runs": runs[name]} for name in names]
    print(table(["zeros", "CRIU dump s", "of it: pages in (scan included) / written s", "pages GB", "of it zeros GB",
                 "restore s", "then every byte read once s", "memory after restore"],
                [[r["row"], f"{r['dump_s']:.2f}", f"{r['memdump_s'] - r['memwrite_s']:.2f} / {r['memwrite_s']:.2f}",
                  f"{r['pages_bytes'] / 1e9:.2f}", f"{r['zero_page_bytes'] / 1e9:.2f}", f"{r['restore_s']:.2f}",
                  f"{r['first_read_s']:.2f}", r["memory"]] for r in rows]))
    by = {r["row"]: r for r in rows}
    zero_gib, all_gib = args.zero_mib / 1024, (args.zero_mib + args.data_mib) / 1024

    def pages_in(name: str) -> float:
        return float(by[name]["memdump_s"] - by[name]["memwrite_s"])

    print(table(["s per GiB of zeros (CRIU's stats)", "written (write - skip)", "got: vmsplice (write - skip)",
                 "the scan in the parasite (skip - released)", "a copy out instead (process_vm_readv, per GiB)"],
                [["dump", f"{(by['write']['memwrite_s'] - by['skip']['memwrite_s']) / zero_gib:.3f}",
                  f"{(pages_in('write') - pages_in('skip')) / zero_gib:.3f}",
                  f"{(pages_in('skip') - pages_in('released')) / zero_gib:.3f}",
                  f"{by['write']['copy_out_s'] / all_gib:.3f}"]]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"criu-dump-shape-{os.uname().nodename[:24]}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps({"data_mib": args.data_mib, "zero_mib": args.zero_mib, "rows": rows}, indent=2) + "\n")
    print(f"JSON: {path}")
    return 0 if all(r["memory"] == "same" for row in rows for r in row["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())

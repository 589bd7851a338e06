"""CRIU's dump of a process shaped like a released server, stock against dump-threads.patch's threads (issue 35
item 3), side by side in one run: any machine with CRIU, no GPU.

    python bench/criu_dump_threads.py --criu PATH [--rows 1,0] [--mib 700] [--thp-mib 256] [--nothp-mib 128]
                                      [--zero-mib 512] [--threads 100] [--libs 80] [--dir /dev/shm] [--repeat 3]
                                      [--baseline-criu PATH]

One target (bench/criu_target.py): `--mib` MiB of data, a region advised `MADV_HUGEPAGE` and one
`MADV_NOHUGEPAGE`, a region of which about 60 % are pages of zeros, `--threads` waiting threads and its Python's
extension libraries (the defaults: 1.14 GB of pages written, as the H200's `transformers serve`). It is stopped
(SIGSTOP) so that every row dumps the same memory. A row is a `CRIU_DUMP_THREADS` value (1: stock CRIU's pages
path; 0: unset, the CPUs this process may use), dumped as the capture worker runs CRIU (`-v4`; here
`--leave-running` so that the next row dumps it again) into `--dir`; the rows take turns, `--repeat` rounds, and
each row's best frozen time is shown with CRIU's own account of it (`stats-dump`). Then every row's pages images
are compared with the first row's, page by page (the waiting threads' stacks differ between any two dumps: the
kernel writes an interrupted sleep's remaining time there), and the last row's images are restored and the
target checks every byte of its memory. `--baseline-criu`: another build (the patch before a change) dumps every
row too, in the same turns, its rows marked "(baseline)". A table on stdout, JSON in --out.
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

from bench._common import criu_environment, run_criu, table, wait_file
from coldsnap_probe import dump_stats

HERE = Path(__file__).resolve().parent
PAGE = 4096


def criu_env(criu: str, threads: int) -> dict[str, str]:
    """CRIU with its own libraries; 0 threads: CRIU_DUMP_THREADS unset (the CPUs)."""
    env = criu_environment(criu)
    env.pop("CRIU_DUMP_THREADS", None)
    return env | ({"CRIU_DUMP_THREADS": str(threads)} if threads else {})


def dump(criu: str, threads: int, pid: int, scratch: Path) -> dict[str, Any]:
    """One dump of the stopped target into scratch/images; its seconds and CRIU's stats."""
    images = scratch / "images"
    images.mkdir(parents=True)
    seconds = run_criu(criu, ["dump", "--tree", str(pid), "--images-dir", str(images), "--work-dir", str(scratch),
                              "--leave-running"], scratch / "dump.log", criu_env(criu, threads))
    pages = sum(p.stat().st_size for p in images.glob("pages-*.img"))
    threaded = "dump-threads: " in (scratch / "dump.log").read_text(errors="replace")
    return {"dump_s": seconds, "pages_bytes": pages, "threaded": threaded, **dump_stats(scratch)}


def pages_differing(one: Path, other: Path) -> int:
    """4 KiB pages that differ between two dumps' pages images (each file compared with its namesake)."""
    differ = 0
    for path in sorted(one.glob("pages-*.img")):
        a, b = path.read_bytes(), (other / path.name).read_bytes()
        if len(a) != len(b):
            return -1
        differ += sum(a[at:at + PAGE] != b[at:at + PAGE] for at in range(0, len(a), PAGE))
    return differ


def restored_memory(criu: str, threads: int, scratch: Path, control: Path, pid: int) -> str:
    """The last row's images restored (the target killed first); what the restored target says of its memory."""
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    run_criu(criu, ["restore", "--images-dir", str(scratch / "images"), "--work-dir", str(scratch),
                    "--restore-detached"], scratch / "restore.log", criu_env(criu, threads))
    try:
        os.kill(pid, signal.SIGCONT)  # it was dumped stopped, and so restored
        (control / "verify").touch()
        result = json.loads(wait_file(control / "result", 120))
        return "same" if result["ok"] else f"differs: {result['bad']}"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def target(args: argparse.Namespace, control: Path) -> int:
    """The target started, filled and stopped; its pid (a child of this process)."""
    proc = subprocess.Popen([sys.executable, str(HERE / "criu_target.py"), "--dir", str(control), "--repeat",
                             "--mib", str(args.mib), "--thp-mib", str(args.thp_mib), "--nothp-mib",
                             str(args.nothp_mib), "--zero-mib", str(args.zero_mib), "--threads", str(args.threads),
                             "--libs", str(args.libs)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_file(control / "ready", 300)
    os.kill(proc.pid, signal.SIGSTOP)
    return proc.pid


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--criu", required=True)
    parser.add_argument("--rows", default="1,0", help="CRIU_DUMP_THREADS values, 0 for unset (the CPUs)")
    parser.add_argument("--mib", type=int, default=700)
    parser.add_argument("--thp-mib", type=int, default=256)
    parser.add_argument("--nothp-mib", type=int, default=128)
    parser.add_argument("--zero-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=100)
    parser.add_argument("--libs", type=int, default=80)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--baseline-criu", help="another CRIU build dumping each row beside --criu")
    args = parser.parse_args()
    builds = [("", args.criu)] + ([(" (baseline)", args.baseline_criu)] if args.baseline_criu else [])
    rows = [(n, mark, criu) for mark, criu in builds for n in (int(v) for v in args.rows.split(","))]
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the restored target is ours to reap
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="criu-threads-") as scratch:
        control = Path(scratch) / "control"
        control.mkdir()
        pid = target(args, control)
        runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(rows))}
        try:
            for rnd in range(args.repeat):  # the rows take turns: a busy moment of the machine falls on all of them
                for i, (n, _, criu) in enumerate(rows):
                    where = Path(scratch) / f"row{i}-{rnd}"
                    runs[i].append(dump(criu, n, pid, where))
                    if rnd < args.repeat - 1:
                        subprocess.run(["rm", "-rf", str(where)], check=True)
            last = {i: Path(scratch) / f"row{i}-{args.repeat - 1}" for i in runs}
            differ = {i: pages_differing(last[0] / "images", last[i] / "images") for i in runs}
            shown = len(rows) // len(builds) - 1  # the last row of --criu's: its images are restored
            memory = restored_memory(args.criu, rows[shown][0], last[shown], control, pid)
        finally:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    best = {i: min(runs[i], key=lambda r: r["frozen_s"]) for i in runs}
    name = {i: ("stock" if n == 1 else f"{n} threads" if n else f"unset ({os.cpu_count()} CPUs)") + mark
            for i, (n, mark, _) in enumerate(rows)}
    print(table(["CRIU_DUMP_THREADS", "dump s", "frozen s", "memdump s (of it: pages written)", "pages GB",
                 "pages path", f"pages differing from {name[0]}"],
                [[name[i], f"{best[i]['dump_s']:.3f}", f"{best[i]['frozen_s']:.3f}",
                  f"{best[i]['memdump_s']:.3f} ({best[i]['memwrite_s']:.3f})", f"{best[i]['pages_bytes'] / 1e9:.2f}",
                  "threads" if best[i]["threaded"] else "stock", differ[i]] for i in runs]))
    print(f"{name[shown]}'s images restored: memory {memory}; {args.threads} waiting threads")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"criu-dump-threads-{os.uname().nodename[:24]}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "memory": memory,
                                "differing": {name[i]: differ[i] for i in runs},
                                "rows": {name[i]: runs[i] for i in runs}}, indent=2) + "\n")
    print(f"JSON: {path}")
    return 0 if memory == "same" else 1


if __name__ == "__main__":
    sys.exit(main())

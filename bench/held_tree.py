"""What holding a captured tree still costs a capture (issue 36, `coldsnap_probe._held_tree`): per thread count, the
steps the capture worker adds around the driver's checkpoint, and CRIU's dump of the same process running (as
before) and stopped (as now), side by side in one run.

    python bench/held_tree.py [--threads 8,100,400] [--repeat 20] [--criu PATH]

A process of N Python threads (each waking every 10 ms: a server's pools, libcuda's waiters) is, per repeat:
stopped (SIGSTOP, every thread seen stopped), held (every thread seized), one thread let run alone (`run_only`:
the driver's restore thread in a capture; it includes the hold's 5 ms settle), released, seen stopped again, and
continued. Medians in milliseconds. With `--criu`, the process is dumped (`--leave-stopped`, then continued, images
removed) `repeat // 5` times running and as many stopped: the seconds CRIU takes either way. Needs root (ptrace).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coldsnap_probe import ThreadHold, stop_tree, wait_stopped

PROGRAM = """
import sys, threading, time
def idle():
    while True:
        time.sleep(0.01)
for _ in range(int(sys.argv[1]) - 1):
    threading.Thread(target=idle, daemon=True).start()
print("ready", flush=True)
idle()
"""
STEPS = ("stop", "seize", "run_only", "release", "stopped_again", "continue")


def start(threads: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, str(threads)], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    while len(os.listdir(f"/proc/{proc.pid}/task")) < threads:
        time.sleep(0.01)
    return proc


def hold_once(pid: int, tid: int) -> dict[str, float]:
    marks = [time.perf_counter()]
    stop_tree([pid])
    marks.append(time.perf_counter())
    hold = ThreadHold(pid)
    marks.append(time.perf_counter())
    hold.run_only(tid)
    marks.append(time.perf_counter())
    hold.release()
    marks.append(time.perf_counter())
    wait_stopped([pid])
    marks.append(time.perf_counter())
    os.kill(pid, signal.SIGCONT)
    marks.append(time.perf_counter())
    return {step: (marks[i + 1] - marks[i]) * 1000 for i, step in enumerate(STEPS)}


def dump_seconds(criu: str, pid: int, stopped: bool, work: Path) -> float:
    images = Path(tempfile.mkdtemp(dir=work))
    if stopped:
        stop_tree([pid])
    started = time.perf_counter()
    subprocess.run([criu, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "--leave-stopped"],
                   check=True, timeout=120)
    seconds = time.perf_counter() - started
    os.kill(pid, signal.SIGCONT)
    shutil.rmtree(images)
    return seconds


def measure(threads: int, repeat: int, criu: str | None, work: Path) -> dict[str, float]:
    proc = start(threads)
    try:
        tid = max(int(t) for t in os.listdir(f"/proc/{proc.pid}/task"))
        runs = [hold_once(proc.pid, tid) for _ in range(repeat)]
        row = {step: statistics.median(r[step] for r in runs) for step in STEPS}
        row["total"] = statistics.median(sum(r.values()) for r in runs)
        if criu:
            dumps = max(1, repeat // 5)
            row["dump_running_s"] = statistics.median(dump_seconds(criu, proc.pid, False, work) for _ in range(dumps))
            row["dump_stopped_s"] = statistics.median(dump_seconds(criu, proc.pid, True, work) for _ in range(dumps))
        return row
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="8,100,400")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--criu", help="also time CRIU's dump of the process running and stopped")
    args = parser.parse_args()
    counts = [int(n) for n in args.threads.split(",")]
    if any(n < 2 for n in counts) or args.repeat < 1:
        parser.error("--threads must each be at least 2 and --repeat at least 1")
    columns = [*STEPS, "total", *(["dump_running_s", "dump_stopped_s"] if args.criu else [])]
    print("| threads | " + " | ".join(f"{c} (ms)" if not c.endswith("_s") else f"{c[:-2]} (s)" for c in columns)
          + " |")
    print("|" + " --- |" * (len(columns) + 1))
    with tempfile.TemporaryDirectory() as work:
        for n in counts:
            row = measure(n, args.repeat, args.criu, Path(work))
            print(f"| {n} | " + " | ".join(f"{row[c]:.3f}" if c.endswith("_s") else f"{row[c]:.2f}" for c in columns)
                  + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU half of the tail under faults (issue 35 item 4): capture workers SIGKILLed from outside, on a machine
without a GPU, with the real CRIU.

    python bench/capture_kill.py --criu CRIU [--rounds 10] [--mib 256] [--out FILE.json]

Each round starts a process that checks its own memory (bench/criu_target.py, `--mib` MiB), runs the capture
worker (`python -m coldsnap_probe capture --boundary n580`) with a report directory, and kills it with SIGKILL from
a watcher (bench/fault_checks.py) as its live phase reaches the one the round names: `audit`, or `criu-dump` once
CRIU has seized the tree (ptrace). It then measures, for real: the seconds from the kill until the worker's stderr
closed (its guard, which shares it, is done), whether that stderr names the phase and the guard's account, whether
the target still runs (not stopped) with every page intact, and whether any image is left. A last round per
phase captures without a fault, for the time a capture takes here. One table, and the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import become_subreaper, percentile, table, wait_file
from bench.fault_checks import Watcher


def target_ok(control: Path, pid: int, mib: int) -> bool:
    """The target runs (not stopped) and its own check of every page passes."""
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1] if Path(f"/proc/{pid}").exists() else ""
    if state in ("", "T", "Z"):
        return False
    (control / "result").unlink(missing_ok=True)
    (control / "verify").touch()
    result = json.loads(wait_file(control / "result", 120))
    return bool(result.get("ok")) and result.get("bytes") == mib << 20


def one_round(work: Path, criu: str, mib: int, phase: str | None) -> dict[str, Any]:
    control, images, state = work / "control", work / "images", work / "state"
    reports = state / "capsule-reports" / "unit"
    for d in (control, reports):
        d.mkdir(parents=True)
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control), "--mib",
                               str(mib)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    row: dict[str, Any] = {"phase": phase or "(none)"}
    try:
        wait_file(control / "ready")
        watcher = Watcher(state, "capture", phase, "worker") if phase else None
        started = time.monotonic()
        worker = subprocess.Popen([sys.executable, "-m", "coldsnap_probe", "capture", "--pid", str(target.pid),
                                   "--images", str(images), "--boundary", "n580", "--criu", criu], cwd=ROOT,
                                  text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**os.environ, "COLDSNAP_REPORT_DIR": str(reports)})
        _out, err = worker.communicate(timeout=120)
        ended, ended_wall = time.monotonic(), time.time()
        if watcher is None:
            row.update(outcome="captured" if worker.returncode == 0 else "failed", seconds=ended - started)
            target.wait(30)  # the capture ends the dumped tree
            return row
        seen = watcher.result()
        row.update(seen, outcome="killed" if worker.returncode == -9 else f"exit {worker.returncode}",
                   seconds=ended_wall - (watcher.killed_at or ended_wall),
                   phase_named=f"capture phase {phase}\n" in err,
                   guard="capture guard: the worker died" in err, images_left=images.exists(),
                   target_serving=target_ok(control, target.pid, mib))
        row["clean"] = bool(row["outcome"] == "killed" and row["phase_named"] and row["guard"]
                            and not row["images_left"] and row["target_serving"] and row["seconds"] <= 2.0)
        return row
    finally:
        (control / "exit").touch()
        try:
            target.wait(30)
        except subprocess.TimeoutExpired:
            target.kill()
            target.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--criu", required=True)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    become_subreaper()  # the dumped targets and orphaned CRIU runs are reaped here
    rows: list[dict[str, Any]] = []
    for phase in ("audit", "criu-dump", None):
        for _ in range(args.rounds if phase else 3):
            work = Path(tempfile.mkdtemp(prefix="cs-capture-kill-"))
            try:
                rows.append(one_round(work, args.criu, args.mib, phase))
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(json.dumps(rows[-1]), flush=True)
    lines = []
    for phase in ("audit", "criu-dump", "(none)"):
        mine = [r for r in rows if r["phase"] == phase]
        seconds = [float(r["seconds"]) for r in mine]
        lines.append([phase, len(mine), sum(bool(r.get("clean", r["outcome"] == "captured")) for r in mine),
                      ", ".join(sorted({r["outcome"] for r in mine})), f"{percentile(seconds, 50):.3f}",
                      f"{max(seconds):.3f}", sum(bool(r.get("images_left")) for r in mine),
                      sum(r.get("target_serving") is False for r in mine)])
    print(table(["killed in", "rounds", "clean", "outcomes", "p50 s", "max s", "images left", "target lost"], lines))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("clean", r["outcome"] == "captured") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The restore worker's path from its `main` to CRIU's start, on this host, side by side (issue 35 item 2).

    python bench/path_to_criu.py --criu PATH [--before REF] [--restores 12] [--mib 16] [--importtime]
                                 [--captures 0] [--out FILE.json]

A small CPU process (`criu_target.py`, `--mib` MiB) is captured once by this checkout's worker (`python -S -m
coldsnap_probe capture --boundary n580`, as a capsule runs it); then each worker restores those same images in
turn, `--restores` times, every restored process ended and reaped before the next restore (this process is the
subreaper): `--before`'s (that git ref's `coldsnap_probe`, or a directory's, compiled), this checkout's with the
images' carried kernel-feature cache hidden (its kernel probe runs, as before it), and this checkout's as it is.
Each row is a median (p90) in milliseconds over the restores, from the worker's own marks (`worker_start`,
`timeline`; `criu_restore_phases.kdat_probe_s`) and the host's clock around the command; no container
(bench/restore_start.py is the same path through a daemon and Docker).

`--importtime`: then one more restore by this checkout's worker under `python -X importtime`, and the modules its
command imported from the process's start (the interpreter's own included) to CRIU's, the largest first.
`--captures N`: then N captures of a fresh target by each side's worker in turn (`--before`'s and this checkout's):
the dump's CRIU (`timings_s.criu_dump`; an n580 dump probes the kernel itself, an n610 capture's dump loads the
probe its worker ran beside the lock and checkpoint) and the capture command, median (p90) in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import become_subreaper, kill_and_reap, percentile, table, wait_file
from bench.worker_start import package_copy

CARRIED = ("criu-kdat.bin", "criu-kdat.json")  # the capture's kernel-feature cache and its key
# (row, start mark, end mark): `command` and `exited` are the host's clock around the worker's command; the rest
# are the worker's marks; `kdat_probe` is the probe's own seconds (absent: none ran).
ROWS = (
    ("command -> worker main (interpreter)", "command", "worker_main"),
    ("worker main -> guard started", "worker_main", "guard_started"),
    ("worker main -> imports done", "worker_main", "imports_done"),
    ("worker main -> restore_begin", "worker_main", "restore_begin"),
    ("worker main -> validated (every record checked: one rank, while CRIU runs)", "worker_main", "validated"),
    ("**worker main -> CRIU started**", "worker_main", "criu_restore_begin"),
    ("CRIU's kernel probe (its own time; - : none ran)", "kdat_probe", ""),
    ("CRIU restore", "criu_restore_begin", "criu_restore_end"),
    ("command -> CRIU started", "command", "criu_restore_begin"),
    ("command -> exited (the whole worker)", "command", "exited"),
)


def capture(package: Path, criu: str, mib: int, scratch: Path) -> tuple[Path, int]:
    """The target captured by the worker in `package` (into `scratch`): its images and its (now free) PID."""
    return capture_report(package, criu, mib, scratch)[:2]


def capture_report(package: Path, criu: str, mib: int, scratch: Path) -> tuple[Path, int, dict[str, float]]:
    """`capture`, with the capture's `timings_s` and its command's seconds (`command`)."""
    control = scratch / "control"
    control.mkdir(parents=True)
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control), "--mib",
                               str(mib), "--thp-mib", "0", "--shared-mib", "1", "--file-mib", "1", "--zero-mib", "1"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    wait_file(control / "ready")
    images = scratch / "images"
    started = time.perf_counter()
    done = worker(package, "capture", "--pid", str(target.pid), "--images", str(images), "--boundary", "n580",
                  "--criu", criu)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the capture failed: {done.stderr[-2000:]}")
    target.wait()
    return images, target.pid, {**json.loads(done.stdout)["timings_s"], "command": seconds}


def capture_table(sides: dict[str, Path], criu: str, mib: int, captures: int, scratch: Path) -> str:
    """Each side's worker capturing a fresh target, in turn: its dump, the wait for its kernel probe, its command."""
    samples: dict[str, list[dict[str, float]]] = {label: [] for label in sides}
    for n in range(captures):
        for k, (label, package) in enumerate(sides.items()):
            samples[label].append(capture_report(package, criu, mib, scratch / f"capture-{n}-{k}")[2])
    rows = [[what, *(cell(samples[label], key, "")
                     for label in sides)]
            for what, key in (("CRIU's dump (criu_dump)", "criu_dump"),
                              ("the dump's wait for the kernel probe (kdat_wait; -: none ran)", "kdat_wait"),
                              ("the capture command", "command"))]
    return table(["capture, ms: median (p90)", *sides], rows)


def before_package(before: str, into: Path) -> Path:
    """`before`'s `coldsnap_probe` under `into`, compiled: a git ref's, or a directory's that holds one (a machine
    without the repository's history: `git archive REF coldsnap_probe | tar -x -C DIR` made elsewhere)."""
    into.mkdir()
    if (Path(before) / "coldsnap_probe").is_dir():
        shutil.copytree(Path(before) / "coldsnap_probe", into / "coldsnap_probe",
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", before, "coldsnap_probe"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(into)], check=True, stdout=subprocess.DEVNULL)
    return into


def worker(package: Path, *args: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(package), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-S", *flags, "-m", "coldsnap_probe", *args], env=env, cwd=package,
                          capture_output=True, text=True, timeout=120, check=False)


def restore_once(package: Path, images: Path, criu: str, pid: int, work: Path,
                 flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """One restore by the worker in `package`: each mark's unix ns (and the probe's seconds), and its stderr under
    `stderr`; the tree ended."""
    shutil.rmtree(work, ignore_errors=True)
    command = time.time_ns()
    done = worker(package, "restore", "--images", str(images), "--criu", criu, "--work-dir", str(work), flags=flags)
    exited = time.time_ns()
    kill_and_reap([pid])
    if done.returncode != 0:
        raise SystemExit(f"the restore by {package} failed: {done.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    marks: dict[str, Any] = {m["name"]: float(m["unix_ns"]) for m in [*report["worker_start"], *report["timeline"]]}
    marks.update(command=float(command), exited=float(exited))
    probe = (report.get("criu_restore_phases") or {}).get("kdat_probe_s")
    if probe is not None:
        marks["kdat_probe"] = probe
    if flags:
        marks["stderr"] = done.stderr
    return marks


def import_profile(stderr: str, top: int = 25) -> str:
    """`-X importtime`'s lines of the worker up to its last module before CRIU (the guard's process writes to the
    same stderr only when it undoes): the `top` largest, cumulative and self, in milliseconds."""
    rows: list[tuple[int, int, str]] = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "[us]" not in line:
            own, cumulative, name = line[len("import time:"):].split("|")
            rows.append((int(cumulative), int(own), name.rstrip()))
            if name.strip() == "coldsnap_probe._restore":  # the later phases are imported while CRIU runs
                break
    total = sum(own for _, own, _ in rows)
    largest = sorted(rows, reverse=True)[:top]
    return "\n".join([f"{len(rows)} modules, {total / 1e3:.1f} ms in all (self); the {top} largest, ms:",
                      table(["module (indent: its import depth)", "cumulative", "self"],
                            [[name.replace(" ", "\u00a0"), f"{c / 1e3:.1f}", f"{o / 1e3:.1f}"]
                             for c, o, name in largest])])


def cell(samples: list[dict[str, Any]], start: str, end: str) -> str:
    if not end:  # a duration the report states, in seconds
        values = [s[start] * 1e3 for s in samples if start in s]
    else:
        values = [(s[end] - s[start]) / 1e6 for s in samples if start in s and end in s]
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({percentile(values, 90):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--criu", required=True, help="the CRIU the workers run (scripts/criu/build's)")
    parser.add_argument("--before", help="a git ref (or a directory holding its coldsnap_probe) whose worker restores "
                                         "the same images, side by side")
    parser.add_argument("--restores", type=int, default=12)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--importtime", action="store_true", help="then profile one restore's imports")
    parser.add_argument("--captures", type=int, default=0, help="then this many captures by each side's worker")
    parser.add_argument("--out", type=Path, help="also write every restore's marks here (JSON)")
    args = parser.parse_args()
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="path-to-criu-") as name:
        scratch = Path(name)
        now = package_copy(scratch / "now", True)
        images, pid = capture(now, args.criu, args.mib, scratch)
        hidden = scratch / "images-uncarried"  # the same images but the carried cache: the probe runs
        hidden.mkdir()
        for f in images.iterdir():
            if f.name not in CARRIED:
                os.link(f, hidden / f.name) if f.is_file() else shutil.copytree(f, hidden / f.name)
        sides = {"this checkout, cache not carried (kernel probed)": (now, hidden),
                 "this checkout": (now, images)}
        if args.before:
            sides = {f"before ({args.before})": (before_package(args.before, scratch / "before"), images), **sides}
        samples: dict[str, list[dict[str, Any]]] = {label: [] for label in sides}
        for _ in range(args.restores):
            for label, (package, restored) in sides.items():
                samples[label].append(restore_once(package, restored, args.criu, pid, scratch / "work"))
        profiled = restore_once(now, images, args.criu, pid, scratch / "work", ("-X", "importtime")) \
            if args.importtime else None
        captured = capture_table({label: package for label, (package, restored) in sides.items()
                                  if restored == images}, args.criu, args.mib, args.captures, scratch) \
            if args.captures else None
    print(f"{args.restores} restores each, {args.mib} MiB CPU process, ms: median (p90)\n")
    print(table(["phase", *sides], [[row, *(cell(samples[label], start, end) for label in sides)]
                                    for row, start, end in ROWS]))
    if captured is not None:
        print(f"\n{args.captures} captures each, {args.mib} MiB CPU process:\n\n{captured}")
    if profiled is not None:
        print(f"\nthis checkout, one restore under -X importtime: {import_profile(profiled['stderr'])}")
    if args.out:
        args.out.write_text(json.dumps(samples, indent=1) + "\n")


if __name__ == "__main__":
    main()

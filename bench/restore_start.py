"""A restore's fixed costs, phase by phase, through a real daemon (issue 35 item 2): from the restore unit's
`workload-run` to CRIU's start, and from the worker's readiness to the daemon's last answer.

    python bench/restore_start.py --criu PATH [--restores 8] [--before REF] [--mib 64] [--image TAG] [--out DIR]

A CPU process (`--mib` MiB of pages, a session leader at PID 300) runs in a unit of `--image` (busybox) with the
host's /usr, /lib and /lib64 and the worker (`coldsnap_probe`, compiled, as a capsule carries it) mounted read-only;
the worker captures it there (`capture --boundary n580`, CRIU `--criu`). Then `--restores` restore units, each
launched, awaited and inspected as bench/e2e_restore.py does it for the H200 (the same `launch_unit` and
`await_unit`: the readiness check through `workload-exec`, the report, `workload-inspect`). With `--before REF`,
that git ref's daemon and worker restore the same images too (a second daemon, run from that ref's packages), the
two taking turns: the columns are side by side, one run. Each phase's median and 90th percentile over the
restores, in milliseconds, from the host clock, Docker's `StartedAt` and the worker's own marks (`timeline`,
`worker_start`; a worker without a mark shows "-").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import table
from bench._daemon import running_daemon
from bench.e2e_restore import (
    IMAGES,
    READY,
    WORKER_PATH,
    Driver,
    E2EError,
    Layout,
    await_unit,
    launch_unit,
    output,
    unix,
)

CRIU_IN_UNIT = "/opt/coldsnap/criu/criu"
PYTHON = "/usr/bin/python3"
TARGET_PID = 300  # free in every restore unit (spec 7.3: the captured PIDs must be)
TARGET = ("import os, time\nb = bytes(range(256)) * ({mib} << 12)\n"
          "open('/tmp/target-ready.tmp', 'w').write(str(os.getpid())); os.rename('/tmp/target-ready.tmp', "
          "'/tmp/target-ready')\ntime.sleep(1e9)\n")
# (row, start mark, end mark): the host's `request`, `reply`, `readied`, `inspected`; Docker's `started`; the rest
# are the worker's marks.
PHASES = (
    ("workload-run request -> reply (daemon, dockerd create + start)", "request", "reply"),
    ("request -> container started (Docker StartedAt)", "request", "started"),
    ("container started -> worker main (shell, interpreter)", "started", "worker_main"),
    ("worker main -> imports done (a worker since 51b2ce3: the guard's fork first)", "worker_main", "imports_done"),
    ("imports done -> restore_begin (before 51b2ce3: the guard's fork)", "imports_done", "restore_begin"),
    ("container started -> restore_begin (all of the above)", "started", "restore_begin"),
    ("restore_begin -> CRIU started (identity and target check, shm files)", "restore_begin", "criu_restore_begin"),
    ("CRIU started -> validated (one rank: the records checked while CRIU runs)", "criu_restore_begin", "validated"),
    ("worker main -> CRIU started (the worker's path to CRIU: issue 35 item 2)", "worker_main", "criu_restore_begin"),
    ("CRIU's kernel probe, its own time (-: none ran, the capture's cache was carried)", "kdat_zero", "kdat_probe"),
    ("CRIU restore", "criu_restore_begin", "criu_restore_end"),
    ("CRIU end -> ready", "criu_restore_end", "ready"),
    ("ready -> readiness seen (report written, readiness exec)", "ready", "readied"),
    ("readiness seen -> inspected (the driver's work after readiness)", "readied", "inspected"),
    ("a second exec reading the report (the driver before this; in no total)", "report_exec_begin",
     "report_exec_end"),
    ("request -> restore_begin (e2e's worker_started_s)", "request", "restore_begin"),
    ("request -> CRIU started", "request", "criu_restore_begin"),
    ("request -> inspected (all)", "request", "inspected"),
)


@dataclass
class CpuLayout(Layout):
    """A capsule made of the host: busybox, the host's interpreter and libraries, the worker and CRIU mounted."""

    worker: Path = Path()
    criu_binary: Path = Path()

    def mounts(self) -> list[dict[str, Any]]:
        return [*super().mounts(), {"source": str(self.worker), "target": WORKER_PATH, "read_only": True},
                {"source": str(self.criu_binary), "target": CRIU_IN_UNIT, "read_only": True}]


def worker_copy(parent: Path, ref: str | None) -> Path:
    """`coldsnap_probe` of `ref` (None: this checkout) under `parent`, compiled as a capsule carries it; for a ref,
    its daemon's packages beside it (the daemon of that side runs from there)."""
    parent.mkdir(parents=True)
    if ref is None:
        shutil.copytree(ROOT / "coldsnap_probe", parent / "coldsnap_probe",
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "coldsnap_probe", "coldsnap_provider",
                                  "coldsnap_runtime", "nccl_shim"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(parent)], input=archive, check=True)
    subprocess.run([PYTHON, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash", str(parent)],
                   check=True, stdout=subprocess.DEVNULL)
    return parent


async def capture(d: Driver, layout: CpuLayout, image: str, mib: int) -> str:
    """The target started in its unit and captured there by the worker; the capture's ID."""
    name, capture_id = f"rs-target-{os.getpid()}", "rs-capture"
    command = (f"echo {TARGET_PID - 1} > /proc/sys/kernel/ns_last_pid; setsid {PYTHON} -S -c "
               f"\"$TARGET\" </dev/null >/dev/null 2>&1 & exec sleep 2147483647")
    spec = layout.unit(name, image, entrypoint="sh", command=["-c", command])
    spec["environment"] = {**spec["environment"], "TARGET": TARGET.format(mib=mib)}
    await d.expect(f"starting {name}", "workload-run", workload=spec)
    try:
        wait = "n=0; until test -s /tmp/target-ready; do n=$((n+1)); [ $n -gt 3000 ] && exit 1; sleep 0.01; done"
        pid = output(await d.expect("the target's pid", "workload-exec", name=name, execution={
            "command": ["sh", "-c", f"{wait}; cat /tmp/target-ready"]})).strip()
        if pid != str(TARGET_PID):
            raise E2EError(f"the target runs as PID {pid}, not {TARGET_PID}: the restore units would collide")
        await d.expect("the capture", "workload-exec", name=name, execution={"command": [
            "sh", "-c", f"{layout.worker_environment()} {PYTHON} -S -m coldsnap_probe capture --pid {pid} "
                        f"--images {IMAGES}/{capture_id} --boundary n580 --criu {CRIU_IN_UNIT} >/dev/null"]})
    finally:
        await d.runtime("workload-remove", name=name)
    return capture_id


async def restore(d: Driver, layout: CpuLayout, image: str, capture_id: str, name: str) -> dict[str, float]:
    """One restore unit through the daemon, removed after; every instant the phases need (unix seconds)."""
    labels = {"io.coldsnap-bench.restore-start": "1"}
    try:
        request, reply = await launch_unit(d, image, layout, name, capture_id, labels=labels)
        unit = await await_unit(d, name, request, labels=labels, readiness_timeout=60)
        asked = time.time()  # what reading the report in an exec of its own cost (the driver's way before)
        await d.expect("the report, read again", "workload-exec", name=name, execution={"command": ["cat", READY]})
        read = time.time()
    finally:
        await d.runtime("workload-remove", name=name)
    report = unit["worker_report"]
    marks = {m["name"]: m["unix_ns"] / 1e9 for m in [*report.get("worker_start", []), *report["timeline"]]}
    marks.setdefault("criu_restore_begin", marks["criu_restore_end"] - report["criu_restore_seconds"])
    readied = request + unit["readiness_s"]
    probe = (report.get("criu_restore_phases") or {}).get("kdat_probe_s")
    if probe is not None:  # a duration of its own, as a pair of instants
        marks.update(kdat_zero=0.0, kdat_probe=probe)
    return {**marks, "request": request, "reply": reply, "started": unix(unit["started_at"]), "readied": readied,
            "inspected": readied + unit["inspect_s"], "report_exec_begin": asked, "report_exec_end": read}


def rows(runs: dict[str, list[dict[str, float]]]) -> list[list[str]]:
    """Per phase, per worker: median (90th percentile) in milliseconds over the restores that have both marks."""
    out = []
    for label, start, end in PHASES:
        cells = [label]
        for samples in runs.values():
            values = sorted((s[end] - s[start]) * 1e3 for s in samples if start in s and end in s)
            cells.append(f"{statistics.median(values):.1f} ({values[int(0.9 * (len(values) - 1))]:.1f})"
                         if values else "-")
        out.append(cells)
    return out


async def run(args: argparse.Namespace, work: Path) -> dict[str, list[dict[str, float]]]:
    sides = {"this checkout": (worker_copy(work / "after", None), ROOT)}  # label -> (worker, the daemon's checkout)
    if args.before:
        before = worker_copy(work / "before", args.before)
        sides = {f"before ({args.before}): its daemon and worker": (before, before), **sides}
    (work / "weights").mkdir()
    layouts = {label: CpuLayout(run_dir=work / "run", images_dir=work / "images", weights=work / "weights",
                                python=PYTHON, host_mounts=("/usr", "/lib", "/lib64"), gpus=(), criu=CRIU_IN_UNIT,
                                worker=worker, criu_binary=Path(args.criu).resolve())
               for label, (worker, _) in sides.items()}
    layouts["this checkout"].prepare()
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in layouts}
    async with contextlib.AsyncExitStack() as stack:
        drivers = {}
        for n, (label, (_, checkout)) in enumerate(sides.items()):
            # As on the GPU machine: privileged units get the engine's capabilities (its bounding set lacks one
            # here too), and every unit gets a report directory (the live phase).
            config = (f'[runtime]\nprivileged = "host-capabilities"\n'
                      f'[metrics]\naddress = "unix:{work}/metrics-{n}.sock"\n')
            daemon = await stack.enter_async_context(running_daemon(config, cwd=checkout))
            drivers[label] = Driver(daemon.state_dir)
            await drivers[label].open()
        capture_id = await capture(drivers["this checkout"], layouts["this checkout"], args.image, args.mib)
        for attempt in range(args.restores):
            for label, layout in layouts.items():
                runs[label].append(await restore(drivers[label], layout, args.image, capture_id,
                                                 f"rs-restore-{os.getpid()}"))
                print(f"[{label}] restore {attempt + 1}: request -> restore_begin "
                      f"{(runs[label][-1]['restore_begin'] - runs[label][-1]['request']) * 1e3:.1f} ms", flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--criu", required=True, help="the CRIU binary (scripts/criu/build's)")
    parser.add_argument("--restores", type=int, default=8)
    parser.add_argument("--before", help="a git ref whose worker restores the same images, side by side")
    parser.add_argument("--mib", type=int, default=64, help="the target's memory")
    parser.add_argument("--image", default="coldsnap-test/busybox:1")
    parser.add_argument("--out", type=Path, help="a directory for restore-start.json and restore-start.md")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cs-restore-start-", dir="/tmp"))
    try:
        runs = anyio.run(run, args, work)
    except E2EError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = (f"{args.restores} restores each, {args.mib} MiB CPU process, milliseconds: median (p90)\n\n"
            + table(["phase", *runs], rows(runs)))
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "restore-start.json").write_text(json.dumps(runs, indent=1) + "\n")
        (args.out / "restore-start.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

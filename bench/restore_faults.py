"""The tail under faults (issue 35 item 4): ≥ 100 restores of one capture through a real daemon, a fault in every phase
in turn, and after every step a check, for real, of what was left.

    python bench/restore_faults.py --state-dir DIR --capsule TAG --model DIR --work DIR --out DIR
                                   [--restores 100] [--port 18471] [--images-root DIR] [--build CONTEXT=TAG]

Against a running `coldsnap-provider serve` (`[metrics] address` set, so that every unit has a report directory;
`[gpus] mode = "native"`), through runtime-v1 envelopes only (bench/e2e_restore.py's `Driver`), with the units of
bench/e2e_serve.py's `full-interposer-hydrator` path (bench/serve_units.py): `transformers serve` unchanged under
the CUDA interposer, a staging node hydrator beside it. The server is started cold and captured once; then rounds,
each one fault and the clean restore after it, the faults in turn:

* capture: the worker killed in cuda-lock, cuda-checkpoint or criu-dump (a restored server captured again; the
  watcher SIGKILLs the worker as the phase begins);
* restore: the restore unit's worker killed in criu-restore, cuda-restore or hydrate, the same way;
* the node hydrator killed during a stage (as the restore's CRIU phase begins) or between restores (before it);
  it is started again after;
* an image: the pages image truncated (a truncated copy in its place), the pagemap image unreadable (a dangling
  link in its place); put back after (the same inode: a device dump file is not touched, since a changed file
  identity would make every later restore digest its dump and skip the node hydrator's stage).

The watcher (bench/fault_checks.py) acts from outside: it reads the worker's live phase from the report directory
and kills with a signal. A faulted operation must restore or fail within 2 s of the fault, its reply naming the
phase; a faulted capture must leave the server serving (the same completion) and no images. After every step: no
process on the GPU locked or checkpointed (the driver's own state of each), none but the node hydrator left, no
unit left (the daemon's inspect), no stage left on the hydrator (its `status`). Each step is a row (fault, outcome,
seconds, phase named, leftovers); the table per fault and `faults.json` go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table
from bench.e2e_restore import (
    Driver,
    E2EError,
    await_unit,
    capture,
    inspect_capsule,
    launch_unit,
    unit_labels,
    wait_hydrator,
)
from bench.e2e_serve import build_capsules, unit_names
from bench.fault_checks import Watcher, gpu_states, stages_left
from bench.interposer_units import STAGING_SOCKET, InterposerLayout, start_staging_hydrator
from bench.serve_client import ClientError, stream_chat
from bench.serve_units import HOST, body, cluster, restore_once, serve_layout, start_cold
from coldsnap_probe import pids_by_argv

MODE = "full-interposer-hydrator"
CLEAN_S = 2.0  # a faulted operation restores or fails within this many seconds of the fault
FAULTS = ("capture:cuda-lock", "capture:cuda-checkpoint", "capture:criu-dump", "restore:criu-restore",
          "restore:cuda-restore", "restore:hydrate", "hydrator:during-stage", "hydrator:between-restores",
          "image:pages-truncated", "image:pagemap-unreadable")


class Run:
    """One run's state: the daemon, the path's layout and units, the capture, the cold completion, the rows."""

    def __init__(self, d: Driver, args: argparse.Namespace, image: str, layout: InterposerLayout) -> None:
        self.d, self.args, self.image, self.layout = d, args, image, layout
        self.cold_name, self.unit, self.hydrator = unit_names(MODE)
        self.capture_id, self.cold_text, self.server_pid = "", "", 0
        self.restores, self.rows = 0, []  # type: int, list[dict[str, Any]]

    @property
    def images(self) -> Path:
        return self.layout.images_dir / self.capture_id

    def hydrator_socket(self) -> Path:
        assert self.layout.interposer_dir is not None
        return self.layout.interposer_dir / Path(STAGING_SOCKET).name

    async def start_hydrator(self) -> None:
        service = await start_staging_hydrator(self.d, self.image, self.layout, self.hydrator)
        await wait_hydrator(self.d, self.hydrator, service["created_unix"])

    async def restore(self) -> dict[str, Any]:
        """A clean restore and the client's request; the unit is kept (the caller removes it)."""
        self.restores += 1
        done = await restore_once(self.d, self.image, self.layout, self.unit, self.capture_id, cluster(MODE),
                                  self.args.port)
        done["identical"] = done["text"] == self.cold_text
        return done

    async def remove_unit(self) -> None:
        await self.d.runtime("workload-remove", name=self.unit)


def named_phase(message: str, kind: str) -> str | None:
    """The last phase a failure's message names (`<kind> phase <name>`: the worker's phase lines, its error line)."""
    at = message.rfind(f"{kind} phase ")
    if at < 0:
        return None
    return message[at + len(kind) + 7:].split(None, 1)[0].rstrip(":") or None


def phase_named(message: str, kind: str, phase: str | None) -> bool:
    """Whether the failure's reply names `phase` as the one it stopped in."""
    return bool(phase) and named_phase(message, kind) == phase


async def fault_capture(run: Run, phase: str) -> dict[str, Any]:
    """A restored server captured again, its worker killed as `phase` begins: the server serves the same
    completion afterwards, no images are left."""
    restored = await run.restore()
    row: dict[str, Any] = {"restore_identical": restored["identical"]}
    target = f"{run.capture_id}-fault-{len(run.rows)}"
    watcher = Watcher(run.d.state_dir, "capture", phase, "worker")
    try:
        await capture(run.d, run.unit, run.server_pid, run.layout, target, hydrate=False)
        row["outcome"] = "captured"
    except E2EError as exc:
        row.update(outcome="failed", error=str(exc)[-2000:], replied_unix=time.time())
    _watched(row, watcher, "capture")
    row["guard_undid"] = "capture guard: the worker died" in row.get("error", "")
    row["images_left"] = (run.layout.images_dir / target).exists()
    shutil.rmtree(run.layout.images_dir / target, ignore_errors=True)  # a completed capture's (the fault missed)
    if row["outcome"] == "captured":  # the fault missed its phase: a capture that completed ends its server
        await run.remove_unit()
        return row
    try:
        served = await stream_chat(HOST, run.args.port, body(), connect_limit=10)
        row["served_after"] = served.text == run.cold_text
    except ClientError as exc:
        row.update(served_after=False, served_error=str(exc))
    await run.remove_unit()
    return row


def _watched(row: dict[str, Any], watcher: Watcher, kind: str) -> None:
    """What the watcher saw into `row`: its account, the seconds from the kill to the failed reply, and whether
    the reply named the phase the worker was killed in."""
    seen = row["watch"] = watcher.result()
    if seen["killed"] and "replied_unix" in row:
        row["seconds"] = row.pop("replied_unix") - watcher.killed_at  # type: ignore[operator]
    row["phase_named"] = phase_named(row.get("error", ""), kind, seen["killed_in"])


async def fault_restore(run: Run, phase: str) -> dict[str, Any]:
    """The restore unit's worker killed as `phase` begins: the unit fails naming the phase, and is removed."""
    run.restores += 1
    labels = unit_labels(run.capture_id, cluster(MODE))
    watcher = Watcher(run.d.state_dir, "restore", phase, "worker")
    row: dict[str, Any] = {}
    try:
        created, _ = await launch_unit(run.d, run.image, run.layout, run.unit, run.capture_id, labels=labels)
        await await_unit(run.d, run.unit, created, labels=labels, readiness_timeout=60, window=0.2)
        row["outcome"] = "restored"
    except E2EError as exc:
        row.update(outcome="failed", error=str(exc)[-2000:], replied_unix=time.time())
    _watched(row, watcher, "restore")
    await run.remove_unit()
    return row


async def fault_hydrator(run: Run, during: bool) -> dict[str, Any]:
    """The node hydrator killed while a restore stages on it, or before a restore: the restore still succeeds (the
    interposer fills the device memory itself) with the same completion; the hydrator is started again."""
    pids = pids_by_argv(["coldsnap_probe.hydration", "serve", "--staging"])
    row: dict[str, Any] = {"hydrator_pids": pids}
    watcher = Watcher(run.d.state_dir, "restore", "criu-restore", pids[0]) if during and pids else None
    if not during:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    started = time.time()
    try:
        done = await run.restore()
        row.update(outcome="restored", identical=done["identical"], staged=done.get("device_staged"),
                   seconds=done["first_token_s"])
    except (E2EError, ClientError) as exc:
        row.update(outcome="failed", error=str(exc)[-2000:], seconds=time.time() - started)
    if watcher is not None:
        row["watch"] = watcher.result()
    await run.remove_unit()
    await run.d.runtime("workload-remove", name=run.hydrator)
    await run.start_hydrator()
    return row


def _largest(paths: list[Path]) -> Path:
    return max(paths, key=lambda p: p.stat().st_size)


def _spoil(victim: Path, *, truncate: bool) -> Path:
    """Put `victim` aside and leave in its place its first half, or a dangling link; where it was put."""
    aside = victim.with_name(victim.name + ".aside")
    os.rename(victim, aside)
    if not truncate:
        victim.symlink_to("/nonexistent/coldsnap-fault")
        return aside
    left = aside.stat().st_size // 2
    with open(aside, "rb") as source, open(victim, "wb") as copy:
        while left > 0:
            left -= os.copy_file_range(source.fileno(), copy.fileno(), left) or left
    shutil.copystat(aside, victim)
    return aside


async def fault_image(run: Run, how: str) -> dict[str, Any]:
    """The pages image truncated, or the pagemap image unreadable (a dangling link in its place): the restore
    fails naming the phase (or restores), and the file is put back."""
    phase = "criu-restore"
    victim = _largest(list(run.images.glob("pages-*.img" if how == "pages-truncated" else "pagemap-*.img")))
    aside = _spoil(victim, truncate=how == "pages-truncated")
    row: dict[str, Any] = {"file": str(victim.relative_to(run.images))}
    run.restores += 1
    labels = unit_labels(run.capture_id, cluster(MODE))
    started = time.time()
    try:
        created, _ = await launch_unit(run.d, run.image, run.layout, run.unit, run.capture_id, labels=labels)
        await await_unit(run.d, run.unit, created, labels=labels, readiness_timeout=60, window=0.2)
        row["outcome"] = "restored"
    except E2EError as exc:
        row.update(outcome="failed", error=str(exc)[-2000:])
    row["seconds"] = time.time() - started
    row["phase_named"] = phase_named(row.get("error", ""), "restore", phase)
    await run.remove_unit()
    victim.unlink()
    os.rename(aside, victim)
    return row


async def leftovers(run: Run) -> list[str]:
    """What the step left on the node, each checked for real (waiting up to 3 s for the driver and the hydrator's
    idle pass to see a removed unit's processes go)."""
    left: list[str] = []
    deadline = time.monotonic() + 3.0
    hydrators = set(pids_by_argv(["coldsnap_probe.hydration", "serve", "--staging"]))
    while True:
        states = await anyio.to_thread.run_sync(gpu_states)
        held = {p: s for p, s in states.items() if s != "running"}
        others = sorted(set(states) - hydrators)
        stages = stages_left(run.hydrator_socket())
        if (not held and not others and not stages) or time.monotonic() > deadline:
            break
        await anyio.sleep(0.1)
    left += [f"GPU process {p} {s}" for p, s in held.items()]
    left += [f"GPU process {p} left (not the node hydrator)" for p in others]
    left += [f"stage {s.get('key', '')[:19]} ({s.get('bytes')} bytes)" for s in stages or []]
    for name in (run.unit, run.cold_name):
        if not await run.d.gone(name):
            left.append(f"unit {name}")
    return left


async def step(run: Run, fault: str) -> None:
    """One round: the fault, its checks, then the clean restore after it and its checks."""
    kind, what = fault.split(":", 1)
    handlers: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "capture": lambda: fault_capture(run, what), "restore": lambda: fault_restore(run, what),
        "hydrator": lambda: fault_hydrator(run, what == "during-stage"), "image": lambda: fault_image(run, what)}
    started = time.time()
    try:
        row = await handlers[kind]()
    except (E2EError, ClientError, OSError, KeyError, ValueError) as exc:
        row = {"outcome": "bench error", "error": f"{type(exc).__name__}: {exc}"[-2000:]}
        await run.remove_unit()
    row.update(fault=fault, step_s=round(time.time() - started, 3), leftovers=await leftovers(run))
    row["clean"] = clean_verdict(row)
    run.rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "error"}, default=str)[:600], flush=True)
    after: dict[str, Any] = {"fault": f"restore after {fault}"}
    try:
        done = await run.restore()
        after.update(outcome="restored", identical=done["identical"], seconds=done["first_token_s"])
    except (E2EError, ClientError) as exc:
        after.update(outcome="failed", error=str(exc)[-2000:])
    await run.remove_unit()
    after["leftovers"] = await leftovers(run)
    after["clean"] = after["outcome"] == "restored" and after.get("identical") is True and not after["leftovers"]
    run.rows.append(after)


def clean_verdict(row: dict[str, Any]) -> bool:
    """A faulted step is clean when it restored (the same completion) or failed within CLEAN_S naming its phase,
    left nothing, and (a capture) left the server serving and no images."""
    if row["leftovers"] or row.get("images_left") or row.get("served_after") is False:
        return False
    if row["outcome"] in ("restored", "captured"):  # the operation succeeded (a fault that missed its phase too)
        return row.get("identical", True) is not False and row.get("restore_identical", True) is not False
    return row["outcome"] == "failed" and bool(row.get("phase_named")) and float(row.get("seconds", 99)) <= CLEAN_S


def summary(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """One line per fault: steps, clean, outcomes, seconds (max), phase named, leftovers."""
    lines = []
    for fault in [*FAULTS, *(f"restore after {f}" for f in FAULTS)]:
        mine = [r for r in rows if r["fault"] == fault]
        if not mine:
            continue
        outcomes: dict[str, int] = {}
        for r in mine:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        failed = [r for r in mine if r["outcome"] == "failed"]
        seconds = [float(r["seconds"]) for r in mine if isinstance(r.get("seconds"), (int, float))]
        lines.append([fault, len(mine), sum(r["clean"] for r in mine),
                      ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())),
                      f"{max(seconds):.2f}" if seconds else "-",
                      f"{sum(bool(r.get('phase_named')) for r in failed)}/{len(failed)}" if failed else "-",
                      sum(len(r["leftovers"]) for r in mine)])
    return lines


def totals(run: Run) -> dict[str, Any]:
    rows = run.rows
    faulted = [r for r in rows if not r["fault"].startswith("restore after")]
    failed = [r for r in faulted if r["outcome"] == "failed"]
    left = [x for r in rows for x in r["leftovers"]]
    return {"restores": run.restores, "steps": len(rows), "faulted": len(faulted),
            "clean": sum(r["clean"] for r in rows), "failures": len(failed),
            "failures_naming_phase": sum(bool(r.get("phase_named")) for r in failed),
            "gpu_locked_or_checkpointed": sum(" locked" in x or " checkpointed" in x for x in left),
            "units_or_stages_left": sum(x.startswith(("unit ", "stage ")) for x in left),
            "faults_missed": sum(1 for r in faulted if (r.get("watch") or {}).get("killed") is False),
            "restores_after_identical": sum(bool(r.get("identical")) for r in rows
                                            if r["fault"].startswith("restore after"))}


def report(run: Run, out: Path, cold: dict[str, Any]) -> str:
    text = table(["fault", "steps", "clean", "outcomes", "max s", "phase named", "leftovers"], summary(run.rows))
    counts = totals(run)
    text += "\n\n" + ", ".join(f"{k} {v}" for k, v in counts.items())
    (out / "faults.json").write_text(json.dumps({"mode": MODE, "cold": cold, "capture_id": run.capture_id,
                                                 "totals": counts, "rows": run.rows}, indent=1, default=str))
    (out / "faults-table.md").write_text(text + "\n")
    return text


async def prepare(d: Driver, args: argparse.Namespace) -> tuple[Run, dict[str, Any]]:
    """The capsule pinned, the node hydrator, the cold server and its completion, the one capture."""
    await build_capsules(d, args.build)
    image = str((await inspect_capsule(d, args.capsule))["id"])
    work = Path(args.work) / MODE
    shutil.rmtree(work, ignore_errors=True)
    layout = serve_layout(work, Path(args.model), MODE)
    if args.images_root:
        layout.images_dir = Path(args.images_root) / MODE
        shutil.rmtree(layout.images_dir, ignore_errors=True)
    layout.prepare()
    run = Run(d, args, image, layout)
    await run.start_hydrator()
    cold = await start_cold(d, image, layout, run.cold_name, args.port)
    run.cold_text, run.server_pid = cold["text"], int(cold["server_pid"])
    run.capture_id = f"faults-{time.strftime('%Y%m%dT%H%M%S')}"
    captured = await capture(d, run.cold_name, run.server_pid, layout, run.capture_id, hydrate=False)
    await d.expect(f"removing {run.cold_name}", "workload-remove", name=run.cold_name)
    cold["capture_timings_s"] = captured.get("timings_s")
    print(f"cold {cold['first_token_s']:.2f} s, captured: {cold['capture_timings_s']}", flush=True)
    return run, cold


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("--state-dir", "--capsule", "--model", "--work", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--restores", type=int, default=100)
    parser.add_argument("--port", type=int, default=18471)
    parser.add_argument("--images-root")
    parser.add_argument("--budget-s", type=float, default=0, help="start no round after this many seconds (0: none)")
    parser.add_argument("--build", action="append", default=[], metavar="CONTEXT=TAG")
    args = parser.parse_args()
    began = time.monotonic()
    d = Driver(Path(args.state_dir))
    await d.open()
    run, cold = await prepare(d, args)
    try:
        turn = 0
        while run.restores < args.restores and not (args.budget_s and time.monotonic() - began > args.budget_s):
            await step(run, FAULTS[turn % len(FAULTS)])
            turn += 1
            report(run, Path(args.out), cold)  # after each round: a run cut short keeps what it did
    finally:
        for name in (run.unit, run.cold_name, run.hydrator):
            await d.runtime("workload-remove", name=name)
        shutil.rmtree(run.layout.images_dir, ignore_errors=True)
    text = report(run, Path(args.out), cold)
    print(text, flush=True)
    counts = totals(run)
    ok = counts["clean"] == counts["steps"] and counts["restores"] >= args.restores
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

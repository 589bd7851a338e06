"""bench/restore_faults.py's CPU-checkable parts: the watcher kills a real process from outside as the live phase it
publishes (a real `.phase-<pid>` file, written by coldsnap_probe._phase) reaches the phase named, and not before;
the phase a failure's reply names; the verdict on a step; the counts the run reports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.fault_checks import Watcher, host_pid_of
from bench.restore_faults import FAULTS, Run, clean_verdict, named_phase, phase_named, summary, totals

# A stand-in worker: its command line has the words the watcher looks for; it publishes phases as the real one does.
WORKER = """
import os, sys, time
from coldsnap_probe import _phase
phases = _phase.PhaseLog("restore")
for phase in sys.argv[1].split(","):
    phases.enter(phase)
    time.sleep(0.3)
print("finished", flush=True)
"""


def start_worker(reports: Path, phases: str) -> subprocess.Popen[str]:
    env = {**os.environ, "COLDSNAP_REPORT_DIR": str(reports), "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen([sys.executable, "-c", WORKER, phases, "coldsnap_probe", "restore"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_watcher_kills_the_worker_as_the_phase_begins_and_names_it(tmp_path: Path) -> None:
    reports = tmp_path / "capsule-reports" / "unit-1"
    reports.mkdir(parents=True)
    watcher = Watcher(tmp_path, "restore", "cuda-restore", "worker", limit=30)
    worker = start_worker(reports, "validate,criu-restore,cuda-restore,hydrate")
    out, err = worker.communicate(timeout=30)
    seen = watcher.result()
    assert worker.returncode == -signal.SIGKILL and "finished" not in out
    assert seen["killed"] and seen["killed_pid"] == worker.pid and seen["killed_in"] == "cuda-restore", seen
    assert seen["phases_seen"] == ["validate", "criu-restore", "cuda-restore"]
    assert named_phase(err, "restore") == "cuda-restore" and "hydrate" not in err  # its log ends with the phase


def test_a_watcher_whose_phase_never_comes_kills_nothing(tmp_path: Path) -> None:
    reports = tmp_path / "capsule-reports" / "unit-1"
    reports.mkdir(parents=True)
    watcher = Watcher(tmp_path, "restore", "hydrate", "worker", limit=30)
    worker = start_worker(reports, "validate,criu-restore")
    out, _ = worker.communicate(timeout=30)
    time.sleep(0.1)
    seen = watcher.result()
    assert worker.returncode == 0 and "finished" in out and not seen["killed"] and seen["killed_pid"] is None


def test_host_pid_of_matches_the_namespace_pid_and_the_command_line() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "coldsnap_probe", "capture"])
    try:
        deadline = time.monotonic() + 10  # until the child has exec'd (its command line is the parent's before)
        while b"coldsnap_probe" not in Path(f"/proc/{sleeper.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the sleeper never showed its command line"
            time.sleep(0.01)
        assert host_pid_of(sleeper.pid, "coldsnap_probe capture") == sleeper.pid  # one namespace here
        assert host_pid_of(sleeper.pid, "coldsnap_probe restore") is None
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(("message", "kind", "phase"), [
    ("coldsnap-worker: restore phase validate\ncoldsnap-worker: restore phase criu-restore\n", "restore",
     "criu-restore"),
    ("exited 1: coldsnap-worker: capture phase cuda-lock\nerror: capture phase cuda-lock: WorkerError: x", "capture",
     "cuda-lock"),
    ("restore unit exited (code 1); its log ends:\nerror: WorkerError: criu restore exited 1", "restore", None),
])
def test_the_phase_a_reply_names_is_its_last(message: str, kind: str, phase: str | None) -> None:
    assert named_phase(message, kind) == phase
    assert phase_named(message, kind, phase) is (phase is not None)
    assert not phase_named(message, kind, "hydrate")


def row(**fields: Any) -> dict[str, Any]:
    return {"fault": FAULTS[0], "outcome": "failed", "seconds": 0.4, "phase_named": True, "leftovers": [], **fields}


@pytest.mark.parametrize(("fields", "clean"), [
    ({}, True),
    ({"seconds": 2.5}, False),  # failed, but not within 2 s
    ({"phase_named": False}, False),
    ({"leftovers": ["GPU process 7 locked"]}, False),
    ({"images_left": True}, False),
    ({"served_after": False}, False),  # a faulted capture must leave the server serving
    ({"outcome": "restored", "identical": True}, True),
    ({"outcome": "restored", "identical": False}, False),
    ({"outcome": "bench error"}, False),
])
def test_a_step_is_clean_only_when_it_restored_or_failed_fast_naming_its_phase_leaving_nothing(
        fields: dict[str, Any], clean: bool) -> None:
    assert clean_verdict(row(**fields)) is clean


def test_the_counts_say_what_was_left_and_how_many_failures_named_their_phase() -> None:
    run = Run.__new__(Run)
    run.restores = 3
    left = ["GPU process 9 checkpointed", "unit servefullinterposerhydrator_node_0"]
    run.rows = [row(clean=True), row(phase_named=False, clean=False, leftovers=left),
                {"fault": f"restore after {FAULTS[0]}", "outcome": "restored", "identical": True, "leftovers": [],
                 "clean": True}]
    counts = totals(run)
    assert counts == {"restores": 3, "steps": 3, "faulted": 2, "clean": 2, "failures": 2, "failures_naming_phase": 1,
                      "gpu_locked_or_checkpointed": 1, "units_or_stages_left": 1, "faults_missed": 0,
                      "restores_after_identical": 1}
    lines = summary(run.rows)
    assert lines[0] == [FAULTS[0], 2, 1, "failed 2", "0.40", "1/2", 2]
    assert lines[1][0] == f"restore after {FAULTS[0]}"


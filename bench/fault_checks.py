"""The host side of bench/restore_faults.py: a watcher that kills a worker (or the node hydrator) from outside as a
phase begins, and the checks for what a step left behind, done for real on the node.

* `Watcher`: reads the workers' live phase (`.phase-<pid>` in the daemon's per-unit report directories,
  `<state>/capsule-reports/*/`, written by coldsnap_probe/_phase.py), finds the worker's host PID (the file names
  its PID in the unit's namespace: matched on /proc/*/status NSpid and the worker's command line) as soon as it
  appears, and SIGKILLs the victim the moment the phase named begins (polled every 0.2 ms);
* `gpu_states`: every process on the GPU (nvidia-smi's compute apps) with the CUDA driver's own checkpoint state of
  it (`cuCheckpointProcessGetState` through libcuda, ctypes: running, locked, checkpointed, failed);
* `stages_left`: what the node hydrator still holds (its `status`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from coldsnap_probe import jsonline, pids_by_argv

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}  # CUprocessState
POLL_S = 0.0002


def host_pid_of(ns_pid: int, needle: str) -> int | None:
    """The host PID of the process whose PID in its own namespace is `ns_pid` and whose command line has `needle`."""
    for pid in pids_by_argv(needle.split()):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        line = next((x for x in status.splitlines() if x.startswith("NSpid:")), "")
        if line and int(line.split()[-1]) == ns_pid:
            return pid
    return None


class Watcher:
    """Kill `victim` ("worker", or a host PID: the node hydrator) when a `kind` worker (capture, restore) begins
    `phase`. Started before the operation; `result()` says what it saw and did."""

    def __init__(self, state_dir: Path, kind: str, phase: str, victim: str | int, limit: float = 120.0) -> None:
        self.reports, self.kind, self.phase, self.victim = state_dir / "capsule-reports", kind, phase, victim
        self.limit, self.started = limit, time.time()
        self.killed_at: float | None = None
        self.seen: list[str] = []
        self.killed_pid: int | None = None
        self.killed_in = ""  # the live phase read right after the kill
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-watcher", daemon=True)
        self._thread.start()

    def _live(self) -> tuple[Path, dict[str, Any]] | None:
        for path in self.reports.glob("*/.phase-*"):
            if path.name.endswith(".tmp"):
                continue
            try:
                if path.stat().st_mtime < self.started:
                    continue  # an earlier (killed) worker's last phase
                state = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if state.get("kind") == self.kind:
                return path, state
        return None

    def _run(self) -> None:
        deadline, worker = time.monotonic() + self.limit, None
        while not self._stop.is_set() and time.monotonic() < deadline:
            live = self._live()
            if live is None:
                time.sleep(POLL_S)
                continue
            path, state = live
            if not self.seen or self.seen[-1] != state["phase"]:
                self.seen.append(str(state["phase"]))
            if worker is None and self.victim == "worker":
                worker = host_pid_of(int(state["pid"]), f"coldsnap_probe {self.kind}")
            if state["phase"] == self.phase:
                target = worker if self.victim == "worker" else int(self.victim)
                if target is not None:
                    os.kill(target, signal.SIGKILL)
                    self.killed_at, self.killed_pid = time.time(), target
                    time.sleep(0.05)
                    self.killed_in = str((self._live() or (path, {"phase": ""}))[1]["phase"])
                return
            time.sleep(POLL_S)

    def result(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        return {"phases_seen": self.seen, "killed": self.killed_at is not None, "killed_in": self.killed_in or None,
                "killed_pid": self.killed_pid}


def gpu_states() -> dict[int, str]:
    """Every compute process on the GPUs (host PIDs) and the CUDA driver's checkpoint state of it."""
    listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                            text=True, check=False).stdout.split()
    pids = sorted({int(p) for p in listed if p.isdigit()})
    if not pids:
        return {}
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuInit(0)
    states = {}
    for pid in pids:
        state = ctypes.c_int(-1)
        result = cuda.cuCheckpointProcessGetState(ctypes.c_int(pid), ctypes.byref(state))
        states[pid] = STATES.get(state.value, f"unknown-{state.value}") if result == 0 else f"error-{result}"
    return states


def stages_left(socket_path: Path) -> list[dict[str, Any]] | None:
    """What the node hydrator holds for this uid (None: no hydrator answers)."""
    try:
        answer = jsonline.request(str(socket_path), {"op": "status"}, timeout=5.0)
    except Exception:  # a killed hydrator: nothing can be staged on it
        return None
    return list(answer.get("staged") or [])

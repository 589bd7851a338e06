"""coldsnap_probe._held_tree: a capture's tree stopped once the driver has locked it, each CUDA process held but one
thread while the driver checkpoints it, and never left held: the order the capture worker keeps, on real processes
with real ptrace (the driver's calls themselves run on the GPU host: tests/probe/test_worker.py,
test_worker_guard.py, tests/bench/test_jax_server.py).

A real program (a main thread writing what its workers counted; one worker blocking a signal of its own): stopped,
every thread in its group stop; held, only the thread let run runs; released, every thread back in its stop before
CRIU seizes it, untraced; dumped stopped and restored, it runs once continued. A failure inside the hold releases
it (the thread's own mask back, the tree still stopped for the rollback to continue); a capture worker killed while
it holds a thread leaves its guard to give the mask back and continue the tree; a process of the tree that ended
is named."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe._held_tree import stop_again, stop_tree, wait_stopped
from coldsnap_probe._process import signal_tree
from coldsnap_probe._thread_hold import ThreadHold
from coldsnap_probe.errors import WorkerError
from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_main import has_nvidia_driver

cpu_criu = pytest.mark.skipif(CRIU is None, reason="ptrace and CRIU need root and scripts/criu/build's CRIU")

WORKERS = 24
# Workers count (mostly asleep: a worker stopped while it holds the GIL would stop the main thread too); the last
# blocks SIGUSR2, its own mask; the main thread writes every count, its own first, every 20 ms.
PROGRAM = f"""
import os, signal, threading, time
counts = [0] * {WORKERS}
def work(i):
    if i == {WORKERS - 1}:
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR2}})
        os.write(1, f"own-mask {{threading.get_native_id()}}\\n".encode())  # one write: never inside a line
    while True:
        counts[i] += 1
        time.sleep(0.05)
for i in range({WORKERS}):
    threading.Thread(target=work, args=(i,), daemon=True).start()
beat = 0
while True:
    beat += 1
    os.write(1, (" ".join(map(str, [beat, *counts])) + "\\n").encode())
    time.sleep(0.02)
"""
OWN_MASK = 1 << (signal.SIGUSR2 - 1)


class Target:
    def __init__(self, root: Path) -> None:
        self.log = root / "out.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", PROGRAM], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=out, start_new_session=True)
        self.pid = self.proc.pid
        while len(self.counts_lines()) < 3:
            assert self.proc.poll() is None, self.log.read_text()
            time.sleep(0.01)
        self.own = next(int(line.split()[1]) for line in self.log.read_text().splitlines()
                        if line.startswith("own-mask"))

    def counts_lines(self) -> list[list[int]]:
        whole = self.log.read_text().split("\n")[:-1]  # the last one may be half written
        return [[int(v) for v in line.split()] for line in whole if line and not line.startswith("own-mask")]

    def last(self) -> list[int]:
        return self.counts_lines()[-1]

    def states(self) -> dict[int, str]:
        return {int(tid): Path(f"/proc/{self.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                for tid in os.listdir(f"/proc/{self.pid}/task")}

    def status(self, tid: int, key: str) -> str:
        line = next(line for line in Path(f"/proc/{self.pid}/task/{tid}/status").read_text().splitlines()
                    if line.startswith(f"{key}:"))
        return line.split()[1]

    def tracers(self) -> set[int]:
        return {int(self.status(tid, "TracerPid")) for tid in self.states()}

    def runs_everywhere(self) -> bool:
        """Every count and the main thread's beat move within a second."""
        before = self.last()
        give_up = time.monotonic() + 1.0
        while time.monotonic() < give_up:
            time.sleep(0.1)
            after = self.last()
            if all(a > b for a, b in zip(after, before, strict=True)):
                return True
        return False


@pytest.fixture
def target(tmp_path: Path) -> Iterator[Target]:
    started = Target(tmp_path)
    yield started
    with contextlib.suppress(ProcessLookupError):
        os.killpg(started.pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(started.pid, 0)


@cpu_criu
def test_a_tree_stopped_and_held_but_one_thread_is_dumped_stopped_and_runs_once_restored(
        tmp_path: Path, target: Target) -> None:
    stop_tree([target.pid])
    assert set(target.states().values()) == {"T"}
    journal: list[dict[str, int]] = []
    with ThreadHold(target.pid, note=lambda **step: journal.append(step)) as hold:
        hold.run_only(target.own)  # the driver's restore thread, in a capture: the one thread that runs
        assert journal == [{"hold": target.pid, "thread": target.own, "mask": OWN_MASK}]  # before it changed
        assert int(target.status(target.own, "SigBlk"), 16) != OWN_MASK  # every signal blocked meanwhile
        states = target.states()
        assert states[target.own] in "RS" and {s for t, s in states.items() if t != target.own} == {"t"}, states
    wait_stopped([target.pid])  # what the capture waits for before CRIU seizes the tree
    assert set(target.states().values()) == {"T"} and target.tracers() == {0}
    assert int(target.status(target.own, "SigBlk"), 16) == OWN_MASK
    stopped = target.last()
    images = tmp_path / "images"
    images.mkdir()
    with criu_wrapper(tmp_path) as criu:
        subprocess.run([criu, "dump", "-t", str(target.pid), "-D", str(images), "-o", "dump.log",
                        "--leave-stopped"], check=True, timeout=60)
        assert target.last() == stopped  # nothing ran between the hold and the dump
        os.kill(target.pid, signal.SIGKILL)
        target.proc.wait()
        subprocess.run([criu, "restore", "-D", str(images), "-o", "restore.log", "--restore-detached",
                        "--leave-stopped", "--pidfile", str(tmp_path / "pid")], check=True, timeout=60)
        assert set(target.states().values()) == {"T"}  # restored stopped, as the restore worker's CUDA step needs
        os.kill(target.pid, signal.SIGCONT)
        assert target.runs_everywhere() and int(target.status(target.own, "SigBlk"), 16) == OWN_MASK


@cpu_criu
def test_a_failure_inside_the_hold_releases_it_and_the_rollback_lets_the_tree_run(target: Target) -> None:
    stop_tree([target.pid])
    with pytest.raises(RuntimeError, match="the checkpoint failed"), ThreadHold(target.pid) as hold:
        hold.run_only(target.own)
        raise RuntimeError("the checkpoint failed")
    assert target.tracers() == {0} and int(target.status(target.own, "SigBlk"), 16) == OWN_MASK
    wait_stopped([target.pid])  # still stopped: the rollback gives the CUDA state back first, then continues
    stop_again([target.pid])  # (the rollback's first step: a stopped tree stays stopped, at once)
    signal_tree([target.pid], signal.SIGCONT)
    assert target.runs_everywhere() and target.tracers() == {0}


@cpu_criu
def test_a_process_of_the_tree_that_ended_is_named_and_the_others_are_stopped(target: Target) -> None:
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    with pytest.raises(WorkerError, match=f"process {ended.pid} of the tree ended before it could be stopped"):
        stop_tree([target.pid, ended.pid])
    wait_stopped([target.pid])
    os.kill(target.pid, signal.SIGCONT)
    assert target.runs_everywhere()


# A capture worker as far as the hold: its guard started, the tree journalled and stopped, one thread let run.
HOLDER = """
import sys, time
from coldsnap_probe._held_tree import stop_tree
from coldsnap_probe._thread_hold import ThreadHold
from coldsnap_probe._worker_guard import WorkerGuard
pid, tid = int(sys.argv[1]), int(sys.argv[2])
guard = WorkerGuard()
guard.start("capture")
guard.note(stop=[pid])
stop_tree([pid])
hold = ThreadHold(pid, note=guard.note)
hold.run_only(tid)
print("held", flush=True)
time.sleep(60)
"""


@cpu_criu
def test_a_worker_killed_while_it_holds_a_thread_leaves_the_tree_running_with_its_own_mask(target: Target) -> None:
    """The kernel lets go of a dead tracer's threads but not of the mask it gave the one it let run: the guard
    gives that back (only while it is still the hold's), then continues the stopped tree."""
    run = subprocess.Popen([sys.executable, "-c", HOLDER, str(target.pid), str(target.own)], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert run.stdout is not None and run.stdout.readline() == "held\n", run.communicate(timeout=30)
    assert int(target.status(target.own, "SigBlk"), 16) != OWN_MASK and target.tracers() == {run.pid}
    run.kill()
    _out, err = run.communicate(timeout=30)  # EOF once the guard, which shares stderr, is done
    assert "capture guard: the worker died" in err and f"thread [{target.own}] given its signal mask back" in err, err
    assert f"tree [{target.pid}] running again" in err, err
    assert target.tracers() == {0} and int(target.status(target.own, "SigBlk"), 16) == OWN_MASK
    assert target.runs_everywhere() and alive(target.pid)


# A thread that ends once it is let run (the hold's running thread gone before its release), the main thread asleep.
ENDING = """
import os, threading, time
def work():
    os.write(1, f"{threading.get_native_id()}\\n".encode())
    time.sleep(0.2)
threading.Thread(target=work).start()
time.sleep(600)
"""


def test_a_running_thread_that_ended_is_reaped_and_every_other_thread_is_still_let_go() -> None:
    """`release` stops the thread it let run before detaching the rest: when that thread had ended, the failure to
    stop it left every other thread traced by the worker (the tree then stayed in its ptrace stops, whatever
    SIGCONT the rollback sent, until the worker exited). Since review 11 the ended thread is waited for (no zombie
    left to this tracer) and named in `ended`, and the release succeeds."""
    target = subprocess.Popen([sys.executable, "-c", ENDING], stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None
        tid = int(target.stdout.readline())
        asleep = time.monotonic() + 10  # main in clock_nanosleep, its interpreter lock let go: stopped holding
        while Path(f"/proc/{target.pid}/syscall").read_text().split()[0] != "230":  # it, the worker never ends
            assert time.monotonic() < asleep
            time.sleep(0.002)
        stop_tree([target.pid])
        hold = ThreadHold(target.pid)
        hold.run_only(tid)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{target.pid}/task/{tid}/stat").exists() and \
                "Z" not in Path(f"/proc/{target.pid}/task/{tid}/stat").read_text().split(")")[-1][:3]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        hold.release()
        assert hold.ended == [tid] and not Path(f"/proc/{target.pid}/task/{tid}").exists()
        tracers = {line.split()[1] for task in Path(f"/proc/{target.pid}/task").iterdir()
                   for line in (task / "status").read_text().splitlines() if line.startswith("TracerPid:")}
        assert tracers == {"0"}, tracers
        os.kill(target.pid, signal.SIGCONT)
        wait_running = time.monotonic() + 10
        while (stat := Path(f"/proc/{target.pid}/stat").read_text())[stat.rindex(")") + 2] == "T":
            assert time.monotonic() < wait_running, stat
            time.sleep(0.01)
    finally:
        target.kill()
        target.wait()


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_process_the_driver_names_no_restore_thread_for_is_undone_running_and_the_undo_goes_on() -> None:
    """`undo_cuda`'s hold asks the driver for the process's restore thread: a driver that refuses (here: a process
    without CUDA state, stopped) raised a CudaError out of the whole undo, and the capture's rollback never sent
    its SIGCONT nor gave memory back. The process is continued and undone running instead, the undo goes on."""
    from coldsnap_probe._cuda import Driver
    from coldsnap_probe._held_tree import held
    from coldsnap_probe._process import undo_cuda

    target = subprocess.Popen(["sleep", "60"])
    try:
        stop_tree([target.pid])
        driver = Driver()
        driver.call("cuInit", 0)
        undo_cuda(driver, [(target.pid, "locked")], held(driver))
        stat = Path(f"/proc/{target.pid}/stat").read_text()
        assert stat[stat.rindex(")") + 2] in "SR", stat  # continued, not left stopped
    finally:
        target.kill()
        target.wait()


# A capture worker that locked its tree and stopped it, then died: its guard's CUDA undo comes before the tree runs.
LOCKED = """
import sys, time
from coldsnap_probe._held_tree import stop_tree
from coldsnap_probe._worker_guard import WorkerGuard
pid = int(sys.argv[1])
guard = WorkerGuard()
guard.start("capture")
guard.note(cuda=pid, state="locked")
guard.note(stop=[pid])
stop_tree([pid])
print("stopped", flush=True)
time.sleep(60)
"""


def test_a_dead_workers_tree_runs_again_even_when_its_cuda_undo_fails(tmp_path: Path) -> None:
    """The guard stops the tree again, undoes the CUDA state, then continues the tree: a CUDA undo that raised
    (here no driver to load; on a host, a cuInit that refuses) left the tree stopped for good, the guard gone. The
    tree must run again whatever the driver does, and the guard say what it could not undo. (On a GPU host the
    driver loads and the undo of a process with no CUDA state is a no-op: the tree runs again there too.)"""
    target = subprocess.Popen(["sleep", "60"])
    try:
        run = subprocess.Popen([sys.executable, "-c", LOCKED, str(target.pid)], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert run.stdout is not None and run.stdout.readline() == "stopped\n", run.communicate(timeout=30)
        run.kill()
        _out, err = run.communicate(timeout=30)  # EOF once the guard, which shares stderr, is done
        assert "capture guard: the worker died" in err and f"tree [{target.pid}] running again" in err, err
        stat = Path(f"/proc/{target.pid}/stat").read_text()
        assert stat[stat.rindex(")") + 2] in "SR", stat  # not T: running (asleep) again
        assert has_nvidia_driver() or f"CUDA state of [{target.pid}] not undone" in err, err
    finally:
        target.kill()
        target.wait()


# -- the GPU host: the capture worker against a JAX process that keeps libcuda busy --------------------------------
gpu_jax = pytest.mark.skipif(not has_nvidia_driver() or shutil.which("criu") is None
                             or importlib.util.find_spec("jax") is None,
                             reason="needs an NVIDIA driver, CRIU and jax with its CUDA plugin (run on the GPU host)")
# A JAX process whose device is never idle: a thread steps an array on the GPU without pause (XLA's stream threads
# and libcuda's busy when the capture locks, stops and checkpoints it), the main thread answers a reduction and
# how many steps were done, one JSON line per connection on a Unix socket.
BUSY = """
import json, os, socket, sys, threading
import jax, jax.numpy as jnp
x = jnp.arange(int(sys.argv[2]) << 18, dtype=jnp.float32) * 1e-6
total = jax.jit(lambda a, k: (a * k).sum())
step = jax.jit(lambda a: a * 0.999 + 1e-3)
steps = [0]
def hammer():
    y = x
    while True:
        y = step(y).block_until_ready()
        steps[0] += 1
threading.Thread(target=hammer, daemon=True).start()
server = socket.socket(socket.AF_UNIX); server.bind(sys.argv[1]); server.listen()
print(json.dumps({"ready": os.getpid(), "platform": jax.devices()[0].platform}), flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(json.dumps({"sum": f"{float(total(x, 3.0)):.6f}", "steps": steps[0]}).encode() + b"\\n")
    conn.close()
"""
ROUNDS = 3


def ask(path: Path) -> dict[str, Any]:
    give_up = time.monotonic() + 60
    while True:
        with socket.socket(socket.AF_UNIX) as conn:
            try:
                conn.connect(str(path))
            except OSError:
                assert time.monotonic() < give_up, f"{path} never listened"
                time.sleep(0.02)
                continue
            return json.loads(conn.makefile("rb").readline())  # type: ignore[no-any-return]


@gpu_jax
def test_a_jax_process_computing_without_pause_is_captured_and_restored_every_time(
        tmp_path: Path) -> None:
    """Issue 36: the capture's CUDA checkpoint (and a restore's) with the tree stopped and only the driver's thread
    running, against the process that showed the race (a JAX process: ~100 threads, libcuda's waiters): a capture
    whose dump fails rolled back (restored and unlocked held, then continued); captured while its device works,
    restored, captured again from the restored process, ROUNDS times; every capture and
    restore succeeds, the same answer each time, and the computing thread goes on. The hold's cost per capture is
    printed as one `held_tree` JSON line (pytest -rP shows it)."""
    from tests.probe.test_worker import kill_and_reap, worker

    ctypes.CDLL(None).prctl(36, 1)  # a subreaper: each restored tree is reparented here
    sock, log = tmp_path / "busy.sock", tmp_path / "busy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", BUSY, str(sock), "128"], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out, start_new_session=True,
                                env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    pid, rounds = proc.pid, []
    try:
        give_up = time.monotonic() + 120
        while '"ready"' not in log.read_text():
            assert proc.poll() is None and time.monotonic() < give_up, log.read_text()[-3000:]
            time.sleep(0.05)
        ready = json.loads(next(line for line in log.read_text().splitlines() if '"ready"' in line))
        assert ready["platform"] == "gpu", log.read_text()[-3000:]
        cold = ask(sock)
        threads = len(os.listdir(f"/proc/{pid}/task"))  # XLA's pools and libcuda's threads
        # A failed dump first: the rollback restores and unlocks the held process, then lets it run on.
        done = worker("capture", "--pid", str(pid), "--images", str(tmp_path / "images-0"), "--criu", "/bin/false")
        assert done.returncode == 1 and "criu dump exited 1" in done.stderr, done.stderr[-3000:]
        first = ask(sock)
        time.sleep(0.2)
        later = ask(sock)
        assert first["sum"] == cold["sum"] and later["steps"] > first["steps"], ("rolled back", cold, first, later)
        for n in range(1, ROUNDS + 1):
            done = worker("capture", "--pid", str(pid), "--images", str(tmp_path / f"images-{n}"), "--criu",
                          shutil.which("criu") or "")
            assert done.returncode == 0, f"capture {n}: {done.stderr[-3000:]}"
            timings = json.loads(done.stdout)["timings_s"]
            if n == 1:
                proc.wait()  # the capture ended the tree: its pid is free for the restore
            else:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)  # (a restored tree, reparented here)
            sock.unlink(missing_ok=True)
            done = worker("restore", "--images", str(tmp_path / f"images-{n}"), "--work-dir", str(tmp_path / f"w{n}"))
            assert done.returncode == 0, f"restore {n}: {done.stderr[-3000:]}"
            report = json.loads(done.stdout)
            first = ask(sock)
            time.sleep(0.2)
            later = ask(sock)
            assert first["sum"] == cold["sum"] and later["steps"] > first["steps"], (n, cold, first, later)
            rounds.append({key: round(timings.get(key, -1.0), 4) for key in
                           ("tree_stop", "thread_hold", "cuda_checkpoint", "cuda_lock", "criu_dump")}
                          | {"cuda_restore": report.get("cuda_restore_seconds"), "threads": threads})
    finally:
        print("held_tree", json.dumps(rounds))  # the GPU run's numbers: pytest -rP
        if Path(f"/proc/{pid}").exists():
            kill_and_reap(pid)
        proc.wait()  # (reaped already: its status is all that is left)
    assert len(rounds) == ROUNDS and all(r["tree_stop"] >= 0 and r["thread_hold"] >= 0 for r in rounds), rounds

"""coldsnap_probe._thread_hold: a CRIU-restored process held still but for one thread while the driver restores it.

A real process (a main thread writing what its two workers counted), really dumped and restored by CRIU
(`--leave-stopped`, as the restore worker runs it): held, only the thread let run runs; released and continued,
every thread runs and none is traced any more. Bad requests are refused naming the thread or the process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe._thread_hold import ThreadHold
from coldsnap_probe.errors import WorkerError
from tests.criu import CRIU, alive, criu_wrapper

pytestmark = pytest.mark.skipif(CRIU is None, reason="CRIU needs root and its build (scripts/criu/build)")

# Two workers count; the main thread writes their counts and its own, every 20 ms.
PROGRAM = """
import sys, threading, time
counts = [0, 0]
def work(i):
    while True:
        counts[i] += 1
        time.sleep(0.005)
for i in range(2):
    threading.Thread(target=work, args=(i,), daemon=True).start()
beat = 0
while True:
    beat += 1
    print(beat, *counts, flush=True)
    time.sleep(0.02)
"""


def last(log: Path) -> list[int]:
    return [int(v) for v in log.read_text().splitlines()[-1].split()]


def traced(pid: int) -> list[int]:
    return [int(Path(f"/proc/{pid}/task/{tid}/status").read_text().split("TracerPid:")[1].split()[0])
            for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.fixture
def restored(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """The program, dumped and restored stopped by CRIU: (its pid, its output)."""
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", PROGRAM], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out, start_new_session=True)
    while not log.exists() or len(log.read_text().splitlines()) < 3:
        time.sleep(0.01)
    images = tmp_path / "images"
    images.mkdir()
    with criu_wrapper(tmp_path) as criu:
        subprocess.run([criu, "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log"], check=True,
                       timeout=60)
        proc.wait()
        subprocess.run([criu, "restore", "-D", str(images), "-o", "restore.log", "--restore-detached",
                        "--leave-stopped", "--pidfile", str(tmp_path / "pid")], check=True, timeout=60)
        try:
            yield proc.pid, log
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(proc.pid, 0)


def test_only_the_thread_let_run_runs_until_the_hold_is_released(restored: tuple[int, Path]) -> None:
    pid, log = restored
    with ThreadHold(pid) as hold:
        assert len(hold.threads) == 3 and traced(pid) == [os.getpid()] * 3
        hold.run_only(pid)  # the main thread: it writes, while the counts it writes stand still
        time.sleep(0.15)
        before = last(log)
        time.sleep(0.2)
        during = last(log)
        assert during[0] > before[0] and during[1:] == before[1:], (before, during)
        states = {tid: Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for tid in hold.threads}
        assert states[pid] in "RS" and all(states[tid] == "t" for tid in hold.threads if tid != pid), states
    assert traced(pid) == [0, 0, 0]
    released = last(log)
    time.sleep(0.2)
    assert last(log) == released  # released into the group stop CRIU left: nothing runs before the SIGCONT
    os.killpg(pid, signal.SIGCONT)
    time.sleep(0.3)
    after = last(log)
    assert after[0] > released[0] and after[1] > released[1] and after[2] > released[2] and alive(pid), after


def test_a_thread_outside_the_process_is_refused_and_nothing_stays_traced(restored: tuple[int, Path]) -> None:
    pid, _ = restored
    with pytest.raises(WorkerError, match=f"thread 1 is not one of process {pid}'s 3 threads"), ThreadHold(pid) as hold:
        hold.run_only(1)
    assert traced(pid) == [0, 0, 0]


def test_a_process_that_is_gone_is_refused_naming_it() -> None:
    with pytest.raises(WorkerError, match="cannot hold process 999999999's threads"):
        ThreadHold(999999999)


# A worker that ends once FLAG exists; the main thread waits on stdin (holding no lock) and then ends. PARENT runs
# it as its child (the holder is its tracer, not its parent, as in the worker) and exits with its status (128+N: N's
# signal).
ENDING = """
import os, sys, threading, time
def work():
    print(os.getpid(), threading.get_native_id(), flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.005)
threading.Thread(target=work).start()
sys.stdin.read(1)
"""
PARENT = "import subprocess, sys; rc = subprocess.call(sys.argv[1:]); sys.exit(128 - rc if rc < 0 else rc)"


def state(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def ended(pid: int, tid: int) -> None:
    give_up = time.monotonic() + 5
    while state(pid, tid) not in ("Z", "gone") and time.monotonic() < give_up:
        time.sleep(0.002)


@pytest.fixture
def ending(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, int, Path]]:
    """ENDING, stopped (SIGSTOP), under PARENT: (PARENT, ENDING's pid, its worker's thread id, the flag that ends
    the worker)."""
    flag = tmp_path / "flag"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, sys.executable, "-c", ENDING, str(flag)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    assert parent.stdout is not None
    pid, tid = (int(v) for v in parent.stdout.readline().split())
    # Stopped only once the main thread waits in read(2), its interpreter lock let go: stopped holding it, the
    # worker let run could never take it to end.
    give_up = time.monotonic() + 10
    while Path(f"/proc/{pid}/syscall").read_text().split()[0] != "0":
        assert time.monotonic() < give_up, "the main thread never waited on stdin"
        time.sleep(0.002)
    os.kill(pid, signal.SIGSTOP)
    while any(state(pid, int(t)) != "T" for t in os.listdir(f"/proc/{pid}/task")):
        time.sleep(0.002)
    try:
        yield parent, pid, tid, flag
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)


def test_a_thread_that_ends_while_held_is_reaped_and_forgotten(
        ending: tuple[subprocess.Popen[bytes], int, int, Path]) -> None:
    """Review 11: the thread let run ends while held: it reports its end to the holder, which waits for it (no
    zombie thread, no failed release); the others are let go as ever and the process then ends as it would."""
    parent, pid, tid, flag = ending
    with ThreadHold(pid) as hold:
        flag.touch()
        hold.run_only(tid)
        ended(pid, tid)
    assert hold.ended == [tid] and hold.threads == [] and hold.running is None
    assert state(pid, tid) == "gone" and traced(pid) == [0]  # reaped; the main thread let go
    os.kill(pid, signal.SIGCONT)
    out, _ = parent.communicate(b"x", timeout=10)
    assert out == b"" and parent.returncode == 0


def test_a_process_killed_while_held_is_let_go_and_its_parent_reaps_it(
        ending: tuple[subprocess.Popen[bytes], int, int, Path]) -> None:
    """Every held thread ends at once (SIGKILL): release waits for each (the main thread last: it cannot be waited
    for before its other threads) instead of failing on them, and the process's parent then reaps it."""
    parent, pid, tid, _ = ending
    with ThreadHold(pid) as hold:
        os.kill(pid, signal.SIGKILL)
        ended(pid, tid)
    assert hold.ended == [tid, pid] and hold.threads == []
    assert parent.wait(timeout=5) == 128 + signal.SIGKILL

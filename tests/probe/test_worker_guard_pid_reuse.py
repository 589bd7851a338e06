"""review: a capture guard signals the tree it was told of, never a process that took a pid of it since."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.helpers import ROOT

WORKER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from coldsnap_probe._worker_guard import WorkerGuard

    guard = WorkerGuard()
    guard.start("capture")
    for attempt in range(50):
        victim = subprocess.Popen(["sleep", "100"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.05)  # the guard has read the steps meanwhile
        guard.note(dump=[victim.pid])
        guard.note(commit=[victim.pid])
        time.sleep(0.05)
        victim.kill()
        victim.wait()  # its pid is free: the next fork is made to take it
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(victim.pid - 1))
        innocent = subprocess.Popen(["sleep", "100"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if innocent.pid == victim.pid:
            break
        innocent.kill()
        innocent.wait()
    print(innocent.pid, victim.pid, flush=True)
    os._exit(0)  # died after the commit, before its end: the guard ends the committed tree
""")


def test_a_guard_never_kills_a_process_that_reused_a_tree_pid() -> None:
    worker = subprocess.run([sys.executable, "-c", WORKER], cwd=ROOT, capture_output=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # stderr's end: the guard is done
    innocent, victim = (int(word) for word in worker.stdout.split())
    try:
        assert innocent == victim, "the pid was not reused (another process took it): inconclusive"
        assert b"guard: the worker died" in worker.stderr, worker.stderr
        time.sleep(0.2)
        stat = Path(f"/proc/{innocent}/stat")
        state = stat.read_text().rsplit(")", 1)[1].split()[0] if stat.exists() else "gone"
        assert state not in ("Z", "gone"), "the guard killed the process that took the tree's pid"
    finally:
        try:
            os.kill(innocent, signal.SIGKILL)
        except ProcessLookupError:
            pass


RESTORE = textwrap.dedent("""
    import os, sys
    from coldsnap_probe._worker_guard import WorkerGuard

    guard = WorkerGuard()
    guard.start("restore")
    guard.note(restore=sys.argv[1], pidfile=sys.argv[2])
    os._exit(0)
""")


def test_a_restore_guard_never_kills_process_group_0_or_1(tmp_path: Path) -> None:
    """review: a pidfile that reads 0 or 1 (killpg(1) is kill(-1, ...): every process the guard may signal)."""
    pidfile = tmp_path / "restored.pid"
    pidfile.write_text("0\n")
    worker = subprocess.run([sys.executable, "-c", RESTORE, str(tmp_path / "images"), str(pidfile)], cwd=ROOT,
                            capture_output=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert b"guard: the worker died" in worker.stderr and b"no tree was restored" in worker.stderr, worker.stderr

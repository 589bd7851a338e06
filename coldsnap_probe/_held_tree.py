"""A captured tree held still while the CUDA driver checkpoints it, and while a failed capture gives its CUDA state
back: the order CRIU's own CUDA plugin keeps (CRIU 4.2, `plugins/cuda/cuda_plugin.c`).

The driver's checkpoint releases the process's device mappings: its `/dev/nvidiactl` shared page becomes a `---p`
reservation until a restore maps it back (bench/results/h200-jaxdiag-2026-12-01/). A thread of the process that
runs in between may read such a page and die: a libcuda thread of a JAX process did, at restore (docs/interposer.md,
"JAX and XLA"). So, per the driver's contract and as the plugin orders its hooks:

    lock          the tree runs: the driver waits for the CUDA work in flight and blocks new calls
    stop          every process of the tree stopped (SIGSTOP; every thread seen in its group stop)
    checkpoint    per CUDA process, every thread held in a ptrace stop but the driver's restore thread
                  (`cuCheckpointProcessGetRestoreThreadId`), which the driver needs to run (`_thread_hold`)
    dump          CRIU seizes the stopped tree and leaves it stopped (`--leave-stopped`)
    undo          a failed capture: per CUDA process, held again, restore what was checkpointed and unlock, and
                  only then let the tree run (SIGCONT)

The driver's state (`cuCheckpointProcessGetState`) is asked only while the restore thread runs, inside the hold
(as every restore asks it): asked of a stopped process it did not answer, and a capture that asked it after the
hold hung (H200, 2026-12-02). `cuCheckpointProcessGetRestoreThreadId` answers for a stopped process.

Nothing but the restore thread runs from the checkpoint until the dump or the undo is done; the hold is released on
every path (a `with`), the tree continued by the caller's rollback, and a worker that dies leaves both to its guard
(`_worker_guard`: the tree journalled as `stop`, the held thread's own mask as `hold`). CRIU dumps the tree as
stopped; a restore (`--leave-stopped` whenever there is CUDA state) continues it once the driver's restore is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._thread_hold import ThreadHold
from .errors import WorkerError

if TYPE_CHECKING:
    from ._cuda import Driver

__all__ = ("driver_alone", "held", "stop_again", "stop_tree", "wait_stopped", "wait_untraced")

STOP_WAIT_S = 10.0  # for every thread to reach its group stop (one in a driver call finishes it first)
LET_GO_S = 5.0  # for the kernel to detach a tree from a tracer (CRIU, a dead worker) that has exited
SLOW_S = 20.0  # a driver call under the hold this long is said on stderr (where each thread is), once


def stop_tree(tree: list[int]) -> None:
    """SIGSTOP to every process of `tree`, then wait until every thread of each is stopped."""
    gone = []
    for pid in tree:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            gone.append(pid)
    if gone:
        raise WorkerError(f"process {gone[0]} of the tree ended before it could be stopped")
    wait_stopped(tree)


def stop_again(tree: list[int]) -> None:
    """Before an undo: the tree let go by CRIU (its dump ended) and stopped (a failed dump may have let it run);
    a process that will not stop is undone running (`_process.undo_cuda`)."""
    wait_untraced(tree)
    with contextlib.suppress(WorkerError):
        stop_tree(tree)


def wait_stopped(tree: list[int], timeout_s: float = STOP_WAIT_S) -> None:
    """Every thread of every process of `tree` is in a stop (its group stop, or a ptrace stop); else `WorkerError`
    naming a thread that is not, and its state."""
    give_up = time.monotonic() + timeout_s
    while True:
        running = [(pid, tid, state) for pid in tree for tid, state in _thread_states(pid) if state not in "Tt"]
        if not running:
            return
        if time.monotonic() > give_up:
            pid, tid, state = running[0]
            raise WorkerError(f"thread {tid} of process {pid} did not stop within {timeout_s:g} s (state {state}; "
                              f"{len(running)} threads of the tree still run)")
        time.sleep(0.001)


def wait_untraced(tree: list[int], timeout_s: float = LET_GO_S) -> bool:
    """Whether no process of `tree` is traced any more (a tracer that exited is let go of by the kernel)."""
    give_up = time.monotonic() + timeout_s
    while any(_traced(pid) for pid in tree):
        if time.monotonic() > give_up:
            return False
        time.sleep(0.002)
    return True


@contextlib.contextmanager
def driver_alone(driver: Driver, pid: int, *, note: Callable[..., Any] | None = None) -> Iterator[ThreadHold]:
    """Process `pid` (stopped) held with only the driver's restore thread running, for the block's driver calls;
    `note` journals the thread's own signal mask first (a capture's guard)."""
    with ThreadHold(pid, note=note) as hold:
        tid = int(driver.call("cuCheckpointProcessGetRestoreThreadId", pid))
        hold.run_only(tid)
        watch = threading.Timer(SLOW_S, _say_slow, (pid, tid))  # a driver that never answers is named, not silent
        watch.daemon = True
        watch.start()
        try:
            yield hold
        finally:
            watch.cancel()


def _say_slow(pid: int, tid: int) -> None:
    def where(task: int) -> str:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
            return f"{stat[stat.rindex(')') + 2:][:1]} in {Path(f'/proc/{pid}/task/{task}/wchan').read_text() or '-'}"
        except OSError as exc:
            return exc.strerror or "gone"
    with contextlib.suppress(WorkerError):
        states = dict(Counter(state for _, state in _thread_states(pid)))
        sys.stderr.write(f"coldsnap-worker: a driver call has held process {pid} for {SLOW_S:g} s; its restore "
                         f"thread {tid}: {where(tid)}; its threads by state: {states}\n")
        sys.stderr.flush()


def held(driver: Driver) -> Callable[[int], contextlib.AbstractContextManager[Any]]:
    """`undo_cuda`'s hold for a stopped tree: each process held with only its restore thread running."""
    return lambda pid: driver_alone(driver, pid)


def _thread_states(pid: int) -> list[tuple[int, str]]:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError as exc:
        raise WorkerError(f"process {pid} of the tree ended while it was being stopped") from exc
    states = []
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended: nothing of it runs
            continue
        state = stat[stat.rindex(")") + 2:][:1]
        if state not in "ZX":  # (a thread that ended, its process's main thread among them, runs nothing)
            states.append((int(tid), state))
    return states


def _traced(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in status.splitlines())

"""A CRIU-restored process held still while the driver restores its CUDA state: every thread in a ptrace stop
but the one the driver restores with (`cuCheckpointProcessGetRestoreThreadId`), as CRIU's own CUDA plugin runs a
restore. Until the restore is done the driver's pages are not mapped back; a thread let run meanwhile may read
them and die: a libcuda thread of a JAX process, woken from its futex wait, did (issue 36, docs/interposer.md
"JAX and XLA", bench/results/h200-jaxdiag-2026-12-01/).

CRIU leaves the tree stopped (`--leave-stopped`): seizing a stopped thread traps it (PTRACE_SEIZE), so nothing runs
between CRIU and the hold. `run_only` lets one thread run, every signal blocked on it (a signal stop would leave
it parked inside the driver's restore); `release` puts its mask back and detaches every thread, which then stays in
the group stop CRIU left until the caller's SIGCONT. Raises `WorkerError` naming the thread and the errno.

A traced thread that ends (the one let run returns, or the process is killed) reports its exit to this tracer, not
its process: until it is waited for it stays a zombie, and its process's main thread cannot be reaped. The hold
waits for it (`ended` lists it) and forgets it: nothing to stop, give a mask back or detach.

A capture holds a live process the same way, once the worker has stopped its tree (`_held_tree`). There a holder
that dies leaves the thread it let run with every signal blocked (the kernel detaches its tracees, not their
masks): `note` journals the thread's own mask before it is changed, and a dead worker's guard gives it back
(`put_back_mask`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .errors import WorkerError

__all__ = ("ThreadHold",)

_SEIZE, _INTERRUPT, _CONT, _DETACH, _GETSIGMASK, _SETSIGMASK = 0x4206, 0x4207, 7, 17, 0x420A, 0x420B
_WALL = 0x40000000  # waitpid: threads too
_SIGSET_BYTES = 8  # the kernel's sigset_t on Linux
_STOP_WAIT_S = 2.0  # for a thread to report the stop it was asked for
_RETRAP_S = 0.005  # a group-stop notification pending when a thread is continued traps it at once
# The thread let run: every signal blocked but SIGTRAP (and SIGKILL and SIGSTOP, which the kernel never blocks: the
# mask as it reads back).
HELD_MASK = ~sum(1 << (s - 1) for s in (signal.SIGTRAP, signal.SIGKILL, signal.SIGSTOP)) & (2**64 - 1)


class ThreadHold:
    """Every thread of `pid` held (the process must be stopped); a context manager that releases them on exit."""

    def __init__(self, pid: int, *, note: Callable[..., Any] | None = None) -> None:
        self.pid, self._note = pid, note
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.ptrace.restype = ctypes.c_long
        self._libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self._mask = ctypes.c_uint64(0)
        self.running: int | None = None  # the one thread let run
        self.threads: list[int] = []
        self.ended: list[int] = []  # threads that ended while held, waited for (reaped) here
        try:
            self.threads = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task"))
        except OSError as exc:
            raise WorkerError(f"cannot hold process {pid}'s threads: {exc.strerror}") from exc
        seized: list[int] = []
        try:
            for tid in self.threads:
                self._ptrace(_SEIZE, tid)
                seized.append(tid)
            for tid in self.threads:
                self._wait_stop(tid)
        except WorkerError:
            self.threads = seized  # what was seized is let go: nothing stays traced by a failed hold
            with contextlib.suppress(WorkerError):
                self.release()
            raise

    def __enter__(self) -> ThreadHold:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.release()
            return
        with contextlib.suppress(WorkerError):  # the failure in flight is the one to report
            self.release()

    def run_only(self, tid: int) -> None:
        """Let thread `tid` run, every signal blocked on it (its own mask comes back at `release`)."""
        if tid not in self.threads:
            raise WorkerError(f"thread {tid} is not one of process {self.pid}'s {len(self.threads)} threads")
        self._ptrace(_GETSIGMASK, tid, _SIGSET_BYTES, ctypes.byref(self._mask))
        if self._note is not None:  # before the mask changes: a guard puts it back should this process die
            self._note(hold=self.pid, thread=tid, mask=self._mask.value)
        blocked = ctypes.c_uint64(HELD_MASK)
        self._ptrace(_SETSIGMASK, tid, _SIGSET_BYTES, ctypes.byref(blocked))
        self._ptrace(_CONT, tid)
        self.running = tid
        settled = time.monotonic() + _RETRAP_S
        while time.monotonic() < settled and self.running == tid:
            got, status = os.waitpid(tid, os.WNOHANG | _WALL)
            if got and os.WIFSTOPPED(status):
                self._ptrace(_CONT, tid)
            elif got:  # it ended at once: reaped by that wait
                self._forget(tid)
            time.sleep(0.001)

    def put_back_mask(self, tid: int, mask: int) -> bool:
        """Thread `tid`'s own signal mask `mask` back, if it still has the one `run_only` gives (a holder died
        before `release`); False if it has another (its own, which it may have changed since: left alone)."""
        if tid not in self.threads:  # it ended meanwhile
            return False
        current = ctypes.c_uint64(0)
        self._ptrace(_GETSIGMASK, tid, _SIGSET_BYTES, ctypes.byref(current))
        if current.value != HELD_MASK:
            return False
        own = ctypes.c_uint64(mask & (2**64 - 1))
        self._ptrace(_SETSIGMASK, tid, _SIGSET_BYTES, ctypes.byref(own))
        return True

    def release(self) -> None:
        """Stop the running thread, give it its mask back, detach every thread (they stay group-stopped). A thread
        that ended is waited for and forgotten (`ended`), not a failure. Every thread is detached even when the
        running one could not be stopped: the first failure is raised after, never left as threads traced by this
        process."""
        failed: list[WorkerError] = []
        if self.running is not None:
            tid = self.running
            try:
                self._ptrace(_INTERRUPT, tid, gone_ok=True)
                if tid in self.threads:
                    self._wait_stop(tid, ended_ok=True)
                if tid in self.threads:
                    self._ptrace(_SETSIGMASK, tid, _SIGSET_BYTES, ctypes.byref(self._mask), gone_ok=True)
            except WorkerError as exc:
                failed.append(exc)
            self.running = None
        # The main thread last: ended, it can be waited for only once its other threads have been
        for tid in sorted(self.threads, key=lambda t: t == self.pid):
            try:
                self._ptrace(_DETACH, tid, gone_ok=True)  # a thread that ended meanwhile is reaped instead
            except WorkerError as exc:
                failed.append(exc)
        self.threads = []
        if failed:
            raise failed[0]

    def _forget(self, tid: int) -> None:
        """Thread `tid` ended and was waited for: nothing of it is left to stop or let go."""
        if tid in self.threads:
            self.threads.remove(tid)
            self.ended.append(tid)
        if self.running == tid:
            self.running = None

    def _reaped(self, tid: int) -> bool:
        """Whether thread `tid` has ended (waited for here, if it was not yet) and is forgotten."""
        try:
            got, status = os.waitpid(tid, os.WNOHANG | _WALL)
        except ChildProcessError:  # waited for already, or never traced here
            got, status = tid, 0
        if not got or os.WIFSTOPPED(status):  # a stop consumed here leaves the thread stopped: retried
            return False
        self._forget(tid)
        return True

    def _ptrace(self, request: int, tid: int, addr: int = 0, data: object = None, *, gone_ok: bool = False) -> None:
        """`request` on `tid`, retried while the thread is between two stops; `gone_ok`: a thread that ended is
        waited for and forgotten (nothing to do on it)."""
        for _ in range(100):  # ESRCH while the thread is between two stops (the kernel's transient RUNNING)
            if self._libc.ptrace(request, tid, addr, data) == 0:
                return
            code = ctypes.get_errno()
            if code != errno.ESRCH:
                break
            if gone_ok and self._reaped(tid):
                return
            time.sleep(0.002)
        raise WorkerError(f"ptrace request {request:#x} on thread {tid} of process {self.pid}: "
                          f"{errno.errorcode.get(code, code)} ({os.strerror(code)})")

    def _wait_stop(self, tid: int, *, ended_ok: bool = False) -> None:
        """Until thread `tid` reports a stop; `ended_ok`: its end instead (it is then forgotten)."""
        give_up = time.monotonic() + _STOP_WAIT_S
        while time.monotonic() < give_up:
            try:
                got, status = os.waitpid(tid, os.WNOHANG | _WALL)
            except ChildProcessError as exc:
                raise WorkerError(f"thread {tid} of process {self.pid} is gone: {exc}") from exc
            if got:
                if os.WIFSTOPPED(status):
                    return
                self._forget(tid)  # reaped by that wait
                if ended_ok:
                    return
                raise WorkerError(f"thread {tid} of process {self.pid} ended (wait status {status:#x})")
            time.sleep(0.001)
        raise WorkerError(f"thread {tid} of process {self.pid} reported no stop within {_STOP_WAIT_S:g} s")

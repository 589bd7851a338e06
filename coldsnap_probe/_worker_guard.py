"""A worker's guard: what a capture or restore worker is about to do, undone if the worker dies before it ends.

A worker can be killed in any phase (the kernel's OOM killer, a node agent's timeout, a client whose exec is torn
down): the capture's own rollback (`_capture.py`) then never runs, and the workload would stay locked or
checkpointed by the CUDA driver, stopped after CRIU's dump, its device memory or weights released, with
half-written images. So the worker command forks a guard before its first step (before any CUDA call, so the guard
may initialise the driver itself): a child in its own session that reads the worker's journal on a pipe, one JSON
line per step *about to be taken*:

    {"worker": "capture" | "restore"}      first, from `start`
    {"images": path, "created": bool}      the images directory (removed, or emptied, on undo)
    {"work": path}                          a scratch directory of the worker's own (CRIU's work dir; a
                                            restore's kernel probe's), about to be made
    {"memory": weights_control}            the memory sources are about to release (undone from their records)
    {"cuda": pid, "state": "locked" | "checkpointed"}
    {"stop": [pids]}                        the tree is about to be stopped (SIGSTOP), once locked (`_held_tree`)
    {"hold": pid, "thread": tid, "mask": n} thread `tid` is about to run alone, every signal blocked; `n` its mask
    {"dump": [pids]}                        CRIU dumps the tree (always `--leave-stopped`)
    {"commit": [pids]}                      the images are complete (capture.json written): the tree ends
    {"end": true}                          the worker finished: a capture, or its own rollback

When the pipe closes after `commit` but without `end`, the guard ends the stopped tree, as the worker was about
to (the images are the capture). When it closes before, the guard undoes, in the order of the capture's own
rollback: with a stopped tree, it waits for the kernel to let go of it (no process of it traced any more: CRIU
or the dead worker's hold), stops it again, gives a held thread its own signal mask back, restores what was
checkpointed and unlocks what was locked, each process held but its driver's restore thread (`_held_tree`), and
only then lets the tree run (SIGCONT); has every memory source give back what its
records in the images say it released, removes the images and the worker's scratch directory (a failed dump's log
kept in an images directory that stays, as the worker's own rollback keeps it).
Each undo checks the state first (a step journalled but never taken is a no-op). What it undid goes to stderr,
which it shares with the worker: the exec's reply ends with it, and comes only once it is done.

A restore journals `{"partial": path}` before it writes a /dev/shm file beside the one it puts back (removed),
`{"lazy_socket": path}` and `{"lazy_pages": pid}` around starting a lazy-pages daemon,
`{"restore": images, "pidfile": path}` before CRIU runs and `{"root": pid}` once the restored tree exists: a restore
worker that dies leaves no restored tree (nothing half-restored serves: stopped, checkpointed on the GPU, or running
unreported), as its own rollback would: the guard kills the lazy-pages daemon and the tree's process group. (In a
restore unit the container's end kills everything too; a worker run on a host has only its guard.) A stage the
worker asked of a node hydrator is freed by the hydrator when the worker exits (its pidfd rode with the request).

The guard acts only on what the journal names, never on a process found by its name (another capsule's CRIU, a
user's program called `criu`): the processes of a step by the pidfds it opens as it reads the step, a CRIU the
worker started by the journal itself: CRIU inherits the journal's write end (`lifeline`), so the journal ends only
once CRIU has too, and the guard, which undoes only then, never has to look for an orphaned CRIU. A lazy-pages
daemon, which outlives a failed restore, is killed through its pidfd, or, when the worker died between starting it
and naming it, ended through the socket the worker named first (a connection that sends nothing ends its wait).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ("WorkerGuard",)


class WorkerGuard:
    """The worker's end of the journal (`note`, `end`); `start` forks the guard. Without `start`, a journal that
    only keeps nothing (a capture called in-process, whose caller's own rollback is enough)."""

    def __init__(self) -> None:
        self._fd = -1

    def start(self, kind: str) -> None:
        """Fork the guard of a `kind` worker (capture, restore)."""
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the guard: never returns into the worker's code
            os.close(write)
            code = 0
            try:
                os.setsid()  # a kill of the worker's process group leaves it
                if (journal := _read_journal(read)) is not None:
                    # Imported only now, in the guard alone, to undo: off the worker's path (a restore's to CRIU).
                    from ._guard_undo import undo

                    undo(*journal)
            except BaseException:  # a guard's own failure still ends the process
                code = 1
            finally:
                os._exit(code)
        os.close(read)
        self._fd = write
        self.note(worker=kind)

    def note(self, **step: Any) -> None:
        if self._fd < 0:
            return
        try:
            os.write(self._fd, json.dumps(step).encode() + b"\n")  # one write, under PIPE_BUF: whole or not at all
        except OSError:  # the guard is gone (killed with the worker's group?): the capture goes on unguarded
            os.close(self._fd)
            self._fd = -1

    def lifeline(self) -> tuple[int, ...]:
        """The journal's write end, for a child (CRIU) to inherit (`pass_fds`): the journal then ends only once the
        worker and that child are both gone, so the guard undoes only after it (none without a started guard)."""
        return (self._fd,) if self._fd >= 0 else ()

    def scratch(self, prefix: str) -> Path:
        """A new directory of the worker's own in the temporary directory (0700, a random name, as `mkdtemp`),
        journalled before it is made: the guard removes it if the worker dies."""
        while True:
            path = Path(_temporary_directory()) / f"{prefix}{os.urandom(6).hex()}"
            if path.exists():  # never journal a path the worker did not make: the guard would remove it
                continue
            self.note(work=str(path))
            path.mkdir(mode=0o700)
            return path

    def end(self) -> None:
        """The capture is over (done, or rolled back by the worker itself): the guard leaves without undoing."""
        if self._fd >= 0:
            self.note(end=True)
            os.close(self._fd)
            self._fd = -1


def _temporary_directory() -> str:
    """Where a worker's scratch goes: $TMPDIR (or $TEMP, $TMP) when it names a directory this process may write,
    else /tmp, as `tempfile.gettempdir` chooses on Linux but without its import and its trial file (a restore's
    path to CRIU), made absolute as it does: the kernel probe's CRIU runs in its scratch and is told a path there."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        if (chosen := os.environ.get(name)) and os.path.isdir(chosen) and os.access(chosen, os.W_OK | os.X_OK):
            return os.path.abspath(chosen)
    return "/tmp"


def _read_journal(fd: int) -> tuple[list[dict[str, Any]], dict[int, int]] | None:
    """The guard's side: the journal read to its end (the worker and every CRIU it started are gone), with a pidfd
    opened for each of the tree's processes as its step is read, while the tree lives (a process that took a pid of
    the tree after it ended is never signalled); None when there is nothing to undo (`end`, or no step at all)."""
    steps: list[dict[str, Any]] = []
    held: dict[int, int] = {}
    with os.fdopen(fd, "rb", buffering=0) as journal:
        for line in journal:
            try:
                steps.append(json.loads(line))
            except ValueError:
                continue
            if not isinstance(steps[-1], dict):
                steps.pop()
                continue
            if steps[-1].get("end"):
                return None  # the worker finished (a CRIU it started may still hold the journal: nothing is left to do)
            for key in ("stop", "dump", "root", "lazy_pages"):
                pids = steps[-1].get(key)
                for pid in pids if isinstance(pids, list) else [pids]:
                    if isinstance(pid, int) and pid > 0 and pid not in held:
                        with contextlib.suppress(OSError):
                            held[pid] = os.pidfd_open(pid)
    return (steps, held) if steps else None

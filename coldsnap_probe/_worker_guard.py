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
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import WorkerError

__all__ = ("WorkerGuard", "remove_contents")


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
                _guard(read)
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
            path = Path(tempfile.gettempdir()) / f"{prefix}{os.urandom(6).hex()}"
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


# The tree's processes as the journal named them, by pidfd (opened as each step is read, while the tree lives): a
# process that took a pid of the tree after it ended is never signalled.
_PIDFDS: dict[int, int] = {}


def _hold(pids: object) -> None:
    for pid in pids if isinstance(pids, list) else [pids]:
        if isinstance(pid, int) and pid > 0 and pid not in _PIDFDS:
            with contextlib.suppress(OSError):
                _PIDFDS[pid] = os.pidfd_open(pid)


def _signal(pid: int, sig: int) -> None:
    """`sig` to the tree's `pid`, through the pidfd held for it (none: it had ended already, nothing is sent)."""
    if (fd := _PIDFDS.get(pid)) is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, sig)


def _guard(fd: int) -> None:
    steps: list[dict[str, Any]] = []
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
                return  # the worker finished (a CRIU it started may still hold the journal: nothing is left to do)
            for key in ("stop", "dump", "root", "lazy_pages"):
                _hold(steps[-1].get(key))
    if not steps:
        return
    started = time.monotonic()
    committed = [s["commit"] for s in steps if "commit" in s]
    kind = str(steps[0].get("worker", "capture"))
    undone = (_undo_restore(steps) if kind == "restore" else [_end_tree([int(p) for p in committed[-1]])]
              if committed else _undo(steps))
    for work in dict.fromkeys(str(s["work"]) for s in steps if "work" in s):  # a restore's: CRIU's, its kernel probe's
        # a failed capture's dump log is kept as the worker's own rollback keeps it
        undone.append(_remove_work(Path(work), None if committed else _images(steps)))
    sys.stderr.write(f"coldsnap-worker: {kind} guard: the worker died; undone in {time.monotonic() - started:.2f} s:"
                     f" {'; '.join(undone) or 'nothing was begun'}\n")
    sys.stderr.flush()


def _undo(steps: list[dict[str, Any]]) -> list[str]:
    """The capture's own rollback order: its CUDA state comes back (a stopped tree held still meanwhile), the tree
    runs, then its memory comes back."""
    undone: list[str] = []
    stopped = [s.get("stop") or s["dump"] for s in steps if "stop" in s or "dump" in s]
    tree = [int(p) for p in stopped[-1]] if stopped else []
    if tree:
        undone.append(_hold_still(tree, [s for s in steps if "hold" in s]))
    cuda = [(int(s["cuda"]), str(s["state"])) for s in steps if "cuda" in s]
    driver = None
    try:
        driver = _undo_cuda(cuda, held=bool(tree)) if cuda else None
    except Exception as exc:  # no driver to load, or cuInit refused: the tree stopped above must still run again
        undone.append(f"CUDA state of {sorted({p for p, _ in cuda})} not undone: {type(exc).__name__}: {exc}")
    if tree:
        undone.append(_let_tree_run(tree))
    if driver is not None:  # asked once the tree runs: GetState does not answer for a stopped process
        undone.append(_cuda_states(driver, cuda))
    images = _images(steps)
    memory = [s for s in steps if "memory" in s]
    if memory and images is not None:
        undone.append(_give_memory_back(images, memory[-1]["memory"]))
    if images is not None:
        undone.append(_remove_images(images, created=bool(next(s for s in steps if "images" in s).get("created"))))
    return undone


def _undo_restore(steps: list[dict[str, Any]]) -> list[str]:
    """No restored tree is left: the lazy-pages daemon ends, then the restored tree's process group is killed. The
    CRIU restore has ended (it held the journal), so its pidfile names the tree if the worker could not."""
    for partial in [str(s["partial"]) for s in steps if "partial" in s]:  # a /dev/shm file being put back
        with contextlib.suppress(OSError):
            os.unlink(partial)
    roots = [int(s["root"]) for s in steps if "root" in s]
    began = next((s for s in steps if "restore" in s), None)
    if not roots and began is not None:
        with contextlib.suppress(OSError, ValueError):
            roots = [int(Path(began["pidfile"]).read_text().split()[0])]
            _hold(roots)
    lazy = [int(s["lazy_pages"]) for s in steps if "lazy_pages" in s]
    for pid in lazy:
        _signal(pid, signal.SIGKILL)
    if not lazy and (named := [str(s["lazy_socket"]) for s in steps if "lazy_socket" in s]):
        _hang_up(named[-1])
    # Only a root whose pidfd says it still lives: its group is the tree's (killpg(1) would be kill(-1), 0 the
    # guard's own group, and a pid since taken by another process is never the tree's).
    roots = [root for root in roots if root > 1 and _alive(root)]
    for root in roots:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)
        _signal(root, signal.SIGKILL)
    return [f"restored tree {roots} killed" if roots else "no tree was restored"]


def _alive(pid: int) -> bool:
    """The journalled process `pid` has not exited (its pidfd is not readable yet)."""
    fd = _PIDFDS.get(pid)
    return fd is not None and not select.select([fd], [], [], 0)[0]


def _hang_up(path: str) -> None:
    """End a lazy-pages daemon still waiting for its restore: a connection that sends nothing is a failed one.
    (Through the directory's descriptor: a socket's path may be longer than a socket address holds.)"""
    with contextlib.suppress(OSError):
        folder = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
                peer.settimeout(1.0)
                peer.connect(f"/proc/self/fd/{folder}/{os.path.basename(path)}")
        finally:
            os.close(folder)


def _images(steps: list[dict[str, Any]]) -> Path | None:
    return next((Path(s["images"]) for s in steps if "images" in s), None)


def _hold_still(tree: list[int], holds: list[dict[str, Any]]) -> str:
    """The CRIU dump and the worker's hold have ended (both held the journal): once the kernel has let go of the
    tree, it is stopped again (through its pidfds), and a thread the worker let run alone gets its own mask back."""
    # Imported here, in the guard's own process and only for this undo: off a restore worker's path to CRIU.
    from ._held_tree import wait_stopped, wait_untraced
    from ._thread_hold import ThreadHold

    wait_untraced(tree)
    for pid in tree:
        _signal(pid, signal.SIGSTOP)
    with contextlib.suppress(WorkerError):  # what does not stop is undone running (`undo_cuda`)
        wait_stopped(tree)
    given = []
    for step in holds:
        tid, mask = int(step["thread"]), int(step["mask"])
        with contextlib.suppress(WorkerError), ThreadHold(int(step["hold"])) as hold:
            if hold.put_back_mask(tid, mask):
                given.append(tid)
    return f"tree {tree} stopped" + (f", thread {given} given its signal mask back" if given else "")


def _let_tree_run(tree: list[int]) -> str:
    for pid in tree:
        _signal(pid, signal.SIGCONT)
    alive = [p for p in tree if Path(f"/proc/{p}").exists()]
    return f"tree {tree} running again ({len(alive)} alive)"


def _end_tree(tree: list[int]) -> str:
    for pid in tree:
        _signal(pid, signal.SIGKILL)
    return f"the capture was complete: tree {tree} ended, images kept"


def _undo_cuda(done: list[tuple[int, str]], *, held: bool) -> Any:
    """The CUDA state restored and unlocked (`undo_cuda`); the driver, for `_cuda_states`."""
    from ._cuda import Driver  # only here: the worker forked the guard before any CUDA call
    from ._held_tree import held as hold
    from ._process import undo_cuda

    driver = Driver()
    driver.call("cuInit", 0)
    undo_cuda(driver, done, hold(driver) if held else None)
    return driver


def _cuda_states(driver: Any, done: list[tuple[int, str]]) -> str:
    states = {}
    for pid in sorted({p for p, _ in done}):
        try:
            states[pid] = driver.state(pid)
        except Exception as exc:  # a process that exited has no state: say so
            states[pid] = type(exc).__name__
    return f"CUDA states {states}"


def _give_memory_back(images: Path, weights_control: str | None) -> str:
    """Every memory source's release, as its records in the images say (a release the worker died in before it
    wrote a record stays with the engine's own gate)."""
    from .hydration import HydrationManifest
    from .memory import read_record
    from .memory._device_dump import RECORD, DeviceRelease, validated_dumps
    from .memory._weights import RECORD as WEIGHTS_RECORD
    from .memory._weights import WeightsCapture

    given: list[str] = []
    if (images / RECORD).exists():
        with contextlib.suppress(Exception):
            release = DeviceRelease(images, [])
            release.records = validated_dumps(images)
            release.asked = [(r.socket, images / r.directory) for r in release.records]
            release.roll_back()
            given.append(f"device memory of {[r.pid for r in release.records]}")
    if weights_control and (images / WEIGHTS_RECORD).exists():
        weights = WeightsCapture(images, weights_control)
        with contextlib.suppress(Exception):
            weights.manifest = HydrationManifest.from_json(read_record(images, WEIGHTS_RECORD, None))
        weights.roll_back()
        given.append("weights")
    return f"memory given back: {', '.join(given) or 'none was released'}"


def _remove_images(images: Path, *, created: bool) -> str:
    if created:
        shutil.rmtree(images, ignore_errors=True)
    else:
        remove_contents(images)
    return f"images {images} removed"


def _remove_work(work: Path, images: Path | None) -> str:
    """The worker's scratch directory; a failed dump's log goes to the images directory if that one stays."""
    if images is not None and images.is_dir() and (work / "dump.log").is_file():
        with contextlib.suppress(OSError):
            shutil.copy2(work / "dump.log", images / "dump.log")
    shutil.rmtree(work, ignore_errors=True)
    return f"scratch {work} removed"


def remove_contents(images: Path) -> None:
    """Everything in the images directory, never through a link (a failed capture leaves nothing that restores)."""
    for entry in list(images.iterdir()) if images.is_dir() else []:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)

"""A worker's guard: what a capture or restore worker is about to do, undone if the worker dies before it ends.

A worker can be killed in any phase (the kernel's OOM killer, a node agent's timeout, a client whose exec is torn
down): the capture's own rollback (`_capture.py`) then never runs, and the workload would stay locked or
checkpointed by the CUDA driver, stopped after CRIU's dump, its device memory or weights released, with
half-written images. So the worker command forks a guard before its first step (before any CUDA call, so the guard
may initialise the driver itself): a child in its own session that reads the worker's journal on a pipe, one JSON
line per step *about to be taken*:

    {"worker": "capture" | "restore"}      first, from `start`
    {"images": path, "created": bool}      the images directory (removed, or emptied, on undo)
    {"memory": weights_control}            the memory sources are about to release (undone from their records)
    {"cuda": pid, "state": "locked" | "checkpointed"}
    {"dump": [pids]}                        CRIU dumps the tree (always `--leave-stopped`)
    {"commit": [pids]}                      the images are complete (capture.json written): the tree ends
    {"end": true}                          the worker finished: a capture, or its own rollback

When the pipe closes after `commit` but without `end`, the guard ends the stopped tree, as the worker was about
to (the images are the capture). When it closes before, the guard undoes, in the order of the capture's own
rollback: it waits for CRIU to let go of the tree (no process of it traced any more), lets the tree run
(SIGCONT), restores what was checkpointed and unlocks what was locked, has every memory source give back what its
records in the images say it released, and removes the images.
Each undo checks the state first (a step journalled but never taken is a no-op). What it undid goes to stderr,
which it shares with the worker: the exec's reply ends with it, and comes only once it is done.

A restore journals two steps, `{"restore": images, "pidfile": path}` before CRIU runs and `{"root": pid}` once the
restored tree exists: a restore worker that dies leaves no restored tree (nothing half-restored serves: stopped,
checkpointed on the GPU, or running unreported), as its own rollback would: the guard waits for an orphaned CRIU
restore of those images and its lazy-pages daemon, then kills the tree's process group. (In a restore unit the
container's end kills everything too; a worker run on a host has only its guard.) A stage the worker asked of a
node hydrator is freed by the hydrator when the worker exits (its pidfd rode with the request).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ("WorkerGuard", "remove_contents")

CRIU_LET_GO_S = 60.0  # for a CRIU dump the dead worker started to finish with the tree
CRIU_START_S = 0.1  # for a CRIU the worker forked just before it died to show itself (its exec)


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
    for pid in pids if isinstance(pids, list) else []:
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
            if isinstance(steps[-1], dict):
                _hold(steps[-1].get("dump"))
    if not steps or steps[-1].get("end"):
        return
    started = time.monotonic()
    committed = [s["commit"] for s in steps if "commit" in s]
    kind = str(steps[0].get("worker", "capture"))
    undone = (_undo_restore(steps) if kind == "restore" else [_end_tree([int(p) for p in committed[-1]])]
              if committed else _undo(steps))
    sys.stderr.write(f"coldsnap-worker: {kind} guard: the worker died; undone in {time.monotonic() - started:.2f} s:"
                     f" {'; '.join(undone) or 'nothing was begun'}\n")
    sys.stderr.flush()


def _undo(steps: list[dict[str, Any]]) -> list[str]:
    """The capture's own rollback order: the tree runs, its CUDA state comes back, then its memory."""
    undone: list[str] = []
    dumps = [s["dump"] for s in steps if "dump" in s]
    if dumps:
        undone.append(_let_tree_run([int(p) for p in dumps[-1]]))
    cuda = [(int(s["cuda"]), str(s["state"])) for s in steps if "cuda" in s]
    if cuda:  # after the tree runs again: the CUDA restore needs its restore thread scheduled
        undone.append(_undo_cuda(cuda))
    images = next((Path(s["images"]) for s in steps if "images" in s), None)
    memory = [s for s in steps if "memory" in s]
    if memory and images is not None:
        undone.append(_give_memory_back(images, memory[-1]["memory"]))
    if images is not None:
        undone.append(_remove_images(images, created=bool(next(s for s in steps if "images" in s).get("created"))))
    return undone


def _undo_restore(steps: list[dict[str, Any]]) -> list[str]:
    """No restored tree is left: CRIU's (orphaned) restore ends first, then its tree's process group is killed."""
    roots = [int(s["root"]) for s in steps if "root" in s]
    began = next((s for s in steps if "restore" in s), None)
    if not roots and began is not None:
        images = str(began["restore"]).encode()
        _wait_while(lambda: _running([b"restore", b"--images-dir", images]), grace=CRIU_START_S)
        with contextlib.suppress(OSError, ValueError):
            roots = [int(Path(began["pidfile"]).read_text().split()[0])]
    if began is not None:
        for pid in _pids_of([b"lazy-pages", b"--images-dir", str(began["restore"]).encode()]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    roots = [root for root in roots if root > 1]  # killpg(1) is kill(-1): every process; killpg(0) the guard's own
    for root in roots:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root, signal.SIGKILL)
    return [f"restored tree {roots} killed" if roots else "no tree was restored"]


def _wait_while(busy: Callable[[], bool], *, grace: float) -> None:
    """Until `busy` is false (after `grace` seconds at least, for a child still starting), CRIU_LET_GO_S at most."""
    now = time.monotonic()
    give_up, grace_end = now + CRIU_LET_GO_S, now + grace
    while time.monotonic() < give_up:
        if not busy() and time.monotonic() > grace_end:
            return
        time.sleep(0.005)


def _let_tree_run(tree: list[int]) -> str:
    """CRIU (the dead worker's child, maybe still starting) finishes or fails on its own, leaving the tree stopped
    (or dead); only then does the tree run again."""
    dump = [b"dump", b"--tree", str(tree[0]).encode()]
    _wait_while(lambda: _running(dump) or any(_traced(p) for p in tree), grace=CRIU_START_S)
    for pid in tree:
        _signal(pid, signal.SIGCONT)
    alive = [p for p in tree if Path(f"/proc/{p}").exists()]
    return f"tree {tree} running again ({len(alive)} alive)"


def _end_tree(tree: list[int]) -> str:
    for pid in tree:
        _signal(pid, signal.SIGKILL)
    return f"the capture was complete: tree {tree} ended, images kept"


def _pids_of(words: list[bytes]) -> list[int]:
    """The processes whose command line holds `words` in a row (a CRIU the dead worker started, orphaned)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(argv[i:i + len(words)] == words for i in range(len(argv) - len(words) + 1)):
            found.append(int(entry))
    return found


def _running(words: list[bytes]) -> bool:
    return bool(_pids_of(words))


def _traced(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in status.splitlines())


def _undo_cuda(done: list[tuple[int, str]]) -> str:
    from ._cuda import Driver  # only here: the worker forked the guard before any CUDA call
    from ._process import undo_cuda

    driver = Driver()
    driver.call("cuInit", 0)
    undo_cuda(driver, done)
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
            weights.manifest = HydrationManifest.from_json(json.loads((images / WEIGHTS_RECORD).read_text()))
        weights.roll_back()
        given.append("weights")
    return f"memory given back: {', '.join(given) or 'none was released'}"


def _remove_images(images: Path, *, created: bool) -> str:
    if created:
        shutil.rmtree(images, ignore_errors=True)
    else:
        remove_contents(images)
    return f"images {images} removed"


def remove_contents(images: Path) -> None:
    """Everything in the images directory, never through a link (a failed capture leaves nothing that restores)."""
    for entry in list(images.iterdir()) if images.is_dir() else []:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)

"""What a worker's guard undoes when its worker dies: the guard's own process (forked by `_worker_guard.WorkerGuard`)
reads the journal to its end and, when the worker never wrote `end`, imports this and undoes what the journal names,
in the order of the worker's own rollback (the journal's steps and the undo's rules: `_worker_guard`). Imported by
the guard alone, and only for an undo: none of it is on a worker's path (a restore's to CRIU), nor competes with it
for a CPU."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .errors import WorkerError

__all__ = ("remove_contents", "undo")


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


def undo(steps: list[dict[str, Any]], held: dict[int, int]) -> None:
    """Undo what the journal's `steps` name (the worker died before `end`); `held`: the pidfds the guard opened for
    the tree's processes as it read each step."""
    _PIDFDS.update(held)
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

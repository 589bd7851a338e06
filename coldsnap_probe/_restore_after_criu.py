"""Restore, the phases after CRIU's start (`_restore.py` runs those before it and the one rollback): CUDA restore and
unlock per process, reverse inventory order, only its restore thread running -> [cuda-restored] -> every page in (lazy
pages) -> resume the tree -> [process-resumed] -> hydrate every memory source, in reverse registry order -> recreate
the communicators -> [ready] -> where CRIU's restore spent its time (its log). Brackets are barriers.

A module of its own so that a restore worker imports it (and what it needs: the held tree, the engine's control
socket) while CRIU runs, not on its path to CRIU (issue 35 item 2: `_restore._import_later_phases`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ._coordinator import Coordinator
from ._criu_restore_log import restore_phases
from ._engine import ABORT_POLL, resume_engine
from ._held_tree import driver_alone
from ._process import process_state, require_state, tail
from ._reports import RestoredGraphPolicy, RestoreReport, Timeline
from .errors import RankAborted, WorkerError

if TYPE_CHECKING:
    from ._criu_kdat import KernelProbe
    from ._cuda import Driver
    from ._phase import PhaseLog
    from .memory import MemoryRestores

__all__ = ("LAZY_PAGES_FINISH_S", "RestoredTree", "after_criu", "restore_args")

LAZY_PAGES_FINISH_S = 120.0  # for `criu lazy-pages` to have copied every page after the restore


class RestoredTree(Protocol):
    """What the later phases need of a restore (`_restore.py`'s run) once CRIU has started."""

    phase: PhaseLog
    timeline: Timeline
    report: RestoreReport
    ranks: Coordinator
    driver: Driver | None  # the CUDA driver, initialised while CRIU ran; None: no CUDA process
    cuda: list[int]
    gpu_pairs: list[tuple[bytes, bytes]]
    lazy: subprocess.Popen[bytes] | None
    work: Path | None
    memory: MemoryRestores | None
    engine: str | None
    graph: RestoredGraphPolicy | None
    kernel: KernelProbe | None  # CRIU's kernel-feature probe, when the worker ran one


def after_criu(run: RestoredTree, root: int) -> None:
    """The phases from the CUDA restore of the tree CRIU restored (`root`) to `ready`."""
    run.phase.enter("cuda-restore")
    _cuda_restore(run, root)
    if run.lazy:
        run.phase.enter("pages-in")
        _finish_lazy_pages(run.lazy, run.work or Path(), root, run.ranks)
        run.timeline.mark("all_pages_in")
        run.report.all_pages_in_seconds = run.timeline.seconds("restore_begin", "all_pages_in")
    run.phase.enter("resume")
    _resume(run, root)
    if run.memory is not None:
        run.phase.enter("hydrate")
        run.memory.hydrate(run.report)
    if run.engine and run.graph is not None:
        run.phase.enter("communicators")
        _recreate_communicators(run, run.engine, run.graph)
    run.ranks.barrier("ready")
    run.timeline.mark("ready")
    _criu_phases(run)


def _criu_phases(run: RestoredTree) -> None:
    """Where CRIU's restore spent its time, from its log (after `ready`: off the restored server's path)."""
    try:
        phases = restore_phases((run.work or Path()).joinpath("restore.log").read_bytes())
    except OSError:
        return
    if run.kernel is not None and run.kernel.seconds is not None:
        phases["kdat_probe_s"] = round(run.kernel.seconds, 6)
    if run.kernel is not None and run.kernel.carried_seconds is not None:  # no probe ran: the capture's cache
        phases["kdat_carried_s"] = round(run.kernel.carried_seconds, 6)
    run.report.criu_restore_phases = phases


def _cuda_restore(run: RestoredTree, root: int) -> None:
    """n610: per CUDA process in reverse inventory order: checkpointed -> restore -> locked -> unlock."""
    driver = run.driver
    if driver is None:
        return
    run.timeline.mark("deferred_cuda_restore_begin")
    for pid in reversed(run.cuda):
        # CRIU left the tree stopped: only the driver's restore thread runs until the process's CUDA state is
        # back (a thread running meanwhile may touch mappings not yet restored: `_held_tree`).
        with driver_alone(driver, pid):
            require_state(driver, [pid], "checkpointed", "before CUDA restore")
            driver.call("cuCheckpointProcessRestore", pid, restore_args(driver.cuda, run.gpu_pairs))
            require_state(driver, [pid], "locked", "after CUDA restore")
            driver.call("cuCheckpointProcessUnlock", pid, None)
            require_state(driver, [pid], "running", "after unlock")
    if not (run.ranks.multi or run.lazy):
        os.killpg(root, signal.SIGCONT)  # else held until every rank's CUDA state is back, every page is in
    run.timeline.mark("deferred_cuda_restore_end")
    seconds = run.report.cuda_restore_seconds = run.timeline.seconds("deferred_cuda_restore_begin",
                                                                     "deferred_cuda_restore_end")
    peers = run.ranks.barrier("cuda-restored", {"cuda_seconds": seconds})
    run.report.peer_cuda_restore_seconds = [p.get("cuda_seconds") for p in peers]
    if run.ranks.multi:
        run.timeline.mark("distributed_cuda_restore_barrier_end")


def _resume(run: RestoredTree, root: int) -> None:
    if run.ranks.multi or run.lazy:
        os.killpg(root, signal.SIGCONT)
    if run.ranks.multi:
        run.ranks.barrier("process-resumed")
    run.timeline.mark("process_resumed")  # without CUDA, one rank, eager: the tree was restored running


def _recreate_communicators(run: RestoredTree, engine: str, graph: RestoredGraphPolicy) -> None:
    run.timeline.mark("communicator_recreate_begin")
    run.report.engine_resume = resume_engine(engine, run.ranks, graph.effective, "restore", run.work or Path())
    run.timeline.mark("communicator_recreate_end")
    run.report.communicator_recreate_seconds = run.timeline.seconds("communicator_recreate_begin",
                                                                    "communicator_recreate_end")


def restore_args(cuda: Any, pairs: list[tuple[bytes, bytes]]) -> Any:
    """`cuCheckpointProcessRestore`'s arguments: None on the captured GPU; else a `CUcheckpointRestoreArgs` whose
    `gpuPairs` map each captured GPU's UUID onto this host's (`cuda`: cuda-python's driver module)."""
    if not pairs:
        return None
    built = []
    for was, now in pairs:
        pair = cuda.CUcheckpointGpuPair()
        for field, value in (("oldUuid", was), ("newUuid", now)):
            uuid = cuda.CUuuid()
            ctypes.memmove(uuid.getPtr(), value, len(value))  # (the binding's `bytes` is read-only)
            setattr(pair, field, uuid)
        built.append(pair)
    args = cuda.CUcheckpointRestoreArgs()
    args.gpuPairs, args.gpuPairsCount = built, len(built)
    return args


def _finish_lazy_pages(daemon: subprocess.Popen[bytes], work: Path, root: int, ranks: Coordinator) -> None:
    """Every page is in once the daemon exits 0 while the restored tree still lives (the tree is stopped
    meanwhile, so nothing runs on memory the daemon might never fill). A timeout or a peer's abort leaves
    the daemon to the caller, which kills the tree first."""
    give_up = time.monotonic() + LAZY_PAGES_FINISH_S
    while daemon.poll() is None:
        if time.monotonic() > give_up:
            raise WorkerError(f"criu lazy-pages had not copied every page after {LAZY_PAGES_FINISH_S:.0f} s")
        if reason := ranks.aborted():
            raise RankAborted(f"the activation was aborted while pages were restored: {reason}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.wait(ABORT_POLL)
    if daemon.returncode != 0:
        raise WorkerError(f"criu lazy-pages exited {daemon.returncode}, the restored memory is incomplete: "
                          f"{tail(work / 'lazy-pages.log')}")
    if process_state(root) in ("", "Z", "X"):
        raise WorkerError(f"the restored process {root} exited while its pages were restored")

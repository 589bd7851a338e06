"""Capture as phases (admission spec 7.2, 7.3): each phase records what it did, and one rollback undoes it.

n580 (a pre-CUDA template): audit -> [capture-ready] -> CRIU dump -> [dumped].
n610 (initialized CUDA state): find the CUDA processes -> [capture-ready, the ranks agree on the graph policy]
-> quiesce the engine's communicators -> [quiesced] -> release every memory source, in registry order
(`memory.SOURCES`: the engine's weights, then the CUDA interposer's device memory, each recorded into the images)
-> CUDA lock -> the tree stopped, CUDA checkpoint (each process held but its driver's restore thread) ->
[checkpointed] -> CRIU dump (+ graph.json) -> [dumped]. Brackets are the ranks' barriers. From the checkpoint until
the dump or the rollback is done nothing of the tree runs but the driver's restore thread (`_held_tree`: a thread
let run meanwhile may touch device mappings the driver has torn down).

The rollback, in this order, whatever phase failed: abort the activation for every rank (peers first), restore
and unlock what was checkpointed and locked (the process done last first; in a stopped tree each process held but
its restore thread), let a stopped tree run again, give back
what each memory source released, in reverse registry order (the device memory hydrated back and its dump
removed, which opens the interposer's gate, then the weights hydrated back), recreate the communicators the
quiesce destroyed, keep CRIU's log beside the images.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

from ._coordinator import Coordinator
from ._criu_kdat import CACHE_VARIABLE, KernelProbe, carry
from ._criu_stats import dump_stats
from ._cuda import Driver
from ._cuda_ipc import refuse_cuda_ipc
from ._engine import check_quiesced, engine_request, graph_plan, resume_engine, write_graph_record
from ._graph import GraphPlan
from ._guard_undo import remove_contents
from ._held_tree import driver_alone, held, stop_again, stop_tree, wait_stopped
from ._images_fs import images_filesystem
from ._phase import PhaseLog
from ._process import (
    anonymous_memory,
    audit_pre_cuda,
    cuda_processes,
    image_digest,
    images_size,
    process_age_s,
    process_tree,
    require_state,
    run_criu,
    signal_tree,
    undo_cuda,
)
from ._profile import identity
from ._quiesce import IDLE_WAIT_S, event_loops, wait_idle
from ._reports import CapturedGraphPolicy, CaptureReport
from ._shm_files import save_shared_files, shared_files
from ._worker_guard import WorkerGuard
from .errors import WorkerError
from .memory import CaptureScope, MemoryCaptures, MemoryOptions

__all__ = ("capture",)


def capture(pid: int, images: Path, *, criu: str, boundary: str = "n610", lock_timeout_ms: int = 30_000,
            digest: bool = False, memory: MemoryOptions | None = None, coordinator: Coordinator | None = None,
            engine: str | None = None, graph_policy: str = "auto", phases: PhaseLog | None = None,
            guard: WorkerGuard | None = None, worker_main_ns: int | None = None) -> CaptureReport:
    """Checkpoint and dump the tree rooted at `pid` into `images` (must be new or empty); `memory` says what
    the memory sources release; `phases` publishes each phase as it begins; `guard` (started) undoes the capture
    if this process dies before it ends; `worker_main_ns` (when the worker command's main began, unix ns) makes
    the report say what the worker's start cost before the capture began (`timings_s.worker_start`)."""
    began_ns = time.time_ns()
    if boundary not in ("n580", "n610"):
        raise WorkerError(f"boundary must be n580 or n610, got {boundary!r}")
    if images.exists() and any(images.iterdir()):
        raise WorkerError(f"images directory {images} is not empty")
    ranks = coordinator or Coordinator.single()
    if ranks.multi and boundary == "n610" and not engine:
        raise WorkerError("several ranks need the engine's control socket (engine=) to release their "
                          "communicators before capture")
    journal = guard or WorkerGuard()
    journal.note(images=str(images.absolute()), created=not images.exists())
    images.mkdir(mode=0o700, parents=True, exist_ok=True)
    run = _Capture(pid, images, criu=criu, boundary=boundary, ranks=ranks, memory=memory or MemoryOptions(),
                   engine=engine,
                   plan=graph_plan(graph_policy, ranks.world_size) if engine and boundary == "n610" else None,
                   phases=phases or PhaseLog("capture", publish=False), journal=journal)
    if worker_main_ns is not None:  # the interpreter's own start (to the clock tick), then the command's
        run.report.timings_s["worker_start"] = (began_ns - worker_main_ns) / 1e9
        run.report.timings_s["interpreter_start"] = max(
            0.0, process_age_s(os.getpid()) - (time.time_ns() - worker_main_ns) / 1e9)
    run.report.images_filesystem = images_filesystem(images)
    try:
        run.run(lock_timeout_ms)
        run.phase.enter("finish")
        return run.finish(digest=digest)
    finally:
        journal.end()


class _Capture:
    """One capture's state: what each phase did, so that `roll_back` undoes exactly that."""

    def __init__(self, pid: int, images: Path, *, criu: str, boundary: str, ranks: Coordinator,
                 memory: MemoryOptions, engine: str | None, plan: GraphPlan | None, phases: PhaseLog,
                 journal: WorkerGuard) -> None:
        self.pid, self.images, self.criu, self.ranks, self.phase = pid, images, criu, ranks, phases
        self.journal = journal  # each step is noted before it is taken: a guard undoes it if this process dies
        self.memory_options, self.engine, self.plan = memory, engine, plan
        self.tree = process_tree(pid)
        self.report = CaptureReport(boundary=boundary, root_pid=pid, tree=self.tree, rank=ranks.rank,
                                    world_size=ranks.world_size, engine=engine)
        self.work = journal.scratch("coldsnap-capture-")  # CRIU's work dir: the guard removes it if we die
        # What was done, for the rollback. Invariant: each is set right after its step succeeded (or began, for
        # `quiesced`: a quiesce that failed half-way still needs its communicators back).
        self.driver: Driver | None = None
        self.done: list[tuple[int, str]] = []  # (pid, "locked" | "checkpointed"), in the order done
        self.quiesced = self.stopped = self.dumped = False  # stopped: SIGSTOP was sent to the tree
        self.memory: MemoryCaptures | None = None  # what the memory sources released (each rolls back its own)
        self.kernel: KernelProbe | None = None  # CRIU's kernel probe for the dump, from `run` on

    def run(self, lock_timeout_ms: int) -> None:
        # n610: CRIU's kernel-feature probe, run while the tree is locked and checkpointed: the dump loads its
        # cache instead of probing (tens of milliseconds of the capture), and the images carry it (`_criu_kdat`). A
        # template (n580) goes to its dump at once: nothing to run it beside, the dump probes for itself.
        if self.report.boundary == "n610":
            self.kernel = KernelProbe(self.criu, self.journal.scratch("coldsnap-kdat-"))
        try:
            if self.report.boundary == "n580":
                self._template()
            else:
                self._initialized(lock_timeout_ms)
        except BaseException as exc:
            self._roll_back(exc)
            raise
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
            if self.kernel is not None:
                self.kernel.close()

    # -- the phases, in order ----------------------------------------------------------------------------------
    def _template(self) -> None:
        """n580: no CUDA state may be in the tree; a CPU-only dump."""
        self.phase.enter("audit")
        audit_pre_cuda(self.tree)
        self.report.event_loops = event_loops(self.tree)  # an io_uring ring would fail deep in CRIU's dump
        self.report.cuda_pids = []
        self.ranks.barrier("capture-ready", {"pid": self.pid})
        self._dump()
        self.ranks.barrier("dumped")

    def _initialized(self, lock_timeout_ms: int) -> None:
        """n610: every CUDA process of the tree locked and checkpointed, then dumped with the rest."""
        self.phase.enter("find-cuda")
        started = time.perf_counter()
        self.driver = Driver()
        self.driver.call("cuInit", 0)
        cuda = self._find_cuda(self.driver)
        self.report.timings_s["find_cuda"] = time.perf_counter() - started
        self.report.cuda_ipc = refuse_cuda_ipc(cuda, self.memory_options)  # before anything is done to the tree
        self._agree_on_policy()
        self._quiesce()
        self.ranks.barrier("quiesced")
        self._wait_idle()
        self._release_memory(cuda)
        started = time.perf_counter()  # both scans are on the capture's path: the report says what they cost
        self.report.memory_before_checkpoint = {str(p): anonymous_memory(p) for p in self.tree}
        scanned = time.perf_counter() - started
        self._lock(self.driver, cuda, lock_timeout_ms)
        self._checkpoint(self.driver, cuda)
        self.ranks.barrier("checkpointed")
        started = time.perf_counter()
        self.report.memory_after_checkpoint = {str(p): anonymous_memory(p) for p in self.tree}
        self.report.timings_s["memory_scan"] = scanned + time.perf_counter() - started
        self._dump()
        if self.plan is not None:
            write_graph_record(self.images, self.plan, self.ranks.world_size)
        self.ranks.barrier("dumped")

    def _find_cuda(self, driver: Driver) -> list[int]:
        cuda = cuda_processes(driver, self.tree)
        if not cuda:
            raise WorkerError(f"no CUDA process in the tree of {self.pid} (n610 needs initialized CUDA state)")
        self.report.cuda_pids = cuda
        require_state(driver, cuda, "running", "before lock")
        return cuda

    def _agree_on_policy(self) -> None:
        peers = self.ranks.barrier("capture-ready", {"pid": self.pid,
                                                     "policy": self.plan.recorded if self.plan else None})
        if len({str(p.get("policy")) for p in peers}) != 1:
            raise WorkerError(f"the ranks disagree on the graph policy: {[p.get('policy') for p in peers]}")

    def _quiesce(self) -> None:
        """Under a graph policy: the engine destroys its communicators (and graphs) before the CUDA lock."""
        if self.plan is None:
            return
        plan = self.plan
        self.phase.enter("quiesce")
        self.report.graph_policy = CapturedGraphPolicy(requested=plan.requested, recorded=plan.recorded,
                                                       effective=plan.effective, reason=plan.reason)
        started = time.perf_counter()
        self.quiesced = True  # from here a failure recreates the communicators (rollback)
        answer = engine_request(str(self.engine), {"op": "quiesce", "policy": plan.effective},
                                "the engine did not quiesce before capture", timeout=60)
        self.report.engine_quiesce = answer
        check_quiesced(answer, plan, self.tree)
        self.report.timings_s["engine_quiesce"] = time.perf_counter() - started

    def _wait_idle(self) -> None:
        """Without a graph policy the tree may be a server we do not control: its own requests end first."""
        if self.plan is not None:
            return
        self.phase.enter("wait-idle")
        started = time.perf_counter()
        self.report.event_loops = event_loops(self.tree)
        wait_idle(self.tree, IDLE_WAIT_S)
        self.report.timings_s["wait_idle"] = time.perf_counter() - started

    def _release_memory(self, cuda: list[int]) -> None:
        """Every registered memory source gets its memory out of the tree and records it into the images."""
        self.phase.enter("release-memory")
        self.journal.note(memory=self.memory_options.weights_control)
        self.memory = MemoryCaptures(CaptureScope(self.images, cuda, self.memory_options))
        self.memory.release(self.report)

    def _lock(self, driver: Driver, cuda: list[int], timeout_ms: int) -> None:
        self.phase.enter("cuda-lock")
        started = time.perf_counter()
        for p in cuda:
            args = driver.cuda.CUcheckpointLockArgs()
            args.timeoutMs = timeout_ms
            self.journal.note(cuda=p, state="locked")
            driver.call("cuCheckpointProcessLock", p, args)
            self.done.append((p, "locked"))
        require_state(driver, cuda, "locked", "after lock")
        self.report.timings_s["cuda_lock"] = time.perf_counter() - started

    def _checkpoint(self, driver: Driver, cuda: list[int]) -> None:
        """The tree stopped (every CUDA call in flight ended at the lock), then each CUDA process checkpointed with
        only its driver's restore thread running; every thread back in its stop before CRIU seizes the tree."""
        self.phase.enter("cuda-checkpoint")
        started = time.perf_counter()
        self.journal.note(stop=self.tree)
        self.stopped = True
        stop_tree(self.tree)
        self.report.timings_s["tree_stop"] = time.perf_counter() - started
        in_driver = 0.0
        for p in cuda:
            with driver_alone(driver, p, note=self.journal.note):
                self.journal.note(cuda=p, state="checkpointed")
                called = time.perf_counter()
                driver.call("cuCheckpointProcessCheckpoint", p, None)
                self.done.append((p, "checkpointed"))
                # GetState only while the restore thread runs (as every restore asks it): asked of the stopped
                # process after the hold, it never answered and the capture hung (H200, 2026-12-02).
                require_state(driver, [p], "checkpointed", "after checkpoint")
                in_driver += time.perf_counter() - called
        wait_stopped(self.tree)  # a released restore thread re-enters its group stop: CRIU then sees one state
        total = self.report.timings_s["cuda_checkpoint"] = time.perf_counter() - started
        self.report.timings_s["thread_hold"] = total - self.report.timings_s["tree_stop"] - in_driver

    def _dump(self) -> None:
        # The dumped tree stays stopped until the images are complete (capture.json) and, with several ranks, until
        # every rank has dumped: a failed peer, or a guard whose worker died meanwhile, lets it run again. Its
        # shared-memory files are copied meanwhile (nothing writes them; a failed copy lets it run again too).
        self.phase.enter("criu-dump")
        self.journal.note(dump=self.tree)
        shared = shared_files(self.tree)
        args = ["dump", "--tree", str(self.pid), "--images-dir", str(self.images), "--work-dir", str(self.work),
                "--leave-stopped"]
        # The kernel probe's cache (or, without one, the dump's own probe written to the work dir), carried in the
        # images: a restore on this boot, in this confinement, then runs none (`_criu_kdat`).
        waited = time.perf_counter()
        env = (self.kernel.environment() if self.kernel else {}) or {CACHE_VARIABLE: str(self.work / "criu.kdat")}
        if self.kernel is not None:  # what the dump waited for the probe: on the capture's path
            self.report.timings_s["kdat_wait"] = time.perf_counter() - waited
        self.report.timings_s["criu_dump"] = run_criu(self.criu, args, self.work / "dump.log",
                                                      lifeline=self.journal.lifeline(), env=env)
        self.dumped = True
        carry(Path(env[CACHE_VARIABLE]), self.images)
        try:  # where CRIU's time went; an unreadable account is said so, the images are whole all the same
            self.report.criu_dump_stats = {**dump_stats(self.work)}
        except (OSError, WorkerError) as exc:
            self.report.criu_dump_stats = {"unreadable": str(exc)}
        if shared:
            started = time.perf_counter()
            self.report.shared_files = [f.to_json() for f in save_shared_files(shared, self.images)]
            self.report.timings_s["shared_files"] = time.perf_counter() - started

    # -- the one rollback ----------------------------------------------------------------------------------------
    def _roll_back(self, exc: BaseException) -> None:
        """Undo what was done, so that the workload keeps running on every rank."""
        self.ranks.abort(f"rank {self.ranks.rank} capture: {type(exc).__name__}: {exc}")  # peers first, then undo
        if self.stopped:
            stop_again(self.tree)
        if self.driver is not None:  # a stopped tree runs only once its CUDA state is back (`_held_tree`)
            undo_cuda(self.driver, self.done, held(self.driver) if self.stopped else None)
        if self.stopped or self.dumped:
            signal_tree(self.tree, signal.SIGCONT)
        if self.memory is not None:
            self.memory.roll_back()
        if self.quiesced and self.engine:  # every rank rolls back: recreate the communicators the capture destroyed
            with contextlib.suppress(WorkerError):
                resume_engine(self.engine, self.ranks, self.plan.effective if self.plan else "recreate-from-plan",
                              "rollback", self.work)
        remove_contents(self.images)  # no half-written images: nothing there restores
        if (self.work / "dump.log").exists():  # keep the evidence of a failed dump
            shutil.copy2(self.work / "dump.log", self.images / "dump.log")

    # -- after the last phase --------------------------------------------------------------------------------
    def finish(self, *, digest: bool) -> CaptureReport:
        report = self.report
        started = time.perf_counter()
        if self.memory is not None:  # every rank dumped: offered now, answered while the rest below runs
            self.memory.warm()
        report.identity = identity(None, criu=self.criu)
        report.engine_quiesced = self.quiesced
        report.barrier_wait_s = dict(self.ranks.waits)
        report.image_bytes, report.image_files = images_size(self.images)
        if digest:
            report.image_digest = image_digest(self.images, contents=True)
        if self.memory is not None:
            self.memory.warmed(report)
        report.completed_unix = time.time()
        report.timings_s["finish"] = time.perf_counter() - started  # before capture.json: it is in it
        (self.images / "capture.json").write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
        # The images are complete (and, with several ranks, every rank's): the captured tree ends here.
        self.journal.note(commit=self.tree)
        signal_tree(self.tree, signal.SIGKILL)
        return report


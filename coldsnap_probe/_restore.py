"""Restore as phases (admission spec 7.4): each phase records what it started, and one rollback stops it all.

read the capture's record while the host's identity is read, check the host (decision 17: before any CRIU or CUDA
call) -> [one rank whose tree CRIU leaves paused: CRIU starts] -> read and check every other record (graph, each
memory source's: the weight sources, the device dumps) -> [validated] -> stage every memory source, in registry
order (a node hydrator's stages, read-ahead) -> [otherwise: CRIU starts] -> CRIU restores, paused (cuInit
meanwhile) -> [criu-restored] -> the phases after CRIU (`_restore_after_criu`): CUDA restore and unlock per
process, reverse inventory order, only its restore thread running -> [cuda-restored] -> every page in (lazy pages)
-> resume the tree -> [process-resumed] -> hydrate every memory source, in reverse registry order (the CUDA
interposer's device memory, then the engine's weights) -> recreate the communicators -> [ready]. Brackets are
barriers.

This module imports only what the phases up to CRIU's start need: the graph's and memory sources' modules (one
rank), the later phases' module and what it needs are imported while CRIU runs (`_import_later_phases`, issue 35
item 2), and so is the typed report (`_reports`: ten
frozen dataclasses, ~12 ms of a restore's imports on the H200): the instants and facts known before CRIU are kept
here and put into the report once CRIU runs (`_open_report`).

The rollback, whatever phase failed: kill the restored tree (nothing half-restored serves), abort the
activation for every rank, discard what the memory sources staged (registry order), stop the lazy-pages daemon.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._coordinator import Coordinator
from ._host import IdentityReading
from ._phase import PhaseLog
from ._process import CriuRun, criu_environment, process_tree, stop, tail
from ._shm_files import SharedFile, load_shared_files, put_back
from ._target import check_target, comparable, gpu_pairs
from ._worker_guard import WorkerGuard
from .errors import TargetRefused, WorkerError

if TYPE_CHECKING:
    from ._criu_kdat import KernelProbe
    from ._cuda import Driver
    from ._reports import RestoredGraphPolicy, RestoreReport, Timeline
    from .memory import MemoryRestores

__all__ = ("restore",)

LAZY_PAGES_START_S = 10.0  # for `criu lazy-pages` to listen


def restore(images: Path, *, criu: str, work: Path | None = None, coordinator: Coordinator | None = None,
            lazy_pages: bool = False, device_policy: str = "same-model", device_digests: bool = False,
            phases: PhaseLog | None = None, guard: WorkerGuard | None = None,
            startup: dict[str, int] | None = None, identity: IdentityReading | None = None,
            kernel: KernelProbe | None = None) -> RestoreReport:
    """Restore the tree captured in `images`; returns the report (the images are only read).

    `lazy_pages`: CRIU restores the processes without their memory, which `criu lazy-pages` then fills
    (faults first, the rest in the background) while the CUDA state is restored. The tree is then held
    stopped until every page is in, so nothing serves from memory a failed daemon never filled. `device_policy` and
    `device_digests`: how the interposer's device dumps hydrate (`MemoryOptions`); `phases` publishes each phase as
    it begins; `guard` (started) kills the restored tree if this process dies before the restore ends. `startup`:
    what the worker's command did before this call (mark name -> unix ns), reported as `worker_start`. `identity`:
    this host's identity, already being read (the worker starts reading it before its imports); None: read here,
    while the capture's record is. `kernel`: CRIU's
    kernel-feature probe, already running (the worker starts it before its imports; this call ends it and removes
    its cache); None: the restore's CRIU probes the kernel itself.
    """
    run = _Restore(images, criu=criu, work=work, ranks=coordinator or Coordinator.single(), lazy_pages=lazy_pages,
                   phases=phases or PhaseLog("restore", publish=False))
    run.startup = startup or {}
    run.device_policy, run.device_digests = device_policy, device_digests
    run.journal = guard or WorkerGuard()
    run.identity = identity
    run.kernel = kernel
    try:
        run.phases()
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        run.roll_back(error)
        if isinstance(exc, WorkerError):
            raise
        raise WorkerError(error) from exc
    finally:
        if kernel is not None:
            kernel.close()
        if work is None and run.work is not None:  # its own scratch (the logs' tails are in the error already)
            shutil.rmtree(run.work, ignore_errors=True)
        run.journal.end()
    run.report.barrier_wait_s = dict(run.ranks.waits)
    return run.report


class _Restore:
    """One restore's state: what each phase started, so that `roll_back` stops exactly that."""

    def __init__(self, images: Path, *, criu: str, work: Path | None, ranks: Coordinator, lazy_pages: bool,
                 phases: PhaseLog) -> None:
        self.images, self.criu, self.work, self.ranks, self.lazy_pages = images, criu, work, ranks, lazy_pages
        self.phase = phases
        self.journal = WorkerGuard()  # CRIU's restore and the restored root are noted: a guard kills the tree
        phases.enter("validate")
        self.began = time.time_ns()
        # Until CRIU runs: the marks taken (name, unix ns) and the facts found, for the report made then.
        # Invariant: `report` and `timeline` exist from `_open_report` on, and only the phases after it use them.
        self.marks: list[tuple[str, int]] = [("restore_begin", self.began)]
        self.startup: dict[str, int] = {}  # the worker command's marks before this restore (`worker_start`)
        self.captured_root = 0  # the captured tree's root pid, as the record says
        self.compatibility: str | None = None
        self.identity_source: str | None = None
        self.report: RestoreReport
        self.timeline: Timeline
        self.captured: dict[str, Any] = {}
        self.graph: RestoredGraphPolicy | None = None  # the graph policy record, when the capture wrote one
        self.device_policy, self.device_digests = "same-model", False  # the worker's options for the dumps
        self.memory: MemoryRestores | None = None  # the memory sources whose records the images hold
        self.engine: str | None = None  # the engine's control socket, when its communicators were quiesced
        self.shared: list[SharedFile] = []  # the tree's /dev/shm files, put back just before CRIU
        self.cuda: list[int] = []
        self.identity: IdentityReading | None = None
        self.kernel: KernelProbe | None = None
        self.driver: Driver | None = None
        self.gpu_pairs: list[tuple[bytes, bytes]] = []  # (captured, this) GPU UUIDs: restored onto another GPU
        # What was started, for the rollback.
        self.root: int | None = None
        self.pidfile = Path()  # CRIU's, in the work directory
        self.paused = True  # CRIU leaves the restored tree stopped (`_read_capture` says)
        self.lazy: subprocess.Popen[bytes] | None = None

    def phases(self) -> None:
        # The host's identity (procfs, or NVML where procfs cannot tell) and `criu --version` take milliseconds to
        # tens of them: they are read while the capture's record is (the worker's command began it before its imports).
        current = self.identity or IdentityReading(self.criu)
        try:
            self._read_capture()
        except BaseException:
            with contextlib.suppress(Exception):  # the record's failure is the one to report; no thread left behind
                current.result()
            raise
        self._check_host(current.result())  # decision 17: nothing is started on a host that cannot restore these
        # One rank whose tree CRIU leaves paused: CRIU first, the graph's and memory sources' records read and checked
        # while it runs (their modules' imports were a third of the worker's path to CRIU, issue 35 item 2); a record
        # that fails stops the restore before anything is resumed, as it did before CRIU: the rollback kills the
        # paused tree. Several ranks: every rank's records agree before any rank restores anything.
        early = self.paused and not self.ranks.multi
        if not early:
            self._read_records()
            self.phase.enter("criu-restore")
        try:
            criu = self._start_criu()
        except BaseException:  # starting CRIU (the /dev/shm files, lazy pages) is its phase, never the records'
            if early:
                self.phase.enter("criu-restore")
            raise
        root = self._end_criu(criu, records=early)
        # The phases after CRIU live in `_restore_after_criu`, imported while CRIU ran (`_import_later_phases`): the
        # path to CRIU imports only what its checks need (issue 35 item 2). Here it is a lookup.
        from ._restore_after_criu import after_criu

        after_criu(self, root)

    # -- the phases, in order ----------------------------------------------------------------------------------
    def _read_capture(self) -> None:
        """The capture's own record and the tree's /dev/shm files: what CRIU's start needs, checked before it."""
        captured = self.captured = json.loads((self.images / "capture.json").read_text())
        ranks = self.ranks
        if (captured.get("rank", 0), captured.get("world_size", 1)) != (ranks.rank, ranks.world_size):
            raise WorkerError(f"these images are rank {captured.get('rank', 0)} of {captured.get('world_size', 1)}, "
                              f"not rank {ranks.rank} of {ranks.world_size}")
        self.shared = load_shared_files(self.images)
        self.cuda = list(captured.get("cuda_pids", []))
        self.engine = captured.get("engine") if captured.get("engine_quiesced") else None
        self.captured_root = int(captured["root_pid"])
        # Every rank is restored paused and released together; a lazy tree is released once its pages are in.
        self.paused = bool(self.cuda) or ranks.multi or self.lazy_pages

    def _read_records(self) -> None:
        """Every other record checked (graph, each memory source's), every rank agreeing, then the memory sources
        staged: everything that can be known before the tree is resumed (a restore that cannot succeed never
        resumes one). Imported here: the sources' and the graph's modules, off the path to CRIU's start."""
        from ._graph import validated_graph_record
        from .memory import MemoryOptions, MemoryRestores, RestoreScope

        self.graph = validated_graph_record(self.images)
        options = MemoryOptions(device_policy=self.device_policy, device_digests=self.device_digests)
        self.memory = MemoryRestores(RestoreScope(self.images, self.ranks, options))
        if self.ranks.multi and self.captured["boundary"] == "n610" and (self.graph is None or self.engine is None):
            raise WorkerError("these multi-rank images lack the graph record or the engine's quiesce: their "
                              "communicators could not be recreated")
        if self.graph is not None and self.graph.effective == "preserve-nccl-exec":
            raise WorkerError("the record retains NCCL graph executables in place, which needs the engine's "
                              "admitted in-place NCCL provider; this engine recreates its communicators")
        self._agree()
        self._mark("validated")  # what the checks cost (identity, records, sources)
        # Only now: a restore refused by the checks (on any rank) leaves nothing staged on the node hydrator.
        self.phase.enter("stage")
        self._start_stages()

    def _start_stages(self) -> None:
        """What each memory source starts before CRIU (a node hydrator's stages, read-ahead); the rollback
        discards it."""
        if self.memory is not None:
            self.memory.stage()

    def _check_host(self, current: dict[str, Any]) -> None:
        """This host against the captured one, every fact (`_target`): nothing is started on a host that cannot
        restore the capture."""
        captured, boundary = self.captured.get("identity", {}), self.captured["boundary"]
        captured, current = comparable(captured, current, boundary)
        try:
            self.compatibility = check_target(captured, current, boundary,
                                              device_policy=self.device_policy)
        except TargetRefused as exc:
            self._mark("refused")
            exc.seconds = (self.marks[-1][1] - self.began) / 1e9
            raise
        self.identity_source = current["gpu_identity_source"]
        self.gpu_pairs = gpu_pairs(captured, current)

    def _agree(self) -> None:
        """Nothing is restored on any rank until every rank's images, record and identity are good."""
        peers = self.ranks.barrier("validated", {"plan_sha256": self.graph.plan_sha256
                                                 if self.graph else None})
        if len({str(p.get("plan_sha256")) for p in peers}) != 1:
            raise WorkerError(f"the ranks' graph records disagree: {[p.get('plan_sha256') for p in peers]}")

    def _start_criu(self) -> CriuRun:
        """CRIU starts restoring the tree (paused when anything follows)."""
        if not (self.images / "pstree.img").is_file():  # CRIU's process tree: the patched CRIU crashes without it
            raise WorkerError(f"these images lack pstree.img (CRIU's process tree): {self.images} is no whole capture")
        work = self.work = self.work or self.journal.scratch("coldsnap-restore-")
        work.mkdir(parents=True, exist_ok=True)
        pidfile = self.pidfile = work / "restored.pid"
        pidfile.unlink(missing_ok=True)  # CRIU refuses to overwrite one left by an earlier restore
        cached = self.kernel.environment() if self.kernel else {}  # ended long before, unless the CPU is starved
        if self.lazy_pages:
            self.lazy = _start_lazy_pages(self.criu, self.images, work, self.journal, cached)
        args = ["restore", "--images-dir", str(self.images), "--work-dir", str(work), "--restore-detached",
                "--pidfile", str(pidfile), *(["--leave-stopped"] if self.paused else []),
                *(["--lazy-pages"] if self.lazy else [])]
        put_back(self.shared, self.images, self.journal.note)  # what CRIU maps is what the tree had when dumped
        self.journal.note(restore=str(self.images), pidfile=str(pidfile))
        self._mark("criu_restore_begin")
        return CriuRun(self.criu, args, work / "restore.log", lifeline=self.journal.lifeline(), env=cached)

    def _end_criu(self, criu: CriuRun, *, records: bool) -> int:
        """While CRIU runs: the CUDA driver initialised, the records checked and the sources staged (`records`: one
        rank's), the report made, the later phases imported; then CRIU's end, the restored tree's root."""
        # CRIU first, then the CUDA driver while it runs: cuda-python's import, libcuda's load and cuInit took tens
        # of milliseconds before CRIU started, and cuInit alone a good part of the CUDA restore.
        failed: BaseException | None = None
        try:
            if records:
                self._read_records()
                self.phase.enter("criu-restore")
            starting = _CudaStart() if self.cuda else None
            self._open_report()
            _import_later_phases()  # while cuInit runs, which releases the interpreter
            self.driver = starting.result() if starting else None
            if starting:  # after CRIU's end, the driver was what the CUDA restore waited for (issue 35 item 2)
                self.timeline.mark("cuda_driver_ready")
        except BaseException as exc:  # CRIU is running: its tree is found (and killed by the rollback) first
            failed = exc
        try:
            seconds = criu.wait()
        except WorkerError as exc:
            if failed is not None and self.phase.current != "criu-restore":  # a record or stage failed meanwhile: the
                raise failed from exc  # restore's reason, as when the records were checked before CRIU (review 14)
            raise exc from failed
        if failed is None:
            self.report.criu_restore_seconds = seconds
            self.timeline.mark("criu_restore_end")
        root = self.root = int(self.pidfile.read_text().split()[0])  # first: the rollback kills the tree then
        self.journal.note(root=root)
        if failed is not None:
            raise failed
        self.report.restored_pid = root
        if not set(self.cuda) <= set(process_tree(root)):
            raise WorkerError(f"the recorded CUDA processes {self.cuda} are not in the restored tree of {root}")
        peers = self.ranks.barrier("criu-restored", {"pid": root, "criu_seconds": seconds})
        self.report.peer_criu_restore_seconds = [p.get("criu_seconds") for p in peers]
        if self.ranks.multi:
            self.timeline.mark("rank_barrier_end")
        return root

    # -- before CRIU runs, and once it does --------------------------------------------------------------------
    def _mark(self, name: str) -> None:
        """An instant before CRIU runs (a `timeline` mark once the report is made)."""
        self.marks.append((name, time.time_ns()))

    def _open_report(self) -> None:
        """The typed report, made while CRIU runs, from the marks and facts kept until then."""
        from ._reports import Mark, RestoreReport

        report = self.report = RestoreReport(rank=self.ranks.rank, world_size=self.ranks.world_size)
        report.timeline.marks = [Mark(name, ns, (ns - self.began) / 1e9) for name, ns in self.marks]
        report.worker_start = [Mark(name, ns, (ns - self.began) / 1e9) for name, ns in self.startup.items()] or None
        report.boundary, report.captured_root_pid = self.captured["boundary"], self.captured_root
        report.cuda_pids = self.cuda
        report.graph_policy = self.graph
        report.identity_compatibility, report.identity_source = self.compatibility, self.identity_source
        report.shared_files = [f.path for f in self.shared] or None
        self.timeline = report.timeline

    # -- the one rollback ----------------------------------------------------------------------------------------
    def roll_back(self, error: str) -> None:
        """A failure on any rank stops every rank: nothing half-restored serves."""
        if self.root is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.root, signal.SIGKILL)
        self.ranks.abort(f"rank {self.ranks.rank} restore: {error}")
        if self.memory is not None:
            self.memory.discard()
        if self.lazy:
            stop(self.lazy)


def _start_lazy_pages(criu: str, images: Path, work: Path, journal: WorkerGuard,
                      cached: dict[str, str]) -> subprocess.Popen[bytes]:
    """`criu lazy-pages` for the restore that follows: it serves the restored process's page faults from the
    images (userfaultfd) and copies every other page in the background, then exits 0. Its socket, then its pid,
    are journalled: the guard of a worker that dies ends it. `cached`: the kernel probe's cache, as the restore's."""
    listening = work / "lazy-pages.socket"
    listening.unlink(missing_ok=True)
    log = work / "lazy-pages.log"
    journal.note(lazy_socket=str(listening))
    daemon = subprocess.Popen([criu, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work),
                               "--log-file", str(log), "-v4"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**criu_environment(criu), **cached})
    journal.note(lazy_pages=daemon.pid)
    give_up = time.monotonic() + LAZY_PAGES_START_S
    while not listening.exists():
        if daemon.poll() is not None:
            raise WorkerError(f"criu lazy-pages did not start (exit {daemon.returncode}): {tail(log)}")
        if time.monotonic() > give_up:
            stop(daemon)
            raise WorkerError(f"criu lazy-pages did not listen within {LAZY_PAGES_START_S:.0f} s: {tail(log)}")
        time.sleep(0.001)
    return daemon


class _CudaStart:
    """The CUDA driver being initialised while CRIU runs: cuda-python's bindings imported and libcuda loaded here
    (the largest import of a restore worker, never before CRIU starts), then `cuInit` in a thread of its own (the
    binding releases the interpreter during the call), so that the worker imports what its later phases need
    meanwhile."""

    def __init__(self) -> None:
        from ._cuda import Driver

        self.driver = Driver()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._init, name="coldsnap-cuinit", daemon=True)
        self._thread.start()

    def _init(self) -> None:
        try:
            self.driver.call("cuInit", 0)
        except BaseException as exc:  # raised again in the worker's thread, by `result`
            self._failed = exc

    def result(self) -> Driver:
        """The driver, initialised; raises what `cuInit` raised."""
        self._thread.join()
        if self._failed is not None:
            raise self._failed
        return self.driver


# Imported only by the phases after CRIU, while CRIU runs: their module (the held tree, the engine's control socket,
# the memory sources' hydration) and the sources' hydration pools (with them `logging`), off the path to CRIU and off
# the hydration after it (issue 35 item 2).
LATER_PHASES_MODULES = (f"{__package__}._restore_after_criu", "concurrent.futures")


def _import_later_phases() -> None:
    for name in LATER_PHASES_MODULES:
        importlib.import_module(name)

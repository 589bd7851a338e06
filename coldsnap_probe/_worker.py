"""The capture and restore worker (admission spec 7.2-7.4, single rank): CUDA checkpoint + CRIU.

Capture (n610, initialized CUDA state): find the CUDA processes of the tree, require `running`,
lock all, checkpoint all (state checked after every step), CRIU dump; on any failure the
processes are restored and unlocked in reverse order so the workload keeps running.

Capture (n580, pre-CUDA template): audit that no process of the tree maps the CUDA driver or
holds an NVIDIA device file, then a CPU-only CRIU dump; the restored process initializes CUDA
fresh.

Restore: CRIU restore leaving the tree stopped, then (n610) per CUDA process in reverse
inventory order: require `checkpointed`, restore, require `locked`, unlock, require
`running`; finally SIGCONT. On failure the restored tree is killed. With lazy pages, CRIU restores
the tree without its memory and `criu lazy-pages` fills it (userfaultfd) while the CUDA state comes
back; the tree is then held stopped until every page is in, and a daemon that fails kills it.
Timeline marks are taken by this (fresh) process, never by the restored one. The image directory is
only read.

Weight hydration (`_hydrate.py`): with `hydration=<engine control socket>` the capture first asks
the engine to release its weight regions (the engine's fail-before-release gate; the manifest goes
into the images as `hydration.json`) and, if anything fails afterwards, to hydrate them back so the
workload keeps serving. A restore whose images hold `hydration.json` checks the weight sources
before CRIU runs, and after the CUDA unlock asks the engine to re-map, hydrate and verify; the
report's `hydration` gives bytes, seconds, GB/s and regions verified. When the engine hydrates through
a long-lived hydrator, the worker has it stage the weights on the engine's GPU while CRIU and CUDA
restore the process (`Stager`), so that the engine's hydration only maps and verifies them. A failed
hydration kills the restored tree: nothing half-hydrated serves.

Several ranks (tensor parallelism, spec 7.1-7.3): one worker per rank, meeting the others through a
`Coordinator` at every step, so that all ranks reach the capture point together and a failure on one
rank aborts all. A rank's communicators are handled by the graph policy (`plan_graph_policy`, default
per driver): under `recreate-from-plan` the engine is asked (its control socket, `engine=`) to destroy
its collective graphs and communicators before the CUDA lock, and the capture refuses a rank whose engine
still reports a live communicator (restoring one fails with CUDA_ERROR_NOT_SUPPORTED and loses the rank);
after restore the engine recreates them on a fresh store and re-captures its graphs. The graph record is
written into the images at capture and validated (digest recomputed) on every rank before anything is
restored. Every rank is restored paused; CUDA state is restored only once every rank's CRIU restore
exists; the ranks are then released together. A multi-rank dump leaves the tree stopped until every rank
has dumped, so a failed peer rolls every rank back to serving.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ._coordinator import Coordinator
from ._cuda import Driver
from ._graph import GraphPlan, default_graph_policy, graph_record, plan_graph_policy, validate_graph_record
from ._hydrate import HydrationManifest, Stager, check_sources
from ._hydrate import request as hydration_request
from ._profile import identity
from ._quiesce import IDLE_WAIT_S, refuse_io_uring, wait_idle
from ._quiesce import endpoint as _endpoint
from ._quiesce import readlink as _readlink
from .errors import ContractError, ProbeError, RankAborted, WorkerError

__all__ = ("anonymous_memory", "capture", "identity_compatibility", "image_digest", "restore", "tp_execution")

CAPTURE_KIND = "coldsnap-cuda-criu-capture"
RESTORE_KIND = "coldsnap-cuda-criu-restore"
LAZY_PAGES_START_S = 10.0  # for `criu lazy-pages` to listen
LAZY_PAGES_FINISH_S = 120.0  # for it to have copied every page after the restore
ABORT_POLL = 0.05  # seconds between looks at the activation's abort while the engine works
_NVIDIA_MAPS = ("libcuda.so", "libnvidia-ml.so", "/dev/nvidia")


class Timeline:
    """Marks measured by this process: unix_ns and seconds since the first mark."""

    def __init__(self) -> None:
        self.marks: list[dict[str, Any]] = []
        self._origin: int | None = None

    def mark(self, name: str) -> None:
        now = time.time_ns()
        if self._origin is None:
            self._origin = now
        self.marks.append({"name": name, "unix_ns": now, "since_restore_begin_s": (now - self._origin) / 1e9})

    def seconds(self, start: str, end: str) -> float:
        by_name: dict[str, int] = {m["name"]: m["unix_ns"] for m in self.marks}
        return float(by_name[end] - by_name[start]) / 1e9


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            kids.extend(int(c) for c in text.split())
    except OSError:
        pass
    return kids


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, parents before children (the inventory order)."""
    order, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        if pid not in order:
            order.append(pid)
            queue.extend(sorted(_children(pid)))
    return order


def _cuda_processes(driver: Driver, tree: list[int]) -> list[int]:
    """The processes of the tree the driver knows as CUDA processes (GetState answers for them)."""
    cuda = []
    for pid in tree:
        try:
            driver.state(pid)
        except Exception:
            continue
        cuda.append(pid)
    return cuda


def _require(driver: Driver, pids: list[int], expected: str, step: str) -> None:
    for pid in pids:
        state = driver.state(pid)
        if state != expected:
            raise WorkerError(f"{step}: process {pid} is {state}, expected {expected}")


def _audit_pre_cuda(tree: list[int]) -> None:
    """n580 boundary: no process may map the CUDA driver or hold an NVIDIA device file."""
    for pid in tree:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [target for fd in os.listdir(f"/proc/{pid}/fd") if (target := _readlink(f"/proc/{pid}/fd/{fd}"))]
        except OSError as exc:
            raise WorkerError(f"audit: cannot read process {pid}: {exc}") from exc
        hits = sorted({m for m in _NVIDIA_MAPS if m in maps} | {f for f in fds if f.startswith("/dev/nvidia")})
        if hits:
            raise WorkerError(f"audit: process {pid} is not a pre-CUDA template: it holds {', '.join(hits)}")


def _criu(criu: str, args: list[str], log: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([criu, *args, "--log-file", str(log), "-v4"], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise WorkerError(f"criu {args[0]} exited {done.returncode}: {(done.stderr or '').strip()}\n{_tail(log)}")
    return time.perf_counter() - started


def image_digest(images: Path, *, contents: bool = False) -> str:
    """Every file's name, size, mtime and ctime (any write changes them), optionally its bytes."""
    h = hashlib.sha256()
    for path in sorted(p for p in images.rglob("*") if p.is_file()):
        st = path.stat()
        h.update(f"{path.relative_to(images)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0".encode())
        if contents:
            with path.open("rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return "sha256:" + h.hexdigest()


def anonymous_memory(pid: int, top: int = 6) -> dict[str, Any]:
    """The process's resident anonymous bytes and its largest anonymous mappings (what CRIU will dump)."""
    sizes: list[tuple[int, str]] = []
    name, total = "", 0
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split()
            if head and "-" in head[0] and not line.endswith(" kB"):
                name = " ".join(head[5:]) or "[anon]"
            elif line.startswith("Anonymous:"):
                kib = int(head[1])
                total += kib
                if kib:
                    sizes.append((kib << 10, name))
    except OSError:
        return {}
    return {"anonymous_bytes": total << 10, "largest": sorted(sizes, reverse=True)[:top]}


def _images_size(images: Path) -> tuple[int, int]:
    files = [p for p in images.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def _engine(control: str, message: dict[str, Any], what: str, *, timeout: float = 300.0,
            ranks: Coordinator | None = None) -> dict[str, Any]:
    """One request to the engine's control socket; a refusal is a WorkerError naming `what`.

    With `ranks` (a restore of several ranks), a peer's abort ends the wait: the engine may be blocked on that
    peer (a communicator's rendezvous), and this rank's restored tree is killed anyway."""
    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            outcome["answer"] = hydration_request(control, message, timeout=timeout)
        except ProbeError as exc:
            outcome["error"] = exc

    if ranks is None or not ranks.multi:
        ask()
    else:
        asking = threading.Thread(target=ask, name="coldsnap-engine-request", daemon=True)
        asking.start()
        while asking.is_alive():
            asking.join(ABORT_POLL)
            if asking.is_alive() and (reason := ranks.aborted()):
                raise RankAborted(f"{what}: the activation was aborted while the engine worked: {reason}")
    if "error" in outcome:
        raise WorkerError(f"{what}: {outcome['error']}") from outcome["error"]
    answer: dict[str, Any] = outcome["answer"]
    if not answer.get("ok"):
        raise WorkerError(f"{what}: {answer.get('error')}")
    return answer


def _release_weights(control: str, report: dict[str, Any]) -> HydrationManifest:
    started = time.perf_counter()
    answer = _engine(control, {"op": "release", "generation": f"capture-{time.time_ns()}"},
                     "the engine did not release its weights (nothing was released)")
    try:
        manifest = HydrationManifest.from_json(answer.get("manifest"))
    except ProbeError as exc:
        _hydrate_back(control)
        raise WorkerError(f"the engine's hydration manifest is invalid: {exc}") from exc
    report["hydration"] = {"released_bytes": sum(r.size for r in manifest.regions), "regions": len(manifest.regions),
                           "release_seconds": time.perf_counter() - started,
                           "plan_digest": manifest.plan.plan_digest, "manifest_digest": manifest.manifest_digest}
    return manifest


def _hydrate_back(control: str) -> None:
    """Rollback after a failed capture: the engine maps and hydrates its weights again and keeps serving."""
    try:
        hydration_request(control, {"op": "hydrate"})
    except ProbeError:
        pass


def tp_execution(world_size: int, engine: str) -> dict[str, Any]:
    """The execution graph of one tensor-parallel service (spec 5.5's `execution`), one worker per rank."""
    workers = [f"rank-{r}" for r in range(world_size)]
    return {"workers": [{"id": w, "unit": f"unit-{r}", "service": "engine", "process_slot": 0, "device_slots": [r]}
                        for r, w in enumerate(workers)],
            "groups": [{"id": "tp", "kind": "tensor-parallel", "service": "engine", "members": workers}],
            "services": [{"id": "engine", "role": "serving", "workers": workers}],
            "adapter": {"schema": "coldsnap-engine-control-v1", "digest": "", "payload": {"engine": engine,
                                                                                          "tensor": world_size}}}


def _graph_plan(requested: str, world_size: int) -> GraphPlan:
    if requested == "auto":
        requested = default_graph_policy(str(identity(None).get("driver_version", "")))
    # Retaining NCCL graph executables needs an admitted in-place provider driven inside the engine, and a
    # restore path for it; this worker has neither, so such a request is recorded as the valid downgrade.
    mode = os.environ.get("COLDSNAP_NCCL_IN_PLACE_MODE", "").strip()
    reason = ("COLDSNAP_NCCL_IN_PLACE_MODE is not net-reconnect-v1" if mode != "net-reconnect-v1"
              else "this worker has no in-place NCCL restore path")
    try:
        return plan_graph_policy(requested, world_size, in_place_admitted=False, in_place_reason=reason)
    except ContractError as exc:
        raise WorkerError(str(exc)) from exc


def _inet_sockets(tree: list[int]) -> list[str]:
    """The tree's TCP/UDP sockets as `pid fd proto local -> remote`: none may be left once communicators are gone."""
    found = []
    for pid in tree:
        try:
            links = {fd: _readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            inodes = {link[8:-1]: fd for fd, link in links.items() if link.startswith("socket:[")}
            for proto in ("tcp", "tcp6", "udp", "udp6"):
                for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if len(fields) > 9 and fields[9] in inodes:
                        found.append(f"process {pid} fd {inodes[fields[9]]} {proto} {_endpoint(fields[1])} -> "
                                     f"{_endpoint(fields[2])}")
        except OSError:
            continue
    return found


def _check_quiesced(answer: dict[str, Any], plan: GraphPlan, tree: list[int]) -> None:
    """After the engine's quiesce: refuse a rank that still holds a communicator or a network socket."""
    live = answer.get("communicators")
    if plan.effective != "preserve-nccl-exec" and live != 0:
        raise WorkerError(f"the engine still holds {live!r} live NCCL communicator(s) after quiesce: restoring such "
                          "a rank fails (CUDA_ERROR_NOT_SUPPORTED) and loses it, so it is not checkpointed")
    if sockets := _inet_sockets(tree):  # e.g. NCCL's RAS service outlives every communicator (NCCL_RAS_ENABLE=0)
        raise WorkerError("after quiesce the rank still holds network sockets a checkpoint cannot carry: "
                          + "; ".join(sockets[:8]))


def _resume_engine(control: str, coordinator: Coordinator, plan: str, label: str, scratch: Path) -> dict[str, Any]:
    """Recreate the communicators on a store of this activation and re-capture the graphs (every rank at once)."""
    store = str((coordinator.directory or scratch) / f"{label}.store")  # every rank's, or this worker's own
    return _engine(control, {"op": "resume", "policy": plan, "store": store, "rank": coordinator.rank,
                             "world_size": coordinator.world_size}, f"engine {label}",
                   ranks=coordinator if label == "restore" else None)


def _signal_tree(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def capture(pid: int, images: Path, *, criu: str, boundary: str = "n610", lock_timeout_ms: int = 30_000,
            digest: bool = False, hydration: str | None = None, coordinator: Coordinator | None = None,
            engine: str | None = None, graph_policy: str = "auto") -> dict[str, Any]:
    """Checkpoint and dump the tree rooted at `pid` into `images` (must be new or empty)."""
    if boundary not in ("n580", "n610"):
        raise WorkerError(f"boundary must be n580 or n610, got {boundary!r}")
    if images.exists() and any(images.iterdir()):
        raise WorkerError(f"images directory {images} is not empty")
    ranks = coordinator or Coordinator.single()
    images.mkdir(mode=0o700, parents=True, exist_ok=True)
    tree = process_tree(pid)
    timings: dict[str, float] = {}
    report: dict[str, Any] = {"format": 1, "kind": CAPTURE_KIND, "boundary": boundary, "root_pid": pid,
                              "tree": tree, "started_unix": time.time(), "rank": ranks.rank,
                              "world_size": ranks.world_size, "engine": engine}
    work = Path(tempfile.mkdtemp(prefix="coldsnap-capture-"))
    # Several ranks: the dumped tree stays stopped until every rank has dumped, so a failed peer can roll back.
    dump_args = ["dump", "--tree", str(pid), "--images-dir", str(images), "--work-dir", str(work),
                 *(["--leave-stopped"] if ranks.multi else [])]
    if ranks.multi and boundary == "n610" and not engine:
        raise WorkerError("several ranks need the engine's control socket (engine=) to release their "
                          "communicators before capture")
    plan = _graph_plan(graph_policy, ranks.world_size) if engine and boundary == "n610" else None
    quiesced = dumped = False
    try:
        if boundary == "n580":
            _audit_pre_cuda(tree)
            report["cuda_pids"] = []
            ranks.barrier("capture-ready", {"pid": pid})
            timings["criu_dump"] = _criu(criu, dump_args, work / "dump.log")
            dumped = True
            ranks.barrier("dumped")
        else:
            driver = Driver()
            driver.call("cuInit", 0)
            cuda = _cuda_processes(driver, tree)
            if not cuda:
                raise WorkerError(f"no CUDA process in the tree of {pid} (n610 needs initialized CUDA state)")
            report["cuda_pids"] = cuda
            _require(driver, cuda, "running", "before lock")
            peers = ranks.barrier("capture-ready", {"pid": pid, "policy": plan.recorded if plan else None})
            if len({str(p.get("policy")) for p in peers}) != 1:
                raise WorkerError(f"the ranks disagree on the graph policy: {[p.get('policy') for p in peers]}")
            if plan is not None:
                report["graph_policy"] = {"requested": plan.requested, "recorded": plan.recorded,
                                          "effective": plan.effective, "reason": plan.reason}
                started = time.perf_counter()
                quiesced = True  # from here a failure recreates the communicators (rollback below)
                report["engine_quiesce"] = _engine(str(engine), {"op": "quiesce", "policy": plan.effective},
                                                   "the engine did not quiesce before capture", timeout=60)
                _check_quiesced(report["engine_quiesce"], plan, tree)
                timings["engine_quiesce"] = time.perf_counter() - started
            ranks.barrier("quiesced")
            if plan is None:  # a server we do not control: its own requests must end first
                started = time.perf_counter()
                refuse_io_uring(tree)
                wait_idle(tree, IDLE_WAIT_S)
                timings["wait_idle"] = time.perf_counter() - started
            manifest = _release_weights(hydration, report) if hydration else None
            report["memory_before_checkpoint"] = {str(p): anonymous_memory(p) for p in tree}
            done: list[tuple[int, str]] = []  # (pid, what was done) for the rollback
            try:
                started = time.perf_counter()
                for p in cuda:
                    args = driver.cuda.CUcheckpointLockArgs()
                    args.timeoutMs = lock_timeout_ms
                    driver.call("cuCheckpointProcessLock", p, args)
                    done.append((p, "locked"))
                _require(driver, cuda, "locked", "after lock")
                timings["cuda_lock"] = time.perf_counter() - started
                started = time.perf_counter()
                for p in cuda:
                    driver.call("cuCheckpointProcessCheckpoint", p, None)
                    done.append((p, "checkpointed"))
                _require(driver, cuda, "checkpointed", "after checkpoint")
                timings["cuda_checkpoint"] = time.perf_counter() - started
                ranks.barrier("checkpointed")
                report["memory_after_checkpoint"] = {str(p): anonymous_memory(p) for p in tree}
                timings["criu_dump"] = _criu(criu, dump_args, work / "dump.log")
                dumped = True
                if manifest is not None:
                    (images / "hydration.json").write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
                if plan is not None:
                    _write_graph_record(images, plan, ranks.world_size)
                ranks.barrier("dumped")
            except BaseException as exc:
                ranks.abort(f"rank {ranks.rank} capture: {type(exc).__name__}: {exc}")  # peers first, then undo
                if dumped and ranks.multi:
                    _signal_tree(tree, signal.SIGCONT)  # the CUDA restore thread of a stopped tree must run
                _rollback(driver, done)
                if hydration:
                    _hydrate_back(hydration)
                raise
    except BaseException as exc:
        ranks.abort(f"rank {ranks.rank} capture: {type(exc).__name__}: {exc}")
        if boundary == "n580" and dumped and ranks.multi:
            _signal_tree(tree, signal.SIGCONT)
        if quiesced and engine:  # every rank rolls back: recreate the communicators the capture destroyed
            with contextlib.suppress(WorkerError):
                _resume_engine(engine, ranks, plan.effective if plan else "recreate-from-plan", "rollback",
                               work)
        if (work / "dump.log").exists():  # keep the evidence of a failed dump
            shutil.copy2(work / "dump.log", images / "dump.log")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if ranks.multi:  # every rank has dumped: the captured tree ends here, as a single-rank dump ends it
        _signal_tree(tree, signal.SIGKILL)
    report["identity"] = identity(None)
    report["engine_quiesced"] = quiesced
    report["timings_s"] = timings
    report["barrier_wait_s"] = dict(ranks.waits)
    report["image_bytes"], report["image_files"] = _images_size(images)
    if digest:
        report["image_digest"] = image_digest(images, contents=True)
    report["completed_unix"] = time.time()
    (images / "capture.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def _write_graph_record(images: Path, plan: GraphPlan, world_size: int) -> None:
    execution = tp_execution(world_size, "coldsnap-engine")
    record = graph_record(async_graphs=plan.recorded != "disabled", graph_policy=plan.recorded,
                          engine="coldsnap-engine", execution=execution)
    (images / "graph.json").write_text(json.dumps({"record": record, "execution": execution}, indent=2) + "\n")


def _validated_graph_record(images: Path) -> dict[str, Any] | None:
    """The record written at capture, every rule checked and its digest recomputed; None if there is none."""
    path = images / "graph.json"
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text())
        record, execution = stored["record"], stored["execution"]
        validate_graph_record(record, engine="coldsnap-engine", execution=execution, coverage=None)
    except (ValueError, KeyError, TypeError, AttributeError, ContractError) as exc:
        raise WorkerError(f"graph.json: {exc}") from exc
    return dict(record)


def _rollback(driver: Driver, done: list[tuple[int, str]]) -> None:
    """Undo in reverse order so the workload keeps running: restore what was checkpointed, then unlock."""
    for pid, what in reversed(done):
        try:
            if what == "checkpointed":
                driver.call("cuCheckpointProcessRestore", pid, None, required=False)
            elif driver.state(pid) == "locked":
                driver.call("cuCheckpointProcessUnlock", pid, None, required=False)
        except Exception:
            continue


def _driver_major(version: Any) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def identity_compatibility(captured: dict[str, Any], current: dict[str, Any], boundary: str) -> str:
    """`exact`, `driver-upgraded` or `pre-cuda-template`; raises when the state cannot restore here."""
    if captured.get("architecture") != current.get("architecture"):
        raise WorkerError(f"captured on {captured.get('architecture')}, this host is {current.get('architecture')}")
    if boundary == "n580":
        return "pre-cuda-template"  # no CUDA state was captured: the process initializes CUDA fresh
    was, now = _driver_major(captured.get("driver_version")), _driver_major(current.get("driver_version"))
    if was is None or now is None:
        raise WorkerError("the NVIDIA driver version is unknown: initialized CUDA state cannot be checked")
    if now < was:
        raise WorkerError(f"driver {current.get('driver_version')} is older than the captured "
                          f"{captured.get('driver_version')}")
    if captured.get("gpu_name") != current.get("gpu_name"):
        raise WorkerError(f"captured on {captured.get('gpu_name')}, this GPU is {current.get('gpu_name')}")
    return "exact" if captured.get("driver_version") == current.get("driver_version") else "driver-upgraded"


def _start_lazy_pages(criu: str, images: Path, work: Path) -> subprocess.Popen[bytes]:
    """`criu lazy-pages` for the restore that follows: it serves the restored process's page faults from the
    images (userfaultfd) and copies every other page in the background, then exits 0."""
    listening = work / "lazy-pages.socket"
    listening.unlink(missing_ok=True)
    log = work / "lazy-pages.log"
    daemon = subprocess.Popen([criu, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work),
                               "--log-file", str(log), "-v4"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    give_up = time.monotonic() + LAZY_PAGES_START_S
    while not listening.exists():
        if daemon.poll() is not None:
            raise WorkerError(f"criu lazy-pages did not start (exit {daemon.returncode}): {_tail(log)}")
        if time.monotonic() > give_up:
            _stop(daemon)
            raise WorkerError(f"criu lazy-pages did not listen within {LAZY_PAGES_START_S:.0f} s: {_tail(log)}")
        time.sleep(0.001)
    return daemon


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
                          f"{_tail(work / 'lazy-pages.log')}")
    if _state(root) in ("", "Z", "X"):
        raise WorkerError(f"the restored process {root} exited while its pages were restored")


def _state(pid: int) -> str:
    """The process's state letter (`T` stopped, `Z` zombie...), or "" once it is gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat_line[stat_line.rindex(")") + 2:][:1]


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def _tail(log: Path, lines: int = 15) -> str:
    """CRIU's first error lines (the cause; what follows is mostly the unwinding) and the log's last lines."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    # (every run on the GPU machine logs a harmless RLIMIT_NOFILE error first)
    errors = [line for line in text if "Error (" in line and "RLIMIT_NOFILE" not in line][:4]
    return "\n".join([*errors, "...", *text[-lines:]] if errors else text[-lines:])


def restore(images: Path, *, criu: str, work: Path | None = None, coordinator: Coordinator | None = None,
            lazy_pages: bool = False) -> dict[str, Any]:
    """Restore the tree captured in `images`; returns the report (the images are only read).

    `lazy_pages`: CRIU restores the processes without their memory, which `criu lazy-pages` then fills
    (faults first, the rest in the background) while the CUDA state is restored. The tree is then held
    stopped until every page is in, so nothing serves from memory a failed daemon never filled.
    """
    ranks = coordinator or Coordinator.single()
    timeline = Timeline()
    timeline.mark("restore_begin")
    root = None
    stager: Stager | None = None
    lazy: subprocess.Popen[bytes] | None = None
    report: dict[str, Any] = {"format": 1, "kind": RESTORE_KIND, "rank": ranks.rank, "world_size": ranks.world_size}
    try:
        capture_report = json.loads((images / "capture.json").read_text())
        boundary = capture_report["boundary"]
        if (capture_report.get("rank", 0), capture_report.get("world_size", 1)) != (ranks.rank, ranks.world_size):
            raise WorkerError(f"these images are rank {capture_report.get('rank', 0)} of "
                              f"{capture_report.get('world_size', 1)}, not rank {ranks.rank} of {ranks.world_size}")
        graph = _validated_graph_record(images)
        manifest = None
        if (images / "hydration.json").exists():  # check the weight sources before spending a CRIU restore
            try:
                manifest = HydrationManifest.from_json(json.loads((images / "hydration.json").read_text()))
                check_sources(manifest.regions, manifest.identities)
            except (ProbeError, ValueError) as exc:
                raise WorkerError(f"weight hydration cannot succeed, not restoring: {exc}") from exc
        compatibility = identity_compatibility(capture_report.get("identity", {}), identity(None), boundary)
        cuda = list(capture_report.get("cuda_pids", []))
        engine = capture_report.get("engine") if capture_report.get("engine_quiesced") else None
        if ranks.multi and boundary == "n610" and (graph is None or engine is None):
            raise WorkerError("these multi-rank images lack the graph record or the engine's quiesce: their "
                              "communicators could not be recreated")
        report.update({"boundary": boundary, "captured_root_pid": capture_report["root_pid"], "cuda_pids": cuda,
                       "identity_compatibility": compatibility})
        if graph is not None:
            report["graph_policy"] = {"effective": graph["policy_effective"], "decision": graph["decision"],
                                      "plan_sha256": graph["recipe"]["plan_sha256"]}
            if graph["policy_effective"] == "preserve-nccl-exec":
                raise WorkerError("the record retains NCCL graph executables in place, which needs the engine's "
                                  "admitted in-place NCCL provider; this engine recreates its communicators")
        # Nothing is restored on any rank until every rank's images, record and identity are good.
        peers = ranks.barrier("validated", {"plan_sha256": graph["recipe"]["plan_sha256"] if graph else None})
        if len({str(p.get("plan_sha256")) for p in peers}) != 1:
            raise WorkerError("the ranks' graph records disagree: "
                              f"{[p.get('plan_sha256') for p in peers]}")
        if manifest is not None and manifest.hydrator:  # the weights are copied while the process is restored
            stager = Stager(manifest)
        work = work or Path(tempfile.mkdtemp(prefix="coldsnap-restore-"))
        work.mkdir(parents=True, exist_ok=True)
        pidfile = work / "restored.pid"
        pidfile.unlink(missing_ok=True)  # CRIU refuses to overwrite one left by an earlier restore
        # Every rank is restored paused and released together; a lazy tree is released once its pages are in.
        paused = bool(cuda) or ranks.multi or lazy_pages
        if lazy_pages:
            lazy = _start_lazy_pages(criu, images, work)
        args = ["restore", "--images-dir", str(images), "--work-dir", str(work), "--restore-detached",
                "--pidfile", str(pidfile), *(["--leave-stopped"] if paused else []),
                *(["--lazy-pages"] if lazy else [])]
        driver = Driver() if cuda else None
        with ThreadPoolExecutor(1, thread_name_prefix="coldsnap-cuinit") as pool:
            # The driver initialises while CRIU runs (cuInit is a good part of the CUDA restore otherwise).
            initialised = pool.submit(driver.call, "cuInit", 0) if driver is not None else None
            report["criu_restore_seconds"] = _criu(criu, args, work / "restore.log")
            timeline.mark("criu_restore_end")
            root = int(pidfile.read_text().split()[0])  # before anything else can fail: the tree is killed then
            if initialised is not None:
                initialised.result()
        report["restored_pid"] = root
        if not set(cuda) <= set(process_tree(root)):
            raise WorkerError(f"the recorded CUDA processes {cuda} are not in the restored tree of {root}")
        peers = ranks.barrier("criu-restored", {"pid": root, "criu_seconds": report["criu_restore_seconds"]})
        report["peer_criu_restore_seconds"] = [p.get("criu_seconds") for p in peers]
        if ranks.multi:
            timeline.mark("rank_barrier_end")
        if driver is not None:
            timeline.mark("deferred_cuda_restore_begin")
            os.killpg(root, signal.SIGCONT)  # leave-stopped tree: the CUDA restore thread must run
            for pid in reversed(cuda):
                _require(driver, [pid], "checkpointed", "before CUDA restore")
                driver.call("cuCheckpointProcessRestore", pid, None)
                _require(driver, [pid], "locked", "after CUDA restore")
                driver.call("cuCheckpointProcessUnlock", pid, None)
                _require(driver, [pid], "running", "after unlock")
            if ranks.multi or lazy:
                os.killpg(root, signal.SIGSTOP)  # held until every rank's CUDA state is back, every page is in
            timeline.mark("deferred_cuda_restore_end")
            report["cuda_restore_seconds"] = timeline.seconds("deferred_cuda_restore_begin",
                                                               "deferred_cuda_restore_end")
            peers = ranks.barrier("cuda-restored", {"cuda_seconds": report["cuda_restore_seconds"]})
            report["peer_cuda_restore_seconds"] = [p.get("cuda_seconds") for p in peers]
            if ranks.multi:
                timeline.mark("distributed_cuda_restore_barrier_end")
        if lazy:
            _finish_lazy_pages(lazy, work, root, ranks)
            timeline.mark("all_pages_in")
            report["all_pages_in_seconds"] = timeline.seconds("restore_begin", "all_pages_in")
        if ranks.multi or lazy:
            os.killpg(root, signal.SIGCONT)
        if ranks.multi:
            ranks.barrier("process-resumed")
        timeline.mark("process_resumed")  # without CUDA, one rank, eager: the tree was restored running
        if manifest is not None:
            timeline.mark("hydration_begin")
            staged = stager.result() if stager else None
            answer = _engine(manifest.control, {"op": "hydrate"},
                             "weight hydration failed, the restored engine is not released", ranks=ranks)
            timeline.mark("hydration_end")
            hydrated = answer["report"]
            report["hydration"] = {"bytes": hydrated["bytes"], "seconds": hydrated["seconds"],
                                   "gbps": hydrated["gbps"], "regions_verified": hydrated["verified_regions"],
                                   "engine": hydrated, "staged": staged,
                                   "phase_seconds": timeline.seconds("hydration_begin", "hydration_end")}
        if engine and graph is not None:
            timeline.mark("communicator_recreate_begin")
            report["engine_resume"] = _resume_engine(engine, ranks, graph["policy_effective"], "restore", work)
            timeline.mark("communicator_recreate_end")
            report["communicator_recreate_seconds"] = timeline.seconds("communicator_recreate_begin",
                                                                       "communicator_recreate_end")
        ranks.barrier("ready")
        timeline.mark("ready")
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        if root is not None:  # a failure on any rank stops every rank: nothing half-restored serves
            with contextlib.suppress(ProcessLookupError):
                os.killpg(root, signal.SIGKILL)
        ranks.abort(f"rank {ranks.rank} restore: {report['error']}")
        if stager:
            stager.discard()
        if lazy:
            _stop(lazy)
        report["timeline"] = timeline.marks
        if isinstance(exc, WorkerError):
            raise
        raise WorkerError(report["error"]) from exc
    report["timeline"] = timeline.marks
    report["barrier_wait_s"] = dict(ranks.waits)
    report["restore_seconds"] = timeline.seconds("restore_begin", "process_resumed")
    report["ready_seconds"] = timeline.seconds("restore_begin", "ready")
    return report

"""Memory source: the CUDA interposer's device dump (hydration/_interposer.py, docs/interposer.md).

Capture: every CUDA process whose environment enabled the interposer (or the one the capture names) dumps its
regions into `device-<pid>/` in the images and releases them before the CUDA lock (the addresses stay reserved);
`device-memory.json` records each dump. A failed capture hydrates every process asked back and removes its dump.
A process that enabled the interposer but never allocated through it has no socket and restores as before,
recorded as such.
Restore: the record, every manifest's digest and every dump file's size are checked before CRIU runs; the dump
files are read ahead, and a node hydrator the engine named stages each process's dump (`DeviceStage`) while CRIU
and CUDA restore the tree; once the tree runs, each interposer maps what was staged or re-creates its regions at
their addresses, fills and verifies them, and opens its gate. A failed restore discards the stages.

The stage is best effort by design, as the weights' `Stager`: a stage that fails, is late or is refused is
reported, and the regular hydration (the interposer fills the regions itself) runs. It is asked for only when
every dump file is provably the one the capture wrote, or one the node's capture store made from the capture's
checked chunks (`verification` is `sampled`): the hydrator copies bytes, it does not digest them, and the
interposer's sampled read-back compares the device with the files.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import jsonline
from ..errors import ChannelError, HydrationError, ProbeError, WorkerError
from ..hydration import (
    ADOPT_PAGE,
    ENV_HYDRATOR,
    DeviceDump,
    StageRequest,
    check_dump,
    dump_identities,
    interposer_request,
    interposer_socket,
    remove_dump,
    store_made,
    verification,
)
from ._protocol import CaptureScope, RestoreScope, read_record

if TYPE_CHECKING:  # the report types load where they are made: off a restore's path to CRIU (issue 35 item 2)
    from .._reports import CaptureReport, DumpedDevice, HydratedDevice, RestoreReport

__all__ = ("INTERPOSER_PAGE", "RECORD", "STAGE_GROUP", "WARM_WAIT_S", "DeviceDumpSource", "DeviceRelease",
           "DeviceRestore", "DeviceStage", "DeviceWarm", "DumpRecord", "hydrate_devices", "prefetch_dumps",
           "stage_groups", "stage_parts", "stages_for", "validated_dumps")

RECORD = "device-memory.json"
RECORD_KIND = "coldsnap-device-memory"
INTERPOSER_PAGE = 16  # descriptors per page to the interposer's control socket (constants.h's CSCU_PAGE_FDS)
STAGE_GROUP = 1 << 30  # bytes of regions one staged allocation backs when the stage is copied (CSCU_STAGE_GROUP)
WARM_WAIT_S = 2.0  # the most a capture waits for its node hydrators' answers to `warm` (milliseconds, normally)


@dataclass(frozen=True, slots=True)
class DumpRecord:
    """One CUDA process's release: its socket, its dump directory (a name in the images), the manifest and each
    dump file's identity when it was written (`verification`)."""

    pid: int
    socket: str
    directory: str
    dump: DeviceDump
    files: dict[str, list[int]]
    hydrator: str = ""  # the node hydrator the engine named (ENV_HYDRATOR): restore stages the dump there

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "socket": self.socket, "directory": self.directory, "manifest": self.dump.to_json(),
                "files": self.files, "hydrator": self.hydrator}


class DeviceStage(StageRequest):
    """One process's stage: asked at once (a thread), adopted after the CUDA restore, discarded on failure."""

    def __init__(self, hydrator: str, dump: DeviceDump, directory: Path) -> None:
        self.key = dump.manifest_digest
        self.parts, self.sizes = stage_parts(dump, directory)
        self.device_uuid = dump.regions[0].device_uuid
        super().__init__(hydrator, "coldsnap-device-stage")

    def _ask(self) -> dict[str, Any]:
        return self._stage({"op": "stage-dump", "key": self.key, "parts": self.parts,
                            "device_uuid": self.device_uuid})

    def _discard(self) -> dict[str, Any]:
        return {"op": "discard", "key": self.key, "ticket": self.ticket}

    def adopt(self, timeout: float = 600.0) -> list[int] | None:
        """The staged allocations as descriptors, one per region in order (the caller closes them), taken from
        the hydrator ADOPT_PAGE at a time; None (`report` says why, nothing is left open) when there is no stage,
        or an answer is refused or does not fit: a count other than the regions', a page of other sizes."""
        started = time.perf_counter()
        if not self.wait(timeout) or not self.report.get("staged"):
            self.report.setdefault("error", "still staging")
            return None
        waited = time.perf_counter()
        self.report["wait_s"] = waited - started  # after the CUDA restore, for the stage to be filled
        taken: list[int] = []
        try:
            while len(taken) < len(self.sizes):
                taken += self._page(len(taken))
        except (ChannelError, HydrationError) as exc:
            for fd in taken:
                os.close(fd)
            self.report["adopt_error"] = str(exc)
            return None
        self.report["pages_s"] = time.perf_counter() - waited  # the descriptors taken from the hydrator
        return taken

    def _page(self, first: int) -> list[int]:
        """The descriptors of the page at `first` (HydrationError, nothing left open, unless exactly the
        regions')."""
        answer, fds = jsonline.request_with_fds(self.hydrator, {"op": "adopt", "key": self.key, "ticket": self.ticket,
                                                                "parts": self.parts, "first": first}, timeout=60.0)
        expected = self.sizes[first:first + ADOPT_PAGE]
        problem = (str(answer.get("error") or "refused") if not answer.get("ok") else
                   f"the hydrator holds {answer.get('count')} allocations, the dump {len(self.sizes)} regions"
                   if answer.get("count") != len(self.sizes) else
                   f"page {first}: {len(fds)} descriptors of {answer.get('sizes')} bytes, expected {expected}"
                   if answer.get("first") != first or answer.get("sizes") != expected or len(fds) != len(expected)
                   else "")
        if problem:
            for fd in fds:
                os.close(fd)
            raise HydrationError(f"adopt: {problem}")
        return fds


def stage_parts(dump: DeviceDump, directory: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """A stage-dump's `parts` for `dump` in `directory` (as a capture's `warm` names them too, so that the RAM tier
    entry it loads is the one the stage asks for), and each staged allocation's bytes."""
    # Each segment file names the allocation it is staged in. One per region where the interposer adopts them
    # (it maps each whole at its region's address: a mapping of a part of a larger allocation is refused).
    # An engine's own VMM allocations come in many small pages whose flags no staged allocation can carry
    # (PyTorch's expandable segments: ~830 pages of 20 MiB at 16 GiB, GPUDirect RDMA capable): the interposer
    # re-creates them as the engine made them and copies them from the stage on the device, so consecutive
    # regions share one staged allocation of up to STAGE_GROUP bytes (`stage_groups`, hydrate.c's twin).
    grouped = dump.moved.get("vmm_by_engine", {}).get("count", 0) > 0
    groups = stage_groups([r.size for r in dump.regions]) if grouped else list(range(len(dump.regions)))
    # A segment's chunks of zeros (its `zero` mask, bound by the manifest's digest, the stage's key) are set on
    # the device by the hydrator: never read from the dump nor moved over the link.
    parts = [{"file": str(directory / s.file), "bytes": s.size, "region": groups[index],
              **({"zero": s.zero} if s.zero else {})}
             for index, region in enumerate(dump.regions) for s in region.segments]
    sizes = [0] * (groups[-1] + 1 if groups else 0)
    for index, region in enumerate(dump.regions):
        sizes[groups[index]] += region.size
    return parts, sizes


def stage_groups(sizes: list[int]) -> list[int]:
    """The staged allocation of each region (by index) when a stage is copied from: consecutive regions up to
    STAGE_GROUP bytes share one, a larger region has its own (hydrate.c's stage_groups, the same rule)."""
    groups: list[int] = []
    used = 0
    for size in sizes:
        if not groups or used + size > STAGE_GROUP:
            groups.append(groups[-1] + 1 if groups else 0)
            used = 0
        else:
            groups.append(groups[-1])
        used += size
    return groups


def _owner(pid: int) -> tuple[int, int]:
    """The process's effective uid and gid (/proc/<pid>/status)."""
    uid = gid = -1
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            uid = int(line.split()[2])
        elif line.startswith("Gid:"):
            gid = int(line.split()[2])
    return uid, gid


class DeviceRelease:
    """Capture: the releases done so far, so that a failed capture hydrates them back and removes their dumps."""

    def __init__(self, images: Path, cuda: list[int], explicit: str | None = None) -> None:
        self.images, self.cuda, self.explicit = images.absolute(), cuda, explicit  # the engine's cwd is not ours
        self.records: list[DumpRecord] = []
        self.asked: list[tuple[str, Path]] = []  # (socket, dump directory) of every release asked, failed ones too
        self.reports: list[DumpedDevice] = []
        self.warming: DeviceWarm | None = None

    def _socket(self, pid: int, cuda: list[int]) -> str | None:
        if self.explicit:
            if len(cuda) != 1:
                raise WorkerError(f"--interposer names one socket, the tree has {len(cuda)} CUDA processes: enable "
                                  "the interposer through their environment (COLDSNAP_CUDA_INTERPOSER_SOCKET with %p)")
            return self.explicit
        return interposer_socket(pid)

    def release(self, report: CaptureReport) -> None:
        """Ask every CUDA process with an interposer to dump and release its device memory."""
        started = time.perf_counter()
        self._release_all()
        if self.reports:
            report.device_memory = self.reports
            report.timings_s["device_release"] = time.perf_counter() - started

    def _release_all(self) -> None:
        from .._reports import DumpedDevice

        cuda = self.cuda
        for pid in cuda:
            socket = self._socket(pid, cuda)
            if socket is None:
                continue
            if not os.path.exists(socket):  # enabled, but nothing was ever allocated through it
                self.reports.append(DumpedDevice(pid=pid, socket=socket, state="not-started"))
                continue
            try:
                owner = interposer_request(socket, {"op": "status"}, f"the interposer of process {pid}",
                                           timeout=30.0).get("pid")
            except ProbeError as exc:
                raise WorkerError(f"device memory release: {exc}") from exc
            if owner != pid:  # one path without %p, taken by another process of the tree: this one is pass-through
                self.reports.append(DumpedDevice(pid=pid, socket=socket, state="not-started"))
                continue
            self._release_one(pid, socket)
        if self.records:
            record = {"format": 1, "kind": RECORD_KIND, "processes": [r.to_json() for r in self.records]}
            (self.images / RECORD).write_text(json.dumps(record, indent=2) + "\n")

    def _release_one(self, pid: int, socket: str) -> None:
        from .._reports import DumpedDevice, StackLimit

        directory = self.images / f"device-{pid}"
        directory.mkdir(mode=0o700)
        uid, gid = _owner(pid)
        if os.geteuid() == 0 and uid not in (-1, 0):  # the engine writes its own dump (0600 files, its uid)
            os.chown(directory, uid, gid)
            os.chmod(self.images, 0o711)  # it may pass through the images directory, not list it
        self.asked.append((socket, directory))
        started = time.perf_counter()
        try:
            answer = interposer_request(socket, {"op": "release", "dir": str(directory)},
                                        f"release the device memory of process {pid}")
            dump = DeviceDump.from_json(answer.get("manifest"), answered=True)
            stack = StackLimit.from_json(answer["stack_limit"]) if "stack_limit" in answer else None
        except (ProbeError, ValueError) as exc:
            raise WorkerError(f"device memory release: {exc}") from exc
        if dump.regions:
            self.records.append(DumpRecord(pid, socket, directory.name, dump, dump_identities(dump, directory),
                                           interposer_socket(pid, ENV_HYDRATOR) or ""))
        else:  # nothing was routed through it: nothing to hydrate, nothing left in the images
            remove_dump(directory)
        self.reports.append(DumpedDevice(
            pid=pid, socket=socket, state="released" if dump.regions else "empty", bytes=dump.bytes,
            regions=len(dump.regions), segments=len(dump.segments), seconds=time.perf_counter() - started,
            gbps=dump.gbps, timings_s=dump.timings_s, uncovered=dump.uncovered, moved=dump.moved,
            manifest_digest=dump.manifest_digest, stack_limit=stack))

    def warm(self) -> None:
        """The tree is dumped: each dump offered to the node hydrator its engine named (`DeviceWarm`)."""
        self.warming = DeviceWarm(self.records, self.images)

    def warmed(self, report: CaptureReport) -> None:
        if self.warming is not None:
            self.warming.record(report)

    def roll_back(self) -> None:
        """A failed capture: every process asked to release gets its memory back; the dumps are removed."""
        written = {r.socket: r for r in self.records}
        for socket, directory in self.asked:
            record = written.get(socket)  # a dump just written and recorded needs no digest pass to come back
            verify = verification(record.dump, directory, record.files) if record else "digest"
            with contextlib.suppress(ProbeError):
                status = interposer_request(socket, {"op": "status"}, "status", timeout=30.0)
                if status.get("released"):
                    interposer_request(socket, {"op": "hydrate", "dir": str(directory), "verify": verify},
                                       "roll back the release")
            remove_dump(directory)
        (self.images / RECORD).unlink(missing_ok=True)


class DeviceWarm:
    """After the dump: each dump whose engine named a node hydrator (its regions on one GPU, as a stage asks)
    offered to that hydrator's RAM tier (`warm`, hydration/_warm.py: the parts a restore's stage will name, so the
    tier's entry is the one that stage asks for), in a thread while the capture finishes: the first restore's stage
    is then a hit. `record` waits for the answers at most WARM_WAIT_S (the hydrator opens the files and queues
    them: milliseconds; it pins them later, on its own) and puts each into its process's report. Best effort: a
    refusal, no RAM tier or a hydrator that does not answer is reported, never the capture's failure."""

    def __init__(self, records: list[DumpRecord], images: Path) -> None:
        self.answers: dict[int, dict[str, Any]] = {}
        offered = [r for r in records if r.hydrator and len({x.device_uuid for x in r.dump.regions}) == 1]
        self.offered = {r.pid for r in offered}
        self._thread = threading.Thread(target=self._run, args=(offered, images), name="coldsnap-device-warm",
                                        daemon=True)
        self._thread.start()

    def _run(self, records: list[DumpRecord], images: Path) -> None:
        for record in records:
            started = time.perf_counter()
            parts, _sizes = stage_parts(record.dump, images / record.directory)
            try:
                answer = jsonline.request(record.hydrator, {"op": "warm", "key": record.dump.manifest_digest,
                                                            "parts": parts,
                                                            "device_uuid": record.dump.regions[0].device_uuid},
                                          timeout=WARM_WAIT_S)
                got = {"queued": answer.get("queued") is True} if answer.get("ok") else {
                    "queued": False, "error": str(answer.get("error"))[:400]}
            except Exception as exc:  # best effort: the capture is done whatever the hydrator says, and says why
                got = {"queued": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
            self.answers[record.pid] = {**got, "seconds": time.perf_counter() - started}

    def record(self, report: CaptureReport) -> None:
        """Each answer into its process's `device_memory[].warm` (one not come within WARM_WAIT_S: `late`)."""
        self._thread.join(WARM_WAIT_S)
        late = {"queued": False, "error": f"no answer within {WARM_WAIT_S} s"}
        if report.device_memory:
            report.device_memory = [replace(d, warm=dict(self.answers.get(d.pid) or late)) if d.pid in self.offered
                                    else d for d in report.device_memory]


def validated_dumps(images: Path) -> list[DumpRecord]:
    """Restore, before CRIU: the record, every manifest's digest and every dump file's size; [] without one."""
    try:
        stored = read_record(images, RECORD, RECORD_KIND)
        if stored is None:
            return []
        records = [DumpRecord(int(p["pid"]), str(p["socket"]), str(p["directory"]), DeviceDump.from_json(p["manifest"]),
                              {str(k): [int(x) for x in v] for k, v in dict(p.get("files") or {}).items()},
                              str(p.get("hydrator") or ""))
                   for p in stored["processes"]]
        for record in records:
            if record.directory != f"device-{record.pid}":
                raise HydrationError(f"process {record.pid}'s dump directory must be device-{record.pid}")
            check_dump(record.dump, images / record.directory)
    except (ValueError, KeyError, TypeError, ProbeError) as exc:
        raise WorkerError(f"{RECORD}: device memory cannot be hydrated, not restoring: {exc}") from exc
    return records


def prefetch_dumps(records: list[DumpRecord], images: Path) -> None:
    """Before CRIU runs: ask the kernel to read the dump files ahead (images on disk come into the page cache
    while CRIU and CUDA restore the process; on tmpfs it does nothing), but for their chunks of zeros, which no
    restore reads (a pulled image's files hold them as written zeros, not holes: reading them ahead would spend
    the disk on bytes set on the device anyway). Asynchronous; a failure changes nothing."""
    for record in records:
        for segment in record.dump.segments:
            with contextlib.suppress(OSError):
                # The engine's uid wrote these files: never follow a link it left, never block on a FIFO.
                fd = os.open(images / record.directory / segment.file,
                             os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        continue
                    for offset, size in segment.data_runs():
                        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)


def stages_for(records: list[DumpRecord], images: Path,
               made: frozenset[tuple[int, ...]] = frozenset()) -> dict[int, DeviceStage]:
    """Restore, before CRIU: a node hydrator stage (docs/interposer.md) per process whose engine named a hydrator,
    whose regions are on one GPU and whose dump files are the capture's own (the release's, or those the node's
    capture store made and listed: `made`, `store_made()`); by pid."""
    stages = {}
    for record in records:
        directory = images.absolute() / record.directory
        if not record.hydrator or len({r.device_uuid for r in record.dump.regions}) != 1:
            continue
        if verification(record.dump, directory, record.files, made) == "sampled":
            stages[record.pid] = DeviceStage(record.hydrator, record.dump, directory)
    return stages


def _staged(record: DumpRecord, stage: DeviceStage, directory: Path, policy: str,
            started: float) -> HydratedDevice | None:
    """The interposer maps what the hydrator staged (one allocation per released region, passed in pages of
    INTERPOSER_PAGE descriptors on one connection), reported as hydrated since `started`; None when there is
    nothing to map or it refused (then the regular hydration runs: a refused adoption leaves the regions released,
    the gate closed)."""
    fds = stage.adopt()
    if fds is None:
        return None
    held = list(fds)

    def let_go() -> None:  # sent: the interposer's copies keep the allocations (it frees one copied from at once)
        while held:
            os.close(held.pop())

    try:
        answer = jsonline.request(record.socket, {"op": "hydrate", "dir": str(directory), "policy": policy,
                                                  "allocations": str(len(fds))}, fds=fds, page=INTERPOSER_PAGE,
                                  timeout=600.0, sent=let_go)
    except ProbeError as exc:
        stage.report["adopt_error"] = str(exc)
        return None
    finally:
        let_go()  # the regions' mappings hold the allocations now
    if not answer.get("ok"):
        stage.report["adopt_error"] = str(answer.get("error"))
        return None
    report = dict(answer.get("report") or {})
    from .._reports import HydratedDevice

    return HydratedDevice(pid=record.pid, bytes=int(report.get("bytes", 0)), seconds=time.perf_counter() - started,
                          gbps=0.0, interposer={**report, "stage": stage.report})


def hydrate_devices(records: list[DumpRecord], images: Path, policy: str, *, digests: bool = False,
                    stages: dict[int, DeviceStage] | None = None,
                    made: frozenset[tuple[int, ...]] = frozenset()) -> list[HydratedDevice]:
    """Restore, after the CUDA restore: each process maps, fills and verifies its regions, then runs on (the
    processes of a tree at once). Every byte is digested when `digests` or when a dump file is not provably the
    one written at capture. The first failure is raised once every process has answered. A process with a stage
    (`stages`, by pid) first maps what the node hydrator filled meanwhile."""

    from .._reports import HydratedDevice

    def one(record: DumpRecord) -> HydratedDevice:
        started = time.perf_counter()
        directory = images.absolute() / record.directory
        verify = "digest" if digests else verification(record.dump, directory, record.files, made)
        stage = (stages or {}).get(record.pid)
        if stage is not None and verify == "sampled" and (staged := _staged(record, stage, directory, policy,
                                                                            started)):
            return staged
        if stage is not None:
            stage.discard()  # not adopted: the hydrator frees it now rather than at its TTL
        try:
            answer = interposer_request(record.socket, {"op": "hydrate", "dir": str(directory), "policy": policy,
                                                        "verify": verify},
                                        f"hydrate the device memory of process {record.pid}")
        except ProbeError as exc:
            raise WorkerError(f"device memory hydration failed, the restored process is not released: {exc}") from exc
        report = {**(answer.get("report") or {}), **({"stage": stage.report} if stage is not None else {})}
        return HydratedDevice(pid=record.pid, bytes=int(report.get("bytes", 0)), seconds=time.perf_counter() - started,
                              gbps=float(report.get("gbps", 0.0)), interposer=report)

    if len(records) == 1:
        return [one(records[0])]
    from concurrent.futures import ThreadPoolExecutor, wait  # only here: off a restore's path to CRIU (issue 35)

    with ThreadPoolExecutor(len(records), thread_name_prefix="coldsnap-device-hydrate") as pool:
        futures = [pool.submit(one, r) for r in records]
        wait(futures)
    return [f.result() for f in futures]


class DeviceDumpSource:
    """The CUDA interposer's device dump: released for every CUDA process that enabled the interposer."""

    name = "device-dump"

    def capture(self, scope: CaptureScope) -> DeviceRelease:
        return DeviceRelease(scope.images, scope.cuda, scope.options.interposer)

    def load(self, scope: RestoreScope) -> DeviceRestore | None:
        records = validated_dumps(scope.images)  # every manifest and dump file checked before CRIU runs
        return DeviceRestore(records, scope) if records else None


class DeviceRestore:
    """One restore's device dumps: read ahead and staged before CRIU, hydrated once the tree runs."""

    def __init__(self, records: list[DumpRecord], scope: RestoreScope) -> None:
        self.records, self.images, self.options = records, scope.images, scope.options
        self.stages: dict[int, DeviceStage] = {}
        self.made = store_made()  # the files the node's capture store made, when it mounted them here

    def stage(self) -> None:
        prefetch_dumps(self.records, self.images)
        self.stages = stages_for(self.records, self.images, self.made)

    def hydrate(self, report: RestoreReport) -> None:
        """Each interposer re-creates its regions at their addresses, fills and verifies them, opens its gate."""
        report.timeline.mark("device_hydration_begin")
        report.device_memory = hydrate_devices(self.records, self.images, self.options.device_policy,
                                               digests=self.options.device_digests, stages=self.stages,
                                               made=self.made)
        report.timeline.mark("device_hydration_end")
        report.device_hydration_seconds = report.timeline.seconds("device_hydration_begin", "device_hydration_end")

    def discard(self) -> None:
        for stage in self.stages.values():
            stage.discard()

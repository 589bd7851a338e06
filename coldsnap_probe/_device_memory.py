"""The workers' side of the CUDA interposer (hydration/_interposer.py): release every CUDA process's device
memory before the CUDA lock, hydrate it after the CUDA restore, and the record between the two
(`device-memory.json` in the images, beside each process's dump directory `device-<pid>/`).

A process is asked only when its environment enabled the interposer (or the capture names its socket); a
process that enabled it but never allocated through it has no socket and restores as before, recorded as such.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import jsonline
from ._device_stage import DeviceStage
from ._reports import DumpedDevice, HydratedDevice
from .errors import HydrationError, ProbeError, WorkerError
from .hydration import (
    ENV_HYDRATOR,
    DeviceDump,
    check_dump,
    dump_identities,
    interposer_request,
    interposer_socket,
    remove_dump,
    verification,
)

__all__ = ("RECORD", "DeviceRelease", "hydrate_devices", "prefetch_dumps", "stages_for", "validated_dumps")

RECORD = "device-memory.json"
RECORD_KIND = "coldsnap-device-memory"
INTERPOSER_PAGE = 16  # descriptors per page to the interposer's control socket (control.c's PAGE_FDS)


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

    def __init__(self, images: Path, explicit: str | None = None) -> None:
        self.images, self.explicit = images.absolute(), explicit  # the engine's cwd is not ours
        self.records: list[DumpRecord] = []
        self.asked: list[tuple[str, Path]] = []  # (socket, dump directory) of every release asked, failed ones too
        self.reports: list[DumpedDevice] = []

    def _socket(self, pid: int, cuda: list[int]) -> str | None:
        if self.explicit:
            if len(cuda) != 1:
                raise WorkerError(f"--interposer names one socket, the tree has {len(cuda)} CUDA processes: enable "
                                  "the interposer through their environment (COLDSNAP_CUDA_INTERPOSER_SOCKET with %p)")
            return self.explicit
        return interposer_socket(pid)

    def release(self, cuda: list[int]) -> None:
        """Ask every CUDA process with an interposer to dump and release its device memory."""
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
        except ProbeError as exc:
            raise WorkerError(f"device memory release: {exc}") from exc
        if dump.regions:
            self.records.append(DumpRecord(pid, socket, directory.name, dump, dump_identities(dump, directory),
                                           interposer_socket(pid, ENV_HYDRATOR) or ""))
        else:  # nothing was routed through it: nothing to hydrate, nothing left in the images
            remove_dump(directory)
        self.reports.append(DumpedDevice(
            pid=pid, socket=socket, state="released" if dump.regions else "empty", bytes=dump.bytes,
            regions=len(dump.regions), segments=len(dump.segments), seconds=time.perf_counter() - started,
            gbps=dump.gbps, timings_s=dump.timings_s, uncovered=dump.uncovered, manifest_digest=dump.manifest_digest))

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


def validated_dumps(images: Path) -> list[DumpRecord]:
    """Restore, before CRIU: the record, every manifest's digest and every dump file's size; [] without one."""
    path = images / RECORD
    if not path.exists():
        return []
    try:
        stored = json.loads(path.read_text())
        if not isinstance(stored, dict) or stored.get("kind") != RECORD_KIND or stored.get("format") != 1:
            raise HydrationError(f"not a format-1 {RECORD_KIND}")
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
    while CRIU and CUDA restore the process; on tmpfs it does nothing). Asynchronous; a failure changes nothing."""
    for record in records:
        for segment in record.dump.segments:
            with contextlib.suppress(OSError):
                # The engine's uid wrote these files: never follow a link it left, never block on a FIFO.
                fd = os.open(images / record.directory / segment.file,
                             os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        continue
                    os.posix_fadvise(fd, segment.offset, segment.size, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)


def stages_for(records: list[DumpRecord], images: Path) -> dict[int, DeviceStage]:
    """Restore, before CRIU: a node hydrator stage (docs/interposer.md) per process whose engine named a hydrator,
    whose regions are on one GPU and whose dump files are the capture's own; by pid."""
    stages = {}
    for record in records:
        directory = images.absolute() / record.directory
        if not record.hydrator or len({r.device_uuid for r in record.dump.regions}) != 1:
            continue
        if verification(record.dump, directory, record.files) == "sampled":
            stages[record.pid] = DeviceStage(record.hydrator, record.dump, directory)
    return stages


def _staged(record: DumpRecord, stage: DeviceStage, directory: Path, policy: str) -> dict[str, Any] | None:
    """The interposer maps what the hydrator staged (one allocation per released region, passed in pages of
    INTERPOSER_PAGE descriptors on one connection); None when there is nothing to map or it refused (then the
    regular hydration runs: a refused adoption leaves the regions released, the gate closed)."""
    fds = stage.adopt()
    if fds is None:
        return None
    try:
        answer = jsonline.request(record.socket, {"op": "hydrate", "dir": str(directory), "policy": policy,
                                                  "allocations": str(len(fds))}, fds=fds, page=INTERPOSER_PAGE,
                                  timeout=600.0)
    except ProbeError as exc:
        stage.report["adopt_error"] = str(exc)
        return None
    finally:
        for fd in fds:
            os.close(fd)  # the regions' mappings hold the allocations now
    if not answer.get("ok"):
        stage.report["adopt_error"] = str(answer.get("error"))
        return None
    return dict(answer.get("report") or {})


def hydrate_devices(records: list[DumpRecord], images: Path, policy: str, *, digests: bool = False,
                    stages: dict[int, DeviceStage] | None = None) -> list[HydratedDevice]:
    """Restore, after the CUDA restore: each process maps, fills and verifies its regions, then runs on (the
    processes of a tree at once). Every byte is digested when `digests` or when a dump file is not provably the
    one written at capture. The first failure is raised once every process has answered. A process with a stage
    (`stages`, by pid) first maps what the node hydrator filled meanwhile."""

    def one(record: DumpRecord) -> HydratedDevice:
        started = time.perf_counter()
        directory = images.absolute() / record.directory
        verify = "digest" if digests else verification(record.dump, directory, record.files)
        stage = (stages or {}).get(record.pid)
        if stage is not None and verify == "sampled" and (report := _staged(record, stage, directory, policy)):
            return HydratedDevice(pid=record.pid, bytes=int(report.get("bytes", 0)),
                                  seconds=time.perf_counter() - started, gbps=0.0,
                                  interposer={**report, "stage": stage.report})
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
    with ThreadPoolExecutor(len(records), thread_name_prefix="coldsnap-device-hydrate") as pool:
        futures = [pool.submit(one, r) for r in records]
        wait(futures)
    return [f.result() for f in futures]

"""What the capture and restore workers report, as types: `CaptureReport`, `RestoreReport`, `Timeline`.

Their JSON (`to_json`) is the wire the daemon's phase metrics and the benches decode: the keys, units and
meanings are fixed (docs/worker-reports.md). A key that is absent from a report is an optional field left
`None` here (for example `graph_policy` when no graph policy was planned); it is never written as null.
Seconds are floats from a monotonic clock, `*_unix` are wall-clock seconds, `unix_ns` wall-clock nanoseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import ChannelError

__all__ = ("CAPTURE_KIND", "RESTORE_KIND", "CaptureReport", "CapturedGraphPolicy", "DumpedDevice", "HydratedDevice",
           "HydratedWeights", "Mark", "ReleasedWeights", "RestoreReport", "RestoredGraphPolicy", "SourceReport",
           "StackLimit", "Timeline")

CAPTURE_KIND = "coldsnap-cuda-criu-capture"
RESTORE_KIND = "coldsnap-cuda-criu-restore"


class SourceReport(Protocol):
    """A memory source's report with no field of its own here (`memory_sources`, by the source's name)."""

    def to_json(self) -> dict[str, Any]:
        """Its JSON object."""


def _present(values: dict[str, Any]) -> dict[str, Any]:
    """The keys whose value is not None: an optional field that was never set is absent, as before."""
    return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True, slots=True)
class Mark:
    """One instant of a restore, measured by the worker (never by the restored process)."""

    name: str
    unix_ns: int
    since_restore_begin_s: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "unix_ns": self.unix_ns, "since_restore_begin_s": self.since_restore_begin_s}


class Timeline:
    """Marks in the order they were taken; the first is the origin of `since_restore_begin_s`."""

    def __init__(self) -> None:
        self.marks: list[Mark] = []

    def mark(self, name: str) -> None:
        now = time.time_ns()
        origin = self.marks[0].unix_ns if self.marks else now
        self.marks.append(Mark(name, now, (now - origin) / 1e9))

    def seconds(self, start: str, end: str) -> float:
        """Seconds between two marks (the last of each name)."""
        by_name = {m.name: m.unix_ns for m in self.marks}
        return float(by_name[end] - by_name[start]) / 1e9

    def to_json(self) -> list[dict[str, Any]]:
        return [m.to_json() for m in self.marks]


@dataclass(frozen=True, slots=True)
class CapturedGraphPolicy:
    requested: str
    recorded: str
    effective: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"requested": self.requested, "recorded": self.recorded, "effective": self.effective,
                "reason": self.reason}


@dataclass(frozen=True, slots=True)
class ReleasedWeights:
    """The engine's weights released before the CUDA lock (bytes, regions, seconds, the plan and manifest)."""

    released_bytes: int
    regions: int
    release_seconds: float
    plan_digest: str
    manifest_digest: str

    def to_json(self) -> dict[str, Any]:
        return {"released_bytes": self.released_bytes, "regions": self.regions,
                "release_seconds": self.release_seconds, "plan_digest": self.plan_digest,
                "manifest_digest": self.manifest_digest}


@dataclass(frozen=True, slots=True)
class StackLimit:
    """What a release did to the contexts' stack limit (CU_LIMIT_STACK_SIZE: the driver reserves it for every
    resident thread, and the CUDA checkpoint copies that reservation): the engine's own value (`engine_bytes`, the
    largest of its `contexts`), what the checkpoint then saw (`set_bytes`: lowered, or the engine's when the knob
    is off or a driver call failed: `error`), and the seconds it took. The hydration sets it back. The interposer
    keeps 16 contexts: `contexts_left` more (a process with regions on more GPUs) kept their own limit, and the
    checkpoint copied their whole reservation."""

    enabled: bool
    engine_bytes: int
    set_bytes: int
    contexts: int
    seconds: float
    error: str | None = None
    contexts_left: int = 0

    @classmethod
    def from_json(cls, value: object) -> StackLimit:
        """The interposer's `stack_limit` answer; ChannelError (it answered badly) naming the field and the rule."""
        if not isinstance(value, dict):
            raise ChannelError(f"stack_limit must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - {"enabled", "engine_bytes", "set_bytes", "contexts", "contexts_left", "seconds",
                                       "error"})
        if unknown:
            raise ChannelError(f"stack_limit has unknown keys {unknown}")
        if not isinstance(value.get("enabled"), bool):
            raise ChannelError("stack_limit.enabled must be true or false")
        # An older interposer's answer lacks `contexts_left` (it kept every context): 0.
        value = {"contexts_left": 0, **value}
        for key in ("engine_bytes", "set_bytes", "contexts", "contexts_left"):
            if type(value.get(key)) is not int or value[key] < 0:
                raise ChannelError(f"stack_limit.{key} must be an integer >= 0, got {value.get(key)!r}")
        seconds = value.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 86400:
            raise ChannelError(f"stack_limit.seconds must be a number of seconds (0 to 86400), got {seconds!r}")
        if not isinstance(value.get("error", ""), str):
            raise ChannelError("stack_limit.error must be a string")
        return cls(enabled=value["enabled"], engine_bytes=value["engine_bytes"], set_bytes=value["set_bytes"],
                   contexts=value["contexts"], seconds=float(seconds), error=value.get("error"),
                   contexts_left=value["contexts_left"])

    def to_json(self) -> dict[str, Any]:
        return _present({"enabled": self.enabled, "engine_bytes": self.engine_bytes, "set_bytes": self.set_bytes,
                         "contexts": self.contexts, "contexts_left": self.contexts_left,
                         "seconds": self.seconds, "error": self.error})


@dataclass(frozen=True, slots=True)
class DumpedDevice:
    """One CUDA process's device memory through the interposer before the CUDA lock: `released` (dumped, then
    unmapped; `moved` is what went at line rate, per source: `alloc` (cuMemAlloc), `stream_ordered`
    (cuMemAllocAsync), `vmm_by_engine` (the engine's own cuMemCreate); `uncovered` is what stayed on the CUDA
    checkpoint path, per kind; each `{count, bytes}`), `empty` (listening, but holding no
    region) or `not-started` (enabled, but nothing was ever allocated through it, so no socket, or its socket
    path is another process's): in the last two everything is on the checkpoint path."""

    pid: int
    socket: str
    state: str
    bytes: int = 0
    regions: int = 0
    segments: int = 0
    seconds: float = 0.0  # the whole release, as the worker waited for it
    gbps: float = 0.0  # the dump's rate (device to files)
    timings_s: dict[str, float] = field(default_factory=dict)  # synchronize, dump, unmap
    uncovered: dict[str, dict[str, int]] = field(default_factory=dict)
    moved: dict[str, dict[str, int]] = field(default_factory=dict)
    manifest_digest: str = ""
    stack_limit: StackLimit | None = None  # released only: the stack limit lowered for the checkpoint
    # The node hydrator's answer to `warm` (the dump offered to its RAM tier once the tree was dumped): {queued,
    # seconds, error?}; None when no hydrator was named.
    warm: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return _present({"pid": self.pid, "socket": self.socket, "state": self.state, "bytes": self.bytes,
                         "regions": self.regions, "segments": self.segments, "seconds": self.seconds,
                         "gbps": self.gbps, "timings_s": self.timings_s, "uncovered": self.uncovered,
                         "moved": self.moved, "manifest_digest": self.manifest_digest,
                         "stack_limit": self.stack_limit.to_json() if self.stack_limit else None,
                         "warm": self.warm})


@dataclass(frozen=True, slots=True)
class HydratedDevice:
    """One CUDA process's device memory back after restore: bytes, what the worker waited, the fill's rate, the
    interposer's own report (check_s, create_s, fill_s, verify_s, policy) and `stack_restore_s`, what setting the
    engine's stack limit back took (on the restore's path, before the fill)."""

    pid: int
    bytes: int
    seconds: float
    gbps: float
    interposer: dict[str, Any]

    @property
    def stack_restore_s(self) -> float | None:
        value = self.interposer.get("stack_restore_s")
        return float(value) if isinstance(value, (int, float)) else None

    def to_json(self) -> dict[str, Any]:
        return _present({"pid": self.pid, "bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                         "interposer": self.interposer, "stack_restore_s": self.stack_restore_s})


@dataclass(slots=True)
class CaptureReport:
    """`capture.json` in the images, and the capture worker's stdout."""

    boundary: str
    root_pid: int
    tree: list[int]
    rank: int
    world_size: int
    engine: str | None  # the engine's control socket, null when there is none (always present)
    started_unix: float = field(default_factory=time.time)
    cuda_pids: list[int] = field(default_factory=list)
    graph_policy: CapturedGraphPolicy | None = None
    engine_quiesce: dict[str, Any] | None = None  # the engine's own answer to `quiesce`
    hydration: ReleasedWeights | None = None
    device_memory: list[DumpedDevice] | None = None  # the interposer's releases, when a process enabled it
    memory_sources: dict[str, SourceReport] = field(default_factory=dict)  # other memory sources, by name
    memory_before_checkpoint: dict[str, dict[str, Any]] | None = None  # pid -> `anonymous_memory`
    memory_after_checkpoint: dict[str, dict[str, Any]] | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    event_loops: dict[str, str] | None = None  # pid -> "uvloop", for the processes running it (unchanged servers)
    shared_files: list[dict[str, Any]] | None = None  # the tree's /dev/shm files kept with the images (_shm_files)
    cuda_ipc: dict[str, list[int]] | None = None  # the CUDA processes checked for CUDA IPC, and those that could not be
    engine_quiesced: bool = False
    timings_s: dict[str, float] = field(default_factory=dict)  # engine_quiesce, cuda_lock, cuda_checkpoint, criu_dump
    criu_dump_stats: dict[str, float | int | str] | None = None  # CRIU's stats-dump (`_criu_stats.dump_stats`)
    images_filesystem: dict[str, str] | None = None  # `_images_fs.images_filesystem` of the images directory
    barrier_wait_s: dict[str, float] = field(default_factory=dict)
    image_bytes: int = 0
    image_files: int = 0
    image_digest: str | None = None
    completed_unix: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"format": 1, "kind": CAPTURE_KIND, **_present({
            "boundary": self.boundary, "root_pid": self.root_pid, "tree": self.tree, "started_unix": self.started_unix,
            "rank": self.rank, "world_size": self.world_size, "cuda_pids": self.cuda_pids,
            "graph_policy": self.graph_policy.to_json() if self.graph_policy else None,
            "engine_quiesce": self.engine_quiesce,
            "hydration": self.hydration.to_json() if self.hydration else None,
            "device_memory": [d.to_json() for d in self.device_memory] if self.device_memory is not None else None,
            "memory_sources": {n: r.to_json() for n, r in sorted(self.memory_sources.items())} or None,
            "memory_before_checkpoint": self.memory_before_checkpoint,
            "memory_after_checkpoint": self.memory_after_checkpoint, "identity": self.identity,
            "event_loops": self.event_loops, "shared_files": self.shared_files, "cuda_ipc": self.cuda_ipc,
            "engine_quiesced": self.engine_quiesced, "timings_s": self.timings_s,
            "criu_dump_stats": self.criu_dump_stats, "images_filesystem": self.images_filesystem,
            "barrier_wait_s": self.barrier_wait_s,
            "image_bytes": self.image_bytes, "image_files": self.image_files,
            "image_digest": self.image_digest, "completed_unix": self.completed_unix}), "engine": self.engine}


@dataclass(frozen=True, slots=True)
class RestoredGraphPolicy:
    effective: str
    decision: str
    plan_sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"effective": self.effective, "decision": self.decision, "plan_sha256": self.plan_sha256}


@dataclass(frozen=True, slots=True)
class HydratedWeights:
    """The engine's weights back after restore: the engine's own report, and what the worker waited."""

    bytes: int
    seconds: float
    gbps: float
    regions_verified: int
    engine: dict[str, Any]  # the engine's hydration report (strategy, copy_s, verify_s, ...)
    staged: dict[str, Any] | None  # the hydrator's stage answer, null when nothing was staged (always present)
    phase_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                "regions_verified": self.regions_verified, "engine": self.engine, "staged": self.staged,
                "phase_seconds": self.phase_seconds}


@dataclass(slots=True)
class RestoreReport:
    """The restore worker's stdout."""

    rank: int
    world_size: int
    boundary: str | None = None
    captured_root_pid: int | None = None
    cuda_pids: list[int] | None = None
    identity_compatibility: str | None = None
    identity_source: str | None = None  # where the GPU facts checked came from: `procfs` or `nvml`
    graph_policy: RestoredGraphPolicy | None = None
    criu_restore_seconds: float | None = None
    criu_restore_phases: dict[str, float] | None = None  # from CRIU's log (`_criu_restore_log.restore_phases`)
    restored_pid: int | None = None
    peer_criu_restore_seconds: list[Any] | None = None
    cuda_restore_seconds: float | None = None
    peer_cuda_restore_seconds: list[Any] | None = None
    all_pages_in_seconds: float | None = None
    hydration: HydratedWeights | None = None
    device_memory: list[HydratedDevice] | None = None  # the interposer's hydrations, when the capture released any
    device_hydration_seconds: float | None = None  # the worker's whole device hydration phase
    memory_sources: dict[str, SourceReport] = field(default_factory=dict)  # other memory sources, by name
    engine_resume: dict[str, Any] | None = None  # the engine's own answer to `resume`
    communicator_recreate_seconds: float | None = None
    shared_files: list[str] | None = None  # the /dev/shm files put back before CRIU (_shm_files)
    timeline: Timeline = field(default_factory=Timeline)
    barrier_wait_s: dict[str, float] = field(default_factory=dict)
    worker_start: list[Mark] | None = None  # the worker command's steps before `restore_begin` (negative offsets)

    def to_json(self) -> dict[str, Any]:
        t = self.timeline
        return {"format": 1, "kind": RESTORE_KIND, "rank": self.rank, "world_size": self.world_size, **_present({
            "boundary": self.boundary, "captured_root_pid": self.captured_root_pid, "cuda_pids": self.cuda_pids,
            "identity_compatibility": self.identity_compatibility, "identity_source": self.identity_source,
            "graph_policy": self.graph_policy.to_json() if self.graph_policy else None,
            "criu_restore_seconds": self.criu_restore_seconds, "criu_restore_phases": self.criu_restore_phases,
            "restored_pid": self.restored_pid,
            "peer_criu_restore_seconds": self.peer_criu_restore_seconds,
            "cuda_restore_seconds": self.cuda_restore_seconds,
            "peer_cuda_restore_seconds": self.peer_cuda_restore_seconds,
            "all_pages_in_seconds": self.all_pages_in_seconds,
            "hydration": self.hydration.to_json() if self.hydration else None, "engine_resume": self.engine_resume,
            "device_memory": [d.to_json() for d in self.device_memory] if self.device_memory is not None else None,
            "device_hydration_seconds": self.device_hydration_seconds,
            "memory_sources": {n: r.to_json() for n, r in sorted(self.memory_sources.items())} or None,
            "communicator_recreate_seconds": self.communicator_recreate_seconds,
            "shared_files": self.shared_files,
            "worker_start": [m.to_json() for m in self.worker_start] if self.worker_start else None}),
            "timeline": t.to_json(), "barrier_wait_s": self.barrier_wait_s,
            "restore_seconds": t.seconds("restore_begin", "process_resumed"),
            "ready_seconds": t.seconds("restore_begin", "ready")}

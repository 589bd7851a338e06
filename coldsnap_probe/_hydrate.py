"""Weight hydration: an engine's weights leave device memory before capture and come back after restore.

The API (engine side, inside the capsule; standard library + cuda-python)::

    arena = WeightArena(total_bytes)                  # VMM reservation + backing, mapped, exact address
    arena.declare([WeightRegion(name, arena.address + off, size, source_path, source_offset, digest),
                   WeightRegion("kv", arena.address + off2, size2, "", 0, "", policy="discard")])  # optional
    arena.load()                                      # cold start: fill from the sources, verified
    arena.serve(control_socket)                       # a thread the restore worker talks to
    ... build tensors over arena.address, serve; before each request: arena.wait_ready() ...

`region_digest(path, offset, size)` computes a region's digest (``sha256-64m:<hex>``: SHA-256 over
the SHA-256 of each 64 MiB chunk, so it is computed in parallel). The worker side::

    manifest = request(control_socket, {"op": "release", "generation": g})  # before CUDA lock
    ... CUDA checkpoint, CRIU dump; restore ...
    report = request(control_socket, {"op": "hydrate"})                  # after CUDA unlock

A `discard` region (a KV cache, scratch buffers) is released with the weights and comes back zero-filled:
its bytes are in neither the images nor any source (the plan's `kv_cache` layout, spec policy `discard`).

`release` is the fail-before-release gate (memory contracts, `_memory.py`): the regions must lie
inside the reservation without overlapping, every source must hold its region and match its
digest, the checkpoint plan must pass `require_checkpoint_plan`; the layout and the sources are
revalidated just before the backing is unmapped (the reservation is kept, so captured CUDA graphs
stay valid). Any failure raises `HydrationError` naming the region, and nothing was released.
`hydrate` (after restore) checks the manifest against the arena (same plan digest), the sources
against the identities recorded at release (device, inode, size, mtime, ctime; on a mismatch the
content digest decides), and the free device memory; then it maps fresh backing at the same
address, copies, verifies sampled blocks against the source, and only then sets `ready`. On a
failure the backing is released again and the engine stays not ready: nothing half-hydrated serves.

Copy strategies (`strategy=`): ``register`` (the source file is mmapped and page-locked with
`cuMemHostRegister`, copied by DMA on several streams; the pinning is paid at every hydration),
``ring`` (reader threads into a ring of pinned buffers; page cache or disk), ``direct`` (the ring
with O_DIRECT reads), and ``hydrator:<socket>``: a long-lived `HydratorServer` process
(``python -m coldsnap_probe._hydrate serve --socket S FILE...``) keeps the sources page-locked (paid
once, at its start) and writes into the engine's allocation, which the engine exports
(`cuMemExportToShareableHandle`, SCM_RIGHTS); an exported allocation is released before the next
checkpoint anyway (the weights are released before every capture).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import itertools
import json
import mmap
import os
import random
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._memory import (
    MemoryCheckpointPlan,
    MemoryLayoutDescriptor,
    MemoryRegion,
    ProviderCapabilities,
    require_checkpoint_plan,
)
from .canonical import digest
from .errors import CudaError, HydrationError, MemoryCapabilityError

__all__ = (
    "CAPABILITIES",
    "DIGEST_CHUNK",
    "MANIFEST_KIND",
    "PROVIDER",
    "HydrationManifest",
    "HydratorServer",
    "SourceIdentity",
    "Stager",
    "WeightArena",
    "WeightRegion",
    "check_sources",
    "chunk_digests",
    "combine_digests",
    "device_uuid",
    "plan_for",
    "region_digest",
    "request",
    "request_with_fds",
    "validate_regions",
)

DIGEST_CHUNK = 64 << 20
DIGEST_PREFIX = "sha256-64m:"
MANIFEST_KIND = "coldsnap-hydration-manifest"
PROVIDER = "coldsnap-vmm-weights"
COPY_CHUNK = 256 << 20
SAMPLES_PER_REGION = 16
SAMPLE_BYTES = 64 << 10
_REQUEST_MAX = 1 << 20
REGION_POLICIES = ("preserve", "discard")
REQUEST_TIMEOUT = 30.0  # seconds a control or hydrator connection has to send its request
ADOPT_TIMEOUT = 30.0  # seconds an engine waits for the hydrator's adopt answer before hydrating the regular way
STAGE_TTL = 120.0  # seconds a staged allocation waits for its engine before the hydrator frees it
STAGE_MAX = 4  # staged allocations a hydrator holds at once
STAGE_RESERVE = 1 << 30  # device bytes staging leaves free (the engine's restored state needs them)
CAPABILITIES = ProviderCapabilities(
    provider=PROVIDER, tagged_regions=True, stable_virtual_addresses=True, scoped_interception=False,
    allocation_enumeration=True, external_snapshot_store=True, graph_regions=False, per_device_synchronization=True,
    exact_address_reservation=True, page_granular_mapping=True, release_backing_retain_va=True,
    checkpoint_quiescence=True)
_ACTIONS = ("release-backing", "remap-pages")
_HOST_REGISTER_READ_ONLY = 0x08


# ---------------------------------------------------------------------------------------------------------------
# Regions, digests, sources (no CUDA)


@dataclass(frozen=True, slots=True)
class WeightRegion:
    """`size` bytes at virtual `address` come from `source` at `offset`; `digest` is `region_digest` of them.

    Policy `discard` (a KV cache, scratch): released like the weights, but not kept anywhere: it comes back
    zero-filled, with no source, offset 0 and no digest. Its bytes never reach the images either way. Every
    release zeroes it, a release that a failed capture rolls back included: an engine must not keep state that
    points into it (cached prefixes) across a release.
    """

    name: str
    address: int
    size: int
    source: str
    offset: int
    digest: str
    policy: str = "preserve"

    @property
    def preserved(self) -> bool:
        return self.policy == "preserve"

    def to_json(self) -> dict[str, Any]:
        value = dataclasses.asdict(self)
        if self.preserved:  # manifests written before discard regions existed keep their digests
            del value["policy"]
        return value

    @classmethod
    def from_json(cls, value: Any) -> WeightRegion:
        try:
            region = cls(**value)
        except TypeError as exc:
            raise HydrationError(f"malformed weight region: {exc}") from exc
        region.check_types()
        return region

    def check_types(self) -> None:
        """Integers that are not booleans, strings: each field, named when it is not."""
        for name in ("address", "size", "offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise HydrationError(f"{name} must be an integer, got {type(value).__name__}", region=str(self.name))
        for name in ("name", "source", "digest", "policy"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise HydrationError(f"{name} must be a string, got {type(value).__name__}", region=str(self.name))


def chunk_digests(path: str | Path, offset: int, size: int, *, threads: int = 0) -> list[bytes]:
    """SHA-256 of each 64 MiB chunk of the region, computed by parallel threads over a shared mapping."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        have = os.fstat(fd).st_size
        if have < offset + size:
            raise HydrationError(f"source {path} is truncated: {have} bytes, the region needs {offset + size}")
        if size == 0:
            return []
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        view = mmap.mmap(fd, offset + size - base, mmap.MAP_SHARED, mmap.PROT_READ, offset=base)
    finally:
        os.close(fd)
    try:
        memory = memoryview(view)
        end = offset - base + size

        def one(start: int) -> bytes:
            return hashlib.sha256(memory[start:min(start + DIGEST_CHUNK, end)]).digest()

        with ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1)) as pool:
            parts = list(pool.map(one, range(offset - base, end, DIGEST_CHUNK)))
        memory.release()
    finally:
        view.close()
    return parts


def combine_digests(parts: Sequence[bytes]) -> str:
    """The region digest from its chunk digests (so a region that is a 64 MiB-aligned prefix reuses them)."""
    return DIGEST_PREFIX + hashlib.sha256(b"".join(parts)).hexdigest()


def region_digest(path: str | Path, offset: int, size: int, *, threads: int = 0) -> str:
    """``sha256-64m:`` + SHA-256 of the concatenated SHA-256 of each 64 MiB chunk of the region (parallel)."""
    return combine_digests(chunk_digests(path, offset, size, threads=threads))


def validate_regions(regions: Sequence[WeightRegion], reservation_address: int,
                     reservation_size: int) -> tuple[WeightRegion, ...]:
    """Sorted by address; each named once, non-empty, inside the reservation, not overlapping another."""
    if not regions:
        raise HydrationError("no weight regions declared")
    for region in regions:
        region.check_types()
    names = [r.name for r in regions]
    for region in regions:
        if not region.name or any(c.isspace() for c in region.name):
            raise HydrationError(f"region name {region.name!r} must be non-empty without whitespace")
        if names.count(region.name) > 1:
            raise HydrationError("declared more than once", region=region.name)
        if region.size <= 0 or region.offset < 0 or region.address < 0:
            raise HydrationError(f"size must be > 0 and address, offset >= 0 (size {region.size}, "
                                 f"offset {region.offset})", region=region.name)
        if region.policy not in REGION_POLICIES:
            raise HydrationError(f"policy {region.policy!r} must be one of {', '.join(REGION_POLICIES)}",
                                 region=region.name)
        if not region.preserved:
            for field in ("source", "offset", "digest"):
                if getattr(region, field):
                    raise HydrationError(f"{field} must be empty for a discard region, got "
                                         f"{getattr(region, field)!r}", region=region.name)
        elif not region.source:
            raise HydrationError("names no source file", region=region.name)
        elif not region.digest.startswith(DIGEST_PREFIX) or len(region.digest) != len(DIGEST_PREFIX) + 64:
            raise HydrationError(f"digest must be {DIGEST_PREFIX}<64 hex digits>", region=region.name)
        end, limit = region.address + region.size, reservation_address + reservation_size
        if region.address < reservation_address or end > limit:
            raise HydrationError(f"[{region.address:#x}, {end:#x}) exceeds the reservation "
                                 f"[{reservation_address:#x}, {limit:#x})", region=region.name)
    if not any(r.preserved for r in regions):
        raise HydrationError("no weight region declared: every region is discarded")
    ordered = tuple(sorted(regions, key=lambda r: r.address))
    for before, after in itertools.pairwise(ordered):
        if before.address + before.size > after.address:
            raise HydrationError(f"overlaps region {before.name} at {after.address:#x}", region=after.name)
    return ordered


@dataclass(frozen=True, slots=True)
class SourceIdentity:
    """What a write, truncation or replacement of a source file changes."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str) -> SourceIdentity:
        try:
            st = os.stat(path)
        except OSError as exc:
            raise HydrationError(f"source {path} cannot be read: {exc.strerror}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise HydrationError(f"source {path} is not a regular file")
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_sources(regions: Sequence[WeightRegion], recorded: dict[str, SourceIdentity] | None = None, *,
                  content: bool = False) -> dict[str, SourceIdentity]:
    """Every source exists and holds its region; the digest is checked when `content` or the identity changed.

    Returns the sources' identities now. Raises HydrationError naming the first region at fault.
    """
    now: dict[str, SourceIdentity] = {}
    for region in (r for r in regions if r.preserved):
        try:
            identity = now[region.source] if region.source in now else SourceIdentity.of(region.source)
        except HydrationError as exc:
            raise HydrationError(str(exc), region=region.name) from exc
        now[region.source] = identity
        if identity.size < region.offset + region.size:
            raise HydrationError(f"source {region.source} is truncated: {identity.size} bytes, the region needs "
                                 f"{region.offset + region.size}", region=region.name)
        changed = recorded is not None and recorded.get(region.source) != identity
        if content or changed:
            actual = region_digest(region.source, region.offset, region.size)
            if actual != region.digest:
                raise HydrationError(f"source {region.source} does not match the digest: expected "
                                     f"{region.digest}, found {actual}", region=region.name)
    return now


def plan_for(regions: Sequence[WeightRegion], *, address: int, size: int, granularity: int, generation: str,
             owner: str = "engine") -> tuple[MemoryLayoutDescriptor, MemoryCheckpointPlan]:
    """The `weights` layout (one extent per preserved region; the `kv_cache` layout holds the discarded ones)
    and the release/remap checkpoint plan over both."""
    ordered = validate_regions(regions, address, size)

    def layout_of(region: MemoryRegion, members: list[WeightRegion]) -> MemoryLayoutDescriptor:
        return MemoryLayoutDescriptor.create(
            provider=PROVIDER, provider_abi=1, region=region, device="cuda:0", base_address=address,
            logical_bytes=sum(r.size for r in members), allocation_granularity=granularity, mapping_granularity=size,
            layout_kind="contiguous" if len(members) == 1 else "per-layer", groups=tuple(r.name for r in members),
            extent_count=len(members), extension={"reservation_bytes": size, "regions": [r.to_json() for r in members]})

    layout = layout_of(MemoryRegion("weights", "preserve"), [r for r in ordered if r.preserved])
    discarded = [r for r in ordered if not r.preserved]
    layouts = [layout, *([layout_of(MemoryRegion("kv_cache", "discard"), discarded)] if discarded else [])]

    def prepare(resolved: tuple[MemoryRegion, ...], gen: str) -> MemoryCheckpointPlan:
        return MemoryCheckpointPlan.create(
            layouts=layouts, generation=gen, owner=owner, provider=PROVIDER, provider_abi=1, actions=_ACTIONS,
            mapped_bytes_before=size, mapped_bytes_after=0, reserved_bytes_before=size, reserved_bytes_after=size,
            participants=(owner,), quiescence_evidence="cuCtxSynchronize", terminal_on_failure=False,
            abort_safe=True)

    try:
        plan = require_checkpoint_plan(CAPABILITIES, prepare, [x.region.name for x in layouts], generation)
    except MemoryCapabilityError as exc:
        raise HydrationError(f"the checkpoint plan is refused: {exc}") from exc
    return layout, plan


@dataclass(frozen=True, slots=True)
class HydrationManifest:
    """What was released, so that restore can put it back: regions, sources, layout and plan, digested."""

    generation: str
    device: int
    reservation_address: int
    reservation_size: int
    granularity: int
    regions: tuple[WeightRegion, ...]
    sources: tuple[SourceIdentity, ...]
    layout: MemoryLayoutDescriptor
    plan: MemoryCheckpointPlan
    control: str = ""
    hydrator: str = ""  # the long-lived hydrator the engine hydrates through, if any: restore stages there early
    manifest_digest: str = ""
    format: int = 1

    def _body(self) -> dict[str, Any]:
        return {"format": self.format, "kind": MANIFEST_KIND, "generation": self.generation, "device": self.device,
                "reservation_address": self.reservation_address, "reservation_size": self.reservation_size,
                "granularity": self.granularity, "regions": [r.to_json() for r in self.regions],
                "sources": [s.to_json() for s in self.sources], "layout": self.layout.to_json(),
                "plan": self.plan.to_json(), "control": self.control,
                **({"hydrator": self.hydrator} if self.hydrator else {})}

    def stage_request(self, op: str, **extra: Any) -> dict[str, Any]:
        """A hydrator request about this manifest's allocation (`stage`, `adopt`, `discard`), keyed by its digest.
        Only the preserved regions travel: the hydrator has nothing to copy for a discarded one."""
        return {"op": op, "key": self.manifest_digest, "base": self.reservation_address,
                "size": self.reservation_size, "regions": [r.to_json() for r in self.regions if r.preserved],
                **extra}

    def to_json(self) -> dict[str, Any]:
        return {**self._body(), "manifest_digest": self.manifest_digest}

    @classmethod
    def create(cls, **fields: Any) -> HydrationManifest:
        draft = cls(**fields)
        return dataclasses.replace(draft, manifest_digest=digest(draft._body()))

    @classmethod
    def from_json(cls, value: Any) -> HydrationManifest:
        """Decode and check everything: kind, digest, regions in the reservation, layout and plan recompute."""
        try:
            if value.get("kind") != MANIFEST_KIND or value.get("format") != 1:
                raise HydrationError(f"not a format-1 {MANIFEST_KIND}")
            manifest = cls(
                generation=str(value["generation"]), device=int(value["device"]),
                reservation_address=int(value["reservation_address"]),
                reservation_size=int(value["reservation_size"]), granularity=int(value["granularity"]),
                regions=tuple(WeightRegion.from_json(r) for r in value["regions"]),
                sources=tuple(SourceIdentity(**s) for s in value["sources"]),
                layout=MemoryLayoutDescriptor.from_json(value["layout"]),
                plan=MemoryCheckpointPlan.from_json(value["plan"]), control=str(value.get("control", "")),
                hydrator=str(value.get("hydrator", "")), manifest_digest=str(value["manifest_digest"]))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise HydrationError(f"malformed hydration manifest: {type(exc).__name__}: {exc}") from exc
        except MemoryCapabilityError as exc:
            raise HydrationError(f"hydration manifest: {exc}") from exc
        if manifest.manifest_digest != digest(manifest._body()):
            raise HydrationError("hydration manifest digest does not recompute")
        layout, plan = plan_for(manifest.regions, address=manifest.reservation_address,
                                size=manifest.reservation_size, granularity=manifest.granularity,
                                generation=manifest.generation, owner=manifest.plan.owner)
        if layout.layout_digest != manifest.layout.layout_digest or plan.plan_digest != manifest.plan.plan_digest:
            raise HydrationError("hydration manifest layout or plan does not match its regions")
        return manifest

    @property
    def identities(self) -> dict[str, SourceIdentity]:
        return {s.path: s for s in self.sources}


# ---------------------------------------------------------------------------------------------------------------
# CUDA (cuda-python through coldsnap_probe._cuda.Driver)


def _ok(driver: Any, name: str, result: Any) -> Any:
    """The binding's (err, *outputs) to outputs, or CudaError (the same text as Driver.call)."""
    err, *outputs = result
    if int(err) != 0:
        error_name, error_string = driver._error_text(err)
        raise CudaError(name, error_name, error_string)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _cu(driver: Any, name: str, *args: Any) -> Any:
    return _ok(driver, name, getattr(driver.cuda, name)(*args))


def _fd_handle(driver: Any) -> Any:
    """The POSIX file-descriptor handle type: how allocations travel between processes here."""
    return driver.cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _device_allocation(driver: Any, device: int, *, exportable: bool) -> Any:
    """Properties of a pinned device allocation on `device` (exportable: as a file descriptor)."""
    cu = driver.cuda
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if exportable:
        prop.requestedHandleTypes = _fd_handle(driver)
    return prop


def _map_read_write(driver: Any, address: int, size: int, device: int) -> None:
    """Give `device` read-write access to the mapped range."""
    cu = driver.cuda
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _cu(driver, "cuMemSetAccess", address, size, [access], 1)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = 0x8000


class _Mapped:
    """A read-only shared mapping of a whole file (address stable for cuMemHostRegister), optionally page-locked."""

    def __init__(self, path: str, *, populate: bool = True) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
            address = _libc.mmap(None, self.size, mmap.PROT_READ, flags, fd, 0)
        finally:
            os.close(fd)
        if address in (None, _MAP_FAILED):
            raise HydrationError(f"cannot map source {path}: {os.strerror(ctypes.get_errno())}")
        self.path, self.address, self.registered = path, int(address), False

    def register(self, driver: Any) -> None:
        try:
            _cu(driver, "cuMemHostRegister", self.address, self.size, _HOST_REGISTER_READ_ONLY)
        except CudaError:  # drivers without read-only registration
            _cu(driver, "cuMemHostRegister", self.address, self.size, 0)
        self.registered = True

    def close(self, driver: Any) -> None:
        if self.registered:
            _ok(driver, "cuMemHostUnregister", driver.cuda.cuMemHostUnregister(self.address))
            self.registered = False
        _libc.munmap(self.address, self.size)


def _copy_registered(driver: Any, jobs: Sequence[tuple[int, int, int]], streams: Sequence[Any]) -> None:
    """(device address, host address, bytes) jobs in COPY_CHUNK pieces, round-robin over the streams."""
    index = 0
    for dst, src, size in jobs:
        for start in range(0, size, COPY_CHUNK):
            n = min(COPY_CHUNK, size - start)
            _cu(driver, "cuMemcpyHtoDAsync", dst + start, src + start, n, streams[index % len(streams)])
            index += 1
    for stream in streams:
        _cu(driver, "cuStreamSynchronize", stream)


def _copy_ring(driver: Any, context: Any, regions: Sequence[WeightRegion], dst_of: Callable[[WeightRegion], int],
               *, threads: int, chunk: int, direct: bool) -> dict[str, float]:
    """Reader threads, each with two pinned buffers and a stream: pread (O_DIRECT when `direct`), then H2D."""
    align = 4096 if direct else 1
    pieces = [(dst_of(r) + s, r.source, r.offset + s, min(chunk, r.size - s))
              for r in regions for s in range(0, r.size, chunk)]
    fds = {src: os.open(src, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
           for src in {r.source for r in regions}}
    pin_seconds = [0.0] * threads

    def work(worker: int) -> None:
        _cu(driver, "cuCtxSetCurrent", context)
        started = time.perf_counter()
        stream = _cu(driver, "cuStreamCreate", 1)
        size = chunk + 2 * align
        buffers = [int(_cu(driver, "cuMemHostAlloc", size, 0)) for _ in range(2)]
        events = [_cu(driver, "cuEventCreate", 2) for _ in range(2)]
        pin_seconds[worker] = time.perf_counter() - started
        try:
            for k, (dst, src, offset, n) in enumerate(pieces[worker::threads]):
                slot = k % 2
                if k >= 2:
                    _cu(driver, "cuEventSynchronize", events[slot])
                first = offset - offset % align
                length = -(-(offset + n - first) // align) * align
                view = memoryview((ctypes.c_char * size).from_address(buffers[slot])).cast("B")
                got = os.preadv(fds[src], [view[:length]], first)
                view.release()
                if got < offset - first + n:
                    raise HydrationError(f"source {src} ended at {first + got} while reading {offset + n}")
                _cu(driver, "cuMemcpyHtoDAsync", dst, buffers[slot] + (offset - first), n, stream)
                _cu(driver, "cuEventRecord", events[slot], stream)
            _cu(driver, "cuStreamSynchronize", stream)
        finally:
            for event in events:
                driver.cuda.cuEventDestroy(event)
            for buffer in buffers:
                driver.cuda.cuMemFreeHost(buffer)
            driver.cuda.cuStreamDestroy(stream)

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"pin_s": max(pin_seconds)}


class WeightArena:
    """A VMM reservation for an engine's weights whose backing can be released and re-created in place."""

    def __init__(self, size: int, *, device: int = 0, exportable: bool = False, streams: int = 4,
                 driver: Any = None) -> None:
        from ._cuda import Driver

        self.driver: Any = driver or Driver()
        self.driver.context(device)
        cu = self.driver.cuda
        self.context = _cu(self.driver, "cuCtxGetCurrent")
        self.device, self.exportable = device, exportable
        self._prop = _device_allocation(self.driver, device, exportable=exportable)
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(_cu(self.driver, "cuMemGetAllocationGranularity", self._prop, flag))
        self.size = -(-size // self.granularity) * self.granularity
        self.address = int(_cu(self.driver, "cuMemAddressReserve", self.size, 0, 0, 0))
        self._handle: Any = None
        self._streams = [_cu(self.driver, "cuStreamCreate", 1) for _ in range(streams)]
        self.regions: tuple[WeightRegion, ...] = ()
        self.manifest: HydrationManifest | None = None
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self.strategy = "register"  # the restore worker's hydrations use the strategy given to serve()
        self.adopt_refusal = ""  # why the last restore found nothing staged to adopt
        self.last_report: dict[str, Any] = {}
        self._map()

    # -- backing ---------------------------------------------------------------------------------------------
    def _map(self, handle: Any = None) -> None:
        """Back the reservation with `handle` (an imported allocation) or a new allocation."""
        cu = self.driver.cuda
        self._handle = handle if handle is not None else _cu(self.driver, "cuMemCreate", self.size, self._prop, 0)
        try:
            _cu(self.driver, "cuMemMap", self.address, self.size, 0, self._handle, 0)
        except BaseException:
            cu.cuMemRelease(self._handle)
            self._handle = None
            raise
        try:
            _map_read_write(self.driver, self.address, self.size, self.device)
        except BaseException:
            self._unmap()
            raise

    def _unmap(self) -> None:
        if self._handle is None:
            return
        _cu(self.driver, "cuCtxSynchronize")
        _cu(self.driver, "cuMemUnmap", self.address, self.size)
        _cu(self.driver, "cuMemRelease", self._handle)
        self._handle = None

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    # -- engine API -------------------------------------------------------------------------------------------
    def declare(self, regions: Sequence[WeightRegion]) -> None:
        """Record the weight regions (checked against the reservation; the sources are checked at use)."""
        self.regions = validate_regions(regions, self.address, self.size)

    def load(self, *, strategy: str = "register") -> dict[str, Any]:
        """Cold start: fill the mapped backing from the sources (digests checked), verify, set `ready`."""
        with self._lock:
            if not self.regions:
                raise HydrationError("declare the weight regions before loading them")
            started = time.perf_counter()
            check_sources(self.regions, content=True)
            report = {"digest_s": time.perf_counter() - started, **self._fill(strategy)}
            self.ready.set()
            self.last_report = report
            return report

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the weights are hydrated and verified (engines call this before serving a request)."""
        return self.ready.wait(timeout)

    def release(self, generation: str, *, owner: str = "engine", content: bool = True) -> HydrationManifest:
        """Before capture: the fail-before-release gate, revalidation, then unmap (the reservation is kept)."""
        with self._lock:
            if not self.mapped:
                raise HydrationError("the weights are already released")
            if not self.regions:
                raise HydrationError("no weight regions declared: nothing to release")
            layout, plan = plan_for(self.regions, address=self.address, size=self.size,
                                    granularity=self.granularity, generation=generation, owner=owner)
            identities = check_sources(self.regions, content=content)
            manifest = HydrationManifest.create(
                generation=generation, device=self.device, reservation_address=self.address,
                reservation_size=self.size, granularity=self.granularity, regions=self.regions,
                sources=tuple(identities[s] for s in sorted(identities)), layout=layout, plan=plan,
                control=self._control.getsockname() if self._control else "",
                hydrator=self.strategy.split(":", 1)[1] if self.strategy.startswith("hydrator:") else "")
            # Revalidation before commit: the layouts and plan recompute and no source changed since the gate.
            _, again = plan_for(self.regions, address=self.address, size=self.size, granularity=self.granularity,
                                generation=generation, owner=owner)
            if again.plan_digest != plan.plan_digest:
                raise HydrationError("the weight layout changed during the release")
            check_sources(self.regions, identities)
            self.ready.clear()
            try:
                self._unmap()
            except BaseException:
                self.ready.set()  # nothing was released: keep serving
                raise
            self.manifest = manifest
            return manifest

    def restore(self, manifest: HydrationManifest | None = None, *, strategy: str = "register") -> dict[str, Any]:
        """After restore: check, map at the same address, hydrate, verify, then set `ready`."""
        with self._lock:
            manifest = manifest or self.manifest
            if manifest is None:
                raise HydrationError("no hydration manifest: the weights were never released")
            if self.mapped:
                raise HydrationError("the weights are mapped: release them first")
            started = time.perf_counter()
            if (manifest.reservation_address, manifest.reservation_size) != (self.address, self.size):
                raise HydrationError(f"the manifest's reservation [{manifest.reservation_address:#x}, +"
                                     f"{manifest.reservation_size}) is not this arena's [{self.address:#x}, "
                                     f"+{self.size})")
            _, plan = plan_for(manifest.regions, address=self.address, size=self.size,
                               granularity=self.granularity, generation=manifest.generation,
                               owner=manifest.plan.owner)
            if plan.plan_digest != manifest.plan.plan_digest:
                raise HydrationError("the weight layout changed since the release")
            check_sources(manifest.regions, manifest.identities)
            _cu(self.driver, "cuCtxSetCurrent", self.context)
            checked = time.perf_counter()
            self.regions = manifest.regions
            self.adopt_refusal = ""
            adopted = self._adopt(strategy.split(":", 1)[1], manifest) if strategy.startswith("hydrator:") else None
            if adopted is None:
                free, _total = _cu(self.driver, "cuMemGetInfo")
                if int(free) < self.size:
                    raise HydrationError(f"the GPU has {int(free)} bytes free, hydration needs {self.size}")
                self._map()
            try:
                report = self._fill(strategy) if adopted is None else self._verified(adopted)
            except BaseException:
                self._unmap()  # nothing half-hydrated stays mapped, and `ready` stays clear
                raise
            if adopted is None and strategy.startswith("hydrator:"):
                report["staged"], report["adopt_refusal"] = False, self.adopt_refusal
            report["check_s"] = checked - started
            report["total_s"] = time.perf_counter() - started
            self.ready.set()
            self.last_report = report
            return report

    @property
    def _preserved(self) -> tuple[WeightRegion, ...]:
        return tuple(r for r in self.regions if r.preserved)

    def _zero_discarded(self) -> dict[str, Any]:
        """Discarded regions come back zero-filled (whatever a fresh or staged allocation held there)."""
        discarded = [r for r in self.regions if not r.preserved]
        for region in discarded:
            _cu(self.driver, "cuMemsetD8Async", region.address, 0, region.size, self._streams[0])
        _cu(self.driver, "cuStreamSynchronize", self._streams[0])
        return {"discarded_regions": len(discarded), "zeroed_bytes": sum(r.size for r in discarded)}

    def _fill(self, strategy: str) -> dict[str, Any]:
        """Copy every preserved region in (the backing is mapped), zero the discarded ones, then verify sampled
        blocks; a report."""
        _cu(self.driver, "cuCtxSetCurrent", self.context)
        regions = self._preserved
        total = sum(r.size for r in regions)
        report: dict[str, Any] = {"strategy": strategy, "bytes": total, "regions": len(regions)}
        started = time.perf_counter()
        if strategy == "register":
            mapped: dict[str, _Mapped] = {}
            try:
                for source in sorted({r.source for r in regions}):
                    mapped[source] = _Mapped(source)
                report["map_s"] = time.perf_counter() - started
                for m in mapped.values():
                    m.register(self.driver)
                report["pin_s"] = time.perf_counter() - started - report["map_s"]
                copy_started = time.perf_counter()
                _copy_registered(self.driver, [(r.address, mapped[r.source].address + r.offset, r.size)
                                               for r in regions], self._streams)
                report["copy_s"] = time.perf_counter() - copy_started
            finally:
                for m in mapped.values():
                    m.close(self.driver)
        elif strategy in ("ring", "direct"):
            report.update(_copy_ring(self.driver, self.context, regions, lambda r: r.address, threads=8,
                                     chunk=64 << 20, direct=strategy == "direct"))
        elif strategy.startswith("hydrator:"):
            report.update(self._via_hydrator(strategy.split(":", 1)[1]))
        else:
            raise HydrationError(f"unknown hydration strategy {strategy!r}")
        report["seconds"] = time.perf_counter() - started
        report["gbps"] = total / report["seconds"] / 1e9 if report["seconds"] > 0 else 0.0
        report.update(self._zero_discarded())
        verify_started = time.perf_counter()
        report["verified_regions"] = self._verify()
        report["verify_s"] = time.perf_counter() - verify_started
        return report

    def _adopt(self, path: str, manifest: HydrationManifest) -> dict[str, Any] | None:
        """Map the allocation the hydrator staged for `manifest` (filled while this process was being restored)
        at the reservation; None when nothing was staged (the regular hydration runs then)."""
        started = time.perf_counter()
        try:
            answer, fds = request_with_fds(path, manifest.stage_request("adopt"), timeout=ADOPT_TIMEOUT)
        except HydrationError as exc:  # the regular hydration reports the hydrator's state itself
            self.adopt_refusal = str(exc)
            return None
        if not answer.get("ok") or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.adopt_refusal = str(answer.get("error") or "no descriptor")
            return None
        try:
            self._map(_cu(self.driver, "cuMemImportFromShareableHandle", fds[0], _fd_handle(self.driver)))
        except CudaError as exc:  # the regular hydration still can
            self.adopt_refusal = str(exc)
            return None
        finally:
            os.close(fds[0])
        return {"strategy": f"hydrator-staged:{path}", "stage_s": answer.get("stage_s"),
                "copy_s": answer.get("copy_s"), "adopt_s": time.perf_counter() - started}

    def _verified(self, adopted: dict[str, Any]) -> dict[str, Any]:
        """The report of an adopted allocation: its copy ran in the hydrator, here only the verification.
        `seconds` is the adoption (what the restore waited for); `gbps` is the staged copy's rate."""
        total = sum(r.size for r in self._preserved)
        zeroed = self._zero_discarded()
        verify_started = time.perf_counter()
        verified = self._verify()
        copy_s = float(adopted.get("copy_s") or 0.0)
        return {**adopted, **zeroed, "bytes": total, "regions": len(self._preserved), "staged": True,
                "seconds": adopted["adopt_s"], "gbps": total / copy_s / 1e9 if copy_s > 0 else 0.0,
                "verified_regions": verified, "verify_s": time.perf_counter() - verify_started}

    def _via_hydrator(self, path: str) -> dict[str, Any]:
        if not self.exportable:
            raise HydrationError("the hydrator strategy needs WeightArena(exportable=True)")
        fd = int(_cu(self.driver, "cuMemExportToShareableHandle", self._handle, _fd_handle(self.driver), 0))
        try:
            answer = request(path, {"op": "hydrate", "base": self.address, "size": self.size,
                                    "regions": [r.to_json() for r in self._preserved]}, fds=[fd], timeout=600.0)
        finally:
            os.close(fd)
        if not answer.get("ok"):
            raise HydrationError(f"the hydrator refused: {answer.get('error')}")
        return {k: v for k, v in answer.items() if k.endswith("_s")}

    def _verify(self) -> int:
        """Read back sampled blocks of every region (first, last and random ones) and compare with the source."""
        rng = random.Random(os.urandom(16))
        buffer = ctypes.create_string_buffer(SAMPLE_BYTES)
        for region in self._preserved:
            span = min(SAMPLE_BYTES, region.size)
            starts = {0, region.size - span, *(rng.randrange(0, region.size - span + 1)
                                              for _ in range(SAMPLES_PER_REGION - 2))}
            fd = os.open(region.source, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for start in sorted(starts):
                    _cu(self.driver, "cuMemcpyDtoH", ctypes.addressof(buffer), region.address + start, span)
                    expected = os.pread(fd, span, region.offset + start)
                    if buffer.raw[:span] != expected:
                        raise HydrationError(f"device bytes at +{start:#x} differ from the source after hydration",
                                             region=region.name)
            finally:
                os.close(fd)
        return len(self._preserved)

    # -- the restore worker's channel -------------------------------------------------------------------------
    def serve(self, path: str | Path, *, strategy: str = "register") -> None:
        """Listen on a Unix socket for the worker's `release` / `hydrate` / `status` (one thread, one at a time).

        Each connection carries one JSON line and gets one JSON line back; then the engine closes it (so no
        connection is open when CRIU dumps the process).
        """
        path = str(path)
        if os.path.lexists(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen()
        self._control = listener
        self.strategy = strategy
        thread = threading.Thread(target=self._serve_loop, args=(listener, strategy), name="coldsnap-hydration",
                                  daemon=True)
        thread.start()

    def _serve_loop(self, listener: socket.socket, strategy: str) -> None:
        _cu(self.driver, "cuCtxSetCurrent", self.context)
        _answer_each(listener, lambda conn: self._handle_request(json.loads(_read_line(conn)), strategy))

    def _handle_request(self, message: Any, strategy: str) -> dict[str, Any]:
        op = message.get("op") if isinstance(message, dict) else None
        if op == "release":
            manifest = self.release(str(message.get("generation") or ""), owner=str(message.get("owner", "engine")))
            return {"ok": True, "manifest": manifest.to_json()}
        if op == "hydrate":
            given = message.get("manifest")
            chosen = HydrationManifest.from_json(given) if given is not None else None
            return {"ok": True, "report": self.restore(chosen, strategy=str(message.get("strategy", strategy)))}
        if op == "status":
            return {"ok": True, "mapped": self.mapped, "ready": self.ready.is_set()}
        raise HydrationError(f"unknown request {op!r}")


Answer = dict[str, Any] | tuple[dict[str, Any], list[int]]  # a JSON answer, or one with descriptors to pass


def _answer_each(listener: socket.socket, answer: Callable[[socket.socket], Answer], *,
                 idle: Callable[[], None] | None = None, idle_every: float = 1.0,
                 request_timeout: float = REQUEST_TIMEOUT) -> None:
    """Serve connections one at a time: one request, one JSON line back (an error as `ok: false`), then close.
    An asker that goes silent is dropped after `request_timeout`; `idle` runs between connections."""
    listener.settimeout(idle_every if idle else None)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if idle:
                idle()
            continue
        with conn:
            conn.settimeout(request_timeout)  # the whole request, see _read_line
            fds: list[int] = []
            try:
                reply = answer(conn)
                if isinstance(reply, tuple):
                    reply, fds = reply
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                _send(conn, json.dumps(reply).encode() + b"\n", fds)
            except OSError:
                pass  # the asker left; the next one is served
            finally:
                for fd in fds:
                    os.close(fd)
        if idle:
            idle()


def _read_line(conn: socket.socket, data: bytes = b"") -> bytes:
    """One request line (after `data`, already read): within the connection's timeout as a whole, so that an
    asker trickling bytes cannot hold the (single-threaded) server longer than a silent one."""
    deadline = time.monotonic() + (conn.gettimeout() or REQUEST_TIMEOUT)
    while not data.endswith(b"\n"):
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        part = conn.recv(65536)
        if not part:
            break
        data += part
        if len(data) > _REQUEST_MAX:
            raise HydrationError("request too long")
    return data


def _send(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    """All of `payload`, the descriptors with its first bytes (one sendmsg may send only part)."""
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else 0
    sock.sendall(payload[sent:])


def request(path: str | Path, message: dict[str, Any], *, fds: Sequence[int] = (),
            timeout: float = 300.0) -> dict[str, Any]:
    """One JSON request to an engine's control socket or a hydrator; its JSON answer (read to EOF)."""
    answer, received = request_with_fds(path, message, fds=fds, timeout=timeout)
    for fd in received:
        os.close(fd)
    return answer


def request_with_fds(path: str | Path, message: dict[str, Any], *, fds: Sequence[int] = (),
                     timeout: float = 300.0) -> tuple[dict[str, Any], list[int]]:
    """`request`, also returning the descriptors the answer carried (the caller closes them)."""
    received: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            _send(sock, json.dumps(message).encode() + b"\n", fds)
            data = b""
            while True:
                part, more, _flags, _addr = socket.recv_fds(sock, 1 << 20, 4)
                received += more
                if not part:
                    break
                data += part
        except OSError as exc:
            for fd in received:
                os.close(fd)
            raise HydrationError(f"hydration channel {path}: {exc}") from exc
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        for fd in received:
            os.close(fd)
        raise HydrationError(f"hydration channel {path} answered {data[:200]!r}")
    return answer, received


# ---------------------------------------------------------------------------------------------------------------
# The long-lived hydrator


@dataclass
class _Staged:
    """An allocation the hydrator filled ahead of its engine's restore (see HydratorServer)."""

    handle: Any
    base: int
    size: int
    regions: tuple[WeightRegion, ...]
    stage_s: float
    copy_s: float
    expires: float


class HydratorServer:
    """Keeps source files page-locked (paid once) and copies them into engines' weight allocations.

    Requests (one JSON line each, on its socket): `hydrate` carries an engine's exported allocation and fills it;
    `stage` (from a restore worker, before its CRIU restore; only with `staging`, see `serve --staging`)
    allocates and fills one on the hydrator's GPU while the engine is still being restored, kept under the
    manifest's digest for `stage_ttl` seconds (at most STAGE_MAX at once, never leaving less than STAGE_RESERVE
    free); `adopt` (from the restored engine) hands that allocation over as a descriptor, so the engine only
    maps it; `discard` frees one that will not be adopted; `status` lists what is staged.
    """

    def __init__(self, sources: Sequence[str], *, streams: int = 4, driver: Any = None,
                 stage_ttl: float = STAGE_TTL, staging: bool = False) -> None:
        from ._cuda import Driver

        self.driver: Any = driver or Driver()
        self.driver.context()
        self.context = _cu(self.driver, "cuCtxGetCurrent")
        self.device_uuid = device_uuid(self.driver, 0)
        started = time.perf_counter()
        self.sources: dict[str, _Mapped] = {}
        for source in sources:
            self.sources[os.path.realpath(source)] = _Mapped(source)
        self.map_seconds = time.perf_counter() - started
        for m in self.sources.values():
            m.register(self.driver)
        self.pin_seconds = time.perf_counter() - started - self.map_seconds
        self._streams = [_cu(self.driver, "cuStreamCreate", 1) for _ in range(streams)]
        if stage_ttl <= 0:
            raise HydrationError(f"stage_ttl must be positive, not {stage_ttl}")
        self.staged: dict[str, _Staged] = {}
        self.stage_ttl, self.staging = stage_ttl, staging

    def serve(self, path: str) -> None:
        if os.path.lexists(path):
            os.unlink(path)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(path)
            listener.listen()
            sys.stdout.write(json.dumps({"ready": True, "map_s": self.map_seconds, "pin_s": self.pin_seconds,
                                         "bytes": sum(m.size for m in self.sources.values()),
                                         "device_uuid": self.device_uuid}) + "\n")
            sys.stdout.flush()
            _answer_each(listener, self._one, idle=self._expire)

    def _one(self, conn: socket.socket) -> Answer:
        data, fds, _flags, _addr = socket.recv_fds(conn, _REQUEST_MAX, 1)
        try:
            message = json.loads(_read_line(conn, data))
            op = message.get("op", "hydrate") if isinstance(message, dict) else None
            if op != "hydrate" and fds:
                raise HydrationError(f"a {op} request carries no descriptor")
            if op == "hydrate":
                if len(fds) != 1:
                    raise HydrationError("a hydrate request carries exactly one allocation descriptor")
                return self._hydrate(message, fds[0])
            if op == "stage":
                return self._stage(message)
            if op == "adopt":
                return self._adopt(message)
            if op == "discard":
                return {"ok": True, "discarded": self._discard(_stage_key(message))}
            if op == "status":
                now = time.monotonic()
                return {"ok": True, "device_uuid": self.device_uuid, "staged": [
                    {"key": k, "bytes": v.size, "expires_in_s": v.expires - now} for k, v in self.staged.items()]}
            raise HydrationError(f"unknown request {op!r}")
        finally:
            for fd in fds:
                os.close(fd)

    def _jobs(self, message: dict[str, Any]) -> tuple[int, int, tuple[WeightRegion, ...], list[tuple[int, int, int]]]:
        """The request's reservation and regions (validated), and (offset, pinned source address, bytes) copies."""
        try:
            base, size = int(message["base"]), int(message["size"])
            regions = validate_regions([WeightRegion.from_json(r) for r in message["regions"]], base, size)
        except (KeyError, TypeError, ValueError) as exc:
            raise HydrationError(f"malformed request: {type(exc).__name__}: {exc}") from exc
        jobs = []
        for region in (r for r in regions if r.preserved):  # discarded regions: the engine zeroes them
            src = self.sources.get(os.path.realpath(region.source))
            if src is None or src.size < region.offset + region.size:
                raise HydrationError(f"this hydrator does not hold {region.source}", region=region.name)
            jobs.append((region.address - base, src.address + region.offset, region.size))
        return base, size, regions, jobs

    def _fill(self, handle: Any, size: int, jobs: Sequence[tuple[int, int, int]]) -> float:
        """Map `handle` here, copy the jobs into it from the pinned sources, unmap; the copy's seconds."""
        cu, d = self.driver.cuda, self.driver
        va = 0
        try:
            va = int(_cu(d, "cuMemAddressReserve", size, 0, 0, 0))
            _cu(d, "cuMemMap", va, size, 0, handle, 0)
            _map_read_write(d, va, size, 0)
            started = time.perf_counter()
            _copy_registered(d, [(va + off, src, n) for off, src, n in jobs], self._streams)
            return time.perf_counter() - started
        finally:
            if va:
                cu.cuMemUnmap(va, size)
                cu.cuMemAddressFree(va, size)

    def _hydrate(self, message: dict[str, Any], fd: int) -> dict[str, Any]:
        """Fill an engine's exported allocation. The descriptor is the caller's to close: while it is open, it
        keeps the engine's allocation alive, even after the engine released it."""
        _base, size, _regions, jobs = self._jobs(message)
        started = time.perf_counter()
        handle = _cu(self.driver, "cuMemImportFromShareableHandle", fd, _fd_handle(self.driver))
        try:
            copy_s = self._fill(handle, size, jobs)
        finally:
            self.driver.cuda.cuMemRelease(handle)
        return {"ok": True, "import_map_s": time.perf_counter() - started - copy_s, "copy_s": copy_s,
                "bytes": sum(n for _, _, n in jobs)}

    def _stage(self, message: dict[str, Any]) -> dict[str, Any]:
        """Allocate and fill ahead of the engine's restore; refused for an engine on another GPU."""
        if not self.staging:
            raise HydrationError("staging is off on this hydrator (serve --staging)")
        key = _stage_key(message)
        if message.get("device_uuid") != self.device_uuid:
            raise HydrationError(f"the engine's GPU {message.get('device_uuid')} is not this hydrator's "
                                 f"{self.device_uuid}")
        base, size, regions, jobs = self._jobs(message)
        self._discard(key)
        self._expire()
        if len(self.staged) >= STAGE_MAX:
            raise HydrationError(f"{len(self.staged)} allocations are staged already (at most {STAGE_MAX})")
        free, _total = _cu(self.driver, "cuMemGetInfo")
        if int(free) - size < STAGE_RESERVE:
            raise HydrationError(f"staging {size} bytes would leave {int(free) - size} of the GPU's {int(free)} free "
                                 f"bytes (at least {STAGE_RESERVE} stay free)")
        started = time.perf_counter()
        handle = _cu(self.driver, "cuMemCreate", size, _device_allocation(self.driver, 0, exportable=True), 0)
        try:
            copy_s = self._fill(handle, size, jobs)
        except BaseException:
            self.driver.cuda.cuMemRelease(handle)
            raise
        stage_s = time.perf_counter() - started
        self.staged[key] = _Staged(handle, base, size, regions, stage_s, copy_s, time.monotonic() + self.stage_ttl)
        return {"ok": True, "staged": True, "stage_s": stage_s, "copy_s": copy_s, "bytes": sum(n for _, _, n in jobs)}

    def _adopt(self, message: dict[str, Any]) -> Answer:
        """Hand a staged allocation to its engine as a descriptor; the hydrator keeps no reference to it."""
        key = _stage_key(message)
        staged = self.staged.get(key)
        if staged is None:
            return {"ok": False, "staged": False, "error": f"nothing is staged for {key}"}
        base, size, regions, _jobs = self._jobs(message)  # a request for another layout leaves the stage alone
        if (base, size, regions) != (staged.base, staged.size, staged.regions):
            raise HydrationError("the staged allocation was filled for another layout")
        del self.staged[key]
        try:
            fd = int(_cu(self.driver, "cuMemExportToShareableHandle", staged.handle, _fd_handle(self.driver), 0))
        finally:
            self.driver.cuda.cuMemRelease(staged.handle)  # the descriptor keeps the allocation alive
        return {"ok": True, "staged": True, "stage_s": staged.stage_s, "copy_s": staged.copy_s}, [fd]

    def _discard(self, key: str) -> bool:
        staged = self.staged.pop(key, None)
        if staged is not None:
            self.driver.cuda.cuMemRelease(staged.handle)
        return staged is not None

    def _expire(self) -> None:
        """Free what no engine adopted in time (a restore that failed after its worker staged)."""
        now = time.monotonic()
        for key in [k for k, v in self.staged.items() if v.expires <= now]:
            self._discard(key)


def _stage_key(message: dict[str, Any]) -> str:
    """A stage's key: the manifest digest it was filled for (`sha256:` and 64 hex digits)."""
    key = message.get("key")
    if not isinstance(key, str) or not key.startswith("sha256:") or len(key) != 71 or \
            any(c not in "0123456789abcdef" for c in key[7:]):
        raise HydrationError(f"key must be a manifest digest (sha256: and 64 lowercase hex digits), not {key!r:.80}")
    return key


class Stager:
    """The restore worker's side of staging: while CRIU and CUDA restore the engine, the hydrator named in the
    manifest fills an allocation for it on the engine's GPU, which the engine then adopts when asked to hydrate.

    Best effort by design: whatever goes wrong here is reported and the engine hydrates the regular way.
    """

    def __init__(self, manifest: HydrationManifest) -> None:
        self.manifest = manifest
        self.report: dict[str, Any] = {}
        self._lock = threading.Lock()  # exactly one of the thread and discard() sends the discard
        self._finished = self._discarded = False
        self._thread = threading.Thread(target=self._run, name="coldsnap-stage", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ._cuda import Driver

        started = time.perf_counter()
        try:
            driver = Driver()
            driver.call("cuInit", 0)
            uuid = device_uuid(driver, self.manifest.device)
            answer = request(self.manifest.hydrator, self.manifest.stage_request("stage", device_uuid=uuid),
                             timeout=600.0)
            self.report = {k: v for k, v in answer.items() if k != "ok"} if answer.get("ok") else {
                "staged": False, "error": str(answer.get("error"))}
        except Exception as exc:  # staging is an optimisation: the regular hydration still runs
            self.report = {"staged": False, "error": f"{type(exc).__name__}: {exc}"}
        self.report["worker_s"] = time.perf_counter() - started
        with self._lock:
            self._finished = True
            discarded = self._discarded
        if discarded:  # the restore failed while this stage was being filled
            self._send_discard()

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait for the stage request's answer (the hydrator serves it before the engine's adopt)."""
        self._thread.join(timeout)
        return self.report if not self._thread.is_alive() else {"staged": False, "error": "still staging"}

    def discard(self) -> None:
        """After a failed restore: the hydrator frees what no engine will adopt (it would expire anyway). Never
        waits for a stage still being filled: that thread discards it when its answer comes."""
        with self._lock:
            self._discarded = True
            finished = self._finished
        if finished:
            self._send_discard()

    def _send_discard(self) -> None:
        if self.report.get("staged"):
            with contextlib.suppress(HydrationError):
                request(self.manifest.hydrator, self.manifest.stage_request("discard"), timeout=5.0)


def device_uuid(driver: Any, ordinal: int) -> str:
    """The GPU's UUID (`GPU-...`, as nvidia-smi prints it): ordinals differ between containers, UUIDs do not."""
    name = "cuDeviceGetUuid_v2" if hasattr(driver.cuda, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
    raw = bytes(_cu(driver, name, _cu(driver, "cuDeviceGet", ordinal)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _positive(text: str) -> float:
    import argparse

    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coldsnap_probe._hydrate serve --socket PATH FILE...`` (the long-lived hydrator) or
    ``digest FILE OFFSET SIZE``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m coldsnap_probe._hydrate")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--socket", required=True)
    serve.add_argument("--staging", action="store_true",
                       help="accept stage requests: fill an engine's weights while its process is restored, in "
                            "device memory this hydrator holds until the engine adopts it (or --stage-ttl)")
    serve.add_argument("--stage-ttl", type=_positive, default=STAGE_TTL,
                       help="seconds a staged allocation waits for its engine before it is freed")
    serve.add_argument("sources", nargs="+")
    dig = sub.add_parser("digest")
    dig.add_argument("path")
    dig.add_argument("offset", type=int)
    dig.add_argument("size", type=int)
    args = parser.parse_args(argv)
    try:
        if args.command == "digest":
            sys.stdout.write(region_digest(args.path, args.offset, args.size) + "\n")
            return 0
        HydratorServer(args.sources, stage_ttl=args.stage_ttl, staging=args.staging).serve(args.socket)
    except Exception as exc:
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

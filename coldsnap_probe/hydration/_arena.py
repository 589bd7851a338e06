"""The engine side of hydration: `WeightArena`, a VMM reservation whose backing is released before capture
and re-created in place after restore, and its control socket for the restore worker."""

from __future__ import annotations

import ctypes
import os
import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import jsonline
from ..errors import ChannelError, CudaError, HydrationError
from ._copy import Pinned, Pread, copy_to_device, region_pieces
from ._vmm import Mapped, cucall, device_allocation, fd_handle, map_read_write
from ._weights import HydrationManifest, WeightRegion, check_sources, plan_for, validate_regions

__all__ = ("ADOPT_TIMEOUT", "WeightArena")

SAMPLES_PER_REGION = 16
SAMPLE_BYTES = 64 << 10
ADOPT_TIMEOUT = 30.0  # seconds an engine waits for the hydrator's adopt answer before hydrating the regular way


class WeightArena:
    """A VMM reservation for an engine's weights whose backing can be released and re-created in place."""

    def __init__(self, size: int, *, device: int = 0, exportable: bool = False, streams: int = 4,
                 driver: Any = None) -> None:
        from .._cuda import Driver

        self.driver: Any = driver or Driver()
        self.driver.context(device)
        cu = self.driver.cuda
        self.context = cucall(self.driver, "cuCtxGetCurrent")
        self.device, self.exportable = device, exportable
        self._prop = device_allocation(self.driver, device, exportable=exportable)
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granularity = int(cucall(self.driver, "cuMemGetAllocationGranularity", self._prop, flag))
        self.size = -(-size // self.granularity) * self.granularity
        self.address = int(cucall(self.driver, "cuMemAddressReserve", self.size, 0, 0, 0))
        self._handle: Any = None
        self._streams = [cucall(self.driver, "cuStreamCreate", 1) for _ in range(streams)]
        self.regions: tuple[WeightRegion, ...] = ()
        self.manifest: HydrationManifest | None = None
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._control: jsonline.LineServer | None = None
        self.strategy = "register"  # the restore worker's hydrations use the strategy given to serve()
        self.adopt_refusal = ""  # why the last restore found nothing staged to adopt
        self.last_report: dict[str, Any] = {}
        self._map()

    # -- backing ---------------------------------------------------------------------------------------------
    def _map(self, handle: Any = None) -> None:
        """Back the reservation with `handle` (an imported allocation) or a new allocation."""
        cu = self.driver.cuda
        self._handle = handle if handle is not None else cucall(self.driver, "cuMemCreate", self.size, self._prop, 0)
        try:
            cucall(self.driver, "cuMemMap", self.address, self.size, 0, self._handle, 0)
        except BaseException:
            cu.cuMemRelease(self._handle)
            self._handle = None
            raise
        try:
            map_read_write(self.driver, self.address, self.size, self.device)
        except BaseException:
            self._unmap()
            raise

    def _unmap(self) -> None:
        if self._handle is None:
            return
        cucall(self.driver, "cuCtxSynchronize")
        cucall(self.driver, "cuMemUnmap", self.address, self.size)
        cucall(self.driver, "cuMemRelease", self._handle)
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
                control=self._control.listener.getsockname() if self._control else "",
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

    def restore(self, manifest: HydrationManifest | None = None, *, strategy: str = "register",
                ticket: str = "") -> dict[str, Any]:
        """After restore: check, map at the same address, hydrate, verify, then set `ready`.

        `ticket`: the one the hydrator gave the restore worker's stage (`Stager.ticket`): the hydrator hands a
        staged allocation only to the peer that presents it."""
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
            cucall(self.driver, "cuCtxSetCurrent", self.context)
            checked = time.perf_counter()
            self.regions = manifest.regions
            self.adopt_refusal = ""
            adopted = self._adopt(strategy.split(":", 1)[1], manifest, ticket) if strategy.startswith(
                "hydrator:") else None
            if adopted is None:
                free, _total = cucall(self.driver, "cuMemGetInfo")
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
            cucall(self.driver, "cuMemsetD8Async", region.address, 0, region.size, self._streams[0])
        cucall(self.driver, "cuStreamSynchronize", self._streams[0])
        return {"discarded_regions": len(discarded), "zeroed_bytes": sum(r.size for r in discarded)}

    def _fill(self, strategy: str) -> dict[str, Any]:
        """Copy every preserved region in (the backing is mapped), zero the discarded ones, then verify sampled
        blocks; a report."""
        cucall(self.driver, "cuCtxSetCurrent", self.context)
        regions = self._preserved
        total = sum(r.size for r in regions)
        report: dict[str, Any] = {"strategy": strategy, "bytes": total, "regions": len(regions)}
        started = time.perf_counter()
        if strategy == "register":
            mapped: dict[str, Mapped] = {}
            try:
                for source in sorted({r.source for r in regions}):
                    mapped[source] = Mapped(source)
                report["map_s"] = time.perf_counter() - started
                for m in mapped.values():
                    m.register(self.driver)
                report["pin_s"] = time.perf_counter() - started - report["map_s"]
                copy_started = time.perf_counter()
                copy_to_device(self.driver, self.context, region_pieces(regions),
                               Pinned({source: m.address for source, m in mapped.items()}, self._streams))
                report["copy_s"] = time.perf_counter() - copy_started
            finally:
                for m in mapped.values():
                    m.close(self.driver)
        elif strategy in ("ring", "direct"):
            report.update(copy_to_device(self.driver, self.context, region_pieces(regions),
                                         Pread(threads=8, chunk=64 << 20, direct=strategy == "direct")))
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

    def _adopt(self, path: str, manifest: HydrationManifest, ticket: str) -> dict[str, Any] | None:
        """Map the allocation the hydrator staged for `manifest` (filled while this process was being restored)
        at the reservation; None when nothing was staged (the regular hydration runs then)."""
        started = time.perf_counter()
        try:
            answer, fds = jsonline.request_with_fds(path, manifest.stage_request("adopt", ticket=ticket),
                                                    timeout=ADOPT_TIMEOUT)
        except ChannelError as exc:  # the regular hydration reports the hydrator's state itself
            self.adopt_refusal = str(exc)
            return None
        if not answer.get("ok") or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.adopt_refusal = str(answer.get("error") or "no descriptor")
            return None
        try:
            self._map(cucall(self.driver, "cuMemImportFromShareableHandle", fds[0], fd_handle(self.driver)))
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
        fd = int(cucall(self.driver, "cuMemExportToShareableHandle", self._handle, fd_handle(self.driver), 0))
        try:
            answer = jsonline.request(path, {"op": "hydrate", "base": self.address, "size": self.size,
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
                    cucall(self.driver, "cuMemcpyDtoH", ctypes.addressof(buffer), region.address + start, span)
                    expected = os.pread(fd, span, region.offset + start)
                    if buffer.raw[:span] != expected:
                        raise HydrationError(f"device bytes at +{start:#x} differ from the source after hydration",
                                             region=region.name)
            finally:
                os.close(fd)
        return len(self._preserved)

    # -- the restore worker's channel -------------------------------------------------------------------------
    def serve(self, path: str | Path, *, strategy: str = "register", peers: jsonline.Peers | None = None,
              group: int | None = None) -> None:
        """Listen on a Unix socket for the worker's `release` / `hydrate` / `status` (one thread, one at a time).

        The socket is 0600 (0660 with `group`) from its creation and answers only the peers `peers` admits
        (default: root and this engine's uid): a release or hydration is the engine's own business. Each
        connection carries one JSON line and gets one JSON line back; then the engine closes it (so no
        connection is open when CRIU dumps the process). `stop_serving()` ends it.
        """
        if self._control is not None:
            raise HydrationError("the control socket is served already")
        listener = jsonline.listen(path, group=group)
        self.strategy = strategy
        self._control = jsonline.LineServer(
            listener, lambda conn, _peer: self._handle_request(jsonline.read_request(conn), strategy),
            peers=peers or jsonline.Peers(), name="coldsnap-hydration").start()

    def stop_serving(self) -> None:
        """Close the control socket and wait for its thread (an engine shutting down)."""
        if self._control is not None:
            self._control.close()
            self._control = None

    def _handle_request(self, message: Any, strategy: str) -> dict[str, Any]:
        cucall(self.driver, "cuCtxSetCurrent", self.context)  # this thread's, for every call below
        op = message.get("op") if isinstance(message, dict) else None
        if op == "release":
            manifest = self.release(str(message.get("generation") or ""), owner=str(message.get("owner", "engine")))
            return {"ok": True, "manifest": manifest.to_json()}
        if op == "hydrate":
            given = message.get("manifest")
            chosen = HydrationManifest.from_json(given) if given is not None else None
            asked = str(message.get("strategy", strategy))
            if asked.startswith("hydrator:") and asked != strategy:  # never hand the allocation to a socket named
                raise HydrationError(f"strategy {asked!r} is not this engine's hydrator")  # by the asker
            return {"ok": True, "report": self.restore(chosen, strategy=asked, ticket=str(message.get("ticket", "")))}
        if op == "status":
            return {"ok": True, "mapped": self.mapped, "ready": self.ready.is_set()}
        raise HydrationError(f"unknown request {op!r}")

"""The node's long-lived hydrator (`HydratorServer`); the restore worker's side of staging is `_staging.py`."""

from __future__ import annotations

import hmac
import json
import math
import os
import secrets
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .. import jsonline
from ..errors import HydrationError
from ._copy import ZEROS, HostBuffers, Piece, Pinned, Pread, copy_to_device
from ._device_tier import DEVICE_TIER_TTL, DeviceTier, dump_name, weights_name
from ._peer_files import DumpLayout, dump_layout, dump_reads, held_sources, open_dump_parts
from ._peer_view import OPENERS, PeerView
from ._ram_tier import RamTier
from ._request_fields import first_page, request_regions, stage_key
from ._stage_copy import at_once, dump_pieces, weights_pieces
from ._stage_quota import StageQuota, check_stage_quota
from ._staging import ADOPT_PAGE
from ._vmm import (
    HostPins,
    Mapped,
    cucall,
    device_allocation,
    device_uuid,
    fd_handle,
    map_read_write,
)
from ._warm import Warms
from ._weights import WeightRegion

__all__ = ("CONNECTIONS", "DUMP_CHUNK", "DUMP_CHUNKS", "DUMP_THREADS", "MAX_DUMP_THREADS", "STAGE_MAX",
           "STAGE_PAUSE_S", "STAGE_RESERVE", "STAGE_TTL", "UID_CONNECTIONS", "HydratorServer")

STAGE_TTL = 120.0  # seconds a staged allocation waits for its engine before the hydrator frees it
STAGE_MAX = 4  # staged allocations a hydrator holds at once
STAGE_RESERVE = 1 << 30  # device bytes staging leaves free (the engine's restored state needs them)
# A filled stage pauses the RAM tier's loads until adopted, at most this long: an engine adopts within its restore
# (its CUDA restore: 0.3 s on the H200); one that fell back or hangs must not hold every load for the whole TTL.
STAGE_PAUSE_S = 10.0
_Slot = tuple[int, str]  # a stage's place: (the uid that staged it, its key), so tenants never share one
DUMP_THREADS, DUMP_CHUNK = 16, 8 << 20  # the ring a dump is read through (page-locked, kept: 256 MiB)
MAX_DUMP_THREADS = 64  # `serve --dump-threads`' bound (each reader keeps two page-locked buffers of DUMP_CHUNK)
DUMP_CHUNKS = (64 << 10, 64 << 20)  # `serve --dump-chunk`'s bounds: a read's bytes (issue 35: what bounds the ring)
CONNECTIONS = 8  # peers answered at once, as the interposer's control socket: more wait in the listen backlog
UID_CONNECTIONS = CONNECTIONS // 2  # of them, one tenant uid's at most (root's and ours are not capped)


@dataclass
class _Staged:
    """An allocation the hydrator filled ahead of its engine's restore (see HydratorServer)."""

    handles: tuple[Any, ...]  # one allocation, or one per region of a device dump, mapped back to back
    base: int
    size: int
    regions: tuple[WeightRegion, ...]
    stage_s: float
    copy_s: float
    expires: float
    owner: int  # the uid of the peer that staged it: its `status` lists it; stages are keyed per owner (_Slot)
    ticket: str  # a secret answered to the stager only (never in a report), which hands it to its engine
    layout: DumpLayout = ()  # a device dump's parts as the stager named them (`stage-dump`); () for weights
    sizes: tuple[int, ...] = ()  # each allocation's bytes, in handles' order
    # Invariant: the pages [0, taken) were handed out by `adopt`; the stage is dropped with the last page.
    taken: int = 0
    # Invariant: a stage is `ready` once filled (only then adoptable, discardable, expirable); until then its
    # `unallocated` bytes are reserved (counted as used by the next stage's free-memory check) and `expires` is inf.
    ready: bool = False
    unallocated: int = 0
    stager: int = -1  # the stager's pidfd (owned here; -1: none sent): a ready stage is freed once it exits
    # The RAM tier's loads stay paused from the stage's request until it is dropped (adopted, discarded, expired,
    # failed) or STAGE_PAUSE_S after it was filled: the engine's restore and adopt run meanwhile.
    resume: Callable[[], None] = field(default=lambda: None)

    def held_by(self, ticket: object) -> bool:
        """Adopting or discarding a stage takes its ticket: the engine may run as another uid than the worker
        that staged for it, and the worker gives the ticket only to it (over the engine's 0600 socket)."""
        given = ticket.encode("utf-8", "surrogatepass") if isinstance(ticket, str) else b""
        return bool(given) and hmac.compare_digest(given, self.ticket.encode())


class HydratorServer:
    """Keeps source files page-locked (paid once) and copies them into engines' weight allocations.

    Requests (one JSON line each, on its socket): `hydrate` carries an engine's exported allocation and fills it;
    `stage` (from a restore worker, before its CRIU restore; only with `staging`, see `serve --staging`)
    allocates and fills one on the hydrator's GPU while the engine is still being restored, kept under the
    manifest's digest for `stage_ttl` seconds (at most STAGE_MAX at once, never leaving less than STAGE_RESERVE
    free, and within each peer uid's `quota`, _stage_quota.py); `stage-dump` does the same from a CUDA
    interposer's device dump, one allocation per region; `adopt` (from the restored engine) hands the allocations
    over as descriptors, ADOPT_PAGE an answer, so the engine only maps them; `discard` frees a stage that will not
    be adopted; `status` lists what is staged and the RAM tier's state. Device dumps staged once are kept
    page-locked (`ram_tier_bytes`, _ram_tier.py) so that the next stage of the same dump is a DMA at the link's rate;
    `warm` (from a capture worker, its dump done) queues a dump for that tier with a stage-dump's checks (_warm.py).

    Who may ask what (a hydrator may serve several tenants): the socket is 0600 (0660 with a group) and only
    the peers `peers` admits are answered (SO_PEERCRED); a `hydrate` or `stage` gets a source's bytes only for
    a peer that could read the source file itself, in its own view (its root, uid, groups and DAC capabilities:
    `_peer_view.PeerView`; uid 0 alone reads nothing), and so does a `stage-dump` for each part; `adopt` and
    `discard` need the stage's ticket (answered to
    the stager only), each uid's stages are its own (another uid staging the same key, the same model's manifest,
    stages beside it and never replaces nor blocks it), and `status` lists only the asker's own stages.

    Concurrency: each connection is answered on a thread of its own, CONNECTIONS at once (jsonline.LineServer), each
    within the request deadline, so a slow copy or a silent peer holds up no one else; one tenant uid gets at most
    UID_CONNECTIONS of them (its others wait for one of its own to end, holding no thread), so its silent
    connections cannot take them all. Each thread makes the hydrator's context current before any driver call, and
    each copy makes its own streams. The locking rule: `self.staged` and every stage in it are read and changed only
    under `self._lock`, and every check-then-act on them (quota, STAGE_MAX and free memory then reserve; find a
    ticket's stage then export or free it; expiry) happens in one hold of it. A stage is reserved under the lock
    (its slot, and its bytes as `unallocated`) and allocated and filled outside it; until it is `ready` no one can
    adopt, discard or expire it, a second stage of the same slot is refused, and a failed fill gives its reservation
    back. Nothing slow (a copy) runs under it.
    """

    def __init__(self, sources: Sequence[str], *, streams: int = 4, driver: Any = None,
                 stage_ttl: float = STAGE_TTL, staging: bool = False, peers: jsonline.Peers | None = None,
                 group: int | None = None, stage_uid_count: int | None = None,
                 stage_uid_bytes: int | None = None, ram_tier_bytes: int = 0,
                 status_uids: frozenset[int] = frozenset(), dump_threads: int = DUMP_THREADS,
                 warm_captures: bool = True, dump_chunk: int = DUMP_CHUNK, device_tier_bytes: int = 0,
                 device_tier_ttl: float = DEVICE_TIER_TTL) -> None:
        from .._cuda import Driver

        self.driver: Any = driver or Driver()
        self.driver.context()
        self.context = cucall(self.driver, "cuCtxGetCurrent")
        self.device_uuid = device_uuid(self.driver, 0)
        started = time.perf_counter()
        self.sources: dict[str, Mapped] = {}
        # The held files by (device, inode): a peer's source is the file its own path names in its own view.
        self._identities: dict[tuple[int, int], str] = {}
        for source in sources:
            real = os.path.realpath(source)
            self.sources[real] = Mapped(real)
            self._identities[self.sources[real].identity] = real
        self.map_seconds = time.perf_counter() - started
        for m in self.sources.values():
            m.register(self.driver)
        self.pin_seconds = time.perf_counter() - started - self.map_seconds
        self.streams = streams  # a copy's own streams (see _pinned)
        if stage_ttl <= 0:
            raise HydrationError(f"stage_ttl must be positive, not {stage_ttl}")
        self.staged: dict[_Slot, _Staged] = {}
        self._lock = threading.Lock()  # the stage table and its stages: see the locking rule above
        self.stage_ttl, self.staging = stage_ttl, staging
        self.peers, self.group = peers or jsonline.Peers(), group
        # Uids that may ask only for `status`, the RAM tier's counters included: the provider daemon's account (its
        # metrics, coldsnap_provider/_hydrator_stages.py), which the shipped unit does not run as root.
        self.status_uids = status_uids
        self._openers = threading.BoundedSemaphore(OPENERS)  # threads opening files in peers' views (_peer_view)
        _free, total = cucall(self.driver, "cuMemGetInfo")
        # Device dumps kept page-locked across restores (_ram_tier.py): only a staging hydrator stages them.
        budget = ram_tier_bytes if staging else 0
        pins = HostPins(self.driver, self.context)
        self.ram_tier = RamTier(budget, pin=pins.pin, unpin=pins.unpin)
        # Captures' dumps offered to the tier (_warm.py), whenever there is one: a restore's stage joins a load
        # that is still pinning and pauses it, never waits for it (_ram_tier.py; issue 35).
        self.warms = Warms(self.ram_tier, self._openers) if warm_captures and budget else None
        # Device dumps kept on this GPU across restores (_device_tier.py): a stage of one is a copy within the GPU.
        self.device_tier = DeviceTier(device_tier_bytes if staging else 0, driver=self.driver, context=self.context,
                                      total=int(total), reserve=STAGE_RESERVE, streams=streams, ttl=device_tier_ttl,
                                      pending=self._pending)
        self.quota = StageQuota.default(int(total), shared=bool(self.peers.uids or self.peers.gids), stages=STAGE_MAX,
                                        count=stage_uid_count, size=stage_uid_bytes)
        # One stage's ring of page-locked buffers, allocated now rather than on every restore's path (256 MiB).
        if not 1 <= dump_threads <= MAX_DUMP_THREADS:  # a disk-tier stage's readers (issue 35: fewer may cost less)
            raise HydrationError(f"dump_threads must be 1 to {MAX_DUMP_THREADS}, not {dump_threads}")
        if not DUMP_CHUNKS[0] <= dump_chunk <= DUMP_CHUNKS[1] or dump_chunk % 4096:
            raise HydrationError(f"dump_chunk must be a multiple of 4096 from {DUMP_CHUNKS[0]} to {DUMP_CHUNKS[1]} "
                                 f"bytes, not {dump_chunk}")
        self.dump_threads, self.dump_chunk = dump_threads, dump_chunk
        self.dump_buffers = HostBuffers(self.driver, dump_chunk + 2, keep=2 * dump_threads)
        self.ring_pin_seconds = self.dump_buffers.fill() if staging else 0.0

    def serve(self, path: str) -> None:
        """Answer requests on `path` until the process ends (ready line on stdout once it listens)."""
        with jsonline.listen(path, group=self.group) as listener:
            sys.stdout.write(json.dumps({"ready": True, "map_s": self.map_seconds, "pin_s": self.pin_seconds,
                                         "ring_pin_s": self.ring_pin_seconds,
                                         "bytes": sum(m.size for m in self.sources.values()),
                                         "device_uuid": self.device_uuid, "ram_tier_bytes": self.ram_tier.budget,
                                         "device_tier_bytes": self.device_tier.budget})
                             + "\n")
            sys.stdout.flush()
            try:
                askers = jsonline.Peers(uids=self.peers.uids | self.status_uids, gids=self.peers.gids)
                jsonline.LineServer(listener, self._one, peers=askers, idle=self._expire,
                                    threads=CONNECTIONS, per_uid=UID_CONNECTIONS).run()
            finally:
                self.device_tier.close()
                self.ram_tier.close()

    def _one(self, conn: socket.socket, peer: jsonline.Peer) -> jsonline.Answer:
        cucall(self.driver, "cuCtxSetCurrent", self.context)  # this connection's thread, for every call below
        message, fds = jsonline.read_request_with_fds(conn, 1)
        try:
            op = message.get("op", "hydrate")
            if op != "status" and not self.peers.admits(peer):  # a --status-uid asker only
                raise HydrationError(f"uid {peer.uid} may ask this hydrator for its status only")
            if op not in ("hydrate", "stage", "stage-dump") and fds:
                raise HydrationError(f"a {op!r:.80} request carries no descriptor")
            if op == "hydrate":
                if len(fds) != 1:
                    raise HydrationError("a hydrate request carries exactly one allocation descriptor")
                with self.ram_tier.copying():  # a restore's copy: the tier's loads pin no further piece meanwhile
                    return self._hydrate(message, fds[0], peer, conn)
            if op in ("stage", "stage-dump"):
                with self.ram_tier.copying():
                    return (self._stage if op == "stage" else self._stage_dump)(message, peer, conn, _stager(fds))
            if op == "warm":
                if self.warms is None:
                    return {"ok": True, "queued": False,
                            "reason": "this hydrator warms no capture (no RAM tier, or serve --no-warm-captures)"}
                return self.warms.warm(self._stage_slot(message), message, peer, conn)
            if op == "adopt":
                return self._adopt(message, peer, conn)
            if op == "discard":
                return {"ok": True, "discarded": self._discard(stage_key(message), message.get("ticket"))}
            if op == "status":
                return self._status(peer)
            raise HydrationError(f"unknown request {op!r:.80}")
        finally:
            for fd in fds:
                os.close(fd)

    def _jobs(self, message: dict[str, Any], peer: jsonline.Peer, conn: socket.socket) -> \
            tuple[int, int, tuple[WeightRegion, ...], list[Piece]]:
        """The request's reservation and regions (validated), and the pieces of the held sources they name (to
        their offsets in the reservation), each one the peer could read itself in its own view (`held_sources`)."""
        base, size, regions = request_regions(message)
        preserved = [r for r in regions if r.preserved]  # discarded regions: the engine zeroes them
        if not preserved:
            return base, size, regions, []
        with PeerView.of(conn, peer, openers=self._openers) as view:
            held = held_sources(view, (r.source for r in preserved), self._identities)
        pieces = []
        for region in preserved:
            if self.sources[held[region.source]].size < region.offset + region.size:
                raise HydrationError(f"this hydrator does not hold {region.source}", region=region.name)
            pieces.append(Piece(region.address - base, held[region.source], region.offset, region.size))
        return base, size, regions, pieces

    def _fill(self, allocations: Sequence[tuple[Any, int]], copy: Callable[[int], object]) -> tuple[float, Any]:
        """Map `allocations` ((handle, bytes)) back to back in one range here, `copy` into it (given the range's
        address), unmap; the copy's seconds and what it returned. Each is mapped whole at offset 0 of its own
        (cuMemMap's offset must be zero), so the copy sees one contiguous range however many allocations there
        are."""
        cu, d = self.driver.cuda, self.driver
        size = sum(n for _, n in allocations)
        va, mapped = 0, []
        try:
            va = int(cucall(d, "cuMemAddressReserve", size, 0, 0, 0))
            at = va
            for handle, n in allocations:
                cucall(d, "cuMemMap", at, n, 0, handle, 0)
                mapped.append((at, n))
                map_read_write(d, at, n, 0)
                at += n
            started = time.perf_counter()
            done = copy(va)
            return time.perf_counter() - started, done
        finally:
            for at, n in mapped:
                cu.cuMemUnmap(at, n)
            if va:
                cu.cuMemAddressFree(va, size)

    def _pinned(self, pieces: Sequence[Piece], addresses: Mapping[str, int] | None = None) -> Callable[[int], object]:
        """The copy of `pieces` (of the held sources, or of page-locked `addresses`: the RAM tier's, to offsets)
        into an allocation mapped at its argument.
        Each copy makes its own streams (microseconds next to a copy): a Pinned copy waits for its streams, and
        on streams shared with another peer's copy that wait would also take in the other copy's work."""
        if addresses is None:
            addresses = {source: mapped.address for source, mapped in self.sources.items()}

        def copy(va: int) -> None:
            streams: list[Any] = []
            try:
                for _ in range(self.streams):
                    streams.append(cucall(self.driver, "cuStreamCreate", 1))
                copy_to_device(self.driver, self.context, [p._replace(dst=va + p.dst) for p in pieces],
                               Pinned(addresses, streams))
            finally:  # after a failed enqueue too: nothing in flight outlives the caller's mapping
                for stream in streams:
                    self.driver.cuda.cuStreamSynchronize(stream)
                    self.driver.cuda.cuStreamDestroy(stream)
        return copy

    def _hydrate(self, message: dict[str, Any], fd: int, peer: jsonline.Peer, conn: socket.socket) -> dict[str, Any]:
        """Fill an engine's exported allocation. The descriptor is the caller's to close: while it is open, it
        keeps the engine's allocation alive, even after the engine released it."""
        _base, size, _regions, jobs = self._jobs(message, peer, conn)
        started = time.perf_counter()
        handle = cucall(self.driver, "cuMemImportFromShareableHandle", fd, fd_handle(self.driver))
        try:
            copy_s, _ = self._fill([(handle, size)], self._pinned(jobs))
        finally:
            self.driver.cuda.cuMemRelease(handle)
        return {"ok": True, "import_map_s": time.perf_counter() - started - copy_s, "copy_s": copy_s,
                "bytes": sum(p.size for p in jobs)}

    def _stage_slot(self, message: dict[str, Any]) -> str:
        """A `stage` or `stage-dump` request's key: refused when staging is off, or for an engine on another GPU."""
        if not self.staging:
            raise HydrationError("staging is off on this hydrator (serve --staging)")
        key = stage_key(message)
        if message.get("device_uuid") != self.device_uuid:
            raise HydrationError(f"the engine's GPU {message.get('device_uuid')} is not this hydrator's "
                                 f"{self.device_uuid}")
        return key

    def _reserve(self, slot: _Slot, staged: _Staged) -> _Staged:
        """In one hold of the lock: refuse a stage beyond the uid's quota, STAGE_MAX or the free memory (a refusal
        frees nothing), else replace the slot's earlier stage (a retry) with `staged`, reserved (not ready, its
        bytes unallocated, its ticket drawn) for the caller to fill."""
        with self._lock:
            self._expire_locked()
            earlier = self.staged.get(slot)
            if earlier is not None and not earlier.ready:
                raise HydrationError(f"{slot[1]} is being staged for uid {slot[0]} by another request already "
                                     "(one stage per key and uid at once)")
            check_stage_quota(self.staged, key=slot, uid=slot[0], size=staged.size, quota=self.quota)
            self._room_for(staged.size, earlier)
            if earlier is not None:
                self._free(slot)
            reserved = self.staged[slot] = replace(staged, expires=math.inf, owner=slot[0],
                                                   ticket=secrets.token_urlsafe(32), ready=False,
                                                   unallocated=staged.size)
            return reserved

    def _stage_into(self, key: str, peer: jsonline.Peer, conn: socket.socket, staged: _Staged,
                    copy: Callable[[int], object], copied: int, stager: int) -> dict[str, Any]:
        """Reserve `staged` under `key` (`_reserve`), allocate its bytes as one allocation per `staged.sizes` and
        `copy` into them outside the lock, then make it ready (handles, timings, expiry). A failure releases every
        allocation made and the reservation; so does a stager that hung up (`conn` closed) meanwhile: a restore
        refused after it started its stages, or a worker that died, leaves nothing staged for the TTL."""
        slot = (peer.uid, key)
        kept = replace(staged, stager=os.dup(stager) if stager >= 0 else -1,  # the request's own is closed after it
                       resume=self.ram_tier.pause())
        try:
            reserved = self._reserve(slot, kept)
        except BaseException:
            _let_go(kept)
            raise
        started = time.perf_counter()
        handles: list[Any] = []
        try:
            prop = device_allocation(self.driver, 0, exportable=True, rdma=True)  # adoptable for RDMA-capable ones
            for n in staged.sizes:
                handles.append(cucall(self.driver, "cuMemCreate", n, prop, 0))
                with self._lock:  # now counted by cuMemGetInfo instead
                    reserved.unallocated -= n
            copy_s, report = self._fill(list(zip(handles, staged.sizes, strict=True)), copy)
            if _hung_up(conn):  # no one will ever get the ticket: kept, it would hold the GPU for the whole TTL
                raise HydrationError(f"the stager of {key} hung up while its stage was filled: freed")
        except BaseException:
            with self._lock:
                if self.staged.get(slot) is reserved:
                    del self.staged[slot]
            _let_go(reserved)
            for handle in handles:
                self.driver.cuda.cuMemRelease(handle)
            raise
        stage_s = time.perf_counter() - started
        with self._lock:
            reserved.handles, reserved.stage_s, reserved.copy_s = tuple(handles), stage_s, copy_s
            reserved.expires, reserved.ready = time.monotonic() + self.stage_ttl, True
        return {"ok": True, "staged": True, "stage_s": stage_s, "copy_s": copy_s, "bytes": copied,
                "allocations": len(handles), "ticket": reserved.ticket,
                **({"copy": report} if isinstance(report, dict) else {})}  # the ring's thread-seconds

    def _stage(self, message: dict[str, Any], peer: jsonline.Peer, conn: socket.socket,
               stager: int) -> dict[str, Any]:
        """Allocate and fill ahead of the engine's restore; refused for an engine on another GPU. The answer's
        `ticket` is what the engine presents to adopt it."""
        key = self._stage_slot(message)
        base, size, regions, jobs = self._jobs(message, peer, conn)
        name = weights_name(size, jobs)
        kept = self.device_tier.take(name)  # a copy within the GPU: the link is the CUDA restore's alone
        copy = self.device_tier.copy_from(kept[1]) if kept is not None else \
            self.device_tier.keeping(name, {}, (size,), peer.uid, self._pinned(weights_pieces(size, jobs)))
        answer: dict[str, Any] = {}
        try:
            answer = self._stage_into(key, peer, conn, _Staged((), base, size, regions, 0.0, 0.0, 0.0, 0, "",
                                                               sizes=(size,)), copy, sum(p.size for p in jobs), stager)
        finally:
            if kept is not None:
                self.device_tier.give_back(kept, size if answer else 0)
        return {**answer, "tier": "device" if kept is not None else "ram"}

    def _pending(self) -> int:
        """Device bytes the stages being filled reserved and have not allocated yet: a keep leaves them free."""
        with self._lock:
            return sum(v.unallocated for v in self.staged.values())

    def _room_for(self, size: int, replacing: _Staged | None) -> None:
        """Under the lock: refuse a stage of `size` bytes (replacing `replacing`) beyond STAGE_MAX, or leaving less
        than STAGE_RESERVE free once the stages being filled have their bytes (the device tier gives way first)."""
        count = len(self.staged) - (replacing is not None)
        if count >= STAGE_MAX:
            raise HydrationError(f"{count} allocations are staged already (at most {STAGE_MAX})")
        free, _total = cucall(self.driver, "cuMemGetInfo")
        # A replaced stage gives back only its pages not handed out yet: an adopted page lives on in its engine.
        returned = sum(replacing.sizes[replacing.taken:]) if replacing else 0
        free = int(free) + returned - sum(v.unallocated for v in self.staged.values())
        if free - size < STAGE_RESERVE:
            free += self.device_tier.make_room(STAGE_RESERVE - (free - size))
        if free - size < STAGE_RESERVE:
            raise HydrationError(f"staging {size} bytes would leave {free - size} of the GPU's {free} free bytes "
                                 f"(at least {STAGE_RESERVE} stay free; stages being filled count as used)")

    def _stage_dump(self, message: dict[str, Any], peer: jsonline.Peer, conn: socket.socket,
                    stager: int) -> dict[str, Any]:
        """Fill one allocation per released region from an interposer's device dump (docs/interposer.md) while
        its process is being restored: `parts` are (file, bytes, region, optionally zero: its chunks of zeros) in
        the order the interposer maps them back (`dump_layout`), each part's first `bytes` of its file but for its
        chunks of zeros (set on the device, never read: `dump_pieces`) read through a ring of page-locked buffers
        into the allocations mapped back to back (through the page cache: on the H200 machine's disk 16 readers
        read 1.45 GB/s through it and 1.02 with O_DIRECT, bench/e2e_store.py's rates), or, when the RAM tier holds
        these very files (`tier: ram`), one DMA per piece from their pinned mappings; a miss (`tier: disk`) queues
        them for the tier; a stage of a dump the tier is loading (a capture's warm) copies what is pinned so far
        from it and reads the rest at once (`tier: joined`, `ram_bytes`: _stage_copy.py). Only files `peer`
        could read itself in its own view, on this hydrator's GPU."""
        key = self._stage_slot(message)
        layout, sizes = dump_layout(message.get("parts"))
        with PeerView.of(conn, peer, openers=self._openers) as view:
            parts, fds = open_dump_parts(layout, view)
        size, reads, pieces = sum(sizes), dump_reads(layout), dump_pieces(parts, layout, 0)  # reads: no zeros
        zero = sum(p.size for p in pieces if p.source == ZEROS)
        kept = self.device_tier.take(dump_name(layout, fds))  # the very files the peer opened, on this GPU
        lease = self.ram_tier.lease(key, fds, reads) if kept is None else None  # a hit or a join, pinned
        held, rest = lease.split(pieces) if lease is not None else ([], pieces)
        copy, copied = self.device_tier.copy_from(kept[1]) if kept is not None else None, 0
        if copy is None:
            reader = Pread(threads=self.dump_threads, chunk=self.dump_chunk, opened=fds, buffers=self.dump_buffers)
            copies: list[Callable[[int], object]] = []
            if lease is not None and held:
                copies.append(self._pinned(held, lease.addresses))
            if rest:
                copies.append(lambda va: copy_to_device(self.driver, self.context,
                                                        [p._replace(dst=va + p.dst) for p in rest], reader))
            # the ring's last: its report is the stage's `copy`; then kept on the GPU for the next stage
            copy = self.device_tier.keeping(dump_name(layout, fds), fds, sizes, peer.uid,
                                            at_once(self.driver, self.context, copies))
        ram = sum(p.size for p in held if p.source != ZEROS)
        try:
            answer = self._stage_into(key, peer, conn, _Staged((), 0, size, parts, 0.0, 0.0, 0.0, 0, "",
                                                               layout=layout, sizes=sizes), copy, size, stager)
            copied = size
            tier = "device" if kept is not None else \
                self.ram_tier.staged(key, fds, reads, lease, ram, size - zero - ram, owner=peer.uid)
        finally:
            if kept is not None:
                self.device_tier.give_back(kept, copied)
            if lease is not None:
                lease.release()
            for fd in fds.values():
                os.close(fd)
        # zero_bytes: set on the device; copied_bytes: read and moved (from the RAM tier or the files: `tier`)
        return {**answer, "zero_bytes": zero, "copied_bytes": size - zero, "tier": tier, "ram_bytes": ram}

    def _adopt(self, message: dict[str, Any], peer: jsonline.Peer, conn: socket.socket) -> jsonline.Answer:
        """Hand a stage's allocations to its engine as descriptors, ADOPT_PAGE at a time from `first` (default 0):
        the answer says `first` and `count` (all of the stage's). The stage stays until its last page is taken
        (or its TTL ends); a page may be asked again until then (a retry), never one beyond the next. Handing
        out the last page drops the stage: the descriptors keep the allocations alive. All in one hold of the
        lock (exporting a page is quick), so an expiry, a discard or another adopt of the same ticket comes wholly
        before or after it: of two adopts of a one-page stage exactly one gets it."""
        key = stage_key(message)
        # A weights stage's layout is worked out before the lock: `_jobs` resolves and stats the paths the peer
        # names, and a filesystem that hangs there (the peer's own FUSE mount) must hold this thread only, not
        # every peer's stages. Its refusal is raised only for a stage the ticket opens, as before.
        try:
            weights: tuple[int, int, tuple[WeightRegion, ...]] | Exception = self._jobs(message, peer, conn)[:3]
        except Exception as exc:  # a dump's adopt has no weights layout: unused then
            weights = exc
        with self._lock:
            if (held := self._held(key, message.get("ticket"))) is None:  # another's, or still filling: as if absent
                return {"ok": False, "staged": False, "error": f"nothing is staged for {key}"}
            slot, staged = held
            first = first_page(message.get("first", 0), len(staged.handles), staged.taken)
            if staged.layout:  # another layout leaves the stage alone
                if dump_layout(message.get("parts"))[0] != staged.layout:
                    raise HydrationError("the staged allocations were filled from another dump")
            else:
                if isinstance(weights, Exception):
                    raise weights
                if weights != (staged.base, staged.size, staged.regions):
                    raise HydrationError("the staged allocation was filled for another layout")
            page = staged.handles[first:first + ADOPT_PAGE]
            fds: list[int] = []
            try:
                for handle in page:
                    fds.append(int(cucall(self.driver, "cuMemExportToShareableHandle", handle,
                                          fd_handle(self.driver), 0)))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
            if first + len(page) == len(staged.handles):
                self._free(slot)  # the descriptors keep the allocations alive
            else:
                staged.taken = max(staged.taken, first + len(page))
        return {"ok": True, "staged": True, "stage_s": staged.stage_s, "copy_s": staged.copy_s, "first": first,
                "count": len(staged.handles), "sizes": list(staged.sizes[first:first + len(page)])}, fds

    def _status(self, peer: jsonline.Peer) -> dict[str, Any]:
        """The asker's own stages (one being filled says so, with no expiry yet), the per-uid quota and, for root,
        this hydrator's uid and the `status_uids`, the RAM tier's state."""
        now, warms, operator = time.monotonic(), self.warms.status() if self.warms else "off", \
            peer.uid in (0, os.getuid(), *self.status_uids)
        with self._lock:
            staged = [{"key": k[1], "bytes": v.size, "filling": not v.ready,
                       "expires_in_s": v.expires - now if v.ready else None}
                      for k, v in self.staged.items() if v.owner == peer.uid]
        return {"ok": True, "device_uuid": self.device_uuid, "staged": staged,
                "quota": {"count": self.quota.count, "bytes": self.quota.bytes},
                # The tiers are every tenant's: their counters say when others restored: the operator's only.
                **({"ram_tier": {**self.device_tier.beside(self.ram_tier.status()), "warms": warms},
                    "device_tier": self.device_tier.status()} if operator else {})}

    def _held(self, key: str, ticket: object) -> tuple[_Slot, _Staged] | None:
        """Under the lock: the ready stage under `key` that `ticket` opens, whoever staged it (the engine may run
        as another uid)."""
        return next(((slot, v) for slot, v in self.staged.items()
                     if slot[1] == key and v.ready and v.held_by(ticket)), None)

    def _discard(self, key: str, ticket: object) -> bool:
        with self._lock:
            if (held := self._held(key, ticket)) is None:
                return False
            self._free(held[0])
            return True

    def _free(self, slot: _Slot) -> None:
        """Under the lock: drop a ready stage and release its allocations (a handed-out descriptor keeps its own)."""
        dropped = self.staged.pop(slot)
        _let_go(dropped)
        for handle in dropped.handles:
            self.driver.cuda.cuMemRelease(handle)

    def _expire(self) -> None:
        """Free what no engine adopted in time (a restore that failed after its worker staged): the server's idle
        call, on the accept thread, alongside the connections' threads."""
        cucall(self.driver, "cuCtxSetCurrent", self.context)
        with self._lock:
            self._expire_locked()
        self.ram_tier.prune()  # a removed dump's pinned memory back within a second
        self.device_tier.prune()

    def _expire_locked(self) -> None:
        now = time.monotonic()  # a stage being filled expires at inf: never freed under its filler
        for staged in self.staged.values():
            if staged.ready and staged.expires - self.stage_ttl + STAGE_PAUSE_S <= now:
                staged.resume()
        for key in [k for k, v in self.staged.items() if v.ready and (v.expires <= now or _exited(v.stager))]:
            self._free(key)


def _stager(fds: list[int]) -> int:
    """A stage request's one optional descriptor: its stager's pidfd (-1 without one), the caller's to close."""
    if fds and (len(fds) > 1 or os.readlink(f"/proc/self/fd/{fds[0]}") != "anon_inode:[pidfd]"):
        raise HydrationError("a stage request carries at most one descriptor, its stager's pidfd")
    return fds[0] if fds else -1


def _exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited."""
    if pidfd < 0:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _let_go(staged: _Staged) -> None:
    """A stage let go: its stager's pidfd closed, the RAM tier's loads no longer paused for it."""
    staged.resume()
    if staged.stager >= 0:
        os.close(staged.stager)


def _hung_up(conn: socket.socket) -> bool:
    """Whether the asker has closed its end of `conn` (both directions: POLLHUP). A request is sent whole, so an
    asker that only ended its writing (POLLRDHUP) still waits for the answer."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return any(events & select.POLLHUP for _fd, events in poller.poll(0))

"""The node's long-lived hydrator (`HydratorServer`) and the restore worker's side of staging (`Stager`)."""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import jsonline
from ..errors import HydrationError
from ._stage_quota import StageQuota, check_stage_quota
from ._staging import StageRequest
from ._vmm import (
    Mapped,
    copy_registered,
    copy_ring,
    cucall,
    device_allocation,
    device_uuid,
    fd_handle,
    map_read_write,
)
from ._weights import HydrationManifest, WeightRegion, validate_regions

__all__ = ("STAGE_MAX", "STAGE_RESERVE", "STAGE_TTL", "HydratorServer", "Stager")

STAGE_TTL = 120.0  # seconds a staged allocation waits for its engine before the hydrator frees it
STAGE_MAX = 4  # staged allocations a hydrator holds at once
STAGE_RESERVE = 1 << 30  # device bytes staging leaves free (the engine's restored state needs them)
DUMP_ALIGN = 2 << 20  # a device dump's parts are whole VMM regions: multiples of the allocation granularity
DUMP_THREADS, DUMP_CHUNK = 16, 8 << 20  # the ring a dump is read through (page-locked per stage: 256 MiB)


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
    owner: int  # the uid of the peer that staged it: its `status` lists it, another uid cannot stage over it
    ticket: str  # a secret answered to the stager only (never in a report), which hands it to its engine
    dump: bool = False  # filled from an interposer's device dump (`stage-dump`), not from the held sources

    def held_by(self, ticket: object) -> bool:
        """Adopting or discarding a stage takes its ticket: the engine may run as another uid than the worker
        that staged for it, and the worker gives the ticket only to it (over the engine's 0600 socket)."""
        given = ticket.encode("utf-8", "surrogatepass") if isinstance(ticket, str) else b""
        return bool(given) and hmac.compare_digest(given, self.ticket.encode())


def readable_by(path: str, st: os.stat_result, peer: jsonline.Peer, *, search: bool | None = None) -> bool:
    """Whether `peer` could open the file `path` (`st`: the held file's status) itself: read permission on
    it and search permission on every directory above it, as the kernel checks mode bits for one uid and
    gid. The hydrator hands out a source's bytes only to a peer that could read them anyway; a world-readable
    file in another tenant's 0700 directory is not readable by the others. With `search` given, only `st`
    itself is checked (search permission of a held directory, or read permission of a held file): the caller
    walked the path by descriptors."""
    if peer.uid == 0:
        return True
    if search is not None:
        return _permits(st, peer, *((stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH) if search else
                                    (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)))
    if not _permits(st, peer, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH):
        return False
    directory = os.path.dirname(path)
    while True:
        try:
            above = os.stat(directory)
        except OSError:
            return False
        if not _permits(above, peer, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
            return False
        if directory == os.path.dirname(directory):
            return True
        directory = os.path.dirname(directory)


def _permits(st: os.stat_result, peer: jsonline.Peer, user: int, group: int, other: int) -> bool:
    if st.st_uid == peer.uid:
        return bool(st.st_mode & user)
    if st.st_gid == peer.gid:
        return bool(st.st_mode & group)
    return bool(st.st_mode & other)


class HydratorServer:
    """Keeps source files page-locked (paid once) and copies them into engines' weight allocations.

    Requests (one JSON line each, on its socket): `hydrate` carries an engine's exported allocation and fills it;
    `stage` (from a restore worker, before its CRIU restore; only with `staging`, see `serve --staging`)
    allocates and fills one on the hydrator's GPU while the engine is still being restored, kept under the
    manifest's digest for `stage_ttl` seconds (at most STAGE_MAX at once, never leaving less than STAGE_RESERVE
    free, and within each peer uid's `quota`, _stage_quota.py); `adopt` (from the restored engine) hands that
    allocation over as a descriptor, so the engine only maps it; `discard` frees one that will not be adopted;
    `status` lists what is staged.

    Who may ask what (a hydrator may serve several tenants): the socket is 0600 (0660 with a group) and only
    the peers `peers` admits are answered (SO_PEERCRED); a `hydrate` or `stage` gets a source's bytes only for
    a peer that could read the source file itself; `adopt` and `discard` need the stage's ticket (answered to
    the stager only), another uid cannot stage over a stage, and `status` lists only the asker's own stages.
    """

    def __init__(self, sources: Sequence[str], *, streams: int = 4, driver: Any = None,
                 stage_ttl: float = STAGE_TTL, staging: bool = False, peers: jsonline.Peers | None = None,
                 group: int | None = None, stage_uid_count: int | None = None,
                 stage_uid_bytes: int | None = None) -> None:
        from .._cuda import Driver

        self.driver: Any = driver or Driver()
        self.driver.context()
        self.context = cucall(self.driver, "cuCtxGetCurrent")
        self.device_uuid = device_uuid(self.driver, 0)
        started = time.perf_counter()
        self.sources: dict[str, Mapped] = {}
        self._files: dict[str, int] = {}  # the same files held open: their owner and mode are checked per peer
        for source in sources:
            real = os.path.realpath(source)
            self._files[real] = os.open(real, os.O_RDONLY | os.O_CLOEXEC)
            self.sources[real] = Mapped(real)
        self.map_seconds = time.perf_counter() - started
        for m in self.sources.values():
            m.register(self.driver)
        self.pin_seconds = time.perf_counter() - started - self.map_seconds
        self._streams = [cucall(self.driver, "cuStreamCreate", 1) for _ in range(streams)]
        if stage_ttl <= 0:
            raise HydrationError(f"stage_ttl must be positive, not {stage_ttl}")
        self.staged: dict[str, _Staged] = {}
        self.stage_ttl, self.staging = stage_ttl, staging
        self.peers, self.group = peers or jsonline.Peers(), group
        _free, total = cucall(self.driver, "cuMemGetInfo")
        self.quota = StageQuota.default(int(total), shared=bool(self.peers.uids or self.peers.gids), stages=STAGE_MAX,
                                        count=stage_uid_count, size=stage_uid_bytes)

    def serve(self, path: str) -> None:
        """Answer requests on `path` until the process ends (ready line on stdout once it listens)."""
        with jsonline.listen(path, group=self.group) as listener:
            sys.stdout.write(json.dumps({"ready": True, "map_s": self.map_seconds, "pin_s": self.pin_seconds,
                                         "bytes": sum(m.size for m in self.sources.values()),
                                         "device_uuid": self.device_uuid}) + "\n")
            sys.stdout.flush()
            jsonline.LineServer(listener, self._one, peers=self.peers, idle=self._expire).run()

    def _one(self, conn: socket.socket, peer: jsonline.Peer) -> jsonline.Answer:
        data, fds, _flags, _addr = socket.recv_fds(conn, jsonline.MAX_REQUEST, 1)
        try:
            message = json.loads(jsonline.read_line(conn, data))
            op = message.get("op", "hydrate") if isinstance(message, dict) else None
            if op != "hydrate" and fds:
                raise HydrationError(f"a {op} request carries no descriptor")
            if op == "hydrate":
                if len(fds) != 1:
                    raise HydrationError("a hydrate request carries exactly one allocation descriptor")
                return self._hydrate(message, fds[0], peer)
            if op == "stage":
                return self._stage(message, peer)
            if op == "stage-dump":
                return self._stage_dump(message, peer)
            if op == "adopt":
                return self._adopt(message, peer)
            if op == "discard":
                return {"ok": True, "discarded": self._discard(_stage_key(message), message.get("ticket"))}
            if op == "status":
                now = time.monotonic()
                return {"ok": True, "device_uuid": self.device_uuid, "staged": [
                    {"key": k, "bytes": v.size, "expires_in_s": v.expires - now} for k, v in self.staged.items()
                    if v.owner == peer.uid], "quota": {"count": self.quota.count, "bytes": self.quota.bytes}}
            raise HydrationError(f"unknown request {op!r}")
        finally:
            for fd in fds:
                os.close(fd)

    def _jobs(self, message: dict[str, Any], peer: jsonline.Peer) -> tuple[int, int, tuple[WeightRegion, ...],
                                                                           list[tuple[int, int, int]]]:
        """The request's reservation and regions (validated), and (offset, pinned source address, bytes) copies
        of the sources `peer` may read."""
        try:
            base, size = int(message["base"]), int(message["size"])
            regions = validate_regions([WeightRegion.from_json(r) for r in message["regions"]], base, size)
        except (KeyError, TypeError, ValueError) as exc:
            raise HydrationError(f"malformed request: {type(exc).__name__}: {exc}") from exc
        jobs = []
        for region in (r for r in regions if r.preserved):  # discarded regions: the engine zeroes them
            real = os.path.realpath(region.source)
            src = self.sources.get(real)
            if src is None or src.size < region.offset + region.size:
                raise HydrationError(f"this hydrator does not hold {region.source}", region=region.name)
            if not readable_by(real, os.fstat(self._files[real]), peer):
                raise HydrationError(f"peer uid {peer.uid} may not read {region.source}", region=region.name)
            jobs.append((region.address - base, src.address + region.offset, region.size))
        return base, size, regions, jobs

    def _fill(self, handle: Any, size: int, copy: Callable[[int], object]) -> float:
        """Map `handle` here, `copy` into it (given the mapped address), unmap; the copy's seconds."""
        cu, d = self.driver.cuda, self.driver
        va = 0
        try:
            va = int(cucall(d, "cuMemAddressReserve", size, 0, 0, 0))
            cucall(d, "cuMemMap", va, size, 0, handle, 0)
            map_read_write(d, va, size, 0)
            started = time.perf_counter()
            copy(va)
            return time.perf_counter() - started
        finally:
            if va:
                cu.cuMemUnmap(va, size)
                cu.cuMemAddressFree(va, size)

    def _pinned(self, jobs: Sequence[tuple[int, int, int]]) -> Callable[[int], object]:
        """The copy of `jobs` ((offset, pinned source address, bytes)) into an allocation mapped at its argument."""
        return lambda va: copy_registered(self.driver, [(va + off, src, n) for off, src, n in jobs], self._streams)

    def _hydrate(self, message: dict[str, Any], fd: int, peer: jsonline.Peer) -> dict[str, Any]:
        """Fill an engine's exported allocation. The descriptor is the caller's to close: while it is open, it
        keeps the engine's allocation alive, even after the engine released it."""
        _base, size, _regions, jobs = self._jobs(message, peer)
        started = time.perf_counter()
        handle = cucall(self.driver, "cuMemImportFromShareableHandle", fd, fd_handle(self.driver))
        try:
            copy_s = self._fill(handle, size, self._pinned(jobs))
        finally:
            self.driver.cuda.cuMemRelease(handle)
        return {"ok": True, "import_map_s": time.perf_counter() - started - copy_s, "copy_s": copy_s,
                "bytes": sum(n for _, _, n in jobs)}

    def _stage_slot(self, message: dict[str, Any], peer: jsonline.Peer) -> tuple[str, _Staged | None]:
        """A `stage` or `stage-dump` request's key and the stage it replaces (a retry of the same stage): refused
        when staging is off, for an engine on another GPU, or over another uid's stage."""
        if not self.staging:
            raise HydrationError("staging is off on this hydrator (serve --staging)")
        key = _stage_key(message)
        if message.get("device_uuid") != self.device_uuid:
            raise HydrationError(f"the engine's GPU {message.get('device_uuid')} is not this hydrator's "
                                 f"{self.device_uuid}")
        if (earlier := self.staged.get(key)) is not None and earlier.owner != peer.uid:
            raise HydrationError(f"{key} is staged by another peer")
        return key, earlier

    def _stage_into(self, key: str, earlier: _Staged | None, peer: jsonline.Peer, staged: _Staged,
                    copy: Callable[[int], object], copied: int) -> dict[str, Any]:
        """Replace `earlier`, allocate `staged.size` bytes (within the peer's quota, STAGE_MAX and STAGE_RESERVE;
        a refusal frees nothing, not even `earlier`), `copy` into them
        and keep them as `staged` (its handle, timings, expiry, owner and ticket set here) under `key`."""
        self._expire()
        check_stage_quota(self.staged, key=key, uid=peer.uid, size=staged.size, quota=self.quota)  # before any free
        self._discard(key, earlier.ticket if earlier else "")
        self._room_for(staged.size)
        started = time.perf_counter()
        handle = cucall(self.driver, "cuMemCreate", staged.size, device_allocation(self.driver, 0, exportable=True),
                        0)
        try:
            copy_s = self._fill(handle, staged.size, copy)
        except BaseException:
            self.driver.cuda.cuMemRelease(handle)
            raise
        stage_s = time.perf_counter() - started
        self.staged[key] = replace(staged, handle=handle, stage_s=stage_s, copy_s=copy_s,
                                   expires=time.monotonic() + self.stage_ttl, owner=peer.uid,
                                   ticket=secrets.token_urlsafe(32))
        return {"ok": True, "staged": True, "stage_s": stage_s, "copy_s": copy_s, "bytes": copied,
                "ticket": self.staged[key].ticket}

    def _stage(self, message: dict[str, Any], peer: jsonline.Peer) -> dict[str, Any]:
        """Allocate and fill ahead of the engine's restore; refused for an engine on another GPU. The answer's
        `ticket` is what the engine presents to adopt it."""
        key, earlier = self._stage_slot(message, peer)
        base, size, regions, jobs = self._jobs(message, peer)
        return self._stage_into(key, earlier, peer, _Staged(None, base, size, regions, 0.0, 0.0, 0.0, 0, ""),
                                self._pinned(jobs), sum(n for _, _, n in jobs))

    def _room_for(self, size: int) -> None:
        if len(self.staged) >= STAGE_MAX:
            raise HydrationError(f"{len(self.staged)} allocations are staged already (at most {STAGE_MAX})")
        free, _total = cucall(self.driver, "cuMemGetInfo")
        if int(free) - size < STAGE_RESERVE:
            raise HydrationError(f"staging {size} bytes would leave {int(free) - size} of the GPU's {int(free)} free "
                                 f"bytes (at least {STAGE_RESERVE} stay free)")

    def _stage_dump(self, message: dict[str, Any], peer: jsonline.Peer) -> dict[str, Any]:
        """Fill one allocation from an interposer's device dump (docs/interposer.md) while its process is being
        restored: `parts` are (file, bytes) in the order the interposer maps them back, each file read whole
        through a ring of page-locked buffers. Only files `peer` could read itself, on this hydrator's GPU."""
        key, earlier = self._stage_slot(message, peer)
        parts, fds = _open_dump_parts(message.get("parts"), peer)
        size = sum(r.size for r in parts)
        try:
            return self._stage_into(key, earlier, peer, _Staged(None, 0, size, parts, 0.0, 0.0, 0.0, 0, "", dump=True),
                                    lambda va: copy_ring(self.driver, self.context, parts, lambda r: va + r.address,
                                                         threads=DUMP_THREADS, chunk=DUMP_CHUNK, direct=False,
                                                         opened=fds), size)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _adopt(self, message: dict[str, Any], peer: jsonline.Peer) -> jsonline.Answer:
        """Hand a staged allocation to its engine as a descriptor; the hydrator keeps no reference to it."""
        key = _stage_key(message)
        staged = self.staged.get(key)
        if staged is None or not staged.held_by(message.get("ticket")):  # another's: as if absent
            return {"ok": False, "staged": False, "error": f"nothing is staged for {key}"}
        if staged.dump:  # another layout leaves the stage alone
            if _dump_parts(message.get("parts"), peer) != staged.regions:
                raise HydrationError("the staged allocation was filled from another dump")
        else:
            base, size, regions, _jobs = self._jobs(message, peer)
            if (base, size, regions) != (staged.base, staged.size, staged.regions):
                raise HydrationError("the staged allocation was filled for another layout")
        del self.staged[key]
        try:
            fd = int(cucall(self.driver, "cuMemExportToShareableHandle", staged.handle, fd_handle(self.driver), 0))
        finally:
            self.driver.cuda.cuMemRelease(staged.handle)  # the descriptor keeps the allocation alive
        return {"ok": True, "staged": True, "stage_s": staged.stage_s, "copy_s": staged.copy_s}, [fd]

    def _discard(self, key: str, ticket: object) -> bool:
        staged = self.staged.get(key)
        if staged is None or not staged.held_by(ticket):
            return False
        self._free(key)
        return True

    def _free(self, key: str) -> None:
        self.driver.cuda.cuMemRelease(self.staged.pop(key).handle)

    def _expire(self) -> None:
        """Free what no engine adopted in time (a restore that failed after its worker staged)."""
        now = time.monotonic()
        for key in [k for k, v in self.staged.items() if v.expires <= now]:
            self._free(key)


def _dump_parts(value: Any, peer: jsonline.Peer) -> tuple[WeightRegion, ...]:
    """`_open_dump_parts` for a comparison (an adopt names the dump it expects): the regions, nothing held open."""
    parts, fds = _open_dump_parts(value, peer)
    for fd in fds.values():
        os.close(fd)
    return parts


def _open_dump_parts(value: Any, peer: jsonline.Peer) -> tuple[tuple[WeightRegion, ...], dict[str, int]]:
    """A `stage-dump` request's parts as regions of the staged allocation (address: the offset in it): each a
    whole regular file (not a link) `peer` could read, holding at least its bytes, in order, sizes multiples of
    2 MiB; and
    each file open (by resolved path), so that the copy reads the very file checked, not what the path names
    by then (the peer may own a directory on it and swap a symlink or a FIFO in)."""
    if not isinstance(value, list) or not value:
        raise HydrationError("parts must be a non-empty list of {file, bytes}")
    parts: list[WeightRegion] = []
    fds: dict[str, int] = {}
    at = 0
    try:
        for index, part in enumerate(value):
            if not isinstance(part, dict) or set(part) != {"file", "bytes"} or not isinstance(part["file"], str) \
                    or not isinstance(part["bytes"], int) or isinstance(part["bytes"], bool) or part["bytes"] <= 0 \
                    or part["bytes"] % DUMP_ALIGN or not os.path.isabs(part["file"]):
                raise HydrationError(f"part {index} must be {{file: an absolute path, bytes: a positive multiple "
                                     f"of {DUMP_ALIGN}}}")
            # The directory resolved (links above the dump are the node's own), the file itself never a link:
            # the dump's directory belongs to the engine, which may plant one there.
            real = os.path.join(os.path.realpath(os.path.dirname(part["file"])), os.path.basename(part["file"]))
            if real not in fds:
                fds[real] = _open_readable(real, part["file"], part["bytes"], peer)
            elif os.fstat(fds[real]).st_size < part["bytes"]:
                raise HydrationError(f"dump file {part['file']} is not a regular file of at least {part['bytes']} "
                                     f"bytes")
            parts.append(WeightRegion(f"part-{index}", at, part["bytes"], real, 0, ""))
            at += part["bytes"]
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return tuple(parts), fds


def _open_readable(real: str, named: str, size: int, peer: jsonline.Peer) -> int:
    """Open `real` (a resolved absolute path) for reading as `peer` could: one component at a time, never
    following a link (a link there now was swapped in since `realpath`), each directory searchable by the peer
    and the file a regular one it may read, of at least `size` bytes; opened O_PATH first, so that no FIFO
    or device is ever opened for reading. The descriptor (O_RDONLY)."""
    names = [n for n in real.split("/") if n]
    if not names:
        raise HydrationError(f"dump file {named} is not a regular file of at least {size} bytes")
    path_flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    held = os.open("/", path_flags | os.O_DIRECTORY)
    try:
        for index, name in enumerate(names):
            if not readable_by("/", os.fstat(held), peer, search=True):
                raise HydrationError(f"peer uid {peer.uid} may not read {named}")
            flags = path_flags | (os.O_DIRECTORY if index < len(names) - 1 else 0)
            try:
                opened = os.open(name, flags, dir_fd=held)
            except OSError as exc:
                raise HydrationError(f"dump file {named}: {exc.strerror} (at {name})") from exc
            os.close(held)
            held = opened
        st = os.fstat(held)
        if not stat.S_ISREG(st.st_mode) or st.st_size < size:
            raise HydrationError(f"dump file {named} is not a regular file of at least {size} bytes")
        if not readable_by("/", st, peer, search=False):
            raise HydrationError(f"peer uid {peer.uid} may not read {named}")
        return os.open(f"/proc/self/fd/{held}", os.O_RDONLY | os.O_CLOEXEC)  # the same inode, for reading
    finally:
        os.close(held)


def _stage_key(message: dict[str, Any]) -> str:
    """A stage's key: the manifest digest it was filled for (`sha256:` and 64 hex digits)."""
    key = message.get("key")
    if not isinstance(key, str) or not key.startswith("sha256:") or len(key) != 71 or \
            any(c not in "0123456789abcdef" for c in key[7:]):
        raise HydrationError(f"key must be a manifest digest (sha256: and 64 lowercase hex digits), not {key!r:.80}")
    return key


class Stager(StageRequest):
    """The restore worker's side of staging: while CRIU and CUDA restore the engine, the hydrator named in the
    manifest fills an allocation for it on the engine's GPU, which the engine then adopts when asked to hydrate.

    Best effort by design: whatever goes wrong here is reported and the engine hydrates the regular way.
    """

    def __init__(self, manifest: HydrationManifest) -> None:
        self.manifest = manifest
        super().__init__(manifest.hydrator, "coldsnap-stage")

    def _ask(self) -> dict[str, Any]:
        from .._cuda import Driver

        driver = Driver()
        driver.call("cuInit", 0)
        uuid = device_uuid(driver, self.manifest.device)
        return jsonline.request(self.hydrator, self.manifest.stage_request("stage", device_uuid=uuid), timeout=600.0)

    def _discard(self) -> dict[str, Any]:
        return self.manifest.stage_request("discard", ticket=self.ticket)

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait for the stage request's answer (the hydrator serves it before the engine's adopt)."""
        return self.report if self.wait(timeout) else {"staged": False, "error": "still staging"}

"""The node hydrator's device tier (issue 35): a copy of each device dump it staged, kept on its own GPU, so that
the next stage of the same dump is a copy within the GPU's memory instead of one over the host link.

Why: a stage of 16 GB from the RAM tier takes the link for 0.30 s on the H200, and the engine's own CUDA restore
runs beside it on the same link (0.25 s alone, +0.32 s per second of overlap: session 12's 100 restores). A GPU
with room to spare between restores (an engine scaled to zero leaves all of it) can keep the dump where the next
restore needs it; the stage is then a device-to-device copy (HBM, milliseconds) and the link is the CUDA
restore's alone. At 64 GiB the stage is the restore's largest part (1.15 s at the link's rate).

What is kept: whole stages, one entry per what the stage copies (a dump's layout and the identities of its files
as the stage's peer opened them, `_ram_tier.identity`; a weights stage's pieces of the hydrator's own held files),
filled right after a stage that missed the tier, from that stage's allocations,
before the stage is ready (its engine has not adopted it yet, so the bytes are the dump's). An entry serves a
stage only for descriptors its peer opened in its own view (`_peer_files.open_dump_parts`, as for a RAM tier hit),
whatever uid kept it: a hit gives a peer the bytes of files it could read itself. A file replaced, truncated or
rewritten is another identity (a miss), and a file whose identity changed while its stage was filled is not kept;
an entry whose files were removed or changed is dropped soon after the hydrator's next idle call (`prune`), so a
collected capture's GPU memory comes back within a second.

Descriptors: an entry's are the peer's files, on a filesystem the peer may control (its own FUSE mount), where an
fstat or a close waits for the peer's answer. So they are looked at (`_stale`) and closed only on the tier's own
files thread, never under a lock nor on a connection's or the accept thread: a filesystem that never answers holds
that thread alone (then keeping stops once CLOSE_BACKLOG descriptors wait: `skipped.closing`), and make_room, which
runs under the hydrator's lock, frees device memory only. One thread both checks and closes, so a descriptor it
checks is never closed (and its number reused) meanwhile.

Budget: the entries' bytes stay within `budget` (0: off; `serve --device-tier-bytes`), and an entry is made only
while the GPU keeps `reserve` bytes free beside it. Room is made as the RAM tier makes it (max-min between the uids
that kept entries, least recently used first, never an entry a stage is copying from), and a stage that lacks
device memory takes it from the tier first (`make_room`): the tier is a cache, a stage is a restore in flight.
Entries unused for `ttl` seconds go. Memory the tier holds is memory engines cannot allocate: an operator sizes it
for the GPU's idle room.

Locking: the entries and counters are read and changed only under `self._lock`, one hold per check-then-act; an
entry's allocation and copy run outside it, on a reservation (`ready` false: never matched, never evicted).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import HydrationError
from ._copy import Piece
from ._peer_files import DumpLayout
from ._ram_tier import Identity, fair_victims, identity
from ._vmm import cucall, device_allocation, map_read_write

__all__ = ("CLOSE_BACKLOG", "DEVICE_TIER_TTL", "DeviceTier", "dump_name", "weights_name")

DEVICE_TIER_TTL = 600.0  # seconds an entry stays unused before it goes (`serve --device-tier-ttl`)
_PIECE = 256 << 20  # a device copy's piece: pieces go round the copy's streams
CLOSE_BACKLOG = 256  # descriptors waiting for the files thread beyond which no entry is kept (module docstring)
Copy = Callable[[int], object]  # a copy into the range mapped at its argument (as _stage_copy.Copy)
_Name = tuple[Any, ...]  # what an entry holds: `dump_name` or `weights_name`


@dataclass(eq=False)
class _Entry:
    owner: int  # the uid whose stage made it: its bytes count to that uid's share
    size: int
    handles: tuple[Any, ...] = ()  # made so far, each of `sizes`' bytes in order, mapped back to back from `va`
    sizes: tuple[int, ...] = ()
    va: int = 0
    fds: Mapping[str, int] | None = None  # duplicated, to see a file removed or changed (`prune`)
    ids: Mapping[str, Identity] | None = None
    used: float = 0.0  # monotonic: the last fill or hit
    users: int = 0  # stages copying from it now: never evicted while above 0
    ready: bool = False


class DeviceTier:
    """Dumps kept in device memory of the hydrator's context (module docstring)."""

    def __init__(self, budget: int, *, driver: Any, context: Any, total: int, reserve: int, streams: int,
                 ttl: float = DEVICE_TIER_TTL, pending: Callable[[], int] = lambda: 0) -> None:
        if not 0 <= budget <= total - reserve:
            raise HydrationError(f"device_tier_bytes must be 0 (off) or a size up to the GPU's {total} bytes less "
                                 f"the {reserve} a stage keeps free, not {budget}")
        self.budget, self.reserve, self.streams, self.ttl = budget, reserve, streams, ttl
        self._driver, self._context = driver, context
        self._pending = pending  # device bytes the hydrator's stages reserved and have not allocated yet
        self._lock = threading.Lock()
        self._entries: dict[_Name, _Entry] = {}  # least recently used first
        self.hits = self.misses = self.kept = self.evictions = self.dropped = 0
        self.copied_bytes = 0  # bytes stages copied from the tier (its `stages`' bytes: the metrics' read_bytes)
        self.skipped: dict[str, int] = {"too_large": 0, "no_room": 0, "changed": 0, "failed": 0, "closing": 0}
        self.last_error = ""
        # The files thread's work: descriptors to close, or None: look for entries whose files changed (`_check`).
        self._files: queue.SimpleQueue[Mapping[str, int] | None] = queue.SimpleQueue()
        self._closing = 0  # descriptors queued and not closed yet
        self._checking = False  # a check queued or running: the idle call queues at most one
        if budget:
            threading.Thread(target=self._files_loop, name="coldsnap-device-tier-files", daemon=True).start()

    def take(self, name: _Name) -> tuple[_Name, _Entry] | None:
        """The entry `name` (`dump_name`, `weights_name`), marked in use until `give_back`; None when the tier is
        off or holds none."""
        if not self.budget:
            return None
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or not entry.ready:
                self.misses += 1
                return None
            entry.users += 1
            self._entries[name] = self._entries.pop(name)  # most recently used last
            self.hits += 1
            return name, entry

    def give_back(self, taken: tuple[_Name, _Entry], copied: int) -> None:
        """A stage's copy from the entry ended (done or failed; `copied` bytes if done)."""
        with self._lock:
            taken[1].users -= 1
            taken[1].used = time.monotonic()
            self.copied_bytes += copied

    def copy_from(self, entry: _Entry) -> Copy:
        """The copy of `entry` into a stage's allocations of the same layout, mapped at the argument."""
        return lambda va: self._device_copy(va, entry.va, entry.size)

    def keeping(self, name: _Name, fds: Mapping[str, int], sizes: tuple[int, ...], owner: int, copy: Copy) -> Copy:
        """`copy` (a stage's fill that missed the tier: of the files open as `fds`, none for the weights the
        hydrator holds itself), then, best effort, its result kept as entry `name` (never the stage's failure: a
        refusal is counted in `skipped`)."""
        if not self.budget:
            return copy
        before = _identities(fds)

        def fill_and_keep(va: int) -> object:
            done = copy(va)
            self._keep(name, fds, before, sizes, owner, va)
            return done
        return fill_and_keep

    def _keep(self, name: _Name, fds: Mapping[str, int], before: Mapping[str, Identity], sizes: tuple[int, ...],
              owner: int, va: int) -> None:
        size = sum(sizes)
        with self._lock:
            if name in self._entries:  # kept already, or being kept by another stage
                return
            if size > self.budget:
                self.skipped["too_large"] += 1
                return
            if self._closing > CLOSE_BACKLOG:  # the files thread is held by a filesystem: keep no more descriptors
                self.skipped["closing"] += 1
                return
            evicted = self._room_for(size, owner)
            if evicted is None:
                self.skipped["no_room"] += 1
                return
            entry = self._entries[name] = _Entry(owner, size)
        for old in evicted:
            self._release(old)
        try:
            free, _total = cucall(self._driver, "cuMemGetInfo")
            if int(free) - self._pending() - size < self.reserve:  # a stage in flight comes first
                raise _Skip("no_room")
            self._allocate(entry, sizes)
            self._device_copy(entry.va, va, size)
            if _identities(fds) != before:  # a file changed while the stage read it
                raise _Skip("changed")
            entry.fds = _dup_all(fds)
            entry.ids = before
        except Exception as exc:
            with self._lock:
                del self._entries[name]
                reason = exc.reason if isinstance(exc, _Skip) else "failed"
                self.skipped[reason] += 1
                if reason == "failed":
                    self.last_error = f"{type(exc).__name__}: {exc}"[:500]
            self._release(entry)
            return
        with self._lock:
            entry.used, entry.ready = time.monotonic(), True
            self.kept += 1

    def _allocate(self, entry: _Entry, sizes: tuple[int, ...]) -> None:
        """The entry's allocations, mapped back to back in a range of its own, read-write for this GPU."""
        d = self._driver
        prop = device_allocation(d, 0, exportable=False)
        entry.va = int(cucall(d, "cuMemAddressReserve", entry.size, 0, 0, 0))
        at = entry.va
        for n in sizes:
            entry.handles += (cucall(d, "cuMemCreate", n, prop, 0),)
            cucall(d, "cuMemMap", at, n, 0, entry.handles[-1], 0)
            entry.sizes += (n,)
            at += n
        map_read_write(d, entry.va, entry.size, 0)

    def _device_copy(self, dst: int, src: int, size: int) -> None:
        """`size` bytes from `src` to `dst` on this GPU, in pieces round the copy's own streams; done on return
        (nothing in flight, also after a failure)."""
        cucall(self._driver, "cuCtxSetCurrent", self._context)
        streams: list[Any] = []
        try:
            for _ in range(self.streams):
                streams.append(cucall(self._driver, "cuStreamCreate", 1))
            for index, offset in enumerate(range(0, size, _PIECE)):
                cucall(self._driver, "cuMemcpyDtoDAsync", dst + offset, src + offset, min(_PIECE, size - offset),
                       streams[index % len(streams)])
        finally:
            for stream in streams:
                self._driver.cuda.cuStreamSynchronize(stream)
                self._driver.cuda.cuStreamDestroy(stream)

    def make_room(self, need: int) -> int:
        """Evict entries no stage is using, least recently used first, until `need` bytes of device memory came
        back (a stage in flight lacks them); the bytes given back."""
        with self._lock:
            chosen: list[_Entry] = []
            for name, entry in list(self._entries.items()):
                if sum(e.size for e in chosen) >= need:
                    break
                if entry.ready and not entry.users:
                    chosen.append(self._entries.pop(name))
            self.evictions += len(chosen)
        for entry in chosen:
            self._release(entry)
        return sum(entry.size for entry in chosen)

    def prune(self) -> None:
        """Drop the entries unused for `ttl` seconds, and have the files thread drop those whose files were removed
        or changed (never a hit again). The hydrator's idle call: it never touches a descriptor."""
        now = time.monotonic()
        with self._lock:
            stale = [name for name, entry in self._entries.items() if entry.ready and not entry.users and
                     now - entry.used > self.ttl]
            dropped = [self._entries.pop(name) for name in stale]
            self.dropped += len(dropped)
            check, self._checking = bool(self.budget) and not self._checking, True
        for entry in dropped:
            self._release(entry)
        if check:
            self._files.put(None)

    def _files_loop(self) -> None:
        """The files thread: closes what `_release` queued, and runs the checks `prune` queued."""
        while True:
            work = self._files.get()
            if work is None:
                self._check()
                continue
            for fd in work.values():
                os.close(fd)
            with self._lock:
                self._closing -= len(work)

    def _check(self) -> None:
        """On the files thread: drop the entries no stage is using whose files were removed or changed."""
        with self._lock:
            idle = [(name, entry) for name, entry in self._entries.items() if entry.ready and not entry.users]
        stale = [(name, entry) for name, entry in idle if _stale(entry)]  # outside the lock: fstat may wait
        with self._lock:
            dropped = [self._entries.pop(name) for name, entry in stale
                       if self._entries.get(name) is entry and not entry.users]
            self.dropped += len(dropped)
            self._checking = False
        for entry in dropped:
            self._release(entry)

    def beside(self, ram: dict[str, Any]) -> dict[str, Any]:
        """The RAM tier's `status` with this tier's stages and bytes beside its own per tier (the daemon's metrics
        read them by tier: coldsnap_provider/_hydrator_stages.py)."""
        with self._lock:
            ram["stages"]["device"], ram["read_bytes"]["device"] = self.hits, self.copied_bytes
        return ram

    def status(self) -> dict[str, Any]:
        """The tier's state and counters (no digest nor path: the tier is shared by every tenant)."""
        with self._lock:
            ready = [e for e in self._entries.values() if e.ready]
            return {"budget": self.budget, "entries": len(ready), "bytes": sum(e.size for e in ready),
                    "in_use": sum(e.users > 0 for e in ready), "hits": self.hits, "misses": self.misses,
                    "kept": self.kept, "evictions": self.evictions, "dropped": self.dropped,
                    "skipped": dict(self.skipped), "copied_bytes": self.copied_bytes, "last_error": self.last_error,
                    "closing": self._closing}

    def close(self) -> None:
        """Free every entry (none may be in use: the hydrator stops)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for entry in entries:
            self._release(entry)

    def _room_for(self, size: int, owner: int) -> list[_Entry] | None:
        """Under the lock: take out entries no stage is using until `size` more bytes of `owner`'s fit the budget,
        each time the least recently used of the uid holding the most among `owner` and the uids holding more
        than `owner` will (as the RAM tier's Shares); those taken out (to free outside the lock), or None (none
        taken) when they cannot."""
        if (chosen := fair_victims(self._entries, size, owner, self.budget)) is None:
            return None
        self.evictions += len(chosen)
        return [self._entries.pop(name) for name in chosen]

    def _release(self, entry: _Entry) -> None:
        """An entry out of the table: unmapped, its allocations and range freed now, its descriptors queued for the
        files thread (module docstring: never closed here, maybe under the hydrator's lock)."""
        if entry.handles or entry.va:
            cu = self._driver.cuda
            cucall(self._driver, "cuCtxSetCurrent", self._context)
            at = entry.va
            for index, handle in enumerate(entry.handles):
                if index < len(entry.sizes):  # mapped (a failed cuMemMap leaves its handle unmapped)
                    cu.cuMemUnmap(at, entry.sizes[index])
                    at += entry.sizes[index]
                cu.cuMemRelease(handle)
            if entry.va:
                cu.cuMemAddressFree(entry.va, entry.size)
        if entry.fds:
            with self._lock:
                self._closing += len(entry.fds)
            self._files.put(entry.fds)


class _Skip(Exception):
    """An entry not kept, for a reason counted in `skipped` (not a failure)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def dump_name(layout: DumpLayout, fds: Mapping[str, int]) -> _Name:
    """A device dump's entry: what its stage copies, the layout (zero masks included) of its files as the peer
    opened them. Not the stage's key: a manifest's digest names a restore (its generation), not the bytes."""
    return "dump", layout, frozenset(_identities(fds).items())


def weights_name(size: int, pieces: Sequence[Piece]) -> _Name:
    """A weights stage's entry: what it copies, the pieces of the hydrator's own held files (held for its life:
    their mappings are the bytes) into an allocation of `size` bytes."""
    return "weights", size, tuple(pieces)


def _identities(fds: Mapping[str, int]) -> dict[str, Identity]:
    return {named: identity(fd) for named, fd in fds.items()}


def _stale(entry: _Entry) -> bool:
    """Whether one of the entry's files lost its last link or is no longer what its identity says."""
    for named, fd in (entry.fds or {}).items():
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if st.st_nlink == 0 or (entry.ids is not None and ident != entry.ids.get(named)):
            return True
    return False


def _dup_all(fds: Mapping[str, int]) -> dict[str, int]:
    duplicated: dict[str, int] = {}
    try:
        for named, fd in fds.items():
            duplicated[named] = os.dup(fd)
    except OSError:
        for fd in duplicated.values():
            os.close(fd)
        raise
    return duplicated

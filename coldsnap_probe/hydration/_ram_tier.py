"""The node hydrator's RAM tier: device dumps it staged, kept mapped and page-locked across restores, so that the
next stage of the same dump is one DMA per piece from host memory at the link's rate (`_copy.Pinned`), with no
reader thread copying from the page cache through the ring (`_copy.Pread`, the disk tier).

What is held: whole dumps, one entry per (manifest digest, the identities of its files and the runs of each that
its stages read: `reads`, `_peer_files.dump_reads`). Only those runs are pinned, and counted against the budget: a
file is the peer's own, and may be far larger than what its stage reads (a stage of 2 MiB naming a file of
hundreds of GB would otherwise pin and read all of it, and evict every other tenant's entries for it); and a
dump's chunks of zeros are holes that no stage reads (set on the device): pinning them would fill tmpfs with pages
of zeros and count them against the budget (a JAX engine's 35 GB dump is half zeros: whole, it never fit the
default budget; its 18 GB of data do). A file's identity is
(device, inode, size, mtime, ctime) of the descriptor the peer opened: a file replaced (another inode; the held
mapping keeps the old inode alive, so its number is not reused meanwhile), truncated or rewritten (its times)
is another identity, so its entry never serves it: the stage misses and reads the file as it is now. A file
changed in place after it was held shows through the shared mapping anyway; a file changed while it was being
held is not held (its identity is taken again once it is pinned).

Serving (`lease`): only for the descriptors a stage's peer opened in its own view (`_peer_files.open_dump_parts`,
as for a miss), so a hit gives a peer the bytes of exactly the files it could read itself; the entry's mappings
are then read at their addresses. A lease marks the entry in use until the stage's copy ends: an entry in use is
never evicted.

Loading (`load_later`): never on a restore's critical path. A miss stages through the ring as before; then the
dump (or one a capture offered: `_warm.py`) is queued (descriptors duplicated, at most LOAD_QUEUE waiting, a dump
already held or queued once) for the loader thread, which maps each file from its descriptor, pins it (the
hydrator's `cuMemHostRegister`) in pieces of PIN_PIECE bytes, LOAD_THREADS pieces at once, and checks its identity
again, every thread at the lowest CPU priority.

A load yields to restores (issue 35: on the H200 a stage that came while a warm pinned 16 GB in whole files waited
1.29 s, its allocations queued behind the driver's registrations): the hydrator wraps every copy on a restore's
path in `copying()` and holds a `pause()` from a stage's request until its engine adopts it (or it is dropped), and
meanwhile the loader pins no further piece (`loader_paused_s`); a restore waits at most for the pieces in flight.
The loader yields for at most LOADER_YIELD_S before each piece, though: restores that never stop (a tenant starting
stage after stage, a peer that holds its request open) may slow everyone's loads to a round of pieces per
LOADER_YIELD_S, never stop them (`loader_forced`: the pieces pinned while restores were in flight).
A stage of a dump still being loaded joins it (`joins`): its lease names the pieces pinned so far (`Lease.pinned`),
the stage copies those from the pinned mappings and reads only the rest from the files (`Lease.split`), and the
load goes on after it. A stage of a dump of which nothing is pinned yet misses (`misses_loading`). A stage never
waits for a load.

Budget: the bytes held, entries being loaded included, stay within `budget` (0: the tier is off). Room is made by
evicting entries no stage is using; a dump that would not fit even so (larger than the budget, or the rest in use
or another tenant's share) is not held, and counted as `skipped`. A pinned dump on tmpfs costs no memory beyond
the file's own pages; one on a disk's filesystem keeps its page cache resident: the default budget
(`default_budget`) is a quarter of the node's memory (its cgroup's limit, if lower).

Shares: the tier is every tenant's, so each entry is counted to the peer uid whose stage loaded it (its `owner`), and
a load evicts only its owner's own entries or those of a uid that holds more than the owner will once the load is
in, from the uid that holds the most, least recently used first (max-min fairness, as each manager's share of the
capture store's fetch threads bounds one manager's pulls). One tenant alone may fill the whole budget; once others
load, its entries make room for theirs until they hold alike, and its own misses then evict its own entries, never
theirs: one tenant's stages, however many, cannot empty the tier of the others'. A hit of another uid's entry
serves it (the same files, read in the asker's own view); the entry stays its owner's. The load queue holds at most
QUEUE_PER_UID dumps of one uid, so one tenant's misses cannot keep the others' out of it.

Locking: the entries, their use counts, what each load has pinned so far and the counters are read and changed
only under `self._lock`, in one hold per check-then-act; pinning and unpinning (slow: hundreds of ms for tens of
GB) run outside it, so a lease never waits for them. A load that fails unpins only once no stage that joined it
still copies from it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..errors import HydrationError
from ._copy import ZEROS, Piece
from ._digests import DIGEST_CHUNK
from ._peer_files import Runs, merge_runs
from ._vmm import Mapped

__all__ = ("LOADER_YIELD_S", "LOAD_QUEUE", "LOAD_THREADS", "PIN_PIECE", "QUEUE_PER_UID", "TIERS", "Identity", "Lease",
           "RamTier", "Shared", "default_budget", "fair_victims", "identity", "node_memory", "pin_pieces")

LOAD_QUEUE = 2  # dumps waiting for the loader: a later miss queues the dump again
QUEUE_PER_UID = 1  # of those, one peer uid's: the other place stays free for another tenant's miss
# Pieces of a dump pinned at once: pinning 8 GiB of tmpfs took 4.5 s on one thread (4 KiB pages, H200).
LOAD_THREADS = 4
# A load's registration: a stage waits at most for the pieces in flight (4 KiB pages: ~35 ms each on the H200),
# and a copy from the tier never spans two registrations (`Lease.split` cuts at them).
PIN_PIECE = DIGEST_CHUNK
# The longest the loader waits for restores' copies before pinning its next piece anyway: a restore that overlaps
# it sees a round of LOAD_THREADS pieces (~35 ms each on the H200) at most every LOADER_YIELD_S (~2 % of its time),
# and the loads of every tenant progress however many stages one tenant keeps in flight (review of issue 34).
LOADER_YIELD_S = 2.0
TIERS = ("ram", "disk")  # where a stage's bytes were read: the RAM tier, or the files (page cache or disk)
_K = TypeVar("_K")  # an entry's name in its tier
Identity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns
_Name = tuple[str, frozenset[tuple[Identity, Runs]]]  # the manifest digest; its files' identities and runs read
_SKIPS = ("too_large", "no_room", "failed")


def identity(fd: int) -> Identity:
    """The identity of the file open as `fd`."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def node_memory() -> int:
    """The node's memory for this process: MemTotal, or its cgroup's memory.max when that is lower."""
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as limit:
            text = limit.read().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:  # cgroup v1, or none mounted: the node's memory
        pass
    return total


def default_budget() -> int:
    """A quarter of the node's memory (`node_memory`)."""
    return node_memory() // 4


def pin_pieces(runs: Runs) -> Runs:
    """The runs cut into the registrations a load pins one at a time, PIN_PIECE bytes at most each."""
    return tuple((offset + at, min(PIN_PIECE, n - at)) for offset, n in runs for at in range(0, n, PIN_PIECE))


@dataclass(eq=False)
class _Dump:
    """One held dump: its files' pinned mappings by identity (empty until loaded)."""

    size: int
    owner: int  # the peer uid whose stage's miss loaded it: its bytes count to that uid's share
    files: dict[Identity, Mapped] = field(default_factory=dict)  # filled as the load maps each file
    fds: dict[Identity, int] = field(default_factory=dict)  # each file's descriptor, kept to see it removed
    # Invariant: each file's registrations done so far, as they completed (all of `pin_pieces` once ready); only
    # grows.
    pinned: dict[Identity, list[tuple[int, int]]] = field(default_factory=dict)
    users: int = 0  # stages copying from it now (leases): never evicted nor unpinned while above 0
    ready: bool = False  # loaded and pinned: a hit; before, a stage joins what is pinned
    failed: bool = False  # its load failed: no stage joins it, it goes once no stage uses it


@dataclass(frozen=True)
class Lease:
    """A hit (`complete`) or a join of a load: each part file, as the stage's peer named it, to its first byte in
    the mapping and to the runs of it pinned (one registration each); the entry stays in use until the lease is
    released."""

    addresses: Mapping[str, int]
    pinned: Mapping[str, Runs]  # each file's registrations, in order
    size: int
    complete: bool
    release: Callable[[], None]  # once, when the stage's copy has ended (done or failed)

    def split(self, pieces: Sequence[Piece]) -> tuple[list[Piece], list[Piece]]:
        """`pieces` as the ones to copy from the pinned mappings (cut at the registrations; the runs of zeros,
        which read nothing, with them) and the rest, to read from the files."""
        held: list[Piece] = []
        rest: list[Piece] = []
        for piece in pieces:
            if piece.source == ZEROS:
                held.append(piece)
                continue
            at, end = piece.offset, piece.offset + piece.size
            for offset, n in self.pinned.get(piece.source, ()):  # in order (`RamTier.lease`)
                low, high = max(at, offset), min(end, offset + n)
                if low >= high:
                    continue
                if low > at:
                    rest.append(_part(piece, at, low))
                held.append(_part(piece, low, high))
                at = high
            if at < end:
                rest.append(_part(piece, at, end))
        return held, rest


def _part(piece: Piece, start: int, end: int) -> Piece:
    """The bytes [start, end) of `piece`'s source, to where they go in its destination."""
    return Piece(piece.dst + start - piece.offset, piece.source, start, end - start)


class RamTier:
    """Device dumps kept page-locked, within `budget` bytes (module docstring). `pin` page-locks a run (offset,
    bytes) of a mapping for the copy engine, one registration, and `unpin` undoes them all and unmaps (the
    hydrator's driver calls, in its context)."""

    def __init__(self, budget: int, *, pin: Callable[[Mapped, tuple[int, int]], None],
                 unpin: Callable[[Mapped], None], yield_s: float = LOADER_YIELD_S) -> None:
        if budget < 0:
            raise HydrationError(f"the RAM tier's budget must be 0 (off) or a number of bytes, not {budget}")
        self.budget, self._pin, self._unpin, self._yield_s = budget, pin, unpin, yield_s
        self._lock = threading.Lock()
        self._held: collections.OrderedDict[_Name, _Dump] = collections.OrderedDict()  # least recently used first
        # Each: the dump's name, its owner (peer uid), its files' descriptors (the tier's own duplicates).
        self._queue: collections.deque[tuple[_Name, int, dict[Identity, int]]] = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self.hits = self.misses = self.evictions = self.loads = self.dropped = 0
        self.skipped = dict.fromkeys(_SKIPS, 0)
        self.misses_loading = 0  # of the misses, those of a dump the loader was pinning then
        self.joins = 0  # stages that copied what a load had pinned so far and read the rest
        self.loader_paused_s = 0.0  # the loader's thread-seconds spent waiting for restores' copies
        self.loader_forced = 0  # pieces pinned while restores' copies ran, after waiting yield_s for them
        self._copies = 0  # copies on a restore's path running now (`copying`): the loader pins nothing meanwhile
        self.read_bytes = dict.fromkeys(TIERS, 0)  # bytes staged from each tier
        self.stages = dict.fromkeys(TIERS, 0)  # stages filled from each tier (the hydrator's own count: metrics)
        self.last_error = ""  # the loader's last failure (a dump not held), for `status`
        self._loader: threading.Thread | None = None
        if budget:
            self._loader = threading.Thread(target=self._load_loop, name="coldsnap-ram-tier", daemon=True)
            self._loader.start()

    def lease(self, key: str, fds: Mapping[str, int], reads: Mapping[str, Runs]) -> Lease | None:
        """The held dump of `key` whose files are the ones open as `fds` (each part file as the peer named it, to
        the descriptor it opened), of which its stage reads the runs `reads` (named alike; a file it reads nothing
        of is not held), in use until the lease ends: whole (a hit) or, while it is being loaded, what is pinned
        so far (a join); None (a miss) when the tier holds no such dump or has pinned none of it yet."""
        if not self.budget:
            return None
        ids = {named: identity(fd) for named, fd in fds.items() if named in reads}
        name = (key, frozenset(_reads(ids, reads).items()))
        with self._lock:
            dump = self._held.get(name)
            if dump is None or dump.failed or not any(dump.pinned.values()):
                self.misses += 1
                self.misses_loading += dump is not None  # nothing pinned yet (a warm's load): never waited for
                return None
            dump.users += 1
            if dump.ready:
                self._held.move_to_end(name)
                self.hits += 1
            else:
                self.joins += 1
            addresses = {named: dump.files[ident].address for named, ident in ids.items() if ident in dump.files}
            pinned = {named: tuple(sorted(dump.pinned.get(ident, ()))) for named, ident in ids.items()}
        return Lease(addresses, pinned, dump.size, dump.ready, lambda: self._release(dump))

    def _release(self, dump: _Dump) -> None:
        with self._lock:
            dump.users -= 1
            self._wake.notify_all()  # a failed load waits for its last user to unpin

    def pause(self) -> Callable[[], None]:
        """A restore is in flight (a stage, from its request until its engine adopts it): the loader pins no
        further piece until the call returned is made (once; a second does nothing)."""
        ended = threading.Event()
        with self._lock:
            self._copies += 1

        def resume() -> None:
            with self._lock:
                if not ended.is_set():
                    ended.set()
                    self._copies -= 1
                    self._wake.notify_all()
        return resume

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """A copy on a restore's path (a request to stage or hydrate) runs inside: `pause` for its length."""
        resume = self.pause()
        try:
            yield
        finally:
            resume()

    def _quiet(self) -> None:
        """The loader's wait before each piece: until no restore's copy runs, or for yield_s at most; a
        HydrationError once closed."""
        with self._lock:
            started = time.perf_counter()
            if not self._wake.wait_for(lambda: not self._copies or self._closed, timeout=self._yield_s):
                self.loader_forced += 1
            self.loader_paused_s += time.perf_counter() - started
            if self._closed:
                raise HydrationError("the RAM tier closed while a dump was being held")

    def staged(self, key: str, fds: Mapping[str, int], reads: Mapping[str, Runs], lease: Lease | None,
               ram: int, disk: int, *, owner: int) -> str:
        """After a stage copied `ram` bytes from `lease`'s pinned mappings and `disk` from the files open as
        `fds` (their runs `reads`), for a peer of uid `owner`: its bytes counted under the tier that served them,
        the stage under the one that served most, a miss's dump queued for loading (`load_later`); that tier's
        name (TIERS), or `joined` for a stage that joined a load and read from both."""
        tier = "ram" if lease is not None and ram >= disk else "disk"
        with self._lock:
            self.read_bytes["ram"] += ram
            self.read_bytes["disk"] += disk
            self.stages[tier] += 1
        if lease is None:
            self.load_later(key, fds, reads, owner=owner)
        return "joined" if ram and disk else tier

    def load_later(self, key: str, fds: Mapping[str, int], reads: Mapping[str, Runs], *, owner: int = 0) -> bool:
        """Queue the runs `reads` (named as in `fds`) of the dump of `key` in the files open as `fds` for the
        loader, counted to peer uid `owner` (their descriptors duplicated: the caller's stay its own); False when
        the tier is off, holds or queued it already, the queue has no place for `owner`, nothing of it is read, or
        the descriptors could not be duplicated (the process's limit: counted as `failed`, never the stage's
        failure)."""
        if not self.budget or not any(reads.get(named) for named in fds):
            return False
        ids = {named: identity(fd) for named, fd in fds.items() if named in reads}
        files = {ids[named]: fds[named] for named in ids}
        name = (key, frozenset(_reads(ids, reads).items()))
        with self._lock:
            if name in self._held or any(queued == name for queued, _, _ in self._queue) or self._closed or \
                    len(self._queue) >= LOAD_QUEUE or sum(uid == owner for _, uid, _ in self._queue) >= QUEUE_PER_UID:
                return False
            try:
                duplicated = _dup_all(files)
            except OSError as exc:
                self.skipped["failed"] += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                return False
            self._queue.append((name, owner, duplicated))
            self._wake.notify()
        return True

    def status(self) -> dict[str, Any]:
        """The tier's state and counters (no digest nor path: the tier is shared by every tenant)."""
        with self._lock:
            return {"budget": self.budget, "entries": sum(d.ready for d in self._held.values()),
                    "bytes": sum(d.size for d in self._held.values()),
                    "in_use": sum(d.users > 0 for d in self._held.values()),
                    "loading": len(self._queue),
                    "hits": self.hits, "misses": self.misses, "evictions": self.evictions, "loads": self.loads,
                    "dropped": self.dropped, "skipped": dict(self.skipped), "read_bytes": dict(self.read_bytes),
                    "stages": dict(self.stages),
                    "bytes_by_uid": {str(uid): n for uid, n in _by_owner(self._held.values()).items()},
                    "last_error": self.last_error, "misses_loading": self.misses_loading, "joins": self.joins,
                    "loader_paused_s": round(self.loader_paused_s, 3), "loader_forced": self.loader_forced,
                    "loading_pinned_bytes": sum(n for d in self._held.values() if not d.ready
                                                for runs in d.pinned.values() for _offset, n in runs)}

    def close(self) -> None:
        """Stop the loader and unpin every entry (none may be in use)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._loader is not None:
            self._loader.join()
        with self._lock:
            dumps, queued = list(self._held.values()), list(self._queue)
            self._held.clear()
            self._queue.clear()
        for _name, _owner, fds in queued:
            _close_all(fds)
        for dump in dumps:
            self._drop(dump)

    def prune(self) -> None:
        """Drop the held dumps no stage is using whose files were removed (a capture collected: its memory comes
        back now, not once the LRU reaches it) or changed since (never a hit again). The hydrator's idle call."""
        with self._lock:
            stale = [name for name, dump in self._held.items() if dump.ready and not dump.users and
                     any(_stale(fd, ident) for ident, fd in dump.fds.items())]
            dumps = [self._held.pop(name) for name in stale]
            self.dropped += len(dumps)
        for dump in dumps:
            self._drop(dump)

    def _load_loop(self) -> None:
        _lowest_priority()
        while True:
            with self._lock:
                self._wake.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                name, owner, fds = self._queue[0]
            kept = False
            try:
                kept = self._load(name, owner, fds)
            except Exception as exc:  # a driver refusal (unpinning): said in `status`, and the loader goes on
                with self._lock:
                    self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                if not kept:
                    _close_all(fds)
                with self._lock:
                    self._queue.popleft()
                    self._wake.notify_all()

    def _load(self, name: _Name, owner: int, fds: Mapping[Identity, int]) -> bool:
        """Reserve room for `owner`'s dump (evicting), map and pin it (`_map_and_pin`), then make it ready,
        keeping `fds`; a file whose identity changed meanwhile, or a failed pin, gives everything back. Whether it
        kept `fds`."""
        runs = dict(name[1])
        size = sum(n for file_runs in runs.values() for _offset, n in file_runs)
        with self._lock:
            victims = self._room_for(size, owner)
            if victims is None:
                self.skipped["too_large" if size > self.budget else "no_room"] += 1
                return False
            dump = self._held[name] = _Dump(size, owner)
        try:  # a victim's failed unpin (or no thread to pin with): the room reserved is given back, not kept for ever
            for victim in victims:
                self._drop(victim)
            failed = self._map_and_pin(dump, fds, runs)
        except BaseException:
            self._give_back(name, dump)
            raise
        if failed:
            with self._lock:
                self.skipped["failed"] += 1
                self.last_error = failed
            self._give_back(name, dump)
            return False
        with self._lock:
            dump.fds, dump.ready = dict(fds), True
            self.loads += 1
        return True

    def _map_and_pin(self, dump: _Dump, fds: Mapping[Identity, int], runs: Mapping[Identity, Runs]) -> str:
        """Each file of `dump` mapped to the end of its last run, then every piece of every file (`pin_pieces`)
        pinned, LOAD_THREADS at once whatever the files' count (a JAX dump is one file), each once no restore is
        in flight and then made joinable; then each file's identity taken again. Why not ("" when done)."""
        try:
            for ident, fd in fds.items():
                mapped = Mapped(f"/proc/self/fd/{fd}", fd=fd, length=sum(runs[ident][-1]),
                                ranges=pin_pieces(runs[ident]))
                with self._lock:
                    dump.files[ident], dump.pinned[ident] = mapped, []
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        failed: list[str] = []

        def pin(ident: Identity, run: tuple[int, int]) -> None:
            if failed:  # the load is given back anyway
                return
            try:
                self._quiet()
                self._pin(dump.files[ident], run)
                with self._lock:
                    dump.pinned[ident].append(run)
            except Exception as exc:
                failed.append(f"{type(exc).__name__}: {exc}")
        pieces = [(ident, run) for ident in fds for run in dump.files[ident].ranges]
        with ThreadPoolExecutor(min(LOAD_THREADS, len(pieces)), initializer=_lowest_priority) as pool:
            list(pool.map(lambda piece: pin(*piece), pieces))
        if failed:
            return failed[0]
        if any(identity(fd) != ident for ident, fd in fds.items()):
            return "HydrationError: a dump file changed while it was being held"
        return ""

    def _give_back(self, name: _Name, dump: _Dump) -> None:
        """A failed load out of the table once no stage that joined it copies from it, then unpinned: no stage
        joins it meanwhile, and the room it reserved comes back."""
        with self._lock:
            dump.failed = True
            self._wake.wait_for(lambda: dump.users == 0)
            del self._held[name]
        self._unpin_all(dump.files.values())

    def _room_for(self, size: int, owner: int) -> list[_Dump] | None:
        """Under the lock: drop entries no stage is using until `size` more bytes of `owner`'s fit the budget, each
        time the least recently used of the uid holding the most among `owner` and the uids holding more than
        `owner` will (module docstring, Shares); those dropped (to unpin outside the lock), or None (nothing
        dropped) when they cannot."""
        if size > self.budget or (chosen := fair_victims(self._held, size, owner, self.budget)) is None:
            return None
        self.evictions += len(chosen)
        return [self._held.pop(name) for name in chosen]

    def _unpin_all(self, files: Any) -> None:
        """Every mapping unpinned and unmapped, also after one failed (the first failure raised then): one refusal
        must not leave the others pinned outside the budget, which no longer counts them."""
        failed: Exception | None = None
        for mapped in files:
            try:
                self._unpin(mapped)
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def _drop(self, dump: _Dump) -> None:
        """A dump out of the table (evicted, pruned, closed): unpinned, unmapped, its descriptors closed."""
        try:
            self._unpin_all(dump.files.values())
        finally:
            _close_all(dump.fds)


def _lowest_priority() -> None:
    """This thread at the lowest CPU priority (Linux: a thread's nice value is its own): a restore's come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


def _reads(ids: Mapping[str, Identity], reads: Mapping[str, Runs]) -> dict[Identity, Runs]:
    """Each file's identity (`ids`: by its names) to the runs of it held: what any of its names reads, merged (one
    file may be named twice)."""
    spans: dict[Identity, list[tuple[int, int]]] = {}
    for named, ident in ids.items():
        spans.setdefault(ident, []).extend(reads[named])
    return {ident: merge_runs(runs) for ident, runs in spans.items()}


class Shared(Protocol):
    """An entry of a tier every tenant shares (this tier's dumps, the device tier's): whose, how large, in use."""

    owner: int
    size: int
    users: int
    ready: bool


def fair_victims(entries: Mapping[_K, Shared], size: int, owner: int, budget: int) -> list[_K] | None:
    """The entries to take out so that `size` more bytes of `owner`'s fit `budget`, among those no stage is using
    (`entries` in least recently used order), each time the least recently used of the uid holding the most among
    `owner` and the uids holding more than `owner` will (module docstring, Shares); None when they cannot."""
    held = sum(e.size for e in entries.values())
    usage = _by_owner(entries.values())
    usage[owner] = usage.get(owner, 0) + size
    idle = [(n, e) for n, e in entries.items() if e.ready and not e.users]
    chosen: list[_K] = []
    while held + size > budget:
        open_to = [(n, e) for n, e in idle if e.owner == owner or usage[e.owner] > usage[owner]]
        if not open_to:
            return None
        most = max(usage[e.owner] for _, e in open_to)
        victim = next((n, e) for n, e in open_to if usage[e.owner] == most)
        idle.remove(victim)
        chosen.append(victim[0])
        usage[victim[1].owner] -= victim[1].size
        held -= victim[1].size
    return chosen


def _by_owner(dumps: Iterable[Shared]) -> dict[int, int]:
    """The bytes each owner's entries hold (entries being loaded included)."""
    usage: dict[int, int] = {}
    for dump in dumps:
        usage[dump.owner] = usage.get(dump.owner, 0) + dump.size
    return usage


def _stale(fd: int, ident: Identity) -> bool:
    """Whether the file open as `fd` has lost its last link or is no longer what `ident` says it was."""
    st = os.fstat(fd)
    return st.st_nlink == 0 or (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) != ident


def _dup_all(fds: Mapping[Identity, int]) -> dict[Identity, int]:
    """Each descriptor duplicated; none left open when one cannot be (EMFILE)."""
    duplicated: dict[Identity, int] = {}
    try:
        for ident, fd in fds.items():
            duplicated[ident] = os.dup(fd)
    except OSError:
        _close_all(duplicated)
        raise
    return duplicated


def _close_all(fds: Mapping[Identity, int]) -> None:
    for fd in fds.values():
        os.close(fd)

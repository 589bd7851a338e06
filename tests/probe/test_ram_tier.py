"""The node hydrator's RAM tier (`_ram_tier.RamTier`) with real files, real mappings and real page locks: its
budget and eviction order, an entry in use never evicted, a replaced or rewritten file never served from what
was held, the `serve --ram-tier-bytes` refusals, and the peer rules on a hit (the tier serves only descriptors a
peer opened in its own view). The CPU tests pin with mlock (the kernel's page lock, counted in VmLck) where the
hydrator pins with cuMemHostRegister; the GPU test runs the real hydrator: two stages of one dump, the second
from the RAM tier (`tier: ram`), the adopted bytes identical to the files'."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration.__main__ import main
from coldsnap_probe.hydration._copy import ZEROS, Piece
from coldsnap_probe.hydration._digests import DIGEST_CHUNK
from coldsnap_probe.hydration._peer_files import dump_layout, dump_reads, open_dump_parts
from coldsnap_probe.hydration._peer_view import OPENERS, PeerView
from coldsnap_probe.hydration._ram_tier import PIN_PIECE, Lease, RamTier, identity, pin_pieces
from coldsnap_probe.hydration._vmm import Mapped
from tests.helpers import ROOT
from tests.probe._peers import AS_NOBODY, connected, listening
from tests.probe._staged import stage_and_read
from tests.probe.test_main import has_nvidia_driver

MIB = 1 << 20
KEY = "sha256:" + hashlib.sha256(b"ram-tier").hexdigest()
OTHER_KEY = "sha256:" + hashlib.sha256(b"ram-tier-other").hexdigest()
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = _libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def mlock(mapped: Mapped, run: tuple[int, int]) -> None:
    """The run (offset, bytes) of the mapping page-locked, as the hydrator's cuMemHostRegister does."""
    offset, n = run
    if _libc.mlock(mapped.address + offset, n) != 0:
        raise OSError(ctypes.get_errno(), "mlock")


def munlock_and_unmap(mapped: Mapped) -> None:
    for offset, n in mapped.ranges:
        _libc.munlock(mapped.address + offset, n)
    mapped.close(None)  # not registered with a driver: only unmapped


def locked_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmLck:"))


@pytest.fixture
def tier_of(tmp_path: Path) -> Iterator[Any]:
    """RamTier(budget) pinning with mlock; every tier made is closed (everything unpinned) at the end."""
    made: list[RamTier] = []

    def make(budget: int) -> RamTier:
        made.append(RamTier(budget, pin=mlock, unpin=munlock_and_unmap))
        return made[-1]
    yield make
    for tier in made:
        tier.close()


def dump(path: Path, size: int, fill: bytes | None = None) -> Path:
    path.write_bytes(os.urandom(size) if fill is None else fill * (size // len(fill)))
    return path


def whole(fds: dict[str, int]) -> dict[str, tuple[tuple[int, int], ...]]:
    """Each file's one run, its whole size: what a stage reads of it when its parts read it all."""
    return {named: ((0, os.fstat(fd).st_size),) for named, fd in fds.items()}


class Opened:
    """Dump files opened read-only (as the hydrator's `open_dump_parts` leaves them), named by their paths."""

    def __init__(self, *paths: Path) -> None:
        self.fds = {str(p): os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths}

    def __enter__(self) -> dict[str, int]:
        return self.fds

    def __exit__(self, *_exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)


def settle(tier: RamTier) -> dict[str, Any]:
    """The tier's status once its loader has nothing queued (a bound, never a measurement)."""
    deadline = time.monotonic() + 30
    while (status := tier.status())["loading"] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not status["loading"], status
    return status


def until(done: Any) -> None:
    """Wait until `done()` is true (a bound, never a measurement)."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def held(tier: RamTier, key: str, *paths: Path) -> bool:
    """Whether `paths` under `key` are a hit (the lease released at once)."""
    with Opened(*paths) as fds:
        lease = tier.lease(key, fds, whole(fds))
    if lease is not None:
        lease.release()
    return lease is not None


def load(tier: RamTier, key: str, *paths: Path) -> dict[str, Any]:
    with Opened(*paths) as fds:
        assert tier.load_later(key, fds, whole(fds))
    return settle(tier)


class TestBudget:
    def test_the_least_recently_used_entry_not_in_use_is_evicted_first(self, tmp_path: Path, tier_of: Any) -> None:
        a, b, c, d = (dump(tmp_path / f"{n}.bin", 2 * MIB) for n in "abcd")
        tier = tier_of(6 * MIB)
        for path in (a, b, c):
            load(tier, KEY, path)
        assert held(tier, KEY, a)  # a is now the most recently used: b the least
        status = load(tier, KEY, d)
        assert (status["entries"], status["bytes"], status["evictions"]) == (3, 6 * MIB, 1), status
        assert [held(tier, KEY, p) for p in (a, b, c, d)] == [True, False, True, True]

    def test_a_dump_of_several_files_is_one_entry_held_and_evicted_whole(self, tmp_path: Path,
                                                                         tier_of: Any) -> None:
        a, b, c = (dump(tmp_path / f"{n}.bin", 2 * MIB) for n in "abc")
        tier, before = tier_of(4 * MIB), locked_bytes()
        assert load(tier, KEY, a, b)["entries"] == 1 and locked_bytes() - before == 4 * MIB  # both files pinned
        assert held(tier, KEY, a, b) and not held(tier, KEY, a)  # a part of it is another dump
        load(tier, OTHER_KEY, c)
        assert not held(tier, KEY, a, b) and tier.status()["bytes"] == 2 * MIB

    def test_pinned_bytes_are_page_locked_while_held_and_unlocked_once_evicted(self, tmp_path: Path,
                                                                              tier_of: Any) -> None:
        a, b = dump(tmp_path / "a.bin", 8 * MIB), dump(tmp_path / "b.bin", 8 * MIB)
        tier, before = tier_of(8 * MIB), locked_bytes()
        load(tier, KEY, a)
        assert locked_bytes() - before == 8 * MIB
        load(tier, KEY, b)  # a evicted: its pages unlocked, b's locked
        assert locked_bytes() - before == 8 * MIB and tier.status()["evictions"] == 1
        tier.close()
        assert locked_bytes() == before

    def test_a_dump_larger_than_the_budget_is_not_held_and_nothing_is_evicted_for_it(self, tmp_path: Path,
                                                                                     tier_of: Any) -> None:
        small, large = dump(tmp_path / "s.bin", 2 * MIB), dump(tmp_path / "l.bin", 6 * MIB)
        tier = tier_of(4 * MIB)
        load(tier, KEY, small)
        status = load(tier, OTHER_KEY, large)
        assert status["skipped"]["too_large"] == 1 and status["evictions"] == 0 and held(tier, KEY, small)

    def test_a_stage_reading_the_start_of_a_large_file_holds_and_counts_only_those_bytes(self, tmp_path: Path,
                                                                                       tier_of: Any) -> None:
        """The file is the peer's: a stage of 2 MiB naming a 6 MiB file held (and read, and pinned) all 6, and
        evicted another tenant's entry for bytes no stage reads."""
        other, large = dump(tmp_path / "other.bin", 4 * MIB), dump(tmp_path / "large.bin", 6 * MIB)
        tier, before = tier_of(8 * MIB), locked_bytes()
        load(tier, OTHER_KEY, other)
        with Opened(large) as fds:
            assert tier.load_later(KEY, fds, {str(large): ((0, 2 * MIB),)})
            status = settle(tier)
            assert (status["entries"], status["bytes"], status["evictions"]) == (2, 6 * MIB, 0), status
            assert locked_bytes() - before == 6 * MIB and held(tier, OTHER_KEY, other)
            lease = tier.lease(KEY, fds, {str(large): ((0, 2 * MIB),)})
            assert lease is not None and lease.size == 2 * MIB
            lease.release()
            # A stage reading more of the file is another entry: never served past the bytes held.
            assert tier.lease(KEY, fds, {str(large): ((0, 4 * MIB),)}) is None

    def test_a_tier_of_budget_zero_is_off(self, tmp_path: Path, tier_of: Any) -> None:
        a = dump(tmp_path / "a.bin", 2 * MIB)
        tier = tier_of(0)
        with Opened(a) as fds:
            assert not tier.load_later(KEY, fds, whole(fds)) and tier.lease(KEY, fds, whole(fds)) is None
        assert tier.status() | {"read_bytes": None} == {
            "budget": 0, "entries": 0, "bytes": 0, "in_use": 0, "loading": 0, "hits": 0, "misses": 0,
            "evictions": 0, "loads": 0, "dropped": 0, "skipped": {"too_large": 0, "no_room": 0, "failed": 0},
            "read_bytes": None, "stages": {"ram": 0, "disk": 0}, "bytes_by_uid": {}, "last_error": "",
            "misses_loading": 0, "joins": 0, "loader_paused_s": 0.0, "loader_forced": 0, "loading_pinned_bytes": 0}


class TestZeroChunks:
    """Regression: #34 (JAX's dumps never entered the tier: half of the 35 GB are chunks of zeros, holes no stage
    reads, and the tier pinned and counted each file whole, so the dump never fit the default budget)."""

    def test_a_dump_larger_than_the_budget_whose_data_fits_is_held_without_its_holes(self, tier_of: Any) -> None:
        top = Path("/dev/shm") / f"cs-ram-tier-zeros-{os.getpid()}"  # tmpfs, as the dumps: a hole costs no page
        top.mkdir()
        try:
            path = top / "seg-0.bin"
            with open(path, "wb") as f:  # as the interposer writes it: full size, the chunk of zeros left a hole
                f.truncate(3 * DIGEST_CHUNK)
                for chunk in (0, 2):
                    f.seek(chunk * DIGEST_CHUNK)
                    f.write(bytes([0x30 + chunk]) * DIGEST_CHUNK)
            layout, _sizes = dump_layout([{"file": str(path), "bytes": 3 * DIGEST_CHUNK, "region": 0, "zero": 0b010}])
            reads = dump_reads(layout)  # what the hydrator's stage-dump hands the tier
            assert reads == {str(path): ((0, DIGEST_CHUNK), (2 * DIGEST_CHUNK, DIGEST_CHUNK))}
            tier, before, blocks = tier_of(5 * DIGEST_CHUNK // 2), locked_bytes(), os.stat(path).st_blocks
            with Opened(path) as fds:
                assert tier.load_later(KEY, fds, reads)
                status = settle(tier)
                assert (status["entries"], status["bytes"], status["skipped"]["too_large"]) == \
                    (1, 2 * DIGEST_CHUNK, 0), status
                assert locked_bytes() - before == 2 * DIGEST_CHUNK and os.stat(path).st_blocks == blocks
                lease = tier.lease(KEY, fds, reads)
                assert lease is not None and lease.size == 2 * DIGEST_CHUNK
                at = lease.addresses[str(path)]
                assert ctypes.string_at(at + 2 * DIGEST_CHUNK + DIGEST_CHUNK - 4, 4) == b"2222"
                lease.release()
                # Another mask over the same file reads other bytes: another entry, never served from this one.
                assert tier.lease(KEY, fds, whole(fds)) is None
        finally:
            shutil.rmtree(top)

    def test_a_file_named_by_two_parts_is_held_once_for_the_runs_either_reads(self, tmp_path: Path) -> None:
        layout, _sizes = dump_layout([
            {"file": "/d/a.bin", "bytes": 3 * DIGEST_CHUNK, "region": 0, "zero": 0b110},
            {"file": "/d/a.bin", "bytes": 2 * DIGEST_CHUNK, "region": 1, "zero": 0b01},
            {"file": "/d/b.bin", "bytes": DIGEST_CHUNK, "region": 2, "zero": 0b1}])
        assert dump_reads(layout) == {"/d/a.bin": ((0, 2 * DIGEST_CHUNK),)}  # b.bin: all zeros, read nowhere

    def test_a_dump_of_zeros_only_is_not_queued(self, tmp_path: Path, tier_of: Any) -> None:
        path = tmp_path / "seg-0.bin"
        with open(path, "wb") as f:
            f.truncate(DIGEST_CHUNK)
        layout, _sizes = dump_layout([{"file": str(path), "bytes": DIGEST_CHUNK, "region": 0, "zero": 1}])
        tier = tier_of(2 * DIGEST_CHUNK)
        with Opened(path) as fds:
            assert not tier.load_later(KEY, fds, dump_reads(layout)) and tier.status()["loading"] == 0


class TestCounters:
    def test_a_miss_counts_its_bytes_on_the_disk_tier_and_queues_the_dump_a_hit_counts_on_the_ram_tier(
            self, tmp_path: Path, tier_of: Any) -> None:
        a = dump(tmp_path / "a.bin", 2 * MIB)
        tier = tier_of(8 * MIB)
        with Opened(a) as fds:
            assert tier.lease(KEY, fds, whole(fds)) is None
            assert tier.staged(KEY, fds, whole(fds), None, 0, 2 * MIB, owner=0) == "disk"
        settle(tier)
        with Opened(a) as fds:
            lease = tier.lease(KEY, fds, whole(fds))
            assert lease is not None and tier.staged(KEY, fds, whole(fds), lease, 2 * MIB, 0, owner=0) == "ram"
            lease.release()
        status = tier.status()
        assert (status["hits"], status["misses"], status["loads"], status["entries"]) == (1, 1, 1, 1), status
        assert status["read_bytes"] == {"ram": 2 * MIB, "disk": 2 * MIB}
        assert status["stages"] == {"ram": 1, "disk": 1} and status["bytes_by_uid"] == {"0": 2 * MIB}, status

    def test_a_dump_is_queued_once_and_the_queue_is_bounded_also_per_uid(self, tmp_path: Path) -> None:
        """Regression (review10's open finding): one tenant's misses kept the loader's queue full, so no other
        tenant's dump was ever queued; now one uid has at most QUEUE_PER_UID of its places."""
        gate = threading.Event()

        def held_back(mapped: Mapped, run: tuple[int, int]) -> None:  # the loader waits: the queue stays
            gate.wait(30)
            mlock(mapped, run)
        paths = [dump(tmp_path / f"{n}.bin", 2 * MIB) for n in range(5)]
        tier = RamTier(32 * MIB, pin=held_back, unpin=munlock_and_unmap)
        try:
            with Opened(*paths) as fds:
                mine = [tier.load_later(KEY, {str(p): fds[str(p)]}, {str(p): ((0, 2 * MIB),)}, owner=1000)
                        for p in paths[:2]]
                theirs = [tier.load_later(KEY, {str(p): fds[str(p)]}, {str(p): ((0, 2 * MIB),)}, owner=uid)
                          for uid, p in zip((2000, 3000, 4000), paths[2:], strict=True)]
                again = tier.load_later(KEY, {str(paths[0]): fds[str(paths[0])]}, {str(paths[0]): ((0, 2 * MIB),)},
                                        owner=2000)
            assert mine == [True, False] and theirs == [True, False, False] and not again
            gate.set()
            assert settle(tier)["entries"] == 2
        finally:
            gate.set()
            tier.close()



def recording_tier(budget: int) -> tuple[list[tuple[int, int]], RamTier]:
    """A tier pinning with mlock that records each run it pins, in order."""
    pins: list[tuple[int, int]] = []

    def pin(mapped: Mapped, run: tuple[int, int]) -> None:
        pins.append(run)
        mlock(mapped, run)
    return pins, RamTier(budget, pin=pin, unpin=munlock_and_unmap)

class TestJoin:
    """Issue 35: a load (a capture's warm) pins in pieces, pins none while a restore's copy runs, and a stage of
    the dump it is loading joins it: what is pinned from RAM, the rest from the files, never waiting for it."""

    def test_a_load_pins_in_pieces_of_at_most_pin_piece_bytes(self) -> None:
        assert pin_pieces(((0, 2 * PIN_PIECE + 5), (3 * PIN_PIECE, 7))) == (
            (0, PIN_PIECE), (PIN_PIECE, PIN_PIECE), (2 * PIN_PIECE, 5), (3 * PIN_PIECE, 7))

    def test_the_pieces_of_one_file_are_pinned_at_once(self, tmp_path: Path) -> None:
        """A dump of one file (a JAX engine's pool) is pinned by LOAD_THREADS threads, not one: both pieces must be
        in their pin together, or the barrier breaks and the load fails."""
        a = dump(tmp_path / "a.bin", PIN_PIECE + MIB, bytes(range(256)))
        together = threading.Barrier(2, timeout=10)

        def pin(mapped: Mapped, run: tuple[int, int]) -> None:
            together.wait()
            mlock(mapped, run)
        tier = RamTier(2 * PIN_PIECE, pin=pin, unpin=munlock_and_unmap)
        try:
            status = load(tier, KEY, a)
            assert (status["loads"], status["skipped"]["failed"]) == (1, 0), status
        finally:
            tier.close()

    def test_split_copies_what_is_pinned_cut_at_each_registration_and_reads_the_rest(self) -> None:
        """Every byte once, each pinned part inside one registration (a DMA never spans two), zeros with the
        pinned copy (they read nothing)."""
        lease = Lease({"a": 1 << 40}, {"a": ((0, 4 * MIB), (4 * MIB, 4 * MIB), (12 * MIB, 4 * MIB)), "b": ()},
                      16 * MIB, False, lambda: None)
        held_pieces, rest = lease.split([Piece(0, "a", 2 * MIB, 14 * MIB), Piece(100 * MIB, ZEROS, 0, 8 * MIB),
                                         Piece(200 * MIB, "b", 0, MIB)])
        assert held_pieces == [Piece(0, "a", 2 * MIB, 2 * MIB), Piece(2 * MIB, "a", 4 * MIB, 4 * MIB),
                               Piece(10 * MIB, "a", 12 * MIB, 4 * MIB), Piece(100 * MIB, ZEROS, 0, 8 * MIB)]
        assert rest == [Piece(6 * MIB, "a", 8 * MIB, 4 * MIB), Piece(200 * MIB, "b", 0, MIB)]

    def test_a_stage_during_a_load_joins_what_is_pinned_and_the_load_completes_after(self, tmp_path: Path) -> None:
        a = dump(tmp_path / "a.bin", PIN_PIECE + 2 * MIB, bytes(range(256)))
        go = threading.Event()

        def pin(mapped: Mapped, run: tuple[int, int]) -> None:
            if run[0]:  # the second piece waits: the stage comes meanwhile
                assert go.wait(20)
            mlock(mapped, run)
        tier = RamTier(2 * PIN_PIECE, pin=pin, unpin=munlock_and_unmap)
        try:
            with Opened(a) as fds:
                assert tier.load_later(KEY, fds, whole(fds))
                until(lambda: tier.status()["loading_pinned_bytes"] == PIN_PIECE)
                lease = tier.lease(KEY, fds, whole(fds))
                assert lease is not None and not lease.complete and lease.pinned == {str(a): ((0, PIN_PIECE),)}
                assert lease.split([Piece(0, str(a), 0, PIN_PIECE + 2 * MIB)]) == (
                    [Piece(0, str(a), 0, PIN_PIECE)], [Piece(PIN_PIECE, str(a), PIN_PIECE, 2 * MIB)])
                assert ctypes.string_at(lease.addresses[str(a)], MIB) == bytes(range(256)) * (MIB // 256)
                assert tier.staged(KEY, fds, whole(fds), lease, PIN_PIECE, 2 * MIB, owner=0) == "joined"
                lease.release()
                go.set()
                status = settle(tier)
                assert (status["joins"], status["hits"], status["misses"], status["loads"]) == (1, 0, 0, 1), status
                assert status["read_bytes"] == {"ram": PIN_PIECE, "disk": 2 * MIB}, status
                assert status["stages"] == {"ram": 1, "disk": 0}, status
                full = tier.lease(KEY, fds, whole(fds))
                assert full is not None and full.complete, full
                assert full.pinned == {str(a): ((0, PIN_PIECE), (PIN_PIECE, 2 * MIB))}
                full.release()
        finally:
            go.set()
            tier.close()

    def test_the_loader_pins_no_piece_while_a_restores_copy_runs(self, tmp_path: Path) -> None:
        """Without the pause the loader pins the second piece at once, beside the copy (issue 35: a stage's
        allocations waited 1.29 s behind a warm's registrations on the H200)."""
        a = dump(tmp_path / "a.bin", PIN_PIECE + MIB, bytes(range(256)))
        pins, tier = recording_tier(2 * PIN_PIECE)
        try:
            with Opened(a) as fds, tier.copying():
                assert tier.load_later(KEY, fds, whole(fds))
                time.sleep(0.2)  # a bound on how long the loader has to misbehave, not a measurement
                assert pins == [] and tier.status()["loading"] == 1
            status = settle(tier)
            assert sorted(pins) == [(0, PIN_PIECE), (PIN_PIECE, MIB)] and status["loads"] == 1, status
            assert status["loader_paused_s"] > 0, status
        finally:
            tier.close()

    def test_a_restore_in_flight_pauses_the_loader_until_its_own_resume_and_a_second_resume_ends_no_other(
            self, tmp_path: Path) -> None:
        """A stage holds a pause from its request until its engine adopts it; the hydrator may let a stage go
        twice (a failed fill, then its slot's replacement): the second call must not end another restore's pause."""
        a = dump(tmp_path / "a.bin", PIN_PIECE + MIB, bytes(range(256)))
        pins, tier = recording_tier(2 * PIN_PIECE)
        try:
            with Opened(a) as fds:
                mine, theirs = tier.pause(), tier.pause()
                assert tier.load_later(KEY, fds, whole(fds))
                mine()
                mine()
                time.sleep(0.2)  # a bound on how long the loader has to misbehave, not a measurement
                assert pins == [], pins
                theirs()
                assert settle(tier)["loads"] == 1 and sorted(pins) == [(0, PIN_PIECE), (PIN_PIECE, MIB)]
        finally:
            tier.close()

    def test_restores_that_never_end_slow_the_loader_but_never_stop_it(self, tmp_path: Path) -> None:
        """Review (issue 34, item 3): each stage in flight paused every load until it ended; one tenant starting
        stage after stage (or a peer holding its request open) kept every tenant's loads paused for ever."""
        a = dump(tmp_path / "a.bin", 2 * PIN_PIECE + MIB, bytes(range(256)))
        pins: list[tuple[int, int]] = []

        def pin(mapped: Mapped, run: tuple[int, int]) -> None:
            pins.append(run)
            mlock(mapped, run)
        tier = RamTier(3 * PIN_PIECE, pin=pin, unpin=munlock_and_unmap, yield_s=0.05)
        try:
            with Opened(a) as fds:
                resume = tier.pause()  # never resumed while the load runs
                assert tier.load_later(KEY, fds, whole(fds))
                status = settle(tier)
                resume()
            assert status["loads"] == 1 and status["loader_forced"] == 3 and len(pins) == 3, status
            assert status["loader_paused_s"] >= 0.05, status
        finally:
            tier.close()

    def test_a_load_that_fails_after_a_stage_joined_it_unpins_only_once_that_stage_is_done(
            self, tmp_path: Path) -> None:
        """The joined stage copies from the pinned mapping: unmapped under it, its DMA (here: a read) would
        fault. The failed load is joined no more, and gives everything back once the lease ends."""
        a = dump(tmp_path / "a.bin", PIN_PIECE + MIB, bytes(range(256)))
        joined = threading.Event()

        def pin(mapped: Mapped, run: tuple[int, int]) -> None:
            if run[0]:
                assert joined.wait(20)
                raise OSError(12, "Cannot allocate memory")
            mlock(mapped, run)
        tier, before = RamTier(2 * PIN_PIECE, pin=pin, unpin=munlock_and_unmap), locked_bytes()
        try:
            with Opened(a) as fds:
                assert tier.load_later(KEY, fds, whole(fds))
                until(lambda: tier.status()["loading_pinned_bytes"] == PIN_PIECE)
                lease = tier.lease(KEY, fds, whole(fds))
                assert lease is not None and not lease.complete
                joined.set()
                until(lambda: tier.status()["skipped"]["failed"] == 1)
                time.sleep(0.2)  # a bound on how long the failed load has to unpin under the lease
                assert tier.lease(KEY, fds, whole(fds)) is None and tier.status()["loading"] == 1
                assert locked_bytes() - before == PIN_PIECE
                assert ctypes.string_at(lease.addresses[str(a)], MIB) == bytes(range(256)) * (MIB // 256)
                lease.release()
                status = settle(tier)
            assert (status["entries"], status["bytes"], status["skipped"]["failed"]) == (0, 0, 1), status
            assert locked_bytes() == before
        finally:
            joined.set()
            tier.close()


class TestDescriptors:
    def test_a_dump_whose_descriptors_cannot_be_duplicated_is_not_queued_and_leaves_none_open(
            self, tmp_path: Path, tier_of: Any) -> None:
        """Regression (tidy, 2026-12-02): at the process's descriptor limit the second file's dup raised out of
        `staged`, after the stage was filled: the first dup stayed open for ever, and the stager was answered a
        failure while its stage held the GPU until the TTL. Now the dump is only not queued (`failed`)."""
        import resource

        def is_open(fd: int) -> bool:
            try:
                os.fstat(fd)
            except OSError:
                return False
            return True

        def open_fds() -> set[int]:  # without the listing's own descriptor, closed by then
            return set(filter(is_open, map(int, os.listdir("/proc/self/fd"))))

        a, b = dump(tmp_path / "a.bin", 2 * MIB), dump(tmp_path / "b.bin", 2 * MIB)
        tier = tier_of(8 * MIB)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        with Opened(a, b) as fds:
            before = open_fds()
            limit = next(n for n in range(1, soft) if len(set(range(n)) - before) == 1)  # one descriptor free
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            try:
                tier_name = tier.staged(KEY, fds, whole(fds), None, 0, 4 * MIB, owner=0)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert open_fds() == before
        status = tier.status()
        assert tier_name == "disk" and status["loading"] == 0 and status["skipped"]["failed"] == 1, status
        assert "Too many open files" in status["last_error"] and status["stages"]["disk"] == 1, status


class TestShares:
    """Regression (review10's open finding): one tenant's stages evicted every other tenant's entries (the LRU knew
    no owner). A load now evicts only its owner's entries or those of a uid holding more (max-min fairness)."""

    @staticmethod
    def load_as(tier: RamTier, owner: int, path: Path) -> dict[str, Any]:
        with Opened(path) as fds:
            assert tier.load_later(KEY, fds, whole(fds), owner=owner)
        return settle(tier)

    def test_one_tenants_misses_evict_its_own_entries_never_a_smaller_tenants(self, tmp_path: Path,
                                                                             tier_of: Any) -> None:
        mine = [dump(tmp_path / f"a{n}.bin", 2 * MIB) for n in range(6)]
        theirs = dump(tmp_path / "b.bin", 2 * MIB)
        tier = tier_of(4 * MIB)
        for path in mine[:2]:
            self.load_as(tier, 1000, path)  # alone, a tenant fills the whole budget
        assert tier.status()["bytes_by_uid"] == {"1000": 4 * MIB}
        status = self.load_as(tier, 2000, theirs)  # the larger tenant makes room: its least recently used goes
        assert status["bytes_by_uid"] == {"1000": 2 * MIB, "2000": 2 * MIB} and not held(tier, KEY, mine[0])
        for path in mine[2:]:  # however many it stages, the first tenant now replaces only its own
            status = self.load_as(tier, 1000, path)
            assert status["bytes_by_uid"] == {"1000": 2 * MIB, "2000": 2 * MIB}, status
            assert held(tier, KEY, theirs) and held(tier, KEY, path)
        assert status["evictions"] == 5 and status["skipped"]["no_room"] == 0, status

    def test_a_load_that_only_another_tenants_fair_share_could_make_room_for_is_skipped(
            self, tmp_path: Path, tier_of: Any) -> None:
        a, b, c = (dump(tmp_path / f"{n}.bin", 2 * MIB) for n in "abc")
        tier = tier_of(4 * MIB)
        self.load_as(tier, 2000, a)
        with Opened(b) as fds:
            lease = tier.lease(KEY, fds, whole(fds))
            assert lease is None and tier.load_later(KEY, fds, whole(fds), owner=1000)
        settle(tier)
        with Opened(b) as fds:
            lease = tier.lease(KEY, fds, whole(fds))
        assert lease is not None  # 1000's own entry in use: its next load may only take 2000's, which is no larger
        try:
            status = self.load_as(tier, 1000, c)
        finally:
            lease.release()
        assert status["skipped"]["no_room"] == 1 and held(tier, KEY, a) and not held(tier, KEY, c), status


class TestInUse:
    def test_an_entry_in_use_is_never_evicted_and_the_newcomer_waits_for_a_later_miss(self, tmp_path: Path,
                                                                                      tier_of: Any) -> None:
        a, b = dump(tmp_path / "a.bin", 4 * MIB), dump(tmp_path / "b.bin", 4 * MIB)
        tier = tier_of(4 * MIB)
        load(tier, KEY, a)
        with Opened(a) as fds:
            lease = tier.lease(KEY, fds, whole(fds))
        assert lease is not None and tier.status()["in_use"] == 1
        status = load(tier, OTHER_KEY, b)  # no room without evicting the leased one: not held
        assert status["skipped"]["no_room"] == 1 and status["evictions"] == 0
        assert ctypes.string_at(lease.addresses[str(a)], 4 * MIB) == a.read_bytes()  # still mapped, same bytes
        lease.release()
        load(tier, OTHER_KEY, b)
        assert held(tier, OTHER_KEY, b) and not held(tier, KEY, a)

    def test_leases_from_many_threads_count_every_hit_and_leave_nothing_in_use(self, tmp_path: Path,
                                                                              tier_of: Any) -> None:
        a = dump(tmp_path / "a.bin", 2 * MIB)
        tier = tier_of(2 * MIB)
        load(tier, KEY, a)
        threads = [threading.Thread(target=lambda: [held(tier, KEY, a) for _ in range(50)]) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        status = tier.status()
        assert (status["hits"], status["in_use"], status["entries"]) == (400, 0, 1), status


class TestFreshness:
    def test_a_replaced_file_is_a_miss_and_the_new_file_is_served_once_held(self, tmp_path: Path,
                                                                            tier_of: Any) -> None:
        a = dump(tmp_path / "a.bin", 2 * MIB, b"old!")
        tier = tier_of(8 * MIB)
        load(tier, KEY, a)
        dump(tmp_path / "a.new", 2 * MIB, b"new!").rename(a)  # same path, same size, another inode
        with Opened(a) as fds:
            assert tier.lease(KEY, fds, whole(fds)) is None
            tier.load_later(KEY, fds, whole(fds))
        settle(tier)
        with Opened(a) as fds:
            lease = tier.lease(KEY, fds, whole(fds))
        assert lease is not None
        assert ctypes.string_at(lease.addresses[str(a)], 2 * MIB) == b"new!" * (MIB // 2)
        lease.release()

    def test_a_file_truncated_and_rewritten_in_place_is_a_miss(self, tmp_path: Path, tier_of: Any) -> None:
        a = dump(tmp_path / "a.bin", 2 * MIB, b"old!")
        tier = tier_of(8 * MIB)
        load(tier, KEY, a)
        time.sleep(0.02)  # past the filesystem clock's tick: the rewrite's times differ from the load's
        with a.open("r+b") as f:
            f.truncate(0)
            f.write(b"new!" * (MIB // 2))
        assert not held(tier, KEY, a) and tier.status()["misses"] == 1

    def test_a_stage_while_its_dump_is_being_pinned_misses_at_once_and_the_load_goes_on(self, tmp_path: Path) -> None:
        """A restore never waits for a load (a capture's warm still pinning): it stages from the files; the miss
        is counted as one that came during the load."""
        a = dump(tmp_path / "a.bin", 2 * MIB)
        pinning, go = threading.Event(), threading.Event()

        def slow_pin(mapped: Mapped, run: tuple[int, int]) -> None:
            pinning.set()
            assert go.wait(20)
            mlock(mapped, run)
        tier = RamTier(8 * MIB, pin=slow_pin, unpin=munlock_and_unmap)
        try:
            with Opened(a) as fds:
                assert tier.load_later(KEY, fds, whole(fds)) and pinning.wait(20)
                assert tier.lease(KEY, fds, whole(fds)) is None  # while the pin is held up: answered at once
                status = tier.status()
                assert (status["misses"], status["misses_loading"], status["loading"]) == (1, 1, 1), status
                go.set()
                settle(tier)
                lease = tier.lease(KEY, fds, whole(fds))
                assert lease is not None
                lease.release()
        finally:
            go.set()
            tier.close()

    def test_a_file_changed_while_it_is_being_held_is_not_held(self, tmp_path: Path) -> None:
        """The identity is taken again once the file is pinned: a write between the request and the pin means
        the tier would hold a file that is not the one the stage read."""
        a = dump(tmp_path / "a.bin", 2 * MIB)

        def pin_then_touch(mapped: Mapped, run: tuple[int, int]) -> None:
            mlock(mapped, run)
            time.sleep(0.02)
            with a.open("r+b") as f:
                f.write(b"x")
        tier = RamTier(8 * MIB, pin=pin_then_touch, unpin=munlock_and_unmap)
        try:
            status = load(tier, KEY, a)
            assert (status["entries"], status["bytes"], status["skipped"]["failed"]) == (0, 0, 1), status
            assert status["last_error"] == "HydrationError: a dump file changed while it was being held"
        finally:
            tier.close()

    def test_a_removed_dump_is_dropped_at_the_next_prune_and_its_pages_unlocked(self, tmp_path: Path,
                                                                               tier_of: Any) -> None:
        """A collected capture's pinned memory comes back within the hydrator's idle pass, not at the LRU's turn;
        one in use waits for its stage to end; one that only changed (a rewrite) is dropped too."""
        a, b = dump(tmp_path / "a.bin", 4 * MIB), dump(tmp_path / "b.bin", 4 * MIB)
        tier, before = tier_of(16 * MIB), locked_bytes()
        load(tier, KEY, a)
        load(tier, OTHER_KEY, b)
        with Opened(a) as fds:
            lease = tier.lease(KEY, fds, whole(fds))
        assert lease is not None
        a.unlink()
        tier.prune()  # in use: kept
        assert tier.status()["entries"] == 2 and locked_bytes() - before == 8 * MIB
        lease.release()
        tier.prune()
        status = tier.status()
        assert (status["entries"], status["bytes"], status["dropped"]) == (1, 4 * MIB, 1), status
        assert locked_bytes() - before == 4 * MIB
        time.sleep(0.02)
        with b.open("r+b") as f:
            f.write(b"x")
        tier.prune()
        assert tier.status()["entries"] == 0 and locked_bytes() == before

    def test_a_failed_unpin_of_an_evicted_dump_leaves_nothing_pinned_nor_reserved(self, tmp_path: Path) -> None:
        """The driver refusing one unpin (after it unpinned, as cuMemHostUnregister may report a sticky error) left
        the victim's other files pinned outside the budget, and the newcomer's room reserved for ever, never
        loaded, never evicted."""
        a1, a2, b = (dump(tmp_path / f"{n}.bin", 2 * MIB) for n in ("a1", "a2", "b"))
        refusals = [1]

        def unpin(mapped: Mapped) -> None:
            munlock_and_unmap(mapped)
            if refusals:
                refusals.pop()
                raise HydrationError("CUDA_ERROR_UNKNOWN: cuMemHostUnregister")
        before = locked_bytes()
        tier = RamTier(4 * MIB, pin=mlock, unpin=unpin)
        try:
            load(tier, KEY, a1, a2)
            status = load(tier, OTHER_KEY, b)  # a1 and a2 evicted for b: the first unpin refused
            assert "cuMemHostUnregister" in status["last_error"], status
            assert (status["entries"], status["bytes"]) == (0, 0) and locked_bytes() == before, status
            assert load(tier, OTHER_KEY, b)["entries"] == 1 and held(tier, OTHER_KEY, b)  # a later miss loads it
        finally:
            tier.close()
        assert locked_bytes() == before

    def test_a_failed_pin_holds_nothing_and_the_loader_goes_on(self, tmp_path: Path) -> None:
        a, b = dump(tmp_path / "a.bin", 2 * MIB), dump(tmp_path / "b.bin", 2 * MIB)
        refused: list[int] = []

        def pin(mapped: Mapped, run: tuple[int, int]) -> None:
            if not refused:  # the first pin fails as the driver's would (out of page-locked memory)
                refused.append(mapped.size)
                raise OSError(12, "Cannot allocate memory")
            mlock(mapped, run)
        tier = RamTier(8 * MIB, pin=pin, unpin=munlock_and_unmap)
        try:
            status = load(tier, KEY, a)
            assert (status["entries"], status["bytes"], status["skipped"]["failed"]) == (0, 0, 1), status
            assert "Cannot allocate memory" in status["last_error"]
            assert load(tier, KEY, b)["entries"] == 1 and held(tier, KEY, b)
        finally:
            tier.close()

    def test_the_same_files_under_another_manifest_digest_are_a_miss(self, tmp_path: Path, tier_of: Any) -> None:
        a = dump(tmp_path / "a.bin", 2 * MIB)
        tier = tier_of(8 * MIB)
        load(tier, KEY, a)
        assert held(tier, KEY, a) and not held(tier, OTHER_KEY, a)

    def test_a_file_deleted_after_it_was_held_keeps_its_inode_so_its_number_names_nothing_else(
            self, tmp_path: Path, tier_of: Any) -> None:
        a = dump(tmp_path / "a.bin", 2 * MIB)
        tier = tier_of(8 * MIB)
        with Opened(a) as fds:
            first = identity(fds[str(a)])
        load(tier, KEY, a)
        a.unlink()
        b = dump(tmp_path / "b.bin", 2 * MIB)
        with Opened(b) as fds:
            assert identity(fds[str(b)])[:2] != first[:2] and tier.lease(KEY, fds, whole(fds)) is None


class TestOptions:
    @pytest.mark.parametrize(("value", "rule"), [
        pytest.param("lots", "must be 0 \\(off\\), auto or a size", id="words"),
        pytest.param("-1", "must be 0 \\(off\\), auto or a size", id="negative"),
        pytest.param("1.5G", "must be 0 \\(off\\), auto or a size", id="fraction"),
        pytest.param("100T", "must be at most the node's memory", id="beyond-memory"),
    ])
    def test_a_bad_budget_is_refused_naming_the_option_before_anything_starts(
            self, tmp_path: Path, value: str, rule: str, capsys: pytest.CaptureFixture[str]) -> None:
        sock = tmp_path / "h.sock"
        with pytest.raises(SystemExit) as exited:  # argparse's refusal: before the driver or the socket
            main(["serve", "--staging", "--socket", str(sock), f"--ram-tier-bytes={value}"])
        assert exited.value.code == 2 and not sock.exists()
        stderr = capsys.readouterr().err
        assert "argument --ram-tier-bytes:" in stderr and re.search(rule, stderr), stderr

    @pytest.mark.parametrize(("value", "rule"), [
        pytest.param("0", "must be a positive whole number, not 0", id="zero"),
        pytest.param("four", "must be a positive whole number, not four", id="words"),
        pytest.param("65", "must be at most 64, not 65", id="beyond-the-bound"),
    ])
    def test_bad_dump_threads_are_refused_naming_the_option_before_anything_starts(
            self, tmp_path: Path, value: str, rule: str, capsys: pytest.CaptureFixture[str]) -> None:
        sock = tmp_path / "h.sock"
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--staging", "--socket", str(sock), f"--dump-threads={value}"])
        assert exited.value.code == 2 and not sock.exists()
        stderr = capsys.readouterr().err
        assert "argument --dump-threads:" in stderr and rule in stderr, stderr

    @pytest.mark.parametrize("value", ["1G", "auto"])
    def test_a_budget_without_staging_is_refused(self, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 value: str) -> None:
        """`auto` is a budget too (a quarter of the node's memory); the tier is off unless one is given."""
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--socket", str(tmp_path / "h.sock"), "--ram-tier-bytes", value])
        assert exited.value.code == 2
        assert "argument --ram-tier-bytes: only with --staging" in capsys.readouterr().err

    def test_a_negative_budget_is_refused_by_the_tier_itself(self) -> None:
        with pytest.raises(HydrationError, match="budget must be 0 \\(off\\) or a number of bytes, not -1"):
            RamTier(-1, pin=mlock, unpin=munlock_and_unmap)


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A 0755 tree holding the peer's own dump file `att/seg-0.bin` (nobody's) and another tenant's
    `secret/seg-0.bin` (in root's 0700 directory)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the hydrator's peers are other uids")
    top = Path("/tmp") / f"cs-ram-tier-{os.getpid()}"
    (top / "att").mkdir(parents=True)
    (top / "secret").mkdir(mode=0o700)
    top.chmod(0o755)
    try:
        own, secret = dump(top / "att" / "seg-0.bin", 2 * MIB), dump(top / "secret" / "seg-0.bin", 2 * MIB)
        secret.chmod(0o644)
        for p in (top / "att", own):
            os.chown(p, 65534, 65534)
        yield own, secret
    finally:
        shutil.rmtree(top)


@contextlib.contextmanager
def parts_as(prefix: tuple[str, ...], path: Path) -> Iterator[dict[str, int]]:
    """The descriptors open_dump_parts opens for one part `path`, as a real peer process (`prefix`) sees it over
    a real socket: what the hydrator hands the tier."""
    with listening() as (listener, sock), connected(listener, sock, prefix) as (conn, peer, _), \
            PeerView.of(conn, peer, openers=threading.BoundedSemaphore(OPENERS)) as view:
        _parts, fds = open_dump_parts(dump_layout([{"file": str(path), "bytes": 2 * MIB, "region": 0}])[0], view)
        try:
            yield fds
        finally:
            for fd in fds.values():
                os.close(fd)


class TestPeerRules:
    def test_a_held_file_the_peer_may_not_read_is_refused_before_the_tier_is_asked(self, tenants: Any,
                                                                                   tier_of: Any) -> None:
        _own, secret = tenants
        tier = tier_of(8 * MIB)
        with parts_as((), secret) as fds:  # the other tenant's restore, as root: held from now on
            tier.load_later(KEY, fds, whole(fds))
        settle(tier)
        with pytest.raises(HydrationError, match="peer uid 65534 may not read"), parts_as(AS_NOBODY, secret):
            pass
        assert tier.status()["hits"] == 0

    def test_a_peer_naming_its_own_file_under_a_held_digest_gets_a_miss_not_the_held_bytes(
            self, tenants: Any, tier_of: Any) -> None:
        own, secret = tenants
        tier = tier_of(8 * MIB)
        with parts_as((), secret) as fds:
            tier.load_later(KEY, fds, whole(fds))
        settle(tier)
        with parts_as(AS_NOBODY, own) as fds:
            assert tier.lease(KEY, fds, whole(fds)) is None  # same digest, same size, its own file: not the held one
        with parts_as((), secret) as fds:  # the tenant that may read it hits
            lease = tier.lease(KEY, fds, whole(fds))
            assert lease is not None and ctypes.string_at(lease.addresses[str(secret)], 2 * MIB) == \
                secret.read_bytes()
            lease.release()

    def test_a_peer_hits_on_its_own_file_as_its_own_view_opened_it(self, tenants: Any, tier_of: Any) -> None:
        own, _secret = tenants
        tier = tier_of(8 * MIB)
        with parts_as(AS_NOBODY, own) as fds:
            tier.load_later(KEY, fds, whole(fds))
        settle(tier)
        with parts_as(AS_NOBODY, own) as fds:
            lease = tier.lease(KEY, fds, whole(fds))
            assert lease is not None and list(lease.addresses) == [str(own)]
            lease.release()


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_the_second_stage_of_a_dump_comes_from_the_ram_tier_with_the_same_bytes(tmp_path: Path) -> None:
    """The real hydrator: the first stage-dump reads the files (`tier: disk`) and queues them for the tier; the
    second is served from their pinned mappings (`tier: ram`), the adopted bytes identical to the files' both
    times; `status` counts a miss, a hit and the bytes read from each tier. Prints both stages' seconds."""
    first, second = dump(tmp_path / "seg-0.bin", 256 * MIB), dump(tmp_path / "seg-1.bin", 64 * MIB)
    parts = [{"file": str(first), "bytes": 256 * MIB, "region": 0},
             {"file": str(second), "bytes": 64 * MIB, "region": 0}]
    control = str(tmp_path / "hydrator.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--ram-tier-bytes", "1G"], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        from coldsnap_probe._cuda import Driver
        from coldsnap_probe.jsonline import request

        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert ready["ram_tier_bytes"] == 1 << 30, ready
        expected = first.read_bytes() + second.read_bytes()
        driver = Driver()
        driver.context(0)
        cold, cold_bytes = stage_and_read(driver, control, KEY, parts, ready["device_uuid"])
        assert cold["tier"] == "disk" and cold_bytes == expected, cold
        deadline = time.monotonic() + 60
        while (tier := request(control, {"op": "status"}, timeout=10.0)["ram_tier"])["entries"] < 1:
            assert time.monotonic() < deadline, tier
            time.sleep(0.05)
        warm, warm_bytes = stage_and_read(driver, control, KEY, parts, ready["device_uuid"])
        assert warm["tier"] == "ram" and warm_bytes == expected, warm
        tier = request(control, {"op": "status"}, timeout=10.0)["ram_tier"]
        assert (tier["hits"], tier["misses"], tier["in_use"]) == (1, 1, 0), tier
        assert tier["read_bytes"] == {"ram": 320 * MIB, "disk": 320 * MIB, "device": 0} and \
            tier["bytes"] == 320 * MIB, tier
        # The stages the hydrator filled (none from the device tier: off), and the entry counted to the uid whose
        # stage loaded it (this process's).
        assert tier["stages"] == {"ram": 1, "disk": 1, "device": 0}, tier
        assert tier["bytes_by_uid"] == {str(os.getuid()): 320 * MIB}, tier
        print(json.dumps({"ram_tier_gpu": {"disk": {k: cold[k] for k in ("stage_s", "copy_s", "bytes")},
                                           "ram": {k: warm[k] for k in ("stage_s", "copy_s", "bytes")}}}))
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_dump_whose_data_fits_the_budget_but_not_its_zeros_is_staged_from_the_ram_tier(tmp_path: Path) -> None:
    """Regression: #34 (JAX's 35 GB dumps, half chunks of zeros, never entered the 32 GiB default tier). The real
    hydrator with a budget below the dump's size but above its data: the second stage is a hit, the zero chunk set
    on the device, the adopted bytes identical to the file's."""
    path = tmp_path / "seg-0.bin"
    with open(path, "wb") as f:  # as the interposer writes it: full size, its chunk of zeros a hole
        f.truncate(4 * DIGEST_CHUNK)
        for chunk in (0, 1, 3):
            f.seek(chunk * DIGEST_CHUNK)
            f.write(os.urandom(DIGEST_CHUNK))
    parts = [{"file": str(path), "bytes": 4 * DIGEST_CHUNK, "region": 0, "zero": 0b0100}]
    control = str(tmp_path / "hydrator.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--ram-tier-bytes", str(7 * DIGEST_CHUNK // 2)], stdout=subprocess.PIPE,
                            cwd=ROOT)
    try:
        from coldsnap_probe.jsonline import request

        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        cold, cold_bytes = stage_and_read(None, control, KEY, parts, ready["device_uuid"])
        assert cold["tier"] == "disk" and cold_bytes == path.read_bytes(), cold
        deadline = time.monotonic() + 60
        while (tier := request(control, {"op": "status"}, timeout=10.0)["ram_tier"])["entries"] < 1:
            assert time.monotonic() < deadline and not tier["skipped"]["too_large"], tier
            time.sleep(0.05)
        assert tier["bytes"] == 3 * DIGEST_CHUNK, tier
        warm, warm_bytes = stage_and_read(None, control, KEY, parts, ready["device_uuid"])
        assert warm["tier"] == "ram" and warm["zero_bytes"] == DIGEST_CHUNK and warm_bytes == path.read_bytes(), warm
    finally:
        proc.kill()
        proc.wait()

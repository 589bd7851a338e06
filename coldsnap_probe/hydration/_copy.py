"""The copy engine: bytes of files (or of page-locked host memory holding them) into device memory, behind one
call, `copy_to_device`, with the way the bytes are read as a strategy:

* `Pinned`: the sources are already page-locked host memory (`_vmm.Mapped`, registered): asynchronous copies
  of COPY_CHUNK pieces straight from it, round-robin over the caller's streams. The node hydrator's held
  sources, the arena's `register` strategy.
* `Pread`: reader threads, each with two page-locked buffers and a stream, `pread` (O_DIRECT with `direct`) of
  one chunk while the other's copy runs. The arena's `ring` and `direct` strategies, the node hydrator's
  staged device dumps.

A piece whose source is ZEROS is no file's: its bytes are set on the device (`cuMemsetD8Async` on the copy's
stream, at HBM rate), never read nor moved over the link; `zero_split` makes them from a dump segment's zero mask
(the release's record, bound by its manifest's digest: never guessed from a file's holes, which whoever can write
the file can punch).

A new reader (a registry or a disk reader) is one more strategy here. The CUDA interposer's in-process fill
(`interposer/dump.c` and `hydrate.c`) stays in C: it runs inside an unchanged engine with no Python; when a node
hydrator is named it hands the fill to this engine instead (the staged path, `Pread` through `_stage_dump`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ..errors import HydrationError
from ._vmm import cucall
from ._weights import WeightRegion

__all__ = ("COPY_CHUNK", "ZEROS", "HostBuffers", "Piece", "Pinned", "Pread", "Reader", "copy_to_device",
           "region_pieces", "zero_split")

COPY_CHUNK = 256 << 20  # a Pinned copy's piece: large enough for the link, small enough to spread over streams
ZEROS = "\0zeros"  # a piece's source that no file can be (a path holds no NUL byte): its bytes are set to zero


class Piece(NamedTuple):
    """`size` bytes of `source` at `offset`, to device address `dst`."""

    dst: int
    source: str
    offset: int
    size: int


def region_pieces(regions: Sequence[WeightRegion], at: int = 0) -> list[Piece]:
    """Each region's bytes of its source, to `at` + its address."""
    return [Piece(at + r.address, r.source, r.offset, r.size) for r in regions]


def zero_split(piece: Piece, zero: int, chunk: int) -> list[Piece]:
    """`piece` with the `chunk`-byte runs that `zero` marks (bit c: the piece's bytes from c * chunk, the last one
    possibly shorter) made ZEROS pieces; neighbours of one kind merged, in order. A mark beyond the piece is a
    HydrationError (the manifest's check refuses it earlier; this is the copy's own guard)."""
    if zero < 0 or zero >> -(-piece.size // chunk):
        raise HydrationError(f"zero mask {zero:#x} marks chunks beyond {piece.size} bytes of {piece.source}")
    out: list[Piece] = []
    for start in range(0, piece.size, chunk):
        n, zeros = min(chunk, piece.size - start), bool(zero >> (start // chunk) & 1)
        if out and (out[-1].source == ZEROS) == zeros:
            last = out.pop()
            out.append(last._replace(size=last.size + n))
        else:
            out.append(Piece(piece.dst + start, ZEROS, 0, n) if zeros else
                       Piece(piece.dst + start, piece.source, piece.offset + start, n))
    return out


class Reader(Protocol):
    """A way of reading the sources: copies every piece to the device, then reports what it measured."""

    def copy(self, driver: Any, context: Any, pieces: Sequence[Piece]) -> dict[str, float]: ...


def copy_to_device(driver: Any, context: Any, pieces: Sequence[Piece], reader: Reader) -> dict[str, float]:
    """Every piece copied to the device (done when this returns, nothing left in flight), read by `reader`;
    the reader's report (thread-seconds that say what bounds the copy, where it measures them)."""
    return reader.copy(driver, context, pieces)


@dataclass(frozen=True, slots=True)
class Pinned:
    """Sources that are page-locked host memory: `addresses` maps a source to its first byte here. The caller
    owns `streams` (the copy waits for all of them)."""

    addresses: Mapping[str, int]
    streams: Sequence[Any]

    def copy(self, driver: Any, context: Any, pieces: Sequence[Piece]) -> dict[str, float]:
        index = 0
        for dst, source, offset, size in pieces:
            if source == ZEROS:
                cucall(driver, "cuMemsetD8Async", dst, 0, size, self.streams[index % len(self.streams)])
                index += 1
                continue
            src = self.addresses[source] + offset
            for start in range(0, size, COPY_CHUNK):
                n = min(COPY_CHUNK, size - start)
                cucall(driver, "cuMemcpyHtoDAsync", dst + start, src + start, n,
                       self.streams[index % len(self.streams)])
                index += 1
        for stream in self.streams:
            cucall(driver, "cuStreamSynchronize", stream)
        return {}


class HostBuffers:
    """Page-locked host buffers of `size` bytes kept between copies by a long-lived copier (the node hydrator):
    allocating a ring's 32 buffers of 8 MiB took 0.17 s of every stage on the H200, on the restore's path. `take`
    hands a kept one out (a new one when none is left: concurrent copies), `give` keeps it again, up to `keep`,
    or frees it."""

    def __init__(self, driver: Any, size: int, keep: int) -> None:
        self.driver, self.size, self.keep = driver, size, keep
        self._kept: list[int] = []
        self._lock = threading.Lock()

    def fill(self) -> float:
        """Allocate the `keep` buffers now (the hydrator's start, not a restore's); the seconds it took."""
        started = time.perf_counter()
        made = [self._new() for _ in range(self.keep)]
        with self._lock:
            self._kept += made
        return time.perf_counter() - started

    def _new(self) -> int:
        return int(cucall(self.driver, "cuMemHostAlloc", self.size, 1))  # portable: any context's copy may use it

    def take(self) -> int:
        with self._lock:
            if self._kept:
                return self._kept.pop()
        return self._new()

    def give(self, buffer: int) -> None:
        """Back once no copy from it is in flight."""
        with self._lock:
            if len(self._kept) < self.keep:
                self._kept.append(buffer)
                return
        self.driver.cuda.cuMemFreeHost(buffer)


@dataclass(frozen=True, slots=True)
class Pread:
    """Reader threads through page-locked buffers: `threads` of them, `chunk` bytes a read, O_DIRECT when
    `direct`. `opened`: sources the caller opened (and checked) already, read through those descriptors (left
    open); the others are opened here, before any driver call, and closed after. `buffers`: kept page-locked
    buffers to take them from (at least a read's size), else each thread allocates and frees its own."""

    threads: int
    chunk: int
    direct: bool = False
    opened: Mapping[str, int] = field(default_factory=dict)
    buffers: HostBuffers | None = None

    def copy(self, driver: Any, context: Any, pieces: Sequence[Piece]) -> dict[str, float]:
        align = 4096 if self.direct else 1
        parts = _reads(pieces, self.chunk)
        own: dict[str, int] = {}
        try:
            for src in sorted({p.source for p in pieces} - set(self.opened) - {ZEROS}):
                own[src] = os.open(src, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
        except BaseException:  # a source that cannot be opened: the ones opened before it are closed
            for fd in own.values():
                os.close(fd)
            raise
        size = self.chunk + 2 * align
        kept = self.buffers if self.buffers is not None and self.buffers.size >= size else None
        ring = _Ring(driver, context, {**self.opened, **own}, size, align, kept)
        try:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(lambda worker: ring.work(worker, parts[worker::self.threads]), range(self.threads)))
        finally:
            for fd in own.values():
                os.close(fd)
        spent = ring.spent.values()
        return {"pin_s": max((s[0] for s in spent), default=0.0), "read_thread_s": sum(s[1] for s in spent),
                "device_thread_s": sum(s[2] for s in spent), "threads": self.threads}


def _reads(pieces: Sequence[Piece], chunk: int) -> list[Piece]:
    """The pieces cut into reads of at most `chunk` bytes; a run of zeros stays one piece (one memset), dealt to
    the threads in turn like the reads."""
    return [part for piece in pieces for part in (
        [piece] if piece.source == ZEROS else
        [Piece(piece.dst + s, piece.source, piece.offset + s, min(chunk, piece.size - s))
         for s in range(0, piece.size, chunk)])]


class _Ring:
    """The reader threads' shared state: the open sources, each thread's seconds, whether one failed."""

    def __init__(self, driver: Any, context: Any, fds: Mapping[str, int], size: int, align: int,
                 kept: HostBuffers | None) -> None:
        self.driver, self.context, self.fds, self.size, self.align = driver, context, fds, size, align
        self.kept = kept
        self.spent: dict[int, tuple[float, float, float]] = {}  # per thread: pinning, reading, waiting the device
        self.failed = threading.Event()

    def work(self, worker: int, parts: Sequence[Piece]) -> None:
        """One reader thread: its stream, two page-locked buffers and their events, then its parts."""
        driver = self.driver
        cucall(driver, "cuCtxSetCurrent", self.context)
        started = time.perf_counter()
        streams: list[Any] = []
        buffers: list[int] = []
        events: list[Any] = []
        try:  # the set-up inside: a failed page-locked allocation (concurrent stages) frees what came before it
            streams.append(cucall(driver, "cuStreamCreate", 1))
            for _ in range(2):
                buffers.append(self.kept.take() if self.kept is not None else
                               int(cucall(driver, "cuMemHostAlloc", self.size, 0)))
                events.append(cucall(driver, "cuEventCreate", 2))
            pinned = time.perf_counter() - started
            self.spent[worker] = (pinned, *self._parts(streams[0], buffers, events, parts))
        except BaseException:
            self.failed.set()
            raise
        finally:  # a failed read leaves copies in flight: none may outlive the buffers or the caller's mapping
            for stream in streams:
                driver.cuda.cuStreamSynchronize(stream)
            for event in events:
                driver.cuda.cuEventDestroy(event)
            for buffer in buffers:
                if self.kept is not None:
                    self.kept.give(buffer)
                else:
                    driver.cuda.cuMemFreeHost(buffer)
            for stream in streams:
                driver.cuda.cuStreamDestroy(stream)

    def _parts(self, stream: Any, buffers: Sequence[int], events: Sequence[Any],
               parts: Sequence[Piece]) -> tuple[float, float]:
        """The parts through the two buffers: each read while the other's copy runs, until they end or another
        thread failed. Seconds reading the files and waiting for the device."""
        driver, align, read_s, device_s, k = self.driver, self.align, 0.0, 0.0, -1
        for dst, src, offset, n in parts:
            if self.failed.is_set():  # the copy is refused anyway: the rest of a large stage is not read for nothing
                break
            if src == ZEROS:  # set on the device, in this stream's order: no buffer, no read
                cucall(driver, "cuMemsetD8Async", dst, 0, n, stream)
                continue
            k += 1
            slot = k % 2
            waited = time.perf_counter()
            if k >= 2:
                cucall(driver, "cuEventSynchronize", events[slot])
            read = time.perf_counter()
            device_s += read - waited
            first = offset - offset % align
            length = -(-(offset + n - first) // align) * align
            view = memoryview((ctypes.c_char * self.size).from_address(buffers[slot])).cast("B")
            got = os.preadv(self.fds[src], [view[:length]], first)
            view.release()
            if got < offset - first + n:
                raise HydrationError(f"source {src} ended at {first + got} while reading {offset + n}")
            read_s += time.perf_counter() - read
            cucall(driver, "cuMemcpyHtoDAsync", dst, buffers[slot] + (offset - first), n, stream)
            cucall(driver, "cuEventRecord", events[slot], stream)
        waited = time.perf_counter()
        cucall(driver, "cuStreamSynchronize", stream)
        return read_s, device_s + time.perf_counter() - waited

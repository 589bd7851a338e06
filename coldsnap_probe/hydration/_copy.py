"""The copy engine: bytes of files (or of page-locked host memory holding them) into device memory, behind one
call, `copy_to_device`, with the way the bytes are read as a strategy:

* `Pinned`: the sources are already page-locked host memory (`_vmm.Mapped`, registered): asynchronous copies
  of COPY_CHUNK pieces straight from it, round-robin over the caller's streams. The node hydrator's held
  sources, the arena's `register` strategy.
* `Pread`: reader threads, each with two page-locked buffers and a stream, `pread` (O_DIRECT with `direct`) of
  one chunk while the other's copy runs. The arena's `ring` and `direct` strategies, the node hydrator's
  staged device dumps.

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

__all__ = ("COPY_CHUNK", "Piece", "Pinned", "Pread", "Reader", "copy_to_device", "region_pieces")

COPY_CHUNK = 256 << 20  # a Pinned copy's piece: large enough for the link, small enough to spread over streams


class Piece(NamedTuple):
    """`size` bytes of `source` at `offset`, to device address `dst`."""

    dst: int
    source: str
    offset: int
    size: int


def region_pieces(regions: Sequence[WeightRegion], at: int = 0) -> list[Piece]:
    """Each region's bytes of its source, to `at` + its address."""
    return [Piece(at + r.address, r.source, r.offset, r.size) for r in regions]


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
            src = self.addresses[source] + offset
            for start in range(0, size, COPY_CHUNK):
                n = min(COPY_CHUNK, size - start)
                cucall(driver, "cuMemcpyHtoDAsync", dst + start, src + start, n,
                       self.streams[index % len(self.streams)])
                index += 1
        for stream in self.streams:
            cucall(driver, "cuStreamSynchronize", stream)
        return {}


@dataclass(frozen=True, slots=True)
class Pread:
    """Reader threads through page-locked buffers: `threads` of them, `chunk` bytes a read, O_DIRECT when
    `direct`. `opened`: sources the caller opened (and checked) already, read through those descriptors (left
    open); the others are opened here, before any driver call, and closed after."""

    threads: int
    chunk: int
    direct: bool = False
    opened: Mapping[str, int] = field(default_factory=dict)

    def copy(self, driver: Any, context: Any, pieces: Sequence[Piece]) -> dict[str, float]:
        align = 4096 if self.direct else 1
        parts = [Piece(dst + s, source, offset + s, min(self.chunk, size - s))
                 for dst, source, offset, size in pieces for s in range(0, size, self.chunk)]
        own: dict[str, int] = {}
        try:
            for src in sorted({p.source for p in pieces} - set(self.opened)):
                own[src] = os.open(src, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0))
        except BaseException:  # a source that cannot be opened: the ones opened before it are closed
            for fd in own.values():
                os.close(fd)
            raise
        ring = _Ring(driver, context, {**self.opened, **own}, self.chunk + 2 * align, align)
        try:
            with ThreadPoolExecutor(self.threads) as pool:
                list(pool.map(lambda worker: ring.work(worker, parts[worker::self.threads]), range(self.threads)))
        finally:
            for fd in own.values():
                os.close(fd)
        spent = ring.spent.values()
        return {"pin_s": max((s[0] for s in spent), default=0.0), "read_thread_s": sum(s[1] for s in spent),
                "device_thread_s": sum(s[2] for s in spent), "threads": self.threads}


class _Ring:
    """The reader threads' shared state: the open sources, each thread's seconds, whether one failed."""

    def __init__(self, driver: Any, context: Any, fds: Mapping[str, int], size: int, align: int) -> None:
        self.driver, self.context, self.fds, self.size, self.align = driver, context, fds, size, align
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
                buffers.append(int(cucall(driver, "cuMemHostAlloc", self.size, 0)))
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
                driver.cuda.cuMemFreeHost(buffer)
            for stream in streams:
                driver.cuda.cuStreamDestroy(stream)

    def _parts(self, stream: Any, buffers: Sequence[int], events: Sequence[Any],
               parts: Sequence[Piece]) -> tuple[float, float]:
        """The parts through the two buffers: each read while the other's copy runs, until they end or another
        thread failed. Seconds reading the files and waiting for the device."""
        driver, align, read_s, device_s = self.driver, self.align, 0.0, 0.0
        for k, (dst, src, offset, n) in enumerate(parts):
            if self.failed.is_set():  # the copy is refused anyway: the rest of a large stage is not read for nothing
                break
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

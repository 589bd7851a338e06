"""CUDA virtual memory for weights (cuda-python through `_cuda.Driver`): allocations that travel between
processes as file descriptors, page-locked source mappings, and the two copy engines (registered sources on
several streams; reader threads into pinned buffers)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CudaError, HydrationError
from ._weights import WeightRegion

__all__ = ("COPY_CHUNK", "Mapped", "copy_registered", "copy_ring", "cucall", "device_allocation", "device_uuid",
           "fd_handle", "map_read_write")

COPY_CHUNK = 256 << 20
_HOST_REGISTER_READ_ONLY = 0x08


def _ok(driver: Any, name: str, result: Any) -> Any:
    """The binding's (err, *outputs) to outputs, or CudaError (the same text as Driver.call)."""
    err, *outputs = result
    if int(err) != 0:
        error_name, error_string = driver._error_text(err)
        raise CudaError(name, error_name, error_string)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def cucall(driver: Any, name: str, *args: Any) -> Any:
    return _ok(driver, name, getattr(driver.cuda, name)(*args))


def fd_handle(driver: Any) -> Any:
    """The POSIX file-descriptor handle type: how allocations travel between processes here."""
    return driver.cuda.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def device_allocation(driver: Any, device: int, *, exportable: bool) -> Any:
    """Properties of a pinned device allocation on `device` (exportable: as a file descriptor)."""
    cu = driver.cuda
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if exportable:
        prop.requestedHandleTypes = fd_handle(driver)
    return prop


def map_read_write(driver: Any, address: int, size: int, device: int) -> None:
    """Give `device` read-write access to the mapped range."""
    cu = driver.cuda
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    cucall(driver, "cuMemSetAccess", address, size, [access], 1)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = 0x8000


class Mapped:
    """A read-only shared mapping of a whole file (address stable for cuMemHostRegister), optionally page-locked."""

    def __init__(self, path: str, *, populate: bool = True) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.identity = (st.st_dev, st.st_ino)  # the file mapped, whatever its path names later
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
            address = _libc.mmap(None, self.size, mmap.PROT_READ, flags, fd, 0)
        finally:
            os.close(fd)
        if address in (None, _MAP_FAILED):
            raise HydrationError(f"cannot map source {path}: {os.strerror(ctypes.get_errno())}")
        self.path, self.address, self.registered = path, int(address), False

    def register(self, driver: Any) -> None:
        try:
            cucall(driver, "cuMemHostRegister", self.address, self.size, _HOST_REGISTER_READ_ONLY)
        except CudaError:  # drivers without read-only registration
            cucall(driver, "cuMemHostRegister", self.address, self.size, 0)
        self.registered = True

    def close(self, driver: Any) -> None:
        if self.registered:
            _ok(driver, "cuMemHostUnregister", driver.cuda.cuMemHostUnregister(self.address))
            self.registered = False
        _libc.munmap(self.address, self.size)


def copy_registered(driver: Any, jobs: Sequence[tuple[int, int, int]], streams: Sequence[Any]) -> None:
    """(device address, host address, bytes) jobs in COPY_CHUNK pieces, round-robin over the streams."""
    index = 0
    for dst, src, size in jobs:
        for start in range(0, size, COPY_CHUNK):
            n = min(COPY_CHUNK, size - start)
            cucall(driver, "cuMemcpyHtoDAsync", dst + start, src + start, n, streams[index % len(streams)])
            index += 1
    for stream in streams:
        cucall(driver, "cuStreamSynchronize", stream)


def _ring_pieces(driver: Any, stream: Any, buffers: Sequence[int], events: Sequence[Any], size: int, align: int,
                 pieces: Sequence[tuple[int, str, int, int]], fds: Mapping[str, int],
                 failed: threading.Event) -> tuple[float, float]:
    """One reader thread's pieces (device address, source, offset, bytes) through its two pinned buffers: each
    read while the other's copy runs, until they end or another thread `failed`. Its seconds reading the files
    and waiting for the device."""
    read_s = device_s = 0.0
    for k, (dst, src, offset, n) in enumerate(pieces):
        if failed.is_set():  # the copy is refused anyway: the rest of a large stage is not read for nothing
            break
        slot = k % 2
        waited = time.perf_counter()
        if k >= 2:
            cucall(driver, "cuEventSynchronize", events[slot])
        read = time.perf_counter()
        device_s += read - waited
        first = offset - offset % align
        length = -(-(offset + n - first) // align) * align
        view = memoryview((ctypes.c_char * size).from_address(buffers[slot])).cast("B")
        got = os.preadv(fds[src], [view[:length]], first)
        view.release()
        if got < offset - first + n:
            raise HydrationError(f"source {src} ended at {first + got} while reading {offset + n}")
        read_s += time.perf_counter() - read
        cucall(driver, "cuMemcpyHtoDAsync", dst, buffers[slot] + (offset - first), n, stream)
        cucall(driver, "cuEventRecord", events[slot], stream)
    waited = time.perf_counter()
    cucall(driver, "cuStreamSynchronize", stream)
    return read_s, device_s + time.perf_counter() - waited


def copy_ring(driver: Any, context: Any, regions: Sequence[WeightRegion], dst_of: Callable[[WeightRegion], int],
               *, threads: int, chunk: int, direct: bool, opened: Mapping[str, int] | None = None) -> dict[str, float]:
    """Reader threads, each with two pinned buffers and a stream: pread (O_DIRECT when `direct`), then H2D.
    `opened`: sources the caller opened (and checked) already, read through those descriptors (left open).
    The report's thread-seconds say what bounds it: the files' reads or the link."""
    align = 4096 if direct else 1
    pieces = [(dst_of(r) + s, r.source, r.offset + s, min(chunk, r.size - s))
              for r in regions for s in range(0, r.size, chunk)]
    held = opened or {}
    own: dict[str, int] = {}
    try:
        for src in sorted({r.source for r in regions} - set(held)):
            own[src] = os.open(src, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
    except BaseException:  # a source that cannot be opened: the ones opened before it are closed
        for fd in own.values():
            os.close(fd)
        raise
    fds = {**held, **own}
    spent = [(0.0, 0.0, 0.0)] * threads  # per thread: pinning, reading the files, waiting for the device
    failed = threading.Event()

    def work(worker: int) -> None:
        cucall(driver, "cuCtxSetCurrent", context)
        started = time.perf_counter()
        size = chunk + 2 * align
        streams: list[Any] = []
        buffers: list[int] = []
        events: list[Any] = []
        try:  # the set-up inside: a failed page-locked allocation (concurrent stages) frees what came before it
            streams.append(cucall(driver, "cuStreamCreate", 1))
            for _ in range(2):
                buffers.append(int(cucall(driver, "cuMemHostAlloc", size, 0)))
                events.append(cucall(driver, "cuEventCreate", 2))
            pinned = time.perf_counter() - started
            spent[worker] = (pinned, *_ring_pieces(driver, streams[0], buffers, events, size, align,
                                                    pieces[worker::threads], fds, failed))
        except BaseException:
            failed.set()
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

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    finally:
        for fd in own.values():
            os.close(fd)
    return {"pin_s": max(s[0] for s in spent), "read_thread_s": sum(s[1] for s in spent),
            "device_thread_s": sum(s[2] for s in spent), "threads": threads}


def device_uuid(driver: Any, ordinal: int) -> str:
    """The GPU's UUID (`GPU-...`, as nvidia-smi prints it): ordinals differ between containers, UUIDs do not."""
    name = "cuDeviceGetUuid_v2" if hasattr(driver.cuda, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
    raw = bytes(cucall(driver, name, cucall(driver, "cuDeviceGet", ordinal)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

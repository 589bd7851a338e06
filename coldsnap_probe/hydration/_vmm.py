"""CUDA virtual memory for weights (cuda-python through `_cuda.Driver`): allocations that travel between
processes as file descriptors, and page-locked source mappings (what `_copy.Pinned` reads from)."""

from __future__ import annotations

import ctypes
import mmap
import os
from dataclasses import dataclass
from typing import Any

from ..errors import CudaError, HydrationError

__all__ = ("HostPins", "Mapped", "cucall", "device_allocation", "device_uuid", "fd_handle", "map_read_write")

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


def device_allocation(driver: Any, device: int, *, exportable: bool, rdma: bool = False) -> Any:
    """Properties of a pinned device allocation on `device` (exportable: as a file descriptor; `rdma`:
    GPUDirect RDMA capable where the device supports it with VMM, as PyTorch's expandable segments ask)."""
    cu = driver.cuda
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    if exportable:
        prop.requestedHandleTypes = fd_handle(driver)
    if rdma and _rdma_with_vmm(driver, device):
        try:
            prop.allocFlags.gpuDirectRDMACapable = 1
        except (AttributeError, TypeError):  # a binding without the field: made without it (never adopted then)
            pass
    return prop


def _rdma_with_vmm(driver: Any, device: int) -> bool:
    """Whether `device` makes GPUDirect RDMA capable VMM allocations; False when the driver or binding cannot say
    (the allocation is then made without the flag, and an engine allocation that has it is filled, not adopted)."""
    cu = driver.cuda
    try:
        attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
        return bool(cucall(driver, "cuDeviceGetAttribute", attribute, device))
    except (AttributeError, TypeError, ValueError, CudaError):
        return False


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

    def __init__(self, path: str, *, populate: bool = True, fd: int = -1, length: int = -1,
                 ranges: tuple[tuple[int, int], ...] = ()) -> None:
        """`path`'s file, or the file open as `fd` (`path` then only names it; the descriptor stays the caller's):
        the RAM tier maps the very descriptor its peer opened in its own view, never what a path names later.
        `length`: only the file's first `length` bytes (at most its size), not the whole file. `ranges`: the
        (offset, bytes) runs `register` page-locks (default: all of it); with them nothing is populated up front:
        the rest may be a dump's holes, which a populated mapping of tmpfs would fill with pages of zeros."""
        own = fd < 0
        if own:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if length > st.st_size:
                raise HydrationError(f"cannot map {length} bytes of source {path}: it holds {st.st_size}")
            self.size = st.st_size if length < 0 else length
            self.identity = (st.st_dev, st.st_ino)  # the file mapped, whatever its path names later
            self.ranges = ranges or ((0, self.size),)
            if any(offset < 0 or n <= 0 or offset + n > self.size for offset, n in self.ranges):
                raise HydrationError(f"cannot pin {self.ranges} of source {path}: beyond its {self.size} bytes")
            flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate and not ranges else 0)
            address = _libc.mmap(None, self.size, mmap.PROT_READ, flags, fd, 0)
        finally:
            if own:
                os.close(fd)
        if address in (None, _MAP_FAILED):
            raise HydrationError(f"cannot map source {path}: {os.strerror(ctypes.get_errno())}")
        self.path, self.address = path, int(address)
        self.pinned: list[int] = []  # the addresses of the ranges registered so far (each unregistered at close)

    def register(self, driver: Any, ranges: tuple[tuple[int, int], ...] = ()) -> None:
        """Page-lock `ranges` (offset, bytes; default: each of its ranges), each one registration (a failure
        leaves those done registered: `close` undoes them)."""
        for offset, n in ranges or self.ranges:
            try:
                cucall(driver, "cuMemHostRegister", self.address + offset, n, _HOST_REGISTER_READ_ONLY)
            except CudaError:  # drivers without read-only registration
                cucall(driver, "cuMemHostRegister", self.address + offset, n, 0)
            self.pinned.append(self.address + offset)

    def close(self, driver: Any) -> None:
        """Unregistered, then unmapped (a refused unregistration raises and leaves the mapping: never unmapped
        under a registration)."""
        while self.pinned:
            _ok(driver, "cuMemHostUnregister", driver.cuda.cuMemHostUnregister(self.pinned[-1]))
            self.pinned.pop()
        _libc.munmap(self.address, self.size)


@dataclass(frozen=True)
class HostPins:
    """Page-locking of mappings for `context`'s copies from any thread (each call makes the context current
    first): the node hydrator's RAM tier pins and unpins on its loader thread."""

    driver: Any
    context: Any

    def pin(self, mapped: Mapped, run: tuple[int, int]) -> None:
        """The run (offset, bytes) of `mapped` page-locked, one registration (the tier pins a dump in pieces)."""
        cucall(self.driver, "cuCtxSetCurrent", self.context)
        mapped.register(self.driver, (run,))

    def unpin(self, mapped: Mapped) -> None:
        """Unpinned, then unmapped."""
        cucall(self.driver, "cuCtxSetCurrent", self.context)
        mapped.close(self.driver)


def device_uuid(driver: Any, ordinal: int) -> str:
    """The GPU's UUID (`GPU-...`, as nvidia-smi prints it): ordinals differ between containers, UUIDs do not."""
    name = "cuDeviceGetUuid_v2" if hasattr(driver.cuda, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
    raw = bytes(cucall(driver, name, cucall(driver, "cuDeviceGet", ordinal)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

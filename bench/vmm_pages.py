"""What re-creating an engine's VMM pages costs, step by step, on the real driver (issue 36 item 1): PyTorch's
`expandable_segments:True` maps one 20 MiB `cuMemCreate` handle per page of one reservation (~830 pages at
16 GiB), and the node hydrator stages one allocation per page for the interposer to adopt. Side by side, one run:

- the creator's side (the hydrator): `cuMemCreate` of N pages, exportable and GPUDirect RDMA capable where the
  device says it supports that with VMM (as PyTorch asks), and `cuMemExportToShareableHandle` of each;
- the adopter's side (a second process, as the engine is): `cuMemImportFromShareableHandle`, `cuMemMap` and
  `cuMemSetAccess` per page, and one `cuMemSetAccess` over the whole run instead;
- the flags each side reads back with `cuMemGetAllocationPropertiesFromHandle` (does an imported handle say it is
  GPUDirect RDMA capable?), and what `cuPointerGetAttribute(IS_GPU_DIRECT_RDMA_CAPABLE)` says of the mapped page;
- whether `cuMemMap` maps a part of a larger allocation (an offset other than zero), on a created and on an
  imported handle: what would let one staged allocation back many engine pages.

    python3 bench/vmm_pages.py [--pages 832] [--page-mib 20]      (GPU host; ~10 s; prints a table and JSON)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

MIB = 1 << 20


class CudaFailed(RuntimeError):
    """A driver call answered an error (its name and the driver's name for the error)."""


def driver() -> Any:
    """cuda-python's driver module, with the GPU's primary context current (cuInit first)."""
    from cuda.bindings import driver as cu

    call(cu, "cuInit", 0)
    call(cu, "cuCtxSetCurrent", call(cu, "cuDevicePrimaryCtxRetain", call(cu, "cuDeviceGet", 0)))
    return cu


def error_name(cu: Any, err: Any) -> str:
    name = cu.cuGetErrorName(err)[1]
    return name.decode() if isinstance(name, bytes) else str(name)


def call(cu: Any, name: str, *args: Any) -> Any:
    """The driver's outputs of `name` (one unwrapped, none as None), or CudaFailed."""
    err, *outputs = getattr(cu, name)(*args)
    if int(err) != 0:
        raise CudaFailed(f"{name}: {error_name(cu, err)}")
    return outputs[0] if len(outputs) == 1 else tuple(outputs) if outputs else None


def fd_handle(cu: Any) -> Any:
    return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def allocation(cu: Any, *, rdma: bool) -> Any:
    """A pinned, exportable device allocation's properties on GPU 0, GPUDirect RDMA capable when `rdma`."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = fd_handle(cu)
    prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
    return prop


def map_read_write(cu: Any, address: int, size: int) -> None:
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    call(cu, "cuMemSetAccess", address, size, [access], 1)


def flags_of(cu: Any, handle: Any) -> dict[str, Any]:
    """What the driver says of an allocation handle: its device, handle types and GPUDirect RDMA flag."""
    prop = call(cu, "cuMemGetAllocationPropertiesFromHandle", handle)
    return {"device": int(prop.location.id), "handle_types": int(prop.requestedHandleTypes),
            "rdma": int(prop.allocFlags.gpuDirectRDMACapable)}


def try_offset_map(cu: Any, handle: Any, size: int, page: int) -> str:
    """cuMemMap of `page` bytes at offset `page` into an allocation of `size`: the driver's answer."""
    va = int(call(cu, "cuMemAddressReserve", size, 0, 0, 0))
    try:
        err = cu.cuMemMap(va, page, page, handle, 0)[0]
        if int(err) == 0:
            map_read_write(cu, va, page)
            cu.cuMemUnmap(va, page)
        return error_name(cu, err)
    finally:
        cu.cuMemAddressFree(va, size)


def pointer_rdma(cu: Any, prop: Any, page: int) -> int:
    """cuPointerGetAttribute(IS_GPU_DIRECT_RDMA_CAPABLE) of a page made with `prop`, mapped read-write."""
    handle = call(cu, "cuMemCreate", page, prop, 0)
    va = int(call(cu, "cuMemAddressReserve", page, 0, 0, 0))
    try:
        call(cu, "cuMemMap", va, page, 0, handle, 0)
        map_read_write(cu, va, page)
        attribute = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE
        return int(call(cu, "cuPointerGetAttribute", attribute, va))
    finally:
        cu.cuMemUnmap(va, page)
        cu.cuMemAddressFree(va, page)
        cu.cuMemRelease(handle)


def timed(steps: dict[str, float], name: str, started: float) -> None:
    steps[name] = round(time.perf_counter() - started, 4)


def adopter(sock_fd: int, pages: int, page: int) -> None:
    """The second process: receives the page descriptors and a large allocation's, imports and maps them."""
    cu = driver()
    conn = socket.socket(fileno=sock_fd)
    fds: list[int] = []
    while len(fds) < pages + 1:
        _, got, _, _ = socket.recv_fds(conn, 16, 253)
        fds += got
    steps: dict[str, float] = {}
    started = time.perf_counter()
    handles = [call(cu, "cuMemImportFromShareableHandle", fd, fd_handle(cu)) for fd in fds[:pages]]
    timed(steps, "import_s", started)
    imported_flags = flags_of(cu, handles[0])
    va = int(call(cu, "cuMemAddressReserve", pages * page, 0, 0, 0))
    started = time.perf_counter()
    for i, h in enumerate(handles):
        call(cu, "cuMemMap", va + i * page, page, 0, h, 0)
    timed(steps, "map_s", started)
    started = time.perf_counter()
    for i in range(pages):
        map_read_write(cu, va + i * page, page)
    timed(steps, "set_access_each_s", started)
    started = time.perf_counter()
    map_read_write(cu, va, pages * page)
    timed(steps, "set_access_once_s", started)
    attribute = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE
    pointer_rdma = int(call(cu, "cuPointerGetAttribute", attribute, va))
    started = time.perf_counter()
    call(cu, "cuMemUnmap", va, pages * page)
    for h in handles:
        call(cu, "cuMemRelease", h)
    timed(steps, "unmap_release_s", started)
    call(cu, "cuMemAddressFree", va, pages * page)
    big = call(cu, "cuMemImportFromShareableHandle", fds[pages], fd_handle(cu))
    answer = {"steps": steps, "imported_flags": imported_flags, "imported_pointer_rdma": pointer_rdma,
              "imported_big_flags": flags_of(cu, big),
              "offset_map_imported": try_offset_map(cu, big, 4 * page, page)}
    call(cu, "cuMemRelease", big)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps(answer).encode() + b"\n")


def creator(pages: int, page: int) -> dict[str, Any]:
    cu = driver()
    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    report: dict[str, Any] = {"rdma_with_vmm": int(call(cu, "cuDeviceGetAttribute", attribute, 0))}
    prop = allocation(cu, rdma=bool(report["rdma_with_vmm"]))
    report["asked_rdma"] = int(prop.allocFlags.gpuDirectRDMACapable)
    report["pointer_rdma_with_flag"] = pointer_rdma(cu, prop, page)
    report["pointer_rdma_without_flag"] = pointer_rdma(cu, allocation(cu, rdma=False), page)
    steps: dict[str, float] = {}
    started = time.perf_counter()
    handles = [call(cu, "cuMemCreate", page, prop, 0) for _ in range(pages)]
    timed(steps, "create_s", started)
    report["created_flags"] = flags_of(cu, handles[0])
    started = time.perf_counter()
    fds = [int(call(cu, "cuMemExportToShareableHandle", h, fd_handle(cu), 0)) for h in handles]
    timed(steps, "export_s", started)
    big = call(cu, "cuMemCreate", 4 * page, prop, 0)
    report["offset_map_created"] = try_offset_map(cu, big, 4 * page, page)
    fds.append(int(call(cu, "cuMemExportToShareableHandle", big, fd_handle(cu), 0)))
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "--adopter", str(theirs.fileno()), "--pages", str(pages),
                              "--page-mib", str(page // MIB)], pass_fds=(theirs.fileno(),))
    theirs.close()
    for at in range(0, len(fds), 16):
        socket.send_fds(ours, [b"p"], fds[at:at + 16])
    answer = json.loads(ours.makefile().readline() or "{}")
    child.wait()
    for fd in fds:
        os.close(fd)
    for h in [*handles, big]:
        call(cu, "cuMemRelease", h)
    report["creator_steps"] = steps
    report.update(answer)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=832, help="pages (engine allocations) to stage and adopt")
    parser.add_argument("--page-mib", type=int, default=20, help="each page's size (PyTorch's large pages: 20)")
    parser.add_argument("--adopter", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    page = args.page_mib * MIB
    if args.adopter >= 0:
        adopter(args.adopter, args.pages, page)
        return 0
    try:
        report = creator(args.pages, page)
    except (RuntimeError, ImportError, OSError) as exc:  # CudaFailed, or no driver to load
        print(f"vmm_pages: {exc}", file=sys.stderr)
        return 1
    steps = {**report.pop("creator_steps"), **report.pop("steps", {})}
    print(f"{args.pages} pages of {args.page_mib} MiB")
    print(f"| {'step':<22} | {'seconds':>8} | {'per page us':>11} |")
    for name, seconds in steps.items():
        print(f"| {name:<22} | {seconds:8.4f} | {seconds / args.pages * 1e6:11.1f} |")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

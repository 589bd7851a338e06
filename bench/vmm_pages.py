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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from coldsnap_probe._cuda import Driver
from coldsnap_probe.errors import ProbeError
from coldsnap_probe.hydration._vmm import cucall, device_allocation, fd_handle, map_read_write

MIB = 1 << 20


def flags_of(driver: Driver, handle: Any) -> dict[str, Any]:
    """What the driver says of an allocation handle: its device, handle types and GPUDirect RDMA flag."""
    prop = cucall(driver, "cuMemGetAllocationPropertiesFromHandle", handle)
    return {"device": int(prop.location.id), "handle_types": int(prop.requestedHandleTypes),
            "rdma": int(prop.allocFlags.gpuDirectRDMACapable)}


def try_offset_map(driver: Driver, handle: Any, size: int, page: int) -> str:
    """cuMemMap of `page` bytes at offset `page` into an allocation of `size`: the driver's answer."""
    va = int(cucall(driver, "cuMemAddressReserve", size, 0, 0, 0))
    try:
        err = driver.cuda.cuMemMap(va, page, page, handle, 0)[0]
        name = driver._error_text(err)[0]
        if int(err) == 0:
            map_read_write(driver, va, page, 0)
            driver.cuda.cuMemUnmap(va, page)
        return name
    finally:
        driver.cuda.cuMemAddressFree(va, size)


def pointer_rdma(driver: Driver, prop: Any, page: int) -> int:
    """cuPointerGetAttribute(IS_GPU_DIRECT_RDMA_CAPABLE) of a page made with `prop`, mapped read-write."""
    handle = cucall(driver, "cuMemCreate", page, prop, 0)
    va = int(cucall(driver, "cuMemAddressReserve", page, 0, 0, 0))
    try:
        cucall(driver, "cuMemMap", va, page, 0, handle, 0)
        map_read_write(driver, va, page, 0)
        attribute = driver.cuda.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE
        return int(cucall(driver, "cuPointerGetAttribute", attribute, va))
    finally:
        driver.cuda.cuMemUnmap(va, page)
        driver.cuda.cuMemAddressFree(va, page)
        driver.cuda.cuMemRelease(handle)


def timed(steps: dict[str, float], name: str, started: float) -> None:
    steps[name] = round(time.perf_counter() - started, 4)


def adopter(sock_fd: int, pages: int, page: int) -> None:
    """The second process: receives the page descriptors and a large allocation's, imports and maps them."""
    driver = Driver()
    driver.context(0)
    conn = socket.socket(fileno=sock_fd)
    fds: list[int] = []
    while len(fds) < pages + 1:
        _, got, _, _ = socket.recv_fds(conn, 16, 253)
        fds += got
    steps: dict[str, float] = {}
    started = time.perf_counter()
    handles = [cucall(driver, "cuMemImportFromShareableHandle", fd, fd_handle(driver)) for fd in fds[:pages]]
    timed(steps, "import_s", started)
    imported_flags = flags_of(driver, handles[0])
    va = int(cucall(driver, "cuMemAddressReserve", pages * page, 0, 0, 0))
    started = time.perf_counter()
    for i, h in enumerate(handles):
        cucall(driver, "cuMemMap", va + i * page, page, 0, h, 0)
    timed(steps, "map_s", started)
    started = time.perf_counter()
    for i in range(pages):
        map_read_write(driver, va + i * page, page, 0)
    timed(steps, "set_access_each_s", started)
    started = time.perf_counter()
    map_read_write(driver, va, pages * page, 0)
    timed(steps, "set_access_once_s", started)
    attribute = driver.cuda.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE
    pointer_rdma = int(cucall(driver, "cuPointerGetAttribute", attribute, va))
    started = time.perf_counter()
    cucall(driver, "cuMemUnmap", va, pages * page)
    for h in handles:
        cucall(driver, "cuMemRelease", h)
    timed(steps, "unmap_release_s", started)
    cucall(driver, "cuMemAddressFree", va, pages * page)
    big = cucall(driver, "cuMemImportFromShareableHandle", fds[pages], fd_handle(driver))
    answer = {"steps": steps, "imported_flags": imported_flags, "imported_pointer_rdma": pointer_rdma,
              "imported_big_flags": flags_of(driver, big),
              "offset_map_imported": try_offset_map(driver, big, 4 * page, page)}
    cucall(driver, "cuMemRelease", big)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps(answer).encode() + b"\n")


def creator(pages: int, page: int) -> dict[str, Any]:
    driver = Driver()
    driver.context(0)
    attribute = driver.cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    report: dict[str, Any] = {"rdma_with_vmm": int(cucall(driver, "cuDeviceGetAttribute", attribute, 0))}
    prop = device_allocation(driver, 0, exportable=True, rdma=True)
    report["asked_rdma"] = int(prop.allocFlags.gpuDirectRDMACapable)
    report["pointer_rdma_with_flag"] = pointer_rdma(driver, prop, page)
    report["pointer_rdma_without_flag"] = pointer_rdma(driver, device_allocation(driver, 0, exportable=True), page)
    steps: dict[str, float] = {}
    started = time.perf_counter()
    handles = [cucall(driver, "cuMemCreate", page, prop, 0) for _ in range(pages)]
    timed(steps, "create_s", started)
    report["created_flags"] = flags_of(driver, handles[0])
    started = time.perf_counter()
    fds = [int(cucall(driver, "cuMemExportToShareableHandle", h, fd_handle(driver), 0)) for h in handles]
    timed(steps, "export_s", started)
    big = cucall(driver, "cuMemCreate", 4 * page, prop, 0)
    report["offset_map_created"] = try_offset_map(driver, big, 4 * page, page)
    fds.append(int(cucall(driver, "cuMemExportToShareableHandle", big, fd_handle(driver), 0)))
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
        cucall(driver, "cuMemRelease", h)
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
    except ProbeError as exc:
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

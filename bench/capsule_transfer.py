"""A capture's path through a registry as the controller drives it (issue 34, item 1: measure it first).

    python bench/capsule_transfer.py --base IMAGE [--mib 1024] [--zero-percent 57] [--out FILE.json]

Through a real `coldsnap-provider serve` and runtime-v1 only: `image-build` of a capsule that carries a capture's
data (`pages.img`: random bytes, then `--zero-percent` of zeros, the share one public tool reports for an inference
server's CRIU images), `image-push` to a real registry (Debian's docker-registry on 127.0.0.1, no auth), `image-remove`,
the page cache dropped, `image-pull`, and a `workload-run` that reads the capture back from the pulled capsule. Beside
them, in the same run, the machine's own rates: a memory copy, the disk read with O_DIRECT, and the registry link
(the same bytes as one blob, pushed and fetched through the registry's HTTP API with nothing compressed).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import free_port, table
from bench._daemon import Session, running_daemon

CHUNK = 8 << 20



def start_registry(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    (work / "registry.yml").write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: "
                                       f"{work / 'registry'}\n  delete:\n    enabled: true\nhttp:\n"
                                       f"  addr: 127.0.0.1:{port}\n")
    process = subprocess.Popen(["docker-registry", "serve", str(work / "registry.yml")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return process, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("docker-registry did not listen")


def write_capture(path: Path, mib: int, zero_percent: int) -> None:
    random_mib = mib * (100 - zero_percent) // 100
    with open(path, "wb") as out:
        for _ in range(random_mib // 8):
            out.write(os.urandom(CHUNK))
        zeros = bytes(CHUNK)
        for _ in range((mib - random_mib) // 8):
            out.write(zeros)
        out.flush()
        os.fsync(out.fileno())


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def memory_copy_gbps(size: int = 1 << 30) -> float:
    """One thread's copy between two buffers already touched (memcpy, no page faults)."""
    source, target = bytearray(b"\1" * size), bytearray(size)
    target[:] = source
    started = time.perf_counter()
    target[:] = source
    return size / (time.perf_counter() - started) / 1e9


def direct_read_gbps(path: Path) -> float:
    """The disk's read rate: the file through O_DIRECT (aligned 8 MiB reads), after the page cache was dropped."""
    drop_caches()
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total, started = 0, time.perf_counter()
    try:
        while n := os.readv(fd, [buffer]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - started) / 1e9


def registry_link(address: str, path: Path) -> dict[str, float]:
    """The same bytes as one blob, uncompressed, up (monolithic PUT) and down (GET), through the registry's API."""
    size = path.stat().st_size
    digest = "sha256:" + subprocess.run(["sha256sum", str(path)], capture_output=True, text=True,
                                        check=True).stdout.split()[0]
    connection = http.client.HTTPConnection(address, timeout=600)
    connection.request("POST", "/v2/coldsnap/link/blobs/uploads/")
    answer = connection.getresponse()
    answer.read()
    location = answer.getheader("Location") or ""
    separator = "&" if "?" in location else "?"
    started = time.perf_counter()
    with open(path, "rb") as body:
        connection.request("PUT", f"{location}{separator}digest={digest}", body=body,
                           headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"})
        answer = connection.getresponse()
        answer.read()
    up = time.perf_counter() - started
    started = time.perf_counter()
    connection.request("GET", f"/v2/coldsnap/link/blobs/{digest}")
    answer = connection.getresponse()
    while answer.read(CHUNK):
        pass
    down = time.perf_counter() - started
    return {"push_gbps": size / up / 1e9, "pull_gbps": size / down / 1e9}


async def timed(session: Session, action: str, **fields: Any) -> float:
    started = time.perf_counter()
    reply = await session.runtime(action, **fields)
    if not reply.ok:
        raise SystemExit(f"{action}: {reply.error}")
    return time.perf_counter() - started


async def controller_path(session: Session, context: Path, reference: str, base: str) -> dict[str, float]:
    dockerfile = f"FROM {base}\nCOPY pages.img /images/pages.img\n".encode()
    phases = {"image-build": await timed(session, "image-build", build={
        "dockerfile": base64.b64encode(dockerfile).decode(), "context": str(context), "tag": reference})}
    phases["image-push"] = await timed(session, "image-push", image=reference)
    phases["image-remove"] = await timed(session, "image-remove", image=reference)
    drop_caches()
    phases["image-pull"] = await timed(session, "image-pull", image=reference)
    drop_caches()
    phases["read the capture in the pulled capsule (cold cache)"] = await timed(
        session, "workload-run", workload={"image": reference, "name": "", "remove_after_exit": True,
                                           "command": ["sh", "-c", "cat /images/pages.img > /dev/null"]})
    await timed(session, "image-remove", image=reference)
    return phases


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="a local image to build the capsule FROM")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--zero-percent", type=int, default=57)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cs-transfer-", dir="/var/tmp"))
    registry, address = start_registry(work)
    try:
        context = work / "context"
        context.mkdir()
        write_capture(context / "pages.img", args.mib, args.zero_percent)
        size = (context / "pages.img").stat().st_size
        rates = {"memory copy": memory_copy_gbps(), "disk read, O_DIRECT": direct_read_gbps(context / "pages.img"),
                 **{f"registry link, {k.split('_')[0]} (one uncompressed blob)": v
                    for k, v in registry_link(address, context / "pages.img").items()}}
        async with running_daemon() as daemon:
            session = await daemon.open_session()
            phases = await controller_path(session, context, f"{address}/coldsnap/capsule-transfer:1", args.base)
    finally:
        registry.kill()
        registry.wait()
        shutil.rmtree(work, ignore_errors=True)
    rows = [[name, f"{seconds:.2f}", f"{size / seconds / 1e9:.3f}"] for name, seconds in phases.items()]
    print(f"capture data: {size / 2**20:.0f} MiB, {args.zero_percent}% zeros")
    print(table(["runtime-v1 phase", "seconds", "GB/s of capture data"], rows))
    print()
    print(table(["the machine's own rate, same run", "GB/s"], [[k, f"{v:.3f}"] for k, v in rates.items()]))
    if args.out:
        args.out.write_text(json.dumps({"mib": args.mib, "zero_percent": args.zero_percent, "bytes": size,
                                        "phases_s": phases, "rates_gbps": rates}, indent=1) + "\n")


if __name__ == "__main__":
    anyio.run(main)

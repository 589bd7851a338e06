"""A capture's path through a registry as the controller drives it (issue 34): Docker's path and the store's.

    python bench/capsule_transfer.py --base IMAGE | --busybox PATH [--mib 1024] [--zero-percent 57]
                                     [--change-percent 4] [--paths docker,store] [--docker-url URL] [--out FILE.json]
                                     [--source synthetic|criu --criu CRIU --target "ARGS"]

Through a real `coldsnap-provider serve` and runtime-v1 only: `image-build` of a capsule that carries a capture's
images directory (`capture.json` and `pages.img`: random bytes, then `--zero-percent` of zeros, the share one public
tool reports for an inference server's CRIU images), `image-push` to a real registry (Debian's docker-registry on
127.0.0.1, no auth), `image-remove`, the page cache dropped, `image-pull`, and a `workload-run` that reads the capture
back from the pulled capsule. Each path runs it: `docker` (a daemon without a capture store: the bytes in the image's
layers) and `store` (`[docker] capture_store`: the build by one daemon with its own store, the pull and the run by
another daemon with an empty one, as another node would). Then the store's second capture of the same data, with
`--change-percent` of its random bytes changed: what it adds to the registry and to a node store. Beside them, in the
same run, the machine's own rates: a memory copy, the disk read with O_DIRECT, and the registry link (the same bytes
through the registry's HTTP API, nothing compressed: as one blob, and as 64 MiB blobs eight at a time).

With `--source criu` both captures are real: two runs of bench/engine_shape_target.py (`--target`: the same
weights every run, fresh state, a Python heap, threads and libraries) each captured by the capture worker with the
built CRIU (bench/capture_pair.py). The second capture's new bytes are read from the registry's storage and the
store's directory, and per kind of file beside what 64 MiB chunks from each file's start would have added.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.client
import json
import mmap
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import free_port, table
from bench._daemon import Session, running_daemon
from bench.capture_pair import criu_capture, fingerprint, share_rows, share_table, worst_table

CHUNK = 8 << 20
# --source criu: an engine's process, small enough for this machine: 1 GiB of weights (the same bytes every run),
# 32 MiB of fresh state (a KV cache), a 200 MiB heap of objects of seeded bytes, 40 threads, 100 libraries.
TARGET = "--threads 40 --libs 100 --anon-mib 0 --heap-mib 200 --heap-seeded --weights-mib 1024 --state-mib 32"
BLOB = 64 << 20  # the capture store's chunk



def start_registry(work: Path, log: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Debian's docker-registry on 127.0.0.1, its storage under `work`; its log (one access line per request) into
    `log`, else nowhere."""
    port = free_port()
    (work / "registry.yml").write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: "
                                       f"{work / 'registry'}\n  delete:\n    enabled: true\nhttp:\n"
                                       f"  addr: 127.0.0.1:{port}\n")
    with open(log or os.devnull, "wb") as out:
        process = subprocess.Popen(["docker-registry", "serve", str(work / "registry.yml")], stdout=out, stderr=out)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return process, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("docker-registry did not listen")


def write_capture(images: Path, mib: int, zero_percent: int) -> None:
    images.mkdir(parents=True)
    (images / "capture.json").write_text('{"bench": "capsule_transfer"}\n')
    random_mib = mib * (100 - zero_percent) // 100
    with open(images / "pages.img", "wb") as out:
        for _ in range(random_mib // 8):
            out.write(os.urandom(CHUNK))
        zeros = bytes(CHUNK)
        for _ in range((mib - random_mib) // 8):
            out.write(zeros)
        out.flush()
        os.fsync(out.fileno())


def second_capture(first: Path, second: Path, change_percent: int) -> None:
    """The same capture again, with `change_percent` of its 64 MiB chunks of random bytes rewritten (a later capture
    of the same model: the same weights and most pages, a few pages that changed)."""
    shutil.copytree(first, second)
    size = (second / "pages.img").stat().st_size
    chunks = size // BLOB
    with open(second / "pages.img", "r+b") as out:
        for index in range(0, chunks, max(1, 100 // max(1, change_percent))):
            out.seek(index * BLOB)
            if out.read(1) != b"\0":
                out.seek(index * BLOB)
                out.write(os.urandom(1 << 20))
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


def registry_link_parallel(address: str, path: Path, parallel: int = 8) -> dict[str, float]:
    """The same bytes as 64 MiB blobs (the zero ones too), `parallel` at a time, up (POST + PUT) and down (GET)."""
    with open(path, "rb") as source:  # each blob's first byte changed: bytes no other repository holds
        blobs = [bytes([blob[0] ^ 0x5A]) + blob[1:] for blob in iter(lambda: source.read(BLOB), b"")]
    digests = ["sha256:" + hashlib.sha256(blob).hexdigest() for blob in blobs]

    def up(index: int) -> None:
        connection = http.client.HTTPConnection(address, timeout=600)
        connection.request("POST", "/v2/coldsnap/link-parallel/blobs/uploads/")
        answer = connection.getresponse()
        answer.read()
        location = answer.getheader("Location") or ""
        separator = "&" if "?" in location else "?"
        connection.request("PUT", f"{location}{separator}digest={digests[index]}", body=blobs[index],
                           headers={"Content-Type": "application/octet-stream"})
        connection.getresponse().read()

    def down(index: int) -> None:
        connection = http.client.HTTPConnection(address, timeout=600)
        connection.request("GET", f"/v2/coldsnap/link-parallel/blobs/{digests[index]}")
        answer = connection.getresponse()
        while answer.read(CHUNK):
            pass

    rates = {}
    for name, work in (("push", up), ("pull", down)):
        started = time.perf_counter()
        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(work, range(len(blobs))))
        rates[name] = sum(map(len, blobs)) / (time.perf_counter() - started) / 1e9
    return rates


def link_sample(pages: Path, sample: Path, limit: int = 2 << 30) -> Path:
    """The capture's first `limit` bytes: the link is measured on at most 2 GiB, so a 16 GiB run still fits the disk."""
    with open(pages, "rb") as source, open(sample, "wb") as out:
        copied = 0
        while copied < limit and (block := source.read(min(CHUNK, limit - copied))):
            copied += out.write(block)
    return sample


def directory_bytes(path: Path) -> int:
    """Bytes on disk under `path` (allocated blocks: holes count nothing)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and not p.is_symlink())


async def timed(session: Session, action: str, **fields: Any) -> float:
    started = time.perf_counter()
    reply = await session.runtime(action, **fields)
    if not reply.ok:
        raise SystemExit(f"{action}: {reply.error}")
    return time.perf_counter() - started


async def busybox_base(work: Path, busybox: Path, docker: str) -> str:
    """A base image with a shell, built from a static busybox through runtime-v1 (the GPU machine has no images)."""
    context = work / "base"
    (context / "bin").mkdir(parents=True)
    shutil.copy2(busybox, context / "bin" / "busybox")
    for applet in ("sh", "cat", "sha256sum"):
        (context / "bin" / applet).symlink_to("busybox")
    dockerfile = b'FROM scratch\nCOPY bin /bin\nENV PATH=/bin\nCMD ["sh"]\n'
    async with running_daemon(docker) as daemon:
        await timed(await daemon.open_session(), "image-build", build={
            "dockerfile": base64.b64encode(dockerfile).decode(), "context": str(context),
            "tag": "coldsnap-bench/busybox:transfer"})
    return "coldsnap-bench/busybox:transfer"


async def build_and_push(session: Session, context: Path, reference: str, base: str) -> dict[str, float]:
    dockerfile = f"FROM {base}\nCOPY images /images\n".encode()
    phases = {"image-build": await timed(session, "image-build", build={
        "dockerfile": base64.b64encode(dockerfile).decode(), "context": str(context), "tag": reference})}
    phases["image-push"] = await timed(session, "image-push", image=reference)
    phases["image-remove"] = await timed(session, "image-remove", image=reference)
    return phases


def disk_written(path: Path) -> int:
    """The bytes the block device holding `path` has written so far (its stat's sectors written)."""
    device = os.stat(path).st_dev
    return int(Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat").read_text().split()[6]) * 512


async def pull_and_read(session: Session, reference: str, disk: Path) -> tuple[dict[str, float], int]:
    """The pull's and the read's seconds, and the bytes the pull wrote to `disk`'s device (the engine's too)."""
    drop_caches()
    before = disk_written(disk)
    phases = {"image-pull": await timed(session, "image-pull", image=reference)}
    os.sync()
    written = disk_written(disk) - before
    drop_caches()
    phases["read the capture in the pulled capsule (cold cache)"] = await timed(
        session, "workload-run", workload={"image": reference, "name": "", "remove_after_exit": True,
                                           "command": ["sh", "-c", "cat /images/* > /dev/null"]})
    await timed(session, "image-remove", image=reference)
    return phases, written


def captures_in(store: Path) -> set[str]:
    return {"sha256:" + p.name.removesuffix(".json") for p in (store / "captures").glob("*.json")}


async def store_path(work: Path, address: str, base: str, second: Callable[[Path], object] | None, docker: str,
                     shares: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int]]:
    """The store's path (build + push on node A, pull + read on node B), then a second capture on node A."""
    registry_before = directory_bytes(work / "registry")
    store_a, store_b = work / "store-a", work / "store-b"
    async with running_daemon(f'{docker}capture_store = "{store_a}"\n') as node_a, \
            running_daemon(f'{docker}capture_store = "{store_b}"\n') as node_b:
        session_a, session_b = await node_a.open_session(), await node_b.open_session()
        phases = await build_and_push(session_a, work / "context", f"{address}/coldsnap/capsule-store:1", base)
        captures = sorted(captures_in(store_a))
        first = {"registry": directory_bytes(work / "registry") - registry_before,
                 "node store": directory_bytes(store_a)}
        pulled, written = await pull_and_read(session_b, f"{address}/coldsnap/capsule-store:1", store_b.parent)
        phases |= pulled
        first["written to the disk by the pull"] = written
        if second is None:  # --change-percent 0: no second capture (it copies the capture: disk space)
            return phases, {"registry, first capture": first["registry"], "node store, first capture":
                            first["node store"], "written to the disk by the pull": written}
        second(work / "context-2" / "images")
        phases |= {f"second capture: {k}": v for k, v in (await build_and_push(
            session_a, work / "context-2", f"{address}/coldsnap/capsule-store:2", base)).items()}
        captures += sorted(captures_in(store_a) - set(captures))
        shares += share_rows(fingerprint(work / "context" / "images"), work / "context-2" / "images", store_a,
                             (captures[0], captures[1]))
    added = {"registry, first capture": first["registry"],
             "registry, second capture (new bytes)": directory_bytes(work / "registry") - registry_before
             - first["registry"],
             "node store, first capture": first["node store"],
             "node store, second capture (new bytes)": directory_bytes(store_a) - first["node store"],
             "written to the disk by the pull": first["written to the disk by the pull"]}
    return phases, added


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="a local image to build the capsule FROM (with a shell)")
    parser.add_argument("--busybox", type=Path, help="or a static busybox to build such a base from")
    parser.add_argument("--docker-url", default="unix:///var/run/docker.sock")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--zero-percent", type=int, default=57)
    parser.add_argument("--change-percent", type=int, default=4)
    parser.add_argument("--paths", default="docker,store")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--source", choices=("synthetic", "criu"), default="synthetic")
    parser.add_argument("--criu", help="the built CRIU (--source criu)")
    parser.add_argument("--target", default=TARGET, help="bench/engine_shape_target.py's arguments (--source criu)")
    args = parser.parse_args()
    if (args.base is None) == (args.busybox is None):
        parser.error("give --base or --busybox")
    if args.source == "criu" and not args.criu:
        parser.error("--source criu needs --criu (scripts/criu/build --print-dir)/usr/sbin/criu")
    work = Path(tempfile.mkdtemp(prefix="cs-transfer-", dir="/var/tmp"))
    registry, address = start_registry(work)
    phases: dict[str, dict[str, float]] = {}
    added: dict[str, int] = {}
    shares: list[dict[str, Any]] = []
    first_images = work / "context" / "images"
    try:
        second = capture_sources(args, work)
        files = [p for p in first_images.rglob("*") if p.is_file()]
        pages, size = max(files, key=lambda p: p.stat().st_size), sum(p.stat().st_size for p in files)
        sample = link_sample(pages, work / "link-sample.bin")
        rates = {"memory copy": memory_copy_gbps(), "disk read, O_DIRECT": direct_read_gbps(pages),
                 **{f"registry link, {k.split('_')[0]} (one uncompressed blob)": v
                    for k, v in registry_link(address, sample).items()},
                 **{f"registry link, {k} (64 MiB blobs, 8 at a time)": v
                    for k, v in registry_link_parallel(address, sample).items()}}
        sample.unlink()
        docker = f'[docker]\nurl = "{args.docker_url}"\n'
        if args.busybox is not None:
            args.base = await busybox_base(work, args.busybox, docker)
        if "docker" in args.paths.split(","):
            async with running_daemon(docker) as daemon:
                session = await daemon.open_session()
                reference = f"{address}/coldsnap/capsule-transfer:1"
                phases["docker"] = await build_and_push(session, work / "context", reference, args.base)
                phases["docker"] |= (await pull_and_read(session, reference, work))[0]
        if "store" in args.paths.split(","):
            phases["store"], added = await store_path(work, address, args.base, second, docker, shares)
    finally:
        registry.kill()
        registry.wait()
        shutil.rmtree(work, ignore_errors=True)
    report(args, size, phases, rates, added, shares)


def capture_sources(args: argparse.Namespace, work: Path) -> Callable[[Path], object] | None:
    """Make the first capture's images (context/images); what makes the second's (None: no second capture)."""
    first = work / "context" / "images"
    if args.source == "criu":
        target = shlex.split(args.target)
        seconds = criu_capture(first, args.criu, target, work)
        print(f"first capture: {seconds:.2f} s", flush=True)
        return lambda images: criu_capture(images, args.criu, target, work)
    write_capture(first, args.mib, args.zero_percent)
    if not args.change_percent:
        return None
    return lambda images: second_capture(first, images, args.change_percent)


def report(args: argparse.Namespace, size: int, phases: dict[str, dict[str, float]], rates: dict[str, float],
           added: dict[str, int], shares: list[dict[str, Any]]) -> None:
    names = list(dict.fromkeys(name for path in phases.values() for name in path))
    rows = [[name, *(f"{p[name]:.2f} s, {size / p[name] / 1e9:.3f} GB/s" if name in p else "" for p in
                     phases.values())] for name in names]
    print(f"capture data: {size / 2**20:.0f} MiB, " + (
        f"two CRIU captures of bench/engine_shape_target.py {args.target}" if args.source == "criu" else
        f"{args.zero_percent}% zeros, the second with {args.change_percent}% of its 64 MiB chunks changed"))
    print(table(["runtime-v1 phase", *(f"{path} path" for path in phases)], rows))
    print()
    print(table(["the machine's own rate, same run", "GB/s"], [[k, f"{v:.3f}"] for k, v in rates.items()]))
    if added:
        print()
        print(table(["bytes added (store path)", "MiB", "share of the capture"],
                    [[k, f"{v / 2**20:.1f}", f"{100 * v / size:.1f} %"] for k, v in added.items()]))
        moved, store = added["registry, first capture"], phases.get("store", {})
        link = {kind: max(v for k, v in rates.items() if k.startswith(f"registry link, {kind}")) for kind in
                ("push", "pull")}
        print()
        print(table(["store path, the bytes it moved", "GB/s", "of the best link rate"],
                    [[f"image-{kind} ({moved / 2**20:.0f} MiB)", f"{moved / store[f'image-{kind}'] / 1e9:.3f}",
                      f"{100 * moved / store[f'image-{kind}'] / 1e9 / link[kind]:.0f} %"]
                     for kind in ("push", "pull") if f"image-{kind}" in store]))
    if shares:
        print()
        print(table(*share_table(shares)))
        print()
        print(table(*worst_table(shares)))
    if args.out:
        args.out.write_text(json.dumps({"mib": args.mib, "zero_percent": args.zero_percent, "bytes": size,
                                        "change_percent": args.change_percent, "phases_s": phases,
                                        "rates_gbps": rates, "bytes_added": added, "source": args.source,
                                        "target": args.target, "second_capture_by_file": shares}, indent=1) + "\n")


if __name__ == "__main__":
    anyio.run(main)

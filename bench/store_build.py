"""An image-build of a capsule carrying a capture, phase by phase, side by side in one run (issue 34: each step at
the machine's limit):

    python bench/store_build.py [--mib 2048] [--page-mib 256] [--work DIR] [--context-dir DIR] [--before REF]
                                [--rounds 2] [--json FILE]

A build context of `--mib` MiB in tmpfs (`--context-dir`, /dev/shm by default, as on the H200 run): a Dockerfile
that copies `images/` into `coldsnap-test/busybox:1`, the worker's `capture.json`, device dumps of distinct 64 MiB
chunks and one `pages-1.img` of `--page-mib` random MiB (cut by content, ~190 KiB chunks). For each side (`--before`'s
coldsnap_runtime, a git ref, then this checkout's; in turns, `--rounds` times, each in a child process importing its
own package, a fresh store under `--work` on the disk each time), the daemon's path as `Images.build` runs it:

* pack: `write_context_tar` into a spool file under `--work` (the packer process, as the session's owner would);
* ingest: `store_context` (the stored files' chunks hashed and written into the store, the capture recorded, the
  filtered context written), wall time and the disk bytes written meanwhile;
* docker build: the filtered context through the engine's classic builder (`docker build`, DOCKER_BUILDKIT=0).

Beside them, this machine's own rates, measured on the same data in the same run: SHA-256 in one thread, the regular
expression's cut of the page image, reading the spool's members through `tarfile`, memory copy, and the disk's write
rate (O_DIRECT, 8 MiB writes; and 64 MiB files written and fsynced one after another, as the store names blobs).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The child's package comes first (`--package-root`): nothing of coldsnap_runtime is imported before it is placed.
BASE = "coldsnap-test/busybox:1"
CHUNK = 64 << 20
DOCKERFILE = f"FROM {BASE}\nCOPY images /images\n"


def make_context(root: Path, mib: int, page_mib: int) -> int:
    """The build context under `root`: dumps of distinct 64 MiB chunks and one page image; its bytes."""
    images = root / "images"
    images.mkdir(parents=True)
    (root / "Dockerfile").write_text(DOCKERFILE)
    (images / "capture.json").write_text('{"bench": "store_build"}\n')
    block = bytearray(os.urandom(CHUNK))
    dump_chunks = max(0, (mib - page_mib) * (1 << 20) // CHUNK)
    per_file = 9  # 576 MiB a dump file, as the device dumps' segment files are hundreds of MiB
    for n in range(0, dump_chunks, per_file):
        with open(images / f"device-{n // per_file}.bin", "wb") as out:
            for i in range(n, min(n + per_file, dump_chunks)):
                block[:8] = i.to_bytes(8, "little")  # each chunk its own blob
                out.write(block)
    with open(images / "pages-1.img", "wb") as out:
        for _ in range(page_mib):
            out.write(os.urandom(1 << 20))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def disk_written(path: Path) -> int:
    st = os.stat(path)
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    if not stat.exists():  # a partition's counters sit under its disk; the whole disk's are as good here
        return 0
    return int(stat.read_text().split()[6]) * 512


def rates(context: Path, work: Path) -> dict[str, float]:
    """GB/s of the machine's parts, on the run's own data and disk."""
    page = (context / "images" / "pages-1.img").read_bytes()
    dump = next((context / "images").glob("device-*.bin"))
    found: dict[str, float] = {}
    with open(dump, "rb") as f:
        data = f.read(4 * CHUNK)
    start = time.perf_counter()
    for n in range(0, len(data), CHUNK):
        hashlib.sha256(memoryview(data)[n:n + CHUNK]).digest()
    found["SHA-256, one thread"] = len(data) / (time.perf_counter() - start) / 1e9
    from coldsnap_runtime.chunking import content_cuts
    start = time.perf_counter()
    content_cuts(page, final=True)
    found["cut by content (the page image, one thread)"] = len(page) / (time.perf_counter() - start) / 1e9
    copy = bytearray(len(data))  # faulted in first: the copy alone is timed
    start = time.perf_counter()
    copy[:] = data
    found["memory copy"] = len(copy) / (time.perf_counter() - start) / 1e9
    del copy
    spool = work / "rate-spool.tar"
    with tarfile.open(spool, "w") as tar:
        tar.add(context / "images", arcname="images")
    size = sum(p.stat().st_size for p in (context / "images").iterdir())
    found["reading members through tarfile (page cache, 64 MiB reads)"] = size / read_members(spool, False) / 1e9
    found["reading members at their offsets into reused 64 MiB windows"] = size / read_members(spool, True) / 1e9
    spool.unlink()
    found["disk write, O_DIRECT (8 MiB writes, fsync)"] = direct_write(work / "rate-direct", 1 << 30)
    target = work / "rate-files"
    target.mkdir()
    start = time.perf_counter()
    for n in range(0, len(data), CHUNK):
        with open(target / str(n), "xb") as out:
            out.write(memoryview(data)[n:n + CHUNK])
            out.flush()
            os.fsync(out.fileno())
    found["disk write, 64 MiB files fsynced in turn"] = len(data) / (time.perf_counter() - start) / 1e9
    shutil.rmtree(target)
    return found


def direct_write(path: Path, size: int) -> float:
    buffer = mmap.mmap(-1, 8 << 20)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(8 << 20))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(size // (8 << 20)):
            os.write(fd, buffer)
        os.fsync(fd)
        return size / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        path.unlink()


def read_members(spool: Path, at_offsets: bool) -> float:
    """Seconds to read the spool's members into 64 MiB buffers: through tarfile's reader (the ingest before), or
    from the spool at each member's offset into one buffer used again (the ingest now)."""
    start = time.perf_counter()
    buffer = bytearray(CHUNK)
    with open(spool, "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            if at_offsets:
                raw.seek(member.offset_data)
                left = member.size
                while left:
                    left -= raw.readinto(memoryview(buffer)[:min(left, CHUNK)])
            else:
                reader = tar.extractfile(member)
                assert reader is not None
                while reader.readinto(bytearray(CHUNK)):  # type: ignore[attr-defined]  # a fresh window each
                    pass
    return time.perf_counter() - start


def side(package_root: Path, context: Path, work: Path) -> dict[str, Any]:
    """One side's build path, in this process, with `package_root`'s coldsnap_runtime."""
    sys.path.insert(0, str(package_root))
    import anyio

    import coldsnap_runtime
    from coldsnap_runtime import backend

    def public(name: str, module: str) -> Any:  # a ref from before they were public (ee52b42): its own module's
        return getattr(backend, name, None) or getattr(importlib.import_module(f"{backend.__name__}.{module}"), name)

    store_context = public("store_context", "_capture_build")
    write_context_tar = public("write_context_tar", "_buildctx")
    from coldsnap_runtime.store import CaptureStore

    result: dict[str, Any] = {"package": coldsnap_runtime.__file__}
    store = CaptureStore(work / "store")
    store.open()
    spool_path, filtered_path = work / "spool.tar", work / "filtered.tar"
    with open(spool_path, "w+b") as spool, open(filtered_path, "w+b") as filtered:
        written = disk_written(work)
        start = time.perf_counter()
        anyio.run(lambda: write_context_tar(spool, context=str(context), contexts={},
                                            dockerfile=DOCKERFILE.encode(), owner=None))
        result["pack"] = time.perf_counter() - start
        result["pack_written"] = disk_written(work) - written
        result["spool"] = spool.tell()
        spool.seek(0)
        written = disk_written(work)
        start = time.perf_counter()
        capture = store_context(spool, filtered, store)
        result["ingest"] = time.perf_counter() - start
        result["ingest_written"] = disk_written(work) - written
        result["capture"] = capture
        result["filtered"] = filtered.tell()
    tag = f"coldsnap-bench/store-build:{os.getpid()}"
    start = time.perf_counter()
    with open(filtered_path, "rb") as filtered:
        subprocess.run(["docker", "build", "-q", "-f", ".coldsnap-build/Dockerfile", "-t", tag, "-"],
                       stdin=filtered, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "DOCKER_BUILDKIT": "0"})
    result["build"] = time.perf_counter() - start
    subprocess.run(["docker", "rmi", "-f", tag], check=True, stdout=subprocess.DEVNULL)
    return result


def before_tree(ref: str, into: Path) -> Path:
    """`ref`'s coldsnap_runtime under `into` (git archive)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "coldsnap_runtime"], check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_side(root: Path, context: Path, work: Path) -> dict[str, Any]:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    from bench._common import drop_caches
    drop_caches()  # the last side's blobs written back first: each side starts from a quiet disk
    out = subprocess.run([sys.executable, __file__, "--side", str(root), "--context-dir", str(context),
                          "--work", str(work)], check=True, stdout=subprocess.PIPE, text=True).stdout
    shutil.rmtree(work)
    return dict(json.loads(out.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=2048, help="the capture's MiB in the build context")
    parser.add_argument("--page-mib", type=int, default=256, help="of those, the page image cut by content")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/coldsnap-store-build"),
                        help="the store and the spool (the disk)")
    parser.add_argument("--context-dir", type=Path, default=Path("/dev/shm/coldsnap-store-build"))
    parser.add_argument("--before", help="a git ref whose coldsnap_runtime runs beside this checkout's")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--side", type=Path, help=argparse.SUPPRESS)  # the child's part: its package root
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.context_dir, args.work)))
        return
    sys.path.insert(0, str(ROOT))
    if args.context_dir.exists() or args.work.exists():
        raise SystemExit(f"{args.context_dir} or {args.work} exists: give fresh paths")
    scratch = Path(tempfile.mkdtemp(prefix="store-build-", dir="/var/tmp"))
    try:
        size = make_context(args.context_dir, args.mib, args.page_mib)
        args.work.mkdir(parents=True)
        machine = rates(args.context_dir, args.work)
        shutil.rmtree(args.work)
        sides = {"this checkout": ROOT}
        if args.before:
            sides = {f"before ({args.before})": before_tree(args.before, scratch / "before"), **sides}
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, root in sides.items():
                results[name].append(run_side(root, args.context_dir, args.work))
        report(size, machine, results)
        if args.json:
            args.json.write_text(json.dumps({"context_bytes": size, "rates": machine, "sides": results}, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(args.context_dir, ignore_errors=True)
        shutil.rmtree(args.work, ignore_errors=True)


def report(size: int, machine: dict[str, float], results: dict[str, list[dict[str, Any]]]) -> None:
    from bench._common import table
    gb = size / 1e9
    rows = []
    for name, runs in results.items():
        for n, r in enumerate(runs, 1):
            total = r["pack"] + r["ingest"] + r["build"]
            rows.append([f"{name} #{n}", f"{r['pack']:.2f}", f"{r['ingest']:.2f}",
                         f"{gb / r['ingest']:.3f}", f"{r['ingest_written'] / 1e9:.2f}", f"{r['build']:.2f}",
                         f"{total:.2f}", f"{gb / total:.3f}"])
    print(f"a build context of {gb:.2f} GB (device dumps and one page image); nproc {os.cpu_count()}\n")
    print(table(["side", "pack s", "ingest s", "ingest GB/s", "ingest disk written GB",
                 "docker build s", "build s", "build GB/s"], rows))
    print()
    print(table(["the machine's own rate, same run", "GB/s", f"s for {gb:.2f} GB"],
                [[k, f"{v:.3f}", f"{gb / v:.2f}"] for k, v in machine.items()]))


if __name__ == "__main__":
    main()

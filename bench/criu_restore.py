"""CRIU's restore of a process's private memory, one thread against N, from tmpfs, the page cache and a cold disk.

    python bench/criu_restore.py --criu DIR/usr/sbin/criu [--gib 1] [--threads N] [--runs 1] [--disk-dir /var/tmp]
                                 [--out DIR]

A process (`bench/criu_target.py --repeat`) maps `--gib` GiB of private anonymous memory; CRIU (the build of
`scripts/criu/build`, run with its library directory) dumps it to tmpfs. Each row restores it
(`--restore-detached`) with CRIU_RESTORE_THREADS=1 (stock: the restorer's one preadv stream) and =N (default:
the CPUs this process may use) and reports the restore's wall time, image GB/s and the share of the restored
memory in huge pages; then the restored process is killed and reaped. Images: on tmpfs (/dev/shm), copied to
--disk-dir and in the page cache, and on the cold disk (caches dropped; root only) with the disk's own sequential
read rate measured in the same run. Then the same for a target whose memory is advised MADV_HUGEPAGE (the
patch's fill gets huge pages there; tmpfs and page cache only). The fill ceiling
(`bench/page_fill.py`'s preadv into fresh memory, N threads, 4 KiB and THP) is measured from the same tmpfs
images. Run as root (CRIU). A table on stdout, JSON in --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import disk_read_rate, drop_caches, table, wait_file
from bench.page_fill import fill

COLD_BUDGET_S = 15.0  # a cold-disk row that would take longer than this (at the measured rate) is skipped


def criu_env(criu: Path, threads: int) -> dict[str, str]:
    libs = criu.resolve().parent.parent / "lib/x86_64-linux-gnu"
    return {**os.environ, "LD_LIBRARY_PATH": str(libs), "CRIU_RESTORE_THREADS": str(threads)}


def reap(pid: int) -> None:
    """Kill the restored process and wait until its PID is free again (this process is the subreaper)."""
    os.kill(pid, signal.SIGKILL)
    while True:
        try:
            if os.waitpid(pid, 0)[0] == pid:
                return
        except ChildProcessError:
            while Path(f"/proc/{pid}").exists():
                time.sleep(0.01)
            return


def dumped(criu: Path, gib: float, work: Path, thp: bool) -> tuple[Path, int]:
    """A target of `gib` GiB (advised MADV_HUGEPAGE with `thp`) dumped to tmpfs: (the images, the target's PID)."""
    pages = "thp" if thp else "4k"
    control, images = work / f"control-{pages}", Path("/dev/shm") / f"coldsnap-criu-bench-{os.getpid()}-{pages}"
    control.mkdir(parents=True)
    images.mkdir()
    mib = str(int(gib * 1024))
    size = ["--mib", "1", "--thp-mib", mib] if thp else ["--mib", mib]
    target = subprocess.Popen([sys.executable, str(Path(__file__).parent / "criu_target.py"), "--dir", str(control),
                               *size, "--repeat"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_file(control / "ready", 600)
    started = time.perf_counter()
    done = subprocess.run([str(criu), "dump", "-t", str(target.pid), "-D", str(images), "-o", "dump.log", "-v4"],
                          env=criu_env(criu, 1), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"criu dump exited {done.returncode}: {(images / 'dump.log').read_text()[-2000:]}")
    print(f"dumped {images_bytes(images) / 1e9:.2f} GB ({pages}) in {time.perf_counter() - started:.2f} s",
          flush=True)
    target.wait()
    return images, target.pid


def huge_bytes(pid: int) -> int:
    """The restored process's PMD-mapped anonymous huge pages, in bytes."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    return 0


def images_bytes(images: Path) -> int:
    return sum(p.stat().st_size for p in images.iterdir() if p.is_file())


def restore(criu: Path, images: Path, threads: int, pid: int) -> dict[str, Any]:
    pidfile = images / "restored.pid"
    pidfile.unlink(missing_ok=True)
    started = time.perf_counter()
    done = subprocess.run([str(criu), "restore", "-D", str(images), "-o", "restore.log", "-v4", "--restore-detached",
                           "--pidfile", str(pidfile)], env=criu_env(criu, threads), capture_output=True, text=True,
                          check=False)
    seconds = time.perf_counter() - started
    log = (images / "restore.log").read_text()
    if done.returncode:
        raise RuntimeError(f"criu restore exited {done.returncode}: {log[-2000:]}")
    restored = int(pidfile.read_text())
    huge = huge_bytes(restored)
    reap(restored)
    fill = re.search(r"page-fill: pages-\d+\.img: (\d+) bytes .* by (\d+) threads in ([\d.]+) s", log)
    return {"threads": threads, "seconds": seconds, "fill_threads": int(fill.group(2)) if fill else 1,
            "fill_seconds": float(fill.group(3)) if fill else None, "huge_bytes": huge}


def ceiling(images: Path, threads: int) -> list[dict[str, Any]]:
    """page_fill.py's fill of fresh memory from the largest pages image, N threads, 4 KiB pages and THP."""
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    size = pages.stat().st_size // mmap.PAGESIZE * mmap.PAGESIZE
    out = []
    fd = os.open(pages, os.O_RDONLY)
    try:
        for name, advice in (("4 KiB", mmap.MADV_NOHUGEPAGE), ("THP", mmap.MADV_HUGEPAGE)):
            seconds = min(fill(fd, size, threads, advice, False) for _ in range(2))
            out.append({"pages": name, "threads": threads, "seconds": seconds, "gbps": size / seconds / 1e9})
    finally:
        os.close(fd)
    return out


def measure(criu: Path, images: Path, pid: int, args: argparse.Namespace, kind: str) -> list[dict[str, Any]]:
    """Rows for one dump (`kind`: its target's pages, 4 KiB or THP): tmpfs and the page cache, and the cold
    disk for the 4 KiB dump only (its rate does not depend on the pages)."""
    rows: list[dict[str, Any]] = []
    size = images_bytes(images)

    def run(where: str, at: Path, before: Any = None) -> None:
        def once(threads: int) -> dict[str, Any]:
            if before:
                before()
            return restore(criu, at, threads, pid)

        for threads in (1, args.threads):
            best = min((once(threads) for _ in range(args.runs)), key=lambda r: r["seconds"])
            row = {"images": where, "pages": kind, **best, "bytes": size}
            row["gbps"] = size / row["seconds"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)

    run("tmpfs", images)
    disk = Path(args.disk_dir) / f"coldsnap-criu-bench-{os.getpid()}"
    shutil.copytree(images, disk)
    try:
        for p in disk.iterdir():  # every byte in the page cache
            p.read_bytes() if p.stat().st_size < (1 << 30) else disk_read_rate(p, 1 << 62)
        run("page cache", disk)
        if kind != "4 KiB":
            return rows
        if not drop_caches():
            rows.append({"images": "cold disk", "skipped": "dropping the caches needs root"})
            return rows
        pages = max(disk.glob("pages-*.img"), key=lambda p: p.stat().st_size)
        rate = disk_read_rate(pages)
        rows.append({"images": "disk read rate", "gbps": rate / 1e9})
        if size / rate > COLD_BUDGET_S:
            rows.append({"images": "cold disk", "skipped": f"{size / rate:.0f} s a row at {rate / 1e9:.2f} GB/s"})
        else:
            run("cold disk", disk, drop_caches)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return rows


def report(rows: list[dict[str, Any]], fills: list[dict[str, Any]], size: int) -> str:
    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append([r["images"], "-", "-", "-", "-", "-", "-", f"skipped: {r['skipped']}"])
        elif "threads" not in r:
            lines.append([r["images"], "-", "-", "-", "-", f"{r['gbps']:.2f}", "-", "sequential read, caches dropped"])
        else:
            fill_s = f"{r['fill_seconds']:.2f}" if r["fill_seconds"] is not None else "-"
            lines.append([r["images"], r["pages"], r["threads"], f"{r['seconds']:.2f}", fill_s, f"{r['gbps']:.2f}",
                          f"{r['huge_bytes'] / r['bytes']:.0%}",
                          "stock (restorer preadv)" if r["threads"] == 1 else f"{r['fill_threads']} fill threads"])
    lines += [[f"ceiling: page_fill {f['pages']}", f["pages"], f["threads"], f"{f['seconds']:.2f}", "-",
               f"{f['gbps']:.2f}", "-", "preadv into fresh memory, outside CRIU"] for f in fills]
    return (f"{size / 1e9:.2f} GB of CRIU images per dump; pages: the target's (THP: advised MADV_HUGEPAGE); "
            "huge: restored memory in PMD-mapped huge pages\n"
            + table(["images", "pages", "threads", "restore s", "fill s", "GB/s", "huge", "note"], lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--criu", required=True, help="scripts/criu/build's usr/sbin/criu (libraries beside it)")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--runs", type=int, default=1, help="restores per row; the fastest is reported")
    parser.add_argument("--disk-dir", default="/var/tmp")
    parser.add_argument("--work", default="/tmp")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: restored processes are reaped here
    criu = Path(args.criu)
    work = Path(args.work) / f"coldsnap-criu-bench-{os.getpid()}"
    rows: list[dict[str, Any]] = []
    fills: list[dict[str, Any]] = []
    size = 0
    try:
        for thp in (False, True):  # one dump at a time: two would need twice the memory
            images, pid = dumped(criu, args.gib, work, thp)
            try:
                if not thp:
                    fills = ceiling(images, args.threads)
                    size = images_bytes(images)
                rows += measure(criu, images, pid, args, "THP" if thp else "4 KiB")
            finally:
                shutil.rmtree(images, ignore_errors=True)
        text = report(rows, fills, size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    if args.out:
        Path(args.out, "criu_restore.json").write_text(json.dumps({"rows": rows, "ceiling": fills}, indent=1))
        Path(args.out, "criu_restore.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

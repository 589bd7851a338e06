"""Two captures of the same model and what the second shares with the first (issue 34's goal: <= 5 % new bytes).

The parts bench/capsule_transfer.py (`--source criu`, this CPU) and bench/e2e_store.py (`--second-capture`, the GPU
machine) build on: a real capture of an engine-shaped CPU process by the capture worker and the built CRIU
(:func:`criu_capture`), and, per kind of file, the second capture's bytes against the first's chunks
(:func:`share_rows`): as 64 MiB chunks from each file's start (the store's rule before page images were cut by
content, computed here by hashing the files) and as the node's store holds them (its data documents).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import table, wait_file
from coldsnap_runtime.chunking import Cuts, content_cuts
from coldsnap_runtime.store import CHUNK_BYTES, CaptureStore

PAGE = 4096
WORST = 6  # files named per kind, those with the most new bytes
STORED_MIN = 1 << 20  # smaller files stay in the image's layers (coldsnap_runtime/backend/_capture_build.py)
KINDS = ((re.compile(r"(.*/)?pages-\d+\.img"), "CRIU page images (pages-*.img)"),
         (re.compile(r"(.*/)?device-\d+/.*"), "device dumps (device-<pid>/)"))


def kind_of(path: str) -> str:
    return next((name for pattern, name in KINDS if pattern.fullmatch(path)), "other stored files")


def criu_capture(images: Path, criu: str, target: list[str], work: Path) -> float:
    """Start bench/engine_shape_target.py with `target` arguments, capture it with the worker (`--boundary n580`, the
    CRIU at `criu`) into `images`; the capture's seconds. The capture ends the process."""
    control = work / f"control-{images.parent.name}"
    control.mkdir(parents=True)
    process = subprocess.Popen([sys.executable, str(ROOT / "bench/engine_shape_target.py"), "--dir", str(control),
                                *target], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        pid = int(wait_file(control / "ready", 300))
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "coldsnap_probe", "capture", "--pid", str(pid), "--images",
                               str(images), "--boundary", "n580", "--criu", criu], cwd=ROOT, capture_output=True,
                              text=True, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode != 0:
            raise RuntimeError(f"the capture worker failed ({done.returncode}): {done.stderr[-2000:]}")
        seconds = time.perf_counter() - started
        process.wait(60)
        return seconds
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _chunk_digest(path: Path, offset: int) -> tuple[str | None, int]:
    with open(path, "rb") as source:
        source.seek(offset)
        data = source.read(CHUNK_BYTES)
    return (None if data.count(0) == len(data) else hashlib.sha256(data).hexdigest()), len(data)


def fixed_chunks(images: Path, threads: int = 8) -> dict[str, list[tuple[str | None, int]]]:
    """Each stored file's 64 MiB chunks from its start (digest, or None for zeros; length), by path in `images`."""
    files = sorted(p for p in images.rglob("*") if p.is_file() and p.stat().st_size >= STORED_MIN)
    jobs = [(p, offset) for p in files for offset in range(0, p.stat().st_size, CHUNK_BYTES)]
    with ThreadPoolExecutor(threads) as pool:  # SHA-256 releases the GIL
        digests = list(pool.map(lambda job: _chunk_digest(*job), jobs))
    out: dict[str, list[tuple[str | None, int]]] = {}
    for (path, _), digest in zip(jobs, digests, strict=True):
        out.setdefault(str(path.relative_to(images)), []).append(digest)
    return out


def page_digests(path: Path) -> list[bytes]:
    """Each 4 KiB page's digest (BLAKE2b, 16 bytes): what a page image shares at best, whatever the chunking."""
    out = []
    with open(path, "rb") as source:
        while block := source.read(8 << 20):
            out += [hashlib.blake2b(block[at:at + PAGE], digest_size=16).digest() for at in range(0, len(block), PAGE)]
    return out


def _page_images(images: Path) -> list[Path]:
    return [p for p in sorted(images.rglob("*")) if p.is_file() and kind_of(p.name) == KINDS[0][1]]


Fingerprint = tuple[dict[str, list[tuple[str | None, int]]], set[bytes]]


def fingerprint(images: Path, threads: int = 8) -> Fingerprint:
    """What the second capture is compared with: the first's 64 MiB chunks, and its page images' pages."""
    return fixed_chunks(images, threads), {d for p in _page_images(images) for d in page_digests(p)}


def _new(chunks: Iterable[tuple[str | None, int]], known: set[str | None]) -> int:
    return sum(length for digest, length in chunks if digest is not None and digest not in known)


def share_rows(first: Fingerprint, second: Path, store: Path, captures: tuple[str, str]) -> list[dict[str, Any]]:
    """Per kind of file of the second capture (`second`: its images; `captures`: both ids in `store`): files, bytes,
    zeros, new bytes as 64 MiB chunks from each file's start, new bytes as the store holds them, and for the page
    images the bytes of pages the first's lack (the floor); then the files the image's layers keep (under 1 MiB)."""
    opened = CaptureStore(store)
    first_fixed, first_pages = first
    known_fixed = {d for chunks in first_fixed.values() for d, _ in chunks}
    first_data, second_data = (opened.data(c) for c in captures)
    known_stored = {c for f in first_data.files for c in f.chunks}
    second_fixed = fixed_chunks(second)
    rows: dict[str, dict[str, Any]] = {}
    for stored in second_data.files:
        name = stored.path.split("/", 1)[1] if "/" in stored.path else stored.path  # the path inside `images`
        row = rows.setdefault(kind_of(name), {"kind": kind_of(name), "files": 0, "bytes": 0, "zero": 0,
                                              "new_fixed_64m": 0, "new_stored": 0, "chunks": 0})
        spans = stored.spans()
        row["files"] += 1
        row["bytes"] += stored.size
        row["chunks"] += len(spans)
        row["zero"] += sum(length for chunk, _, length in spans if chunk is None)
        new = _new(((chunk, length) for chunk, _, length in spans), known_stored)
        row["new_stored"] += new
        row["new_fixed_64m"] += _new(second_fixed.get(name, []), known_fixed)
        # The files with the most new bytes, to say where sharing stops (a dump region's tail the engine never wrote?)
        row["worst"] = sorted([*row.get("worst", []), [name, stored.size, new]], key=lambda w: -w[2])[:WORST]
        row.setdefault("new_by_file", {})[name] = new
    zero = hashlib.blake2b(bytes(PAGE), digest_size=16).digest()
    if (pages := rows.get(KINDS[0][1])) is not None:
        pages["new_pages"] = PAGE * sum(1 for p in _page_images(second) for d in page_digests(p)
                                        if d not in first_pages and d != zero)
    small = [p for p in second.rglob("*") if p.is_file() and p.stat().st_size < STORED_MIN]
    size = sum(p.stat().st_size for p in small)
    rows["small"] = {"kind": "small files (the image's layer)", "files": len(small), "bytes": size, "zero": 0,
                     "new_fixed_64m": size, "new_stored": size, "chunks": 0}
    return list(rows.values())


def region_rows(rows: list[dict[str, Any]], second: Path) -> list[dict[str, Any]]:
    """The second capture's device allocations (each process's record in `device-memory.json`: address, size, its
    segment files), each with its new bytes as the store holds them, those with the most first."""
    new_by_file: dict[str, int] = next((r.get("new_by_file", {}) for r in rows if r["kind"] == KINDS[1][1]), {})
    regions = []
    for record in second.rglob("device-memory.json"):
        base = record.parent.relative_to(second)
        for process in json.loads(record.read_text()).get("processes", []):
            for region in process["manifest"]["regions"]:
                files = [str(base / process["directory"] / s["file"]) for s in region["segments"]]
                regions.append({"pid": process["pid"], "address": f"{region['address']:#x}", "size": region["size"],
                                "new": sum(new_by_file.get(f.removeprefix("./"), 0) for f in files)})
    return sorted(regions, key=lambda r: -r["new"])


def region_table(regions: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The allocations with new bytes (the first WORST * 2), then how many there are and how many have none."""
    new = [r for r in regions if r["new"]]
    cells = [[str(r["pid"]), r["address"], f"{r['size'] / 2**20:.1f}", f"{r['new'] / 2**20:.1f}"]
             for r in new[:2 * WORST]]
    cells.append([f"{len(new)} of {len(regions)} allocations hold new bytes", "",
                  f"{sum(r['size'] for r in new) / 2**20:.1f}", f"{sum(r['new'] for r in new) / 2**20:.1f}"])
    return ["process", "device allocation", "MiB", "new MiB"], cells


def worst_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The files of each kind with the most new bytes, as a table's head and cells."""
    cells = [[r["kind"], name, f"{size / 2**20:.1f}", f"{new / 2**20:.1f} ({100 * new / max(size, 1):.0f} %)"]
             for r in rows for name, size, new in r.get("worst", []) if new]
    return ["kind", "second capture's file with new bytes", "MiB", "new MiB (of the file)"], cells


def share_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The rows as a table's head and cells (MiB, and the share of the capture's bytes), with a total."""
    total = {key: sum(r[key] for r in rows) for key in ("files", "bytes", "zero", "new_fixed_64m", "new_stored",
                                                         "chunks")}
    size = total["bytes"] or 1
    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:.1f} ({100 * n / size:.1f} %)"

    cells = [[r["kind"], str(r["files"]), f"{r['bytes'] / 2**20:.1f}", f"{r['zero'] / 2**20:.1f}", str(r["chunks"]),
              mib(r["new_fixed_64m"]), mib(r["new_stored"]), mib(r.get("new_pages"))]
             for r in [*rows, {"kind": "the second capture", **total}]]
    head = ["second capture, by file", "files", "MiB", "zeros MiB", "chunks stored",
            "new MiB: 64 MiB from each file's start", "new MiB: as the store cut them", "new MiB: pages (the floor)"]
    return head, cells


CANDIDATES = (("\\xa7\\x3c[\\x00-\\x1f]", 3, 128, 4096), ("\\xa7\\x3c", 2, 128, 512), ("\\xa7\\x3c", 2, 128, 256),
              ("\\xa7[\\x3c\\x3d]", 2, 128, 256), ("\\xa7\\x3c", 2, 32, 256))


def restored_capture(first: Path, second: Path, criu: str, work: Path, port: int) -> None:
    """Restore the capture in `first` with the worker, serve it one request on `port`, capture it into `second`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    copy = work / "restore-images"
    subprocess.run(["cp", "-a", str(first), str(copy)], check=True)
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", "restore", "--images", str(copy), "--work-dir",
                           str(work / "restore-work"), "--criu", criu], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the restore failed ({done.returncode}): {done.stderr[-2000:]}")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
        connection.recv(1)  # the request served
    pid = json.loads((first / "capture.json").read_text())["root_pid"]
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", "capture", "--pid", str(pid), "--images",
                           str(second), "--boundary", "n580", "--criu", criu], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the second capture failed ({done.returncode}): {done.stderr[-2000:]}")


def _cut_digests(data: bytes, cuts: Cuts) -> list[tuple[str | None, int]]:
    out, at = [], 0
    for length, zero in content_cuts(data, final=True, cuts=cuts):
        out.append((None if zero else hashlib.sha256(data[at:at + length]).hexdigest(), length))
        at += length
    return out


def candidate_rows(first: Path, second: Path) -> list[list[str]]:
    """For each of CANDIDATES: the second's page images cut so, their chunks, mean and new MiB against the first's."""
    firsts, seconds = [p.read_bytes() for p in _page_images(first)], [p.read_bytes() for p in _page_images(second)]
    rows = []
    for anchor, width, least, most in CANDIDATES:
        cuts = Cuts(re.compile(anchor.encode("latin-1").decode("unicode_escape").encode("latin-1")), width,
                    least << 10, most << 10)
        known = {d for data in firsts for d, _ in _cut_digests(data, cuts)}
        chunks = [c for data in seconds for c in _cut_digests(data, cuts)]
        stored = [n for d, n in chunks if d is not None]
        rows.append([f"{anchor}, {least} / {most}", str(len(chunks)), f"{sum(stored) / len(stored) / 1024:.0f}",
                     f"{_new(chunks, known) / 2**20:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="the second capture of a restored engine-shaped process: its page "
                                     "images' new bytes by cut candidate (coldsnap_runtime/chunking.py)")
    parser.add_argument("--criu", required=True)
    parser.add_argument("--target", default="--threads 40 --libs 100 --anon-mib 0 --heap-mib 200 --heap-seeded "
                        "--weights-mib 1024 --state-mib 32")
    parser.add_argument("--touch", type=int, default=135, help="places a request writes (4 pages each)")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp"))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="capture-pair-", dir=args.work))
    try:
        first, second = work / "one" / "images", work / "two" / "images"
        criu_capture(first, args.criu, [*shlex.split(args.target), "--touch", str(args.touch)], work)
        port = json.loads((work / "control-one" / "shape.json").read_text())["port"]
        restored_capture(first, second, args.criu, work, port)
        floor = {d for p in _page_images(first) for d in page_digests(p)}
        zero = hashlib.blake2b(bytes(PAGE), digest_size=16).digest()
        new_pages = PAGE * sum(1 for p in _page_images(second) for d in page_digests(p) if d not in floor and d != zero)
        print(f"restored, one request writing 4 pages at {args.touch} places, captured again; the floor (pages the "
              f"first lacks): {new_pages / 2**20:.1f} MiB")
        print(table(["anchor, MIN / MAX KiB", "chunks", "mean KiB", "new MiB"], candidate_rows(first, second)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

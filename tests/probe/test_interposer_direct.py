"""The release's direct path without a GPU (dump_direct.c, issue 35 item 3): when it is chosen (tmpfs with room
and the driver's registration, else the staged path, saying why), how a dump is cut into windows, and a window's
life on a real tmpfs: sized with fallocate (a full filesystem fails before the copy), mapped shared, written
where the device would write (a memcpy stands in for the DMA: the CPU part is what is tested), digested from the
mapped pages and unmapped with its chunks of zeros punched out. The files and digests must be byte for byte what
the staged path writes and hydration/_digests.py computes. The device's copy into registered pages runs on the
H200: tests/probe/test_interposer_gpu.py (direct and staged side by side)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe.hydration._digests import crc_digest, region_digest
from coldsnap_probe.hydration._interposer import SOURCES
from tests.probe.interposer_harness import UNITY

MIB = 1 << 20
CHUNK = 64 * MIB

HARNESS = UNITY + r"""
#include <sys/stat.h>

static struct job job = {.lock = PTHREAD_MUTEX_INITIALIZER};

/* One segment a size from argv[3...]; plan_items' runs of argv[2] chunks, printed as JSON. */
static int windows(int argc, char **argv)
{
    char take[64];
    cscu_segment_count = (size_t)argc - 3;
    cscu_segments = calloc(cscu_segment_count, sizeof(*cscu_segments));
    for (size_t i = 0; i < cscu_segment_count; i++)
        cscu_segments[i].size = strtoull(argv[3 + i], NULL, 10);
    memset(take, 1, sizeof(take));
    if (plan_items(&job, 0, take, strtoull(argv[2], NULL, 10)) != 0)
        return 1;
    printf("{\"items\":[");
    for (size_t i = 0; i < job.count; i++)
        printf("%s[%zu,%zu,%zu]", i ? "," : "", job.items[i].segment, job.items[i].offset, job.items[i].size);
    printf("],\"spans\":[");
    for (size_t i = 0; i < job.span_count; i++)
        printf("%s[%zu,%zu]", i ? "," : "", job.spans[i].first, job.spans[i].n);
    printf("]}\n");
    return 0;
}

/* argv: dir bytes: whether a release of `bytes` into `dir` goes direct, and why not. */
static int plan(char **argv)
{
    char why[256] = "";
    int dirfd = open(argv[2], O_RDONLY | O_DIRECTORY);
    int direct = cscu_direct_plan(dirfd, strtoull(argv[3], NULL, 10), why, sizeof(why));
    printf("{\"direct\":%d,\"why\":\"%s\"}\n", direct, why);
    return 0;
}

/* argv: source dump kind window: `source` copied into a new `dump` window by window as a direct release does
 * (map, the "DMA", scan, unmap); its items' zero marks and the segment's digest printed. */
static int copy(char **argv)
{
    int src = open(argv[2], O_RDONLY), fd = open(argv[3], O_RDWR | O_CREAT | O_EXCL, 0600), space = 0;
    struct stat st;
    char take[1] = {1}, why[200] = "";
    struct spent t = {0};
    fstat(src, &st);
    const unsigned char *from = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, src, 0);
    cscu_segment_count = 1;
    cscu_segments = calloc(1, sizeof(*cscu_segments));
    cscu_segments[0].size = (size_t)st.st_size;
    cscu_segments[0].kind = strcmp(argv[4], "crc") == 0 ? CSCU_KIND_CRC32 : CSCU_KIND_SHA256;
    if (from == MAP_FAILED || fd < 0 || ftruncate(fd, st.st_size) != 0
        || plan_items(&job, 0, take, strtoull(argv[5], NULL, 10)) != 0)
        return 1;
    for (size_t w = 0; w < job.span_count; w++) {
        struct item *it = &job.items[job.spans[w].first];
        size_t n = job.spans[w].n, len = it[n - 1].offset + it[n - 1].size - it[0].offset;
        unsigned char *map = cscu_direct_map(fd, it, n, &space, why, sizeof(why));
        if (!map) {
            printf("{\"error\":\"%s\",\"space\":%d}\n", why, space);
            return 0;
        }
        memcpy(map, from + it[0].offset, len);  /* where the device's copy lands */
        cscu_direct_scan(it, n, map, cscu_segments[0].kind, &t);
        if (cscu_direct_unmap(fd, it, n, map) != 0)
            return 1;
    }
    printf("{\"zero\":[");
    for (size_t i = 0; i < job.count; i++)
        printf("%s%d", i ? "," : "", job.items[i].zero);
    cscu_segment_digest(&job, 0, cscu_segments[0].digest);
    printf("],\"digest\":\"%s\",\"digest_s\":%.6f}\n", cscu_segments[0].digest, t.digest);
    return 0;
}

/* argv: file flags bytes: one window of `bytes` from offset 0 of `file` opened with `flags` (w: write-only). */
static int map_one(char **argv)
{
    int fd = open(argv[2], strcmp(argv[3], "w") == 0 ? O_WRONLY : O_RDWR), space = 0;
    char why[200] = "";
    struct item it = {0, 0, strtoull(argv[4], NULL, 10), {0}, 0, 0};
    unsigned char *map = cscu_direct_map(fd, &it, 1, &space, why, sizeof(why));
    printf("{\"mapped\":%d,\"space\":%d,\"why\":\"%s\"}\n", map != NULL, space, why);
    if (map)
        cscu_direct_unmap(fd, &it, 1, map);
    return 0;
}

int main(int argc, char **argv)
{
    if (strcmp(argv[1], "windows") == 0)
        return windows(argc, argv);
    if (strcmp(argv[1], "plan") == 0)
        return plan(argv);
    if (strcmp(argv[1], "copy") == 0)
        return copy(argv);
    return map_one(argv);
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("direct")
    (out / "harness.c").write_text(HARNESS)
    subprocess.run(["gcc", "-O1", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I", str(SOURCES), "-o",
                    str(out / "harness"), str(out / "harness.c"), "-ldl", "-lpthread"], check=True)
    return out / "harness"


def run(harness: Path, *args: Any, env: dict[str, str] | None = None) -> Any:
    done = subprocess.run([str(harness), *map(str, args)], capture_output=True, text=True, check=True,
                          env={**os.environ, **(env or {})})
    return json.loads(done.stdout)


@contextlib.contextmanager
def mounted(where: Path, options: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"{options},mode=0700", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A small tmpfs of its own (400 MiB: a dump of three chunks twice, and a known limit to run out of), 4 KiB
    pages."""
    with mounted(tmp_path_factory.mktemp("tmpfs"), "size=400m,huge=never") as mount:
        yield mount


def fs_type(path: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%t", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


class TestPlan:
    def test_on_tmpfs_with_room_only_the_driver_decides(self, harness: Path, tmpfs: Path) -> None:
        """No libcuda here: the last condition, the driver's registration, is what refuses (on a GPU host the
        same call answers direct)."""
        answer = run(harness, "plan", tmpfs, 256 * MIB)
        has_driver = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout.count("libcuda.so.1")
        assert answer == ({"direct": 1, "why": ""} if has_driver else
                          {"direct": 0, "why": "the driver has no cuMemHostRegister_v2 or cuMemHostUnregister"})

    def test_a_disk_filesystem_goes_staged_naming_its_type(self, harness: Path) -> None:
        disk = Path(__file__).resolve().parent
        if fs_type(disk) == "1021994":
            pytest.skip("the checkout is on tmpfs")
        answer = run(harness, "plan", disk, MIB)
        assert answer["direct"] == 0
        assert answer["why"] == (f"the dump directory is on a filesystem of type 0x{fs_type(disk)}, not tmpfs (a "
                                 "disk file's pages are not pinned for the device to write)")

    def test_less_room_than_the_regions_goes_staged_naming_both(self, harness: Path, tmpfs: Path) -> None:
        answer = run(harness, "plan", tmpfs, 1 << 40)
        assert answer["direct"] == 0
        assert answer["why"].startswith("the dump directory's tmpfs has ") and f"the regions {1 << 40} " in answer[
            "why"]

    def test_huge_takes_only_a_tmpfs_with_huge_pages(self, harness: Path, tmpfs: Path, tmp_path: Path) -> None:
        """COLDSNAP_CUDA_INTERPOSER_DIRECT=huge: the mount's `huge=` read from /proc/self/mountinfo by the
        directory's device (a 4 KiB-page tmpfs is staged; one mounted huge=always goes on to the driver)."""
        huge = {"COLDSNAP_CUDA_INTERPOSER_DIRECT": "huge"}
        forced = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
        if "[force]" in forced or "[deny]" in forced:
            pytest.skip(f"this kernel sets every tmpfs's pages: {forced.strip()}")
        assert run(harness, "plan", tmpfs, MIB, env=huge) == {"direct": 0, "why": (
            "the dump directory's tmpfs gives 4 KiB pages (huge=never) and COLDSNAP_CUDA_INTERPOSER_DIRECT=huge "
            "takes only huge pages")}
        with mounted(tmp_path, "size=16m,huge=always") as always:
            assert not run(harness, "plan", always, MIB, env=huge)["why"].startswith("the dump directory")
            (always / "sub").mkdir()  # a directory below the mount point is on the same device
            assert not run(harness, "plan", always / "sub", MIB, env=huge)["why"].startswith("the dump directory")
        assert run(harness, "plan", tmpfs, MIB)["why"] == run(harness, "plan", tmpfs, MIB, env={
            "COLDSNAP_CUDA_INTERPOSER_DIRECT": "1"})["why"]  # the default takes any tmpfs

    def test_switched_off_it_is_staged_whatever_the_filesystem(self, harness: Path, tmpfs: Path) -> None:
        answer = run(harness, "plan", tmpfs, MIB, env={"COLDSNAP_CUDA_INTERPOSER_DIRECT": "0"})
        assert answer == {"direct": 0, "why": "COLDSNAP_CUDA_INTERPOSER_DIRECT=0"}


class TestWindows:
    @pytest.mark.parametrize("per", [1, 3, 4, 16])
    def test_every_chunk_once_in_runs_of_one_file_interleaved_across_files(self, harness: Path, per: int) -> None:
        sizes = (1 << 30, 1 << 30, 200 * MIB)  # 16, 16 and 4 chunks (the last 8 MiB)
        answer = run(harness, "windows", per, *sizes)
        items = [tuple(i) for i in answer["items"]]
        expected = sorted((s, at, min(CHUNK, size - at)) for s, size in enumerate(sizes)
                          for at in range(0, size, CHUNK))
        assert sorted(items) == expected and len(items) == len(set(items))
        runs = [items[first:first + n] for first, n in answer["spans"]]
        assert sum(len(r) for r in runs) == len(items) and all(1 <= len(r) <= per for r in runs)
        for r in runs:  # one file, consecutive chunks, starting on a multiple of the window
            assert len({s for s, _, _ in r}) == 1 and r[0][1] % (per * CHUNK) == 0
            assert [at for _, at, _ in r] == list(range(r[0][1], r[0][1] + len(r) * CHUNK, CHUNK))
        assert [r[0][0] for r in runs[:3]] == [0, 1, 2]  # the files take turns
        if per == 1:  # the staged path's order, as before: chunk by chunk, files in turn
            assert items[:4] == [(0, 0, CHUNK), (1, 0, CHUNK), (2, 0, CHUNK), (0, CHUNK, CHUNK)]


class TestWindowOnTmpfs:
    @pytest.mark.parametrize(("kind", "window"), [("crc", 2), ("sha", 1)])
    def test_the_file_and_digest_are_the_staged_paths_and_zeros_are_holes(self, harness: Path, tmpfs: Path,
                                                                          kind: str, window: int) -> None:
        """Three chunks, the middle one zeros, the last one short: the bytes land in the file as they are, the
        zero chunk is marked and punched out, the digest is hydration/_digests.py's (the hydration checks it)."""
        source = tmpfs / "source.bin"
        rng = random.Random(35)
        data = rng.randbytes(CHUNK) + bytes(CHUNK) + rng.randbytes(8 * MIB)
        source.write_bytes(data)
        dump = tmpfs / f"seg-{kind}.bin"
        try:
            answer = run(harness, "copy", source, dump, kind, window)
            assert answer["zero"] == [0, 1, 0]
            assert dump.read_bytes() == data
            assert dump.stat().st_blocks * 512 <= len(data) - CHUNK  # the zeros take no room
            assert answer["digest"] == (crc_digest if kind == "crc" else region_digest)(dump, 0, len(data))
        finally:
            source.unlink()
            dump.unlink(missing_ok=True)

    def test_no_room_fails_before_the_copy_and_says_so(self, harness: Path, tmpfs: Path) -> None:
        """fallocate, not a fault in the mapped pages (which would be a SIGBUS in the engine)."""
        target = tmpfs / "full.bin"
        target.write_bytes(b"")
        answer = run(harness, "map", target, "rw", 512 * MIB)
        assert answer["mapped"] == 0 and answer["space"] == 1
        assert answer["why"] == f"fallocate {512 * MIB} bytes at 0: No space left on device"
        assert target.stat().st_blocks == 0  # nothing was left allocated
        target.unlink()

    def test_a_window_that_cannot_be_mapped_is_left_to_the_staged_path(self, harness: Path, tmpfs: Path) -> None:
        target = tmpfs / "write-only.bin"
        target.write_bytes(b"")
        answer = run(harness, "map", target, "w", 2 * MIB)
        assert answer == {"mapped": 0, "space": 0, "why": f"mmap {2 * MIB} bytes at 0: Permission denied"}
        target.unlink()

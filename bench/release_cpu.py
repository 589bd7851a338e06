"""The CPU part of the interposer's release (issue 35 item 3), measured on any machine: what bounds a release once
the device-to-host copies are done, by digest kind, thread count, file count and buffer kind.

    python bench/release_cpu.py [--gib 4] [--dir /dev/shm] [--threads 1,2] [--files 1,4,16] [--out DIR]

A harness is compiled from the interposer's own sources (`digest.c`, `crc32.c`, `sha256.c` and `dump.c`'s block
loop, `digest_and_write`, the function a release runs on each staging buffer) and run here:
1. **digests**: one thread digests 1 GiB of random bytes in 4 MiB pieces (more than the caches hold) with each
   engine: SHA-256 from libcrypto and the built-in one, CRC-32 with VPCLMULQDQ, PCLMULQDQ and tables; and the
   zero check (`all_zero`) on random bytes (it stops at the first byte) and on zeros (it reads everything):
   thread-seconds per GiB.
2. **writes**: `--gib` GiB in 64 MiB chunks, interleaved over `--files` files in `--dir` as a release does, by
   `--threads` threads from plain (malloc) or page-locked (mlock) 4 MiB buffers: writes alone, then the release's
   loop (digest + zero check + write, block by block) with each digest; one run with a quarter of the chunks
   zeros (left as holes). Wall seconds, GB/s and thread-seconds per GiB by part.
3. **mounts** (`--mounts never,always,within_size`, root; then only this part runs): where the dump goes, a
   tmpfs mounted here per `huge=` option, side by side: the writes alone, the release's loop (CRC-32), and the
   files mapped with each 64 MiB chunk populated ahead (MADV_POPULATE_WRITE) and the "DMA" copied straight into
   them (what a copy from the device into registered file pages would leave to the CPU); with the GiB the files
   held in huge pages (ShmemHugePages while they exist).
Best of 2; a table on stdout, JSON in --out (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table

SOURCES = Path(__file__).resolve().parent.parent / "coldsnap_probe" / "hydration" / "interposer"

# The interposer's every source is included ahead of this (build()): dump.c's loop needs the library linked whole.
HARNESS = r"""
#include <sys/mman.h>

#define PIECE ((size_t)4 << 20)
#define SOURCE ((size_t)1 << 30)
static void no_libcrypto(void) {}
static unsigned char *source, *zeros;
static struct job job = {.lock = PTHREAD_MUTEX_INITIALIZER};
static int mode, kind, zero_every, files, locked;  /* mode 0: writes alone, 1: the release's loop, 2: the file
                                                     mapped and populated a chunk at a time, the "DMA" into it */
static unsigned char *maps[64];
static size_t chunks;

static void engine(const char *name)
{
    pthread_once(&crc_once, crc_setup);
    if (strcmp(name, "builtin") == 0)
        pthread_once(&ossl_once, no_libcrypto);
    if (strcmp(name, "pclmul") == 0 || strcmp(name, "tables") == 0)
        crc_have_wide = 0;
    if (strcmp(name, "tables") == 0)
        crc_have_pclmul = 0;
}

static void *writer(void *arg)
{
    struct spent t = {0, 0, 0, 0};
    unsigned char *buf = aligned_alloc(4096, PIECE);
    if (locked && mlock(buf, PIECE) != 0)
        return (void *)1;
    (void)arg;
    for (size_t i; (i = __atomic_fetch_add(&job.next, 1, __ATOMIC_ACQ_REL)) < chunks;) {
        struct item it = {(size_t)(i % (size_t)files), (i / (size_t)files) * CSCU_DIGEST_CHUNK, CSCU_DIGEST_CHUNK,
                          {0}, 1};
        struct cscu_chunk_digest h;
        cscu_chunk_init(&h, kind);
        for (size_t at = 0; at < CSCU_DIGEST_CHUNK; at += PIECE) {
            int zero = zero_every && i % (size_t)zero_every == 0;
            if (mode == 2) {  /* pages allocated ahead (the write's own allocation, apart), then the "DMA" */
                unsigned char *into = maps[it.segment] + it.offset + at;
                double t0 = cscu_now();
                if (at == 0 && madvise(into, CSCU_DIGEST_CHUNK, MADV_POPULATE_WRITE) != 0)
                    return (void *)1;
                t.io += cscu_now() - t0;
                memcpy(into, source + (i * CSCU_DIGEST_CHUNK + at) % SOURCE, PIECE);
                continue;
            }
            memcpy(buf, zero ? zeros : source + (i * CSCU_DIGEST_CHUNK + at) % SOURCE, PIECE);  /* the "DMA" */
            double t0 = cscu_now();
            if (mode == 1 && digest_and_write(&job, &it, buf, PIECE, at, &h, &t) != 0)
                return (void *)1;
            if (mode == 0 && cscu_full_io(0, job.fds[it.segment], buf, PIECE, (off_t)(it.offset + at)) != 0)
                return (void *)1;
            t.io += mode == 0 ? cscu_now() - t0 : 0;
        }
        cscu_chunk_final(&h, it.digest);
    }
    pthread_mutex_lock(&job.lock);
    job.digest_s += t.digest, job.io_s += t.io, job.zero_s += t.zero;
    pthread_mutex_unlock(&job.lock);
    return NULL;
}

static int digests(void)
{
    struct cscu_chunk_digest h;
    double t0 = cscu_now();
    cscu_chunk_init(&h, kind);
    for (size_t at = 0; at < SOURCE; at += PIECE)
        cscu_chunk_update(&h, source + at, PIECE);
    double t1 = cscu_now();
    size_t found = 0;
    for (size_t at = 0; at < SOURCE; at += PIECE)
        found += all_zero(source + at, PIECE);
    double t2 = cscu_now();
    for (size_t at = 0; at < SOURCE; at += PIECE)
        found += all_zero(zeros, PIECE);
    unsigned char out[32];
    cscu_chunk_final(&h, out);
    printf("{\"engine\":\"%s\",\"digest_s_per_gib\":%.4f,\"zero_random_s_per_gib\":%.5f,\"zero_zeros_s_per_gib\":%.4f,"
           "\"found\":%zu}\n", cscu_digest_engine(kind), t1 - t0, t2 - t1, cscu_now() - t2, found);
    return 0;
}

/* argv: digest KIND ENGINE | write KIND ENGINE DIR THREADS FILES GIB LOCKED MODE ZERO_EVERY */
int main(int argc, char **argv)
{
    char named[32];
    snprintf(named, sizeof(named), "%s:", argc > 2 ? argv[2] : "");
    if ((kind = cscu_digest_kind_of(named)) < 0 || argc < 4)
        return 2;
    engine(argv[3]);
    source = malloc(SOURCE), zeros = calloc(1, PIECE);
    for (size_t i = 0, x = 88172645463325252ull; i < SOURCE; i += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(source + i, &x, 8);
    }
    if (strcmp(argv[1], "digest") == 0)
        return digests();
    if (argc != 11)
        return 2;
    int threads = atoi(argv[5]);
    files = atoi(argv[6]), locked = atoi(argv[8]), mode = atoi(argv[9]), zero_every = atoi(argv[10]);
    chunks = (size_t)(atof(argv[7]) * 16);
    struct segment segments[64] = {{0}};
    int fds[64];
    for (int f = 0; f < files && f < 64; f++) {
        char path[4096];
        snprintf(segments[f].file, sizeof(segments[f].file), CSCU_SEGMENT_FILE, (size_t)f);
        snprintf(path, sizeof(path), "%s/%s", argv[4], segments[f].file);
        off_t size = (off_t)(chunks / (size_t)files + 1) * (off_t)CSCU_DIGEST_CHUNK;  /* made whole, as dump_all does */
        if ((fds[f] = open(path, O_RDWR | O_CREAT | O_EXCL, 0600)) < 0 || ftruncate(fds[f], size) != 0)
            return 3;
        if (mode == 2 && (maps[f] = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fds[f], 0))
                             == MAP_FAILED)
            return 4;
    }
    job.fds = fds, job.segments = segments;
    pthread_t ids[64];
    void *failed = NULL, *one;
    double t0 = cscu_now();
    for (int i = 0; i < threads; i++)
        pthread_create(&ids[i], NULL, writer, NULL);
    for (int i = 0; i < threads; i++)
        pthread_join(ids[i], &one), failed = failed ? failed : one;
    double wall = cscu_now() - t0;
    printf("{\"wall_s\":%.4f,\"digest_thread_s\":%.4f,\"zero_thread_s\":%.4f,\"write_thread_s\":%.4f,\"failed\":%d,"
           "\"engine\":\"%s\"}\n", wall, job.digest_s, job.zero_s, job.io_s, failed != NULL, cscu_digest_engine(kind));
    return failed != NULL;
}
"""

ENGINES = (("sha256-64m", "auto"), ("sha256-64m", "builtin"), ("crc32-64m", "auto"), ("crc32-64m", "pclmul"),
           ("crc32-64m", "tables"))


def build(folder: Path) -> Path:
    sources = "".join(f'#include "{c.name}"\n' for c in sorted(SOURCES.glob("*.c")))
    (folder / "harness.c").write_text(sources + HARNESS)  # not digest.c: it includes the interposer's digest.c
    subprocess.run(["gcc", "-O2", "-std=gnu11", "-I", str(SOURCES), "-o", str(folder / "harness"),
                    str(folder / "harness.c"), "-ldl", "-lpthread"], check=True, capture_output=True, text=True)
    return folder / "harness"


def run(harness: Path, *args: object) -> dict[str, Any]:
    done = subprocess.run([str(harness), *map(str, args)], capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"harness {args} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def write_run(harness: Path, root: Path, kind: str, gib: float, threads: int, files: int, locked: int, mode: int,
              zero_every: int) -> dict[str, Any]:
    """The better of two runs, each into a fresh directory removed after it (tmpfs holds what was written)."""
    best: dict[str, Any] = {}
    for _ in range(2):
        folder = Path(tempfile.mkdtemp(prefix="release-cpu-", dir=root))
        try:
            got = run(harness, "write", kind, "auto", folder, threads, files, gib, locked, mode, zero_every)
            got["written_gib"] = sum(p.stat().st_blocks * 512 for p in folder.iterdir()) / (1 << 30)
            got["huge_gib"] = shmem_huge_gib()
        finally:
            shutil.rmtree(folder)
        if not best or got["wall_s"] < best["wall_s"]:
            best = got
    return best


def shmem_huge_gib() -> float:
    """GiB of tmpfs and shared memory held in huge pages now (the files just written, on an idle machine)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


METHODS = (("writes", "crc32-64m", 0), ("loop", "crc32-64m", 1), ("mmap, populated", "crc32-64m", 2))


def mounts(harness: Path, options: list[str], gib: float, threads: list[int], files: int) -> list[dict[str, Any]]:
    """Each `huge=` option's tmpfs, mounted in a temporary directory for its runs and unmounted after them."""
    out = []
    for huge in options:
        with tempfile.TemporaryDirectory(prefix="release-cpu-mount-") as point:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(2 * gib + 2)}g,huge={huge}", "release-cpu",
                            point], check=True, capture_output=True, text=True)
            try:
                for name, kind, mode in METHODS:
                    for n in threads:
                        got = write_run(harness, Path(point), kind, gib, n, files, 0, mode, 0)
                        out.append({"mount": huge, "what": name, "threads": n, "files": files, "gib": gib, **got})
            finally:
                subprocess.run(["umount", point], check=True, capture_output=True, text=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--files", default="1,4,16")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--mounts", default="", help="tmpfs huge= options to compare (root): only that part runs")
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    file_counts = [int(f) for f in args.files.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        harness = build(Path(scratch))
        if args.mounts:
            return mounts_main(args, harness, threads, max(file_counts))
        digests = [{"kind": kind, **run(harness, "digest", kind, engine)} for kind, engine in ENGINES]
        print(table(["digest", "engine", "s per GiB (1 thread)", "GB/s", "zero check s/GiB: random / zeros"],
                    [[d["kind"], d["engine"], f"{d['digest_s_per_gib']:.3f}",
                      f"{(1 << 30) / d['digest_s_per_gib'] / 1e9:.1f}",
                      f"{d['zero_random_s_per_gib']:.5f} / {d['zero_zeros_s_per_gib']:.3f}"] for d in digests]))
        writes = []
        plan = [("writes", "crc32-64m", 0, 0, 0), ("writes", "crc32-64m", 1, 0, 0), ("loop", "crc32-64m", 0, 1, 0),
                ("loop", "sha256-64m", 0, 1, 0), ("loop, 1/4 zeros", "crc32-64m", 0, 1, 4)]
        for name, kind, locked, mode, zero_every in plan:
            for n in threads:
                for files in file_counts if name == "writes" and not locked else [max(file_counts)]:
                    got = write_run(harness, Path(args.dir), kind, args.gib, n, files, locked, mode, zero_every)
                    writes.append({"what": name, "kind": kind if mode else "", "locked": bool(locked), "threads": n,
                                   "files": files, "gib": args.gib, **got})
        rows = [[w["what"], w["kind"] or "-", "mlock" if w["locked"] else "malloc", w["threads"], w["files"],
                 f"{w['wall_s']:.2f}", f"{args.gib * (1 << 30) / w['wall_s'] / 1e9:.2f}",
                 f"{w['write_thread_s'] / args.gib:.3f}", f"{w['digest_thread_s'] / args.gib:.3f}",
                 f"{w['zero_thread_s'] / args.gib:.4f}", f"{w['written_gib']:.2f}"] for w in writes]
        print(table(["what", "digest", "buffer", "threads", "files", "wall s", "GB/s", "write s/GiB",
                     "digest s/GiB", "zero s/GiB", "GiB on tmpfs"], rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d")
    path = out / f"release-cpu-{os.uname().nodename[:24]}-{stamp}.json"
    path.write_text(json.dumps({"cpus": os.cpu_count(), "dir": args.dir, "digests": digests, "writes": writes},
                               indent=2) + "\n")
    print(f"JSON: {path}")
    return 0


def mounts_main(args: argparse.Namespace, harness: Path, threads: list[int], files: int) -> int:
    runs = mounts(harness, args.mounts.split(","), args.gib, threads, files)
    print(table(["tmpfs huge=", "what", "threads", "files", "wall s", "GB/s", "write or populate s/GiB",
                 "digest s/GiB", "GiB in huge pages"],
                [[r["mount"], r["what"], r["threads"], r["files"], f"{r['wall_s']:.2f}",
                  f"{args.gib * (1 << 30) / r['wall_s'] / 1e9:.2f}", f"{r['write_thread_s'] / args.gib:.3f}",
                  f"{r['digest_thread_s'] / args.gib:.3f}", f"{r['huge_gib']:.2f}"] for r in runs]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"release-cpu-mounts-{os.uname().nodename[:24]}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps({"cpus": os.cpu_count(), "mounts": runs}, indent=2) + "\n")
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

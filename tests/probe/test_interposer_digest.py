"""Issue 39 item 2: one `sha256-64m` digest. Its format is defined once (constants.h and hydration/_weights.py,
checked against each other by test_interposer_constants.py); both languages must keep computing it (the
interposer digests inside the engine's process, without Python), so the C (sha256.c's both engines and dump.c's
combination, the functions a release and a hydration call) and Python's `region_digest` are run on the same real
files here and must agree, byte for byte, at the sizes where a chunking mistake would show.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from coldsnap_probe.hydration._interposer import SOURCES
from coldsnap_probe.hydration._weights import DIGEST_CHUNK, region_digest

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

HARNESS = r"""
#include "driver.c"
#include "interpose.c"
#include "regions.c"
#include "control.c"
#include "connection.c"
#include "operations.c"
#include "request.c"
#include "sha256.c"
#include "dump.c"
#include "hydrate.c"
#include "engine_vmm.c"
#include "vmm_backing.c"
#include "stream_ordered.c"

static void no_libcrypto(void) {}

/* argv[1]: a file; argv[2]: "builtin" (our SHA-256) or "auto" (libcrypto when it loads). The file is one dump
 * segment: each chunk digested in staging-sized pieces as the copy threads do, then cscu_segment_digest. */
int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    if (strcmp(argv[2], "builtin") == 0)
        pthread_once(&ossl_once, no_libcrypto);
    int fd = open(argv[1], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0)
        return 1;
    struct segment segment = {.size = (size_t)st.st_size};
    cscu_segments = &segment;
    cscu_segment_count = 1;
    size_t chunks = (segment.size + CSCU_DIGEST_CHUNK - 1) / CSCU_DIGEST_CHUNK;
    struct job job = {.items = calloc(chunks + 1, sizeof(struct item)), .count = chunks};
    char *buffer = malloc((size_t)4 << 20);
    for (size_t c = 0; c < chunks; c++) {
        cscu_sha256 h;
        struct item *it = &job.items[chunks - 1 - c];  /* out of order, as the threads finish them */
        it->offset = c * CSCU_DIGEST_CHUNK;
        it->size = segment.size - it->offset < CSCU_DIGEST_CHUNK ? segment.size - it->offset : CSCU_DIGEST_CHUNK;
        cscu_sha256_init(&h);
        for (size_t at = 0; at < it->size; at += (size_t)4 << 20) {
            size_t n = it->size - at < ((size_t)4 << 20) ? it->size - at : (size_t)4 << 20;
            if (cscu_full_io(1, fd, buffer, n, (off_t)(it->offset + at)) != 0)
                return 1;
            cscu_sha256_update(&h, buffer, n);
        }
        cscu_sha256_final(&h, it->digest);
    }
    char text[CSCU_DIGEST_TEXT];
    cscu_segment_digest(&job, 0, text);
    printf("%s %s\n", cscu_sha256_engine(), text);
    return 0;
}
"""

SIZES = (0, 1, 4095, DIGEST_CHUNK - 1, DIGEST_CHUNK, DIGEST_CHUNK + 1, 2 * DIGEST_CHUNK + 12345)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("digest")
    (folder / "digest.c").write_text(HARNESS)
    subprocess.run(["gcc", "-O2", "-std=gnu11", "-I", str(SOURCES), "-o", str(folder / "digest"),
                    str(folder / "digest.c"), "-ldl", "-lpthread"], check=True, capture_output=True, text=True)
    return folder / "digest"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("bytes")
    data = os.urandom(SIZES[-1])
    made = {}
    for size in SIZES:
        made[size] = folder / f"{size}.bin"
        made[size].write_bytes(data[:size])
    return made


@pytest.mark.parametrize("engine", ["builtin", "auto"])
@pytest.mark.parametrize("size", SIZES)
def test_c_and_python_give_one_digest(harness: Path, files: dict[int, Path], engine: str, size: int) -> None:
    done = subprocess.run([str(harness), str(files[size]), engine], capture_output=True, text=True, check=True,
                          timeout=120)
    used, c_digest = done.stdout.split()
    assert engine == "auto" or used == "builtin"
    assert c_digest == region_digest(files[size], 0, size)


def test_the_digest_sees_one_changed_byte(harness: Path, tmp_path: Path) -> None:
    """The comparison can fail: the last byte of a second chunk changed changes both digests alike."""
    data = bytearray(os.urandom(DIGEST_CHUNK + 7))
    path = tmp_path / "changed.bin"
    path.write_bytes(data)
    before = region_digest(path, 0, len(data))
    data[-1] ^= 1
    path.write_bytes(data)
    after = subprocess.run([str(harness), str(path), "builtin"], capture_output=True, text=True, check=True,
                           timeout=120).stdout.split()[1]
    assert after != before and after == region_digest(path, 0, len(data))

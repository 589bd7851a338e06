"""Issue 39 item 2 and issue 35 item 3: the device dump's digests, `sha256-64m` and `crc32-64m`, each defined once
(constants.h and hydration/_digests.py, checked against each other by test_interposer_constants.py). Both
languages must keep computing them (the interposer digests inside the engine's process, without Python), so the C
(sha256.c's both engines, crc32.c's three, and the release's own block loop, dump.c's `digest_and_write`, and
`cscu_segment_digest`) and Python's `region_digest` / `crc_digest` are run on the same real files here and must
agree, byte for byte, at the sizes where a chunking or folding mistake would show. The same loop writes the file:
it must read back as the input, with its blocks of zeros left as holes and its chunks of zeros recorded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration import DeviceDump, check_dump
from coldsnap_probe.hydration._digests import DIGEST_CHUNK, crc_digest, digest_like, region_digest
from coldsnap_probe.hydration._interposer import DUMP_KIND, SOURCES
from tests.probe.interposer_harness import UNITY

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

HARNESS = UNITY + r"""

static void no_libcrypto(void) {}

/* The engine asked for: "builtin" (our SHA-256), "tables" or "pclmul" (CRC-32 without the wider folds), "auto". */
static void choose(const char *engine)
{
    if (strcmp(engine, "builtin") == 0)
        pthread_once(&ossl_once, no_libcrypto);
    pthread_once(&crc_once, crc_setup);
    if (strcmp(engine, "tables") == 0 || strcmp(engine, "pclmul") == 0)
        crc_have_wide = 0;
    if (strcmp(engine, "tables") == 0)
        crc_have_pclmul = 0;
}

/* argv: a kind and a size: the digest a hydration gives a chunk of zeros it set on the device (never read), as a
 * one-chunk segment's text, asked twice (the second a whole chunk's cached answer). */
static int zeros(char **argv)
{
    char named[32], text[2][CSCU_DIGEST_TEXT];
    unsigned char chunk[2][1][32];
    snprintf(named, sizeof(named), "%s:", argv[1]);
    int kind = cscu_digest_kind_of(named);
    if (kind < 0)
        return 2;
    for (int k = 0; k < 2; k++) {
        cscu_zeros_digest(kind, (size_t)strtoull(argv[2], NULL, 10), chunk[k][0]);
        cscu_digest_text(kind, (const unsigned char (*)[32])chunk[k], 1, text[k]);
    }
    printf("%s %s\n", text[0], text[1]);
    return 0;
}

/* argv: a file, a kind (sha256-64m, crc32-64m), an engine, the file to write. The input is one dump segment:
 * each chunk (out of order, as the threads finish them) in staging-sized pieces through the release's block loop
 * into the output file (made at its full size, as dump_all makes it); then its digest and zero chunks. */
int main(int argc, char **argv)
{
    if (argc == 3)
        return zeros(argv);
    int in = argc == 5 ? open(argv[1], O_RDONLY) : -1, out = argc == 5 ? open(argv[4], O_WRONLY | O_CREAT, 0600) : -1;
    struct stat st;
    if (in < 0 || out < 0 || fstat(in, &st) != 0 || ftruncate(out, st.st_size) != 0)
        return 2;
    char named[32];
    snprintf(named, sizeof(named), "%s:", argv[2]);
    struct segment segment = {.size = (size_t)st.st_size, .kind = cscu_digest_kind_of(named)};
    if (segment.kind < 0)
        return 2;
    choose(argv[3]);
    cscu_segments = &segment;
    cscu_segment_count = 1;
    size_t chunks = (segment.size + CSCU_DIGEST_CHUNK - 1) / CSCU_DIGEST_CHUNK, piece = (size_t)4 << 20;
    struct job job = {.items = calloc(chunks + 1, sizeof(struct item)), .count = chunks, .segments = &segment,
                      .fds = &out, .lock = PTHREAD_MUTEX_INITIALIZER};
    unsigned char *buffer = malloc(piece);
    struct spent spent = {0, 0, 0, 0, 0, 0};
    for (size_t c = 0; c < chunks; c++) {
        struct cscu_chunk_digest h;
        struct item *it = &job.items[chunks - 1 - c];
        it->offset = c * CSCU_DIGEST_CHUNK;
        it->size = segment.size - it->offset < CSCU_DIGEST_CHUNK ? segment.size - it->offset : CSCU_DIGEST_CHUNK;
        it->zero = 1;
        cscu_chunk_init(&h, segment.kind);
        for (size_t at = 0; at < it->size; at += piece) {
            size_t n = it->size - at < piece ? it->size - at : piece;
            if (cscu_full_io(1, in, buffer, n, (off_t)(it->offset + at)) != 0
                || digest_and_write(&job, it, buffer, n, at, &h, &spent) != 0)
                return 1;
        }
        cscu_chunk_final(&h, it->digest);
        segment.zero |= (uint32_t)it->zero << c;
    }
    char text[CSCU_DIGEST_TEXT];
    cscu_segment_digest(&job, 0, text);
    printf("%s %s %u\n", cscu_digest_engine(segment.kind), text, segment.zero);
    return 0;
}
"""

MIB = 1 << 20
SIZES = (0, 1, 4095, DIGEST_CHUNK - 1, DIGEST_CHUNK, DIGEST_CHUNK + 1, 2 * DIGEST_CHUNK + 12 * 1024)
ENGINES = [("sha256-64m", "builtin"), ("sha256-64m", "auto"), ("crc32-64m", "tables"), ("crc32-64m", "pclmul"),
           ("crc32-64m", "auto")]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("digest")
    (folder / "harness.c").write_text(HARNESS)  # not digest.c: the harness includes the interposer's digest.c
    subprocess.run(["gcc", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-I", str(SOURCES), "-o",
                    str(folder / "harness"), str(folder / "harness.c"), "-ldl", "-lpthread"], check=True,
                   capture_output=True, text=True)
    return folder / "harness"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("bytes")
    data = os.urandom(SIZES[-1])
    made = {}
    for size in SIZES:
        made[size] = folder / f"{size}.bin"
        made[size].write_bytes(data[:size])
    return made


def run(harness: Path, path: Path, kind: str, engine: str, out: Path) -> tuple[str, str, int]:
    """What the C says: the engine it used, the digest, the zero chunks' mask (the written file is `out`)."""
    out.unlink(missing_ok=True)
    used, digest, zero = subprocess.run([str(harness), str(path), kind, engine, str(out)], capture_output=True,
                                        text=True, check=True, timeout=120).stdout.split()
    return used, digest, int(zero)


@pytest.mark.parametrize(("kind", "engine"), ENGINES, ids=[f"{k}-{e}" for k, e in ENGINES])
def test_c_and_python_give_one_digest(harness: Path, files: dict[int, Path], tmp_path: Path, kind: str,
                                      engine: str) -> None:
    # The built-in SHA-256 (0.1 GB/s) skips the largest file: the chunks' combination is the same for every engine.
    sizes = SIZES[:-1] if engine == "builtin" else SIZES
    python = {size: (crc_digest if kind.startswith("crc") else region_digest)(files[size], 0, size) for size in sizes}
    for size in sizes:
        path = files[size]
        used, digest, zero = run(harness, path, kind, engine, tmp_path / "out.bin")
        assert engine == "auto" or used == engine, used
        assert (digest, zero) == (python[size], 0), size
        assert digest_like(digest, path, 0, size) == digest
    assert (tmp_path / "out.bin").read_bytes() == path.read_bytes()  # the largest, written back whole


@pytest.mark.parametrize("kind", ["sha256-64m", "crc32-64m"])
def test_the_digest_sees_one_changed_byte(harness: Path, tmp_path: Path, kind: str) -> None:
    """The comparison can fail: the last byte of a second chunk changed changes both digests alike."""
    data = bytearray(os.urandom(DIGEST_CHUNK + 7))
    path = tmp_path / "changed.bin"
    path.write_bytes(data)
    before = digest_like(kind + ":", path, 0, len(data))
    data[-1] ^= 1
    path.write_bytes(data)
    after = run(harness, path, kind, "auto", tmp_path / "out.bin")[1]
    assert after != before and after == digest_like(kind + ":", path, 0, len(data))
    if kind.startswith("crc"):  # one CRC per chunk: the first chunk's is the same, the second's is not
        assert after[:len("crc32-64m:") + 8] == before[:len("crc32-64m:") + 8] and after[-8:] != before[-8:]


def test_blocks_of_zeros_are_holes_and_chunks_of_zeros_are_recorded(harness: Path, tmp_path: Path) -> None:
    """Chunk 1 all zeros, chunk 0 with 1 MiB of zeros inside, chunk 2 zeros but its last byte: the file written
    reads back as the input, takes less space than its size (holes, never written), and only chunk 1 is a zero
    chunk; the digest is the input's (a hole reads as zeros)."""
    data = bytearray(os.urandom(3 * DIGEST_CHUNK))
    data[MIB:2 * MIB] = bytes(MIB)
    data[DIGEST_CHUNK:3 * DIGEST_CHUNK - 1] = bytes(2 * DIGEST_CHUNK - 1)
    path, out = tmp_path / "zeros.bin", tmp_path / "out.bin"
    path.write_bytes(data)
    _, digest, zero = run(harness, path, "crc32-64m", "auto", out)
    assert zero == 0b010 and digest == crc_digest(path, 0, len(data))
    assert out.read_bytes() == data
    assert out.stat().st_blocks * 512 <= DIGEST_CHUNK + 2 * MIB, "the zeros were written, not left as holes"


@pytest.mark.parametrize("kind", ["sha256-64m", "crc32-64m"])
def test_a_chunk_of_zeros_set_on_the_device_is_checked_as_the_zeros_it_is(harness: Path, tmp_path: Path,
                                                                          kind: str) -> None:
    """With digests asked, a hydration sets a recorded chunk of zeros on the device without reading it and takes
    the digest of zeros for it (dump.c's one_chunk): that digest must be what Python finds in a file of zeros, for
    a whole chunk (computed once, then cached) and a segment's shorter last one, so that a manifest whose chunk is
    marked zero but digested otherwise fails the segment's comparison."""
    for size in (DIGEST_CHUNK, 6 * MIB):
        with open(tmp_path / "zeros.bin", "wb") as f:
            f.truncate(size)
        first, cached = subprocess.run([str(harness), kind, str(size)], capture_output=True, text=True,
                                       check=True, timeout=60).stdout.split()
        assert first == cached == digest_like(kind + ":", tmp_path / "zeros.bin", 0, size), size
        (tmp_path / "zeros.bin").write_bytes(bytes(size - 1) + b"\x01")
        assert first != digest_like(kind + ":", tmp_path / "zeros.bin", 0, size)  # the comparison can fail


def _manifest(folder: Path, digest: str, size: int, **segment: int) -> dict[str, object]:
    region = {"address": 0x7F0000000000, "size": size, "requested": size, "device": 0,
              "device_uuid": "GPU-00000000-0000-0000-0000-000000000000", "device_name": "NVIDIA H200",
              "segments": [{"file": "seg-0.bin", "offset": 0, "address": 0x7F0000000000, "size": size,
                            "digest": digest, **segment}]}
    return {"format": 1, "kind": DUMP_KIND, "pid": 42, "dir": str(folder), "digest_engine": "libcrypto",
            "segment_bytes": 1 << 30, "threshold": 2 * MIB, "bytes": size, "regions": [region], "uncovered": {},
            "timings_s": {"dump": 0.1}, "gbps": 1.0}


@pytest.mark.parametrize("kind", ["sha256-64m", "crc32-64m"])
def test_either_kind_verifies_and_an_old_manifest_keeps_its_digest(tmp_path: Path, kind: str) -> None:
    """A manifest written before crc32-64m and zero chunks (sha256-64m, no `zero`) decodes to the same digest it
    was recorded with, and each kind's content check passes on its file and fails on a changed one."""
    size = DIGEST_CHUNK + 4 * MIB
    (tmp_path / "seg-0.bin").write_bytes(bytes(DIGEST_CHUNK) + os.urandom(4 * MIB))
    digest = digest_like(kind + ":", tmp_path / "seg-0.bin", 0, size)
    recorded = DeviceDump.from_json(_manifest(tmp_path, digest, size, **({"zero": 1} if "crc" in kind else {})),
                                    answered=True).to_json()
    dump = DeviceDump.from_json(recorded)
    assert ("zero" in recorded["regions"][0]["segments"][0]) == ("crc" in kind)
    check_dump(dump, tmp_path, content=True)
    with open(tmp_path / "seg-0.bin", "r+b") as f:  # one byte changed (writing a fixed one was a no-op 1 in 256)
        f.seek(DIGEST_CHUNK + MIB)
        changed = bytes([f.read(1)[0] ^ 0xFF])
        f.seek(DIGEST_CHUNK + MIB)
        f.write(changed)
    with pytest.raises(HydrationError, match="does not match its digest"):
        check_dump(dump, tmp_path, content=True)


@pytest.mark.parametrize(("digest", "segment", "error"), [
    ("crc32-64m:0000000", {}, "digest must be"),  # one chunk, seven digits
    ("crc32-64m:" + "0" * 16, {}, "digest must be"),  # two chunks' digests for one chunk
    ("crc32-64m:0000000G", {}, "digest must be"),
    ("crc32-64m:00000000", {"zero": 2}, "beyond the segment's 1"),
    ("crc32-64m:00000000", {"zero": -1}, "non-negative integer"),
    ("crc32-64m:00000000", {"zeros": 1}, "optionally zero"),
])
def test_a_malformed_crc_segment_is_refused_naming_the_rule(tmp_path: Path, digest: str, segment: dict[str, int],
                                                            error: str) -> None:
    with pytest.raises(HydrationError, match=error):
        DeviceDump.from_json(_manifest(tmp_path, digest, 4 * MIB, **segment), answered=True)

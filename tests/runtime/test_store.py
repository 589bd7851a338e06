"""The node's capture store on a real filesystem (coldsnap_runtime/store.py), and where a Dockerfile puts a build
context's files (backend/_capture_build.destinations): no engine needed."""

from __future__ import annotations

import ctypes
import hashlib
import io
import mmap
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_runtime.backend._capture_build import destinations
from coldsnap_runtime.errors import StoreError
from coldsnap_runtime.store import CHUNK_BYTES, CaptureData, CaptureStore, StoredFile, artifact_manifest

MIB = 1 << 20


@pytest.fixture
def store(tmp_path: Path) -> CaptureStore:
    opened = CaptureStore(tmp_path / "store")
    opened.open()
    return opened


def _capture(store: CaptureStore, files: dict[str, bytes]) -> tuple[str, list[StoredFile]]:
    stored = [store.ingest(name, len(data), 0o600, io.BytesIO(data)) for name, data in sorted(files.items())]
    document = msgspec_data(stored)
    return store.record(artifact_manifest(document, stored), document), stored


def msgspec_data(stored: list[StoredFile]) -> bytes:
    import msgspec

    return msgspec.json.encode(CaptureData(files=stored))


def _blobs(store: CaptureStore) -> set[str]:
    return {p.name for p in (store.root / "blobs" / "sha256").iterdir()}


def test_ingest_skips_zero_chunks_and_stores_the_same_bytes_once(store: CaptureStore) -> None:
    random = os.urandom(CHUNK_BYTES)
    pages = random + bytes(CHUNK_BYTES) + b"tail" * 1000
    first, stored = _capture(store, {"images/pages-1.img": pages, "images/dump.bin": random})
    assert stored[1].chunks[1] is None  # the zero chunk: recorded, not stored
    assert stored[0].chunks == [stored[1].chunks[0]]  # the same 64 MiB, one blob
    chunk_blobs = {c.removeprefix("sha256:") for f in stored for c in f.chunks if c}
    assert chunk_blobs <= _blobs(store) and len(chunk_blobs) == 2
    # A second capture sharing the random chunk adds only its new bytes.
    before = _blobs(store)
    second, _ = _capture(store, {"images/pages-1.img": random + os.urandom(MIB)})
    assert second != first and len(_blobs(store) - before) == 2  # one new chunk and its data document, no more
    info = {i.capture: i for i in store.describe_all()}
    assert info[first].zero == CHUNK_BYTES and info[first].shared == CHUNK_BYTES
    assert info[second].stored == CHUNK_BYTES + MIB
    # Regression: review17: a manager's view (the captures it reaches) counted as shared a chunk another manager's
    # capture held: naming a chunk in its own capture told it whether another manager's holds it.
    assert [(i.capture, i.shared) for i in store.describe_all([second])] == [(second, 0)]
    assert store.describe(second, among=[second]).shared == 0 and store.describe(second).shared == CHUNK_BYTES


def test_tree_gives_back_the_same_bytes_with_holes_for_zeros(store: CaptureStore) -> None:
    pages = os.urandom(3 * MIB) + bytes(CHUNK_BYTES) + os.urandom(MIB)
    capture, _ = _capture(store, {"images/pages-1.img": pages, "images/zero.bin": bytes(CHUNK_BYTES + 7)})
    tree, read = store.tree(capture)
    assert read == len(pages)  # both of its chunks hold random bytes; the zero file is read from nothing
    assert hashlib.sha256((tree / "images/pages-1.img").read_bytes()).digest() == hashlib.sha256(pages).digest()
    zero = tree / "images/zero.bin"
    assert zero.stat().st_size == CHUNK_BYTES + 7 and zero.stat().st_blocks == 0
    assert store.tree(capture) == (tree, 0)  # made once


def cached_share(path: Path) -> float:
    """The share of the file's pages in the page cache: mincore(2) over a private map of it (which reads nothing;
    a probing read would start a read-ahead)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        pages = -(-len(mapped) // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        try:
            assert libc.mincore(address, len(mapped), vector) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vector.raw) / pages
        finally:
            del address


def drop(path: Path) -> None:
    """Write the file back and drop it from the page cache (a chunk long after its pull, or after a drop)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
def test_tree_reads_each_chunk_once_and_leaves_only_the_tree_in_the_page_cache(store: CaptureStore,
                                                                                cold: bool) -> None:
    """A chunk, cold or cached (just pulled), is dropped from the page cache once copied: the cache never holds a
    chunk and its tree copy, the same bytes twice."""
    pages = os.urandom(CHUNK_BYTES + 3 * MIB + 123)  # a tail that is not a whole page
    capture, stored = _capture(store, {"images/pages-1.img": pages})
    blobs = [store.blob_path(c) for c in stored[0].chunks if c]
    for blob in blobs:
        if cold:
            drop(blob)
        else:
            blob.read_bytes()
        assert cached_share(blob) == (0.0 if cold else 1.0)
    tree, read = store.tree(capture)
    assert read == len(pages) and (tree / "images/pages-1.img").read_bytes() == pages
    assert [cached_share(blob) for blob in blobs] == [0.0, 0.0]


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing"])
def test_tree_refuses_a_damaged_chunk_naming_it_and_leaves_nothing(store: CaptureStore, damage: str,
                                                                   cold: bool) -> None:
    """Cached or cold, a damaged chunk is refused by name."""
    capture, stored = _capture(store, {"images/pages-1.img": os.urandom(2 * MIB)})
    chunk = stored[0].chunks[0]
    assert chunk is not None
    blob = store.blob_path(chunk)
    if damage == "corrupt":
        with open(blob, "r+b") as out:
            out.seek(MIB)
            out.write(b"\xff")
    elif damage == "truncated":
        os.truncate(blob, MIB + 5)
    else:
        blob.unlink()
    if cold and damage != "missing":
        drop(blob)
        assert cached_share(blob) == 0.0
    with pytest.raises(StoreError, match=f"images/pages-1.img: chunk {chunk} is"):
        store.tree(capture)
    assert not list((store.root / "trees").iterdir()) and not list((store.root / "tmp").iterdir())


def test_record_refuses_a_capture_whose_chunks_are_not_all_there(store: CaptureStore) -> None:
    stored = [StoredFile(path="images/p.img", size=10, mode=0o600, chunks=["sha256:" + "a" * 64])]
    document = msgspec_data(stored)
    with pytest.raises(StoreError, match="names 1 chunks the store lacks"):
        store.record(artifact_manifest(document, stored), document)
    assert store.captures() == []


@pytest.mark.parametrize("path", ["/etc/x", "images/../../x", "", "images/a\0b", "./x", "images//x", "x/"])
def test_record_refuses_a_file_path_that_cannot_be_made_under_the_tree_naming_it(store: CaptureStore,
                                                                                path: str) -> None:
    """Regression: review 2026-12-02 (part 2): a registry's data document naming a path with a NUL byte was recorded,
    then made every pull and run of its image fail with an unnamed internal error (os.open's ValueError)."""
    chunk = store.put_blob(b"x" * 10)
    stored = [StoredFile(path=path, size=10, mode=0o600, chunks=[chunk])]
    document = msgspec_data(stored)
    with pytest.raises(StoreError, match=r"file path .* must be relative, without \.\. or a NUL byte"):
        store.record(artifact_manifest(document, stored), document)
    assert store.captures() == []


def test_remove_keeps_chunks_other_captures_hold_and_collect_keeps_those_in_use(store: CaptureStore) -> None:
    shared = os.urandom(CHUNK_BYTES)
    first, _ = _capture(store, {"a.img": shared + os.urandom(MIB)})
    second, _ = _capture(store, {"b.img": shared})
    third, _ = _capture(store, {"c.img": os.urandom(MIB)})
    store.tree(first)
    store.remove(first)
    assert store.captures() == sorted([second, third]) and not list((store.root / "trees").iterdir())
    assert store.tree(second)[0].joinpath("b.img").read_bytes() == shared  # its chunk survived
    with pytest.raises(StoreError, match="not in the node's store"):
        store.remove(first)
    assert store.collect(in_use={second, third}, max_bytes=0, older_than_s=0).removed == []
    collected = store.collect(in_use={second}, max_bytes=0, older_than_s=None)
    assert collected.removed == [third] and collected.orphans == 0 and collected.blobs == 2  # its chunk and document
    assert collected.bytes >= MIB
    assert store.captures() == [second]


def test_a_full_disk_midway_fails_the_file_naming_it_and_leaves_only_whole_chunks(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        store = CaptureStore(mount / "store")
        store.open()
        data = os.urandom(8 * MIB)  # ~40 chunks cut by content, written 4 at once: the disk fills after ~10
        with pytest.raises(StoreError, match=r"images/pages-1\.img: a chunk could not be stored: No space left"):
            store.ingest("images/pages-1.img", len(data), 0o600, io.BytesIO(data), by_content=True)
        assert not list((mount / "store" / "tmp").iterdir()) and store.captures() == []
        written = _blobs(store)
        assert written  # those before the disk filled: each whole, its bytes its name
        assert all(hashlib.sha256(store.blob_path(f"sha256:{name}").read_bytes()).hexdigest() == name
                   for name in written)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def paths() -> Iterator[set[str]]:
    yield {"unit/images/pages-1.img", "unit/images/dump/seg-0.bin"}


def test_destinations_follow_copy_and_workdir(paths: set[str]) -> None:
    assert destinations("FROM base\nWORKDIR /capsule\nCOPY unit/images images/\n", paths) == {
        "/capsule/images/pages-1.img": "unit/images/pages-1.img",
        "/capsule/images/dump/seg-0.bin": "unit/images/dump/seg-0.bin"}
    assert destinations("FROM base\nCOPY . /c\n", paths) == {"/c/unit/images/pages-1.img": "unit/images/pages-1.img",
                                                             "/c/unit/images/dump/seg-0.bin":
                                                                 "unit/images/dump/seg-0.bin"}
    assert destinations('FROM base\nCOPY ["unit/images/pages-1.img", "/p.img"]\n', paths) == {
        "/p.img": "unit/images/pages-1.img"}
    assert destinations("FROM base\nCOPY other /o\nRUN true\n", paths) == {}  # nothing of the capture copied


@pytest.mark.parametrize("dockerfile", [
    "FROM base AS one\nCOPY unit /u\nFROM base\nCOPY --from=one /u /u\n",  # the copy is in an intermediate stage
    "FROM base\nCOPY unit /u\nRUN sha256sum /u/images/pages-1.img\n",  # a RUN would read a stub
    "FROM base\nADD unit /u\n",
    "FROM base\nCOPY --chown=1:1 unit /u\n",
    "FROM base\nCOPY unit/images/*.img /u/\n",
    "FROM base\nARG D=/u\nCOPY unit $D\n",
], ids=["stages", "run-after", "add", "flags", "wildcard", "variable"])
def test_destinations_keep_every_byte_when_the_dockerfile_is_not_followed(paths: set[str], dockerfile: str) -> None:
    assert destinations(dockerfile, paths) is None


def test_tree_refuses_files_larger_than_the_room_before_writing_any(store: CaptureStore) -> None:
    """Regression (review, 2026-12-02): a data document naming one stored chunk thousands of times made the node
    write its files until the disk was full, under the node-wide capture lock."""
    chunk = store.ingest("images/pages-1.img", CHUNK_BYTES, 0o600, io.BytesIO(os.urandom(CHUNK_BYTES))).chunks[0]
    assert chunk is not None
    room = os.statvfs(store.root)
    times = room.f_bavail * room.f_frsize // CHUNK_BYTES + 2
    huge = [StoredFile(path="images/pages-1.img", size=times * CHUNK_BYTES, mode=0o600, chunks=[chunk] * times)]
    document = msgspec_data(huge)
    capture = store.record(artifact_manifest(document, huge), document)
    with pytest.raises(StoreError, match=f"capture {capture}: its files need {times * CHUNK_BYTES} bytes more, the "
                                         r"store's filesystem has \d+ free; nothing was made"):
        store.tree(capture)
    assert not any((store.root / "trees").iterdir()) and not any((store.root / "tmp").iterdir())


def test_removal_keeps_the_chunks_when_another_capture_cannot_be_read(store: CaptureStore) -> None:
    """review13: a capture of a format this daemon cannot read (a newer daemon's, before a rollback) counted as holding
    nothing: removing another capture deleted the chunks the two shared."""
    shared = os.urandom(MIB)
    first, files = _capture(store, {"a.img": shared})
    newer = msgspec_data(files).replace(b'"format":1', b'"format":3')
    assert newer != msgspec_data(files)
    manifest = artifact_manifest(newer, files)
    store.put_blob(newer)
    (store.root / "captures" / f"{hashlib.sha256(manifest).hexdigest()}.json").write_bytes(manifest)
    store.remove(first)
    assert store.captures() == ["sha256:" + hashlib.sha256(manifest).hexdigest()]
    assert all(store.has_blob(c) for f in files for c in f.chunks if c)


def test_collect_deletes_the_blobs_no_capture_names_and_says_what_it_freed(store: CaptureStore) -> None:
    """Review (issue 34, item 1): a build that failed after storing chunks, or a pull interrupted before its capture
    was listed, left blobs nothing named: collection removed only whole captures, so they stayed for ever."""
    kept, files = _capture(store, {"a.img": os.urandom(MIB)})
    failed = store.ingest("images/pages-1.img", 3 * MIB, 0o600, io.BytesIO(os.urandom(3 * MIB)), by_content=True)
    orphans = {c for c in failed.chunks if c}
    assert orphans and all(store.has_blob(c) for c in orphans)
    gone = "sha256:" + "ab" * 32  # a removal the daemon died in: its files, no record
    (store.root / "trees" / gone.removeprefix("sha256:")).mkdir()
    (store.root / "trees" / gone.removeprefix("sha256:") / "x").write_bytes(os.urandom(4096))
    collected = store.collect(in_use=set(), max_bytes=None, older_than_s=None)
    assert collected.removed == [] and collected.orphans == collected.blobs == len(orphans)
    assert collected.bytes >= 3 * MIB + 4096
    assert not any(store.has_blob(c) for c in orphans) and not any((store.root / "trees").iterdir())
    assert store.captures() == [kept] and all(store.has_blob(c) for f in files for c in f.chunks if c)
    assert store.collect(in_use=set(), max_bytes=None, older_than_s=None).blobs == 0


def test_collection_and_removal_keep_what_a_write_in_flight_holds(store: CaptureStore) -> None:
    """Collection racing a pull or a build: the chunks it stored or found present before its capture is listed."""
    shared = os.urandom(MIB)
    old, _ = _capture(store, {"a.img": shared})
    with store.holding() as hold:  # a build that finds old's chunk present, then a collection takes old
        stored = [store.ingest("b.img", MIB, 0o600, io.BytesIO(shared), hold=hold)]
        assert store.collect(in_use=set(), max_bytes=0, older_than_s=0).removed == [old]
        assert all(store.has_blob(c) for c in stored[0].chunks if c)
        document = msgspec_data(stored)
        new = store.record(artifact_manifest(document, stored), document)
    assert store.captures() == [new] and store.tree(new)[0].joinpath("b.img").read_bytes() == shared
    with store.holding() as hold:  # a pull that found the chunk present, then failed
        hold.add(c for c in stored[0].chunks if c)
        store.remove(new)
        assert all(store.has_blob(c) for c in stored[0].chunks if c)
    assert store.collect(in_use=set(), max_bytes=None, older_than_s=None).orphans == 1
    assert not any((store.root / "blobs" / "sha256").iterdir())


def test_a_killed_daemons_temporaries_are_swept_when_the_store_opens(store: CaptureStore) -> None:
    leftover = store.temporary("sha256:" + "cd" * 32)
    leftover.write_bytes(os.urandom(4096))
    (store.root / "tmp" / "tree-x.1234").mkdir()
    CaptureStore(store.root).open()
    assert not any((store.root / "tmp").iterdir())

"""A pull writes each byte once (issue 34): its chunks go straight into the capture's files, which are their home;
an interrupted pull resumes from what its files hold, checked; dropping the files first keeps, as blobs, what
another capture still needs (the real registry on 127.0.0.1)."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from coldsnap_runtime.backend._capture_registry import Possession, Transferred
from coldsnap_runtime.errors import RuntimeFailed, StoreError
from coldsnap_runtime.store import CaptureStore, artifact_manifest
from coldsnap_runtime.store_pull import PullTree
from tests.conftest import Registry
from tests.runtime.test_capture_registry_review import _pushed, _registry

PIECE = 1 << 20  # each chunk: a page image's chunk is ~190 KiB, a device dump's 64 MiB; small data, the same paths


def _chunks(n: int) -> dict[str, bytes]:
    return {"sha256:" + hashlib.sha256(b).hexdigest(): b for b in (os.urandom(PIECE) for _ in range(n))}


def _written() -> int:
    """The bytes this process has handed to write calls (files and sockets), all its threads."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("wchar:")).split()[1])


def _pulled(registry: Registry, tmp_path: Path, name: str, chunks: dict[str, bytes]) -> tuple[CaptureStore, str]:
    capture = _pushed(registry, tmp_path, name, chunks, served=set(chunks))
    node = CaptureStore(tmp_path / f"node-{name}")
    node.open()
    anyio.run(_registry(node, registry, f"review/{name}{os.getpid()}").pull, capture)
    return node, capture


def _file(node: CaptureStore, capture: str) -> Path:
    return node.root / "trees" / capture.removeprefix("sha256:") / "images" / "pages-1.img"


def _record(node: CaptureStore, chunk: str, length: int) -> str:
    """List a capture of one file of one chunk the node holds (as a build does): its id."""
    document = {"format": 2, "files": [{"path": "images/one.img", "size": length, "mode": 0o644, "chunks": [chunk],
                                        "lengths": [length]}]}
    data = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    files = node.decode_data(data).files
    return node.record(artifact_manifest(data, files), data)


def test_a_pull_writes_each_chunk_once_into_the_captures_files(registry: Registry, tmp_path: Path) -> None:
    chunks = _chunks(4)
    capture = _pushed(registry, tmp_path, "once", chunks, served=set(chunks))
    node = CaptureStore(tmp_path / "node")
    node.open()
    before = _written()
    anyio.run(_registry(node, registry, f"review/once{os.getpid()}").pull, capture)
    written = _written() - before
    assert len(chunks) * PIECE <= written < 1.25 * len(chunks) * PIECE  # before: each chunk as a blob, then copied
    assert _file(node, capture).read_bytes() == b"".join(chunks.values())
    assert len(list((node.root / "blobs" / "sha256").iterdir())) == 1  # its data document only
    assert node.made_files(capture) is not None and not any((node.root / "partial").iterdir())
    assert all(node.has_blob(c) for c in chunks)  # held: in the capture's files
    info = node.describe(capture)
    assert (info.stored, info.tree) == (0, len(chunks) * PIECE)  # on disk once, as its files


def test_an_interrupted_pull_resumes_from_its_files_and_refetches_only_what_does_not_check(
        registry: Registry, tmp_path: Path) -> None:
    chunks = _chunks(3)
    node, capture = _pulled(registry, tmp_path, "resume", chunks)
    hexa = capture.removeprefix("sha256:")
    # What an interrupted pull leaves: its partial files (here: whole), no listing; and one chunk's bytes damaged.
    (node.root / "captures" / f"{hexa}.json").unlink()
    (node.root / "trees" / f"{hexa}.made.json").unlink()
    os.rename(node.root / "trees" / hexa, node.root / "partial" / hexa)
    with open(node.root / "partial" / hexa / "images" / "pages-1.img", "r+b") as damaged:
        damaged.seek(PIECE + 7)
        damaged.write(b"\xff" if damaged.read(1) != b"\xff" else b"\x00")
    again = anyio.run(_registry(node, registry, f"review/resume{os.getpid()}").pull, capture)
    assert (again.blobs, again.present_blobs) == (1, 2)  # the damaged one fetched again, the others checked
    assert node.has(capture) and _file(node, capture).read_bytes() == b"".join(chunks.values())


def test_removing_pulled_files_first_keeps_as_a_blob_what_another_capture_needs(registry: Registry,
                                                                                tmp_path: Path) -> None:
    chunks = _chunks(2)
    node, capture = _pulled(registry, tmp_path, "moveout", chunks)
    shared, own = list(chunks)
    other = _record(node, shared, PIECE)  # a build's capture that found the chunk in the pulled files
    assert not node.blob_path(shared).exists()
    node.remove(capture)
    assert node.blob_path(shared).read_bytes() == chunks[shared] and not node.has_blob(own)
    tree, _ = node.tree(other)
    assert (tree / "images" / "one.img").read_bytes() == chunks[shared]


def test_a_damaged_copy_in_pulled_files_refuses_their_removal_naming_it(registry: Registry, tmp_path: Path) -> None:
    chunks = _chunks(2)
    node, capture = _pulled(registry, tmp_path, "damaged", chunks)
    shared = next(iter(chunks))
    _record(node, shared, PIECE)
    with open(_file(node, capture), "r+b") as damaged:
        damaged.write(b"\x00" * 16)
    with pytest.raises(StoreError, match=f"its copy of chunk {shared}, which another capture or a write in flight "
                                         "needs, is corrupt or truncated; nothing was removed"):
        node.remove(capture)
    assert node.has(capture) and _file(node, capture).exists()


def test_a_pulled_capture_is_pushed_from_its_files(registry: Registry, tmp_path: Path) -> None:
    chunks = _chunks(2)
    node, capture = _pulled(registry, tmp_path, "repush", chunks)
    pushed = anyio.run(_registry(node, registry, f"review/repushed{os.getpid()}").push, capture)
    assert pushed.blobs == 3  # the two chunks (sent from the capture's files) and the data document
    again = CaptureStore(tmp_path / "again")
    again.open()
    anyio.run(_registry(again, registry, f"review/repushed{os.getpid()}").pull, capture)
    assert _file(again, capture).read_bytes() == b"".join(chunks.values())


def test_two_pulls_of_one_capture_never_write_the_same_partial_files(tmp_path: Path) -> None:
    node = CaptureStore(tmp_path / "node")
    node.open()
    data = json.dumps({"format": 1, "files": [{"path": "a.bin", "size": 16, "mode": 0o644,
                                               "chunks": ["sha256:" + "ab" * 32]}]}).encode()
    first, second = node.begin_pull("sha256:" + "cd" * 32, data), node.begin_pull("sha256:" + "cd" * 32, data)
    assert isinstance(first, PullTree) and first.root == node.root / "partial" / ("cd" * 32)
    assert second.root.parent == node.root / "tmp"
    second.leave()
    assert not second.root.exists()
    assert first.join()  # a fetch thread still writing keeps the files from the next pull
    first.leave()
    assert node.collect(in_use=set(), max_bytes=None, older_than_s=None).removed == []
    assert first.root.exists()  # held by the fetch thread still
    first.leave()
    node.collect(in_use=set(), max_bytes=None, older_than_s=None)
    assert not first.root.exists()  # an interrupted pull nobody resumed: collected
    shutil.rmtree(node.root)


def test_a_data_document_naming_one_file_twice_is_refused_and_holds_nothing(tmp_path: Path) -> None:
    node = CaptureStore(tmp_path / "node")
    node.open()
    one = {"path": "a.bin", "size": 16, "mode": 0o644, "chunks": ["sha256:" + "ab" * 32]}
    data = json.dumps({"format": 1, "files": [one, one]}).encode()
    with pytest.raises(StoreError, match="names one file twice; nothing was fetched"):
        node.begin_pull("sha256:" + "cd" * 32, data)
    node.begin_pull("sha256:" + "cd" * 32, json.dumps({"format": 1, "files": [one]}).encode()).leave()
    assert (node.root / "partial" / ("cd" * 32)).is_dir()  # the same capture's pull is not held off


@pytest.mark.parametrize("alias", ["./a.bin", "a.bin/", "d/../a.bin", "./d//b.bin"])
def test_a_data_document_naming_one_file_two_ways_is_refused_before_any_file_is_made(tmp_path: Path,
                                                                                     alias: str) -> None:
    """Regression: review17: "a.bin" and "./a.bin" passed the check for a file named twice, and the pull wrote both
    files' chunks at one place: the capture was listed with a home of one chunk holding the other's bytes, which
    then failed another manager's build of that chunk ("corrupt or truncated") and every collection."""
    node = CaptureStore(tmp_path / "node")
    node.open()
    files = [{"path": path, "size": 16, "mode": 0o644, "chunks": ["sha256:" + digit * 64]}
             for path, digit in (("a.bin", "a"), ("d/b.bin", "b"), (alias, "c"))]
    with pytest.raises(StoreError, match=f"file path {alias!r} must be relative, .* name its file one way"):
        node.begin_pull("sha256:" + "cd" * 32, json.dumps({"format": 1, "files": files}).encode())
    assert not any((node.root / "partial").iterdir())


def test_a_pull_gets_only_the_room_other_pulls_in_flight_leave_it(registry: Registry, tmp_path: Path) -> None:
    """Regression: review17: each pull checked its files against the disk's free bytes alone, so two pulls at once,
    each of which fits, filled the disk (ENOSPC mid-fetch, partial files left until a collection)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], check=True)
    try:
        node = CaptureStore(mount / "store")
        node.open()
        chunks = _chunks(6)  # 6 MiB: fits the disk alone
        capture = _pushed(registry, tmp_path, "room", chunks, served=set(chunks))
        client = _registry(node, registry, f"review/room{os.getpid()}")
        # Another pull in flight, 12 MiB still to write (its chunks not fetched yet): fits alone too.
        data = json.dumps({"format": 2, "files": [{"path": "pages-1.img", "size": 12 * PIECE, "mode": 0o644,
                                                   "chunks": ["sha256:" + f"{n:064x}" for n in range(12)],
                                                   "lengths": [PIECE] * 12}]}).encode()
        first = node.begin_pull("sha256:" + "ef" * 32, data)
        with node.holding() as hold:
            client._layers(data, hold, Possession(None, None, collections.OrderedDict()), first, Transferred())
        with pytest.raises(RuntimeFailed, match=r"its files need 6291456 bytes more, the store's filesystem has "
                                                r"\d+ free; nothing was fetched"):
            anyio.run(client.pull, capture)
        assert node.captures() == []
        first.leave()  # the other pull ended: its room is the disk's again
        anyio.run(client.pull, capture)
        assert _file(node, capture).read_bytes() == b"".join(chunks.values())
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)

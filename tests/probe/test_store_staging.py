"""A capture that came through the node's capture store (issue 34): its device dump is staged like the release's own.

On the H200 (`scripts/device store`, 2026-12-01) every restore of a pulled capture ran `verify: digest` and asked no
stage: its dump files are the ones the store made from the pulled chunks, other inodes than the ones the release
recorded. The store now lists the identities of the files it made (`CaptureStore.made_files`, mounted read-only
into the workload), and the worker takes those as the capture's own."""

from __future__ import annotations

import json
import os
from pathlib import Path

from coldsnap_probe.hydration import dump_identities, store_made, verification
from coldsnap_probe.memory._device_dump import DumpRecord, stages_for
from coldsnap_runtime.store import CaptureStore, StoredFile, artifact_manifest
from tests.probe.test_interposer import dump_in


def _through_the_store(images: Path, store_root: Path) -> tuple[CaptureStore, str, Path]:
    """The images' dump files ingested into a node store as a capture, and its files made (as at a pull):
    (store, capture, the made images directory)."""
    store = CaptureStore(store_root)
    store.open()
    files: list[StoredFile] = []
    for path in sorted((images / "device-42").iterdir()):
        with open(path, "rb") as source:
            files.append(store.ingest(f"images/device-42/{path.name}", path.stat().st_size, 0o600, source))
    data = json.dumps({"format": 1, "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks}
                                                for f in files]}, sort_keys=True, separators=(",", ":")).encode()
    capture = store.record(artifact_manifest(data, files), data)
    tree, _ = store.tree(capture)
    return store, capture, tree / "images"


def test_a_pulled_captures_dump_is_staged_once_the_store_lists_the_files_it_made(tmp_path: Path) -> None:
    images = tmp_path / "images"
    dump = dump_in(images / "device-42")
    released = dump_identities(dump, images / "device-42")  # what the capture's release recorded
    store, capture, made_images = _through_the_store(images, tmp_path / "store")
    listing = store.made_files(capture)
    assert listing is not None
    made = store_made(str(listing))
    directory = made_images / "device-42"
    record = DumpRecord(42, "/run/cuda-42.sock", "device-42", dump, released, str(tmp_path / "absent.sock"))

    # Without the listing (the H200 run): other inodes, every byte digested, no stage asked.
    assert verification(dump, directory, released) == "digest"
    assert stages_for([record], made_images) == {}
    # With it: the worker's plan is the local capture's, a stage asked of the node hydrator.
    assert verification(dump, directory, released, made) == "sampled"
    stages = stages_for([record], made_images, made)
    assert list(stages) == [42]
    assert stages[42].parts[0]["file"] == str(directory / "seg-0.bin")  # the hydrator reads the store's files
    assert stages[42].adopt(timeout=10) is None and "absent.sock" in stages[42].report["error"]
    stages[42].discard()

    # A file changed after the store made it is not vouched for (a write changes its ctime).
    segment = directory / "seg-1.bin"
    with open(segment, "r+b") as out:
        out.write(b"\0")
    assert verification(dump, directory, released, made) == "digest"
    assert stages_for([record], made_images, made) == {}


def test_a_listing_of_another_kind_or_unreadable_vouches_for_nothing(tmp_path: Path) -> None:
    images = tmp_path / "images"
    dump_in(images / "device-42")
    store, capture, _ = _through_the_store(images, tmp_path / "store")
    listing = store.made_files(capture)
    assert listing is not None and len(store_made(str(listing))) == 2
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(listing.read_text()), "kind": "something-else"}))
    assert store_made(str(other)) == frozenset()
    other.write_text("{not json")
    assert store_made(str(other)) == frozenset()
    assert store_made(str(tmp_path / "absent.json")) == frozenset()
    # Dropping the tree drops its listing first: it never outlives the files it names.
    store.drop_tree(capture)
    assert store.made_files(capture) is None and not os.path.exists(listing)

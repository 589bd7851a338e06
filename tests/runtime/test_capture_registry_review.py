"""review: what a registry's capture manifest may make the daemon fetch (the real registry on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import anyio

from coldsnap_runtime.backend._capture_registry import CaptureRegistry
from coldsnap_runtime.store import CHUNK_MEDIA_TYPE, CaptureStore, StoredFile, artifact_manifest
from tests.conftest import Registry


def _registry(store: CaptureStore, registry: Registry, repository: str) -> CaptureRegistry:
    return CaptureRegistry(store, registry=registry.address, repository=repository, insecure=True,
                           auth={"username": registry.username, "password": registry.password}, action="image-pull")


def test_a_pull_fetches_only_the_chunks_the_data_document_names(registry: Registry, tmp_path: Path) -> None:
    """A manifest's extra layers (any blob, any size) were fetched into the store and never collected."""
    source = CaptureStore(tmp_path / "a")
    source.open()
    chunk = source.put_blob(os.urandom(4096))
    extra = source.put_blob(os.urandom(8192))  # in the registry, named by the manifest, not by the capture
    files = [StoredFile(path="images/pages-1.img", size=4096, mode=0o644, chunks=[chunk])]
    data = json.dumps({"format": 1, "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks}
                                                for f in files]}, sort_keys=True, separators=(",", ":")).encode()
    document = json.loads(artifact_manifest(data, files))
    document["layers"].append({"mediaType": CHUNK_MEDIA_TYPE, "digest": extra, "size": 8192})
    manifest = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    capture = source.record(manifest, data)
    assert capture == "sha256:" + hashlib.sha256(manifest).hexdigest()
    repository = f"review/extra{os.getpid()}"
    anyio.run(_registry(source, registry, repository).push, capture)

    target = CaptureStore(tmp_path / "b")
    target.open()
    anyio.run(_registry(target, registry, repository).pull, capture)
    assert target.has(capture) and target.has_blob(chunk)
    assert not target.has_blob(extra)


def test_a_capture_file_is_never_made_set_id(tmp_path: Path) -> None:
    """review: a data document's mode (a registry's) is not trusted with set-id bits on the host's tree."""
    store = CaptureStore(tmp_path / "s")
    store.open()
    chunk = store.put_blob(os.urandom(4096))
    files = [StoredFile(path="images/x", size=4096, mode=0o6755, chunks=[chunk])]
    data = json.dumps({"format": 1, "files": [{"path": "images/x", "size": 4096, "mode": 0o6755, "chunks": [chunk]}]},
                      sort_keys=True, separators=(",", ":")).encode()
    capture = store.record(artifact_manifest(data, files), data)
    tree, _ = store.tree(capture)
    assert (tree / "images" / "x").stat().st_mode & 0o7000 == 0


def _data(chunk: str, path: str) -> tuple[bytes, list[StoredFile]]:
    files = [StoredFile(path=path, size=16, mode=0o644, chunks=[chunk])]
    return json.dumps({"format": 1, "files": [{"path": path, "size": 16, "mode": 0o644, "chunks": [chunk]}]},
                      sort_keys=True, separators=(",", ":")).encode(), files


def test_a_removal_racing_a_record_never_leaves_a_listed_capture_without_its_chunks(tmp_path: Path) -> None:
    """review: remove() of a capture sharing a chunk with one being recorded deleted that chunk after record()
    checked it: the new capture was listed with a chunk missing (its build succeeded, its run failed)."""
    import threading

    store = CaptureStore(tmp_path / "s")
    store.open()
    broken = 0
    for round_ in range(300):
        chunk = store.put_blob(os.urandom(16))
        old_data, old_files = _data(chunk, "old")
        old = store.record(artifact_manifest(old_data, old_files), old_data)
        new_data, new_files = _data(chunk, f"new{round_}")
        go = threading.Barrier(2)
        recorded: list[str] = []

        def record(go: threading.Barrier, data: bytes, files: list[StoredFile], recorded: list[str]) -> None:
            go.wait()
            try:
                recorded.append(store.record(artifact_manifest(data, files), data))
            except Exception:  # the chunk was gone before the check: refused, which is fine
                pass

        thread = threading.Thread(target=record, args=(go, new_data, new_files, recorded))
        thread.start()
        go.wait()
        store.remove(old)
        thread.join()
        if recorded and not store.has_blob(chunk):
            broken += 1
        for capture in store.captures():
            store.remove(capture)
    assert broken == 0

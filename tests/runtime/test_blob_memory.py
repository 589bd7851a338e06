"""A push remembers which blobs it saw in a repository (issue 34, `_blob_memory.py`): counted at the real registry on
127.0.0.1, by its own access log."""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import time
from pathlib import Path

import anyio

from coldsnap_runtime.backend._blob_memory import BlobMemory, KnownBlobs
from coldsnap_runtime.backend._capture_registry import Transferred
from coldsnap_runtime.store import CaptureStore, StoredFile, artifact_manifest
from tests.conftest import Registry

CHUNK = 64 << 10


def _record(store: CaptureStore, chunks: list[str]) -> str:
    """A capture of `chunks` (each its own file) in `store`."""
    files = [StoredFile(path=f"images/pages-{i}.img", size=CHUNK, mode=0o644, chunks=[chunk])
             for i, chunk in enumerate(chunks)]
    data = json.dumps({"format": 1, "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks}
                                                for f in files]}, sort_keys=True, separators=(",", ":")).encode()
    return store.record(artifact_manifest(data, files), data)


def _two_captures(tmp_path: Path) -> tuple[CaptureStore, str, str, list[str]]:
    """(store, first, second, the blobs only the second names: its new chunk and its data document); the second
    capture shares 5 of the first's 6 chunks."""
    store = CaptureStore(tmp_path / "store")
    store.open()
    chunks = [store.put_blob(os.urandom(CHUNK)) for _ in range(7)]
    first, second = _record(store, chunks[:6]), _record(store, chunks[1:])
    config = json.loads(store.manifest(second))["config"]["digest"]
    return store, first, second, [chunks[6], config]


def _push(store: CaptureStore, registry: Registry, repository: str, capture: str,
          known: KnownBlobs | None) -> Transferred:
    return anyio.run(registry.client(store, repository, "image-push", known=known).push, capture)


def _request(registry: Registry, method: str, path: str) -> int:
    connection = http.client.HTTPConnection(registry.address, timeout=30)
    token = base64.b64encode(f"{registry.username}:{registry.password}".encode()).decode()
    connection.request(method, path, headers={"Authorization": f"Basic {token}"})
    status = connection.getresponse().status
    connection.close()
    return status


def _asked(registry: Registry, repository: str) -> list[str]:
    """The blobs of `repository` the registry was asked about, by a HEAD or a POST that mounts it from there (a 401's
    challenge not counted), in its log's order, once a request sent now is in the log (the registry writes each line
    after its answer)."""
    marker = f"/v2/{repository}-marker/blobs/sha256:{os.urandom(32).hex()}"  # another repository: not counted
    _request(registry, "HEAD", marker)
    deadline = time.monotonic() + 10
    while marker not in (log := registry.log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    name = re.escape(repository)
    return re.findall(rf'"(?:HEAD /v2/{name}/blobs/|POST /v2/{name}/blobs/uploads/\?mount=)(sha256:[0-9a-f]{{64}})'
                      rf'\S* HTTP/1.1" (?!401)', log)


def test_a_second_push_asks_only_for_the_blobs_not_seen_in_the_repository(registry: Registry,
                                                                         tmp_path: Path) -> None:
    store, first, second, new = _two_captures(tmp_path)
    repository = f"memory/second{os.getpid()}"
    memory = BlobMemory()

    def known(manager: int | None) -> KnownBlobs:
        return memory.scope(manager=manager, registry=registry.address, repository=repository,
                            auth={"username": registry.username, "password": registry.password})

    pushed = _push(store, registry, repository, first, known(None))
    assert (pushed.blobs, pushed.remembered) == (7, 0)
    before = len(_asked(registry, repository))
    assert len(set(_asked(registry, repository))) == 7  # (an uploaded blob is asked again: is it mounted there?)

    again = _push(store, registry, repository, second, known(None))
    assert sorted(set(_asked(registry, repository)[before:])) == sorted(new)  # none of the 5 chunks seen asked for
    assert (again.blobs, again.present_blobs, again.remembered) == (2, 5, 5)

    # Another manager's push skips nothing it did not see itself (the registry answers its HEADs, not our memory).
    asked = len(_asked(registry, repository))
    stranger = _push(store, registry, repository, second, known(4242))
    assert (stranger.blobs, stranger.present_blobs, stranger.remembered) == (0, 7, 0)
    assert len(set(_asked(registry, repository)[asked:])) == 7


def test_a_registry_that_lost_a_remembered_blob_ends_with_a_whole_capture(registry: Registry,
                                                                          tmp_path: Path) -> None:
    store, first, second, new = _two_captures(tmp_path)
    repository = f"memory/lost{os.getpid()}"
    known = BlobMemory().scope(manager=None, registry=registry.address, repository=repository,
                               auth={"username": registry.username, "password": registry.password})
    _push(store, registry, repository, first, known)
    lost = next(layer["digest"] for layer in json.loads(store.manifest(second))["layers"]
                if layer["digest"] not in new)  # a chunk both captures name
    assert _request(registry, "DELETE", f"/v2/{repository}/blobs/{lost}") == 202  # collected behind the node's back
    assert _request(registry, "HEAD", f"/v2/{repository}/blobs/{lost}") == 404

    again = _push(store, registry, repository, second, known)
    # The manifest was refused naming the lost blob: every skipped blob asked for, the lost one sent again.
    assert (again.blobs, again.present_blobs, again.remembered) == (3, 4, 0)
    assert _request(registry, "HEAD", f"/v2/{repository}/blobs/{lost}") == 200
    pulled = CaptureStore(tmp_path / "pulled")
    pulled.open()
    assert anyio.run(registry.client(pulled, repository, "image-pull").pull, second).blobs == 6
    assert pulled.has(second)
    assert _push(store, registry, repository, second, known).remembered == 7  # remembered again since


def test_the_memory_keeps_at_most_its_bound_the_least_recently_used_forgotten_first() -> None:
    memory = BlobMemory()
    memory.KEPT = 4
    old = memory.scope(manager=None, registry="r", repository="a", auth=None)
    recent = memory.scope(manager=None, registry="r", repository="b", auth=None)
    digests = [f"sha256:{i:064x}" for i in range(6)]
    for digest in digests[:3]:
        old.add(digest)
    for digest in digests[3:]:
        recent.add(digest)
    assert [old.has(d) for d in digests[:3]] == [False, False, True]  # the oldest scope's oldest went first
    assert all(recent.has(d) for d in digests[3:])
    rotated = memory.scope(manager=None, registry="r", repository="b", auth={"username": "u", "password": "p"})
    assert not rotated.has(digests[3])  # other credentials: asked again
    recent.forget()
    assert not any(recent.has(d) for d in digests) and old.has(digests[2])
    old.add("not-a-digest")  # never remembered: asked every time
    assert not old.has("not-a-digest")

"""review: what a registry's capture manifest may make the daemon fetch (the real registry on 127.0.0.1)."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import anyio
import pytest

from coldsnap_runtime.backend._blob_fetch import fetch_blob
from coldsnap_runtime.backend._capture_registry import CaptureRegistry, Possession, Transferred
from coldsnap_runtime.errors import RuntimeFailed
from coldsnap_runtime.store import CHUNK_BYTES, CHUNK_MEDIA_TYPE, CaptureStore, StoredFile, artifact_manifest
from tests.conftest import Registry
from tests.runtime._http_peer import Serve, one_peer


def _registry(store: CaptureStore, registry: Registry, repository: str) -> CaptureRegistry:
    return registry.client(store, repository, "image-pull", slots=4)


async def _fetch_one(registry: CaptureRegistry, digit: str) -> None:
    """The pull's fetch of one 64 MiB chunk named by `digit` repeated (from repository `r`), in one lane."""
    await registry._fetch([("sha256:" + digit * 64, 64 << 20)], Possession(None, None, collections.OrderedDict()),
                          Transferred())


def test_a_pull_refuses_a_manifest_naming_a_blob_its_data_document_does_not(registry: Registry,
                                                                              tmp_path: Path) -> None:
    """A manifest's extra layers (any blob, any size) were fetched into the store and never collected; then (review17)
    not fetched, but the capture listed with them, and its push sent them from the node's store, wherever another
    manager's capture held them: now refused, nothing fetched."""
    source = CaptureStore(tmp_path / "a")
    source.open()
    chunk, extra = source.put_blob(os.urandom(16)), source.put_blob(os.urandom(16))
    repository = f"review/extra{os.getpid()}"
    client = _registry(source, registry, repository)
    for blob, path in ((extra, "extra.img"), (chunk, "images/pages-1.img")):  # every blob in the repository
        data, files = _data(blob, path)
        anyio.run(client.push, source.record(artifact_manifest(data, files), data))
    document = json.loads(artifact_manifest(data, files))
    document["layers"].append({"mediaType": CHUNK_MEDIA_TYPE, "digest": extra, "size": 16})
    manifest = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
    capture = "sha256:" + hashlib.sha256(manifest).hexdigest()

    async def put() -> int:
        async with aiohttp.ClientSession() as session:
            return (await client._put_manifest(session, capture, manifest))[0]

    assert anyio.run(put) == 201  # the registry serves it: every blob it names is there
    target = CaptureStore(tmp_path / "b")
    target.open()
    with pytest.raises(RuntimeFailed, match=f"layer {extra} \\(16 bytes\\) is not a chunk of its data document; "
                                            "nothing was fetched"):
        anyio.run(_registry(target, registry, repository).pull, capture)
    assert target.captures() == [] and not target.has_blob(chunk) and not target.has_blob(extra)


def test_a_manifest_nested_past_the_parsers_depth_is_refused_naming_it(registry: Registry, tmp_path: Path) -> None:
    """Regression: review17: a registry's manifest nested 3,000 deep (Go's parser takes 10,000) raised RecursionError
    out of the pull: an unnamed internal error."""
    source = CaptureStore(tmp_path / "a")
    source.open()
    data, files = _data(source.put_blob(os.urandom(16)), "images/pages-1.img")
    repository = f"review/nested{os.getpid()}"
    client = _registry(source, registry, repository)
    anyio.run(client.push, source.record(artifact_manifest(data, files), data))
    document = json.loads(artifact_manifest(data, files))
    manifest = json.dumps(document)[:-1].encode() + b', "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    capture = "sha256:" + hashlib.sha256(manifest).hexdigest()

    async def put() -> int:
        async with aiohttp.ClientSession() as session:
            return (await client._put_manifest(session, capture, manifest))[0]

    assert anyio.run(put) == 201
    target = CaptureStore(tmp_path / "b")
    target.open()
    with pytest.raises(RuntimeFailed, match=f"manifest {capture} is not a capture's: RecursionError"):
        anyio.run(_registry(target, registry, repository).pull, capture)
    assert target.captures() == []


def test_a_push_sends_its_data_documents_chunks_never_a_blob_its_manifest_adds(registry: Registry,
                                                                               tmp_path: Path) -> None:
    """Regression: review17: a capture listed with a registry's manifest naming another manager's chunk (a pull did
    not check the manifest's layers) pushed that chunk from the node's store to the registry its manager named."""
    node = CaptureStore(tmp_path / "node")
    node.open()
    secret = node.put_blob(os.urandom(16))  # another manager's capture's chunk
    theirs, their_files = _data(secret, "theirs.img")
    node.record(artifact_manifest(theirs, their_files), theirs)
    data, files = _data(node.put_blob(os.urandom(16)), "images/pages-1.img")
    for size in (16, 4096):  # the chunk by name; past its length (its home's neighbours)
        document = json.loads(artifact_manifest(data, files))
        document["layers"].append({"mediaType": CHUNK_MEDIA_TYPE, "digest": secret, "size": size})
        capture = node.record(json.dumps(document).encode(), data)  # as a pull before the check listed it
        with pytest.raises(RuntimeFailed, match=f"layer {secret} \\({size} bytes\\) is not a chunk of its data "
                                                "document; nothing was pushed"):
            anyio.run(_registry(node, registry, f"review/exfil{os.getpid()}").push, capture)
    assert secret.removeprefix("sha256:") not in registry.log.read_text()


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


def _trickling(head: bytes) -> Serve:
    """A registry that sends `head`, then one body byte every 0.1 s, never the whole body."""

    def serve(peer: socket.socket, done: threading.Event) -> None:
        peer.recv(65536)
        peer.sendall(head)
        while not done.wait(0.1):
            peer.sendall(b"x")

    return serve


BLOB_PATH = f"/v2/r/blobs/sha256:{'0' * 64}"
TRICKLE = b"HTTP/1.1 200 OK\r\nContent-Length: 67108864\r\n\r\n"


def test_a_registry_that_trickles_a_blob_is_cut_at_the_blobs_deadline(tmp_path: Path) -> None:
    """Regression (review, 2026-12-02): each read reset the socket timeout, so a byte every few minutes held a
    fetch thread (and the daemon's shutdown) for ever."""
    with one_peer(_trickling(TRICKLE), BLOB_PATH) as url:
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="did not arrive within 1 s"):
            fetch_blob(url, authorization="", digest="sha256:" + "0" * 64, size=64 << 20, into=tmp_path / "b",
                       within_s=1.0, stop=threading.Event())
        assert time.monotonic() - began < 10


def test_a_cancelled_pull_does_not_wait_for_its_fetch_threads(tmp_path: Path) -> None:
    """The pull's request is cancelled (a client hung up): it returns at once, and its thread ends at its next piece,
    leaving no file."""
    store = CaptureStore(tmp_path / "s")
    store.open()
    with one_peer(_trickling(TRICKLE), BLOB_PATH) as url:
        registry = CaptureRegistry(store, registry=url.split("/")[2], repository="r", insecure=True, auth=None,
                                   action="image-pull", fetches=anyio.CapacityLimiter(2),
                                   share=anyio.CapacityLimiter(2), uploads=anyio.CapacityLimiter(2))

        async def cancelled() -> float:
            began = time.monotonic()
            with anyio.move_on_after(0.5):
                await _fetch_one(registry, "0")
            return time.monotonic() - began

        assert anyio.run(cancelled) < 3
        deadline = time.monotonic() + 10
        while any((store.root / "tmp").iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not any((store.root / "tmp").iterdir()) and not any(p.is_file() for p in (store.root / "blobs").rglob("*"))


def test_a_cancelled_pulls_fetch_thread_keeps_its_slot_until_it_ends(tmp_path: Path) -> None:
    """Regression: review 2026-12-02 (part 2): a cancelled pull gave its fetch slot back at once while its thread
    waited on a silent registry for up to its idle timeout, so pulls cancelled one after another (a client that hangs
    up and asks again) piled up threads and sockets without bound. The slot is given back when the thread ends, which
    is within POLL_S of the cancel, the registry still silent."""
    store = CaptureStore(tmp_path / "s")
    store.open()
    fetches = anyio.CapacityLimiter(1)
    with _silent_registry(TRICKLE) as (url, _, asked):
        registry = CaptureRegistry(store, registry=url.split("/")[2], repository="r", insecure=True, auth=None,
                                   action="image-pull", fetches=fetches, share=anyio.CapacityLimiter(1),
                                   uploads=anyio.CapacityLimiter(1))

        async def cancelled_twice() -> None:
            for digit in "01":
                with anyio.move_on_after(0.5):
                    await _fetch_one(registry, digit)
                assert fetches.borrowed_tokens == 1  # its thread has not ended yet: its slot stays taken
                with anyio.fail_after(5):
                    while fetches.borrowed_tokens:
                        await anyio.sleep(0.05)
            assert len(asked) == 2

        anyio.run(cancelled_twice)
    assert not any((store.root / "tmp").iterdir())


_AFTER_THE_LOOP = """
import asyncio, sys, time
from pathlib import Path
import anyio
from coldsnap_runtime.backend._capture_registry import CaptureRegistry
from coldsnap_runtime.store import CaptureStore
from tests.runtime.test_capture_registry_review import TRICKLE, _fetch_one, _silent_registry

store = CaptureStore(Path(sys.argv[1]))
store.open()
with _silent_registry(TRICKLE) as (url, hang_up, _):
    registry = CaptureRegistry(store, registry=url.split("/")[2], repository="r", insecure=True, auth=None,
                               action="image-pull", fetches=anyio.CapacityLimiter(1),
                               share=anyio.CapacityLimiter(1), uploads=anyio.CapacityLimiter(1))

    async def cancelled() -> None:
        with anyio.move_on_after(0.5):
            await _fetch_one(registry, "0")

    loop = asyncio.new_event_loop()
    loop.run_until_complete(cancelled())  # the loop stops, not yet closed, its fetch thread still waiting
    hang_up()  # the thread ends now and gives its slot back to a loop that will never run again
    while any((store.root / "tmp").iterdir()):
        time.sleep(0.05)
    time.sleep(0.2)
    loop.close()
print("exited")
"""


def test_a_fetch_thread_ending_after_its_loop_stopped_does_not_hold_the_process(tmp_path: Path) -> None:
    """Regression: review 15. A fetch thread that ended after the event loop stopped (a daemon shutting down, a test's
    loop ending) waited for the loop to give its slot back, for ever: the interpreter's exit, which waits for it,
    hung (a test run held the tests' lock for half an hour)."""
    done = subprocess.run([sys.executable, "-c", _AFTER_THE_LOOP, str(tmp_path / "s")], capture_output=True,
                          text=True, timeout=30, check=False, cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and done.stdout == "exited\n", done.stderr[-2000:]


@contextmanager
def _silent_registry(head: bytes) -> Iterator[tuple[str, Callable[[], None], list[bytes]]]:
    """A real HTTP peer on 127.0.0.1 that answers each connection with `head`, then nothing until the test hangs
    it up; the request lines it got."""
    server = socket.create_server(("127.0.0.1", 0))
    done, asked = threading.Event(), []

    def answer(peer: socket.socket) -> None:
        with contextlib.suppress(OSError), peer:
            asked.append(peer.recv(65536).split(b"\r\n", 1)[0])
            peer.sendall(head)
            done.wait(60)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while not done.is_set():
                threading.Thread(target=answer, args=(server.accept()[0],), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/v2/r/blobs/", done.set, asked
    finally:
        done.set()
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close from another thread does not)
        server.close()
        thread.join(5)


def test_one_managers_pulls_from_a_silent_registry_never_hold_every_fetch_slot(tmp_path: Path) -> None:
    """Regression: review 2026-12-02 (part 2): two pulls of one manager from a registry that sends nothing held
    every node-wide fetch slot for the blob's whole deadline (300 s), and every other manager's pull waited."""
    store = CaptureStore(tmp_path / "s")
    store.open()
    fetches, mine, theirs = anyio.CapacityLimiter(2), anyio.CapacityLimiter(1), anyio.CapacityLimiter(1)
    with _silent_registry(TRICKLE) as (url, hang_up, asked):
        def registry(share: anyio.CapacityLimiter) -> CaptureRegistry:
            return CaptureRegistry(store, registry=url.split("/")[2], repository="r", insecure=True, auth=None,
                                   action="image-pull", fetches=fetches, share=share,
                                   uploads=anyio.CapacityLimiter(1))

        async def fetch(share: anyio.CapacityLimiter, digit: str) -> None:
            await _fetch_one(registry(share), digit)

        async def three_pulls() -> None:
            async with anyio.create_task_group() as group:
                group.start_soon(fetch, mine, "0")
                group.start_soon(fetch, mine, "1")  # the manager's second pull: waits for its share
                with anyio.fail_after(10):
                    while len(asked) < 1:
                        await anyio.sleep(0.02)
                    group.start_soon(fetch, theirs, "2")  # another manager's: a node slot is left for it
                    while not any(b"sha256:" + b"2" * 64 in line for line in asked):
                        await anyio.sleep(0.02)
                assert not any(b"sha256:" + b"1" * 64 in line for line in asked)
                group.cancel_scope.cancel()
            hang_up()
            with anyio.fail_after(10):
                while fetches.borrowed_tokens:
                    await anyio.sleep(0.05)

        anyio.run(three_pulls)


def test_a_redirect_to_a_malformed_address_is_refused_naming_it(tmp_path: Path) -> None:
    head = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://[::1/x\r\nContent-Length: 0\r\n\r\n"
    with one_peer(_trickling(head), BLOB_PATH) as url, pytest.raises(ConnectionError, match=r"http://\[::1/x"):
        fetch_blob(url, authorization="", digest="sha256:" + "0" * 64, size=1, into=tmp_path / "b", within_s=5.0,
                   stop=threading.Event())


def test_a_document_naming_tens_of_thousands_of_chunks_is_pulled_by_a_few_tasks(registry: Registry,
                                                                                tmp_path: Path) -> None:
    """review13: a pull started a task per chunk its data document named before fetching any; a registry's 4 MiB
    document of 1-byte chunks (format 2) names 50,000: 231 MiB of waiting tasks in the root daemon, per pull."""
    count = 50_000
    chunks = ["sha256:" + hashlib.sha256(str(n).encode()).hexdigest() for n in range(count)]
    data = json.dumps({"format": 2, "files": [{"path": "images/pages-1.img", "size": count, "mode": 0o644,
                                               "chunks": chunks, "lengths": [1] * count}]},
                      sort_keys=True, separators=(",", ":")).encode()
    source = CaptureStore(tmp_path / "a")
    source.open()
    source.put_blob(data)
    manifest = artifact_manifest(data, [])  # the registry's manifest names no chunk: none of them is anywhere
    capture = "sha256:" + hashlib.sha256(manifest).hexdigest()
    (source.root / "captures" / f"{capture.removeprefix('sha256:')}.json").write_bytes(manifest)
    repository = f"review/many{os.getpid()}"
    anyio.run(_registry(source, registry, repository).push, capture)

    target = CaptureStore(tmp_path / "b")
    target.open()
    tracemalloc.start()
    try:
        with pytest.raises(RuntimeFailed, match="answered 404 for blob sha256:"):
            anyio.run(_registry(target, registry, repository).pull, capture)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    assert target.captures() == [] and not list((target.root / "blobs" / "sha256").iterdir())


def test_a_pull_whose_chunks_would_not_fit_the_disk_fetches_nothing(registry: Registry, tmp_path: Path) -> None:
    """review13: a registry's document naming more chunk bytes than the node's disk has free was fetched until the
    disk filled, what it fetched left where nothing collects it."""
    count = 50_000  # 3.4 TB of 64 MiB chunks, named in a 3.7 MB document
    chunks = ["sha256:" + hashlib.sha256(str(n).encode()).hexdigest() for n in range(count)]
    data = json.dumps({"format": 1, "files": [{"path": "images/dump.bin", "size": count * CHUNK_BYTES, "mode": 0o644,
                                               "chunks": chunks}]}, sort_keys=True, separators=(",", ":")).encode()
    target = CaptureStore(tmp_path / "b")
    target.open()
    free = os.statvfs(target.root)
    assert free.f_bavail * free.f_frsize < count * CHUNK_BYTES
    source = CaptureStore(tmp_path / "a")
    source.open()
    source.put_blob(data)
    manifest = artifact_manifest(data, [])
    capture = "sha256:" + hashlib.sha256(manifest).hexdigest()
    (source.root / "captures" / f"{capture.removeprefix('sha256:')}.json").write_bytes(manifest)
    repository = f"review/huge{os.getpid()}"
    anyio.run(_registry(source, registry, repository).push, capture)
    with pytest.raises(RuntimeFailed, match=f"its files need {count * CHUNK_BYTES} bytes more, the "
                       r"store's filesystem has \d+ free; nothing was fetched"):
        anyio.run(_registry(target, registry, repository).pull, capture)
    assert target.captures() == [] and not list((target.root / "blobs" / "sha256").iterdir())


def _pushed(registry: Registry, tmp_path: Path, name: str, chunks: dict[str, bytes], served: set[str]) -> str:
    """A capture of one file of `chunks` (digest -> bytes, in order) pushed to `name` with only the `served` chunks'
    blobs (the registry's manifest names no other): its id."""
    source = CaptureStore(tmp_path / f"src-{name}")
    source.open()
    for data in chunks.values():
        source.put_blob(data)
    lengths = [len(data) for data in chunks.values()]
    files = [StoredFile(path="images/pages-1.img", size=sum(lengths), mode=0o644, chunks=list(chunks),
                        lengths=lengths)]
    data = json.dumps({"format": 2, "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks,
                                               "lengths": f.lengths} for f in files]},
                      sort_keys=True, separators=(",", ":")).encode()
    source.put_blob(data)
    manifest = artifact_manifest(data, [StoredFile(path=f.path, size=len(chunks[c]), mode=f.mode, chunks=[c],
                                                   lengths=[len(chunks[c])]) for f in files for c in f.chunks
                                        if c in served])
    capture = "sha256:" + hashlib.sha256(manifest).hexdigest()
    (source.root / "captures" / f"{capture.removeprefix('sha256:')}.json").write_bytes(manifest)
    anyio.run(_registry(source, registry, f"review/{name}{os.getpid()}").push, capture)
    return capture


def test_a_managers_pull_tells_nothing_of_another_managers_chunks(registry: Registry, tmp_path: Path) -> None:
    """Review (issue 34, item 4): a pull skipped every chunk the node's store held, whoever's capture held it: a
    manager naming another's chunk in its own capture's document learnt whether the node held it (the pull succeeded
    without its registry serving it, and fast), and then read it from the files made for its capture."""
    secret, mine = os.urandom(256 << 10), os.urandom(4096)
    chunks = {"sha256:" + hashlib.sha256(b).hexdigest(): b for b in (secret, mine)}
    node = CaptureStore(tmp_path / "node")
    node.open()
    other = node.put_blob(secret)  # another manager's capture's chunk, on the node
    other_data, other_files = _data(other, "theirs")
    node.record(artifact_manifest(other_data, other_files), other_data)
    probe = _pushed(registry, tmp_path, "probe", chunks, served={list(chunks)[1]})
    repository = f"review/probe{os.getpid()}"

    def pull(store: CaptureStore, possession: Possession | None) -> str:
        try:
            anyio.run(_registry(store, registry, repository).pull, probe, possession)
        except RuntimeFailed as exc:
            return str(exc)
        return ""

    empty = CaptureStore(tmp_path / "empty")
    empty.open()
    absent = pull(empty, Possession(4242, set(), collections.OrderedDict()))
    assert f"answered 404 for blob {other}" in absent
    assert pull(node, Possession(4242, set(), collections.OrderedDict())) == absent  # present: the same answer
    assert not node.has(probe) and node.has_blob(other)
    assert pull(node, None) == "" and node.has(probe)  # root's and the daemon's pulls use what the node holds


def test_a_managers_resumed_pull_uses_the_chunks_its_own_pull_fetched(registry: Registry, tmp_path: Path) -> None:
    """What a manager's pull fetched (the registry served it the bytes) its next pull uses; another's, it fetches."""
    data = {"sha256:" + hashlib.sha256(b).hexdigest(): b for b in (os.urandom(4096), os.urandom(8192))}
    capture = _pushed(registry, tmp_path, "resume", data, served=set(data))
    node = CaptureStore(tmp_path / "node")
    node.open()
    node.put_blob(next(iter(data.values())))  # held by the node already (another manager's)
    proven: collections.OrderedDict[tuple[int, str], None] = collections.OrderedDict()
    pull = _registry(node, registry, f"review/resume{os.getpid()}").pull
    first = anyio.run(pull, capture, Possession(4242, set(), proven))
    assert (first.blobs, first.present_blobs) == (2, 0) and node.has(capture)  # both fetched: one was not its own
    hexa = capture.removeprefix("sha256:")
    (node.root / "captures" / f"{hexa}.json").unlink()  # "interrupted" before listing: its files left partial
    os.rename(node.root / "trees" / hexa, node.root / "partial" / hexa)
    again = anyio.run(pull, capture, Possession(4242, set(), proven))
    assert (again.blobs, again.present_blobs) == (0, 2) and node.has(capture)
    stranger = anyio.run(pull, capture, Possession(4343, set(), proven))
    assert (stranger.blobs, stranger.present_blobs) == (2, 0)

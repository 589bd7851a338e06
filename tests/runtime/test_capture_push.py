"""A capture's push (issue 34): each missing blob in a worker thread (`_blob_upload.py`), against the real registry on
127.0.0.1, through a real TCP relay where the registry must die mid-push or stop reading."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import anyio
import pytest

from coldsnap_runtime.backend._blob_http import Lane
from coldsnap_runtime.backend._blob_upload import mounts, upload_blob
from coldsnap_runtime.backend._capture_registry import Transferred
from coldsnap_runtime.errors import RuntimeFailed
from coldsnap_runtime.store import CaptureStore, StoredFile, artifact_manifest
from tests.conftest import Registry
from tests.runtime._http_peer import Serve, one_peer

BLOBS = 12  # more than the 8 in flight at once
BLOB_BYTES = 2 << 20


class Relay:
    """A TCP relay on 127.0.0.1 in front of `upstream`. After `die_after` answers `201 Created` (blob uploads
    completed) it closes every connection and its listening socket: a registry that dies mid-push."""

    def __init__(self, upstream: str, die_after: int | None = None) -> None:
        self.upstream = upstream
        self.die_after = die_after
        self.created = 0
        self.dead = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while not self.dead.is_set():
                client, _ = self.listener.accept()
                host, port = self.upstream.split(":")
                server = socket.create_connection((host, int(port)))
                with self.lock:
                    self.sockets += [client, server]
                threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
                threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, answers: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 20):
                target.sendall(data)
                if answers and b" 201 Created" in data:
                    with self.lock:
                        self.created += data.count(b" 201 Created")
                        dies = self.die_after is not None and self.created >= self.die_after
                    if dies:
                        self.kill()
                        return
        with contextlib.suppress(OSError):
            target.shutdown(socket.SHUT_WR)

    def kill(self) -> None:
        """Close everything (again: a second call closes nothing new)."""
        self.dead.set()
        self.listener.close()
        with self.lock:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def _capture(tmp_path: Path) -> tuple[CaptureStore, str, list[str]]:
    """A store holding one capture of BLOBS random chunks (each its own file): (store, capture, its blobs)."""
    store = CaptureStore(tmp_path / "source")
    store.open()
    files = [StoredFile(path=f"images/pages-{i}.img", size=BLOB_BYTES, mode=0o644,
                        chunks=[store.put_blob(os.urandom(BLOB_BYTES))]) for i in range(BLOBS)]
    data = json.dumps({"format": 1, "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks}
                                                for f in files]}, sort_keys=True, separators=(",", ":")).encode()
    manifest = artifact_manifest(data, files)
    capture = store.record(manifest, data)
    document = json.loads(manifest)
    return store, capture, [document["config"]["digest"]] + [layer["digest"] for layer in document["layers"]]


def _push(store: CaptureStore, address: str, registry: Registry, repository: str, capture: str) -> Transferred:
    return anyio.run(registry.client(store, repository, "image-push", address=address).push, capture)


def _registry_has(registry: Registry, repository: str, kind: str, digest: str) -> bool:
    connection = http.client.HTTPConnection(registry.address, timeout=30)
    token = base64.b64encode(f"{registry.username}:{registry.password}".encode()).decode()
    connection.request("HEAD", f"/v2/{repository}/{kind}/{digest}",
                       headers={"Authorization": f"Basic {token}",
                                "Accept": "application/vnd.oci.image.manifest.v1+json"})
    status = connection.getresponse().status
    connection.close()
    return status == 200


def test_a_registry_dying_mid_push_fails_naming_a_blob_and_the_retry_sends_only_the_missing_ones(
        registry: Registry, tmp_path: Path) -> None:
    store, capture, blobs = _capture(tmp_path)
    repository = f"push/dies{os.getpid()}"
    relay = Relay(registry.address, die_after=3)
    try:
        with pytest.raises(RuntimeFailed) as failed:
            _push(store, relay.address, registry, repository, capture)
        assert relay.dead.is_set()
    finally:
        relay.kill()  # also when the push went through: no relay thread or socket outlives the test
    assert f"registry {relay.address}: blob sha256:" in str(failed.value), failed.value
    present = [blob for blob in blobs if _registry_has(registry, repository, "blobs", blob)]
    assert 3 <= len(present) < len(blobs)
    assert not _registry_has(registry, repository, "manifests", capture)  # never named before all its blobs

    again = _push(store, registry.address, registry, repository, capture)
    # The registry may still finish an upload the relay had passed on whole when it died (after `present` was read):
    # the retry then finds one more, never one fewer, and sends only what it lacks.
    assert again.present_blobs >= len(present) and again.present_blobs + again.blobs == len(blobs), again
    assert all(_registry_has(registry, repository, "blobs", blob) for blob in blobs)
    assert _registry_has(registry, repository, "manifests", capture)
    pulled = CaptureStore(tmp_path / "pulled")
    pulled.open()
    puller = registry.client(pulled, repository, "image-pull")
    assert anyio.run(puller.pull, capture).blobs == len(blobs) - 1  # the chunks; the data document is read apart
    assert pulled.has(capture)
    third = _push(store, registry.address, registry, repository, capture)  # a second push sends nothing
    assert (third.present_blobs, third.blobs) == (len(blobs), 0)


def test_a_push_to_a_registry_that_is_down_names_the_registry_and_a_blob(registry: Registry, tmp_path: Path) -> None:
    store, capture, _ = _capture(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(RuntimeFailed, match=rf"registry {address}: blob sha256:[0-9a-f]{{64}} was not pushed: "
                                            "ConnectionRefusedError"):
        _push(store, address, registry, "push/down", capture)


ACCEPTED = b"HTTP/1.1 202 Accepted\r\nLocation: /v2/r/blobs/uploads/u\r\nContent-Length: 0\r\n\r\n"


def _stalled(peer: socket.socket, done: threading.Event) -> None:
    """A registry that answers the HEAD (404) and the POST (202) and then reads nothing."""
    for answer in (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", ACCEPTED):
        peer.recv(65536)
        peer.sendall(answer)
    done.wait(30)


def test_a_registry_that_stops_reading_is_cut_at_the_blobs_deadline_and_a_cancel_ends_the_thread(
        tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(16 << 20))  # more than the socket's buffers hold
    digest = "sha256:" + "0" * 64
    with one_peer(_stalled, "/v2/r") as base, open(blob, "rb") as source:
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="was not sent within 1 s"):
            upload_blob(base, authorization="", digest=digest, size=16 << 20, source=source, within_s=1.0,
                        stop=threading.Event())
        assert time.monotonic() - began < 5
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    with one_peer(_stalled, "/v2/r") as base, open(blob, "rb") as source:
        began = time.monotonic()
        with pytest.raises(ConnectionAbortedError, match="its push was cancelled"):
            upload_blob(base, authorization="", digest=digest, size=16 << 20, source=source, within_s=300.0,
                        stop=stop)
        assert time.monotonic() - began < 5


def _tls_registry(tmp_path: Path, bodies: list[bytes]) -> Serve:
    """A registry over TLS (a self-signed certificate the client is told to trust): HEAD 404, POST 202, then the
    PUT's body read whole into `bodies` and answered 201 only when it hashes to the digest the PUT names."""
    import hashlib
    import ssl
    import subprocess

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "key.pem"),
                    "-out", str(tmp_path / "cert.pem")], check=True, capture_output=True)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")

    def serve(peer: socket.socket, done: threading.Event) -> None:
        with context.wrap_socket(peer, server_side=True) as secured, secured.makefile("rwb") as stream:
            for answer in (b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n", ACCEPTED, None):
                head = b"".join(iter(stream.readline, b"\r\n"))
                if answer is None:
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    bodies.append(stream.read(length))
                    digest = head.split(b"digest=")[1].split(b" ")[0].decode()
                    good = "sha256:" + hashlib.sha256(bodies[-1]).hexdigest() == digest
                    answer = b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n" if good else \
                        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"
                stream.write(answer)
                stream.flush()

    return serve


def test_through_tls_the_body_is_sent_encrypted_and_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sendfile would write the file's bytes past the TLS layer: through TLS the thread reads and sends them."""
    import hashlib

    data = os.urandom(3 << 20)
    (tmp_path / "blob").write_bytes(data)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    bodies: list[bytes] = []
    with one_peer(_tls_registry(tmp_path, bodies), "/v2/r", scheme="https") as base, \
            open(tmp_path / "blob", "rb") as source:
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))  # trust the peer's certificate
        uploaded = upload_blob(base, authorization="", digest=digest, size=len(data), source=source, within_s=60.0,
                               stop=threading.Event())
    assert (uploaded.status, uploaded.present) == (201, False)
    assert bodies == [data]


def _hostile(after_post: bytes, then: bytes) -> Serve:
    """A registry that answers the HEAD (404), then answers the POST with `after_post` and goes on sending `then` for
    as long as it is read: a byte at a time (each read well within the socket's timeout), or an endless body."""

    def serve(peer: socket.socket, done: threading.Event) -> None:
        peer.recv(65536)
        peer.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        peer.recv(65536)
        peer.sendall(after_post)
        while not done.is_set():
            peer.sendall(then)
            if len(then) == 1:
                time.sleep(0.05)

    return serve


TRICKLE = (b"HTTP/1.1 202 Accepted\r\nX-Slow: ", b"a")  # one header byte every 50 ms, never ending
ENDLESS = (b"HTTP/1.1 202 Accepted\r\nLocation: /v2/r/blobs/uploads/u\r\nTransfer-Encoding: chunked\r\n\r\n",
           b"10000\r\n" + b"x" * 0x10000 + b"\r\n")  # a body that never ends, sent as fast as it is read


@pytest.mark.parametrize(("answer", "cancel", "expected"), [
    (TRICKLE, False, r"TimeoutError\('blob sha256:0+ was not sent within 1 s'\)"),
    (TRICKLE, True, r"ConnectionAbortedError\('blob sha256:0+: its push was cancelled'\)"),
    (ENDLESS, False, r"ConnectionError\('the registry answered 202 with a body of more than 1048576 bytes'\)"),
    ((b"HTTP/1.1 2\xb22 Accepted\r\n\r\n", b"a"), False,
     r"ConnectionError\(\"the registry answered something else than HTTP/1.1: 'HTTP/1.1 2\xb22 Accepted'\"\)"),
    ((b"HTTP/1.1 202 Accepted\r\nContent-Length: \xb2\r\n\r\n", b"a"), False,
     r"ConnectionError\(\"the registry answered a Content-Length that is no number: '\xb2'\"\)"),
    ((ENDLESS[0], b"1\r\nx\r\n"), False,
     r"ConnectionError\('the registry sent a chunked body in more than 64 chunks for 64 bytes'\)"),
    ((ENDLESS[0] + b"0\r\n", b"X-Trailer: y\r\n"), False,
     r"ConnectionError\(\"the registry sent a chunked body's trailer of more than 65536 bytes\"\)"),
    ((b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\n\r\n"), False,
     r"ConnectionError\('the registry answered more than 8 interim \(1xx\) answers'\)"),
], ids=["trickle", "trickle-cancelled", "endless-body", "status-not-ascii", "length-not-ascii", "byte-chunks",
        "endless-trailer", "endless-interim"])
def test_a_registry_that_answers_a_byte_at_a_time_or_endlessly_never_holds_the_upload_thread(
        tmp_path: Path, answer: tuple[bytes, bytes], cancel: bool, expected: str) -> None:
    """Each read came within the socket's timeout, so only the blob's deadline or its cancel could end these: the
    thread was held for hours (a header line is read up to 64 KiB) or for ever (the body was drained whole), holding
    its upload slot, and the daemon's exit (a worker thread is no daemon thread)."""
    blob = tmp_path / "blob"
    blob.write_bytes(b"\0" * 4096)
    stop = threading.Event()
    ended: list[BaseException | None] = []

    def push() -> None:
        try:
            with open(blob, "rb") as source:
                upload_blob(base, authorization="", digest="sha256:" + "0" * 64, size=4096, source=source,
                            within_s=60.0 if cancel else 1.0, stop=stop)
            ended.append(None)
        except BaseException as exc:  # the test reports what ended it
            ended.append(exc)

    with one_peer(_hostile(*answer), "/v2/r") as base:
        began = time.monotonic()
        thread = threading.Thread(target=push, daemon=True)
        thread.start()
        if cancel:
            time.sleep(0.5)
            stop.set()
        thread.join(8)
        assert not thread.is_alive(), "the upload thread is still held by the registry"
        assert time.monotonic() - began < 5
    assert len(ended) == 1 and re.fullmatch(expected, repr(ended[0])), ended


def test_once_the_registry_mounts_a_blob_from_its_repository_a_push_asks_with_that_post(registry: Registry,
                                                                                     tmp_path: Path) -> None:
    """One round trip fewer a new blob: a POST that mounts the blob from the repository it is pushed to answers 201
    when it is there (then nothing is sent) and begins its upload when not (issue 34's per-blob cost)."""
    store, capture, blobs = _capture(tmp_path)
    repository = f"push/mounts{os.getpid()}"
    pushed = _push(store, registry.address, registry, repository, capture)
    assert (pushed.blobs, pushed.present_blobs) == (len(blobs), 0)
    log = registry.log.read_text()
    name = re.escape(repository)
    heads = re.findall(rf'"HEAD /v2/{name}/blobs/sha256:\w+ HTTP/1.1" 404', log)
    mounted = re.findall(rf'"POST /v2/{name}/blobs/uploads/\?mount=sha256:\w+&from={name} HTTP/1.1" 20[12]', log)
    # The push's first upload showed the registry mounts (201); the lane that learnt it asked for its next blob so.
    assert len(heads) < len(blobs) and len(heads) + len(mounted) > len(blobs), (heads, mounted)
    assert all(_registry_has(registry, repository, "blobs", blob) for blob in blobs)
    assert _registry_has(registry, repository, "manifests", capture)


def _no_mounts(requests: list[bytes]) -> Serve:
    """A registry that does not mount: the POST that asks it to begins an upload (202) anyway, then the PUT's body is
    read and taken (201); each request's line kept in `requests`."""

    def serve(peer: socket.socket, done: threading.Event) -> None:
        with peer.makefile("rwb") as stream:
            for answer in (ACCEPTED, b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"):
                head = b""
                while (line := stream.readline()) not in (b"\r\n", b""):
                    head += line
                if not head:  # the client closed: no more requests
                    return
                requests.append(head.split(b"\r\n")[0])
                if b"Content-Length: " in head and (length := int(head.split(b"Content-Length: ")[1].split(b"\r")[0])):
                    stream.read(length)
                stream.write(answer)
                stream.flush()

    return serve


def test_a_registry_that_does_not_mount_gets_the_upload_its_mount_post_began(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(4096))
    digest = "sha256:" + "0" * 64
    requests: list[bytes] = []
    with one_peer(_no_mounts(requests), "/v2/r") as base, open(blob, "rb") as source:
        uploaded = upload_blob(base, authorization="", digest=digest, size=4096, source=source, within_s=10.0,
                               stop=threading.Event(), mount="r")
    assert (uploaded.status, uploaded.present) == (201, False)
    assert requests == [f"POST /v2/r/blobs/uploads/?mount={digest}&from=r HTTP/1.1".encode(),
                        f"PUT /v2/r/blobs/uploads/u?digest={digest} HTTP/1.1".encode()]
    with one_peer(_no_mounts([]), "/v2/r") as base:  # asked whether it mounts: no (its upload cancelled)
        lane = Lane(base)
        try:
            assert not mounts(base, authorization="", digest=digest, repository="r", lane=lane, stop=threading.Event())
        finally:
            lane.close()

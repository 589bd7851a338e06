"""A lane's kept-alive connection (`_blob_http.py`) against a real peer on 127.0.0.1 that answers as registries and the
proxies before them may: chunked bodies, HTTP/1.0, a kept-alive connection dropped while idle."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from coldsnap_runtime.backend._blob_fetch import fetch_blob
from coldsnap_runtime.backend._blob_http import Lane


@contextlib.contextmanager
def _peer(answers: list[bytes]) -> Iterator[tuple[str, list[int]]]:
    """Serve `answers` in turn, one request each, and close the connection after each (without saying so, as a
    registry that drops an idle kept-alive connection does); yield the base URL and, per answer, the connection's
    number."""
    server = socket.create_server(("127.0.0.1", 0))
    served: list[int] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            for number, answer in enumerate(answers):
                peer, _ = server.accept()
                with peer, peer.makefile("rb") as requests:
                    while requests.readline() not in (b"\r\n", b""):
                        pass
                    peer.sendall(answer)
                    served.append(number)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/v2/r", served
    finally:
        server.close()
        thread.join(5)


def test_a_lane_reads_chunked_and_http10_bodies_and_asks_again_where_the_peer_dropped_the_connection(
        tmp_path: Path) -> None:
    blob = os.urandom(70_000)
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    chunked = b"".join(b"%x;ext=1\r\n%b\r\n" % (len(blob[at:at + 30_000]), blob[at:at + 30_000])
                       for at in range(0, len(blob), 30_000))
    answers = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\nX-Trailer: t\r\n\r\n",
               b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(blob), blob),
               b"HTTP/1.1 200 OK\r\n\r\n" + blob]  # no length: the body ends at the close
    with _peer(answers) as (base, served):
        lane = Lane(base)
        try:
            for turn in range(len(answers)):
                into = tmp_path / f"blob-{turn}"
                fetched = fetch_blob(f"{base}/blobs/{digest}", authorization="", digest=digest, size=len(blob),
                                     into=into, within_s=10.0, stop=threading.Event(), lane=lane)
                assert (fetched.status, fetched.read, fetched.kept) == (200, len(blob), True), turn
                assert into.read_bytes() == blob
        finally:
            lane.close()
    # The first connection was dropped after its answer without a word: the second request went again, on a new one.
    assert served == [0, 1, 2]

"""The JSON-line channel: sockets created private, peers checked by SO_PEERCRED, accept loops that end cleanly.

Peers of another uid are real processes running as `nobody` (setpriv); the tests run as root.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe import jsonline
from coldsnap_probe.errors import ChannelError

NOBODY = pwd.getpwnam("nobody")
AS_NOBODY = ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
# A client with nothing but the standard library (nobody cannot read the project's virtual environment).
CLIENT = """
import json, socket, sys
try:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(sys.argv[1])
        s.sendall(sys.argv[2].encode() + b"\\n")
        data = b"".join(iter(lambda: s.recv(65536), b""))
    print(data.decode().strip())
except OSError as exc:
    print(json.dumps({"os_error": exc.errno}))
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as nobody")


def ask_as_nobody(path: Path | str, message: str | dict[str, Any] = "status") -> dict[str, Any]:
    """`message` (an op, or a whole request) sent by a process running as nobody; the answer."""
    line = json.dumps({"op": message} if isinstance(message, str) else message)
    out = subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-c", CLIENT, str(path), line], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return dict(json.loads(out))


def echo(conn: socket.socket, peer: jsonline.Peer) -> jsonline.Answer:
    return {"ok": True, "echo": json.loads(jsonline.read_line(conn)), "uid": peer.uid}


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory nobody may reach (pytest's tmp_path lies under root's 0700 directories)."""
    path = Path(tempfile.mkdtemp(prefix="coldsnap-jsonline-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def serving(shared_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, jsonline.LineServer]]:
    peers, group = request.param if hasattr(request, "param") else (jsonline.Peers(), None)
    path = shared_dir / "control.sock"
    server = jsonline.LineServer(jsonline.listen(path, group=group), echo, peers=peers).start()
    try:
        yield path, server
    finally:
        server.close()
    assert not server._thread.is_alive()


def test_listen_creates_the_socket_0600_whatever_the_umask(tmp_path: Path) -> None:
    """Regression: #24 (finding 5): the hydration sockets were created with the umask's mode (0755)."""
    old = os.umask(0)
    try:
        with jsonline.listen(tmp_path / "a.sock"), jsonline.listen(tmp_path / "b.sock", group=NOBODY.pw_gid):
            a, b = os.lstat(tmp_path / "a.sock"), os.lstat(tmp_path / "b.sock")
    finally:
        os.umask(old)
    assert stat.S_IMODE(a.st_mode) == 0o600
    assert stat.S_IMODE(b.st_mode) == 0o660 and b.st_gid == NOBODY.pw_gid


def test_listen_replaces_a_stale_socket_and_refuses_anything_else(tmp_path: Path) -> None:
    path = tmp_path / "c.sock"
    with jsonline.listen(path):
        pass
    with jsonline.listen(path):  # the file the first one left behind
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    other = tmp_path / "file"
    other.write_text("keep")
    with pytest.raises(ChannelError, match="exists and is not a socket"):
        jsonline.listen(other)
    assert other.read_text() == "keep"


def test_a_socket_0600_is_unreachable_for_another_uid(serving: tuple[Path, jsonline.LineServer]) -> None:
    path, _server = serving
    assert ask_as_nobody(path) == {"os_error": 13}  # EACCES: the mode alone keeps it out
    assert jsonline.request(path, {"op": "status"}, timeout=10) == {"ok": True, "echo": {"op": "status"}, "uid": 0}


@pytest.mark.parametrize("serving", [(jsonline.Peers(), NOBODY.pw_gid)], indirect=True)
def test_a_peer_that_reaches_the_socket_is_still_refused_unless_admitted(
        serving: tuple[Path, jsonline.LineServer]) -> None:
    """Regression: #24 (finding 5): any process reaching the socket was answered (no SO_PEERCRED check)."""
    path, _server = serving
    answer = ask_as_nobody(path, "release")
    assert answer == {"ok": False, "error": f"peer uid {NOBODY.pw_uid} gid {NOBODY.pw_gid} is not allowed on "
                                            "this socket"}


@pytest.mark.parametrize("serving", [(jsonline.Peers(uids=frozenset({NOBODY.pw_uid})), NOBODY.pw_gid),
                                     (jsonline.Peers(gids=frozenset({NOBODY.pw_gid})), NOBODY.pw_gid)],
                         indirect=True, ids=["by-uid", "by-gid"])
def test_an_admitted_peer_of_another_uid_is_answered(serving: tuple[Path, jsonline.LineServer]) -> None:
    path, _server = serving
    assert ask_as_nobody(path) == {"ok": True, "echo": {"op": "status"}, "uid": NOBODY.pw_uid}


def test_close_ends_the_accept_loop_and_its_thread(tmp_path: Path) -> None:
    """Regression: #24 (the flaky test): an accept loop raised on its closed listener in a leftover thread."""
    errors: list[threading.ExceptHookArgs] = []
    previous, threading.excepthook = threading.excepthook, errors.append
    try:
        for idle in (None, lambda: None):  # blocking accept, and accept with a timeout
            path = tmp_path / "loop.sock"
            server = jsonline.LineServer(jsonline.listen(path), echo, peers=jsonline.Peers(), idle=idle,
                                         idle_every=0.05).start()
            assert jsonline.request(path, {"n": 1}, timeout=10)["ok"]
            server.close()
            assert not server._thread.is_alive()
    finally:
        threading.excepthook = previous
    assert errors == []


def test_run_returns_when_another_thread_closes_the_listener(tmp_path: Path) -> None:
    server = jsonline.LineServer(jsonline.listen(tmp_path / "r.sock"), echo, peers=jsonline.Peers())
    timer = threading.Timer(0.2, server.close)
    timer.start()
    server.run()  # returns instead of raising on the closed listener
    timer.join()


def test_a_silent_asker_does_not_stop_the_loop(tmp_path: Path) -> None:
    """A connection that never sends its request is dropped; the next asker is answered."""
    path = tmp_path / "control.sock"
    server = jsonline.LineServer(jsonline.listen(path), echo, peers=jsonline.Peers(), request_timeout=0.5).start()
    try:
        with socket.socket(socket.AF_UNIX) as silent, socket.socket(socket.AF_UNIX) as trickling:
            silent.connect(str(path))
            trickling.connect(str(path))
            trickling.send(b"{")  # then nothing more: the request's deadline covers it too
            assert jsonline.request(path, {"op": "status"}, timeout=10)["echo"] == {"op": "status"}
    finally:
        server.close()


def test_an_answer_that_raises_is_an_ok_false_reply(tmp_path: Path) -> None:
    def fails(conn: socket.socket, peer: jsonline.Peer) -> jsonline.Answer:
        raise ChannelError("no such thing")

    path = tmp_path / "f.sock"
    server = jsonline.LineServer(jsonline.listen(path), fails, peers=jsonline.Peers()).start()
    try:
        assert jsonline.request(path, {}) == {"ok": False, "error": "ChannelError: no such thing"}
    finally:
        server.close()


def test_request_to_nothing_names_the_channel(tmp_path: Path) -> None:
    with pytest.raises(ChannelError, match=f"channel {tmp_path}/absent.sock: "):
        jsonline.request(tmp_path / "absent.sock", {})


def _answering(tmp_path: Path, answer: Callable[[socket.socket], None]) -> tuple[str, threading.Thread]:
    """A peer (an engine's control socket, say) that reads one request line and answers with `answer`."""
    path = tmp_path / "peer.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        with listener, contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                jsonline.read_line(conn)
                answer(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return str(path), thread


def test_an_answer_without_end_is_cut_off_at_its_bound(tmp_path: Path) -> None:
    def flood(conn: socket.socket) -> None:
        conn.sendall(b'{"ok": true, "x": "')
        block = b"x" * (1 << 20)
        for _ in range((jsonline.MAX_ANSWER >> 20) + 8):
            conn.sendall(block)

    path, thread = _answering(tmp_path, flood)
    with pytest.raises(ChannelError, match="answer over"):
        jsonline.request(path, {"op": "status"}, timeout=60.0)
    thread.join(10)


def test_a_trickled_answer_is_held_to_the_whole_timeout_not_each_read(tmp_path: Path) -> None:
    def trickle(conn: socket.socket) -> None:  # a byte every 0.2 s: each read returns well within 1 s
        for byte in b'{"ok": true, "pid": 42, "trickled": "........................"}':
            conn.sendall(bytes([byte]))
            time.sleep(0.2)

    path, thread = _answering(tmp_path, trickle)
    with pytest.raises(ChannelError, match="timed out"):
        jsonline.request(path, {"op": "status"}, timeout=1.0)
    thread.join(30)


# A peer that opens two connections and says nothing on them; told to go on (a line on stdin), it closes the first,
# asks on the second and prints the answer.
SILENT = """
import socket, sys
first, second = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
first.connect(sys.argv[1])
second.connect(sys.argv[1])
print("connected", flush=True)
sys.stdin.readline()
first.close()
second.sendall(b'{"op": "after"}\\n')
second.settimeout(20)
print(b"".join(iter(lambda: second.recv(65536), b"")).decode().strip(), flush=True)
"""


def test_a_tenant_holding_silent_connections_keeps_at_most_its_share_of_the_threads(shared_dir: Path) -> None:
    """Regression (review4): one admitted uid could open as many silent connections as the server had threads
    (each within its request deadline, again and again) and every other peer waited in the backlog behind them.
    With `per_uid`, a uid's connections beyond its cap wait for its own to end, holding no thread: the others
    are answered meanwhile, and the waiting one is answered once the uid's first ends."""
    path = shared_dir / "capped.sock"
    server = jsonline.LineServer(jsonline.listen(path, group=NOBODY.pw_gid), echo, threads=2, per_uid=1,
                                 request_timeout=60.0, peers=jsonline.Peers(uids=frozenset({NOBODY.pw_uid}))).start()
    silent = subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-c", SILENT, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert silent.stdout is not None and silent.stdin is not None
        assert silent.stdout.readline().strip() == "connected"
        # within a tenth of the silent connections' deadline: without the cap both threads would be theirs
        for _ in range(3):
            assert jsonline.request(path, {"op": "status"}, timeout=6.0) == {
                "ok": True, "echo": {"op": "status"}, "uid": 0}
        silent.stdin.write("\n")
        silent.stdin.flush()
        assert json.loads(silent.stdout.readline()) == {"ok": True, "echo": {"op": "after"}, "uid": NOBODY.pw_uid}
    finally:
        silent.kill()
        silent.wait()
        server.close()
    assert not server._thread.is_alive() and not server._parked and not server._by_uid


# --- a request whose descriptors ride with its first bytes (the node hydrator's hydrate) --------------------------

def _pipe_with(data: bytes) -> int:
    """The read end of a pipe holding `data` (a descriptor whose identity the receiver can check by reading)."""
    read, write = os.pipe()
    os.write(write, data)
    os.close(write)
    return read


def test_a_request_with_its_descriptor_is_read_whole_and_the_descriptor_works() -> None:
    asker, server = socket.socketpair()
    with asker, server:
        fd = _pipe_with(b"through the socket")
        line = json.dumps({"op": "hydrate", "regions": ["x" * 300_000]}).encode() + b"\n"
        # A line longer than the socket's buffer: the rest follows the descriptor's message while it is read.
        sender = threading.Thread(target=jsonline.send, args=(asker, line, [fd]), daemon=True)
        sender.start()
        server.settimeout(5.0)
        try:
            message, fds = jsonline.read_request_with_fds(server, 1)
        finally:
            sender.join(10)
            os.close(fd)
        try:
            assert message["op"] == "hydrate" and len(message["regions"][0]) == 300_000
            assert len(fds) == 1 and os.read(fds[0], 100) == b"through the socket"
            assert server.gettimeout() == 5.0  # the answer's sends get the connection's whole timeout again
        finally:
            for received in fds:
                os.close(received)


@pytest.mark.parametrize(("payload", "count", "error"), [
    (b'{"op": "hydrate"}\n', 2, "at most 1 descriptor"),  # the kernel closed the extra one: refused, not used
    (b'["op", "hydrate"]\n', 1, "not one JSON object"),
    (b'{"op": \n', 1, "not JSON"),
])
def test_a_bad_request_with_descriptors_is_refused_and_leaks_none(payload: bytes, count: int, error: str) -> None:
    asker, server = socket.socketpair()
    with asker, server:
        sent = [_pipe_with(b"") for _ in range(count)]
        try:
            jsonline.send(asker, payload, sent)
            asker.shutdown(socket.SHUT_WR)
        finally:
            for fd in sent:
                os.close(fd)
        server.settimeout(5.0)
        before = sorted(os.listdir("/proc/self/fd"))
        with pytest.raises(ChannelError, match=error):
            jsonline.read_request_with_fds(server, 1)
        assert sorted(os.listdir("/proc/self/fd")) == before


def test_a_trickled_request_with_a_descriptor_is_held_to_one_deadline() -> None:
    """The wait for the first bytes and the rest of the line share the connection's timeout: a peer sending a byte
    at a time cannot hold the server's thread longer than a silent one."""
    asker, server = socket.socketpair()
    with asker, server:
        fd = _pipe_with(b"")
        try:
            jsonline.send(asker, b"{", [fd])
        finally:
            os.close(fd)

        def trickle() -> None:
            with contextlib.suppress(OSError):
                for byte in b'"op": "hydrate", "pad": "........................"}\n':
                    asker.send(bytes([byte]))
                    time.sleep(0.2)

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        server.settimeout(1.0)
        before = sorted(os.listdir("/proc/self/fd"))
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            jsonline.read_request_with_fds(server, 1)
        assert time.monotonic() - started < 2.0
        assert sorted(os.listdir("/proc/self/fd")) == before
        asker.shutdown(socket.SHUT_RDWR)
        thread.join(20)

"""coldsnap_probe._quiesce, what a capture of a server we do not control checks first (issue 23), on real
processes and sockets:
an open request is waited for within a bound and then refused by name; an io_uring holder is refused."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from coldsnap_probe._quiesce import event_loops as _event_loops
from coldsnap_probe._quiesce import open_connections as _open_connections
from coldsnap_probe._quiesce import wait_idle as _wait_idle
from coldsnap_probe.errors import WorkerError

# A child that connects to PORT, says so, and holds the connection until its stdin closes.
CLIENT = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    print(s.getsockname()[1], flush=True)
    sys.stdin.read()
""")
# A child that sets up an io_uring instance and maps its submission ring (what libuv does), then waits.
IO_URING = textwrap.dedent("""
    import ctypes, mmap, sys
    libc = ctypes.CDLL(None, use_errno=True)
    params = (ctypes.c_uint8 * 120)()
    fd = libc.syscall(425, 4, params)  # io_uring_setup
    if fd < 0:
        print("unsupported", ctypes.get_errno(), flush=True)
        sys.exit(0)
    ring = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
    print("ready", flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server
    server.close()


def _child(program: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", program, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def test_open_connection_is_named_then_refused_after_the_bound(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    child = _child(CLIENT, str(port))
    try:
        local = int(child.stdout.readline()) if child.stdout else 0
        accepted, _ = listener.accept()
        found = _open_connections([child.pid])
        assert found == [f"process {child.pid} fd 3 127.0.0.1:{local} <- 127.0.0.1:{port}"]
        started = time.monotonic()
        with pytest.raises(WorkerError) as caught:
            _wait_idle([child.pid], 0.3)
        assert time.monotonic() - started >= 0.3
        assert "capture refused: the server still has 1 open connection(s) after waiting 0.3 s" in str(caught.value)
        assert f"127.0.0.1:{local} <- 127.0.0.1:{port}" in str(caught.value)
        accepted.close()
    finally:
        child.communicate("", timeout=10)


def test_wait_idle_returns_once_the_request_ends_within_the_bound(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    child = _child(CLIENT, str(port))
    try:
        assert child.stdout is not None and child.stdout.readline()
        accepted, _ = listener.accept()
        assert child.stdin is not None
        ends = threading.Timer(0.3, child.stdin.close)  # the request finishes 0.3 s in: the client leaves
        ends.start()
        started = time.monotonic()
        _wait_idle([child.pid], 5.0)
        assert 0.3 <= time.monotonic() - started < 5.0
        accepted.close()
    finally:
        child.wait(timeout=10)


def test_a_process_without_connections_or_io_uring_passes() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _open_connections([child.pid]) == []
        _wait_idle([child.pid], 0.0)
        assert _event_loops([child.pid]) == {}  # nor uvloop
    finally:
        child.kill()
        child.wait()


def test_io_uring_holder_is_refused_by_name() -> None:
    child = _child(IO_URING)
    try:
        first = child.stdout.readline().strip() if child.stdout else ""
        if first.startswith("unsupported"):
            pytest.skip(f"io_uring is not available here ({first})")
        assert first == "ready"
        with pytest.raises(WorkerError, match=f"process {child.pid} holds an io_uring instance"):
            _event_loops([child.pid])
    finally:
        child.communicate("", timeout=10)

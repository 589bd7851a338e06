"""engines/forking_server.py, the server that forks workers (issue 23's fault case), on the CPU: every worker
answers on the one listening socket, a dead worker stops the server, and the project's worker captures the whole
tree with CRIU and restores it with every worker answering again, same PIDs, state kept.

The CRIU cases need root and a CRIU: COLDSNAP_TEST_CRIU names one, else `scripts/criu/build --print-dir` (the
parallel-restore build), and they skip only when neither is there. The GPU form (`--cuda`, through the daemon, in
a capsule) is `bench/serve_faults.py`'s forked-workers case on the H200."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe import image_digest
from engines.forking_server import ForkingServerError, ask_workers
from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT

SERVER = ROOT / "engines/forking_server.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gone(pids: list[int], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """Three workers on a free port, a session leader with stdio on /dev/null (what CRIU can dump)."""
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), "serve", "--port", str(port), "--workers", "3"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    yield process, port
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the server and its workers (its own process group)
    process.wait()


def test_every_worker_answers_on_the_one_listening_socket(server: tuple[subprocess.Popen[bytes], int]) -> None:
    process, port = server
    answers = ask_workers("127.0.0.1", port, 3, limit_s=30)
    assert sorted(answers) == [0, 1, 2]
    assert len({a["pid"] for a in answers.values()}) == 3
    assert {a["parent"] for a in answers.values()} == {process.pid}
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert sorted(int(c) for c in children) == sorted(a["pid"] for a in answers.values())
    assert not [fd for fd in os.listdir(f"/proc/{process.pid}/fd")
                if os.readlink(f"/proc/{process.pid}/fd/{fd}").startswith("socket:")]  # only the workers listen


def test_a_request_other_than_get_root_is_answered_404(server: tuple[subprocess.Popen[bytes], int]) -> None:
    _, port = server
    ask_workers("127.0.0.1", port, 3, limit_s=30)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"POST /other HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 404 Not Found\r\n")


def test_a_dead_worker_stops_the_server_and_its_other_workers(server: tuple[subprocess.Popen[bytes], int]) -> None:
    process, port = server
    pids = [a["pid"] for a in ask_workers("127.0.0.1", port, 3, limit_s=30).values()]
    os.kill(pids[1], signal.SIGKILL)
    assert process.wait(timeout=20) == 1
    assert _gone(pids)


def test_a_killed_supervisor_takes_its_workers_with_it(server: tuple[subprocess.Popen[bytes], int]) -> None:
    process, port = server
    pids = [a["pid"] for a in ask_workers("127.0.0.1", port, 3, limit_s=30).values()]
    process.kill()  # SIGKILL: the parent stops nobody
    process.wait()
    assert _gone(pids)


def test_sigterm_stops_every_worker_and_exits_0(server: tuple[subprocess.Popen[bytes], int]) -> None:
    process, port = server
    pids = [a["pid"] for a in ask_workers("127.0.0.1", port, 3, limit_s=30).values()]
    process.terminate()
    assert process.wait(timeout=20) == 0
    assert _gone(pids)


def test_asking_a_closed_port_names_the_workers_that_never_answered() -> None:
    started = time.monotonic()
    with pytest.raises(ForkingServerError, match=r"workers \[0, 1\] of 2 never answered .* within 0.5 s "
                                                 r"\(last: ConnectionRefusedError"):
        ask_workers("127.0.0.1", _free_port(), 2, limit_s=0.5)
    assert time.monotonic() - started < 10


@pytest.fixture
def criu_env(tmp_path: Path) -> Iterator[str]:
    if CRIU is None:
        pytest.skip("needs root and a CRIU (COLDSNAP_TEST_CRIU or scripts/criu/build)")
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


def _worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True, cwd=ROOT,
                          check=False, timeout=240)


def test_the_forked_tree_is_captured_and_every_worker_answers_after_restore(
        server: tuple[subprocess.Popen[bytes], int], criu_env: str, tmp_path: Path) -> None:
    process, port = server
    before = ask_workers("127.0.0.1", port, 3, limit_s=30)
    images = tmp_path / "images"
    captured = _worker("capture", "--pid", str(process.pid), "--images", str(images), "--boundary", "n580",
                       "--criu", criu_env)
    assert captured.returncode == 0, captured.stderr
    process.wait(timeout=20)  # CRIU ended the tree: reaped, so its PIDs are free for the restore
    pids = [a["pid"] for a in before.values()]
    assert _gone(pids)
    with pytest.raises(ForkingServerError):  # nothing listens between capture and restore
        ask_workers("127.0.0.1", port, 3, limit_s=0.3)
    digest = image_digest(images, contents=True)
    restored = _worker("restore", "--images", str(images), "--criu", criu_env, "--work-dir", str(tmp_path / "work"))
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["restored_pid"] == process.pid
    try:
        after = ask_workers("127.0.0.1", port, 3, limit_s=30)
        assert {k: (a["pid"], a["parent"]) for k, a in after.items()} == {
            k: (a["pid"], a["parent"]) for k, a in before.items()}
        assert all(after[k]["served"] > before[k]["served"] for k in after)  # each worker's own state went on
    finally:
        os.kill(process.pid, signal.SIGTERM)
    assert _gone([process.pid, *pids])
    assert image_digest(images, contents=True) == digest

"""The interposer's control socket under peers that misbehave, without a GPU: a silent peer, one that trickles
its request a byte at a time, an oversized line and a crowd of connections are each dropped or refused within the
request deadline, while `status` and the worker's requests still get answers; a release or hydration runs alone
(a second is refused naming it) and `status` answers while it runs; no descriptor or thread is left behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe.jsonline import request
from tests.probe.test_interposer import library, read_answer, wait_listening

__all__ = ("library",)  # the module fixture, shared

# The stand-in marks that a call is inside it (the interposer counted it in flight on the way in), then sleeps.
SLOW_DRIVER = ("#include <fcntl.h>\n#include <stdlib.h>\n#include <unistd.h>\n"
               "int cuStreamSynchronize(void *stream) { (void)stream; const char *mark = getenv(\"STANDIN_MARK\");\n"
               "    if (mark) close(open(mark, O_CREAT | O_WRONLY, 0600));\n    sleep(4); return 0; }\n")
ENGINE = ("import ctypes, os, sys, threading, time\n"
          "if sys.argv[1] == 'busy':  # an engine thread inside a synchronise for 4 s (a release must drain it)\n"
          "    threading.Thread(target=ctypes.CDLL(None).cuStreamSynchronize, args=(None,), daemon=True).start()\n"
          "if sys.argv[1] == 'fork' and os.fork() == 0:  # a prefork worker that ends normally (exit(), destructors)\n"
          "    sys.exit(0)\n"
          "time.sleep(120)\n")


@contextlib.contextmanager
def engine(library: Path, mode: str = "idle") -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A process under the interposer, listening from its start, with a 1 s request deadline and a 2 s drain;
    `busy`: one of its threads is inside a (stand-in) driver's cuStreamSynchronize for 4 s."""
    folder = Path(tempfile.mkdtemp(prefix="cs-control-", dir="/tmp"))
    source = folder / "standin.c"
    source.write_text(SLOW_DRIVER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(source)], check=True)
    env = {**os.environ, "LD_PRELOAD": str(library), "LD_LIBRARY_PATH": str(folder),
           "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(folder / "cuda-%p.sock"), "COLDSNAP_CUDA_INTERPOSER_LISTEN": "load",
           "COLDSNAP_CUDA_INTERPOSER_REQUEST_S": "1", "COLDSNAP_CUDA_INTERPOSER_DRAIN_S": "2",
           "STANDIN_MARK": str(folder / "inside")}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, mode], env=env)
    path = str(folder / f"cuda-{proc.pid}.sock")
    wait_listening(path)
    if mode == "busy":  # its thread is inside the synchronise (a loaded machine may take seconds to get there)
        deadline = time.monotonic() + 30
        while not (folder / "inside").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        time.sleep(0.3)
    try:
        yield proc, path
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def timed_status(path: str) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    answer = request(path, {"op": "status"}, timeout=10)
    return answer, time.monotonic() - started


def resources(pid: int) -> tuple[int, int]:
    """The process's open descriptors and threads."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def settled(pid: int, baseline: tuple[int, int], within: float = 5.0) -> tuple[int, int]:
    give_up = time.monotonic() + within
    while (now := resources(pid)) != baseline and time.monotonic() < give_up:
        time.sleep(0.05)
    return now


def test_a_silent_peer_holds_up_nobody_and_is_dropped_at_the_deadline(library: Path) -> None:
    """Regression (issue 22): one connection at a time, so a peer that connected and said nothing kept `status`
    and the worker's release waiting for its 30 s receive timeout."""
    with engine(library) as (proc, path), socket.socket(socket.AF_UNIX) as silent:
        baseline = resources(proc.pid)
        silent.settimeout(10)
        silent.connect(path)
        started = time.monotonic()
        answer, seconds = timed_status(path)
        assert answer["ok"] is True and seconds < 0.5 and answer["request_s"] == 1
        dropped = read_answer(silent)
        assert dropped == {"ok": False, "error": "request: not one newline-terminated line"}
        assert 0.9 < time.monotonic() - started < 3.0
        assert settled(proc.pid, baseline) == baseline


def test_a_peer_trickling_its_request_is_cut_at_the_deadline_not_at_each_bytes_timeout(library: Path) -> None:
    """Slow loris: a byte every 0.2 s keeps a per-receive timeout from ever firing; the deadline is the whole
    request's."""
    with engine(library) as (proc, path), socket.socket(socket.AF_UNIX) as slow:
        baseline = resources(proc.pid)
        slow.settimeout(10)
        slow.connect(path)
        started = time.monotonic()
        sent = 0
        with contextlib.suppress(OSError):  # the interposer stops reading: a send may fail once it answered
            for byte in b'{"op": "status"' + b" " * 100:
                slow.send(bytes([byte]))
                sent += 1
                time.sleep(0.2)
                if time.monotonic() - started > 4:
                    break
        assert read_answer(slow)["error"] == "request: not one newline-terminated line"
        assert time.monotonic() - started < 3.5 and sent < 20
        assert settled(proc.pid, baseline) == baseline


def test_an_oversized_line_is_refused_and_the_socket_serves_on(library: Path) -> None:
    with engine(library) as (proc, path), socket.socket(socket.AF_UNIX) as big:
        baseline = resources(proc.pid)
        big.settimeout(10)
        big.connect(path)
        with contextlib.suppress(OSError):
            big.sendall(b"{" + b" " * (1 << 17))
        assert read_answer(big) == {"ok": False, "error": "request: longer than 65536 bytes"}
        assert request(path, {"op": "status"})["ok"] is True
        assert settled(proc.pid, baseline) == baseline


def test_a_crowd_of_connections_is_served_eight_at_a_time_and_leaves_nothing_behind(library: Path) -> None:
    """20 connections at once, saying nothing: at most 8 connection threads at a time, the others wait in the
    backlog for a slot (each is dropped at its deadline, none refused nor reset); then every descriptor and thread
    is gone and status answers."""
    with engine(library) as (proc, path):
        baseline = resources(proc.pid)
        crowd = [socket.socket(socket.AF_UNIX) for _ in range(20)]
        threads = []
        try:
            for sock in crowd:
                sock.settimeout(15)
                sock.connect(path)
            answers: list[str] = []
            reader = threading.Thread(target=lambda: answers.extend(read_answer(s)["error"] for s in crowd))
            reader.start()
            while reader.is_alive():
                threads.append(resources(proc.pid)[1])
                time.sleep(0.05)
        finally:
            for sock in crowd:
                sock.close()
        assert answers == ["request: not one newline-terminated line"] * 20
        assert max(threads) <= baseline[1] + 8
        assert request(path, {"op": "status"})["ok"] is True
        assert settled(proc.pid, baseline) == baseline


def test_status_answers_during_a_release_and_a_second_release_is_refused_naming_it(library: Path,
                                                                                    tmp_path: Path) -> None:
    """Regression (issue 22): a release that waits for an engine call inside the driver (here 2 s, its drain
    limit) held the socket, so `status` waited for it; now status answers at once and says what runs, and a
    second release is refused naming the first, which then ends as before (refused, the gate open)."""
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    with engine(library, "busy") as (_proc, path):
        first: dict[str, Any] = {}
        releasing = threading.Thread(target=lambda: first.update(
            request(path, {"op": "release", "dir": str(dump)}, timeout=20)))
        releasing.start()
        time.sleep(0.3)
        answer, seconds = timed_status(path)
        second = request(path, {"op": "release", "dir": str(dump)}, timeout=10)
        releasing.join(20)
        assert seconds < 0.5 and answer["operation"] == "release" and answer["released"] is False
        assert second["ok"] is False and second["error"].startswith("release: a release is in progress (for ")
        assert first["ok"] is False and "stayed inside the driver for 2 s" in first["error"]
        after = request(path, {"op": "status"})
        assert after["operation"] is None and after["gate"] == "open" and list(dump.iterdir()) == []


def test_a_hydrate_during_a_release_waits_for_it_and_then_runs(library: Path, tmp_path: Path) -> None:
    """A capture's rollback asks `hydrate` after giving up on a slow `release`: it must run once the release ended
    (as when connections were served one at a time), not be refused while the memory stays released."""
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    with engine(library, "busy") as (_proc, path):
        released: dict[str, Any] = {}
        releasing = threading.Thread(target=lambda: released.update(
            request(path, {"op": "release", "dir": str(dump)}, timeout=20)))
        releasing.start()
        time.sleep(0.3)
        started = time.monotonic()
        hydrated = request(path, {"op": "hydrate", "dir": str(dump)}, timeout=20)
        waited = time.monotonic() - started
        releasing.join(20)
        assert "stayed inside the driver for 2 s" in released["error"]  # the release gave up after its 2 s drain
        assert hydrated == {"ok": False, "error": "hydrate: nothing is released"}  # then the hydrate ran
        assert 1.3 < waited < 5  # for the rest of the release, not refused at once


@pytest.mark.parametrize("payload", [b"", b"\n", b"{\"op\": \"status\"}"])
def test_a_peer_that_hangs_up_early_leaves_nothing_behind(library: Path, payload: bytes) -> None:
    with engine(library) as (proc, path):
        baseline = resources(proc.pid)
        for _ in range(20):
            with socket.socket(socket.AF_UNIX) as sock, contextlib.suppress(BrokenPipeError):
                sock.connect(path)
                sock.sendall(payload)  # a peer told that every slot is busy may find the socket closed
        give_up = time.monotonic() + 5
        while not (answer := request(path, {"op": "status"}))["ok"] and time.monotonic() < give_up:
            time.sleep(0.1)  # every slot may still be busy with the ones that hung up: told so, never reset
        assert answer["ok"] is True, answer
        assert settled(proc.pid, baseline) == baseline


def test_peers_crowding_the_socket_with_descriptors_share_one_hydrates_worth(library: Path, tmp_path: Path) -> None:
    """Regression (review3): each connection could hold 4096 descriptors while its pages came (the cap was per
    request), so eight connections announcing a hydrate took 32768 slots of the engine's descriptor table (its
    own opens then fail with EMFILE). Now all connections together hold at most 4096; the one that could not keep
    its descriptors is refused, and every descriptor is closed."""
    marker = tmp_path / "marker"
    marker.write_bytes(b"")
    fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
    line = b'{"op": "hydrate", "dir": "/nonexistent/dump", "allocations": "4096"}\n'
    with engine(library) as (proc, path):
        baseline = resources(proc.pid)
        socks = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        peak = 0
        try:
            for sock in socks:
                sock.settimeout(10)
                sock.connect(path)
                sock.sendall(line)
            for _page in range(255):  # 4080 each: both wait for their last page until the 1 s deadline
                for sock in socks:
                    socket.send_fds(sock, [b"."], [fd] * 16)
            give_up = time.monotonic() + 0.8
            while time.monotonic() < give_up:
                peak = max(peak, resources(proc.pid)[0])
                time.sleep(0.01)
            answers = [read_answer(sock)["error"] for sock in socks]
        finally:
            os.close(fd)
            for sock in socks:
                sock.close()
        assert peak <= baseline[0] + 4096 + 8, peak - baseline[0]
        # each counted what it sent (kept or closed at once), and waited for the rest within its deadline
        assert [a.startswith("hydrate: 4080 of the 4096 announced descriptors arrived") for a in answers] == \
            [True, True], answers
        assert settled(proc.pid, baseline) == baseline


def test_a_forked_child_that_exits_normally_leaves_its_parents_socket(library: Path) -> None:
    """Regression (review3): a child forked without exec inherited `started` and the socket's path, and its
    normal exit (the library's destructor) unlinked its parent's socket: the worker could then neither release
    nor hydrate the engine."""
    with engine(library, "fork") as (proc, path):
        time.sleep(0.5)  # the child has exited (it was forked before the engine slept)
        assert os.path.exists(path)
        assert request(path, {"op": "status"}, timeout=10)["pid"] == proc.pid

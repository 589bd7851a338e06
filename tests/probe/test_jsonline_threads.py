"""A LineServer answering connections on threads of their own (`threads=`): real sockets, real threads, an
`answer` that holds its connection until the test lets it go. A silent or slow peer holds only its own thread;
at most `threads` are answered at once (more wait in the backlog); a failing answer fails that peer only; one
thread (the default) still answers one connection at a time."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe import jsonline
from coldsnap_probe.errors import ChannelError

WAIT = 20.0  # seconds a test waits for something that should happen at once (a bound, never a measurement)


class Holding:
    """An `answer` that, for a request with "hold": true, stays in its thread until `release` is set; counts
    how many answers run at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = self.entered = 0
        self.threads: set[str] = set()  # the names of the threads that answered

    def __call__(self, conn: socket.socket, peer: jsonline.Peer) -> jsonline.Answer:
        message = jsonline.read_request(conn)
        with self.lock:
            self.running += 1
            self.entered += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            if message.get("fail"):
                raise ChannelError("this request fails")
            if message.get("hold") and not self.release.wait(WAIT):
                raise AssertionError("never released")
            return {"ok": True, "n": message.get("n")}
        finally:
            with self.lock:
                self.running -= 1

    def wait_entered(self, count: int) -> None:
        deadline = time.monotonic() + WAIT
        while self.entered < count:
            assert time.monotonic() < deadline, f"{self.entered} of {count} answers started"
            time.sleep(0.01)


@contextlib.contextmanager
def serving(tmp_path: Path, answer: Holding, **options: Any) -> Iterator[Path]:
    path = tmp_path / "threads.sock"
    server = jsonline.LineServer(jsonline.listen(path), answer, peers=jsonline.Peers(), **options).start()
    try:
        yield path
    finally:
        answer.release.set()
        server.close()
        assert not server._thread.is_alive() and not server._serving  # close joined every connection's thread


def ask_in_thread(path: Path, message: dict[str, Any], answers: list[dict[str, Any]]) -> threading.Thread:
    thread = threading.Thread(target=lambda: answers.append(jsonline.request(path, message, timeout=WAIT)))
    thread.start()
    return thread


def test_a_peer_held_in_its_answer_does_not_delay_another_peers_answer(tmp_path: Path) -> None:
    answer = Holding()
    with serving(tmp_path, answer, threads=4) as path:
        held: list[dict[str, Any]] = []
        slow = ask_in_thread(path, {"hold": True, "n": 1}, held)
        answer.wait_entered(1)
        assert jsonline.request(path, {"n": 2}, timeout=WAIT) == {"ok": True, "n": 2}
        assert held == []  # the first is still being answered
        answer.release.set()
        slow.join(WAIT)
        assert held == [{"ok": True, "n": 1}]


def test_a_silent_peer_holds_only_its_own_thread_until_its_deadline(tmp_path: Path) -> None:
    """Regression (threat model's known gap): one connection at a time let a silent peer hold every other
    peer for the whole request deadline (30 s)."""
    answer = Holding()
    with serving(tmp_path, answer, threads=2, request_timeout=60.0) as path, \
            socket.socket(socket.AF_UNIX) as silent:
        silent.connect(str(path))
        # within a tenth of the silent peer's deadline: a one-at-a-time server would still be waiting on it
        assert jsonline.request(path, {"n": 3}, timeout=6.0) == {"ok": True, "n": 3}


def test_at_most_threads_answers_run_at_once_and_the_rest_wait_in_the_backlog(tmp_path: Path) -> None:
    answer = Holding()
    with serving(tmp_path, answer, threads=3) as path:
        answers: list[dict[str, Any]] = []
        askers = [ask_in_thread(path, {"hold": True, "n": n}, answers) for n in range(5)]
        answer.wait_entered(3)
        time.sleep(0.5)  # room for a fourth to start, were the bound not kept
        assert (answer.entered, answer.running) == (3, 3)
        answer.release.set()
        for asker in askers:
            asker.join(WAIT)
        assert sorted(a["n"] for a in answers) == list(range(5)) and answer.most == 3
        assert answer.threads == {"coldsnap-jsonline-conn"}


def test_a_failing_answer_fails_only_its_own_peer(tmp_path: Path) -> None:
    answer = Holding()
    with serving(tmp_path, answer, threads=2) as path:
        held: list[dict[str, Any]] = []
        other = ask_in_thread(path, {"hold": True, "n": 4}, held)
        answer.wait_entered(1)
        assert jsonline.request(path, {"fail": True}, timeout=WAIT) == {"ok": False,
                                                                        "error": "ChannelError: this request fails"}
        answer.release.set()
        other.join(WAIT)
        assert held == [{"ok": True, "n": 4}]
        assert jsonline.request(path, {"n": 5}, timeout=WAIT) == {"ok": True, "n": 5}


def test_one_thread_answers_one_connection_at_a_time_on_the_accept_thread(tmp_path: Path) -> None:
    """The default, for owners whose answer must not run twice at once (an engine's arena control) or uses its
    thread's state (the engines' current CUDA context, torch's stream and grad mode): the accept thread answers."""
    answer = Holding()
    with serving(tmp_path, answer) as path:
        answers: list[dict[str, Any]] = []
        askers = [ask_in_thread(path, {"hold": True, "n": n}, answers) for n in range(2)]
        answer.wait_entered(1)
        time.sleep(0.3)
        assert answer.entered == 1
        answer.release.set()
        for asker in askers:
            asker.join(WAIT)
        assert len(answers) == 2 and answer.most == 1 and answer.threads == {"coldsnap-jsonline"}


def test_idle_runs_while_a_connection_is_answered(tmp_path: Path) -> None:
    """The hydrator's expiry: it must not wait for a long answer (a stage of many GiB)."""
    answer, ticks = Holding(), threading.Event()
    with serving(tmp_path, answer, threads=2, idle=ticks.set, idle_every=0.05) as path:
        held: list[dict[str, Any]] = []
        slow = ask_in_thread(path, {"hold": True, "n": 6}, held)
        answer.wait_entered(1)
        ticks.clear()
        assert ticks.wait(WAIT) and held == []
        answer.release.set()
        slow.join(WAIT)
        assert json.dumps(held) == json.dumps([{"ok": True, "n": 6}])


def test_a_server_of_no_threads_is_refused(tmp_path: Path) -> None:
    with jsonline.listen(tmp_path / "none.sock") as listener, \
            pytest.raises(ChannelError, match="at least one thread, not 0"):
        jsonline.LineServer(listener, Holding(), peers=jsonline.Peers(), threads=0)


def test_a_peer_trickling_after_its_answer_is_cut_off_and_the_next_is_answered(tmp_path: Path) -> None:
    """Regression (review4): after the answer the server read what its asker still sent until it closed, one
    second per read and up to MAX_REQUEST bytes, so a byte every half second held the thread for days (with
    `threads` such peers, every thread); the whole drain now has one short deadline."""
    answer = Holding()
    with serving(tmp_path, answer) as path, socket.socket(socket.AF_UNIX) as trickler:
        trickler.connect(str(path))
        trickler.sendall(b'{"n": 7}\n')
        assert trickler.recv(4096).startswith(b'{"ok": true')
        answers: list[Any] = []

        def ask() -> None:
            try:
                answers.append(jsonline.request(path, {"n": 8}, timeout=8.0))
            except ChannelError as exc:  # the bound below: still held by the trickler
                answers.append(str(exc))

        other = threading.Thread(target=ask)
        other.start()
        while other.is_alive():
            try:
                trickler.send(b" ")  # never the end the drain waits for
            except OSError:
                break  # the server closed its side: the drain is over
            other.join(0.5)
        other.join(WAIT)
        assert answers == [{"ok": True, "n": 8}]
    with jsonline.listen(tmp_path / "uncapped.sock") as listener, \
            pytest.raises(ChannelError, match="per_uid must be at least one connection, not 0"):
        jsonline.LineServer(listener, Holding(), peers=jsonline.Peers(), threads=2, per_uid=0)

"""The real node hydrator serving its peers at once (GPU hosts only; scripts/device gpu-tests runs these): a peer's
`status`, its other stages and a silent connection do not wait for another's large `stage-dump`; a stage being
filled is neither adoptable nor replaceable; two concurrent stages of one uid cannot together pass its quota;
of concurrent adopts and discards of one ticket exactly one wins.

The large dumps are sparse files (holes read as zeros), so they take no disk, only the copy's time."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.probe.test_main import has_nvidia_driver

pytestmark = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")

MIB, GIB = 1 << 20, 1 << 30
WAIT = 120.0  # a bound on what should happen far sooner, never a measurement


def key(n: int) -> str:
    return "sha256:" + hashlib.sha256(f"hydr-{n}".encode()).hexdigest()


def sparse(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        f.truncate(size)
    return path


@contextlib.contextmanager
def hydrator(tmp_path: Path, *options: str) -> Iterator[tuple[str, str]]:
    """A hydrator process with staging on; its socket and GPU's UUID."""
    from tests.helpers import ROOT

    control = str(tmp_path / "hydrator.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--stage-ttl", "60", *options], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        yield control, str(ready["device_uuid"])
    finally:
        proc.kill()
        proc.wait()


def ask(control: str, message: dict[str, Any]) -> dict[str, Any]:
    from coldsnap_probe.jsonline import request

    return request(control, message, timeout=WAIT)


def stage_dump(control: str, uuid: str, n: int, part: Path, size: int) -> dict[str, Any]:
    return ask(control, {"op": "stage-dump", "key": key(n), "device_uuid": uuid,
                         "parts": [{"file": str(part), "bytes": size, "region": 0}]})


def in_thread(results: list[dict[str, Any]], call: Any, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(call(*args)))
    thread.start()
    return thread


def test_peers_are_answered_while_another_peers_large_stage_fills(tmp_path: Path) -> None:
    """Regression (threat model's known gap): the hydrator answered one connection at a time, so every peer
    waited for a 64 GiB stage-dump (about 2 s) or a silent peer's request deadline (30 s)."""
    big, small = sparse(tmp_path / "big.bin", 32 * GIB), tmp_path / "small.bin"
    small.write_bytes(os.urandom(4 * MIB))
    with hydrator(tmp_path) as (control, uuid), socket.socket(socket.AF_UNIX) as silent:
        silent.connect(control)  # says nothing: holds one of the hydrator's threads until its deadline
        big_answer: list[dict[str, Any]] = []
        filling = in_thread(big_answer, stage_dump, control, uuid, 1, big, 32 * GIB)
        wait_filling(control, 1, big_answer)  # status answered while it fills
        again = stage_dump(control, uuid, 1, small, 4 * MIB)  # the same slot, while it fills: refused
        assert not again["ok"] and "is being staged for uid" in str(again["error"]), again
        other = stage_dump(control, uuid, 2, small, 4 * MIB)  # another key of the same uid: staged at once
        assert other["ok"], other
        assert ask(control, {"op": "discard", "key": key(2), "ticket": other["ticket"]})["discarded"] is True
        filling.join(WAIT)
        assert big_answer and big_answer[0]["ok"] and big_answer[0]["bytes"] == 32 * GIB, big_answer
        staged = ask(control, {"op": "status"})["staged"]
        assert [(s["key"], s["filling"]) for s in staged] == [(key(1), False)]
        assert ask(control, {"op": "discard", "key": key(1), "ticket": big_answer[0]["ticket"]})["discarded"]


def wait_filling(control: str, n: int, done: list[dict[str, Any]]) -> None:
    """Until `status` lists stage `n` as being filled (answered while it fills)."""
    deadline = time.monotonic() + WAIT
    while not any(s["key"] == key(n) and s["filling"] for s in ask(control, {"op": "status"})["staged"]):
        assert time.monotonic() < deadline and not done, done
        time.sleep(0.005)


def test_a_fill_that_fails_gives_its_reservation_back(tmp_path: Path) -> None:
    """The dump is cut short while it is being read: the stage is refused naming the file, nothing of it stays
    (not listed, its slot free for the same key at once)."""
    big, small = sparse(tmp_path / "cut.bin", 32 * GIB), tmp_path / "small.bin"
    small.write_bytes(os.urandom(4 * MIB))
    with hydrator(tmp_path) as (control, uuid):
        answers: list[dict[str, Any]] = []
        filling = in_thread(answers, stage_dump, control, uuid, 1, big, 32 * GIB)
        wait_filling(control, 1, answers)
        os.truncate(big, 2 * MIB)
        filling.join(WAIT)
        assert answers and not answers[0]["ok"] and "cut.bin ended at" in str(answers[0]["error"]), answers
        assert ask(control, {"op": "status"})["staged"] == []
        again = stage_dump(control, uuid, 1, small, 4 * MIB)
        assert again["ok"], again
        assert ask(control, {"op": "discard", "key": key(1), "ticket": again["ticket"]})["discarded"] is True


def test_two_concurrent_stages_of_one_uid_cannot_together_exceed_its_quota(tmp_path: Path) -> None:
    """Each passes the quota alone (8 GiB of a 12 GiB cap); together they would hold 16 GiB: the second to
    reserve is refused, naming the cap, whichever it is. The winner's reservation is given back on discard."""
    part = sparse(tmp_path / "eight.bin", 8 * GIB)
    with hydrator(tmp_path, "--stage-uid-bytes", "12G") as (control, uuid):
        answers: list[dict[str, Any]] = []
        start = threading.Barrier(2)

        def racing(n: int) -> dict[str, Any]:
            start.wait()
            return stage_dump(control, uuid, n, part, 8 * GIB)

        threads = [in_thread(answers, racing, n) for n in (1, 2)]
        for thread in threads:
            thread.join(WAIT)
        won = [a for a in answers if a["ok"]]
        lost = [a for a in answers if not a["ok"]]
        assert len(won) == 1 and len(lost) == 1, answers
        assert f"8589934592 more would exceed its cap of {12 * GIB} bytes" in str(lost[0]["error"]), lost
        assert [s["bytes"] for s in ask(control, {"op": "status"})["staged"]] == [8 * GIB]
        winner = next(s["key"] for s in ask(control, {"op": "status"})["staged"])
        assert ask(control, {"op": "discard", "key": winner, "ticket": won[0]["ticket"]})["discarded"] is True
        assert stage_dump(control, uuid, 3, part, 8 * GIB)["ok"]  # the bytes were given back


def race_one_ticket(control: str, message: dict[str, Any]) -> list[str]:
    """Two adopts and two discards of one stage, let go at once; which of them won."""
    from coldsnap_probe.jsonline import request_with_fds

    start = threading.Barrier(4)
    won: list[str] = []

    def adopt() -> None:
        start.wait()
        answer, fds = request_with_fds(control, {"op": "adopt", **message}, timeout=WAIT)
        for fd in fds:
            os.close(fd)
        if answer["ok"]:
            assert len(fds) == 1, answer
            won.append("adopt")

    def discard() -> None:
        start.wait()
        if ask(control, {"op": "discard", **message})["discarded"]:
            won.append("discard")

    racers = [threading.Thread(target=f) for f in (adopt, discard, adopt, discard)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(WAIT)
    return won


def test_of_concurrent_adopts_and_discards_of_one_ticket_exactly_one_wins(tmp_path: Path) -> None:
    part = tmp_path / "seg-0.bin"
    part.write_bytes(os.urandom(4 * MIB))
    parts = [{"file": str(part), "bytes": 4 * MIB, "region": 0}]
    with hydrator(tmp_path) as (control, uuid):
        for round_ in range(5):
            staged = stage_dump(control, uuid, 10 + round_, part, 4 * MIB)
            assert staged["ok"], staged
            won = race_one_ticket(control, {"key": key(10 + round_), "ticket": staged["ticket"], "parts": parts})
            assert len(won) == 1, (round_, won)
            assert ask(control, {"op": "status"})["staged"] == []


def test_a_stage_whose_stager_hung_up_while_it_filled_is_freed(tmp_path: Path) -> None:
    """Regression (review4): a restore starts its stages before the host check; refused there, its worker exits
    and the answer (the only copy of the ticket) goes nowhere, so the filled stage held the GPU for the whole
    TTL. A stager that hangs up while its stage fills now gets nothing staged."""
    big = sparse(tmp_path / "left.bin", 32 * GIB)
    with hydrator(tmp_path) as (control, uuid):
        with socket.socket(socket.AF_UNIX) as stager:
            stager.connect(control)
            stager.sendall(json.dumps({"op": "stage-dump", "key": key(1), "device_uuid": uuid, "parts": [
                {"file": str(big), "bytes": 32 * GIB, "region": 0}]}).encode() + b"\n")
            wait_filling(control, 1, [])
        deadline = time.monotonic() + WAIT  # the stager is gone: its fill ends, and then nothing is staged
        while (staged := ask(control, {"op": "status"})["staged"]) and staged[0]["filling"]:
            assert time.monotonic() < deadline, staged
            time.sleep(0.05)
        assert staged == []

"""Issue 36 item 3: a server split in two processes (engines/split_server.py, vLLM V1's shape) is captured and
restored by the worker as one tree, unchanged: the front end and its engine core (and the resource tracker
`multiprocessing.shared_memory` starts) come back with their PIDs, the socketpair between them, the shared-memory
ring's contents as captured and the conversation only the core remembers.

CPU (real CRIU, n580): the toy model, no CUDA. GPU (n610): the core holds the GPU under the CUDA interposer, the
front end does not; the same tokens and first logits after each restore. CUDA IPC between two processes of a tree
is refused before anything is locked or released, naming the processes and the handles.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_main import has_nvidia_driver

pytestmark = pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
gpu = pytest.mark.skipif(not has_nvidia_driver() or importlib.util.find_spec("torch") is None,
                         reason="needs an NVIDIA driver and torch (run on the GPU host)")
SERVER = ROOT / "engines" / "split_server.py"


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True, cwd=ROOT,
                          check=False, timeout=280)


class Split:
    """The two-process server started from `directory` (its socket and log there); `ask` sends one request."""

    def __init__(self, directory: Path, *args: str, env: dict[str, str] | None = None) -> None:
        directory.mkdir(exist_ok=True)
        self.socket, self.log = directory / "split.sock", directory / "split.log"
        with open(self.log, "wb") as log:  # a plain file: CRIU dumps it with the tree
            self.proc = subprocess.Popen([sys.executable, str(SERVER), "--socket", str(self.socket), *args],
                                         cwd=ROOT, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        deadline = time.monotonic() + 240
        while '"ready"' not in self.log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.02)
        self.pid = self.proc.pid

    def ask(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(120)
            conn.connect(str(self.socket))
            conn.sendall(json.dumps(message).encode() + b"\n")
            lines = [json.loads(line) for line in conn.makefile("rb")]
        assert lines and (lines[-1].get("done") or "front_pid" in lines[-1]), lines
        return lines

    def state(self) -> dict[str, Any]:
        return self.ask({"op": "state"})[-1]

    def tree(self) -> list[int]:
        kids = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        return [self.pid, *sorted(int(k) for k in kids)]

    def reap(self, tree: list[int]) -> None:
        """After the capture ended the tree: every PID of it free again (the orphans are this process's)."""
        self.proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in tree):
            assert time.monotonic() < deadline, f"the captured tree {tree} did not end"
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the (restored) tree and wait until every process of it is gone (this process is its subreaper)."""
        pids = [p for p in self.tree() if alive(p)] if alive(self.pid) else []
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids):
            assert time.monotonic() < deadline, f"the tree {pids} outlived SIGKILL"
            time.sleep(0.02)


def restore(images: Path, criu: str, split: Split, work: Path) -> dict[str, Any]:
    split.socket.unlink(missing_ok=True)  # the dead front end's socket file: the restored one binds it again
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(work))
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_the_two_process_server_is_restored_as_one_tree_with_every_process_s_state(tmp_path: Path,
                                                                                     criu: str) -> None:
    """The ring's file is removed after the capture (a fresh node has none) and rewritten by the first restored
    tree: each restore still maps the captured contents, and the conversation goes on from what the core kept."""
    reference = Split(tmp_path / "reference")  # never captured: what the second turn must be
    try:
        turn_one = reference.ask({"text": "hello", "max_tokens": 6, "conversation": "c"})
        expected = reference.ask({"text": " again", "max_tokens": 6, "conversation": "c"})[-1]["text"]
    finally:
        reference.stop()
    split = Split(tmp_path / "server")
    images = tmp_path / "images"
    try:
        assert split.ask({"text": "hello", "max_tokens": 6, "conversation": "c"}) == turn_one
        split.ask({"prompt": [1, 2, 3], "max_tokens": 4})  # a plain request: in the ring, not in the conversation
        before, tree = split.state(), split.tree()
        assert len(tree) == 3 and before["core_pid"] in tree  # front end, its engine core, the resource tracker
        done = worker("capture", "--pid", str(split.pid), "--images", str(images), "--boundary", "n580",
                      "--criu", criu)
        assert done.returncode == 0, done.stderr
        captured = json.loads(done.stdout)
        ring = f"/dev/shm/{before['ring']}"
        assert [f["path"] for f in captured["shared_files"]] == [ring] and captured["tree"] == tree
        split.reap(tree)
        Path(ring).unlink()  # what a fresh node or container has: no such file
        for attempt in (1, 2):
            report = restore(images, criu, split, tmp_path / f"work-{attempt}")
            assert report["restored_pid"] == split.pid and report["shared_files"] == [ring]
            assert split.tree() == tree and split.state() == before
            answer = split.ask({"text": " again", "max_tokens": 6, "conversation": "c"})[-1]
            assert answer["text"] == expected  # the core's memory of the first turn came back with it
            assert split.state()["ring_sha256"] != before["ring_sha256"]  # the restored tree wrote the live file
            split.stop()
    finally:
        split.stop()


def test_a_corrupt_copy_of_a_shared_file_refuses_the_restore_before_criu(tmp_path: Path, criu: str) -> None:
    split = Split(tmp_path / "server")
    images = tmp_path / "images"
    try:
        ring, tree = split.state()["ring"], split.tree()
        done = worker("capture", "--pid", str(split.pid), "--images", str(images), "--boundary", "n580",
                      "--criu", criu)
        assert done.returncode == 0, done.stderr
        split.reap(tree)
        copy = images / "shm" / ring
        data = bytearray(copy.read_bytes())
        data[100] ^= 1
        copy.write_bytes(bytes(data))
        split.socket.unlink(missing_ok=True)
        done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"))
        assert done.returncode == 1 and "shm-files.json: the tree's shared-memory files cannot be put back" \
            in done.stderr and f"/dev/shm/{ring}" in done.stderr
        assert not (tmp_path / "work" / "restore.log").exists() and not alive(split.pid)  # CRIU never ran
    finally:
        split.stop()
        Path(f"/dev/shm/{ring}").unlink(missing_ok=True)

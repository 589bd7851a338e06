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


@pytest.fixture(scope="module")
def interposer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from coldsnap_probe.hydration import build_library

    library, _ = build_library(tmp_path_factory.mktemp("interposer"))
    return library


def under_interposer(library: Path, root: Path, **extra: str) -> dict[str, str]:
    """Every process of the tree preloads it; each CUDA process listens on its own socket (%p)."""
    return {**os.environ, "LD_PRELOAD": str(library), "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(root / "cuda-%p.sock"),
            **extra}


@gpu
def test_the_two_process_server_with_cuda_in_its_core_restores_to_the_same_tokens_under_the_interposer(
        tmp_path: Path, criu: str, interposer: Path) -> None:
    """Only the core holds CUDA (and the interposer's regions); the front end preloads the library and never
    allocates. Two restores from the same images: the same tokens and first logits, the same PIDs."""
    split = Split(tmp_path / "server", "--cuda", "--gib", "0.25", "--weights", "device",
                  env=under_interposer(interposer, tmp_path))
    prompt = {"prompt": [1, 15043, 29892, 920, 526], "max_tokens": 12}
    try:
        cold, before, tree = split.ask(prompt), split.state(), split.tree()
        done = worker("capture", "--pid", str(split.pid), "--images", str(tmp_path / "images"), "--criu", criu)
        assert done.returncode == 0, done.stderr
        captured = json.loads(done.stdout)
        assert captured["cuda_pids"] == [before["core_pid"]]  # the front end holds no CUDA
        assert captured["cuda_ipc"] == {"checked": [before["core_pid"]], "unchecked": []}
        assert [(d["pid"], d["state"]) for d in captured["device_memory"]] == [(before["core_pid"], "released")]
        assert [f["path"] for f in captured["shared_files"]] == [f"/dev/shm/{before['ring']}"]
        split.reap(tree)
        for attempt in (1, 2):
            report = restore(tmp_path / "images", criu, split, tmp_path / f"work-{attempt}")
            assert [d["pid"] for d in report["device_memory"]] == [before["core_pid"]]
            assert split.tree() == tree and split.state() == before
            assert split.ask(prompt) == cold  # tokens, pieces and the first logits' digest
            split.stop()
    finally:
        split.stop()


@gpu
def test_cuda_ipc_between_two_processes_is_refused_before_capture_naming_both(tmp_path: Path, criu: str,
                                                                             interposer: Path) -> None:
    """The threshold keeps torch's segments on cuMemAlloc (legacy IPC cannot export VMM memory); every process
    listens from the start. The refusal names the exporter and the importer with their counts and bytes, and the
    tree runs on untouched: the child still reads the shared tensor."""
    directory = tmp_path / "target"
    directory.mkdir()
    env = under_interposer(interposer, tmp_path, COLDSNAP_CUDA_INTERPOSER_THRESHOLD=str(1 << 40),
                           COLDSNAP_CUDA_INTERPOSER_LISTEN="load")
    with open(tmp_path / "target.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.probe._ipc_target", str(directory)], cwd=ROOT, env=env,
                                start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 240
        while not (directory / "ready-child").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "target.log").read_text()[-3000:]
            time.sleep(0.05)
        parent = json.loads((directory / "ready-parent").read_text())
        done = worker("capture", "--pid", str(proc.pid), "--images", str(tmp_path / "images"), "--criu", criu)
        assert done.returncode == 3, done.stderr
        refused = json.loads(done.stdout)
        assert refused["kind"] == "capture-refused" and "cuda-ipc" in done.stderr
        by_pid = {r["pid"]: r for r in refused["refused"]}
        assert set(by_pid) == {proc.pid, parent["child"]} and all(r["code"] == "cuda-ipc" for r in by_pid.values())
        assert by_pid[proc.pid]["exported"]["count"] >= 1 and by_pid[proc.pid]["exported"]["bytes"] >= 64 << 20
        assert by_pid[parent["child"]]["imported"]["count"] >= 1
        assert "tests.probe._ipc_target" in by_pid[proc.pid]["command"]
        assert not any((tmp_path / "images").iterdir())  # nothing dumped, nothing released
        (directory / "ask-1").touch()
        while not (directory / "answer-1").exists():
            assert time.monotonic() < deadline + 60, "the child stopped answering after the refusal"
            time.sleep(0.05)
        assert json.loads((directory / "answer-1").read_text())["sum"] == 2.0 * (16 << 20)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

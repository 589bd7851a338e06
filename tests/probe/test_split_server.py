"""Issue 36 item 3: a server split in two processes (engines/split_server.py, vLLM V1's shape) is captured and
restored by the worker as one tree, unchanged: the front end and its engine core (and the resource tracker
`multiprocessing.shared_memory` starts) come back with their PIDs, the socketpair between them, the shared-memory
ring's contents as captured and the conversation only the core remembers.

CPU (real CRIU, n580): the toy model, no CUDA. GPU (n610): the core holds the GPU under the CUDA interposer, the
front end does not; the same tokens and first logits after each restore. CUDA IPC between two processes of a tree
is refused before anything is locked or released, naming the processes and the handles.

As in a capsule, the server runs in a PID namespace of its own under the capsule's init (`engine_llama.py launch`,
its PID floor), the worker captures it from inside, and each restore comes back in a fresh namespace: the captured
PIDs are free there whatever the host's processes hold.
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
from contextlib import contextmanager
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
LAUNCHER = ROOT / "engines" / "engine_llama.py"
PID_FLOOR = 512  # as a capsule's init: the captured PIDs sit above what a restore's own processes take


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True, cwd=ROOT,
                          check=False, timeout=280)


class Namespace:
    """A PID namespace of its own, with its /proc, as a capsule's container has: `command` is its init, and the
    namespace ends with it (`unshare --kill-child`). PIDs here are the namespace's, as the worker in it sees them:
    each restore comes back in a fresh one, where the captured PIDs are free whatever the host's processes hold
    (a restore on the host's PID space once failed with CRIU's "Can't fork for <pid>: File exists")."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        with open(log, "wb") as out:
            self.process = subprocess.Popen(["unshare", "--pid", "--mount-proc", "--kill-child", *command], cwd=ROOT,
                                            env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=out)
        deadline, children = time.monotonic() + 10, Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        while not children.read_text().split():
            assert self.process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.005)
        self.init = int(children.read_text().split()[0])  # the init's host PID
        self.proc = Path(f"/proc/{self.init}/root/proc")  # the namespace's /proc, read from here

    def alive(self, pid: int) -> bool:
        try:
            return (self.proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False

    def children(self, pid: int) -> list[int]:
        return sorted(int(c) for c in (self.proc / str(pid) / "task" / str(pid) / "children").read_text().split())

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """`argv` inside the namespace (its PIDs, its /proc), as `workload-exec` runs the worker in a unit."""
        return subprocess.run(["nsenter", "--target", str(self.init), "--pid", "--mount", f"--wd={ROOT}", *argv],
                              capture_output=True, text=True, check=False, timeout=280)

    def end(self) -> None:
        """Kill the init and so every process of the namespace; wait until the init is gone (after them)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        deadline = time.monotonic() + 10
        while alive(self.init):
            assert time.monotonic() < deadline, f"the namespace of init {self.init} outlived SIGKILL"
            time.sleep(0.02)


class Split:
    """The two-process server started from `directory` (its socket and log there) in a namespace of its own,
    under the capsule's init (engines/engine_llama.py launch: the PID floor, the server a session leader);
    `ask` sends one request."""

    def __init__(self, directory: Path, *args: str, env: dict[str, str] | None = None) -> None:
        directory.mkdir(exist_ok=True)
        self.directory, self.env = directory, env
        self.socket, self.log = directory / "split.sock", directory / "split.log"
        server = [sys.executable, str(SERVER), "--socket", str(self.socket), *args]
        # The server's stdio on a plain file (CRIU dumps it with the tree), not the init's /dev/null.
        self.ns = Namespace([sys.executable, str(LAUNCHER), "launch", "--pid-floor", str(PID_FLOOR), "--log",
                             str(directory / "init.log"), "--", "/bin/sh", "-c", 'exec "$@" >> "$0" 2>&1',
                             str(self.log), *server], directory / "namespace.log", env)
        deadline, init_log = time.monotonic() + 240, directory / "init.log"
        while '"ready"' not in (self.log.read_text() if self.log.exists() else ""):
            assert self.ns.process.poll() is None and time.monotonic() < deadline, \
                (directory / "namespace.log").read_text()
            assert "engine_exited" not in (init_log.read_text() if init_log.exists() else ""), self.log.read_text()
            time.sleep(0.02)
        forked = [json.loads(line) for line in init_log.read_text().splitlines() if "forked" in line]
        self.pid = int(forked[0]["engine_pid"])  # in the namespace: what the worker and the server see
        assert self.pid >= PID_FLOOR

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
        return [self.pid, *self.ns.children(self.pid)]

    def capture(self, images: Path, criu: str, *options: str) -> subprocess.CompletedProcess[str]:
        """The worker captures the server from inside its namespace, as the capsule's worker does."""
        return self.ns.run(sys.executable, "-m", "coldsnap_probe", "capture", "--pid", str(self.pid), "--images",
                           str(images), "--criu", criu, *options)

    def reap(self, tree: list[int]) -> None:
        """After the capture ended the tree: every process of it gone, then its namespace."""
        deadline = time.monotonic() + 10
        while any(self.ns.alive(p) for p in tree):
            assert time.monotonic() < deadline, f"the captured tree {tree} did not end"
            time.sleep(0.02)
        self.ns.end()

    def restore(self, images: Path, criu: str, work: Path) -> tuple[int, str, str]:
        """The worker restores the tree in a fresh namespace, as a restore unit's command does in its container,
        which then holds the tree; (exit status, report, log)."""
        self.socket.unlink(missing_ok=True)  # the dead front end's socket file: the restored one binds it again
        work.mkdir(parents=True)
        self.ns = Namespace(["/bin/sh", "-c", '"$@" > "$0/report.json" 2> "$0/worker.log"; echo $? > "$0/rc"; '
                             "exec sleep 86400", str(work), sys.executable, "-m", "coldsnap_probe", "restore",
                             "--images", str(images), "--criu", criu, "--work-dir", str(work)],
                            work / "namespace.log", self.env)
        deadline = time.monotonic() + 280
        while not (work / "rc").is_file() or not (work / "rc").read_text().strip():
            assert self.ns.process.poll() is None and time.monotonic() < deadline, (work / "namespace.log").read_text()
            time.sleep(0.02)
        return int((work / "rc").read_text()), (work / "report.json").read_text(), (work / "worker.log").read_text()

    def stop(self) -> None:
        """Kill the (restored) tree with its namespace."""
        self.ns.end()


@contextmanager
def host_pid_taken(pid: int) -> Iterator[None]:
    """The host's PID `pid` held by a process of the host's meanwhile (one of ours, through ns_last_pid, unless
    another holds it already): a restore wanting that PID in the host's PID space would fail."""
    holder = None
    for _ in range(20):
        if Path(f"/proc/{pid}").exists():
            break
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        holder = subprocess.Popen(["sleep", "600"])
        if holder.pid != pid:  # another fork came first: try again
            holder.kill()
            holder.wait()
            holder = None
    assert Path(f"/proc/{pid}").exists(), f"could not take the host's PID {pid}"
    try:
        yield
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()


def restore(images: Path, criu: str, split: Split, work: Path) -> dict[str, Any]:
    code, out, err = split.restore(images, criu, work)
    assert code == 0, err
    report: dict[str, Any] = json.loads(out)
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
        done = split.capture(images, criu, "--boundary", "n580")
        assert done.returncode == 0, done.stderr
        captured = json.loads(done.stdout)
        ring = f"/dev/shm/{before['ring']}"
        assert [f["path"] for f in captured["shared_files"]] == [ring] and captured["tree"] == tree
        split.reap(tree)
        Path(ring).unlink()  # what a fresh node or container has: no such file
        for attempt in (1, 2):
            with host_pid_taken(split.pid):  # the restore's namespace is its own: the captured PIDs are free there
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
        done = split.capture(images, criu, "--boundary", "n580")
        assert done.returncode == 0, done.stderr
        split.reap(tree)
        copy = images / "shm" / ring
        data = bytearray(copy.read_bytes())
        data[100] ^= 1
        copy.write_bytes(bytes(data))
        code, _, err = split.restore(images, criu, tmp_path / "work")
        assert code == 1 and "shm-files.json: the tree's shared-memory files cannot be put back" in err \
            and f"/dev/shm/{ring}" in err
        assert not (tmp_path / "work" / "restore.log").exists() and not split.ns.alive(split.pid)  # CRIU never ran
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
        done = split.capture(tmp_path / "images", criu)
        assert done.returncode == 0, done.stderr
        captured = json.loads(done.stdout)
        assert captured["cuda_pids"] == [before["core_pid"]]  # the front end holds no CUDA
        assert captured["cuda_ipc"] == {"checked": [before["core_pid"]], "unchecked": []}
        assert [(d["pid"], d["state"]) for d in captured["device_memory"]] == [(before["core_pid"], "released")]
        assert [f["path"] for f in captured["shared_files"]] == [f"/dev/shm/{before['ring']}"]
        split.reap(tree)
        for attempt in (1, 2):
            with host_pid_taken(split.pid):  # as on the H200 once: "Can't fork for <pid>: File exists" no more
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

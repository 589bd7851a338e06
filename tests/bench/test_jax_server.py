"""engines/jax_server.py: the JAX model server.

On a CPU (JAX_PLATFORMS=cpu, a tiny shape; where this interpreter has jax): the protocol and stages, bitwise
determinism from the seed (the restore check compares a restored server's first logits with its cold start's),
the weights file read in ttft_server.py's layout, bad arguments refused naming the field, a CRIU dump and restore
answering bitwise as before. On the GPU host: the
server, unchanged, under the CUDA interposer with the capsule's JAX environment (docs/interposer.md, "JAX and
XLA"), captured and restored through the workers: the same tokens and first-step logits, and the device bytes
the interposer moved."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.criu import CRIU, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_main import has_nvidia_driver

SERVER = ROOT / "engines" / "jax_server.py"
HAS_JAX = importlib.util.find_spec("jax") is not None
cpu_jax = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed in this interpreter (pip install jax)")
TINY = ["--hidden", "64", "--heads", "4", "--vocab", "256", "--gib", "0.0003"]  # two layers
PROMPT = [1, 15, 29, 92, 52]


class Server:
    """A jax_server.py process, its stdout in a plain file (CRIU dumps it with the process)."""

    def __init__(self, root: Path, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.socket, self.log = root / f"{name}.sock", root / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, str(SERVER), "--socket", str(self.socket), *args],
                                         cwd=ROOT, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=out, start_new_session=True)

    def stages(self) -> dict[str, dict[str, Any]]:
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith('{"stage"')]
        return {line["stage"]: line for line in lines}

    def wait_ready(self, timeout: float = 240.0) -> dict[str, dict[str, Any]]:
        give_up = time.monotonic() + timeout
        while "ready" not in (stages := self.stages()):
            assert self.proc.poll() is None, f"exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < give_up, f"not ready in {timeout} s: {self.log.read_text()[-3000:]}"
            time.sleep(0.05)
        return stages

    def ask(self, max_tokens: int = 8, prompt: list[int] = PROMPT) -> tuple[list[int], str]:
        """(tokens, first_logits_sha256), connecting until the (restored) server listens."""
        give_up = time.monotonic() + 60
        while True:
            try:
                conn = socket.socket(socket.AF_UNIX)
                conn.connect(str(self.socket))
                break
            except OSError:
                conn.close()
                assert time.monotonic() < give_up, f"{self.socket} never listened"
                time.sleep(0.02)
        with conn, conn.makefile("rwb") as stream:
            stream.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode() + b"\n")
            stream.flush()
            lines = [json.loads(line) for line in stream]
        assert lines and lines[-1].get("done"), lines[-3:]
        return [line["token"] for line in lines[:-1]], lines[-1]["first_logits_sha256"]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


def bf16_file(path: Path, params: int, seed: int) -> None:
    """ttft_server.py's file format: raw bf16 (float32 normal(0, 0.02) with its low 16 bits dropped)."""
    import numpy as np

    values = np.random.default_rng(seed).normal(0, 0.02, params).astype(np.float32)
    path.write_bytes((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())


@cpu_jax
def test_the_cpu_server_is_deterministic_from_its_seed_and_reads_the_weights_file(
        tmp_path: Path, servers: list[Server]) -> None:
    env = {"JAX_PLATFORMS": "cpu"}
    params = 256 * 64 + 64 + 2 * (12 * 64 * 64 + 2 * 64)
    bf16_file(tmp_path / "a.bin", params, 1)
    bf16_file(tmp_path / "b.bin", params, 2)
    for name, weights, seed in [("one", "device", "1"), ("again", "device", "1"), ("other", "device", "2"),
                                ("file-a", str(tmp_path / "a.bin"), "1"), ("file-b", str(tmp_path / "b.bin"), "1")]:
        servers.append(Server(tmp_path, name, *TINY, "--weights", weights, "--seed", seed, env=env))
    stages = [server.wait_ready() for server in servers]
    assert list(stages[0]) == ["process_start", "cuda_init", "weights_loaded", "graph_captured", "ready"]
    assert stages[0]["cuda_init"]["platform"] == "cpu" and stages[0]["weights_loaded"]["layers"] == 2
    assert stages[0]["cuda_init"]["environment"] == {"JAX_PLATFORMS": "cpu"}
    # parameters and the KV cache: what the bench divides by as the device's bytes
    assert stages[0]["graph_captured"]["device_bytes"] >= params * 2
    answers = [server.ask() for server in servers]
    one, again, other, file_a, file_b = answers
    assert len(one[0]) == 8 and one == servers[0].ask()  # a second request: the cache is rewritten, not read stale
    assert one == again  # two processes, one seed: the same tokens and bitwise the same first logits
    assert one[1] != other[1] and file_a[1] != file_b[1] and file_a[1] != one[1]
    assert servers[3].ask() == file_a
    # a request past the cache is refused to that asker; the server goes on serving
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(str(servers[0].socket))
    with conn, conn.makefile("rwb") as stream:
        stream.write(json.dumps({"prompt": PROMPT, "max_tokens": 200}).encode() + b"\n")
        stream.flush()
        refused = json.loads(stream.read())
    assert refused["ok"] is False and "1 to 128 positions" in refused["error"]
    assert servers[0].ask() == one


@cpu_jax
@pytest.mark.parametrize(("args", "message"), [
    (["--hidden", "65", "--heads", "4", "--weights", "device"], "--hidden (65) must be a positive multiple of"),
    (["--gib", "0", "--weights", "device"], "--gib must be above 0, not 0.0"),
    (["--weights", "/nonexistent"], "--weights: /nonexistent is not a file"),
], ids=["hidden", "gib", "weights"])
def test_bad_arguments_are_refused_naming_the_field(tmp_path: Path, args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(SERVER), "--socket", str(tmp_path / "s.sock"), *TINY, *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-800:]
    assert not (tmp_path / "s.sock").exists()


@cpu_jax
def test_a_short_weights_file_is_refused_before_serving(tmp_path: Path) -> None:
    (tmp_path / "short.bin").write_bytes(b"\0" * 1000)
    done = subprocess.run([sys.executable, str(SERVER), "--socket", str(tmp_path / "s.sock"), *TINY,
                           "--weights", str(tmp_path / "short.bin")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
    need = (256 * 64 + 64 + 2 * (12 * 64 * 64 + 2 * 64)) * 2
    assert done.returncode == 1 and f"holds 1000 bytes; a 2-layer model needs {need}" in done.stderr, done.stderr
    assert not (tmp_path / "s.sock").exists()


@cpu_jax
@pytest.mark.skipif(CRIU is None, reason="CRIU needs root and its build (scripts/criu/build)")
def test_criu_restores_the_cpu_server_answering_bitwise_as_before(tmp_path: Path, servers: list[Server]) -> None:
    """XLA's runtime (its thread pools, its descriptors) survives a CRIU dump and restore: the host half of what
    the GPU test adds the CUDA checkpoint and the interposer to."""
    server = Server(tmp_path, "criu", *TINY, "--weights", "device", env={"JAX_PLATFORMS": "cpu"})
    servers.append(server)
    server.wait_ready()
    cold = server.ask(16)
    images = tmp_path / "images"
    images.mkdir()
    with criu_wrapper(tmp_path) as criu:
        done = subprocess.run([criu, "dump", "-t", str(server.proc.pid), "-D", str(images), "-o", "dump.log"],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, (images / "dump.log").read_text()[-2000:]
        server.proc.wait()  # CRIU killed it: its pid is free for the restore
        server.socket.unlink(missing_ok=True)
        done = subprocess.run([criu, "restore", "-D", str(images), "-o", "restore.log", "-d"],
                              capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, (images / "restore.log").read_text()[-2000:]
        try:
            assert server.ask(16) == cold
        finally:
            os.kill(server.proc.pid, 9)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(server.proc.pid, 0)


# -- the GPU host: through the workers under the interposer -------------------------------------------------------
gpu_jax = pytest.mark.skipif(not has_nvidia_driver() or shutil.which("criu") is None or not HAS_JAX,
                             reason="needs an NVIDIA driver, CRIU and jax with its CUDA plugin (run on the GPU host)")
HOST_KINDS = {"host_pinned", "host_registered", "unwrapped_entry_points"}  # not device memory (or a count only)
# What JAX and XLA log when the CUDA backend does not start and the CPU takes its place.
FALLBACK = re.compile(r"Unable to initialize backend|Falling back|CUDA_ERROR|cuda|plugin", re.IGNORECASE)


def why_not_on_the_gpu(log: str, limit: int = 60) -> str:
    """The server log's lines that say why JAX came up on the CPU, from the whole log: XLA names the failed backend
    at start, so a tail (the server's later output) loses it."""
    lines = [line[:600] for line in log.splitlines() if FALLBACK.search(line)]
    return "\n".join(lines[:limit]) or f"no line names the backend; the log's tail:\n{log[-1500:]}"


def device_coverage(released: dict[str, Any]) -> tuple[float, dict[str, dict[str, int]]]:
    """The share of the process's device bytes the interposer moved, and what stayed on the checkpoint path."""
    uncovered = {kind: value for kind, value in released.get("uncovered", {}).items()
                 if kind not in HOST_KINDS and value.get("bytes")}
    left = sum(value["bytes"] for value in uncovered.values())
    return released["bytes"] / max(1, released["bytes"] + left), uncovered


@gpu_jax
@pytest.mark.parametrize("allocator", ["capsule", "preallocated-5%"])
def test_the_workers_capture_and_restore_an_unchanged_jax_server(tmp_path: Path, servers: list[Server],
                                                                 allocator: str) -> None:
    """The capsule's environment (a growing BFC pool) has >= 95 % of its device bytes moved by the interposer (the
    CUDA 13 plugin's XLA backs its pool with its own cuMemCreate: this holds once the interposer moves engine VMM
    allocations; the message names what stayed); a small preallocated pool (XLA's default, at 5 % so the test
    stays cheap) restores identically too, whichever path its pool takes."""
    from coldsnap_probe.hydration import ENGINE_DEFAULTS, build_library, interposer_request
    from tests.probe.test_worker import kill_and_reap, worker

    ctypes.CDLL(None).prctl(36, 1)  # a subreaper: the restored tree is reparented here
    library, _ = build_library(tmp_path / "lib")
    env = {"LD_PRELOAD": str(library), "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(tmp_path / "cuda-%p.sock"),
           # One spelling only: jaxlib 0.11's CUDA plugin refuses both at once and XLA falls back to the CPU.
           **(ENGINE_DEFAULTS if allocator == "capsule" else {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".05"})}
    server = Server(tmp_path, "jax", "--gib", "1", "--weights", "device", env=env)
    servers.append(server)
    stages = server.wait_ready()
    # XLA falls back to the CPU when its CUDA client fails to start: its log says why.
    if stages["cuda_init"]["platform"] != "gpu":
        pytest.fail(f"JAX came up on {stages['cuda_init']['platform']!r}, not the GPU ({allocator}); the server "
                    f"log's lines on its backend:\n{why_not_on_the_gpu(server.log.read_text())}", pytrace=False)
    cold = server.ask(16)
    if allocator == "capsule":
        # JAX's CUDA 13 runtime resolves the driver through cuGetProcAddress at 13000: every entry point the gate
        # needs came back wrapped (an unwrapped one would bypass it during a release).
        status = interposer_request(str(tmp_path / f"cuda-{server.proc.pid}.sock"), {"op": "status"}, "status")
        launches = [name for name in status["wrapped"] if name.startswith(("cuLaunch", "cuGraphLaunch"))]
        assert status["unwrapped"] == [] and launches, status
    images = tmp_path / "images"
    done = worker("capture", "--pid", str(server.proc.pid), "--images", str(images), "--criu",
                  shutil.which("criu") or "")
    assert done.returncode == 0, done.stderr[-3000:]
    server.proc.wait()  # CRIU killed it: its pid is free for the restore
    capture = json.loads(done.stdout)
    [released] = capture["device_memory"]
    assert released["state"] in ("released", "empty", "not-started"), released
    server.socket.unlink(missing_ok=True)  # the dead process's; the restored one has it bound again
    done = worker("restore", "--images", str(images), "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    try:
        assert sum(d["bytes"] for d in report.get("device_memory") or []) == released["bytes"], report
        assert server.ask(16) == cold  # the same tokens, bitwise the same first logits
    finally:
        kill_and_reap(report["restored_pid"])
    if allocator == "capsule":  # after the restore: identical outputs are checked whatever path the bytes took
        covered, uncovered = device_coverage(released)
        assert covered >= 0.95, (f"{covered:.0%} of the device bytes moved by the interposer", uncovered,
                                 stages["graph_captured"]["xla_memory"])
        assert released["bytes"] >= stages["graph_captured"]["device_bytes"], (released, stages["graph_captured"])

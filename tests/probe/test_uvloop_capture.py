"""Issue 36 item 2: a server on uvloop is captured and restored with uvloop in it.

uvloop's libuv keeps an io_uring ring (epoll batching) that CRIU cannot dump, so the capture refuses such a server.
Under the capsule's `no_io_uring` preload (scripts/capsule/no_io_uring.c, which every server unit gets) libuv keeps
to epoll: the same server is captured by the real worker and CRIU, restored, and answers on uvloop.
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

import pytest

from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_main import has_nvidia_driver

pytestmark = pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
gpu = pytest.mark.skipif(not has_nvidia_driver() or importlib.util.find_spec("torch") is None,
                         reason="needs an NVIDIA driver and torch (run on the GPU host)")

SERVER = """
import asyncio, os, sys, uvloop

DEVICE = None
if os.environ.get("HOLD_CUDA"):  # initialized CUDA state: 256 MiB on the GPU, read back for every answer
    import torch
    DEVICE = torch.full((64 << 20,), 3.0, device="cuda")
    torch.cuda.synchronize()

async def answer(reader, writer):
    line = await reader.readline()
    loop = type(asyncio.get_running_loop())
    held = "" if DEVICE is None else f" {int(DEVICE.sum().item())}"
    writer.write(f"{loop.__module__}.{loop.__name__} {line.decode().strip()}{held}\\n".encode())
    await writer.drain()
    writer.close()

async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.sockets[0].getsockname()[1]))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    await server.serve_forever()

uvloop.run(main())
"""


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


@pytest.fixture(scope="module")
def no_io_uring(tmp_path_factory: pytest.TempPathFactory) -> Path:
    library = tmp_path_factory.mktemp("preload") / "libcoldsnap_no_io_uring.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(library),
                    str(ROOT / "scripts/capsule/no_io_uring.c"), "-ldl"], check=True)
    return library


def start_server(tmp_path: Path, preload: Path | None, *, cuda: bool = False) -> tuple[subprocess.Popen[bytes], int]:
    port_file = tmp_path / "port"
    env = {**os.environ, **({"LD_PRELOAD": str(preload)} if preload else {}), **({"HOLD_CUDA": "1"} if cuda else {})}
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port_file)], env=env, start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, int(port_file.read_text())


def ask(port: int, text: str) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(text.encode() + b"\n")
        return conn.makefile().readline().strip()


def rings(pid: int) -> int:
    return sum(os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[io_uring]" for fd in os.listdir(f"/proc/{pid}/fd"))


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True, cwd=ROOT,
                          check=False, timeout=280)


def test_uvloop_s_io_uring_ring_is_refused_by_name_and_the_server_keeps_serving(tmp_path: Path, criu: str) -> None:
    server, port = start_server(tmp_path, None)
    try:
        assert rings(server.pid) >= 1  # the reason the preload exists: without it libuv keeps a ring
        done = worker("capture", "--pid", str(server.pid), "--images", str(tmp_path / "images"), "--boundary", "n580",
                      "--criu", criu)
        assert done.returncode == 1 and f"process {server.pid} holds an io_uring instance" in done.stderr
        assert ask(port, "still") == "uvloop.Loop still"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=gpu)], ids=["cpu", "cuda"])
def test_a_uvloop_server_under_the_preload_is_captured_restored_and_answers_on_uvloop(
        tmp_path: Path, criu: str, no_io_uring: Path, cuda: bool) -> None:
    """On the GPU host the server also holds initialized CUDA state (n610: CUDA checkpoint + CRIU)."""
    server, port = start_server(tmp_path, no_io_uring, cuda=cuda)
    held = f" {3 * (64 << 20)}" if cuda else ""
    assert rings(server.pid) == 0 and ask(port, "cold") == f"uvloop.Loop cold{held}"
    images = tmp_path / "images"
    done = worker("capture", "--pid", str(server.pid), "--images", str(images), "--boundary",
                  "n610" if cuda else "n580", "--criu", criu)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["event_loops"] == {str(server.pid): "uvloop"}  # the report names its loop
    server.wait()  # CRIU ended it: its PID is free for the restore
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr
    try:
        assert alive(server.pid) and rings(server.pid) == 0
        maps = Path(f"/proc/{server.pid}/maps").read_text()
        assert "uvloop/loop." in maps and str(no_io_uring) in maps  # the same process, uvloop and the preload in it
        assert ask(port, "restored") == f"uvloop.Loop restored{held}"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10  # reaped here (this process is the restored tree's subreaper)
        while alive(server.pid):
            assert time.monotonic() < deadline, f"the restored server {server.pid} outlived SIGKILL"
            time.sleep(0.02)

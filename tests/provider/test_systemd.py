"""sd_notify READY/STOPPING/WATCHDOG, socket activation, and the unit files."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from coldsnap_provider._client import exchange
from tests.helpers import ROOT, running_daemon


def _receive_all(sock: socket.socket, until: bytes, timeout: float = 10.0) -> list[bytes]:
    messages: list[bytes] = []
    deadline = time.monotonic() + timeout
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            messages.append(sock.recv(4096))
        except TimeoutError:
            continue
        if until in messages[-1]:
            break
    return messages


async def test_sd_notify_ready_watchdog_and_stopping() -> None:
    directory = Path(tempfile.mkdtemp(prefix="cs-notify-", dir="/tmp"))
    path = directory / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        async with running_daemon(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"}) as daemon:
            first = _receive_all(sock, b"READY=1")
            assert b"READY=1" in first
            # Sockets are bound before READY: the control socket answers at once.
            assert (await daemon.control(operation="status"))["version"]
            pings = _receive_all(sock, b"never", timeout=0.8)
            assert pings.count(b"WATCHDOG=1") >= 3
            assert daemon.process is not None
            daemon.process.send_signal(signal.SIGTERM)
            assert b"STOPPING=1" in b"".join(_receive_all(sock, b"STOPPING=1"))
            assert await anyio.to_thread.run_sync(daemon.process.wait, 10) == 0
    shutil.rmtree(directory, ignore_errors=True)


async def test_socket_activation_serves_the_passed_control_socket() -> None:
    state = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    config = state.parent / f"{state.name}.toml"
    config.write_text("")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(state / "activated.sock"))
    listener.listen()
    fd = listener.fileno()
    process = subprocess.Popen(
        ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@"', "sh", sys.executable, "-m", "coldsnap_provider",
         "serve", "--config", str(config), "--state-dir", str(state)],
        pass_fds=(3,), preexec_fn=lambda: os.dup2(fd, 3),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        listener.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                data = await exchange(state / "activated.sock", b'{"format":1,"id":"a","operation":"status"}\n')
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                await anyio.sleep(0.1)
        assert b'"ok":true' in data and b'"version"' in data
        assert not (state / "control.sock").exists()  # nothing bound besides the passed socket
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0, process.stderr.read() if process.stderr else ""
        shutil.rmtree(state, ignore_errors=True)
        config.unlink(missing_ok=True)


def test_unit_files_verify_clean() -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is installed by scripts/test"
    executable = shutil.which("coldsnap-provider") or str(Path(sys.executable).parent / "coldsnap-provider")
    with tempfile.TemporaryDirectory() as directory:
        for name in ("coldsnap-provider.service", "coldsnap-provider.socket"):
            text = (ROOT / "systemd" / name).read_text().replace("/usr/local/bin/coldsnap-provider", executable)
            Path(directory, name).write_text(text)
        result = subprocess.run(
            [analyze, "verify", "--man=no", f"{directory}/coldsnap-provider.service",
             f"{directory}/coldsnap-provider.socket"], capture_output=True, text=True, check=False)
        problems = [line for line in (result.stdout + result.stderr).splitlines()
                    if "coldsnap-provider" in line]
        assert result.returncode == 0 and not problems, result.stdout + result.stderr
    assert "Type=notify" in (ROOT / "systemd" / "coldsnap-provider.service").read_text()

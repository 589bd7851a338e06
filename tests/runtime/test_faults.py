"""Client disconnects during long operations, and a Docker Engine restart between calls."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator

import anyio
import pytest

from tests.conftest import docker
from tests.helpers import Daemon, Session
from tests.runtime.conftest import container_exists, image_exists, uniq

pytestmark = pytest.mark.usefixtures("no_leftovers")


async def send_and_drop(session: Session, runtime: dict[str, object], ready: object) -> None:
    """Send one runtime request, wait until `ready()` is true, then close the connection."""
    request = session.envelope("runtime", host="localhost", runtime=runtime)
    stream = await anyio.connect_unix(session.socket)
    await stream.send(json.dumps(request).encode() + b"\n")
    await stream.send_eof()
    with anyio.fail_after(30):
        while not ready():  # type: ignore[operator]
            await anyio.sleep(0.1)
    await stream.aclose()


async def wait_for_log(daemon: Daemon, text: str, count: int = 1) -> None:
    with anyio.fail_after(20):
        while daemon.log().count(text) < count:
            await anyio.sleep(0.1)


async def test_disconnect_during_sync_run_removes_its_container(daemon: Daemon, session: Session,
                                                                busybox_image: str) -> None:
    name = uniq("sync")
    before = daemon.log().count("client disconnected mid-operation")

    def running() -> bool:
        return docker("ps", "-q", "--filter", f"name=^{name}$").stdout.strip() != b""

    await send_and_drop(session, {"action": "workload-run", "workload": {
        "name": name, "image": busybox_image, "command": ["sleep", "60"]}}, running)
    await wait_for_log(daemon, "client disconnected mid-operation", before + 1)
    with anyio.fail_after(20):
        while container_exists(name):
            await anyio.sleep(0.1)
    # The cleanup RPC the adapter sends next, on a fresh connection, succeeds.
    assert (await session.runtime("workload-remove", name=name)).ok


async def test_disconnect_during_build_cancels_it(daemon: Daemon, session: Session, busybox_image: str) -> None:
    context = tempfile.mkdtemp(prefix="cs-build-")
    tag = f"coldsnap-capsule/{uniq('cancel')}:1"
    dockerfile = f"FROM {busybox_image}\nRUN touch /started && sleep 60\n"
    before = docker("ps", "-aq", "--no-trunc").stdout.split()

    def building() -> bool:
        now = docker("ps", "-q", "--no-trunc").stdout.split()
        return any(c not in before for c in now)

    await send_and_drop(session, {"action": "image-build", "build": {
        "dockerfile": base64.b64encode(dockerfile.encode()).decode(), "context": context, "tag": tag}}, building)
    with anyio.fail_after(30):
        while any(c not in before for c in docker("ps", "-aq", "--no-trunc").stdout.split()):
            await anyio.sleep(0.2)
    assert not image_exists(tag)
    assert (await session.runtime("image-inspect", image=busybox_image)).ok


@pytest.fixture
def silent_registry() -> Iterator[str]:
    """A TCP listener on 127.0.0.1 that accepts and never answers: a pull to it hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


async def test_disconnect_during_pull_cancels_it(daemon: Daemon, session: Session, silent_registry: str) -> None:
    before = daemon.log().count("client disconnected mid-operation")
    started = time.monotonic()
    await send_and_drop(session, {"action": "image-pull", "image": f"{silent_registry}/capsules/m:1"},
                        lambda: time.monotonic() - started > 1.5)
    await wait_for_log(daemon, "client disconnected mid-operation", before + 1)
    with anyio.fail_after(5):
        assert (await session.call("capabilities")).ok
        assert (await daemon.control(operation="status"))["in_flight"] == 0


def _restart_dockerd() -> None:
    pid = int(subprocess.run(["pidof", "dockerd"], capture_output=True, text=True, check=True).stdout.split()[0])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}"):
        assert time.monotonic() < deadline, "dockerd did not stop"
        time.sleep(0.1)
    time.sleep(1)
    if subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        with open("/var/log/coldsnap-dockerd.log", "ab") as log:
            subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "info"], capture_output=True, check=False).returncode != 0:
        assert time.monotonic() < deadline, "dockerd did not come back"
        time.sleep(0.2)


async def test_docker_restart_between_calls_recovers_without_restarting_the_provider(
        daemon: Daemon, session: Session, busybox_image: str) -> None:
    assert (await session.runtime("image-inspect", image=busybox_image)).ok
    provider_pid = daemon.process.pid if daemon.process else None
    await anyio.to_thread.run_sync(_restart_dockerd)
    first = await session.runtime("image-inspect", image=busybox_image)
    assert first.ok or (first.error_code == "runtime_failed" and first.error), first
    second = await session.runtime("image-inspect", image=busybox_image)
    assert second.ok, second.error
    run = await session.runtime("workload-run", workload={"name": "", "image": busybox_image,
                                                          "remove_after_exit": True, "command": ["echo", "back"]})
    assert run.ok and run.runtime.output == b"back\n"  # type: ignore[union-attr]
    assert daemon.process is not None and daemon.process.pid == provider_pid and daemon.process.poll() is None

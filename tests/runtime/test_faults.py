"""Client disconnects during long operations, and a Docker Engine restart between calls."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import shutil
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
from tests.runtime.conftest import container_exists, image_exists, main_dockerd_pid, uniq

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


async def wait_cancelled(daemon: Daemon) -> None:
    """Until no operation is in flight: the dropped one was cancelled and its cleanup ran."""
    with anyio.fail_after(20):
        while (await daemon.control(operation="status"))["in_flight"]:
            await anyio.sleep(0.1)


async def test_disconnect_during_sync_run_removes_its_container(daemon: Daemon, session: Session,
                                                                busybox_image: str) -> None:
    name = uniq("sync")

    def running() -> bool:
        return docker("ps", "-q", "--filter", f"name=^{name}$").stdout.strip() != b""

    await send_and_drop(session, {"action": "workload-run", "workload": {
        "name": name, "image": busybox_image, "command": ["sleep", "60"]}}, running)
    await wait_cancelled(daemon)
    with anyio.fail_after(20):
        while container_exists(name):
            await anyio.sleep(0.1)
    # The cleanup RPC the adapter sends next, on a fresh connection, succeeds.
    assert (await session.runtime("workload-remove", name=name)).ok


async def test_disconnect_during_build_cancels_it(daemon: Daemon, session: Session, busybox_image: str,
                                                  tmp_path: pathlib.Path) -> None:
    context = str(tmp_path)
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
    started = time.monotonic()
    await send_and_drop(session, {"action": "image-pull", "image": f"{silent_registry}/capsules/m:1"},
                        lambda: time.monotonic() - started > 1.5)
    await wait_cancelled(daemon)
    with anyio.fail_after(5):
        assert (await session.call("capabilities")).ok
        assert (await daemon.control(operation="status"))["in_flight"] == 0


def _dockerd_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0


def _running(pid: int) -> bool:
    """Alive and not a zombie (a dockerd this test process started earlier is its child: reap it)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def _restart_dockerd() -> None:
    """Stop dockerd and bring it back; whatever happens, dockerd is running again afterwards."""
    pid = main_dockerd_pid()
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 90  # dockerd first stops its containers
        while _running(pid):
            assert time.monotonic() < deadline, "dockerd did not stop"
            time.sleep(0.1)
    finally:
        time.sleep(1)  # a supervisor (systemd) may restart it by itself
        if not _dockerd_up():
            with open("/var/log/coldsnap-dockerd.log", "ab") as log:
                subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60
        while not _dockerd_up():
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


async def test_disconnect_during_copy_from_leaves_nothing_half_written(daemon: Daemon, session: Session,
                                                                     busybox_image: str,
                                                                     tmp_path: pathlib.Path) -> None:
    name = uniq("copy")
    assert (await session.runtime("workload-run", workload={
        "name": name, "image": busybox_image, "detached": True,
        "command": ["sh", "-c", "dd if=/dev/zero of=/big bs=1M count=768 2>/dev/null && touch /ready && sleep 60"]})).ok
    base = str(tmp_path)
    try:
        with anyio.fail_after(60):
            while not (await session.runtime("workload-exec", name=name,
                                             execution={"command": ["test", "-e", "/ready"]})).ok:
                await anyio.sleep(0.2)
        assert daemon.process is not None
        fd_dir = f"/proc/{daemon.process.pid}/fd"

        def spooling() -> bool:  # the daemon holds its (unlinked) spool file open while copying
            for fd in os.listdir(fd_dir):
                try:
                    target = os.readlink(f"{fd_dir}/{fd}")
                    # In the spool directory (docker.spool_dir, /var/tmp by default), unlinked.
                    if target.startswith("/var/tmp/") and target.endswith(" (deleted)"):
                        return True
                except OSError:
                    continue
            return False

        await send_and_drop(session, {"action": "workload-copy-from", "name": name, "path": "/big",
                                      "destination": f"{base}/big"}, spooling)
        with anyio.fail_after(20):
            while spooling():
                await anyio.sleep(0.1)
        assert os.listdir(base) == []  # neither the destination nor any staging
        assert (await session.call("capabilities")).ok
    finally:
        assert (await session.runtime("workload-remove", name=name)).ok


async def test_sigkill_and_restart_keep_sessions_and_workload_names(busybox_image: str) -> None:
    from tests.helpers import running_daemon

    state = pathlib.Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    name = uniq("survivor")
    try:
        async with running_daemon(state_dir=state) as first:
            s = await first.open_session()
            assert (await s.runtime("workload-run", workload={"name": name, "image": busybox_image,
                                                              "detached": True, "command": ["sleep", "60"]})).ok
            assert first.process is not None
            first.process.kill()
            first.process.wait()
        async with running_daemon(state_dir=state) as second:
            info = await s.runtime("workload-inspect", name=name)
            assert info.ok and info.runtime.workload.running  # type: ignore[union-attr]
            assert (await s.runtime("workload-remove", name=name)).ok
            assert [x["session"] for x in await second.control(operation="session-list")] == [s.session]
    finally:
        docker("rm", "-f", name, check=False)
        shutil.rmtree(state, ignore_errors=True)


async def test_sigkill_mid_attached_run_leaves_no_container_and_no_conflict_after_restart(
        busybox_image: str) -> None:
    """Regression: #11 (finding 15): the attached remove_after_exit container stayed; the rerun got "Conflict"."""
    from tests.helpers import running_daemon

    state = pathlib.Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    name = uniq("attached")
    workload = {"name": name, "image": busybox_image, "remove_after_exit": True, "command": ["sleep", "60"]}
    try:
        async with running_daemon(state_dir=state) as first:
            s = await first.open_session()
            request = s.envelope("runtime", host="localhost", runtime={"action": "workload-run", "workload": workload})
            stream = await anyio.connect_unix(s.socket)
            await stream.send(json.dumps(request).encode() + b"\n")
            await stream.send_eof()
            with anyio.fail_after(20):
                while docker("ps", "-q", "--filter", f"name=^{name}$").stdout.strip() == b"":
                    await anyio.sleep(0.1)
            assert first.process is not None
            first.process.kill()
            first.process.wait()
            await stream.aclose()
            assert container_exists(name)  # nothing ran its cleanup: the leftover of the finding
        async with running_daemon(state_dir=state):
            with anyio.fail_after(20):  # start-up recovery removes this instance's leftover
                while container_exists(name):
                    await anyio.sleep(0.1)
            again = await s.runtime("workload-run", workload={**workload, "command": ["echo", "again"]})
            assert again.ok and again.runtime.output == b"again\n", again  # type: ignore[union-attr]
    finally:
        docker("rm", "-f", name, check=False)
        shutil.rmtree(state, ignore_errors=True)


async def test_abusive_clients_do_not_disturb_legitimate_ones(session: Session, busybox_image: str) -> None:
    """Slow-loris, oversize, malformed, wrong-token and wrong-host traffic alongside real calls."""
    stop = anyio.Event()
    abuse_replies: list[bytes] = []

    async def slow_loris() -> None:
        while not stop.is_set():
            try:
                async with await anyio.connect_unix(session.socket) as stream:
                    await stream.send(b'{"format":1,')
                    await anyio.sleep(0.5)
            except OSError:
                pass

    async def junk(payload: bytes) -> None:
        while not stop.is_set():
            try:
                abuse_replies.append(await session.raw(payload))
            except OSError:
                pass

    wrong_token = json.dumps({**session.envelope("capabilities"), "token": "forged"}).encode() + b"\n"
    wrong_host = json.dumps(session.envelope("exec", host="elsewhere", arguments=["true"])).encode() + b"\n"
    legit_ok = legit_total = 0
    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(slow_loris)
        for payload in (b"{not json\n", b'{"format":1,"id":"x","' + b"a" * (1 << 20) + b'\n', wrong_token,
                        wrong_host, b"\x00\xff" * 64):
            tg.start_soon(junk, payload)
        for _ in range(100):
            reply = await session.runtime("image-inspect", image=busybox_image)
            legit_total += 1
            legit_ok += reply.ok
        stop.set()
    assert legit_ok == legit_total == 100
    assert abuse_replies and all(json.loads(r)["ok"] is False for r in abuse_replies if r)


async def test_docker_restart_with_a_call_in_flight_fails_cleanly_and_leaves_nothing(
        daemon: Daemon, session: Session, busybox_image: str) -> None:
    name = uniq("inflight")
    replies = []

    async def long_run() -> None:
        replies.append(await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "remove_after_exit": True,
            # PID 1 ignores SIGTERM unless it traps it: exit at once when dockerd stops the container.
            "command": ["sh", "-c", "trap 'exit 143' TERM; sleep 60 & wait"]}))

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_run)
        with anyio.fail_after(20):
            while docker("ps", "-q", "--filter", f"name=^{name}$").stdout.strip() == b"":
                await anyio.sleep(0.1)
        await anyio.to_thread.run_sync(_restart_dockerd)
    assert not replies[0].ok and replies[0].error_code == "runtime_failed"  # type: ignore[attr-defined]
    with anyio.fail_after(30):  # the provider's deferred cleanup removes what the restart left
        while container_exists(name):
            await anyio.sleep(0.2)
    assert (await session.runtime("image-inspect", image=busybox_image)).ok

"""Sessions: modes and ownership, persistence across restarts, SO_PEERCRED on the control socket."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_provider import ReplyError
from tests.helpers import EXEC_AS_NOBODY, Daemon, control_as, module_daemon, running_daemon, short_dir


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """One daemon of the default configuration for this module's tests that open sessions of their own names and
    leave its files' modes as they are (a start and a stop are about a second of the 2-core CI box)."""
    yield from module_daemon(None)


async def test_session_socket_and_directory_are_private(daemon: Daemon) -> None:
    s = await daemon.open_session("op-1")
    socket_path = Path(s.socket)
    assert socket_path == daemon.state_dir / "sessions" / "op-1" / "provider.sock"
    assert stat.S_ISSOCK(os.lstat(socket_path).st_mode)
    assert mode(socket_path) == 0o600 and mode(socket_path.parent) == 0o700
    assert mode(daemon.state_dir / "control.sock") == 0o660
    record = (daemon.state_dir / "records" / "op-1.json").read_text()
    assert s.token not in record and json.loads(record)["token_sha256"]


async def test_session_is_owned_by_the_uid_that_opened_it() -> None:
    nobody = 65534
    async with running_daemon(f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{nobody}]\n") as daemon:
        os.chmod(daemon.state_dir / "control.sock", 0o666)
        reply = control_as(nobody, daemon.state_dir, {"operation": "session-open", "session": "op-nobody",
                                                       "hosts": ["localhost"]})
        assert reply["ok"], reply
        socket_path = Path(reply["result"]["socket"])
        assert os.lstat(socket_path).st_uid == nobody and os.stat(socket_path.parent).st_uid == nobody
        listed = control_as(nobody, daemon.state_dir, {"operation": "session-list"})
        assert [x["session"] for x in listed["result"]] == ["op-nobody"]


async def test_control_socket_refuses_an_unlisted_uid() -> None:
    nobody = 65534
    async with running_daemon() as daemon:
        os.chmod(daemon.state_dir / "control.sock", 0o666)  # file modes allow it: SO_PEERCRED must not
        reply = control_as(nobody, daemon.state_dir, {"operation": "session-open", "session": "op-denied",
                                                       "hosts": ["localhost"]})
        # Refused before a byte of the request is read (so it holds no slot), hence no id to echo.
        assert reply == {"format": 1, "id": "", "ok": False,
                         "error": "uid 65534 (gid 65534) may not use the control socket"}
        assert not (daemon.state_dir / "sessions" / "op-denied").exists()


async def test_control_socket_group_is_configurable() -> None:
    async with running_daemon('[server]\ncontrol_group = "nogroup"\n') as daemon:
        assert os.stat(daemon.state_dir / "control.sock").st_gid == 65534


async def test_session_open_from_a_coldsnap_request() -> None:
    request = {"id": "req-7", "launch": {"units": [{"host": "localhost"}, {"host": "node-b"},
                                                   {"host": "localhost"}]}}
    async with running_daemon() as daemon:
        result = await daemon.control(operation="session-open", request=request)
        assert result["session"] == "req-7"
        sessions = await daemon.control(operation="session-list")
        assert sessions[0]["hosts"] == ["localhost", "node-b"]
        with pytest.raises(ReplyError, match=r"launch.units\[0\].host"):
            await daemon.control(operation="session-open", request={"id": "r", "launch": {"units": [{}]}})


async def test_session_open_twice_is_an_error_and_close_removes_it(daemon: Daemon) -> None:
    s = await daemon.open_session("op-dup")
    with pytest.raises(ReplyError, match="already exists"):
        await daemon.open_session("op-dup")
    await daemon.control(operation="session-close", session="op-dup")
    assert not Path(s.socket).parent.exists()
    assert not (daemon.state_dir / "records" / "op-dup.json").exists()
    with pytest.raises(ReplyError, match="does not exist"):
        await daemon.control(operation="session-close", session="op-dup")
    with pytest.raises(OSError):
        await s.call("capabilities")


@pytest.mark.parametrize("bad", ["../x", "a/b", ".hidden", "", "x" * 200, "a b"])
async def test_session_ids_that_cannot_name_a_directory_are_refused(daemon: Daemon, bad: str) -> None:
    records = sorted(os.listdir(daemon.state_dir / "records"))  # the module's daemon: other tests' sessions
    with pytest.raises(ReplyError):
        await daemon.control(operation="session-open", session=bad, hosts=["localhost"])
    assert sorted(os.listdir(daemon.state_dir / "records")) == records


async def test_sessions_survive_a_daemon_restart() -> None:
    state = short_dir()
    try:
        async with running_daemon(state_dir=state) as daemon:
            s = await daemon.open_session("op-keep", labels={"team": "a"}, cluster_id="c1")
        async with running_daemon(state_dir=state) as daemon:
            reply = await s.call("capabilities")
            assert reply.ok
            listed = await daemon.control(operation="session-list")
            assert [x["session"] for x in listed] == ["op-keep"] and listed[0]["labels"] == {"team": "a"}
            assert mode(s.socket) == 0o600
            forged = await s.call("capabilities", check=False, token="forged")
            assert not forged.ok
    finally:
        shutil.rmtree(state, ignore_errors=True)


async def test_a_damaged_record_is_skipped_not_fatal() -> None:
    state = short_dir()
    try:
        async with running_daemon(state_dir=state) as daemon:
            await daemon.open_session("op-good")
            await daemon.open_session("op-bad")
        (state / "records" / "op-bad.json").write_text("{truncated")
        async with running_daemon(state_dir=state) as daemon:
            listed = await daemon.control(operation="session-list")
            assert [x["session"] for x in listed] == ["op-good"]
            assert "skipping damaged session record" in daemon.log()
    finally:
        shutil.rmtree(state, ignore_errors=True)


async def test_status_reports_version_sessions_and_docker() -> None:
    async with running_daemon() as daemon:
        await daemon.open_session()
        status = await daemon.control(operation="status")
        assert status["version"] == "0.1.0" and status["sessions"] == 1
        assert status["docker_reachable"] is True and status["in_flight"] == 0
        assert status["uptime_s"] >= 0
    async with running_daemon('[docker]\nurl = "unix:///nonexistent.sock"\n') as daemon:
        status = await daemon.control(operation="status")
        assert status["docker_reachable"] is False


async def test_a_closed_session_leaves_listings_at_once() -> None:
    async with running_daemon() as daemon:
        for i in range(20):  # the session's task unwinds later: listings must not wait for it
            await daemon.open_session(f"op-race-{i}")
            await daemon.control(operation="session-close", session=f"op-race-{i}")
            assert (await daemon.control(operation="status"))["sessions"] == 0
            assert await daemon.control(operation="session-list") == []


NOBODY = 65534


async def test_session_socket_cannot_be_redirected_by_a_racing_symlink(tmp_path: Path) -> None:
    """Regression: #11 finding 2 (chmod/chown of the socket path followed a planted symlink)."""
    target = tmp_path / "root-owned"
    target.write_text("secret\n")
    target.chmod(0o644)
    state = short_dir()
    async with running_daemon(f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\n", state_dir=state) as daemon:
        os.chmod(daemon.state_dir / "control.sock", 0o666)
        reply = control_as(NOBODY, daemon.state_dir, {"operation": "session-open", "session": "op-race",
                                                      "hosts": ["localhost"]})
        assert reply["ok"], reply
    directory = state / "sessions" / "op-race"
    # The session's owner swaps a symlink to a root-owned file over its socket, as fast as it can,
    # while the daemon restarts and re-binds the socket.
    racer = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
         "import os, sys\n"
         f"d, t = {str(directory)!r}, {str(target)!r}\n"
         "while True:\n"
         "    try:\n"
         "        os.symlink(t, d + '/l'); os.rename(d + '/l', d + '/provider.sock')\n"
         "    except OSError:\n"
         "        pass\n"])
    try:
        for _ in range(3):
            async with running_daemon(state_dir=state):
                pass
    finally:
        racer.kill()
        racer.wait()
    info = target.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (0, 0o644)
    assert target.read_text() == "secret\n"


async def test_record_with_an_out_of_range_uid_is_skipped_not_fatal() -> None:
    """Regression: #11 finding 9 (OverflowError from os.chown stopped every start)."""
    state = short_dir()
    (state / "records").mkdir(parents=True, mode=0o700)
    (state / "records" / "op-big.json").write_text(json.dumps(
        {"session": "op-big", "token_sha256": "0" * 64, "hosts": ["localhost"], "uid": 1 << 40, "gid": 0}))
    async with running_daemon(state_dir=state) as daemon:
        assert (await daemon.control(operation="status"))["sessions"] == 0
        assert "skipping damaged session record" in daemon.log()
        s = await daemon.open_session()
        assert (await s.call("capabilities")).ok


async def test_close_of_a_session_that_is_not_live_checks_its_owner() -> None:
    """Regression: #11 finding 10 (session-close skipped the owner check for sessions not being served)."""
    state = short_dir()
    async with running_daemon(f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\n", state_dir=state) as daemon:
        await daemon.open_session("op-root")
    # A directory where the socket goes: the session cannot be bound at the next start, so it is not live.
    (state / "sessions" / "op-root" / "provider.sock").unlink()
    (state / "sessions" / "op-root" / "provider.sock").mkdir()
    async with running_daemon(f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\n", state_dir=state) as daemon:
        assert (await daemon.control(operation="status"))["sessions"] == 0
        os.chmod(daemon.state_dir / "control.sock", 0o666)
        reply = control_as(NOBODY, daemon.state_dir, {"operation": "session-close", "session": "op-root"})
        assert reply["ok"] is False and reply["error"] == "session 'op-root' belongs to another user"
        assert (state / "records" / "op-root.json").exists()

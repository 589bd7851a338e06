"""Abuse over the real sockets: what no client may do to the daemon (issue 11's findings and their kind).

Every test talks to a real `coldsnap-provider serve` process and ends by checking that the
daemon still answers.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from coldsnap_provider._client import exchange
from tests.helpers import EXEC_AS_NOBODY, Daemon, Session, control_as, module_daemon, running_daemon

NOBODY = 65534


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def raw_control(daemon: Daemon, payload: bytes) -> dict[str, Any]:
    data = await exchange(daemon.state_dir / "control.sock", payload)
    reply: dict[str, Any] = json.loads(data)
    return reply


async def still_serving(daemon: Daemon, session: Session | None = None) -> None:
    assert daemon.process is not None and daemon.process.poll() is None, daemon.log()
    assert (await daemon.control(operation="status"))["version"]
    if session is not None:
        assert (await session.call("capabilities")).ok


async def wait_for_status(daemon: Daemon, predicate: Any) -> dict[str, Any]:
    """Poll `status` until `predicate` holds (callers bound it with fail_after)."""
    while True:
        status: dict[str, Any] = await daemon.control(operation="status")
        if predicate(status):
            return status
        await anyio.sleep(0.05)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """One daemon of the default configuration for this module's tests that each open a session of their own and
    change nothing of the daemon's but what they assert on: a start and a stop are about a second of the 2-core CI
    box. (Each still checks that the daemon serves on afterwards; a test that needs its own configuration, limits
    or a fresh state starts its own.)"""
    yield from module_daemon(None)


class TestDeepNesting:
    """Regression: #11 finding 1 (JSON nested ~1000 deep killed the daemon before authentication)."""

    @pytest.mark.parametrize("where", ["id", "unknown", "request"])
    async def test_control_request_nested_deep_is_refused_and_daemon_survives(self, daemon: Daemon,
                                                                              where: str) -> None:
        deep = nested(5000)
        body = {"id": f'"id":{deep}',
                "unknown": f'"id":"x","junk":{deep}',
                "request": f'"id":"x","request":{{"id":"op","launch":{deep}}}'}[where]
        line = f'{{"format":1,"operation":"session-open",{body}}}\n'.encode()
        reply = await raw_control(daemon, line)
        assert reply["ok"] is False and reply["format"] == 1
        await still_serving(daemon)

    async def test_provider_request_nested_deep_is_refused_and_daemon_survives(self, daemon: Daemon) -> None:
        s = await daemon.open_session()
        for body in (f'"id":{nested(5000)}', f'"id":"7","x":{nested(5000)}'):
            reply = json.loads(await s.raw(f'{{"format":1,{body}}}\n'.encode()))
            assert reply["ok"] is False and "id" in reply
        await still_serving(daemon, s)


class TestDuplicateKeys:
    """Regression: #11 finding 16 (duplicate keys were accepted, last one winning)."""

    async def test_duplicate_token_does_not_authenticate(self, daemon: Daemon, tmp_path: Path) -> None:
        marker = tmp_path / "ran"
        s = await daemon.open_session()
        head = f'{{"format":1,"id":"9","token":"wrong","token":{json.dumps(s.token)}'
        line = (head + f',"session":"{s.session}","operation":"exec","host":"localhost",'
                f'"arguments":["touch","{marker}"]}}\n').encode()
        reply = json.loads(await s.raw(line))
        assert reply == {"format": 1, "id": "9", "ok": False,
                         "error": "host-provider request repeats the key 'token'; every key may appear once"}
        assert not marker.exists()
        await still_serving(daemon, s)

    async def test_duplicate_keys_in_a_control_request_are_refused(self, daemon: Daemon) -> None:
        line = b'{"format":1,"id":"d","operation":"session-open","session":"a","session":"b","hosts":["h"]}\n'
        reply = await raw_control(daemon, line)
        assert reply["ok"] is False and "repeats the key 'session'" in reply["error"]
        assert not (daemon.state_dir / "records" / "a.json").exists()
        assert not (daemon.state_dir / "records" / "b.json").exists()


class TestTrailingNewlines:
    """Regression: #11 finding 11 (`$` accepted a trailing newline in identifiers)."""

    async def test_session_id_with_trailing_newline_is_refused(self, daemon: Daemon) -> None:
        records = sorted(os.listdir(daemon.state_dir / "records"))  # the module's daemon: other tests' sessions
        reply = await raw_control(daemon, json.dumps(
            {"format": 1, "id": "n", "operation": "session-open", "session": "abc\n",
             "hosts": ["localhost"]}).encode() + b"\n")
        assert reply["ok"] is False and "is invalid" in reply["error"]
        assert sorted(os.listdir(daemon.state_dir / "records")) == records

    async def test_token_with_trailing_newline_is_refused_naming_the_field(self, daemon: Daemon) -> None:
        s = await daemon.open_session()
        request = s.envelope("capabilities")
        request["token"] = s.token + "\n"
        reply = json.loads(await s.raw(json.dumps(request).encode() + b"\n"))
        assert reply["ok"] is False and "$.token" in reply["error"]


class TestConnectionBudgets:
    """Regression: #11 finding 4 (unauthorised peers could take every connection slot)."""

    async def test_refused_peers_never_hold_a_slot(self) -> None:
        async with running_daemon("[server]\nmax_connections = 4\n") as daemon:
            s = await daemon.open_session()
            os.chmod(daemon.state_dir / "control.sock", 0o666)  # reachable; SO_PEERCRED must refuse
            holder = subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
                 "import socket, sys, time\n"
                 "socks = [socket.socket(socket.AF_UNIX) for _ in range(20)]\n"
                 f"[x.connect({str(daemon.state_dir / 'control.sock')!r}) for x in socks]\n"
                 "print('held', flush=True)\n"
                 "time.sleep(60)\n"], stdout=subprocess.PIPE)
            try:
                assert holder.stdout is not None
                assert await anyio.to_thread.run_sync(holder.stdout.readline) == b"held\n"
                # Twenty connections from a refused uid, a cap of four: root is still served.
                assert (await s.call("capabilities")).ok
                status = await daemon.control(operation="status")
                assert str(NOBODY) not in status["budgets"]["connections_by_uid"]
            finally:
                holder.kill()
                holder.wait()

    async def test_one_uid_cannot_take_every_slot(self) -> None:
        config = (f"{EXEC_AS_NOBODY}[server]\nmax_connections_per_uid = 2\ncontrol_uids = [{NOBODY}]\n"
                  "request_read_timeout_s = 20\n")
        async with running_daemon(config) as daemon:
            s = await daemon.open_session()
            os.chmod(daemon.state_dir / "control.sock", 0o666)  # nobody is listed; the file mode must let it in

            async def status_as_nobody() -> dict[str, Any]:
                reply = await anyio.to_thread.run_sync(
                    lambda: control_as(NOBODY, daemon.state_dir, {"operation": "status"}))
                assert reply["ok"] is True  # another uid keeps its own budget
                result: dict[str, Any] = reply["result"]["budgets"]
                return result

            idle = [await anyio.connect_unix(s.socket) for _ in range(2)]
            try:
                with anyio.fail_after(10):
                    while (await status_as_nobody())["connections_by_uid"].get("0") != 2:
                        await anyio.sleep(0.05)
                reply = await s.call("capabilities")
                assert not reply.ok and "connection limit for uid 0 (2)" in str(reply.error)
            finally:
                for stream in idle:
                    await stream.aclose()
            with anyio.fail_after(10):
                while "0" in (await status_as_nobody())["connections_by_uid"]:
                    await anyio.sleep(0.05)
            assert (await s.call("capabilities")).ok


class TestMemory:
    """Regression: #11 findings 5 and 6 (no write timeout; buffered bytes unbounded)."""

    async def test_peer_that_never_reads_is_dropped_after_the_write_timeout(self) -> None:
        async with running_daemon("[server]\nreply_write_timeout_s = 1.0\n") as daemon:
            s = await daemon.open_session()
            request = s.envelope("exec", host="localhost", arguments=["head", "-c", "30000000", "/dev/zero"])
            stream = await anyio.connect_unix(s.socket)
            try:
                await stream.send(json.dumps(request).encode() + b"\n")
                await stream.send_eof()
                # It never reads: the daemon gives up on it and releases the reply's bytes.
                with anyio.fail_after(15):
                    await wait_for_status(daemon, lambda st: st["connections"] == 1
                                          and st["budgets"]["buffered_bytes"] < 1 << 20)
                assert "reply not read within the write timeout" in daemon.log()
            finally:
                await stream.aclose()
            await still_serving(daemon, s)

    async def test_request_past_the_byte_budget_is_refused(self) -> None:
        config = "[server]\nmax_buffered_bytes = 1048576\nmax_buffered_bytes_per_uid = 1048576\n"
        async with running_daemon(config) as daemon:
            s = await daemon.open_session()
            reply = await s.call("exec", host="localhost", arguments=["cat"], input=b"x" * (2 << 20))
            assert not reply.ok
            assert "holding its limit of 1048576 buffered bytes for uid 0" in str(reply.error)
            with anyio.fail_after(10):
                status = await wait_for_status(daemon, lambda st: st["budgets"]["buffered_bytes"] < 4096)
            assert status["budgets"]["max_buffered_bytes"] == 1048576
            assert status["budgets"]["max_buffered_bytes_per_uid"] == 1048576
            assert (await s.call("exec", host="localhost", arguments=["cat"], input=b"y" * 1000)).ok


class TestProbeProgram:
    """Regression: #11 finding 3 (the control `probe` ran a request-named `criu` as root)."""

    async def test_probe_request_cannot_name_a_program(self, daemon: Daemon, tmp_path: Path) -> None:
        marker = tmp_path / "ran-as-root"
        script = tmp_path / "criu"
        script.write_text(f"#!/bin/sh\ntouch {marker}\n")
        script.chmod(0o755)
        line = json.dumps({"format": 1, "id": "p", "operation": "probe", "driver": "n610",
                           "host_process": True, "criu": str(script)}).encode() + b"\n"
        reply = await raw_control(daemon, line)
        assert reply["ok"] is False and "unknown field `criu`" in reply["error"]
        assert not marker.exists()


def test_arbitrary_control_bytes_never_stop_the_daemon(daemon: Daemon) -> None:
    """A small deterministic fuzz of the control socket (the provider socket has its own in test_wire)."""
    payloads = [b"", b"\n", b"{" * 100000 + b"\n", b'{"format":1}' * 1000 + b"\n", b"\xff\xfe\x00\n",
                b'{"format":1,"id":"\\ud800","operation":"status"}\n', b'[' * 3000 + b"\n",
                b'{"format":1,"id":"a","operation":"status","format":1}\n', b"x" * (3 << 20)]

    async def main() -> None:
        for payload in payloads:
            try:
                data = await exchange(daemon.state_dir / "control.sock", payload)
            except OSError:
                continue
            if data:
                assert json.loads(data)["ok"] is False
        await still_serving(daemon)

    anyio.run(main)


class TestReviewFindings:
    """Found by the adversarial review of the restructured daemon (issue 11, "the rest of their kind")."""

    async def test_running_out_of_descriptors_is_survived(self) -> None:
        """accept()'s EMFILE arrives from anyio as BrokenResourceError: it must back off, not exit."""
        async with running_daemon("[server]\nrequest_read_timeout_s = 30\n") as daemon:
            s = await daemon.open_session()
            assert daemon.process is not None
            resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE, (128, 128))
            idle = []
            try:
                for _ in range(200):  # more than the daemon can hold
                    idle.append(await anyio.connect_unix(s.socket))
                with anyio.fail_after(10):
                    while daemon.process.poll() is None and "accept failed; backing off" not in daemon.log():
                        await anyio.sleep(0.05)
                assert daemon.process.poll() is None, daemon.log()[-3000:]
            finally:
                for stream in idle:
                    await stream.aclose()
            with anyio.fail_after(15):
                while True:
                    try:
                        if (await s.call("capabilities")).ok:
                            break
                    except OSError:
                        pass
                    await anyio.sleep(0.1)
            await still_serving(daemon, s)

    async def test_one_uid_cannot_take_the_whole_byte_budget_from_root(self) -> None:
        config = (f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\nmax_buffered_bytes = 4194304\n"
                  "max_buffered_bytes_per_uid = 4194304\n")
        async with running_daemon(config) as daemon:
            os.chmod(daemon.state_dir / "control.sock", 0o666)
            s = await daemon.open_session()
            opened = control_as(NOBODY, daemon.state_dir, {"operation": "session-open", "session": "op-hog",
                                                           "hosts": ["localhost"]})
            hog = subprocess.Popen(
                ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
                 "import socket, sys, time\n"
                 "x = socket.socket(socket.AF_UNIX)\n"
                 f"x.connect({opened['result']['socket']!r})\n"
                 "x.sendall(b'{\"id\":\"' + b'a' * (7 << 19))\n"  # most of the budget, never a newline
                 "print('held', flush=True)\n"
                 "time.sleep(60)\n"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            try:
                assert hog.stdout is not None
                assert await anyio.to_thread.run_sync(hog.stdout.readline) == b"held\n"
                with anyio.fail_after(10):
                    while (await daemon.control(operation="status"))["budgets"]["buffered_bytes"] < 3 << 20:
                        await anyio.sleep(0.05)
                # Root is held only to its own share: the budget nobody filled does not starve it.
                reply = await s.call("exec", host="localhost", arguments=["cat"], input=b"r" * (1 << 20))
                assert reply.ok and len(reply.output) == 1 << 20
            finally:
                hog.kill()
                hog.wait()

    async def test_exec_output_is_charged_to_the_byte_budget(self) -> None:
        async with running_daemon("[server]\nmax_buffered_bytes_per_uid = 8388608\n") as daemon:
            s = await daemon.open_session()
            reply = await s.call("exec", host="localhost", arguments=["head", "-c", "20000000", "/dev/zero"])
            assert not reply.ok and "holding its limit of 8388608 buffered bytes for uid 0" in str(reply.error)
            assert (await s.call("exec", host="localhost", arguments=["head", "-c", "1000", "/dev/zero"])).ok

    async def test_control_requests_are_small(self, daemon: Daemon) -> None:
        line = json.dumps({"format": 1, "id": "big", "operation": "session-open", "session": "op-big",
                           "request": {"id": "op-big", "pad": [0] * (1 << 20)}}).encode() + b"\n"
        reply = await raw_control(daemon, line)
        assert reply == {"format": 1, "id": "big", "ok": False, "error": "control request exceeds 1048576 bytes"}
        await still_serving(daemon)

    async def test_sessions_per_uid_are_capped(self) -> None:
        config = f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}]\nmax_sessions_per_uid = 2\n"
        async with running_daemon(config) as daemon:
            os.chmod(daemon.state_dir / "control.sock", 0o666)
            replies = [control_as(NOBODY, daemon.state_dir, {"operation": "session-open", "session": f"op-cap-{i}",
                                                             "hosts": ["localhost"]}) for i in range(3)]
            assert [r["ok"] for r in replies] == [True, True, False]
            assert replies[2]["error"] == ("uid 65534 already holds 2 sessions (server.max_sessions_per_uid); "
                                           "close one first")
            assert not (daemon.state_dir / "records" / "op-cap-2.json").exists()
            await daemon.open_session()  # root is not capped

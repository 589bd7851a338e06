"""Many clients, idle clients, the connection cap, disconnects and SIGTERM draining."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from tests.helpers import Daemon, running_daemon


async def test_many_simultaneous_connections_are_served() -> None:
    async with running_daemon() as daemon:
        s = await daemon.open_session()
        results: list[bool] = []

        async def one(i: int) -> None:
            reply = await s.call("exec", host="localhost", arguments=["echo", str(i)])
            results.append(reply.ok and reply.output == f"{i}\n".encode())

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(one, i)
        assert len(results) == 100 and all(results)


async def test_idle_client_does_not_block_others_and_times_out() -> None:
    async with running_daemon("[server]\nrequest_read_timeout_s = 1.0\n") as daemon:
        s = await daemon.open_session()
        async with await anyio.connect_unix(s.socket) as idle:
            reply = await s.call("capabilities")  # served while the idle client waits
            assert reply.ok
            data = b""
            with anyio.fail_after(5):
                try:
                    while True:
                        data += await idle.receive()
                except anyio.EndOfStream:
                    pass
        assert b"was not received within 1 s" in data


async def test_connections_past_the_cap_get_a_clear_error() -> None:
    async with running_daemon("[server]\nmax_connections = 2\nrequest_read_timeout_s = 5.0\n") as daemon:
        s = await daemon.open_session()
        holders = [await anyio.connect_unix(s.socket) for _ in range(2)]
        try:
            with anyio.fail_after(10):
                while (reply := await s.call("capabilities")).ok:  # until the daemon has accepted both
                    await anyio.sleep(0.05)
            assert "connection limit (2)" in str(reply.error)
        finally:
            for h in holders:
                await h.aclose()
        with anyio.fail_after(10):
            while not (await s.call("capabilities")).ok:
                await anyio.sleep(0.05)


async def wait_in_flight(daemon: Daemon, count: int) -> None:
    with anyio.fail_after(10):
        while (await daemon.control(operation="status"))["in_flight"] != count:
            await anyio.sleep(0.05)


async def wait_refusing(path: Path) -> None:
    """Until the daemon has stopped accepting (a connection is refused)."""
    with anyio.fail_after(10):
        while True:
            try:
                stream = await anyio.connect_unix(path)
            except OSError:
                return
            await stream.aclose()
            await anyio.sleep(0.05)


async def test_client_disconnect_mid_operation_cancels_it_and_daemon_stays_healthy(tmp_path: Path) -> None:
    pid_file = tmp_path / "exec.pid"
    async with running_daemon() as daemon:
        s = await daemon.open_session()
        stream, pid = await s.exec_in_background(f"echo $$ > {pid_file}; exec sleep 30", pid_file)
        await wait_in_flight(daemon, 1)
        await stream.aclose()
        await wait_in_flight(daemon, 0)  # the hang-up cancelled it
        assert (await s.call("exec", host="localhost", arguments=["true"])).ok
        # The cancelled exec's process group was killed and reaped, not orphaned.
        assert not Path(f"/proc/{pid}").exists()


async def test_sigterm_drains_in_flight_operations_then_exits() -> None:
    async with running_daemon("[server]\nshutdown_grace_s = 20\n") as daemon:
        s = await daemon.open_session()
        replies = []

        async def slow() -> None:
            replies.append(await s.call("exec", host="localhost", arguments=["sh", "-c", "sleep 1.5; echo done"]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await wait_in_flight(daemon, 1)
            assert daemon.process is not None
            daemon.process.send_signal(signal.SIGTERM)
            await wait_refusing(daemon.state_dir / "control.sock")
            with pytest.raises(OSError):  # the session's door is closed too, while `slow` finishes
                await s.call("capabilities")
        assert replies and replies[0].ok and replies[0].output == b"done\n"
        code = await anyio.to_thread.run_sync(daemon.process.wait, 10)
        assert code == 0
        assert '"event": "stopping"' in daemon.log()


async def test_shutdown_grace_expiry_cancels_stragglers() -> None:
    async with running_daemon("[server]\nshutdown_grace_s = 0.5\n") as daemon:
        s = await daemon.open_session()
        replies = []
        async with anyio.create_task_group() as tg:

            async def stuck() -> None:
                replies.append(await s.call("exec", host="localhost", arguments=["sleep", "60"]))

            tg.start_soon(stuck)
            await wait_in_flight(daemon, 1)
            assert daemon.process is not None
            daemon.process.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(daemon.process.wait, 15)
        assert code == 0 and "shutdown grace expired" in daemon.log()
        assert not replies[0].ok and replies[0].error_code == "runtime_failed"
        assert "shutting down" in str(replies[0].error)

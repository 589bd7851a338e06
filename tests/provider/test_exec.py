"""`exec` and `upload` through the real daemon."""

from __future__ import annotations

import base64
import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import anyio
import msgspec
import pytest

from tests.helpers import Session, module_daemon, running_daemon, short_dir


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    """One daemon and one session for the tests that only run commands and uploads (a daemon start is about a
    second); those that read its log, set its environment or user, or kill it start their own."""
    with closing(module_daemon(None)) as daemons:
        yield anyio.run(next(daemons).open_session)


@pytest.fixture
def shared(top: Path) -> Path:
    """A sticky world-writable directory (like /tmp) that exec can use whatever account it runs as: root,
    nobody or the systemd unit's own (COLDSNAP_TEST_UNIT=1, docs/systemd.md); pytest's tree is root's 0700."""
    path = top / "shared"
    path.mkdir()
    path.chmod(0o1777)
    return path


async def test_exec_argv_survives_exactly_without_a_shell(session: Session) -> None:
    argv = ["printf", "%s|", "a b", "$HOME", "x;y", "*", "", "'q'", "\\n"]
    reply = await session.call("exec", host="localhost", arguments=argv)
    assert reply.ok and reply.exit_code == 0
    assert reply.output == b"a b|$HOME|x;y|*||'q'|\\n|"


async def test_exec_binary_stdin_round_trips(session: Session) -> None:
    data = bytes(range(256)) * 64 + b"binary\x00input\n"
    reply = await session.call("exec", host="localhost", arguments=["cat"],
                               input=base64.b64encode(data).decode())
    assert reply.ok and reply.output == data and reply.error_output == b""


async def test_exec_nonzero_exit_is_ok_with_exit_code_and_stderr(session: Session) -> None:
    reply = await session.call("exec", host="localhost", arguments=["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert reply.ok and reply.exit_code == 7
    assert reply.output == b"out\n" and reply.error_output == b"err\n"


async def test_exec_combined_merges_stderr_into_output(session: Session) -> None:
    reply = await session.call("exec", host="localhost", combined=True,
                               arguments=["sh", "-c", "echo out; echo err >&2"])
    assert reply.ok and reply.output == b"out\nerr\n" and reply.error_output == b""


async def test_exec_without_input_has_empty_stdin(session: Session) -> None:
    reply = await session.call("exec", host="localhost", arguments=["cat"])
    assert reply.ok and reply.exit_code == 0 and reply.output == b""


async def test_exec_missing_program_reports_127_like_a_shell(session: Session) -> None:
    reply = await session.call("exec", host="localhost", arguments=["/nonexistent/program"])
    assert reply.ok and reply.exit_code == 127 and b"No such file" in reply.error_output


async def test_exec_runs_as_configured_user() -> None:
    async with running_daemon('[exec]\nuser = "nobody"\n') as daemon:
        s = await daemon.open_session()
        uid = await s.call("exec", host="localhost", arguments=["id", "-u"])
        assert uid.ok and uid.output.strip() == b"65534"


async def test_exec_as_another_user_holds_no_capability_and_cannot_regain_any() -> None:
    """Every drop empties the bounding set and sets no_new_privs (docs/systemd.md), also under a root
    daemon, where setresuid alone leaves the bounding set full and set-user-ID programs working."""
    async with running_daemon('[exec]\nuser = "nobody"\n') as daemon:
        s = await daemon.open_session()
        status = await s.call("exec", host="localhost",
                              arguments=["grep", "-E", "^(Cap|NoNewPrivs)", "/proc/self/status"])
        fields = dict(line.split(":\t") for line in status.output.decode().splitlines())
        assert {key: int(value, 16) for key, value in fields.items()} == {
            "CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0, "NoNewPrivs": 1}, fields


async def test_upload_copies_node_local_files_recursively(session: Session, shared: Path) -> None:
    src = Path(tempfile.mkdtemp(prefix="cs-up-", dir=shared))
    src.chmod(0o755)
    (src / "sub").mkdir()
    (src / "sub" / "f").write_bytes(b"payload")
    dest_dir = Path(tempfile.mkdtemp(prefix="cs-dest-", dir=shared))
    dest_dir.chmod(0o777)
    dest = dest_dir / "copy"
    reply = await session.call("upload", host="localhost", sources=[str(src)], destination=str(dest),
                               recursive=True)
    assert reply.ok, reply.error
    assert (dest / "sub" / "f").read_bytes() == b"payload"
    missing = await session.call("upload", host="localhost", sources=["/nonexistent"], destination=str(dest))
    assert not missing.ok and "nonexistent" in str(missing.error)
    relative = await session.call("upload", host="localhost", sources=["rel"], destination=str(dest))
    assert not relative.ok and "$.sources" in str(relative.error)
    assert os.path.exists(dest)


async def test_request_logs_carry_context_but_never_secrets() -> None:
    secret_input = b"stdin-secret-bytes"
    async with running_daemon() as daemon:
        s = await daemon.open_session("op-log")
        reply = await s.call("exec", host="localhost", arguments=["cat"],
                             input=base64.b64encode(secret_input).decode())
        assert reply.ok
        await s.call("runtime", host="localhost", runtime={"action": "workload-run", "workload": {
            "name": "", "image": "nonexistent-image-for-log-test:1", "pull_policy": "never",
            "environment": {"SECRET_ENV": "env-secret-value"}}})
        log = daemon.log()
        assert s.token not in log and "env-secret-value" not in log
        assert secret_input.decode() not in log and base64.b64encode(secret_input).decode() not in log
        lines = [e for e in daemon.log_events() if e.get("event") == "request"]
        exec_line = next(e for e in lines if e["operation"] == "exec")
        assert exec_line["session"] == "op-log" and exec_line["host"] == "localhost" and exec_line["ok"] is True
        assert exec_line["request_id"] == reply.id and exec_line["duration_ms"] >= 0
        from coldsnap_provider._logging import REQUEST_KEYS

        assert all(set(e) <= {*REQUEST_KEYS, "event", "level", "timestamp"} for e in lines)
        run_line = next(e for e in lines if e.get("action") == "workload-run")
        assert run_line["ok"] is False and run_line["error_code"] == "not_found"


async def test_exec_output_over_the_limit_is_a_typed_error(session: Session) -> None:
    """Regression: #11 finding 12 (OutputTooLarge inside an ExceptionGroup became an internal error)."""
    reply = await session.call("exec", host="localhost", arguments=["head", "-c", "60000000", "/dev/zero"])
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert reply.error == f"exec failed: output exceeds {46 << 20} bytes"


async def test_exec_arguments_past_the_kernel_limit_are_rejected(session: Session) -> None:
    """Regression: #11 finding 12 (E2BIG became an internal error)."""
    reply = await session.call("exec", host="localhost", arguments=["true", "a" * (256 << 10)])
    assert not reply.ok and "E2BIG" in str(reply.error) and reply.error_code is msgspec.UNSET


async def test_exec_does_not_inherit_the_daemons_environment() -> None:
    """Regression: #11 finding 14 (an HF_TOKEN in the daemon's environment reached `exec env`)."""
    async with running_daemon(env={"HF_TOKEN": "hf-daemon-secret", "OTHER_SECRET": "s3"}) as daemon:
        s = await daemon.open_session()
        reply = await s.call("exec", host="localhost", arguments=["env"])
        assert reply.ok and b"PATH=" in reply.output
        assert b"hf-daemon-secret" not in reply.output and b"s3" not in reply.output.split(b"=")[-1]
        assert b"OTHER_SECRET" not in reply.output


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


async def _wait_gone(pid: int) -> None:
    with anyio.fail_after(15):
        while _alive(pid):
            await anyio.sleep(0.05)


async def test_grandchild_that_ignores_sigterm_is_killed_on_disconnect(shared: Path) -> None:
    """Regression: #11 finding 15 (no SIGKILL followed once the main process had exited)."""
    pid_file = shared / "grandchild"
    async with running_daemon() as daemon:
        s = await daemon.open_session()
        stream, pid = await s.exec_in_background(
            f"(trap '' TERM; exec sleep 300) & echo $! > {pid_file}; wait", pid_file)
        await stream.aclose()
        await _wait_gone(pid)
        assert (await s.call("capabilities")).ok


async def test_exec_children_of_a_killed_daemon_are_ended_at_its_next_start(shared: Path) -> None:
    """Regression: #11 finding 15 (exec children survived a SIGKILL of the daemon)."""
    pid_file = shared / "child"
    state = short_dir()
    async with running_daemon(state_dir=state) as daemon:
        s = await daemon.open_session()
        stream, pid = await s.exec_in_background(f"sleep 300 & echo $! > {pid_file}; wait", pid_file)
        await anyio.to_thread.run_sync(daemon.stop, signal.SIGKILL)
        await stream.aclose()
    assert _alive(pid)  # nothing ends it but us
    async with running_daemon(state_dir=state):
        await _wait_gone(pid)

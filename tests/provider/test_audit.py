"""The audit trail of a real daemon: one event per privileged action, to the log and the file (issue 26)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from tests.helpers import control_as, next_id, running_daemon, short_dir, write_config

CLI = [sys.executable, "-m", "coldsnap_provider"]


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_audit_records_each_privileged_action_without_secrets(busybox_image: str) -> None:
    audit = short_dir("cs-au-") / "audit.jsonl"
    name = f"cs-audit-{next_id()[-8:]}"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        session = await daemon.open_session()
        assert (await session.call("capabilities")).ok  # read-only: not audited
        assert (await session.call("exec", host="localhost", arguments=["echo", "SECRET-ARG"],
                                   input=b"U0VDUkVULUlOUFVU")).ok
        assert not (await session.runtime("image-inspect", image="coldsnap-test/absent-au:1")).ok  # read-only
        run = await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "detached": True, "entrypoint": "sleep", "command": ["60"],
            "environment": {"PASSWORD": "SECRET-ENV"}})
        assert run.ok, run.error
        stopped = await daemon.control(operation="workload-stop", name=name, timeout_s=1)
        assert stopped["stopped"]
        assert (await session.runtime("workload-remove", name=name)).ok
        forged = session.envelope("exec", host="localhost", arguments=["true"])
        forged["token"] = "x" * 43
        await session.raw(json.dumps(forged).encode() + b"\n")
        await daemon.control(operation="session-close", session=session.session)
        log = daemon.log()
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    events = _events(audit)
    described = [(e["socket"], e["operation"], e["action"], e["outcome"]) for e in events]
    assert described == [
        ("control", "session-open", "", "ok"),
        ("session", "exec", "", "ok"),
        ("session", "runtime", "workload-run", "ok"),
        ("control", "workload-stop", "", "ok"),
        ("session", "runtime", "workload-remove", "ok"),
        ("session", "exec", "", "rejected"),
        ("control", "session-close", "", "ok"),
    ]
    assert all(e["uid"] == 0 and e["peer_uid"] == 0 for e in events)
    assert [e["session"] for e in events] == [session.session] * 3 + [""] + [session.session] * 3  # stop: none
    assert events[2]["target"] == f"{name} image={busybox_image}" and events[2]["host"] == "localhost"
    assert (events[2]["decision"], events[2]["profile"]) == ("admitted", "unrestricted")  # root's default profile
    assert (events[1]["decision"], events[1]["profile"]) == ("", "")  # exec runs as exec.user: no admission
    assert events[3]["target"] == name
    assert events[5]["error"] == "host-provider session is unauthorized"
    assert {"decision", "profile", "duration_ms", "request_id", "time", "peer_pid"} <= set(events[0])
    text = audit.read_text()
    for secret in (session.token, "SECRET-ARG", "SECRET-INPUT", "U0VDUkVULUlOUFVU", "SECRET-ENV", "x" * 43):
        assert secret not in text
    journal = [json.loads(line)["audit"] for line in log.splitlines() if '"event": "audit"' in line]
    assert journal == events  # the same events reach the log (the journal under systemd)
    assert session.token not in "".join(line for line in log.splitlines() if '"event": "audit"' in line)


async def test_audit_records_a_refused_control_peer() -> None:
    audit = short_dir("cs-au-") / "audit.jsonl"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        os.chmod(daemon.state_dir, 0o755)
        os.chmod(daemon.state_dir / "control.sock", 0o666)  # the file mode lets it in; the uid check refuses
        answer = control_as(65534, daemon.state_dir, {"operation": "status"})
        assert not answer["ok"]
    events = _events(audit)
    assert [(e["operation"], e["outcome"], e["uid"]) for e in events] == [("connect", "rejected", 65534)]


def _serve(config: str) -> subprocess.CompletedProcess[str]:
    state = short_dir()
    conf = write_config(short_dir("cs-conf-"), config)
    return subprocess.run([*CLI, "serve", "--config", str(conf), "--state-dir", str(state)], capture_output=True,
                          text=True, timeout=30, check=False)


def test_audit_file_through_a_symlink_or_not_a_file_refuses_to_start(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep\n")
    os.chmod(target, 0o644)
    link = tmp_path / "audit-link"
    link.symlink_to(target)
    result = _serve(f'[audit]\nfile = "{link}"\n')
    assert result.returncode == 2 and f"audit.file '{link}': cannot open" in result.stderr
    assert target.read_text() == "keep\n" and stat.S_IMODE(target.stat().st_mode) == 0o644
    fifo = tmp_path / "audit-fifo"
    os.mkfifo(fifo)
    result = _serve(f'[audit]\nfile = "{fifo}"\n')
    assert result.returncode == 2 and "audit.file" in result.stderr


async def test_audit_file_is_appended_and_tightened_to_0600(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    audit.write_text('{"earlier": true}\n')
    os.chmod(audit, 0o644)
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        await daemon.open_session()
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    lines = audit.read_text().splitlines()
    assert lines[0] == '{"earlier": true}' and json.loads(lines[1])["operation"] == "session-open"


async def _audited(path: Path, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The first audit event in `path` that `predicate` accepts, waiting for it (a few seconds at most)."""
    with anyio.fail_after(10):
        while True:
            found = [e for e in (_events(path) if path.exists() else []) if predicate(e)]
            if found:
                return found[0]
            await anyio.sleep(0.05)


async def test_exec_whose_client_hangs_up_is_audited_and_logged_as_client_gone(tmp_path: Path) -> None:
    """Regression: #37 (finding 5): a request whose client hung up before the reply left no audit event and no
    request log line, though its effect stayed."""
    audit = short_dir("cs-au-") / "audit.jsonl"
    created, pid_file = tmp_path / "created-by-exec", tmp_path / "exec.pid"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        session = await daemon.open_session()
        stream, _ = await session.exec_in_background(f"touch {created}; echo $$ > {pid_file}; exec sleep 30",
                                                     pid_file)
        await stream.aclose()  # gone before the reply
        event = await _audited(audit, lambda e: e["operation"] == "exec")
        assert (await session.call("exec", host="localhost", arguments=["true"])).ok  # the daemon carries on
        lines = [e for e in daemon.log_events() if e.get("event") == "request" and e.get("operation") == "exec"]
    assert created.exists()  # its effect stayed...
    assert (event["socket"], event["outcome"], event["session"]) == ("session", "client-gone", session.session)
    assert event["error"] == "request failed: cancelled: the client hung up before the reply"
    assert event["uid"] == 0 and event["host"] == "localhost" and event["request_id"]
    gone = [e for e in lines if e["request_id"] == event["request_id"]]  # ...and so did its log line
    assert len(gone) == 1 and gone[0]["outcome"] == "client-gone" and gone[0]["ok"] is False


async def test_exec_cancelled_by_shutdown_is_audited_and_logged_as_cancelled(tmp_path: Path) -> None:
    """Regression: #37 (finding 5): a request the daemon cancelled at shutdown was answered, but not audited."""
    audit = short_dir("cs-au-") / "audit.jsonl"
    created = tmp_path / "created-before-shutdown"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n[server]\nshutdown_grace_s = 0.5\n') as daemon:
        session = await daemon.open_session()
        replies = []

        async def stuck() -> None:
            replies.append(await session.call("exec", host="localhost",
                                              arguments=["sh", "-c", f"touch {created}; exec sleep 60"]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stuck)
            with anyio.fail_after(10):
                while not created.exists():
                    await anyio.sleep(0.05)
            assert daemon.process is not None
            daemon.process.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(daemon.process.wait, 15) == 0
        lines = [e for e in daemon.log_events() if e.get("event") == "request" and e.get("operation") == "exec"]
    assert not replies[0].ok and "shutting down" in str(replies[0].error)  # the client is still answered
    events = [e for e in _events(audit) if e["operation"] == "exec"]
    assert len(events) == 1 and events[0]["outcome"] == "cancelled" and events[0]["request_id"] == replies[0].id
    assert events[0]["error"] == "request failed: cancelled: the provider is shutting down"
    assert [e["outcome"] for e in lines] == ["cancelled"]


# A program prints this (assembled by the shell, so the request itself never holds it).
_MARKER = "AUDIT-SECRET-MARKER-42"
_PRINT_MARKER = 'echo "AUDIT-SECRET-""MARKER-$((6*7))"'


async def test_failed_commands_output_never_reaches_the_audit_or_the_log(busybox_image: str) -> None:
    """Regression: #37 (finding 7): a failed command's output (up to 16 KiB) went into the audit event and the
    journal, with whatever secrets it printed; the reply still carries it (the protocol's only channel)."""
    audit = short_dir("cs-au-") / "audit.jsonl"
    context = short_dir("cs-au-ctx-")
    name, tag = f"cs-audit-{next_id()[-8:]}", f"coldsnap-capsule/audit-{next_id()[-8:]}:1"
    try:
        async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
            session = await daemon.open_session()
            run = await session.runtime("workload-run", workload={
                "name": "", "image": busybox_image, "remove_after_exit": True, "entrypoint": "sh",
                "command": ["-c", f"{_PRINT_MARKER} >&2; exit 3"]})
            assert (await session.runtime("workload-run", workload={
                "name": name, "image": busybox_image, "detached": True, "entrypoint": "sleep",
                "command": ["60"]})).ok
            executed = await session.runtime("workload-exec", name=name, execution={
                "command": ["sh", "-c", f"{_PRINT_MARKER}; exit 5"], "combined": True})
            assert (await session.runtime("workload-remove", name=name)).ok
            built = await session.runtime("image-build", build={
                "dockerfile": base64.b64encode(f"FROM {busybox_image}\nRUN echo {_MARKER} && false\n".encode())
                .decode(), "context": str(context), "tag": tag})
            on_host = await session.call("exec", host="localhost", arguments=["sh", "-c", f"{_PRINT_MARKER}; exit 1"])
            log = daemon.log()
    finally:
        shutil.rmtree(context, ignore_errors=True)
    # The client gets what the protocol gives it...
    assert not run.ok and str(run.error).startswith("workload-run failed: exited 3: ") and _MARKER in str(run.error)
    assert not executed.ok and str(executed.error).startswith("workload-exec failed: exited 5: ")
    assert _MARKER in str(executed.error)
    assert not built.ok and _MARKER in str(built.error)
    assert on_host.ok and on_host.exit_code == 1 and _MARKER.encode() in on_host.output
    # ...the audit trail and the daemon's own output get the status, a length and a digest.
    assert _MARKER not in audit.read_text() and _MARKER not in log
    events = {e["action"] or e["operation"]: e for e in _events(audit) if e["outcome"] != "ok"}
    digest = hashlib.sha256(str(run.error).removeprefix("workload-run failed: exited 3: ").encode()).hexdigest()
    assert events["workload-run"]["error"] == (
        f"workload-run failed: exited 3 (output withheld: {len(_MARKER)} bytes, sha256 {digest[:16]})")
    assert events["workload-exec"]["error"].startswith("workload-exec failed: exited 5 (output withheld: ")
    assert events["image-build"]["error"].startswith("image-build failed (output withheld: ")
    assert any(e.get("error") == events["workload-run"]["error"] for e in map(_json_or_empty, log.splitlines()))


def _json_or_empty(line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def test_control_request_whose_client_hangs_up_is_audited_as_client_gone(busybox_image: str) -> None:
    """Regression: #37 (finding 5), the control socket: a workload-stop whose manager hung up left no event."""
    audit = short_dir("cs-au-") / "audit.jsonl"
    name = f"cs-audit-{next_id()[-8:]}"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        session = await daemon.open_session()
        assert (await session.runtime("workload-run", workload={  # sleep as PID 1 ignores SIGTERM: stop waits
            "name": name, "image": busybox_image, "detached": True, "entrypoint": "sleep", "command": ["60"]})).ok
        try:
            stream = await anyio.connect_unix(daemon.state_dir / "control.sock")
            await stream.send(json.dumps({"format": 1, "id": "stop-then-gone", "operation": "workload-stop",
                                          "name": name, "timeout_s": 30}).encode() + b"\n")
            await stream.send_eof()
            await anyio.sleep(1.0)  # the stop is waiting for its timeout
            await stream.aclose()
            event = await _audited(audit, lambda e: e["operation"] == "workload-stop")
            lines = [e for e in daemon.log_events() if e.get("event") == "control"
                     and e.get("request_id") == "stop-then-gone"]
        finally:
            assert (await session.runtime("workload-remove", name=name)).ok
    assert (event["socket"], event["outcome"], event["target"]) == ("control", "client-gone", name)
    assert event["request_id"] == "stop-then-gone" and event["uid"] == 0
    assert [(e["outcome"], e["ok"]) for e in lines] == [("client-gone", False)]

"""The audit trail of a real daemon: one event per privileged action, to the log and the file (issue 26)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers import control_as, next_id, running_daemon, write_config

CLI = [sys.executable, "-m", "coldsnap_provider"]


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_audit_records_each_privileged_action_without_secrets(busybox_image: str) -> None:
    audit = Path(tempfile.mkdtemp(prefix="cs-au-", dir="/tmp")) / "audit.jsonl"
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
    audit = Path(tempfile.mkdtemp(prefix="cs-au-", dir="/tmp")) / "audit.jsonl"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        os.chmod(daemon.state_dir, 0o755)
        os.chmod(daemon.state_dir / "control.sock", 0o666)  # the file mode lets it in; the uid check refuses
        answer = control_as(65534, daemon.state_dir, {"operation": "status"})
        assert not answer["ok"]
    events = _events(audit)
    assert [(e["operation"], e["outcome"], e["uid"]) for e in events] == [("connect", "rejected", 65534)]


def _serve(config: str) -> subprocess.CompletedProcess[str]:
    state = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    conf = write_config(Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp")), config)
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

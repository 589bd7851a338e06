"""SIGHUP on a real daemon: [policy], the log level and the audit file change without a restart (issue 38).

Before: SIGHUP's default action killed the daemon at once, without a drain, leaving its control socket behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from coldsnap_provider import ReplyError
from tests.conftest import docker
from tests.helpers import EXEC_AS_NOBODY, ROOT, Daemon, control_as, running_daemon

_SITE = """
[policy]
admin = "site"
[policy.profiles.site]
images = [{images}]
"""


def _policy(images: str, extra: str = "") -> str:
    return extra + _SITE.format(images=images)


def _events(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    return [e for e in daemon.log_events() if e.get("event") == event]


async def _hang_up(daemon: Daemon, event: str) -> dict[str, Any]:
    """SIGHUP, then the daemon's answer to it (a `reloaded` or `reload refused` line)."""
    seen = len(_events(daemon, event))
    assert daemon.process is not None
    daemon.process.send_signal(signal.SIGHUP)
    with anyio.fail_after(10):
        while len(found := _events(daemon, event)) == seen:
            assert daemon.process.poll() is None, daemon.log()
            await anyio.sleep(0.05)
    return found[-1]


async def test_sighup_applies_a_new_policy_to_an_open_session_and_names_what_needs_a_restart(
        busybox_image: str) -> None:
    target = f"coldsnap-test/busybox:reload-{secrets.token_hex(4)}"
    async with running_daemon(_policy('"*"')) as daemon:
        session = await daemon.open_session()
        try:
            admitted = await session.runtime("image-tag", source=busybox_image, target=target)
            assert admitted.ok, admitted
            daemon.config_path.write_text(_policy('"registry.invalid/*"', '[server]\nshutdown_grace_s = 5.0\n'))
            report = await _hang_up(daemon, "reloaded")
            assert report["changed"] == ["policy.profiles"] and report["needs_restart"] == ["server.shutdown_grace_s"]
            refused = await session.runtime("image-tag", source=busybox_image, target=target)
            assert not refused.ok and "matches none of the images profile site allows" in (refused.error or "")
            assert (await session.call("capabilities")).ok  # the session opened before the reload still works
            listed = await daemon.control(operation="session-list")
            assert session.session in json.dumps(listed)
        finally:
            docker("rmi", target, check=False)
        assert daemon.stop() == 0  # SIGTERM still drains and exits cleanly


async def test_a_broken_configuration_on_sighup_changes_nothing_and_the_daemon_serves_on(busybox_image: str) -> None:
    target = f"coldsnap-test/busybox:reload-{secrets.token_hex(4)}"
    async with running_daemon(_policy('"*"')) as daemon:
        session = await daemon.open_session()
        try:
            daemon.config_path.write_text(_policy('"registry.invalid/*"').replace('admin = "site"',
                                                                                   'admin = "no-such-profile"'))
            refused = await _hang_up(daemon, "reload refused; nothing changed")
            assert "policy.admin" in refused["error"] and "no-such-profile" in refused["error"]
            assert refused["level"] == "error"
            still = await session.runtime("image-tag", source=busybox_image, target=target)
            assert still.ok, still  # the running policy is the old one
            assert (await daemon.open_session()).token  # and the control socket serves
        finally:
            docker("rmi", target, check=False)


async def test_sighup_changes_the_log_level() -> None:
    async with running_daemon() as daemon:  # started with --log-level debug
        daemon.config_path.write_text('[server]\nlog_level = "warning"\n')
        report = await _hang_up(daemon, "reloaded")
        assert report["changed"] == ["server.log_level"]
        before = len(_events(daemon, "control"))
        await daemon.open_session()  # an ok control request: an info line, now below the level
        await anyio.sleep(0.2)
        assert len(_events(daemon, "control")) == before
        daemon.config_path.write_text("")
        await _hang_up(daemon, "reloaded")  # back to --log-level: the report shows either way
        await daemon.open_session()
        with anyio.fail_after(5):
            while len(_events(daemon, "control")) == before:
                await anyio.sleep(0.05)


def _audit_sessions(path: Path) -> list[str]:
    return [json.loads(line)["session"] for line in path.read_text().splitlines()
            if json.loads(line)["operation"] == "session-open"]


async def test_sighup_reopens_the_audit_file_after_it_was_renamed_away_and_nothing_is_lost() -> None:
    directory = Path(tempfile.mkdtemp(prefix="cs-au-", dir="/tmp"))
    audit = directory / "audit.jsonl"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        first = await daemon.open_session()
        os.rename(audit, directory / "audit.jsonl.1")  # what logrotate does first
        second = await daemon.open_session()  # still written to the renamed file, which the daemon holds
        report = await _hang_up(daemon, "reloaded")  # logrotate's postrotate: systemctl reload
        assert report["changed"] == [] and report["audit_file"] == str(audit)
        third = await daemon.open_session()
        deadline = time.monotonic() + 5
        while not audit.exists() and time.monotonic() < deadline:
            await anyio.sleep(0.05)
    assert _audit_sessions(directory / "audit.jsonl.1") == [first.session, second.session]
    assert _audit_sessions(audit) == [third.session]
    assert stat.S_IMODE(audit.stat().st_mode) == 0o600
    shutil.rmtree(directory, ignore_errors=True)


async def test_the_control_operation_reload_answers_what_changed_and_is_for_administrators_only() -> None:
    nobody = 65534
    base = EXEC_AS_NOBODY + f"[server]\ncontrol_uids = [{nobody}]\n"
    async with running_daemon(base) as daemon:
        daemon.config_path.write_text(base + "max_connections = 100\n" + _policy('"registry.invalid/*"'))
        assert await daemon.control(operation="reload") == {"changed": ["policy.admin", "policy.profiles"],
                                                           "needs_restart": ["server.max_connections"]}
        daemon.config_path.write_text(base + '[policy]\nmanagers = "no-such-profile"\n')
        with pytest.raises(ReplyError, match=r"reload refused; nothing changed: .*policy\.managers"):
            await daemon.control(operation="reload")
        os.chmod(daemon.state_dir / "control.sock", 0o666)
        answer = await anyio.to_thread.run_sync(control_as, nobody, daemon.state_dir, {"operation": "reload"})
        assert not answer["ok"] and "may not reload" in answer["error"]
        audited = [e["audit"] for e in daemon.log_events() if e.get("event") == "audit"
                   and e["audit"]["operation"] == "reload"]
        assert [a["outcome"] for a in audited] == ["ok", "rejected", "rejected"]


@pytest.mark.skipif(shutil.which("logrotate") is None, reason="needs logrotate (scripts/test installs it)")
async def test_logrotate_with_the_shipped_snippet_loses_no_audit_event(tmp_path: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="cs-au-", dir="/tmp"))
    audit = directory / "audit.jsonl"
    async with running_daemon(f'[audit]\nfile = "{audit}"\n') as daemon:
        assert daemon.process is not None
        # The snippet as shipped, at this audit file, with systemctl's reload as the unit's ExecReload does it.
        snippet = (ROOT / "systemd" / "coldsnap-provider.logrotate").read_text()
        assert "/var/log/coldsnap-provider/audit.jsonl {" in snippet and "systemctl reload coldsnap-provider" in snippet
        conf = tmp_path / "logrotate.conf"
        conf.write_text(snippet.replace("/var/log/coldsnap-provider/audit.jsonl", str(audit))
                        .replace("systemctl reload coldsnap-provider.service", f"/bin/kill -HUP {daemon.process.pid}"))
        conf.chmod(0o644)
        first = await daemon.open_session()
        seen = len(_events(daemon, "reloaded"))
        done = subprocess.run(["logrotate", "-f", "-s", str(tmp_path / "state"), str(conf)], capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        with anyio.fail_after(10):
            while len(_events(daemon, "reloaded")) == seen:
                await anyio.sleep(0.05)
        second = await daemon.open_session()
    assert _audit_sessions(directory / "audit.jsonl.1") == [first.session]
    assert _audit_sessions(audit) == [second.session]
    shutil.rmtree(directory, ignore_errors=True)

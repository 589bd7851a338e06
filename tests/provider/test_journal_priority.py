"""Under systemd each log line reaches the journal at its priority (issue 38): a real daemon whose stderr is the
stream JOURNAL_STREAM names prefixes every line with `<N>`, which journald's stream parser takes as PRIORITY
(SyslogLevelPrefix=yes, the default) and strips.

Before: every line was bare JSON, which journald files at the stream's default priority, info, so
`journalctl -p err` showed no failed action and `-p warning` no refusal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.helpers import ROOT, Daemon, open_session, running_daemon, write_config

_LINE = re.compile(r"^<(?P<priority>[0-7])>(?P<json>\{.*\})$")
ERR, WARNING, INFO = 3, 4, 6

# Pulls may name only an address where nothing listens: busybox is refused by the policy, the other fails.
_CONFIG = """
[policy]
admin = "site"
[policy.profiles.site]
images = ["127.0.0.1:1/*"]
"""


def _journal_lines(daemon: Daemon) -> list[tuple[int, dict[str, Any]]]:
    lines = []
    for line in daemon.log().splitlines():
        match = _LINE.match(line)
        assert match, f"a line without its priority prefix: {line!r}"
        lines.append((int(match["priority"]), json.loads(match["json"])))
    return lines


def _priority_of(lines: list[tuple[int, dict[str, Any]]], **fields: Any) -> list[int]:
    return [p for p, event in lines if all(event.get(k) == v for k, v in fields.items())]


async def test_each_line_carries_its_priority_for_journald() -> None:
    state = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    conf = Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp"))
    daemon = Daemon(state_dir=state, config_path=write_config(conf, _CONFIG))
    stream = daemon.log_path.stat()  # the daemon's stderr: as systemd sets it for a service's journal stream
    try:
        await anyio.to_thread.run_sync(lambda: daemon.start(env={"JOURNAL_STREAM": f"{stream.st_dev}:{stream.st_ino}"}))
        session = await daemon.open_session()
        assert (await session.call("capabilities")).ok
        refused = await session.runtime("image-pull", image="busybox:1.36")
        assert not refused.ok and "matches none of the images profile site allows" in (refused.error or "")
        failed = await session.runtime("image-pull", image="127.0.0.1:1/nothing:1")
        assert not failed.ok and failed.error_code == "runtime_failed", failed
        await anyio.to_thread.run_sync(daemon.stop)
        lines = _journal_lines(daemon)
    finally:
        if daemon.process is not None and daemon.process.poll() is None:
            daemon.stop()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(conf, ignore_errors=True)
        daemon.log_path.unlink(missing_ok=True)
    assert _priority_of(lines, event="ready") == [INFO]
    assert _priority_of(lines, event="request", operation="capabilities") == [INFO]
    # The policy's refusal: its admission decision, the request's line and its audit event, at warning.
    assert _priority_of(lines, event="admission", decision="refused") == [WARNING]
    assert _priority_of(lines, event="request", action="image-pull", outcome="rejected") == [WARNING]
    # The failed privileged action: its line and its audit event at err (`journalctl -p err`).
    assert _priority_of(lines, event="request", action="image-pull", outcome="runtime_failed") == [ERR]
    audits = [(p, event["audit"]) for p, event in lines if event.get("event") == "audit"]
    assert [p for p, audit in audits if audit["outcome"] == "runtime_failed"] == [ERR]
    assert [p for p, audit in audits if audit["outcome"] == "rejected"] == [WARNING]
    assert _priority_of(lines, event="control", operation="session-open") == [INFO]


async def test_an_inherited_journal_stream_that_is_not_stderr_adds_no_prefix() -> None:
    """A process started from a service inherits JOURNAL_STREAM even when its stderr goes elsewhere."""
    async with running_daemon(env={"JOURNAL_STREAM": "1:1"}) as daemon:
        await daemon.open_session()
        assert all(line.startswith("{") for line in daemon.log().splitlines() if line.strip())


_JOURNALD = "/lib/systemd/systemd-journald"
# A private journald in a private mount namespace (nothing of the host's journal is touched), and the daemon
# under systemd-cat, whose stream is the one a service gets (SyslogLevelPrefix=yes); systemd-cat does not set
# JOURNAL_STREAM, so the daemon's shell sets it as systemd would: its stderr's device:inode.
_IN_JOURNAL = r"""
set -e
mkdir -p /run/systemd /run/log
mount -t tmpfs tmpfs /run/systemd
mount -t tmpfs tmpfs /run/log
if [ -d /var/log/journal ]; then mount -t tmpfs tmpfs /var/log/journal; fi
mkdir -p /run/systemd/journal
"$JOURNALD" & echo $! > "$STATE/journald.pid"
for _ in $(seq 100); do [ -S /run/systemd/journal/stdout ] && break; sleep 0.1; done
exec systemd-cat -t coldsnap-journal-test sh -c \
    'JOURNAL_STREAM=$(stat -L -c %d:%i /proc/self/fd/2) exec "$@"' sh "$@"
"""


def _journald_usable() -> bool:
    return (os.geteuid() == 0 and os.path.exists(_JOURNALD)
            and all(shutil.which(tool) for tool in ("unshare", "nsenter", "systemd-cat", "journalctl")))


@pytest.mark.skipif(not _journald_usable(), reason="needs root, unshare, nsenter and systemd's journald tools")
async def test_journald_files_a_failed_action_at_err_and_a_refusal_at_warning() -> None:
    state = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    conf = Path(tempfile.mkdtemp(prefix="cs-conf-", dir="/tmp"))
    argv = [sys.executable, "-m", "coldsnap_provider", "serve", "--config", str(write_config(conf, _CONFIG)),
            "--state-dir", str(state), "--log-level", "debug"]
    process = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", _IN_JOURNAL, "sh", *argv],
                               cwd=ROOT, env={**os.environ, "JOURNALD": _JOURNALD, "STATE": str(state)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journald = 0
    try:
        deadline = time.monotonic() + 20
        while not (state / "control.sock").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"no private journald here: {process.stderr.read().decode() if process.stderr else ''}")
            await anyio.sleep(0.1)
        journald = int((state / "journald.pid").read_text())
        session = await open_session(state)
        assert not (await session.runtime("image-pull", image="busybox:1.36")).ok  # refused by the policy
        assert (await session.runtime("image-pull", image="127.0.0.1:1/nothing:1")).error_code == "runtime_failed"
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        journal = subprocess.run(["nsenter", "-t", str(journald), "-m", "journalctl", "-t", "coldsnap-journal-test",
                                  "-o", "json", "--no-pager"], capture_output=True, check=True, text=True).stdout
        errors = subprocess.run(["nsenter", "-t", str(journald), "-m", "journalctl", "-t", "coldsnap-journal-test",
                                 "-p", "err", "-o", "cat", "--no-pager"], capture_output=True, check=True,
                                text=True).stdout
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if journald:
            os.kill(journald, signal.SIGTERM)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(conf, ignore_errors=True)
    entries = [json.loads(line) for line in journal.splitlines()]
    # journald took the prefix as PRIORITY and stripped it: MESSAGE is the JSON line.
    filed = [(int(e["PRIORITY"]), json.loads(e["MESSAGE"])) for e in entries]
    assert _priority_of(filed, event="ready") == [INFO]
    assert _priority_of(filed, event="request", outcome="rejected") == [WARNING]
    assert _priority_of(filed, event="request", outcome="runtime_failed") == [ERR]
    shown = [json.loads(line) for line in errors.splitlines()]  # what `journalctl -p err` shows in an incident
    assert {e["event"] for e in shown} == {"request", "audit"}
    assert all("runtime_failed" in json.dumps(e) for e in shown)

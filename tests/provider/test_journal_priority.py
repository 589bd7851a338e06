"""Under systemd each log line reaches the journal at its priority (issue 38): a real daemon whose stderr is the
stream JOURNAL_STREAM names prefixes every line with `<N>`, which journald's stream parser takes as PRIORITY
(SyslogLevelPrefix=yes, the default) and strips.

Before: every line was bare JSON, which journald files at the stream's default priority, info, so
`journalctl -p err` showed no failed action and `-p warning` no refusal.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import anyio

from tests.helpers import Daemon, running_daemon, write_config

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

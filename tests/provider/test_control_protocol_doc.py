"""docs/control-protocol.md's example, run as written against a real daemon (only the state directory differs)."""

from __future__ import annotations

import subprocess
import sys

import anyio

from tests.helpers import ROOT, running_daemon


def example() -> str:
    text = (ROOT / "docs" / "control-protocol.md").read_text()
    return text.split("\n## Example\n", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]


def test_the_example_is_about_ten_lines_of_client_code() -> None:
    body = [line for line in example().splitlines() if line.strip() and not line.startswith(("import", "from"))]
    assert len(body) <= 14, body


async def test_the_control_protocol_example_runs_against_a_real_daemon() -> None:
    async with running_daemon() as daemon:
        code = example().replace('"/run/coldsnap-provider"', repr(str(daemon.state_dir)))
        done = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False))
        assert done.returncode == 0, done.stderr
        first, second = done.stdout.splitlines()
        assert first.startswith("['") and "'runtime-v1'" in first and first.endswith("['op-1']")
        assert second == "absent: workload-inspect: no such workload: no-such-workload"
        assert await daemon.control(operation="session-list") == []  # closed by the example

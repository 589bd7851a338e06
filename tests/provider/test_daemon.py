"""The daemon's own lifecycle: one per state directory."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import running_daemon


async def test_a_second_daemon_on_the_same_state_directory_refuses_to_start() -> None:
    """Regression: #11 finding 13 (a second `serve` silently took the sockets)."""
    async with running_daemon() as daemon:
        s = await daemon.open_session()
        second = subprocess.run(
            [sys.executable, "-m", "coldsnap_provider", "serve", "--state-dir", str(daemon.state_dir)],
            capture_output=True, text=True, timeout=30)
        assert second.returncode == 2
        assert f"{daemon.state_dir} is already served by another coldsnap-provider" in second.stderr
        assert daemon.process is not None
        assert f"(pid {daemon.process.pid})" in second.stderr
        assert (await s.call("capabilities")).ok

"""bench/restore_ttft.py's command line: what it refuses before it starts anything (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench._common import line_rate
from tests.helpers import ROOT


def test_fewer_than_one_restore_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """Regression (review4): `--restores 0` ran the cold start and the capture, then failed on an empty list of
    restores when the table was made."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "restore_ttft.py"), "--restores", "0", "--root",
                           str(tmp_path / "root"), "--weights-dir", str(tmp_path), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--restores must be at least 1, not 0" in done.stderr, done.stderr[-500:]
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--rows", "torch,expandable"], "--rows: expandable: not one of torch, torch-expandable, torch-async, jax"),
    (["--rows", "jax", "--modes", "hydrate"], "--rows jax: --modes hydrate needs ttft_server.py's weight arena"),
], ids=["unknown-row", "hydrate-row"])
def test_a_row_the_shared_table_lacks_or_a_mode_it_cannot_run_is_refused_before_anything_runs(
        tmp_path: Path, args: list[str], message: str) -> None:
    """The rows are bench/engine_rows.py's (the allocator settings restore_rows and e2e_rows run), not spelt here."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "restore_ttft.py"), *args,
                           "--root", str(tmp_path / "root"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-500:]
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize(("devices", "shown"), [
    (None, "-"),
    ([{"moved": {"alloc": {"count": 1, "bytes": 64}, "vmm_by_engine": {"count": 9, "bytes": 900}},
       "uncovered": {"below_threshold": {"count": 2, "bytes": 36}, "host_pinned": {"count": 1, "bytes": 10**9}}}],
     "96.4% (below_threshold 0 MB left)"),
    ([{"moved": {}, "uncovered": {"stream_ordered": {"count": 3, "bytes": 3 * 10**9}}}],
     "0.0% (stream_ordered 3000 MB left)"),
])
def test_the_line_rate_column_counts_device_bytes_only(devices: list[dict[str, object]] | None, shown: str) -> None:
    """Host memory the interposer counts (pinned, registered) is CRIU's, not the device's: not in the share."""
    assert line_rate(devices) == shown  # type: ignore[arg-type]

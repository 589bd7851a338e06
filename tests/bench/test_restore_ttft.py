"""bench/restore_ttft.py's command line: what it refuses before it starts anything (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def test_fewer_than_one_restore_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """Regression (review4): `--restores 0` ran the cold start and the capture, then failed on an empty list of
    restores when the table was made."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "restore_ttft.py"), "--restores", "0", "--root",
                           str(tmp_path / "root"), "--weights-dir", str(tmp_path), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--restores must be at least 1, not 0" in done.stderr, done.stderr[-500:]
    assert not (tmp_path / "root").exists()

"""bench/restore_rows.py without a GPU: what it refuses before starting anything, how a capture's device memory
becomes the row's "moved at line rate" share, and the recorded uvicorn-on-uvloop row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import restore_rows
from tests.helpers import ROOT


@pytest.mark.parametrize(("args", "message"), [
    (["--rows", "torch,nope"], "--rows: nope: not one of torch, torch-expandable, torch-async, jax, jax-platform"),
    (["--restores", "0"], "--restores must be at least 1, not 0"),
    (["--serve-result", "/nonexistent.json"], "--serve-result: /nonexistent.json is not a file"),
], ids=["row", "restores", "serve-result"])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path, args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "restore_rows.py"), "--root", str(tmp_path / "root"),
                           "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-500:]
    assert not (tmp_path / "root").exists()


def test_the_moved_share_counts_device_kinds_only() -> None:
    """Host memory (CRIU's) and entry-point counts are not device bytes left behind; an empty kind is not listed."""
    captured = [{"state": "released", "bytes": 12 << 30,
                 "uncovered": {"host_pinned": {"count": 3, "bytes": 1 << 30}, "vmm_by_engine": {"count": 2,
                               "bytes": 4 << 30}, "below_threshold": {"count": 0, "bytes": 0},
                               "unwrapped_entry_points": {"count": 1, "bytes": 0}}},
                {"state": "not-started", "bytes": 0, "uncovered": {}}]
    moved = restore_rows.coverage(captured)
    assert moved == {"moved_bytes": 12 << 30, "moved_kinds": {"released": 12 << 30},
                     "left_bytes": {"vmm_by_engine": 4 << 30}, "moved_share": 0.75}
    per_kind = restore_rows.coverage([{"moved": {"alloc": {"count": 2, "bytes": 300}, "vmm_by_engine": {"count": 1,
                                                 "bytes": 100}, "stream_ordered": {"count": 0, "bytes": 0}},
                                       "uncovered": {"stream_ordered": {"count": 1, "bytes": 100}}}])
    assert per_kind["moved_kinds"] == {"alloc": 300, "vmm_by_engine": 100} and per_kind["moved_share"] == 0.8
    assert restore_rows.coverage(None)["moved_share"] == 0.0
    assert restore_rows.left_text(moved["left_bytes"]) == "vmm_by_engine 4.29 GB"


def test_every_row_runs_an_engine_that_exists() -> None:
    for row in restore_rows.ROWS.values():
        assert Path(row.command()[1]).is_file(), row


def test_the_recorded_uvloop_row_is_read_as_recorded() -> None:
    cells = restore_rows.serve_cells(restore_rows.SERVE_RESULT)
    assert cells[1].startswith("uvicorn on uvloop") and cells[-1] == "yes"
    assert "of 100" in cells[3] and cells[7].endswith("(100%)"), cells

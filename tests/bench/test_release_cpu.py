"""bench/release_cpu.py's harness, built from the interposer's sources as they are (a source added to the library
must not leave the harness unlinkable, as it once did) and run once small: the release's loop into a directory
(its `--mounts` part, which mounts a tmpfs per huge= option, ran on the H200: `h200-capture-phases-2026-12-02/`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import release_cpu


def test_the_harness_builds_from_every_interposer_source_and_runs_the_release_s_loop(tmp_path: Path) -> None:
    harness = release_cpu.build(tmp_path)
    got = release_cpu.write_run(harness, tmp_path, "crc32-64m", 1 / 16, 1, 1, 0, 1, 0)  # one 64 MiB chunk
    assert got["failed"] == 0 and got["written_gib"] == pytest.approx(1 / 16)
    assert got["engine"] in ("vpclmul", "pclmul", "tables")  # the CRC-32 engine this CPU got
    assert got["digest_thread_s"] > 0 and got["write_thread_s"] > 0 and not list(tmp_path.glob("release-cpu-*"))

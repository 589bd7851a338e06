"""`_criu_stats.dump_stats`: CRIU's stats-dump image decoded (a real one is read in test_criu_restore.py's
capture test); here the image's edges: absent, truncated, not a dump's."""

from __future__ import annotations

from pathlib import Path

import pytest

from coldsnap_probe._criu_stats import dump_stats
from coldsnap_probe.errors import WorkerError


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def image(message: bytes) -> bytes:
    return b"\x40\x59\x10\x55\x06\x33\x09\x57" + len(message).to_bytes(4, "little") + message


def entry(fields: dict[int, int]) -> bytes:
    dump = b"".join(varint(number << 3) + varint(value) for number, value in fields.items())
    return varint(1 << 3 | 2) + varint(len(dump)) + dump


def test_a_dump_s_times_become_seconds_and_its_page_counts_stay_counts(tmp_path: Path) -> None:
    (tmp_path / "stats-dump").write_bytes(image(entry({1: 1500, 2: 912_345, 3: 700_000, 4: 650_000, 5: 300_000,
                                                       6: 0, 7: 190_000, 9: 0, 11: 99})))
    assert dump_stats(tmp_path) == {"freezing_s": 0.0015, "frozen_s": 0.912345, "memdump_s": 0.7, "memwrite_s": 0.65,
                                    "pages_scanned": 300_000, "pages_skipped_parent": 0, "pages_written": 190_000,
                                    "pages_lazy": 0}


def test_the_threads_line_of_each_process_adds_their_count_and_seconds(tmp_path: Path) -> None:
    """dump-threads.patch logs one line a process; the stock path none (then nothing is added)."""
    (tmp_path / "stats-dump").write_bytes(image(entry({2: 500_000})))
    (tmp_path / "dump.log").write_text("(00.1) dump-threads: 7: 10 pages by 1 threads ... (not the line)\n")
    assert dump_stats(tmp_path) == {"frozen_s": 0.5}
    with (tmp_path / "dump.log").open("a") as log:
        for pid, threads, scan, copy in ((7, 16, 40_000, 60_000), (8, 4, 1_000, 2_000)):
            log.write(f"(00.2) dump-threads: {pid}: 99 pages by {threads} threads, 3 of them zeros left out; "
                      f"scan {scan} us, then copy {copy} us\n")
    assert dump_stats(tmp_path) == {"frozen_s": 0.5, "threads": 16, "threads_scan_s": 0.041, "threads_copy_s": 0.062}


def test_no_stats_image_is_no_stats(tmp_path: Path) -> None:
    assert dump_stats(tmp_path) == {}


@pytest.mark.parametrize(("raw", "message"), [
    pytest.param(image(entry({1: 5}))[:-1], "holds 15 bytes, its header says 16", id="shorter-than-its-header"),
    pytest.param(image(varint(2 << 3 | 2) + varint(0)), "has no dump entry", id="a-restore-s-stats"),
    pytest.param(image(varint(1 << 3 | 2) + varint(3) + varint(1 << 3) + b"\xff\xff"), "runs past the end",
                 id="a-varint-cut"),
    pytest.param(image(varint(1 << 3 | 2) + varint(2) + varint(1 << 3 | 5) + b"\x00"), "wire type 5",
                 id="a-fixed32-field"),
])
def test_an_image_that_is_not_a_dump_s_stats_is_refused_naming_why(tmp_path: Path, raw: bytes, message: str) -> None:
    (tmp_path / "stats-dump").write_bytes(raw)
    with pytest.raises(WorkerError, match=message):
        dump_stats(tmp_path)

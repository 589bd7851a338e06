"""CRIU's own account of a dump: the `stats-dump` image it writes into its work directory, decoded.

The capture report carries it (issue 35 item 3: where the CRIU dump's time goes, phase by phase): how long the
tree took to freeze and stayed frozen, how long collecting the pages took and, within that, writing them into the
pages images, and how many pages were scanned and written. The image is one protobuf message (CRIU's
`images/stats.proto`, `stats_entry { dump_stats_entry dump = 1; }`) after 8 bytes of magic and a 4-byte size;
its times are in microseconds. Only varint and length-delimited fields occur in it, so a dozen lines of decoding
do, in the capsule's standard library. Where CRIU's threads read the pages (third_party/criu/dump-threads.patch),
its log's line per process adds how many threads and the seconds of their two passes (docs/criu-dump-threads.md).
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import WorkerError

__all__ = ("dump_stats",)

# dump_stats_entry's field numbers -> the report's names; times (first four) are microseconds.
_TIMES = {1: "freezing_s", 2: "frozen_s", 3: "memdump_s", 4: "memwrite_s"}
_COUNTS = {5: "pages_scanned", 6: "pages_skipped_parent", 7: "pages_written", 9: "pages_lazy",
           12: "shpages_scanned", 14: "shpages_written"}
# dump-threads.patch's log line, one per dumped process
_THREADS = re.compile(rb"dump-threads: \d+: \d+ pages by (\d+) threads, \d+ of them zeros left out; "
                      rb"scan (\d+) us, then copy (\d+) us")


def _fields(data: bytes) -> dict[int, int | bytes]:
    """One message's fields (the last of each number wins, as protobuf reads them)."""
    fields: dict[int, int | bytes] = {}
    at = 0

    def varint() -> int:
        nonlocal at
        value = shift = 0
        while True:
            if at >= len(data) or shift > 63:
                raise WorkerError("a varint runs past the end of the stats image")
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while at < len(data):
        key = varint()
        if key & 7 == 0:
            fields[key >> 3] = varint()
        elif key & 7 == 2:
            size = varint()
            if at + size > len(data):
                raise WorkerError("a field runs past the end of the stats image")
            fields[key >> 3] = data[at:at + size]
            at += size
        else:
            raise WorkerError(f"unexpected protobuf wire type {key & 7} in the stats image")
    return fields


def _threads(log: Path) -> dict[str, float | int]:
    """`threads` (the most any process had) and `threads_scan_s` / `threads_copy_s` (summed over the processes)
    from CRIU's log; {} when no process's pages were read by threads (the stock path, or no log)."""
    try:
        found = _THREADS.findall(log.read_bytes())
    except FileNotFoundError:
        return {}
    if not found:
        return {}
    return {"threads": max(int(n) for n, _, _ in found), "threads_scan_s": sum(int(s) for _, s, _ in found) / 1e6,
            "threads_copy_s": sum(int(c) for _, _, c in found) / 1e6}


def dump_stats(work: Path) -> dict[str, float | int]:
    """`work/stats-dump` decoded: `freezing_s`, `frozen_s`, `memdump_s`, `memwrite_s` and the page counts CRIU
    recorded, with `threads`, `threads_scan_s` and `threads_copy_s` from `work/dump.log` where threads read the
    pages; {} when CRIU wrote no stats (a dump that failed before it). WorkerError for an image that is not one."""
    try:
        raw = (work / "stats-dump").read_bytes()
    except FileNotFoundError:
        return {}
    size = int.from_bytes(raw[8:12], "little")
    if len(raw) < 12 + size:
        raise WorkerError(f"{work / 'stats-dump'} holds {len(raw)} bytes, its header says {12 + size}")
    dump = _fields(raw[12:12 + size]).get(1)
    if not isinstance(dump, bytes):
        raise WorkerError(f"{work / 'stats-dump'} has no dump entry")
    out: dict[str, float | int] = {}
    for number, value in _fields(dump).items():
        if isinstance(value, int) and number in _TIMES:
            out[_TIMES[number]] = value / 1e6
        elif isinstance(value, int) and number in _COUNTS:
            out[_COUNTS[number]] = value
    return out | _threads(work / "dump.log")

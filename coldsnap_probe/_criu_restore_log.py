"""CRIU's restore log (`-v4`) read into phases: where a restore's time goes besides the page fill (issue 35 item 2).

CRIU stamps each line with the seconds since it started. The marks, in the order a restore reaches them: `Reading
image tree` (the kernel-feature probe and the set-up are done), the first `Forking task with` (the images are read),
the parallel fill's `page-fill: pages-N.img: ... in S s` lines (one a task: premap, then fill), every task's `pie: N:
Switched to the restorer` (files, sockets and the rest of its state are back), `net: Unlock network` (the restorer
blobs have moved the memory into place and started the threads), `Restore finished successfully` (CRIU has seized,
stopped at their last `rt_sigreturn` and let go every thread). A phase whose marks are missing (another CRIU, a
stock one-stream fill) is left out rather than guessed.
"""

from __future__ import annotations

import re

__all__ = ("restore_phases",)

_STAMP = re.compile(rb"\((\d+\.\d+)\) ")
_MARKS = {"setup_end": b"Reading image tree\n", "fork": b"Forking task with ", "unlock": b"net: Unlock network\n",
          "finished": b"Restore finished successfully"}
# Matched from a line's text onwards, never from its start (a `^...` scan of every line is ~50 ms a log).
_FILL = re.compile(rb"page-fill: pages-\d+\.img: \d+ bytes in \d+ chunks by \d+ threads in ([\d.]+) s")
_RESTORER = re.compile(rb"pie: \d+: Switched to the restorer")


def _stamp(log: bytes, at: int) -> float | None:
    """The time stamp of the line holding offset `at`."""
    line = log.rfind(b"\n", 0, at) + 1
    found = _STAMP.match(log, line)
    return float(found.group(1)) if found else None


def _first(log: bytes, text: bytes) -> float | None:
    at = log.find(text)
    return None if at < 0 else _stamp(log, at)


def restore_phases(log: bytes) -> dict[str, float]:
    """Seconds per phase of the restore that wrote `log`: `probe_setup_s`, `images_fork_s`, `premap_s`, `fill_s`
    (the slowest task's fill), `files_state_s`, `restorer_s`, `seize_stop_s`, and `logged_s` (to the last line);
    each only where its marks are in the log."""
    at = {name: _first(log, text) for name, text in _MARKS.items()}
    fills = [(ended, float(m.group(1))) for m in _FILL.finditer(log) if (ended := _stamp(log, m.start())) is not None]
    restorers = [t for m in _RESTORER.finditer(log) if (t := _stamp(log, m.start())) is not None]
    if fills:
        last_fill = max(ended for ended, _ in fills)
        at["fill_end"], at["fill_start"] = last_fill, last_fill - max(seconds for _, seconds in fills)
    at["restorer"] = max(restorers) if restorers else None
    at["start"] = 0.0
    spans = (("probe_setup_s", "start", "setup_end"), ("images_fork_s", "setup_end", "fork"),
             ("premap_s", "fork", "fill_start"), ("fill_s", "fill_start", "fill_end"),
             ("files_state_s", "fill_end", "restorer"), ("restorer_s", "restorer", "unlock"),
             ("seize_stop_s", "unlock", "finished"))
    out: dict[str, float] = {}
    for name, begin, end in spans:
        start, stop = at.get(begin), at.get(end)
        if start is not None and stop is not None and stop >= start:
            out[name] = round(stop - start, 6)
    last = _stamp(log, log.rstrip(b"\n").rfind(b"\n(") + 1)
    if last is not None:
        out["logged_s"] = last
    return out

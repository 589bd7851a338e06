"""The worker's live phase: published as each phase of a capture or restore begins, so that a worker that stops
(killed, stuck, failed) says where.

Two places, both readable without the worker's help:

* its stderr, one line per phase (`coldsnap-worker: restore phase criu-restore`): a workload-exec's failure reply
  and a restore unit's log end with the phase the worker was in, even when it was killed and printed nothing else;
* with ``COLDSNAP_REPORT_DIR`` (the daemon's per-unit report directory), ``.phase-<pid>``: one JSON object
  ``{kind, phase, pid, unix}``, replaced whole (written under a temporary dot name, then renamed) at every phase and
  removed when the worker ends; a killed worker's last one stays until its unit's directory is reaped. Dot names
  are never collected as reports (`coldsnap_provider._capsule_reports`), so an operator, or a watcher on the
  host, reads where a live worker is (docs/worker-reports.md, "Live phase").

A failure's `error:` line names the phase it happened in (`__main__`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from ._report_dir import ENV

__all__ = ("PhaseLog",)


class PhaseLog:
    """Where one worker is: `enter` at each phase; `current` is the last phase entered ("" before the first)."""

    def __init__(self, kind: str, *, publish: bool = True) -> None:
        self.kind, self.current = kind, ""
        self._publish = publish
        directory = os.environ.get(ENV, "") if publish else ""
        self._path = os.path.join(directory, f".phase-{os.getpid()}") if directory else ""

    def enter(self, phase: str) -> None:
        self.current = phase
        if not self._publish:
            return
        sys.stderr.write(f"coldsnap-worker: {self.kind} phase {phase}\n")
        sys.stderr.flush()
        if self._path:
            self._write({"kind": self.kind, "phase": phase, "pid": os.getpid(), "unix": time.time()})

    def _write(self, state: dict[str, object]) -> None:
        temporary = f"{self._path}.tmp"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "w") as out:
                json.dump(state, out)
            os.rename(temporary, self._path)
        except OSError:  # the report directory is a convenience: the stderr line is always there
            self._path = ""

    def close(self) -> None:
        """The worker ends (done or failed, its error line names the phase): no live phase is left."""
        if self._path:
            with contextlib.suppress(OSError):
                os.unlink(self._path)

"""The memory-source seam: every way device memory leaves a process before the CUDA checkpoint and comes back
after the restore, behind one small protocol, registered in one place (`SOURCES`).

A source is one module with one `MemorySource`:

- at capture, `capture(scope)` gives its `SourceCapture` for this capture: `release(report)` gets its memory out
  of the tree's CUDA processes and records into the images what a restore needs; `roll_back()` gives back
  whatever it released (including a release that failed half-way) and removes what it recorded;
- at restore, `load(scope)` reads and validates its records from the images (before anything is resumed: one
  rank's restore reads them while CRIU runs, several ranks' before any rank's CRIU; a restore that cannot succeed
  never resumes a tree) and gives its `SourceRestore`, or None when the images hold none of its records;
  `stage()` starts what can run while CRIU and CUDA restore the tree (a node hydrator's stages, read-ahead),
  `hydrate(report)` brings the memory back once the tree runs, `discard()` frees what was staged after a failure;
- once the tree is dumped, `warm()` offers what a source recorded to whoever keeps it warm for the first restore
  (the interposer's dump to its node hydrator's RAM tier), and `warmed(report)` records the answers (bounded).

The order is the registry's, and it is part of the contract:
- capture releases in registry order, and a failed capture rolls back in reverse registry order: the memory
  released last is given back first (the interposer's device memory, and with it the gate that holds the
  engine's CUDA copies, comes back before the engine is asked to hydrate its weights back, which needs those
  copies);
- restore loads, stages and discards in registry order, and hydrates in reverse registry order: the memory
  released last is hydrated first (the interposer's device memory, whose gate holds the engine's CUDA calls,
  comes back before the engine is asked to hydrate its weights).

Each source fills its own part of the capture and restore reports (`_reports.py`: `hydration`, `device_memory`,
their timings); a new source whose report has no field there records it under `memory_sources[name]`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from ..errors import ProbeError
from ._device_dump import DeviceDumpSource
from ._protocol import (
    CaptureScope,
    MemoryOptions,
    MemorySource,
    RestoreScope,
    SourceCapture,
    SourceRestore,
    read_record,
)
from ._weights import WeightsSource

if TYPE_CHECKING:  # annotations only: the report types load once CRIU runs (issue 35 item 2)
    from .._reports import CaptureReport, RestoreReport

__all__ = ("SOURCES", "CaptureScope", "MemoryCaptures", "MemoryOptions", "MemoryRestores", "MemorySource",
           "RestoreScope", "SourceCapture", "SourceRestore", "read_record")


# The registry: the one place a source is named. Its order is the contract above.
SOURCES: tuple[MemorySource, ...] = (WeightsSource(), DeviceDumpSource())


class MemoryCaptures:
    """A capture's sources: released in registry order; what was begun is rolled back in reverse order."""

    def __init__(self, scope: CaptureScope, sources: tuple[MemorySource, ...] = SOURCES) -> None:
        self.scope, self.sources = scope, sources
        self.begun: list[SourceCapture] = []

    def release(self, report: CaptureReport) -> None:
        for source in self.sources:
            begun = source.capture(self.scope)
            self.begun.append(begun)  # before its release: a release that fails half-way is rolled back too
            begun.release(report)

    def warm(self) -> None:
        """The tree is dumped: each source offers what it recorded to be kept warm (never waits)."""
        for begun in self.begun:
            with contextlib.suppress(ProbeError):  # best effort: the capture is done whatever happens here
                begun.warm()

    def warmed(self, report: CaptureReport) -> None:
        for begun in self.begun:
            with contextlib.suppress(ProbeError):
                begun.warmed(report)

    def roll_back(self) -> None:
        for begun in reversed(self.begun):  # the last released first: its gate may hold the others' copies
            with contextlib.suppress(ProbeError):  # one source's failure never keeps the next one's memory away
                begun.roll_back()


class MemoryRestores:
    """A restore's sources whose records the images hold, loaded (validated) in registry order."""

    def __init__(self, scope: RestoreScope, sources: tuple[MemorySource, ...] = SOURCES) -> None:
        self.loaded = [restore for source in sources if (restore := source.load(scope)) is not None]
        self.staged: list[SourceRestore] = []

    def stage(self) -> None:
        for restore in self.loaded:
            self.staged.append(restore)
            restore.stage()

    def hydrate(self, report: RestoreReport) -> None:
        for restore in reversed(self.loaded):  # released last at capture, hydrated first
            restore.hydrate(report)

    def discard(self) -> None:
        for restore in self.staged:
            with contextlib.suppress(ProbeError):
                restore.discard()

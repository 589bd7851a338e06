"""The memory-source protocol, the scopes a source sees and how a record is read back from the images (the
package's `__init__` holds the registry)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .._coordinator import Coordinator
from .._records import read_record

if TYPE_CHECKING:  # annotations only: the report types load once CRIU runs (issue 35 item 2)
    from .._reports import CaptureReport, RestoreReport

__all__ = ("CaptureScope", "MemoryOptions", "MemorySource", "RestoreScope", "SourceCapture", "SourceRestore",
           "read_record")


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    """What the worker's command line says about memory; each source reads its own options."""

    weights_control: str | None = None  # the engine's weights-arena control socket (`--hydration`)
    interposer: str | None = None  # the one CUDA process's interposer socket (`--interposer`)
    device_policy: str = "same-model"  # where the interposer's dumps may be hydrated (`--device-policy`)
    device_digests: bool = False  # digest every byte of the interposer's dumps (`--device-digests`)


@dataclass(frozen=True, slots=True)
class CaptureScope:
    """One capture, as a source sees it: the (new) images, the tree's CUDA processes, the options."""

    images: Path
    cuda: list[int]
    options: MemoryOptions


@dataclass(frozen=True, slots=True)
class RestoreScope:
    """One restore, as a source sees it: the images (only read), the ranks (a peer's abort ends a wait)."""

    images: Path
    ranks: Coordinator
    options: MemoryOptions = field(default_factory=MemoryOptions)


class SourceCapture(Protocol):
    """One source in one capture."""

    def release(self, report: CaptureReport) -> None:
        """Release the memory and record it into the images; a WorkerError names what failed."""

    def roll_back(self) -> None:
        """Give back what was released (also after a release that failed half-way); never raises."""

    def warm(self) -> None:
        """The tree is dumped, what this source recorded is final: offer it to whoever keeps it warm for the first
        restore (best effort: never raises, never waits)."""

    def warmed(self, report: CaptureReport) -> None:
        """Put what `warm` got into the report, waiting for it a bounded while (never raises)."""


class SourceRestore(Protocol):
    """One source in one restore, its records validated."""

    def stage(self) -> None:
        """Start what may run while CRIU and CUDA restore the tree (best effort: never raises)."""

    def hydrate(self, report: RestoreReport) -> None:
        """Bring the memory back into the running tree; a WorkerError when it did not come back."""

    def discard(self) -> None:
        """After a failed restore: free what `stage` started (never raises)."""


class MemorySource(Protocol):
    """A way of getting device memory out before the CUDA checkpoint and back after the restore."""

    name: str

    def capture(self, scope: CaptureScope) -> SourceCapture:
        """This source's part of the capture in `scope` (nothing released yet)."""

    def load(self, scope: RestoreScope) -> SourceRestore | None:
        """This source's records in the images, validated; None when there are none. WorkerError if invalid."""

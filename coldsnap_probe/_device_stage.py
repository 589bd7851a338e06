"""Restore, when the engine named a node hydrator (COLDSNAP_CUDA_INTERPOSER_HYDRATOR): the hydrator fills one
allocation per released region from the process's device dump while CRIU and CUDA restore the tree, and the
interposer then only maps each at its region's address (docs/interposer.md).

Best effort by design, as the weights' `Stager`: a stage that fails, is late or is refused is reported, and the
regular hydration (the interposer fills the regions itself) runs. A stage is asked for only when every dump
file is provably the one the capture wrote (`verification` is `sampled`): the hydrator copies bytes, it does
not digest them, and the interposer's sampled read-back compares the device with the files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import jsonline
from .errors import ChannelError, HydrationError
from .hydration import ADOPT_PAGE, DeviceDump, StageRequest

__all__ = ("DeviceStage",)


class DeviceStage(StageRequest):
    """One process's stage: asked at once (a thread), adopted after the CUDA restore, discarded on failure."""

    def __init__(self, hydrator: str, dump: DeviceDump, directory: Path) -> None:
        self.key = dump.manifest_digest
        # Each segment file names its region: the hydrator makes one allocation per region (the interposer maps
        # each whole at the region's address; a mapping of a part of a larger allocation is refused).
        self.parts = [{"file": str(directory / s.file), "bytes": s.size, "region": index}
                      for index, region in enumerate(dump.regions) for s in region.segments]
        self.sizes = [r.size for r in dump.regions]
        self.device_uuid = dump.regions[0].device_uuid
        super().__init__(hydrator, "coldsnap-device-stage")

    def _ask(self) -> dict[str, Any]:
        return jsonline.request(self.hydrator, {"op": "stage-dump", "key": self.key, "parts": self.parts,
                                                "device_uuid": self.device_uuid}, timeout=600.0)

    def _discard(self) -> dict[str, Any]:
        return {"op": "discard", "key": self.key, "ticket": self.ticket}

    def adopt(self, timeout: float = 600.0) -> list[int] | None:
        """The staged allocations as descriptors, one per region in order (the caller closes them), taken from
        the hydrator ADOPT_PAGE at a time; None (`report` says why, nothing is left open) when there is no stage,
        or an answer is refused or does not fit: a count other than the regions', a page of other sizes."""
        if not self.wait(timeout) or not self.report.get("staged"):
            self.report.setdefault("error", "still staging")
            return None
        taken: list[int] = []
        try:
            while len(taken) < len(self.sizes):
                taken += self._page(len(taken))
        except (ChannelError, HydrationError) as exc:
            for fd in taken:
                os.close(fd)
            self.report["adopt_error"] = str(exc)
            return None
        return taken

    def _page(self, first: int) -> list[int]:
        """The descriptors of the page at `first` (HydrationError, nothing left open, unless exactly the
        regions')."""
        answer, fds = jsonline.request_with_fds(self.hydrator, {"op": "adopt", "key": self.key, "ticket": self.ticket,
                                                                "parts": self.parts, "first": first}, timeout=60.0)
        expected = self.sizes[first:first + ADOPT_PAGE]
        problem = (str(answer.get("error") or "refused") if not answer.get("ok") else
                   f"the hydrator holds {answer.get('count')} allocations, the dump {len(self.sizes)} regions"
                   if answer.get("count") != len(self.sizes) else
                   f"page {first}: {len(fds)} descriptors of {answer.get('sizes')} bytes, expected {expected}"
                   if answer.get("first") != first or answer.get("sizes") != expected or len(fds) != len(expected)
                   else "")
        if problem:
            for fd in fds:
                os.close(fd)
            raise HydrationError(f"adopt: {problem}")
        return fds

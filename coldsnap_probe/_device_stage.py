"""Restore, when the engine named a node hydrator (COLDSNAP_CUDA_INTERPOSER_HYDRATOR): the hydrator fills one
allocation per process from its device dump while CRIU and CUDA restore the tree, and the interposer then only
maps its parts at the regions' addresses (docs/interposer.md).

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
from .errors import ChannelError
from .hydration import DeviceDump, StageRequest

__all__ = ("DeviceStage",)


class DeviceStage(StageRequest):
    """One process's stage: asked at once (a thread), adopted after the CUDA restore, discarded on failure."""

    def __init__(self, hydrator: str, dump: DeviceDump, directory: Path) -> None:
        self.key = dump.manifest_digest
        self.parts = [{"file": str(directory / s.file), "bytes": s.size} for s in dump.segments]
        self.bytes = dump.bytes
        self.device_uuid = dump.regions[0].device_uuid
        super().__init__(hydrator, "coldsnap-device-stage")

    def _ask(self) -> dict[str, Any]:
        return jsonline.request(self.hydrator, {"op": "stage-dump", "key": self.key, "parts": self.parts,
                                                "device_uuid": self.device_uuid}, timeout=600.0)

    def _discard(self) -> dict[str, Any]:
        return {"op": "discard", "key": self.key, "ticket": self.ticket}

    def adopt(self, timeout: float = 600.0) -> int | None:
        """The staged allocation as a descriptor (the caller closes it), or None (`report` says why)."""
        if not self.wait(timeout) or not self.report.get("staged"):
            self.report.setdefault("error", "still staging")
            return None
        try:
            answer, fds = jsonline.request_with_fds(self.hydrator, {"op": "adopt", "key": self.key,
                                                                    "ticket": self.ticket, "parts": self.parts},
                                                    timeout=60.0)
        except ChannelError as exc:
            self.report["adopt_error"] = str(exc)
            return None
        if not answer.get("ok") or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.report["adopt_error"] = str(answer.get("error") or "no descriptor")
            return None
        return fds[0]

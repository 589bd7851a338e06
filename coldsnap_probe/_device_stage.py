"""Restore, when the engine named a node hydrator (COLDSNAP_CUDA_INTERPOSER_HYDRATOR): the hydrator fills one
allocation per process from its device dump while CRIU and CUDA restore the tree, and the interposer then only
maps its parts at the regions' addresses (docs/interposer.md).

Best effort by design, as the weights' `Stager`: a stage that fails, is late or is refused is reported, and the
regular hydration (the interposer fills the regions itself) runs. A stage is asked for only when every dump
file is provably the one the capture wrote (`verification` is `sampled`): the hydrator copies bytes, it does
not digest them, and the interposer's sampled read-back compares the device with the files.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

from . import jsonline
from .errors import ChannelError
from .hydration import DeviceDump

__all__ = ("DeviceStage",)


class DeviceStage:
    """One process's stage: asked at once (a thread), adopted after the CUDA restore, discarded on failure."""

    def __init__(self, hydrator: str, dump: DeviceDump, directory: Path) -> None:
        self.hydrator, self.key = hydrator, dump.manifest_digest
        self.parts = [{"file": str(directory / s.file), "bytes": s.size} for s in dump.segments]
        self.bytes = dump.bytes
        self.device_uuid = dump.regions[0].device_uuid
        self.report: dict[str, Any] = {}
        self.ticket = ""  # the hydrator's, for the adopt: kept out of the report
        self._lock = threading.Lock()  # exactly one of the thread and discard() sends the discard
        self._finished = self._discarded = False
        self._thread = threading.Thread(target=self._run, name="coldsnap-device-stage", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            answer = jsonline.request(self.hydrator, {"op": "stage-dump", "key": self.key, "parts": self.parts,
                                                      "device_uuid": self.device_uuid}, timeout=600.0)
            self.ticket = str(answer.get("ticket", ""))
            self.report = {k: v for k, v in answer.items() if k not in ("ok", "ticket")} if answer.get("ok") else {
                "staged": False, "error": str(answer.get("error"))}
        except Exception as exc:  # staging is an optimisation: the regular hydration still runs
            self.report = {"staged": False, "error": f"{type(exc).__name__}: {exc}"}
        self.report["worker_s"] = time.perf_counter() - started
        with self._lock:
            self._finished = True
            discarded = self._discarded
        if discarded:  # the restore failed while this stage was being filled
            self._send_discard()

    def adopt(self, timeout: float = 600.0) -> int | None:
        """The staged allocation as a descriptor (the caller closes it), or None (`report` says why)."""
        self._thread.join(timeout)
        if self._thread.is_alive() or not self.report.get("staged"):
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

    def discard(self) -> None:
        """After a failed restore: the hydrator frees what will not be adopted (it would expire anyway)."""
        with self._lock:
            self._discarded = True
            finished = self._finished
        if finished:
            self._send_discard()

    def _send_discard(self) -> None:
        if self.report.get("staged"):
            with contextlib.suppress(ChannelError):
                jsonline.request(self.hydrator, {"op": "discard", "key": self.key, "ticket": self.ticket}, timeout=5.0)

"""The restore worker's side of a node hydrator's stage, shared by the weights' `Stager` and the interposer's
`DeviceStage`: the stage is asked at once, in a thread, while CRIU and CUDA restore the tree; the engine adopts
what was staged afterwards, and a failed restore discards it.

Best effort by design: whatever goes wrong is reported (`report`) and the regular hydration runs.

A stage request carries the worker's pidfd: the hydrator keeps a stage only while its stager lives (or until it
is adopted), so a worker killed after its stage was filled leaves nothing on the GPU for the stage's TTL.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import jsonline
from ..errors import ChannelError

if TYPE_CHECKING:
    from . import _weights

__all__ = ("ADOPT_PAGE", "StageRequest", "Stager")

# Descriptors one `adopt` answer carries (a stage of more takes pages). Here, not beside the hydrator that pages
# them: the restore worker needs the number, not the hydrator's server, copy engine and VMM bindings at its start.
ADOPT_PAGE = jsonline.MAX_ANSWER_FDS


class StageRequest:
    """One stage asked of `hydrator`; subclasses say what to ask (`_ask`) and how to discard it (`_discard`)."""

    def __init__(self, hydrator: str, thread_name: str) -> None:
        self.hydrator = hydrator
        self.report: dict[str, Any] = {}
        self.ticket = ""  # the hydrator's, for the engine's adopt: kept out of the report
        self._lock = threading.Lock()  # exactly one of the thread and discard() sends the discard
        self._finished = self._discarded = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _ask(self) -> dict[str, Any]:
        """The stage request's answer (raises on a channel failure)."""
        raise NotImplementedError

    def _discard(self) -> dict[str, Any]:
        """The request that frees this stage on the hydrator."""
        raise NotImplementedError

    def _stage(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send a stage request with this process's pidfd (the stage's life is tied to it); its answer."""
        pidfd = os.pidfd_open(os.getpid())
        try:
            answer, fds = jsonline.request_with_fds(self.hydrator, message, fds=[pidfd], timeout=600.0)
        finally:
            os.close(pidfd)
        for fd in fds:
            os.close(fd)
        return answer

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            answer = self._ask()
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

    def wait(self, timeout: float) -> bool:
        """Whether the stage's answer came within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def discard(self) -> None:
        """After a failed restore: the hydrator frees what no engine will adopt (it would expire anyway). Never
        waits for a stage still being filled: that thread discards it when its answer comes."""
        with self._lock:
            self._discarded = True
            finished = self._finished
        if finished:
            self._send_discard()

    def _send_discard(self) -> None:
        if self.report.get("staged"):
            with contextlib.suppress(ChannelError):
                jsonline.request(self.hydrator, self._discard(), timeout=5.0)


class Stager(StageRequest):
    """The restore worker's side of staging: while CRIU and CUDA restore the engine, the hydrator named in the
    manifest fills an allocation for it on the engine's GPU, which the engine then adopts when asked to hydrate.

    Best effort by design: whatever goes wrong here is reported and the engine hydrates the regular way.
    """

    def __init__(self, manifest: _weights.HydrationManifest) -> None:
        self.manifest = manifest
        super().__init__(manifest.hydrator, "coldsnap-stage")

    def _ask(self) -> dict[str, Any]:
        from .._cuda import Driver
        from ._vmm import device_uuid

        driver = Driver()
        driver.call("cuInit", 0)
        uuid = device_uuid(driver, self.manifest.device)
        return self._stage(self.manifest.stage_request("stage", device_uuid=uuid))

    def _discard(self) -> dict[str, Any]:
        return self.manifest.stage_request("discard", ticket=self.ticket)

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait for the stage request's answer (the hydrator serves it before the engine's adopt)."""
        return self.report if self.wait(timeout) else {"staged": False, "error": "still staging"}

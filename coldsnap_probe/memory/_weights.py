"""Memory source: the engine's weights arena (`hydration.WeightArena`), over the engine's control socket.

Capture: the engine's `release` is its fail-before-release gate; its manifest becomes `hydration.json` in the
images. A failed capture asks the engine to `hydrate` its weights back and removes the manifest.
Restore: `hydration.json` is read and every weight source checked against it before CRIU runs; a node hydrator
the manifest names stages the weights meanwhile (`Stager`); once the tree runs, the engine maps, fills and
verifies its weights (adopting what was staged for it); a failed restore discards the stage.

`hydration`'s names load on first use: a restore whose images hold no weights record imports none of the manifest's
machinery (nor the hydrator's `Stager` without a stage) on its path to CRIU (issue 35 item 2).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import hydration
from .._engine import engine_request
from ..errors import ProbeError, WorkerError
from ..jsonline import request
from ._protocol import CaptureScope, RestoreScope, read_record

if TYPE_CHECKING:
    from .._reports import CaptureReport, RestoreReport
    from ..hydration import HydrationManifest, Stager

__all__ = ("RECORD", "WeightsSource", "hydrate_back")

RECORD = "hydration.json"


def hydrate_back(control: str) -> None:
    """Rollback after a failed capture: the engine maps and hydrates its weights again and keeps serving."""
    try:
        request(control, {"op": "hydrate"})
    except ProbeError:
        pass


class WeightsSource:
    """The engine's weights arena: released when the capture names the engine's control socket."""

    name = "weights"

    def capture(self, scope: CaptureScope) -> WeightsCapture:
        return WeightsCapture(scope.images, scope.options.weights_control)

    def load(self, scope: RestoreScope) -> WeightsRestore | None:
        try:  # the weight sources are checked before a CRIU restore is spent
            if (stored := read_record(scope.images, RECORD, None)) is None:
                return None
            manifest = hydration.HydrationManifest.from_json(stored)
            hydration.check_sources(manifest.regions, manifest.identities)
        except (ProbeError, ValueError) as exc:
            raise WorkerError(f"weight hydration cannot succeed, not restoring: {exc}") from exc
        return WeightsRestore(manifest, scope)


class WeightsCapture:
    """The release of one capture, so that its rollback hydrates the weights back."""

    def __init__(self, images: Path, control: str | None) -> None:
        self.images, self.control = images, control
        self.manifest: HydrationManifest | None = None

    def release(self, report: CaptureReport) -> None:
        """The engine's fail-before-release gate; its manifest is recorded in the images."""
        if not self.control:
            return
        started = time.perf_counter()
        answer = engine_request(self.control, {"op": "release", "generation": f"capture-{time.time_ns()}"},
                                "the engine did not release its weights (nothing was released)")
        try:
            manifest = hydration.HydrationManifest.from_json(answer.get("manifest"))
        except ProbeError as exc:
            hydrate_back(self.control)  # released, but not restorable from this manifest: take them back now
            raise WorkerError(f"the engine's hydration manifest is invalid: {exc}") from exc
        self.manifest = manifest
        (self.images / RECORD).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        from .._reports import ReleasedWeights  # here: the report types are off a restore's path to CRIU

        report.hydration = ReleasedWeights(
            released_bytes=sum(r.size for r in manifest.regions), regions=len(manifest.regions),
            release_seconds=time.perf_counter() - started, plan_digest=manifest.plan.plan_digest,
            manifest_digest=manifest.manifest_digest)

    def roll_back(self) -> None:
        if self.manifest is not None and self.control:
            hydrate_back(self.control)
        (self.images / RECORD).unlink(missing_ok=True)

    def warm(self) -> None:
        """Nothing to offer: the weights' node hydrator keeps its sources page-locked from its start."""

    def warmed(self, report: CaptureReport) -> None:
        """Nothing was offered."""


class WeightsRestore:
    """One restore's weights: the manifest checked, the node hydrator's stage, the engine's hydration."""

    def __init__(self, manifest: HydrationManifest, scope: RestoreScope) -> None:
        self.manifest, self.ranks = manifest, scope.ranks
        self.stager: Stager | None = None

    def stage(self) -> None:
        if self.manifest.hydrator:
            self.stager = hydration.Stager(self.manifest)

    def hydrate(self, report: RestoreReport) -> None:
        """The engine maps, fills and verifies its weights (adopting what the hydrator staged for it)."""
        report.timeline.mark("hydration_begin")
        staged = self.stager.result() if self.stager else None
        ticket = {"ticket": self.stager.ticket} if self.stager and self.stager.ticket else {}  # adopts only its own
        answer = engine_request(self.manifest.control, {"op": "hydrate", **ticket},
                                "weight hydration failed, the restored engine is not released", ranks=self.ranks)
        report.timeline.mark("hydration_end")
        hydrated = answer["report"]
        from .._reports import HydratedWeights  # here: the report types are off a restore's path to CRIU

        report.hydration = HydratedWeights(
            bytes=hydrated["bytes"], seconds=hydrated["seconds"], gbps=hydrated["gbps"],
            regions_verified=hydrated["verified_regions"], engine=hydrated, staged=staged,
            phase_seconds=report.timeline.seconds("hydration_begin", "hydration_end"))

    def discard(self) -> None:
        if self.stager:
            self.stager.discard()

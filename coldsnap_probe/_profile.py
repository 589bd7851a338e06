"""Assemble the format-1 host feature profile (spec 1.1, 2.7)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ._host import DEVICE_SELECTOR_ENV, capsule_facts, criu_identity, nvml_identity, system_identity

if TYPE_CHECKING:
    from ._model import Profile

__all__ = ("build_profile", "identity")


def identity(cuda_driver_api: int | None, criu: str | None = None) -> dict[str, Any]:
    """The full identity, recorded by the profile and the capture: every GPU fact through NVML, what the capsule
    sees (`cuda_driver_api` the given one, else the driver's), and the CRIU (the restore checks the host with the
    lighter `_host.host_identity`)."""
    selector = os.environ.get(DEVICE_SELECTOR_ENV, "0")
    seen = capsule_facts()
    if cuda_driver_api is not None:
        seen["cuda_driver_api"] = cuda_driver_api
    return {**system_identity(), **nvml_identity(selector), **seen, "criu": criu_identity(criu)}


def build_profile(memory_bytes: int, timeout: float) -> Profile:
    """Run the round trip, the VMM canary and the IPC canary (in that order) and emit ten results."""
    # Imported here: the capture worker records `identity` and needs none of the canaries or the profile model.
    from ._canaries import checkpoint_report, checkpoint_results, fresh_state, ipc_canary, known_negatives, vmm_canary
    from ._features import CRIU_PROBE
    from ._model import FeatureResult, Profile

    started = time.time()
    report = checkpoint_report(memory_bytes, timeout)
    vmm = vmm_canary()
    ipc = ipc_canary(memory_bytes, timeout)
    api, roundtrip, initialized = checkpoint_results(report, started)
    driver_api = (report.get("driver_api") or {}).get("driver_api_version")
    criu_reason = "the controller has not attached capsule-pinned CRIU evidence"
    criu = [FeatureResult(id=feature, status="unqualified", probe=CRIU_PROBE, reason=criu_reason, seconds=0.0)
            for feature in ("criu-process-template", "criu-process-tree")]
    features = (api, roundtrip, vmm, ipc, *known_negatives(), *criu, fresh_state(report), initialized)
    return Profile(identity=identity(driver_api), features=features, started_unix=started,
                   completed_unix=time.time())

"""The CUDA canaries (`_canaries.py`): their mapping to typed results everywhere, the real thing on a GPU host.

CI has no GPU: there the mapping and the no-driver behaviour (test_main.py) are what is checked;
scripts/device gpu-tests runs the GPU tests on the H200.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from coldsnap_probe import FeatureResult, validate_profile
from coldsnap_probe._canaries import _negative, checkpoint_results, fresh_state, known_negatives
from coldsnap_probe.errors import CanaryFailed, CudaError, CudaLibraryMissing, CudaUnavailable
from tests.helpers import ROOT
from tests.probe.test_main import ORDER, has_nvidia_driver

needs_driver = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver (run on the GPU host)")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, check=False,
                          timeout=280)


@needs_driver
def test_every_cuda_canary_passes_with_evidence() -> None:
    done = run("coldsnap_probe", "profile")
    assert done.returncode == 0, done.stderr
    profile = validate_profile(json.loads(done.stdout))
    by_id = {f["id"]: f for f in profile["features"]}
    assert [f["id"] for f in profile["features"]] == ORDER
    for feature in ("cuda-checkpoint-api", "cuda-checkpoint-roundtrip", "cuda-vmm-exact-address",
                    "cuda-classic-ipc", "cuda-fresh-state", "cuda-initialized-state"):
        assert by_id[feature]["status"] == "passed", by_id[feature]
    vmm = by_id["cuda-vmm-exact-address"]["evidence"]
    assert vmm["bytes"] >= 2 << 20 and vmm["address"] > 0 and len(vmm["sha256"]) == 64
    assert by_id["cuda-classic-ipc"]["evidence"]["matches"] is True
    identity = profile["identity"]
    assert identity["driver_version"] and identity["gpu_uuid"].startswith("GPU-")
    assert identity["cuda_driver_api"] >= 12000 and identity["compute_capability"]


@needs_driver
def test_no_child_is_left_locked_or_running() -> None:
    run("coldsnap_probe", "profile")
    leftover = subprocess.run(["pgrep", "-f", "coldsnap_probe _(target|ipc_target)"], capture_output=True,
                              text=True, check=False)
    assert leftover.returncode == 1, leftover.stdout


REPORT_NO_LIBRARY = {"api_available": False, "library_loaded": False, "completed_unix": 12.5,
                     "error": "CudaLibraryMissing: libcuda.so.1 could not be loaded"}


def test_checkpoint_results_without_a_library_fail_with_the_spec_phases_and_texts() -> None:
    api, roundtrip, initialized = (r.to_json() for r in checkpoint_results(REPORT_NO_LIBRARY, 10.0))
    assert api == {"id": "cuda-checkpoint-api", "status": "failed", "probe": "cuda-process-checkpoint-v1",
                   "failure_phase": "symbols", "reason": REPORT_NO_LIBRARY["error"], "seconds": 2.5}
    assert roundtrip == {"id": "cuda-checkpoint-roundtrip", "status": "failed", "probe": "cuda-process-checkpoint-v1",
                         "failure_phase": "roundtrip", "reason": "CUDA process checkpoint API is unavailable",
                         "seconds": 2.5}
    assert initialized == {"id": "cuda-initialized-state", "status": "failed", "probe": "cuda-process-checkpoint-v1",
                           "reason": "CUDA process checkpoint API is unavailable", "seconds": 2.5}  # no phase


def test_checkpoint_results_with_missing_symbols_are_unsupported_and_name_them() -> None:
    report = {"api_available": False, "library_loaded": True, "completed_unix": 11.0, "error": None,
              "symbols": {"cuCheckpointProcessLock": False, "cuCheckpointProcessGetState": True}}
    api, roundtrip, _ = checkpoint_results(report, 10.0)
    assert (api.status, api.failure_phase) == ("unsupported", "symbols")
    assert api.reason == "CUDA process checkpoint symbols are unavailable: cuCheckpointProcessLock"
    assert roundtrip.status == "unsupported"


def test_checkpoint_results_that_passed_carry_no_reason_or_phase() -> None:
    report = {"api_available": True, "library_loaded": True, "completed_unix": 11.0, "roundtrip_supported": True}
    assert [r.to_json() for r in checkpoint_results(report, 10.0)] == [
        {"id": feature, "status": "passed", "probe": "cuda-process-checkpoint-v1", "seconds": 1.0}
        for feature in ("cuda-checkpoint-api", "cuda-checkpoint-roundtrip", "cuda-initialized-state")]


@pytest.mark.parametrize(("exc", "phase", "status", "reported_phase", "reason"), [
    (CudaUnavailable("CUDA driver symbols are unavailable: cuMemMap"), "load", "unsupported", "symbols",
     "CudaUnavailable: CUDA driver symbols are unavailable: cuMemMap"),
    (CudaUnavailable("cuMemMap could not be called"), "map-exact", "unsupported", "map-exact",
     "CudaUnavailable: cuMemMap could not be called"),
    (CudaLibraryMissing("libcuda.so.1 could not be loaded"), "load", "failed", "load",
     "CudaLibraryMissing: libcuda.so.1 could not be loaded"),
    (CudaError("cuInit", "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"), "context", "failed", "context",
     "CudaError: cuInit failed: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected"),
    (CanaryFailed("exact CUDA VA request returned 0x2000, expected 0x1000"), "reserve-exact", "failed",
     "reserve-exact", "CanaryFailed: exact CUDA VA request returned 0x2000, expected 0x1000"),
    (NotImplementedError("not ours"), "context", "failed", "context", "NotImplementedError: not ours"),
])
def test_negative_results_are_unsupported_only_for_missing_driver_symbols(
        exc: BaseException, phase: str, status: str, reported_phase: str, reason: str) -> None:
    result = _negative("cuda-vmm-exact-address", "cuda-vmm-exact-v1", phase, exc, started=0.0)
    assert (result.status, result.failure_phase, result.reason) == (status, reported_phase, reason)


def test_fresh_state_and_known_negatives_are_the_spec_records() -> None:
    assert fresh_state({"library_loaded": True}) == FeatureResult(
        id="cuda-fresh-state", status="passed", probe="disposable-process-boundary-v1", seconds=0.0)
    failed = fresh_state({"library_loaded": False, "error": None})
    assert (failed.status, failed.failure_phase, failed.reason) == (
        "failed", "load", "the CUDA driver library could not be loaded")
    assert [(r.id, r.status, r.failure_phase) for r in known_negatives()] == [
        ("cuda-uvm-checkpoint", "unsupported", None), ("cuda-vmm-exported-handle-checkpoint", "unsupported", None)]

"""Assemble the format-1 host feature profile (spec 1.1, 2.7)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
from typing import Any

from ._cache import boot_id
from ._canaries import checkpoint_report, checkpoint_results, fresh_state, ipc_canary, known_negatives, vmm_canary
from ._features import CRIU_PROBE
from ._model import FeatureResult, Profile
from ._process import criu_environment

__all__ = ("build_profile", "criu_identity", "identity")


def criu_identity(criu: str | None = None) -> dict[str, Any]:
    """`criu --version` of the CRIU a capture or restore runs (`criu`; default: the one on PATH), run with its
    library directory so that the version, not a loader error, is what is recorded."""
    path = shutil.which(criu or "criu")
    if path is None:
        return {"installed": False, "path": criu or "criu"}
    env = criu_environment(path)
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5, check=False, env=env)
        return {"installed": True, "path": path, "version": (done.stdout or done.stderr).strip(),
                "version_exit_code": done.returncode}
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"installed": True, "path": path, "version_error": f"{type(exc).__name__}: {exc}"}


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml() -> dict[str, Any]:
    """Driver version and the device's UUID, name and compute capability, through NVML."""
    selector = os.environ.get("COLDSNAP_PROBE_NVML_DEVICE", "0")
    try:
        import pynvml
    except ImportError as exc:
        return {"driver_version": None, "nvml_error": f"ImportError: {exc}"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return {"driver_version": None, "nvml_error": f"{type(exc).__name__}: {exc}"}
    try:
        handle = (pynvml.nvmlDeviceGetHandleByUUID(selector) if selector.startswith(("GPU-", "MIG-"))
                  else pynvml.nvmlDeviceGetHandleByIndex(int(selector)))
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return {"driver_version": _str(pynvml.nvmlSystemGetDriverVersion()),
                "gpu_uuid": _str(pynvml.nvmlDeviceGetUUID(handle)), "gpu_name": _str(pynvml.nvmlDeviceGetName(handle)),
                "compute_capability": f"{major}.{minor}"}
    except Exception as exc:
        return {"driver_version": None, "nvml_error": f"{type(exc).__name__}: {exc}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def identity(cuda_driver_api: int | None, criu: str | None = None) -> dict[str, Any]:
    return {"boot_id": boot_id(), "hostname": platform.node(), "architecture": platform.machine(),
            "kernel": platform.release(), **_nvml(), "cuda_driver_api": cuda_driver_api, "criu": criu_identity(criu)}


def build_profile(memory_bytes: int, timeout: float) -> Profile:
    """Run the round trip, the VMM canary and the IPC canary (in that order) and emit ten results."""
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

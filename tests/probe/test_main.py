"""`python -m coldsnap_probe` (`__main__.py`) on a machine without an NVIDIA driver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap_probe import Profile
from tests.helpers import ROOT

ORDER = ["cuda-checkpoint-api", "cuda-checkpoint-roundtrip", "cuda-vmm-exact-address", "cuda-classic-ipc",
         "cuda-uvm-checkpoint", "cuda-vmm-exported-handle-checkpoint", "criu-process-template",
         "criu-process-tree", "cuda-fresh-state", "cuda-initialized-state"]


def has_nvidia_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(has_nvidia_driver(), reason="these assert the no-driver behaviour")


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False)


def test_profile_without_a_driver_is_valid_and_never_passes_cuda() -> None:
    done = probe("profile")
    assert done.returncode == 0, done.stderr
    profile = Profile.from_json(json.loads(done.stdout)).to_json()
    assert [f["id"] for f in profile["features"]] == ORDER
    for feature in profile["features"]:
        if feature["id"] in ("cuda-uvm-checkpoint", "cuda-vmm-exported-handle-checkpoint"):
            assert feature["status"] == "unsupported" and feature["probe"] == "known-negative-v1"
        elif feature["id"].startswith("criu-"):
            assert feature["status"] == "unqualified"
        else:
            assert feature["status"] == "failed", feature
            assert feature["reason"] and ("libcuda.so.1" in feature["reason"] or "unavailable" in feature["reason"])
    phases = {f["id"]: f.get("failure_phase") for f in profile["features"]}
    assert phases["cuda-checkpoint-api"] == "symbols" and phases["cuda-vmm-exact-address"] == "load"
    assert phases["cuda-classic-ipc"] == "load" and phases["cuda-checkpoint-roundtrip"] == "roundtrip"
    assert profile["identity"]["boot_id"] and profile["identity"]["driver_version"] is None


@pytest.mark.parametrize(("args", "message"), [
    (["profile", "--memory-bytes", "4095"], "--memory-bytes must be within [4096, 1073741824], got 4095"),
    (["profile", "--memory-bytes", str((1 << 30) + 1)], "--memory-bytes must be within"),
    (["profile", "--timeout", "0"], "--timeout must be within (0, 300] seconds, got 0"),
    (["profile", "--timeout", "301"], "--timeout must be within (0, 300] seconds, got 301"),
])
def test_profile_bounds_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    done = probe(*args)
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""


def test_worker_probe_errors_exit_1_with_type_and_message(tmp_path: Path) -> None:
    """Any ProbeError (here the CUDA driver layer's) is one `error:` line, not a traceback."""
    done = probe("capture", "--pid", str(os.getpid()), "--images", str(tmp_path / "images"), "--boundary", "n610")
    assert done.returncode == 1 and done.stdout == ""
    # the phase it began, then the error naming it
    assert done.stderr.startswith("coldsnap-worker: capture phase find-cuda\nerror: capture phase find-cuda: "
                                  "CudaLibraryMissing: libcuda.so.1 could not be loaded")
    assert "Traceback" not in done.stderr


def test_profile_with_a_qualification_record_prints_its_features_passed(tmp_path: Path) -> None:
    """The host-qualification path: the record's unqualified features pass for this exact environment only."""
    identity = json.loads(probe("profile").stdout)["identity"]
    record = {"format": 1, "kind": "coldsnap-qualification-record", "id": "lab-7", "accepted": True,
              "environment": identity,
              "scope": {"engine": "vllm", "model_family": "llama", "connector": "", "topology_sha256": "t",
                        "graph_mode": "g", "transport": "ib", "nccl_provider": "nccl-2.28.9-1+coldsnap.1"},
              "features": ["criu-process-template", "criu-process-tree"], "unchanged_artifact_restores": 2}
    (tmp_path / "record.json").write_text(json.dumps(record))
    done = probe("profile", "--qualification", str(tmp_path / "record.json"))
    assert done.returncode == 0, done.stderr
    features = {f["id"]: f for f in json.loads(done.stdout)["features"]}
    assert features["criu-process-tree"] == {"id": "criu-process-tree", "status": "passed",
                                             "probe": "qualification:lab-7", "seconds": 0.0}
    (tmp_path / "record.json").write_text(json.dumps({**record, "environment": {**identity, "boot_id": "x"}}))
    done = probe("profile", "--qualification", str(tmp_path / "record.json"))
    assert done.returncode == 1 and "ProfileError: qualification environment does not equal" in done.stderr

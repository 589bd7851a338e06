"""On a GPU host (run by scripts/device-qualify on the H200): the probe admits n580 and n610 for real.

CI has no GPU: there the no-driver behaviour in test_cli.py is what is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap_probe import admit, requirements, validate_profile
from tests.helpers import ROOT
from tests.probe.test_cli import ORDER, has_nvidia_driver

pytestmark = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver (run on the GPU host)")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, check=False,
                          timeout=280)


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


def test_no_child_is_left_locked_or_running() -> None:
    run("coldsnap_probe", "profile")
    leftover = subprocess.run(["pgrep", "-f", "coldsnap_probe _(target|ipc_target)"], capture_output=True,
                              text=True, check=False)
    assert leftover.returncode == 1, leftover.stdout


@pytest.mark.skipif(shutil.which("criu") is None, reason="needs CRIU on PATH")
@pytest.mark.parametrize("driver", ["n610", "n580"])
def test_host_process_probe_admits_caches_and_reuses(driver: str, tmp_path: Path) -> None:
    first = run("coldsnap_provider", "probe", "--driver", driver, "--host-process", "--state-dir", str(tmp_path),
                "--json")
    outcome = json.loads(first.stdout)
    assert first.returncode == 0 and outcome["admitted"] is True and outcome["error"] is None, outcome["error"]
    assert outcome["cached"] is False
    admit(requirements(driver), outcome["profile"])
    cache = tmp_path / "host-feature-profiles"
    files = list(cache.iterdir())
    assert len(files) == 1 and stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    second = json.loads(run("coldsnap_provider", "probe", "--driver", driver, "--host-process", "--state-dir",
                            str(tmp_path), "--json").stdout)
    assert second["admitted"] is True and second["cached"] is True
    files[0].write_text(files[0].read_text()[:100])  # damaged: probed afresh, never admitted from it
    third = json.loads(run("coldsnap_provider", "probe", "--driver", driver, "--host-process", "--state-dir",
                           str(tmp_path), "--json").stdout)
    assert third["admitted"] is True and third["cached"] is False

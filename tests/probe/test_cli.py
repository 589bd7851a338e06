"""`python -m coldsnap_probe` on a machine without an NVIDIA driver, and `coldsnap-provider probe`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from coldsnap_probe import validate_profile
from coldsnap_provider._client import ReplyError
from coldsnap_provider._probe import PROBE_MOUNT, ProbeOptions, criu_workload, probe_workload
from coldsnap_runtime.backend._translate import container_config
from tests.conftest import docker
from tests.helpers import ROOT, running_daemon

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
    profile = validate_profile(json.loads(done.stdout))
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


def provider_probe(*args: str, state: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_provider", "probe", "--state-dir", state, *args],
                          capture_output=True, text=True, cwd=ROOT, check=False)


def test_host_process_probe_is_not_admitted_and_not_cached(tmp_path: object) -> None:
    state = str(tmp_path)
    done = provider_probe("--driver", "n610", "--host-process", "--criu", "/bin/true", "--json", state=state)
    assert done.returncode == 3, done.stderr
    outcome = json.loads(done.stdout)
    assert set(outcome) == {"profile", "admitted", "error", "cached"}
    assert outcome["admitted"] is False and outcome["cached"] is False
    assert outcome["error"].startswith("required feature cuda-checkpoint-api is failed: phase symbols: ")
    tree = {f["id"]: f for f in outcome["profile"]["features"]}["criu-process-tree"]
    assert tree["status"] == "passed" and tree["probe"] == "capsule-criu-check-v1"  # CRIU evidence attached
    assert not (tmp_path / "host-feature-profiles").exists()  # type: ignore[operator]


def test_failed_criu_check_is_the_admission_error(tmp_path: object) -> None:
    done = provider_probe("--driver", "n580", "--host-process", "--criu", "/bin/false", "--json", state=str(tmp_path))
    assert done.returncode == 3
    assert json.loads(done.stdout)["error"].startswith("destination kernel failed capsule-pinned CRIU check: exit 1")


@pytest.mark.parametrize("args", [["--driver", "n610"], ["--driver", "n610", "--host-process", "--image", "x"],
                                  ["--driver", "auto", "--host-process"]])
def test_probe_usage_errors_exit_2(args: list[str], tmp_path: object) -> None:
    assert provider_probe(*args, state=str(tmp_path)).returncode == 2


def test_probe_workloads_realise_the_isolation_rules() -> None:
    options = ProbeOptions(driver="n610", device="3", image="capsule@sha256:" + "0" * 64)
    probe_config = container_config(probe_workload(options))
    host = probe_config["HostConfig"]
    assert host["DeviceRequests"][0]["DeviceIDs"] == ["3"] and host["NetworkMode"] == "none"
    assert host["Binds"][0].endswith(f":{PROBE_MOUNT}/coldsnap_probe:ro")
    assert probe_config["Entrypoint"] == ["python3"]
    assert probe_config["Cmd"] == ["-m", "coldsnap_probe", "profile", "--memory-bytes", "1048576", "--timeout", "30"]
    criu = container_config(criu_workload(options))
    assert criu["Entrypoint"] == ["/opt/coldsnap/criu/bin/criu"] and criu["Cmd"] == ["check"]
    assert criu["HostConfig"]["NetworkMode"] == "host" and "DeviceRequests" not in criu["HostConfig"]


@pytest.mark.usefixtures("no_leftovers")
def test_image_probe_runs_in_disposable_containers_and_fails_cleanly_without_nvidia(
        busybox_image: str, tmp_path: object) -> None:
    done = provider_probe("--driver", "n610", "--image", busybox_image, "--criu", "/bin/true", state=str(tmp_path))
    assert done.returncode == 1
    assert 'could not select device driver "nvidia"' in done.stderr
    assert docker("ps", "-aq", "--filter", f"ancestor={busybox_image}").stdout.strip() == b""


async def test_probe_is_a_control_socket_operation() -> None:
    async with running_daemon() as daemon:
        outcome = await daemon.control(operation="probe", driver="n580", host_process=True, criu="/bin/true")
        assert outcome["admitted"] is False
        assert outcome["error"].startswith("required feature cuda-fresh-state is failed")
        with pytest.raises(ReplyError, match="give --image IMAGE or --host-process"):
            await daemon.control(operation="probe", driver="n580")

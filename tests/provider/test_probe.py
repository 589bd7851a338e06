"""`coldsnap-provider probe` (`_probe.py`): the probe launched on this host or in capsule containers.

Moved from tests/probe, which may import only coldsnap_probe's private modules.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap_probe import admit, requirements
from coldsnap_provider import ReplyError
from coldsnap_provider._probe import PROBE_MOUNT, ProbeOptions, criu_workload, probe_workload
from coldsnap_runtime.backend import container_config
from tests.conftest import docker
from tests.helpers import ROOT, running_daemon
from tests.probe.test_main import has_nvidia_driver

no_driver = pytest.mark.skipif(has_nvidia_driver(), reason="these assert the no-driver behaviour")
needs_driver = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver (run on the GPU host)")


def provider_probe(*args: str, state: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_provider", "probe", "--state-dir", state, *args],
                          capture_output=True, text=True, cwd=ROOT, check=False)


@no_driver
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


@no_driver
def test_failed_criu_check_is_the_admission_error(tmp_path: object) -> None:
    done = provider_probe("--driver", "n580", "--host-process", "--criu", "/bin/false", "--json", state=str(tmp_path))
    assert done.returncode == 3
    assert json.loads(done.stdout)["error"].startswith("destination kernel failed capsule-pinned CRIU check: exit 1")


@no_driver
@pytest.mark.parametrize("args", [["--driver", "n610"], ["--driver", "n610", "--host-process", "--image", "x"],
                                  ["--driver", "auto", "--host-process"]])
def test_probe_usage_errors_exit_2(args: list[str], tmp_path: object) -> None:
    assert provider_probe(*args, state=str(tmp_path)).returncode == 2


@no_driver
def test_probe_workloads_realise_the_isolation_rules() -> None:
    options = ProbeOptions(driver="n610", device="3", image="capsule@sha256:" + "0" * 64)
    probe_config = container_config(probe_workload(options, Path("/state/probe-package-x/coldsnap_probe")))
    host = probe_config["HostConfig"]
    assert host["DeviceRequests"][0]["DeviceIDs"] == ["3"] and host["NetworkMode"] == "none"
    assert host["Binds"][0] == f"/state/probe-package-x/coldsnap_probe:{PROBE_MOUNT}/coldsnap_probe:ro"
    assert probe_config["Entrypoint"] == ["python3"]
    assert probe_config["Cmd"] == ["-m", "coldsnap_probe", "profile", "--memory-bytes", "1048576", "--timeout", "30"]
    criu = container_config(criu_workload(options))
    assert criu["Entrypoint"] == ["/opt/coldsnap/criu/bin/criu"] and criu["Cmd"] == ["check"]
    assert criu["HostConfig"]["NetworkMode"] == "none" and "DeviceRequests" not in criu["HostConfig"]


@no_driver
@pytest.mark.usefixtures("no_leftovers")
def test_image_probe_runs_in_disposable_containers_and_fails_cleanly_without_nvidia(
        busybox_image: str, tmp_path: object) -> None:
    # A tag of its own: other clients of the engine may run busybox containers meanwhile. (`ancestor=` would
    # match theirs too: it resolves the tag to the image; a container's Image column is the reference it was
    # created from.)
    image = f"coldsnap-test/busybox:probe-{secrets.token_hex(4)}"
    docker("tag", busybox_image, image)
    try:
        done = provider_probe("--driver", "n610", "--image", image, "--criu", "/bin/true", state=str(tmp_path))
        assert done.returncode == 1
        assert "no mechanism can give this container GPU 0" in done.stderr  # [gpus] mode auto, no NVIDIA here
        # A workload's container is created from the image id its run checked (review 2026-12-02, finding 5) and
        # names the reference asked for in a label.
        assert not docker("ps", "-aq", "--filter", f"label=io.coldsnap-provider.image={image}").stdout.strip()
        assert image not in docker("ps", "-a", "--no-trunc", "--format", "{{.Image}}").stdout.decode().split()
    finally:
        docker("rmi", image, check=False)


@no_driver
async def test_probe_is_a_control_socket_operation() -> None:
    async with running_daemon() as daemon:
        outcome = await daemon.control(operation="probe", driver="n580", host_process=True)
        assert outcome["admitted"] is False  # no criu on this host's PATH, and no GPU
        assert outcome["error"].startswith("destination kernel failed capsule-pinned CRIU check")
        with pytest.raises(ReplyError, match="a probe needs an `image` or `host_process`"):
            await daemon.control(operation="probe", driver="n580")


def run_provider(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_provider", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=280)


@needs_driver
@pytest.mark.skipif(shutil.which("criu") is None, reason="needs CRIU on PATH")
@pytest.mark.parametrize("driver", ["n610", "n580"])
def test_host_process_probe_admits_caches_and_reuses(driver: str, tmp_path: Path) -> None:
    first = run_provider("probe", "--driver", driver, "--host-process", "--state-dir", str(tmp_path),
                "--json")
    outcome = json.loads(first.stdout)
    assert first.returncode == 0 and outcome["admitted"] is True and outcome["error"] is None, outcome["error"]
    assert outcome["cached"] is False
    admit(requirements(driver), outcome["profile"])
    cache = tmp_path / "host-feature-profiles"
    files = list(cache.iterdir())
    assert len(files) == 1 and stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(files[0]).st_mode) == 0o600
    second = json.loads(run_provider("probe", "--driver", driver, "--host-process", "--state-dir",
                            str(tmp_path), "--json").stdout)
    assert second["admitted"] is True and second["cached"] is True
    files[0].write_text(files[0].read_text()[:100])  # damaged: probed afresh, never admitted from it
    third = json.loads(run_provider("probe", "--driver", driver, "--host-process", "--state-dir",
                           str(tmp_path), "--json").stdout)
    assert third["admitted"] is True and third["cached"] is False


async def test_probe_container_gets_a_disposable_copy_of_the_package_never_the_installed_one(
        busybox_image: str, tmp_path: Path) -> None:
    """Review of #24: the probe bound this package's installed directory (code the daemon imports as root)
    read-only into the caller's image with CAP_SYS_ADMIN, which remounts the bind read-write: any manager
    could rewrite the daemon's code. Now the container gets a copy, removed after it."""
    from coldsnap_provider._probe import _PACKAGE_DIR, package_copy

    options = ProbeOptions(driver="n610", image=busybox_image)
    planted = f"planted-{os.getpid()}"
    async with package_copy(tmp_path) as copy:
        [mount] = probe_workload(options, copy).mounts
        assert mount.read_only and Path(mount.source) == copy and copy.parent.parent == tmp_path
        assert sorted(p.name for p in copy.glob("*.py")) == sorted(p.name for p in _PACKAGE_DIR.glob("*.py"))
        # What a hostile probe image does with the probe's CAP_SYS_ADMIN.
        done = subprocess.run(["docker", "run", "--rm", "--cap-add", "SYS_ADMIN", "--security-opt",
                               "apparmor=unconfined", "-v", f"{mount.source}:{mount.target}:ro", busybox_image, "sh",
                               "-c", f"mount -o remount,rw,bind {mount.target} && touch {mount.target}/{planted}"],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr  # the remount works: only a copy makes it harmless
        assert (copy / planted).exists()
        assert not (_PACKAGE_DIR / planted).exists()
    assert not copy.parent.exists()

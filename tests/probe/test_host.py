"""This host's identity (`_host.py`): procfs first for a restore, NVML for the record, and the two agree.

Without an NVIDIA kernel module (CI) procfs cannot answer and NVML is asked; on the GPU host the kernel module's
procfs must give exactly NVML's driver version, UUID and name for every GPU (captures recorded NVML's).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coldsnap_probe._host import (
    DEVICE_SELECTOR_ENV,
    GPU_FACTS,
    IdentityReading,
    gpu_identity,
    host_identity,
    nvml_identity,
    system_identity,
)
from coldsnap_probe._nvidia_procfs import PROC_NVIDIA, KernelGpu, kernel_gpu
from coldsnap_probe._profile import identity
from tests.probe.test_main import has_nvidia_driver

needs_driver = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver (run on the GPU host)")
without_module = pytest.mark.skipif(PROC_NVIDIA.exists(), reason="asserts the behaviour without the kernel module")


@without_module
def test_gpu_identity_without_the_kernel_module_asks_nvml_and_says_why() -> None:
    found = gpu_identity()
    assert found["gpu_identity_source"] == "nvml"
    assert found["procfs_unused"] == f"{PROC_NVIDIA}: No such file or directory"
    assert set(found) <= GPU_FACTS


def test_gpu_identity_asked_for_nvml_never_reads_procfs() -> None:
    found = gpu_identity(nvml=True)
    assert found["gpu_identity_source"] == "nvml" and "procfs_unused" not in found
    assert set(found) <= GPU_FACTS


def test_host_identity_has_what_a_restore_compares() -> None:
    found = host_identity("criu-that-is-not-installed")
    assert found["architecture"] == os.uname().machine and found["boot_id"]
    assert found["criu"] == {"installed": False, "path": "criu-that-is-not-installed"}
    assert found["gpu_identity_source"] in ("procfs", "nvml") and "driver_version" in found


def test_an_identity_reading_runs_while_its_maker_goes_on(tmp_path: Path) -> None:
    # A CRIU whose `--version` answers only once the maker has gone on past the reading's start (a gate file it
    # writes afterwards): a reading made in the maker's own thread would never see the gate.
    gate, criu = tmp_path / "gate", tmp_path / "criu"
    criu.write_text(f"#!/bin/sh\nn=0\nuntil test -e {gate}; do n=$((n+1)); [ $n -gt 400 ] && "
                    "{ echo 'gate never opened'; exit 0; }; sleep 0.01; done\necho 'Version: gated'\n")
    criu.chmod(0o755)
    reading = IdentityReading(str(criu))
    gate.touch()
    found = reading.result()
    assert found["criu"] == {"installed": True, "path": str(criu), "version": "Version: gated",
                             "version_exit_code": 0}
    assert found == {**host_identity(str(criu)), "criu": found["criu"]}
    assert reading.result() is found  # read once


def test_the_profiles_identity_stays_nvmls_with_the_same_keys_as_before() -> None:
    """The profile and the capture record NVML's facts, in the keys older captures have."""
    found = identity(12080, criu="criu-that-is-not-installed")
    assert list(found)[:4] == list(system_identity()) == ["boot_id", "hostname", "architecture", "kernel"]
    assert "gpu_identity_source" not in found and found["cuda_driver_api"] == 12080
    nvml = nvml_identity(os.environ.get(DEVICE_SELECTOR_ENV, "0"))
    assert {k: found.get(k) for k in nvml if k != "nvml_error"} == {k: v for k, v in nvml.items() if k != "nvml_error"}


@needs_driver
def test_procfs_gives_exactly_nvmls_facts_for_every_gpu() -> None:
    """Regression: #22. The restore checks procfs's facts against captures written through NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    assert uuids
    for uuid in (u.decode() if isinstance(u, bytes) else u for u in uuids):
        nvml = nvml_identity(uuid)
        assert kernel_gpu(uuid) == KernelGpu(driver_version=nvml["driver_version"], gpu_uuid=nvml["gpu_uuid"],
                                             gpu_name=nvml["gpu_name"]), uuid
    if len(uuids) == 1:  # the capsule's case: the default selector "0" is answered by procfs
        assert gpu_identity()["gpu_identity_source"] == "procfs"


@needs_driver
def test_the_real_procfs_lists_gpus_under_their_bus_ids() -> None:
    names = sorted(p.name for p in (PROC_NVIDIA / "gpus").iterdir())
    assert names and isinstance(kernel_gpu("0", Path(PROC_NVIDIA)), KernelGpu if len(names) == 1 else str)

"""Whether this host can restore a capture (`_target.check_target`): every fact, a stable code, both values."""

from __future__ import annotations

from typing import Any

import pytest

from coldsnap_probe._target import check_target
from coldsnap_probe.errors import TargetRefused, WorkerError

CRIU = {"installed": True, "path": "/usr/sbin/criu", "version": "Version: 4.2", "version_exit_code": 0}
H200 = {"architecture": "x86_64", "kernel": "6.1.0-28-amd64", "driver_version": "580.159.04",
        "gpu_name": "NVIDIA H200", "gpu_memory_bytes": 150_754_820_096, "cuda_driver_api": 13000, "gpu_devices": 1,
        "image_layers": ["sha256:" + "a" * 64, "sha256:" + "b" * 64], "criu": CRIU}


def refused(current: dict[str, Any], boundary: str = "n610", captured: dict[str, Any] = H200) -> list[dict[str, Any]]:
    with pytest.raises(TargetRefused) as caught:
        check_target(captured, current, boundary)
    assert isinstance(caught.value, WorkerError)  # the worker's error tree: a refusal is a failed restore
    return list(caught.value.mismatches)


@pytest.mark.parametrize(("changed", "boundary", "outcome"), [
    ({}, "n610", "exact"),
    ({"driver_version": "610.43.02"}, "n610", "driver-upgraded"),
    ({"driver_version": "580.65.06"}, "n610", "driver-upgraded"),  # the same major: the driver restores it
    ({"kernel": "6.1.0-31-amd64"}, "n610", "exact"),  # a patch release of the same kernel
    ({"cuda_driver_api": 13010}, "n610", "exact"),  # a newer CUDA API
    ({"driver_version": "575.1", "gpu_name": "NVIDIA GB10", "gpu_devices": 2}, "n580", "pre-cuda-template"),
    ({"image_layers": None, "gpu_memory_bytes": None, "gpu_devices": None}, "n610", "exact"),  # unknown here
    # the upstream flow: captured in the base image, restored in a capsule image built FROM it (more layers)
    ({"image_layers": [*H200["image_layers"], "sha256:" + "c" * 64]}, "n610", "exact"),
])
def test_a_compatible_host_restores(changed: dict[str, Any], boundary: str, outcome: str) -> None:
    assert check_target(H200, {**H200, **changed}, boundary) == outcome


@pytest.mark.parametrize(("changed", "code", "fact"), [
    ({"architecture": "aarch64"}, "architecture-mismatch", "architecture"),
    ({"kernel": "6.12.9-amd64"}, "kernel-mismatch", "kernel"),
    ({"image_layers": ["sha256:" + "a" * 64]}, "capsule-image-mismatch", "image_layers"),
    ({"image_layers": ["sha256:" + "d" * 64, "sha256:" + "b" * 64, "sha256:" + "c" * 64]}, "capsule-image-mismatch",
     "image_layers"),
    ({"criu": {**CRIU, "version": "Version: 4.1.1"}}, "criu-mismatch", "criu"),
    ({"criu": {"installed": False, "path": "criu"}}, "criu-unusable", "criu"),
    ({"driver_version": "575.1"}, "driver-older", "driver_version"),
    ({"driver_version": None}, "driver-unknown", "driver_version"),
    ({"cuda_driver_api": 12080}, "cuda-older", "cuda_driver_api"),
    ({"gpu_name": "NVIDIA GB10"}, "gpu-model-mismatch", "gpu_name"),
    ({"gpu_memory_bytes": 76_000_000_000}, "gpu-memory-mismatch", "gpu_memory_bytes"),
    ({"gpu_devices": 2}, "device-count-mismatch", "gpu_devices"),
])
def test_each_fact_has_its_code_and_both_values(changed: dict[str, Any], code: str, fact: str) -> None:
    [mismatch] = refused({**H200, **changed})
    assert (mismatch["code"], mismatch["fact"]) == (code, fact)
    if fact == "image_layers":
        assert mismatch["captured"] == f"2 layers, the top sha256:{'b' * 64}"
        assert mismatch["current"].startswith(f"{len(changed[fact])} layers, the top sha256:")
    elif fact != "criu":
        assert (mismatch["captured"], mismatch["current"]) == (H200[fact], changed[fact])


def test_every_mismatch_is_named_at_once_and_in_the_message() -> None:
    current = {**H200, "architecture": "aarch64", "gpu_name": "NVIDIA GB10", "driver_version": "575.1"}
    with pytest.raises(TargetRefused) as caught:
        check_target(H200, current, "n610")
    codes = [m["code"] for m in caught.value.mismatches]
    assert codes == ["architecture-mismatch", "driver-older", "gpu-model-mismatch"]
    assert "gpu-model-mismatch (gpu_name: captured 'NVIDIA H200', this host 'NVIDIA GB10')" in str(caught.value)


def test_a_template_compares_no_gpu_fact_but_the_system_and_criu() -> None:
    current = {**H200, "kernel": "5.10.0-9-amd64", "driver_version": None, "gpu_name": None}
    assert [m["code"] for m in refused(current, "n580")] == ["kernel-mismatch"]


def test_an_older_capture_without_the_new_facts_still_restores() -> None:
    """Captures made before these facts were recorded (no kernel, image, memory, device count or CUDA API)."""
    older = {key: H200[key] for key in ("architecture", "driver_version", "gpu_name", "criu")}
    assert check_target(older, H200, "n610") == "exact"


def test_a_capture_whose_criu_could_not_say_its_version_is_not_refused_for_it() -> None:
    older = {**H200, "criu": {"installed": True, "path": "criu", "version_error": "OSError: boom"}}
    assert check_target(older, H200, "n610") == "exact"


@pytest.mark.parametrize(("identity", "why"), [
    ([], "the identity is list, not an object"),
    (None, "the identity is NoneType, not an object"),
    ({**H200, "criu": "Version: 4.2"}, "criu is str, not dict"),
    ({**H200, "kernel": ["6", "1"]}, "kernel is list, not str"),
    ({**H200, "gpu_devices": True}, "gpu_devices is bool, not int"),
    ({**H200, "image_layers": [1, 2]}, "image_layers holds a value that is not a string"),
])
def test_a_record_of_another_shape_is_refused_by_name_never_a_crash(identity: Any, why: str) -> None:
    """Review finding: the manager's own capsule writes the record; a crafted one is refused, with its code."""
    [mismatch] = refused(H200, captured=identity)
    assert (mismatch["code"], mismatch["fact"], mismatch["captured"]) == ("record-invalid", "identity", why)

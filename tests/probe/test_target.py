"""Whether this host can restore a capture (`_target.check_target`): every fact, a stable code, both values."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe._restore_after_criu import restore_args
from coldsnap_probe._target import check_target, gpu_pairs
from coldsnap_probe.errors import TargetRefused, WorkerError
from tests.probe.test_main import has_nvidia_driver

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


# -- another GPU of the captured model (issue 36 item 4) ----------------------------------------------------------
UUID_A, UUID_B = "GPU-0123abcd-4567-89ab-cdef-0123456789ab", "GPU-fedcba98-7654-3210-fedc-ba9876543210"
ON_A = {**H200, "gpu_uuid": UUID_A}


def test_another_gpu_of_the_model_restores_remapped_with_the_pair_the_driver_needs() -> None:
    """Driver 580 (CUDA 13.0) restores onto another GPU of the chip when told the pair (`CUcheckpointRestoreArgs
    .gpuPairs`): admitted as `gpu-remapped`, the pair built from both UUIDs; on the captured GPU, no pair."""
    on_b = {**H200, "gpu_uuid": UUID_B}
    assert check_target(ON_A, on_b, "n610") == "gpu-remapped"
    assert gpu_pairs(ON_A, on_b) == [(bytes.fromhex("0123abcd456789abcdef0123456789ab"),
                                      bytes.fromhex("fedcba9876543210fedcba9876543210"))]
    assert check_target(ON_A, ON_A, "n610") == "exact" and gpu_pairs(ON_A, ON_A) == []
    assert check_target(H200, on_b, "n610") == "exact" and gpu_pairs(H200, on_b) == []  # an older capture: unknown
    assert check_target(ON_A, on_b, "n580") == "pre-cuda-template"  # a template has no CUDA state to remap


@pytest.mark.parametrize(("captured", "current", "policy", "code", "fact"), [
    (ON_A, {**H200, "gpu_uuid": UUID_B}, "same-gpu", "gpu-uuid-mismatch", "gpu_uuid"),
    ({**ON_A, "cuda_driver_api": 12080}, {**H200, "gpu_uuid": UUID_B, "cuda_driver_api": 12080}, "same-model",
     "gpu-remap-unsupported", "cuda_driver_api"),
    ({**ON_A, "gpu_devices": 2}, {**H200, "gpu_uuid": UUID_B, "gpu_devices": 2}, "same-model",
     "gpu-remap-unsupported", "gpu_devices"),
    (ON_A, {**H200, "gpu_uuid": "MIG-0123abcd-4567-89ab-cdef-0123456789ab"}, "same-model", "gpu-remap-unsupported",
     "gpu_uuid"),
], ids=["same-gpu-policy", "cuda-12.8", "several-gpus", "mig"])
def test_another_gpu_the_driver_cannot_be_told_to_restore_onto_is_refused_by_name(
        captured: dict[str, Any], current: dict[str, Any], policy: str, code: str, fact: str) -> None:
    with pytest.raises(TargetRefused) as caught:
        check_target(captured, current, "n610", device_policy=policy)
    [mismatch] = caught.value.mismatches
    assert (mismatch["code"], mismatch["fact"]) == (code, fact)
    assert (mismatch["captured"], mismatch["current"]) == (captured.get(fact), current.get(fact))


def test_the_restore_passes_the_pairs_in_the_drivers_own_struct() -> None:
    """The arguments `cuCheckpointProcessRestore` gets, built with cuda-python's own types (no driver needed to
    build them): none on the captured GPU, every pair's 16 bytes otherwise."""
    driver = pytest.importorskip("cuda.bindings.driver")
    assert restore_args(driver, []) is None
    args = restore_args(driver, gpu_pairs(ON_A, {**H200, "gpu_uuid": UUID_B}))
    assert args.gpuPairsCount == 1
    [pair] = args.gpuPairs
    assert bytes(pair.oldUuid.bytes) == bytes.fromhex(UUID_A[4:].replace("-", ""))
    assert bytes(pair.newUuid.bytes) == bytes.fromhex(UUID_B[4:].replace("-", ""))


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver (run on the GPU host)")
def test_driver_580_takes_a_gpu_pair_on_restore(tmp_path: Path) -> None:
    """The closest one GPU allows to restoring onto another: a CUDA process checkpointed and restored in place with
    the pair (this GPU -> this GPU) in `gpuPairs` (the driver refuses a struct it does not know with
    CUDA_ERROR_INVALID_VALUE), held as the workers hold it; it then computes on its device memory as before."""
    from coldsnap_probe._cuda import Driver
    from coldsnap_probe._held_tree import driver_alone, stop_tree
    from coldsnap_probe._host import gpu_identity
    from tests.probe.test_worker import start_target, verify

    control = tmp_path / "control"
    target = start_target("n610", control, "16")
    try:
        assert verify(control, 0)
        here = gpu_identity()
        pairs = gpu_pairs({"gpu_uuid": "GPU-" + "0" * 32}, here)  # (any other GPU, this one): this one's bytes
        assert len(pairs) == 1, here
        driver = Driver()
        driver.call("cuInit", 0)
        driver.call("cuCheckpointProcessLock", target.pid, None)
        stop_tree([target.pid])
        with driver_alone(driver, target.pid):  # (GetState answers only while the restore thread runs)
            driver.call("cuCheckpointProcessCheckpoint", target.pid, None)
            assert driver.state(target.pid) == "checkpointed"
        with driver_alone(driver, target.pid):
            driver.call("cuCheckpointProcessRestore", target.pid, restore_args(driver.cuda, [(pairs[0][1],) * 2]))
            driver.call("cuCheckpointProcessUnlock", target.pid, None)
            assert driver.state(target.pid) == "running"
        os.kill(target.pid, signal.SIGCONT)
        assert verify(control, 1)
    finally:
        os.killpg(target.pid, signal.SIGKILL)
        target.wait()

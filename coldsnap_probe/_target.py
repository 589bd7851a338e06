"""Whether this host can restore a capture: every recorded fact against the target's, before any CRIU or CUDA work.

A restore that cannot succeed must fail in milliseconds, not deep inside CRIU or the driver's restore (where a
mismatch costs tens of seconds and leaves work to undo). `check_target` compares what the capture recorded with
what `_host.host_identity` read here and raises `errors.TargetRefused` with one `Mismatch` per fact (all of them,
not the first), each with a stable reason code and both values:

    architecture-mismatch     the CPU architecture differs (the images hold its machine code)
    kernel-mismatch           the kernel's major.minor differs (a patch release restores; CRIU's view of the
                              kernel's features may change across minor releases)
    criu-unusable             this capsule's CRIU does not run
    criu-mismatch             another CRIU version (or patch) than the one that dumped the images
    capsule-image-mismatch    the capsule image is not built on the image the capture ran in: the captured
                              image's layers are not the first layers of this one (the upstream flow captures in
                              the base image and restores in a capsule image built FROM it; the provider names
                              every workload's layers, `CAPSULE_LAYERS_ENV`); not compared where either is unknown
    record-invalid            the record's identity is not of the shape a capture writes
    driver-unknown            initialized CUDA state, and the driver version here or in the record is unknown
    driver-older              the NVIDIA driver is older than the captured one (a newer one restores: upgraded)
    cuda-older                the driver's CUDA API version is older than the captured one
    gpu-model-mismatch        another GPU model
    gpu-memory-mismatch       the GPU's memory differs (a MIG slice of another size); compared where both are known
    device-count-mismatch     another number of GPUs visible to the capsule than the captured process saw
    gpu-uuid-mismatch         another GPU of the same model, and the restore's device policy is `same-gpu`
    gpu-remap-unsupported     another GPU of the same model that the driver cannot be told to restore onto: its
                              CUDA API predates the restore's GPU pairs (before 12.9: the 570 driver "does not
                              support GPU migration"), the capture saw several GPUs (one UUID is recorded; the
                              driver needs a pair for every checkpointed GPU), or a UUID is not a `GPU-` one (MIG)

Another GPU of the same model (`same-model`, the default policy): the CUDA restore passes the driver the pair
(captured UUID -> this one: `cuCheckpointProcessRestore`'s `CUcheckpointRestoreArgs.gpuPairs`, "the GPU to
restore onto needs to have enough memory and be of the same chip type"), and the compatibility is `gpu-remapped`.
A pre-CUDA template (n580) holds no CUDA state: only the architecture, kernel, CRIU and capsule image are compared.
The capsule image is a safety check, not a boundary: a manager controls its own capsule's environment.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._host import GPU_FACTS, gpu_identity
from .errors import TargetRefused

__all__ = ("Mismatch", "check_target", "comparable", "gpu_pairs")

REMAP_CUDA_API = 12090  # the first CUDA API whose restore takes GPU pairs (12.8's 570 driver did not remap)
_GPU_UUID_HEX = 32


# A tuple, not a dataclass: it is on a restore's path to CRIU (dataclasses' import, ~15 ms on the H200; issue 35).
class Mismatch(NamedTuple):
    """One fact this host cannot restore: its stable reason code, the fact's name and both values."""

    code: str
    fact: str
    captured: Any
    current: Any

    def to_json(self) -> dict[str, Any]:
        return self._asdict()



def check_target(captured: dict[str, Any], current: dict[str, Any], boundary: str, *,
                 device_policy: str = "same-model") -> str:
    """`exact`, `driver-upgraded`, `gpu-remapped` or `pre-cuda-template`; raises `TargetRefused` naming every
    mismatched fact.

    `captured` is the capture's `identity`, `current` this host's (`host_identity`), both in one vocabulary
    (`comparable`); `device_policy` (`same-model`, `same-gpu`) says whether another GPU of the model restores."""
    if shape := _misshapen(captured):
        raise TargetRefused([Mismatch("record-invalid", "identity", shape, "an identity as a capture writes it")
                             .to_json()])
    found = [*_system(captured, current), *_criu(captured.get("criu") or {}, current.get("criu") or {})]
    if boundary != "n580":
        found += _gpu(captured, current)
        found += _another_gpu(captured, current, device_policy) if not found else []
    if found:
        raise TargetRefused([m.to_json() for m in found])
    if boundary == "n580":
        return "pre-cuda-template"  # no CUDA state was captured: the process initializes CUDA fresh
    if gpu_pairs(captured, current):
        return "gpu-remapped"
    return "exact" if captured.get("driver_version") == current.get("driver_version") else "driver-upgraded"


def _system(captured: dict[str, Any], current: dict[str, Any]) -> list[Mismatch]:
    found = []
    if captured.get("architecture") != current.get("architecture"):
        found.append(Mismatch("architecture-mismatch", "architecture", captured.get("architecture"),
                              current.get("architecture")))
    was, now = _major_minor(captured.get("kernel")), _major_minor(current.get("kernel"))
    if was is not None and was != now:
        found.append(Mismatch("kernel-mismatch", "kernel", captured.get("kernel"), current.get("kernel")))
    was_layers, now_layers = captured.get("image_layers"), current.get("image_layers")
    if was_layers and now_layers and now_layers[:len(was_layers)] != was_layers:
        found.append(Mismatch("capsule-image-mismatch", "image_layers", _layers_text(was_layers),
                              _layers_text(now_layers)))
    return found


def _layers_text(layers: list[str]) -> str:
    return f"{len(layers)} layers, the top {layers[-1]}"


_SHAPES: dict[str, tuple[type, ...]] = {
    "architecture": (str,), "kernel": (str,), "criu": (dict,), "driver_version": (str,), "gpu_name": (str,),
    "gpu_memory_bytes": (int,), "cuda_driver_api": (int,), "gpu_devices": (int,), "image_layers": (list,),
    "procfs": (dict,), "gpu_uuid": (str,)}


def _misshapen(captured: Any) -> str:
    """'' when `captured` has the shape a capture writes (a fact may be absent or null), else what is wrong: a
    record the manager's capsule wrote is refused by name, never crashes the check."""
    if not isinstance(captured, dict):
        return f"the identity is {type(captured).__name__}, not an object"
    for fact, types in _SHAPES.items():
        value = captured.get(fact)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            return f"{fact} is {type(value).__name__}, not {types[0].__name__}"
    layers = captured.get("image_layers")
    if layers is not None and not all(isinstance(layer, str) for layer in layers):
        return "image_layers holds a value that is not a string"
    return ""


def _criu(captured: dict[str, Any], current: dict[str, Any]) -> list[Mismatch]:
    """A restore runs the CRIU that dumped the images: another version (or patch) could misread them. A capture
    that recorded no usable version (older workers recorded a loader error) is not refused for it."""
    if current.get("version_exit_code") != 0:
        return [Mismatch("criu-unusable", "criu", captured.get("version"),
                         current.get("version") or current.get("version_error") or f"{current.get('path')}: absent")]
    if captured.get("version_exit_code") == 0 and captured.get("version") != current.get("version"):
        return [Mismatch("criu-mismatch", "criu", captured.get("version"), current.get("version"))]
    return []


def _gpu(captured: dict[str, Any], current: dict[str, Any]) -> list[Mismatch]:
    found = []
    was, now = _leading_int(captured.get("driver_version")), _leading_int(current.get("driver_version"))
    if was is None or now is None:
        found.append(Mismatch("driver-unknown", "driver_version", captured.get("driver_version"),
                              current.get("driver_version")))
    elif now < was:
        found.append(Mismatch("driver-older", "driver_version", captured.get("driver_version"),
                              current.get("driver_version")))
    cuda_was, cuda_now = captured.get("cuda_driver_api"), current.get("cuda_driver_api")
    if isinstance(cuda_was, int) and isinstance(cuda_now, int) and cuda_now < cuda_was:
        found.append(Mismatch("cuda-older", "cuda_driver_api", cuda_was, cuda_now))
    if captured.get("gpu_name") != current.get("gpu_name"):
        found.append(Mismatch("gpu-model-mismatch", "gpu_name", captured.get("gpu_name"), current.get("gpu_name")))
    found += _known_differ("gpu-memory-mismatch", "gpu_memory_bytes", captured, current)
    found += _known_differ("device-count-mismatch", "gpu_devices", captured, current)
    return found


def _another_gpu(captured: dict[str, Any], current: dict[str, Any], policy: str) -> list[Mismatch]:
    """Another GPU of the captured model (the other facts matched): refused under `same-gpu`, and where the driver
    cannot be given the pair; else the CUDA restore remaps (`gpu_pairs`)."""
    was, now = captured.get("gpu_uuid"), current.get("gpu_uuid")
    if was is None or now is None or was == now:
        return []
    if policy == "same-gpu":
        return [Mismatch("gpu-uuid-mismatch", "gpu_uuid", was, now)]
    if _uuid_bytes(was) is None or _uuid_bytes(now) is None:
        return [Mismatch("gpu-remap-unsupported", "gpu_uuid", was, now)]
    if (captured.get("gpu_devices") or 1) > 1:
        return [Mismatch("gpu-remap-unsupported", "gpu_devices", captured.get("gpu_devices"),
                         current.get("gpu_devices"))]
    api = current.get("cuda_driver_api")
    if not isinstance(api, int) or api < REMAP_CUDA_API:
        return [Mismatch("gpu-remap-unsupported", "cuda_driver_api", captured.get("cuda_driver_api"), api)]
    return []


def gpu_pairs(captured: dict[str, Any], current: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The (captured, current) GPU UUIDs, 16 bytes each, the CUDA restore passes the driver to restore onto another
    GPU of the model (`check_target` admitted it); [] on the captured GPU, or where either UUID is unknown."""
    was, now = _uuid_bytes(captured.get("gpu_uuid")), _uuid_bytes(current.get("gpu_uuid"))
    return [(was, now)] if was is not None and now is not None and was != now else []


def _uuid_bytes(uuid: Any) -> bytes | None:
    """`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` as the driver's 16 bytes (`CUuuid`); None for anything else."""
    text = str(uuid or "")
    digits = text[4:].replace("-", "") if text.startswith("GPU-") else ""
    try:
        return bytes.fromhex(digits) if len(digits) == _GPU_UUID_HEX else None
    except ValueError:
        return None


def _known_differ(code: str, fact: str, captured: dict[str, Any], current: dict[str, Any]) -> list[Mismatch]:
    """A fact an older capture (or another backend) may not have recorded: compared only where both know it."""
    was, now = captured.get(fact), current.get(fact)
    return [Mismatch(code, fact, was, now)] if was is not None and now is not None and was != now else []


def comparable(captured: dict[str, Any], current: dict[str, Any],
               boundary: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The captured and current identities in one vocabulary. The capture records NVML's GPU facts (and, since
    issue 36, the kernel module's under `procfs`); a restore reads procfs where it answers (milliseconds, against
    NVML's ~0.1 s). procfs against a recorded procfs compares like with like, a match or a mismatch alike. Against
    an older capture without it, procfs only confirms an exact match, and anything else is NVML's verdict (a GPU
    whose procfs model were written unlike NVML's name is then not refused for it)."""
    if not isinstance(captured, dict) or boundary == "n580" or current.get("gpu_identity_source") != "procfs":
        return captured, current  # (a record of another shape is refused by `check_target`, naming it)
    if isinstance(recorded := captured.get("procfs"), dict):
        return {**captured, **recorded}, current
    if all(captured.get(key) == current.get(key) for key in ("driver_version", "gpu_name")):
        return captured, current
    system = {key: value for key, value in current.items() if key not in GPU_FACTS}  # none of procfs's is kept
    return captured, {**system, **gpu_identity(nvml=True)}


def _leading_int(version: Any) -> int | None:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return None


def _major_minor(release: Any) -> tuple[int, ...] | None:
    """`6.1` of `6.1.0-28-amd64`; None where the release was not recorded or does not read as one."""
    parts = str(release or "").split(".")[:2]
    try:
        return tuple(int(part.split("-")[0]) for part in parts) if len(parts) == 2 else None
    except ValueError:
        return None

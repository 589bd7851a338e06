"""This host's identity: boot, kernel, the NVIDIA driver and GPU, and the CRIU a worker runs.

Two readers of the GPU facts (docs/host-identity.md): NVML (`nvml_identity`: driver version, UUID, name and
compute capability of the selected device), and the kernel module's procfs (`_nvidia_procfs`: the same driver
version, UUID and name, without loading NVML). The profile and the capture record NVML's; a restore checks the
host with `host_identity`, which reads procfs where it answers for the selected device and NVML otherwise.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
from typing import Any

from ._nvidia_procfs import KernelGpu, kernel_gpu
from ._process import criu_environment

__all__ = ("CAPSULE_LAYERS_ENV", "DEVICE_SELECTOR_ENV", "GPU_FACTS", "IdentityReading", "boot_id", "capsule_facts",
           "criu_identity", "gpu_identity", "host_identity", "nvml_identity", "procfs_identity", "system_identity")

DEVICE_SELECTOR_ENV = "COLDSNAP_PROBE_NVML_DEVICE"  # an NVML index or a GPU-/MIG- UUID; default "0"
# The capsule image's layers (diff IDs, bottom first, comma-separated), which the provider puts in every
# workload's environment (a container cannot read them).
CAPSULE_LAYERS_ENV = "COLDSNAP_CAPSULE_LAYERS"
# What `gpu_identity` gives, from one source or the other.
GPU_FACTS = frozenset({"driver_version", "gpu_uuid", "gpu_name", "compute_capability", "gpu_memory_bytes",
                       "nvml_error", "gpu_identity_source", "procfs_unused"})
_GPU_DEVICE_NODE = re.compile(r"nvidia[0-9]+")


def boot_id() -> str | None:
    """This boot's id (/proc/sys/kernel/random/boot_id), or None where it cannot be read (cache key input 1)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


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


def nvml_identity(selector: str) -> dict[str, Any]:
    """Driver version and the selected device's UUID, name and compute capability, through NVML (imported here:
    pynvml and nvmlInit are most of an identity's cost)."""
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
                "compute_capability": f"{major}.{minor}",
                "gpu_memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)}
    except Exception as exc:
        return {"driver_version": None, "nvml_error": f"{type(exc).__name__}: {exc}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _procfs_facts(found: KernelGpu) -> dict[str, Any]:
    return {"driver_version": found.driver_version, "gpu_uuid": found.gpu_uuid, "gpu_name": found.gpu_name}


def procfs_identity(selector: str) -> dict[str, Any] | None:
    """The kernel module's own words for the selected GPU (driver version, UUID, model), None where procfs cannot
    tell: a capture records them beside NVML's, so that a restore compares procfs with procfs."""
    found = kernel_gpu(selector)
    return _procfs_facts(found) if isinstance(found, KernelGpu) else None


def gpu_identity(*, nvml: bool = False) -> dict[str, Any]:
    """The selected device's driver version, UUID and name, and `gpu_identity_source`: `procfs` where the kernel
    module states all three for exactly that device (and `nvml` is false), else `nvml` (with `procfs_unused`, the
    reason, when procfs was tried)."""
    selector = os.environ.get(DEVICE_SELECTOR_ENV, "0")
    if nvml:
        return {**nvml_identity(selector), "gpu_identity_source": "nvml"}
    found = kernel_gpu(selector)
    if isinstance(found, KernelGpu):
        return {**_procfs_facts(found), "gpu_identity_source": "procfs"}
    return {**nvml_identity(selector), "gpu_identity_source": "nvml", "procfs_unused": found}


def system_identity() -> dict[str, Any]:
    """Boot id, hostname, architecture and kernel release."""
    system = os.uname()  # what `platform` reads, without its import on a restore's path to CRIU (issue 35 item 2)
    return {"boot_id": boot_id(), "hostname": system.nodename, "architecture": system.machine,
            "kernel": system.release}


def _cuda_driver_api() -> int | None:
    """The driver's CUDA API version (`cuDriverGetVersion`, e.g. 13000), which needs neither cuInit nor a context;
    None where libcuda cannot be loaded."""
    try:
        version = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def capsule_facts() -> dict[str, Any]:
    """What the capsule sees besides the host: the GPUs visible to it (their device nodes), the driver's CUDA API
    version and the image's layers (the provider's environment variable; None outside a provider's workload)."""
    try:
        devices = sum(1 for name in os.listdir("/dev") if _GPU_DEVICE_NODE.fullmatch(name))
    except OSError:
        devices = 0
    return {"gpu_devices": devices, "cuda_driver_api": _cuda_driver_api(),
            "image_layers": [layer for layer in os.environ.get(CAPSULE_LAYERS_ENV, "").split(",") if layer] or None}


def host_identity(criu: str | None = None) -> dict[str, Any]:
    """This host as a restore checks it against the captured identity: the system, the GPU facts (procfs first,
    `gpu_identity`), what the capsule sees and the CRIU that will restore."""
    return {**system_identity(), **gpu_identity(), **capsule_facts(), "criu": criu_identity(criu)}


class IdentityReading:
    """`host_identity` read in a thread of its own from the moment it is made: a restore worker makes it before it
    imports the rest of its modules, so that `criu --version` (a process of its own, milliseconds) and the procfs
    reads are done by the time the checks need them (issue 35 item 2: they were on the path to CRIU after the
    imports). Only facts are read: nothing is started that a refusal would have to undo."""

    def __init__(self, criu: str | None) -> None:
        self._found: dict[str, Any] = {}
        self._failed: Exception | None = None
        self._thread = threading.Thread(target=self._read, args=(criu,), name="coldsnap-identity", daemon=True)
        self._thread.start()

    def _read(self, criu: str | None) -> None:
        try:
            self._found = host_identity(criu)
        except Exception as exc:  # raised again in the caller's thread, by `result`
            self._failed = exc

    def result(self) -> dict[str, Any]:
        """The identity, once read; raises what reading it raised."""
        self._thread.join()
        if self._failed is not None:
            raise self._failed
        return self._found

"""The NVIDIA kernel module's own account of the host, read from /proc/driver/nvidia without NVML.

A restore checks the host's driver version and GPU model against the captured ones before CRIU runs; through
NVML that costs ~0.1 s (import, nvmlInit, queries), while the kernel module already states all three in procfs
(the format is `nv-procfs.c` of NVIDIA's kernel module, open and proprietary alike):

    version                    NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Release Build  (...)
                               NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...
    gpus/<bus id>/information  Model: \t\t NVIDIA H200
                               GPU UUID: \t GPU-<8>-<4>-<4>-<4>-<12>
                               GPU Excluded:\t No

Which GPU is the selected one (`COLDSNAP_PROBE_NVML_DEVICE`, an NVML index or UUID) is answered only where it is
certain, and otherwise left to NVML (docs/host-identity.md): a `GPU-` UUID is the GPU whose information states
it; an index only when procfs lists exactly one GPU (a capsule given one GPU by the NVIDIA container runtime sees
only that one's directory), since NVML's index order is not procfs's promise once there are several, and a host
not fenced by the container runtime lists GPUs NVML may not enumerate. A MIG UUID is never in procfs.

Reads are bounded and never follow a symbolic link: each path component is opened relative to its parent with
O_NOFOLLOW, a file must be a regular file of at most `MAX_FILE_BYTES`, and its text must parse exactly.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

from .errors import ProbeError

__all__ = ("PROC_NVIDIA", "KernelGpu", "kernel_gpu")

PROC_NVIDIA = Path("/proc/driver/nvidia")
MAX_FILE_BYTES = 16384  # both files are a few hundred bytes; a larger one is not the kernel module's
MAX_GPUS = 256  # more directories than any host has GPUs: not a procfs listing to trust
_VERSION = re.compile(r"NVRM version: NVIDIA UNIX (?:Open Kernel Module for [\w.-]+|[\w.-]+ Kernel Module) +"
                      r"(\d+\.\d+(?:\.\d+)?)(?: |$)", re.MULTILINE)
_INDEX = re.compile(r"[0-9]{1,6}")  # an NVML index as int() reads it, within reason
_BUS_ID = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_GPU_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO never blocks the open


# A tuple, not a dataclass: it is on a restore's path to CRIU (dataclasses' import, ~15 ms on the H200; issue 35).
class KernelGpu(NamedTuple):
    """The selected GPU as the kernel module states it: the values NVML gives for the same device."""

    driver_version: str
    gpu_uuid: str
    gpu_name: str


def kernel_gpu(selector: str, root: Path = PROC_NVIDIA) -> KernelGpu | str:
    """The GPU `selector` names (an NVML index or `GPU-` UUID) as `root` states it, or why it cannot be told
    from there (then NVML must answer)."""
    if selector.startswith("MIG-"):
        return "a MIG device is not listed in procfs"
    if not (_INDEX.fullmatch(selector) or _GPU_UUID.fullmatch(selector)):
        return f"the device selector {selector!r} is neither an index nor a GPU UUID"
    try:
        root_fd = os.open(root, _DIRECTORY)
    except OSError as exc:
        return f"{root}: {exc.strerror}"
    try:
        version = _driver_version(_read(root_fd, "version"))
        if version is None:
            return f"{root}/version does not state the driver version"
        gpus = _gpus(root_fd)
    except (OSError, ValueError, ProbeError) as exc:  # ValueError: not ASCII
        return f"{root}: {exc}"
    finally:
        os.close(root_fd)
    return _select(selector, gpus, version, root)


def _select(selector: str, gpus: dict[str, dict[str, str]], version: str, root: Path) -> KernelGpu | str:
    if _INDEX.fullmatch(selector):
        if len(gpus) != 1 or int(selector) != 0:
            return (f"device index {selector} with {len(gpus)} GPU(s) in {root}/gpus: only a lone GPU's index is "
                    "certain there")
        chosen = next(iter(gpus.values()))
    else:
        matches = [info for info in gpus.values() if info.get("GPU UUID") == selector]
        if len(matches) != 1:
            return f"{len(matches)} GPU(s) in {root}/gpus state the UUID {selector}"
        chosen = matches[0]
    uuid, name = chosen.get("GPU UUID", ""), chosen.get("Model", "")
    if not _GPU_UUID.fullmatch(uuid) or name in ("", "Unknown") or chosen.get("GPU Excluded", "No") != "No":
        return f"{root}/gpus does not state a usable model and UUID for the device (model {name!r}, uuid {uuid!r})"
    return KernelGpu(driver_version=version, gpu_uuid=uuid, gpu_name=name)


def _driver_version(text: str) -> str | None:
    found = _VERSION.search(text)
    return found.group(1) if found else None


def _gpus(root_fd: int) -> dict[str, dict[str, str]]:
    """Each GPU directory's `information`, as key -> value, by PCI bus id."""
    gpus_fd = os.open("gpus", _DIRECTORY, dir_fd=root_fd)
    try:
        names = sorted(name for name in os.listdir(gpus_fd) if _BUS_ID.fullmatch(name))
        if len(names) > MAX_GPUS:
            raise ProbeError(f"{len(names)} GPU directories (at most {MAX_GPUS})")
        found: dict[str, dict[str, str]] = {}
        for name in names:
            gpu_fd = os.open(name, _DIRECTORY, dir_fd=gpus_fd)
            try:
                found[name] = _fields(_read(gpu_fd, "information"))
            finally:
                os.close(gpu_fd)
        return found
    finally:
        os.close(gpus_fd)


def _fields(text: str) -> dict[str, str]:
    """`Key: <tabs and spaces> value` lines; a key stated twice is not the kernel module's format."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            if key.strip() in fields:
                raise ProbeError(f"the key {key.strip()!r} appears twice in a GPU's information")
            fields[key.strip()] = value.strip()
    return fields


def _read(dir_fd: int, name: str) -> str:
    """A regular file of at most MAX_FILE_BYTES, as ASCII (procfs reports a size of 0: read to the end)."""
    fd = os.open(name, _FILE, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ProbeError(f"{name} is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, MAX_FILE_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                raise ProbeError(f"{name} is larger than {MAX_FILE_BYTES} bytes")
        return b"".join(chunks).decode("ascii")
    finally:
        os.close(fd)

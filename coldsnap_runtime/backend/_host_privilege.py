"""``privileged`` on this host: the engine's capability bounding set, and what host-capabilities grants.

Under ``[runtime] privileged = "docker"`` (default) Docker's own ``Privileged`` is used; where the
engine's bounding set lacks a capability (read from ``/proc/<pid>/status`` of the engine, its pid
from SO_PEERCRED on the engine socket) runc would fail late with "unable to apply caps", so that is
refused before anything is created, naming the missing capabilities. Under ``"host-capabilities"``
the request is realised as every capability in that bounding set (less those the engine cannot
name) and every host device. See ``_gpus.py`` for how this joins a workload's GPU access.

Everything that reads the host takes a ``root`` (default ``/``) so the discovery is a pure function
of a directory tree.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

import anyio
import anyio.to_thread
import structlog

from ..errors import BackendError, RuntimeFailed
from ._translate import GpuAccess, PrivilegeGrant, capability_names, missing_capabilities

__all__ = (
    "CAPABILITY_PROBE_IMAGE",
    "GPU_NODE",
    "PrivilegedPolicy",
    "engine_capabilities",
    "engine_process",
    "host_devices",
    "host_privilege",
    "read_bounding_set",
    "unknown_capability",
)

log = structlog.get_logger(__name__)

PrivilegedPolicy = Literal["docker", "host-capabilities"]
_ACTION = "workload-run"
# Nodes every container already has; privileged adds the rest of the host's /dev.
_DEFAULT_NODES = frozenset({"null", "zero", "full", "random", "urandom", "tty", "console", "ptmx"})
_SKIP_DEV_DIRS = frozenset({"pts", "shm", "fd", "mqueue", ".lxc", ".lxd-mounts", ".udev"})
# A GPU's own device node (/dev/nvidia<minor>; not nvidiactl or nvidia-uvm).
GPU_NODE = re.compile(r"^/dev/nvidia[0-9]+$")


def read_bounding_set(status_text: str) -> int | None:
    """``CapBnd`` of a ``/proc/<pid>/status`` text."""
    for line in status_text.splitlines():
        if line.startswith("CapBnd:"):
            try:
                return int(line.split(":", 1)[1].strip(), 16)
            except ValueError:
                return None
    return None


def host_devices(root: str | os.PathLike[str] = "/", *, exclude: Sequence[str] = ()) -> list[str]:
    """Every character and block device under /dev (as Docker's privileged mode adds them).

    Skips the nodes every container gets anyway, pseudo-terminal/shm/fd directories, and `exclude`.
    """
    base = Path(root) / "dev"
    found: list[str] = []
    for directory, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DEV_DIRS)
        for name in sorted(filenames):
            path = Path(directory) / name
            try:
                mode = path.lstat().st_mode
            except OSError:
                continue
            if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
                continue
            relative = "/dev/" + str(path.relative_to(base))
            if relative[len("/dev/"):] in _DEFAULT_NODES or relative in exclude:
                continue
            found.append(relative)
    return found


_UNKNOWN_CAPABILITY = re.compile(r'unknown capability: "?(CAP_[A-Z_0-9]+)"?')
# A reference no image can have: the engine validates CapAdd before it resolves the image, so a
# create with this image only ever answers which capability it does not know (nothing is created).
CAPABILITY_PROBE_IMAGE = "COLDSNAP/CAPABILITY-PROBE:INVALID"


def unknown_capability(detail: str) -> str | None:
    """The capability an engine error names as unknown (``invalid CapAdd: unknown capability: "CAP_BPF"``)."""
    match = _UNKNOWN_CAPABILITY.search(detail)
    return match.group(1) if match else None


async def engine_capabilities(wanted: Sequence[str], rejects: Callable[[list[str]], Awaitable[str]]) -> tuple[str, ...]:
    """`wanted` minus what the engine cannot name (Docker 20.10 stops at CAP_AUDIT_READ).

    `rejects(caps)` answers the engine's refusal of a create of CAPABILITY_PROBE_IMAGE with those caps ("" if
    it created one), and raises a BackendError when the engine gave no verdict (unreachable, timed out, a server
    error): that stops the asking at once. A capability the engine cannot name is one its own privileged mode
    never grants either.
    """
    caps = list(wanted)
    while caps:
        name = unknown_capability(await rejects(caps))
        if name is None or name not in caps:
            break
        caps.remove(name)
    return tuple(caps)


# --- host I/O -----------------------------------------------------------------------------------


# Per (engine socket, engine process, capabilities wanted): the capabilities that engine can name.
_NAMED: dict[tuple[str, tuple[int, int, str], tuple[str, ...]], tuple[str, ...]] = {}


def engine_process(socket_path: str, root: str | os.PathLike[str] = "/") -> tuple[int, int, str] | None:
    """(capability bounding set, pid, start time) of the process serving `socket_path` (the engine), or None.

    The peer's pid comes from SO_PEERCRED; None when it cannot be read (another pid namespace,
    a proxy that exits, no permission): then nothing can be said before the engine tries.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5.0)
            sock.connect(socket_path)
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        if pid <= 0:
            return None
        bounding = read_bounding_set((Path(root) / f"proc/{pid}/status").read_text())
        started = (Path(root) / f"proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None
    return (bounding, pid, started) if bounding is not None else None


def _last_cap(root: str | os.PathLike[str]) -> int:
    try:
        return int((Path(root) / "proc/sys/kernel/cap_last_cap").read_text().strip())
    except (OSError, ValueError):
        return 40


async def host_privilege(root: str | None, policy: PrivilegedPolicy, socket_path: str, gpus: GpuAccess | None,
                         rejects: Callable[[list[str]], Awaitable[str]]) -> PrivilegeGrant | None:
    """`privileged` on the host at `root` under ``[runtime] privileged = policy``.

    None = Docker's own privileged mode; a grant = host-capabilities; raises when neither can work.
    """
    if root is None:
        return None  # another node's engine: its bounding set is not readable from here
    engine = await anyio.to_thread.run_sync(engine_process, socket_path, root)
    if engine is None:
        return None  # unknown: Docker's privileged mode, and the engine's own error if it fails
    bounding = engine[0]
    last = _last_cap(root)
    missing = missing_capabilities(bounding, last)
    if not missing:
        return None
    if policy == "docker":
        raise RuntimeFailed(action=_ACTION, detail=(
            f"privileged needs every capability, but the container engine's capability bounding set lacks "
            f"{', '.join(missing)}; an administrator may set [runtime] privileged = \"host-capabilities\" "
            "to grant every capability this host has instead"))
    exclude: list[str] = []
    if gpus is not None and gpus.mechanism == "native":
        # Privileged still sees only its own GPUs' nodes (they come with the GPU access).
        exclude = [d for d in host_devices(root) if GPU_NODE.match(d)]
    devices = [d for d in host_devices(root, exclude=exclude)
               if gpus is None or d not in gpus.devices]
    log.warning("privileged realised as the host's capabilities", missing_capabilities=list(missing))
    wanted = capability_names(bounding, last)
    # What this engine process can name, asked once: a create per capability it cannot name cost every
    # privileged run a round trip each (four on Docker 20.10). Another engine process (a restart, an upgrade) asks
    # again.
    # Only a verdict is kept: an engine that failed to answer is asked again by the next privileged run, not taken
    # at its word for its whole life (review 2026-12-02, finding 6).
    key = (socket_path, engine, tuple(wanted))
    if (capabilities := _NAMED.get(key)) is None:
        try:
            capabilities = await engine_capabilities(wanted, rejects)
        except BackendError as exc:
            raise RuntimeFailed(action=_ACTION, detail=(
                f"privileged: the container engine did not say which capabilities it can name ({exc}); nothing "
                "was created, and the next privileged run asks it again")) from exc
        _NAMED[key] = capabilities
    return PrivilegeGrant(capabilities=capabilities, devices=tuple(devices))

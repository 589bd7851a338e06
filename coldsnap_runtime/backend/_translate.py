"""Pure translations between runtime-v1 and the Docker Engine API (no I/O)."""

from __future__ import annotations

import base64
import json
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from msgspec import UNSET

from ..schema import WorkloadSpec
from ._confine import confine

__all__ = (
    "CAPABILITIES",
    "CAPSULE_LAYERS_ENV",
    "IMAGE_LABEL",
    "MANAGED_LABEL",
    "GpuAccess",
    "ImageRef",
    "PrivilegeGrant",
    "capability_names",
    "container_config",
    "demux",
    "encode_registry_auth",
    "image_matches",
    "missing_capabilities",
    "parse_reference",
    "registry_auth",
)

# Marks containers this provider created: only those are inspected, exec'd or removed by name.
MANAGED_LABEL = "io.coldsnap-provider.managed"
# The image reference a workload was asked for: its container is created from the image id the run checked.
IMAGE_LABEL = "io.coldsnap-provider.image"
# Every workload is told its image's layers (a container cannot read them): a restore refuses, before any work,
# images dumped in an image its capsule is not built on (the probe's `_host.CAPSULE_LAYERS_ENV`, the same name).
# A safety check, not a boundary: a manager controls its own capsule's entrypoint and environment.
CAPSULE_LAYERS_ENV = "COLDSNAP_CAPSULE_LAYERS"

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # always fullmatch: `$` would accept a final "\n"
_DEFAULT_REGISTRY = "docker.io"


@dataclass(frozen=True, slots=True)
class ImageRef:
    """A parsed image reference: registry/repository plus a tag or digest (never both empty)."""

    repository: str  # as written, without tag/digest
    tag: str = ""
    digest: str = ""

    @property
    def registry(self) -> str:
        first, sep, _ = self.repository.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            return first
        return _DEFAULT_REGISTRY

    @property
    def normalized_repository(self) -> str:
        """How Docker prints it in RepoTags/RepoDigests (docker.io/library/ elided)."""
        repo = self.repository
        for prefix in ("docker.io/", "index.docker.io/"):
            if repo.startswith(prefix):
                repo = repo[len(prefix):]
        if repo.startswith("library/") and repo.count("/") == 1:
            repo = repo[len("library/"):]
        return repo

    @property
    def pull_tag(self) -> str:
        return self.digest or self.tag or "latest"

    def normalized(self) -> str:
        if self.digest:
            return f"{self.normalized_repository}@{self.digest}"
        return f"{self.normalized_repository}:{self.tag or 'latest'}"


def parse_reference(ref: str) -> ImageRef | None:
    """Parse `repo[:tag][@digest]`; None for a bare image id (`sha256:<64 hex>`)."""
    if _DIGEST.fullmatch(ref):
        return None
    name, _, digest = ref.partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return ImageRef(repository=name, tag=tag, digest=digest)


def image_matches(ref: str, inspect: dict[str, Any]) -> bool:
    """True when `ref` names this image exactly (no engine-side ID-prefix guessing)."""
    if _DIGEST.fullmatch(ref):
        return bool(inspect.get("Id") == ref)
    parsed = parse_reference(ref)
    assert parsed is not None
    wanted = parsed.normalized()
    names = [*(inspect.get("RepoTags") or []), *(inspect.get("RepoDigests") or [])]
    for name in names:
        candidate = parse_reference(name)
        if candidate is not None and candidate.normalized() == wanted:
            return True
    return False


# Linux capability numbers (linux/capability.h), as Docker names them.
CAPABILITIES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
    "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
)


def _capability(bit: int) -> str:
    return CAPABILITIES[bit] if bit < len(CAPABILITIES) else f"CAP_{bit}"


def capability_names(mask: int, last_cap: int) -> tuple[str, ...]:
    """The capabilities set in `mask` (a CapBnd value), up to the kernel's `last_cap`."""
    return tuple(_capability(bit) for bit in range(last_cap + 1) if mask >> bit & 1)


def missing_capabilities(mask: int, last_cap: int) -> tuple[str, ...]:
    """What Docker's privileged mode asks for (every capability the kernel has) that `mask` lacks."""
    return tuple(_capability(bit) for bit in range(last_cap + 1) if not mask >> bit & 1)


@dataclass(frozen=True, slots=True)
class GpuAccess:
    """How this host gives a container its `gpus` (resolved by ``_gpus.realise``)."""

    mechanism: Literal["device-request", "cdi", "native"]
    device_ids: tuple[str, ...] = ()  # device-request: the IDs; cdi: qualified names
    devices: tuple[str, ...] = ()  # native: host device nodes, same path inside
    binds: tuple[str, ...] = ()  # native: driver paths bound read-only at the same path
    environment: Mapping[str, str] = field(default_factory=dict)  # native: LD_LIBRARY_PATH


@dataclass(frozen=True, slots=True)
class PrivilegeGrant:
    """`privileged` as the host's capabilities (``[runtime] privileged = "host-capabilities"``), or, with
    `whole_host` false, as exactly `capabilities` and nothing else (an admission profile's grant)."""

    capabilities: tuple[str, ...]
    devices: tuple[str, ...]
    whole_host: bool = True


def _device(path: str) -> dict[str, str]:
    return {"PathOnHost": path, "PathInContainer": path, "CgroupPermissions": "rwm"}


def _realise_gpus(host: dict[str, Any], spec: WorkloadSpec, gpus: GpuAccess | None) -> None:
    if not spec.gpus:
        return
    if gpus is None or gpus.mechanism == "device-request":
        ids = list(gpus.device_ids) if gpus is not None else list(spec.gpus)
        host["DeviceRequests"] = [{"Driver": "nvidia", "Count": 0, "DeviceIDs": ids, "Capabilities": [["gpu"]]}]
    elif gpus.mechanism == "cdi":
        host["DeviceRequests"] = [{"Driver": "cdi", "DeviceIDs": list(gpus.device_ids)}]
    else:
        host["Devices"] += [_device(d) for d in gpus.devices]
        host["Binds"] += [f"{b}:{b}:ro" for b in gpus.binds]


def _realise_privilege(host: dict[str, Any], grant: PrivilegeGrant) -> None:
    """Docker's privileged mode minus what the engine's bounding set cannot grant (or a profile's capabilities)."""
    host["Privileged"] = False
    host["CapAdd"] = list(grant.capabilities)
    if not grant.whole_host:
        # CRIU mounts and ptraces inside the capsule, which the engine's default AppArmor profile
        # denies; the device cgroup, masked /proc paths and the other host devices stay as they are.
        host["SecurityOpt"] = [*host.get("SecurityOpt", []), "apparmor=unconfined"]
        return
    have = {d["PathInContainer"] for d in host["Devices"]}
    host["Devices"] += [_device(d) for d in grant.devices if d not in have]
    host["DeviceCgroupRules"] = ["a *:* rwm"]
    host["MaskedPaths"], host["ReadonlyPaths"] = [], []  # /proc and /sys paths unmasked (API form of systempaths)
    options = ["seccomp=unconfined", "apparmor=unconfined", "label=disable"]
    host["SecurityOpt"] = [*host.get("SecurityOpt", []), *(o for o in options if o not in host.get("SecurityOpt", []))]


def container_config(spec: WorkloadSpec, *, gpus: GpuAccess | None = None,
                     privilege: PrivilegeGrant | None = None, confined: bool = False,
                     image_layers: list[str] | None = None) -> dict[str, Any]:
    """The Engine API create body realising every WorkloadSpec field (or failing loudly).

    `gpus` and `privilege` carry what the host decided (``_gpus.realise``); without them `gpus`
    is an ``nvidia`` DeviceRequest and `privileged` Docker's own. `confined`: the workload of an
    admission profile's grant (``_confine.confine``: never seccomp-unconfined, its own cgroup namespace).
    `image_layers`: the layers `spec.image` resolved to, told to the workload (`CAPSULE_LAYERS_ENV`, comma-separated,
    never the manager's value).
    """
    host: dict[str, Any] = {
        "NetworkMode": spec.network if spec.network in ("host", "none") else "default",
        "Privileged": spec.privileged,
        # -v semantics (source created if missing), in the order given.
        "Binds": [f"{m.source}:{m.target}{':ro' if m.read_only else ''}" for m in spec.mounts],
        "Devices": [
            {"PathOnHost": d.source, "PathInContainer": d.target or d.source, "CgroupPermissions": "rwm"}
            for d in spec.devices
        ],
        "AutoRemove": bool(spec.detached and spec.remove_after_exit),
    }
    if spec.seccomp_unconfined:
        host["SecurityOpt"] = ["seccomp=unconfined"]
    if spec.memlock_unlimited:
        host["Ulimits"] = [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    if spec.shared_memory_bytes:
        host["ShmSize"] = spec.shared_memory_bytes
    _realise_gpus(host, spec, gpus)
    if privilege is not None and spec.privileged:
        _realise_privilege(host, privilege)
    if confined:
        confine(host)
    environment = {**spec.environment, **(gpus.environment if gpus is not None else {})}
    environment.pop(CAPSULE_LAYERS_ENV, None)
    if image_layers:
        environment[CAPSULE_LAYERS_ENV] = ",".join(image_layers)
    # Like `docker run -i`: stdin is attached whenever the request carries `input`.
    attach_stdin = not spec.detached and spec.input is not UNSET
    config: dict[str, Any] = {
        "Image": spec.image,
        "Env": [f"{k}={v}" for k, v in sorted(environment.items())],
        "Labels": {**spec.labels, MANAGED_LABEL: "true"},
        "Tty": False,
        "AttachStdin": attach_stdin,
        "OpenStdin": attach_stdin,
        "StdinOnce": attach_stdin,
        "AttachStdout": not spec.detached,
        "AttachStderr": not spec.detached,
        "HostConfig": host,
    }
    if spec.user:
        config["User"] = spec.user
    if spec.entrypoint:
        config["Entrypoint"] = [spec.entrypoint]
    if spec.command:
        config["Cmd"] = list(spec.command)
    return config


def demux(buffer: bytearray) -> Iterator[tuple[int, bytes]]:
    """Yield complete (stream, payload) frames of Docker's multiplexed format, consuming them."""
    while len(buffer) >= 8:
        stream, size = struct.unpack(">BxxxL", buffer[:8])
        if len(buffer) < 8 + size:
            return
        payload = bytes(buffer[8:8 + size])
        del buffer[:8 + size]
        yield stream, payload


def registry_auth(credentials: dict[str, Any], registry: str) -> dict[str, str] | None:
    """X-Registry-Auth fields for `registry` from a docker config.json `auths` map."""
    auths = credentials.get("auths")
    if not isinstance(auths, dict):
        return None
    keys = [registry, f"https://{registry}", f"http://{registry}"]
    if registry == _DEFAULT_REGISTRY:
        keys += ["https://index.docker.io/v1/", "index.docker.io"]
    for key in keys:
        entry = auths.get(key)
        if not isinstance(entry, dict):
            continue
        username, password = entry.get("username"), entry.get("password")
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            decoded = base64.b64decode(entry["auth"]).decode()
            username, _, password = decoded.partition(":")
        if isinstance(entry.get("identitytoken"), str) and entry["identitytoken"]:
            return {"identitytoken": entry["identitytoken"], "serveraddress": key}
        if isinstance(username, str) and isinstance(password, str):
            return {"username": username, "password": password, "serveraddress": key}
    return None


def encode_registry_auth(auth: dict[str, str] | None) -> str:
    return base64.urlsafe_b64encode(json.dumps(auth or {}).encode()).decode()

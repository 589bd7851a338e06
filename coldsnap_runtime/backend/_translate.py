"""Pure translations between runtime-v1 and the Docker Engine API (no I/O)."""

from __future__ import annotations

import base64
import json
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET

from ..schema import WorkloadSpec

__all__ = (
    "MANAGED_LABEL",
    "ImageRef",
    "container_config",
    "demux",
    "encode_registry_auth",
    "image_matches",
    "parse_reference",
    "registry_auth",
)

# Marks containers this provider created: only those are inspected, exec'd or removed by name.
MANAGED_LABEL = "io.coldsnap-provider.managed"

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
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
    if _DIGEST.match(ref):
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
    if _DIGEST.match(ref):
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


def container_config(spec: WorkloadSpec) -> dict[str, Any]:
    """The Engine API create body realising every WorkloadSpec field (or failing loudly)."""
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
    if spec.gpus:
        host["DeviceRequests"] = [
            {"Driver": "nvidia", "Count": 0, "DeviceIDs": list(spec.gpus), "Capabilities": [["gpu"]]}
        ]
    # Like `docker run -i`: stdin is attached whenever the request carries `input`.
    attach_stdin = not spec.detached and spec.input is not UNSET
    config: dict[str, Any] = {
        "Image": spec.image,
        "Env": [f"{k}={v}" for k, v in sorted(spec.environment.items())],
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

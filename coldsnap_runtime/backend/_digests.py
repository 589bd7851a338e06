"""``image.id`` is the OCI image-config digest, whatever image store the engine uses.

With Docker's classic image store, an image's ``.Id`` *is* its config digest. With the
containerd image store (the ``io.containerd.snapshotter.v1`` driver type, opt-in on newer
engines), ``.Id`` is the digest of the image's *target*: a manifest, or an index (manifest
list) when the image was pulled by a multi-platform reference. runtime-v1 requires the
config digest, so on such an engine the backend reads the target through the Registry
HTTP API (from a repository the image's ``RepoDigests`` name, with the daemon's registry
credentials) and walks it here:

* an index or manifest list: the manifest for the engine's platform (os, architecture,
  variant; attestation manifests and ``unknown/unknown`` entries are never chosen; an entry
  without a platform is taken only when no entry names this platform);
* a manifest: its ``config.digest``;
* a config: the digest itself.

Every document read is checked against the digest it was read by (content addressing),
and the config found must list the local image's layers (``rootfs.diff_ids`` equal to the
inspect's ``RootFS.Layers``), so a wrong platform or a registry that lies cannot change an
identity. :func:`resolve_step` is the pure selection; :func:`config_digest` drives it over
any reader; :class:`RegistryReader` is the one reader (HTTP, read-only, bounded).
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from ..errors import RuntimeFailed

__all__ = (
    "CONTAINERD_SNAPSHOTTER",
    "Platform",
    "RegistryReader",
    "answer_challenge",
    "config_digest",
    "id_needs_resolution",
    "registry_is_insecure",
    "repository_path",
    "resolve_step",
    "uses_containerd_store",
)

CONTAINERD_SNAPSHOTTER = "io.containerd.snapshotter.v1"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
_INDEXES = frozenset({OCI_INDEX, DOCKER_LIST})
_MANIFESTS = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
_ACCEPT = ", ".join([OCI_INDEX, DOCKER_LIST, OCI_MANIFEST, DOCKER_MANIFEST])
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_ATTESTATION = "vnd.docker.reference.type"
_MAX_DOCUMENT = 8 << 20  # manifests are capped at 4 MiB by registries; configs are small too
_MAX_DEPTH = 4  # index -> (nested index) -> manifest -> config
_ARCHITECTURES = {"x86_64": "amd64", "x86-64": "amd64", "aarch64": "arm64", "armhf": "arm", "armel": "arm"}
_BEARER_FIELD = re.compile(r'(\w+)="([^"]*)"')

Step = tuple[Literal["manifest", "config", "done"], str]
Reader = Callable[[Literal["manifest", "config"], str], Awaitable[bytes]]


@dataclass(frozen=True, slots=True)
class Platform:
    """An OCI platform, normalised as containerd matches it (``arm64`` means ``arm64/v8``)."""

    os: str
    architecture: str
    variant: str = ""

    @classmethod
    def of(cls, os: str, architecture: str, variant: str = "") -> Platform:
        arch = _ARCHITECTURES.get(architecture, architecture)
        if arch == "arm64" and variant in ("", "v8"):
            variant = ""
        return cls(os=os, architecture=arch, variant=variant)

    @classmethod
    def of_engine(cls, version: Mapping[str, Any]) -> Platform:
        """The engine's own platform, from ``GET /version`` (``Os``, ``Arch``)."""
        return cls.of(str(version.get("Os") or "linux"), str(version.get("Arch") or ""))


def uses_containerd_store(info: Mapping[str, Any]) -> bool:
    """Whether ``GET /info`` shows the containerd image store (``driver-type`` in ``DriverStatus``)."""
    status = info.get("DriverStatus") or []
    return any(isinstance(pair, list) and len(pair) == 2 and pair[1] == CONTAINERD_SNAPSHOTTER for pair in status)


def id_needs_resolution(inspect: Mapping[str, Any], *, containerd_store: bool) -> bool:
    """Whether an image inspect's ``Id`` may be a manifest or index digest rather than the config digest.

    Newer engines say so themselves (``Descriptor``, API >= 1.48, names a manifest or index
    whose digest is the Id); an engine on the containerd store says so through ``/info``.
    """
    descriptor = inspect.get("Descriptor")
    if isinstance(descriptor, dict) and descriptor.get("digest") == inspect.get("Id"):
        return descriptor.get("mediaType") in _INDEXES | _MANIFESTS
    return containerd_store


def _checked(digest: str, content: bytes) -> dict[str, Any]:
    if not _DIGEST.fullmatch(digest):
        raise RuntimeFailed(action="image-inspect", detail=f"{digest!r} is not a sha256 digest")
    if "sha256:" + hashlib.sha256(content).hexdigest() != digest:
        raise RuntimeFailed(action="image-inspect", detail=f"the document read as {digest} has another digest")
    try:
        document = json.loads(content)
    except ValueError as exc:
        raise RuntimeFailed(action="image-inspect", detail=f"{digest} is not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise RuntimeFailed(action="image-inspect", detail=f"{digest} is not a JSON object")
    return document


def _choose(digest: str, entries: Sequence[Any], platform: Platform) -> str:
    exact: list[str] = []
    unplatformed: list[str] = []
    for entry in entries:
        if not isinstance(entry, dict) or not _DIGEST.fullmatch(str(entry.get("digest") or "")):
            continue
        if (entry.get("annotations") or {}).get(_ATTESTATION):
            continue  # a build attestation, not an image
        wanted = entry.get("platform")
        if not isinstance(wanted, dict):
            unplatformed.append(entry["digest"])
            continue
        candidate = Platform.of(str(wanted.get("os") or ""), str(wanted.get("architecture") or ""),
                                str(wanted.get("variant") or ""))
        if candidate == platform:
            exact.append(entry["digest"])
    chosen = exact or unplatformed
    if not chosen:
        shown = "/".join(p for p in (platform.os, platform.architecture, platform.variant) if p)
        raise RuntimeFailed(action="image-inspect", detail=f"index {digest} has no manifest for {shown}")
    return chosen[0]


def resolve_step(kind: Literal["manifest", "config"], digest: str, content: bytes, platform: Platform) -> Step:
    """One step of the walk from an image's target to its config digest (pure).

    `content` is the document read as `digest` (as a manifest-or-index for ``"manifest"``,
    as a blob for ``"config"``). Answers what to read next: ``("manifest", d)`` for the
    platform's manifest of an index, ``("config", d)`` for a manifest's config, or
    ``("done", d)`` once `digest` is a config (its own digest is the answer).
    """
    document = _checked(digest, content)
    media_type = document.get("mediaType")
    if kind == "manifest" and (media_type in _INDEXES or (media_type is None and "manifests" in document)):
        return "manifest", _choose(digest, document.get("manifests") or [], platform)
    if kind == "manifest" and (media_type in _MANIFESTS or (media_type is None and "config" in document)):
        config = document.get("config")
        found = str(config.get("digest") or "") if isinstance(config, dict) else ""
        if not _DIGEST.fullmatch(found):
            raise RuntimeFailed(action="image-inspect", detail=f"manifest {digest} has no config digest")
        return "config", found
    if isinstance(document.get("rootfs"), dict):
        return "done", digest  # an image config: its digest is the identity
    raise RuntimeFailed(action="image-inspect", detail=f"{digest} is neither an index, a manifest nor a config")


async def config_digest(digest: str, read: Reader, platform: Platform, *,
                        layers: Sequence[str] | None = None) -> str:
    """The config digest of the image whose target is `digest`, reading documents with `read`.

    With `layers` (the inspect's ``RootFS.Layers``), the config found must list exactly
    those layers.
    """
    kind: Literal["manifest", "config"] = "manifest"
    for _ in range(_MAX_DEPTH):
        content = await read(kind, digest)
        step, found = resolve_step(kind, digest, content, platform)
        if step == "done":
            diff_ids = (json.loads(content).get("rootfs") or {}).get("diff_ids")
            if layers is not None and diff_ids != list(layers):
                raise RuntimeFailed(action="image-inspect", detail=(
                    f"config {found} does not describe the local image's layers"))
            return found
        kind, digest = step, found
    raise RuntimeFailed(action="image-inspect", detail=f"{digest}: more than {_MAX_DEPTH} levels of indexes")


def repository_path(repository: str) -> str:
    """The Registry API's name for `repository` as written (``busybox`` -> ``library/busybox``)."""
    first, sep, rest = repository.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        if first not in ("docker.io", "index.docker.io"):
            return rest
        repository = rest
    return repository if "/" in repository else f"library/{repository}"


def registry_is_insecure(info: Mapping[str, Any], registry: str) -> bool:
    """Whether the engine talks plain HTTP to `registry` (``/info`` ``RegistryConfig``), as Docker decides."""
    config = info.get("RegistryConfig") or {}
    index = (config.get("IndexConfigs") or {}).get(registry)
    if isinstance(index, dict):
        return not index.get("Secure", True)
    host = registry.rsplit(":", 1)[0] if registry.count(":") == 1 else registry
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a name: Docker resolves it; we only trust literal addresses here
    return any(address in ipaddress.ip_network(cidr, strict=False)
               for cidr in config.get("InsecureRegistryCIDRs") or [])


class RegistryReader:
    """Reads one repository's manifests and blobs by digest (Registry HTTP API v2, GET only).

    `auth` is the registry's entry of the daemon's credentials (``registry_auth``): Basic
    credentials answer a Basic challenge, or obtain a Bearer token from the challenge's
    realm. Plain HTTP only where the engine itself uses it (`insecure`). Documents are
    bounded (8 MiB) and read by digest only, so the caller can check what it got.
    """

    def __init__(self, session: aiohttp.ClientSession, *, registry: str, repository: str,
                 auth: Mapping[str, str] | None, insecure: bool) -> None:
        self._session = session
        host = "registry-1.docker.io" if registry == "docker.io" else registry
        self._base = f"{'http' if insecure else 'https'}://{host}/v2/{repository}"
        self._auth = auth or {}
        self._authorization = ""

    async def read(self, kind: Literal["manifest", "config"], digest: str) -> bytes:
        path = f"{self._base}/{'manifests' if kind == 'manifest' else 'blobs'}/{digest}"
        headers = {"Accept": _ACCEPT} if kind == "manifest" else {}
        for attempt in range(2):
            if self._authorization:
                headers["Authorization"] = self._authorization
            async with self._session.get(path, headers=headers) as response:
                if response.status == 401 and attempt == 0:
                    self._authorization = await self._answer(response.headers.get("WWW-Authenticate", ""))
                    continue
                if response.status != 200:
                    raise RuntimeFailed(action="image-inspect", detail=(
                        f"registry answered {response.status} for {kind} {digest}"))
                content = await response.content.read(_MAX_DOCUMENT + 1)
                if len(content) > _MAX_DOCUMENT:
                    raise RuntimeFailed(action="image-inspect", detail=f"{kind} {digest} exceeds {_MAX_DOCUMENT} bytes")
                return content
        raise RuntimeFailed(action="image-inspect", detail=f"registry refused the credentials for {digest}")

    async def _answer(self, challenge: str) -> str:
        return await answer_challenge(self._session, challenge, self._auth)


async def answer_challenge(session: aiohttp.ClientSession, challenge: str, auth: Mapping[str, str],
                           action: str = "image-inspect") -> str:
    """The Authorization header that answers a registry's 401 `challenge` with `auth` (Basic, or a Bearer
    token from the challenge's realm)."""
    scheme, _, rest = challenge.partition(" ")
    username, password = auth.get("username", ""), auth.get("password", "")
    basic = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode() if username else ""
    if scheme.lower() == "basic":
        if not basic:
            raise RuntimeFailed(action=action, detail="registry needs credentials; none are configured")
        return basic
    if scheme.lower() != "bearer":
        raise RuntimeFailed(action=action, detail=f"unsupported registry challenge {scheme!r}")
    fields = dict(_BEARER_FIELD.findall(rest))
    realm = fields.pop("realm", "")
    if not realm.startswith(("https://", "http://")):
        raise RuntimeFailed(action=action, detail="registry's Bearer challenge has no realm")
    async with session.get(realm, params=fields, headers={"Authorization": basic} if basic else {}) as response:
        if response.status != 200:
            raise RuntimeFailed(action=action, detail=f"registry token endpoint answered {response.status}")
        body = json.loads(await response.content.read(1 << 20) or b"{}")
    token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
    if not isinstance(token, str) or not token:
        raise RuntimeFailed(action=action, detail="registry token endpoint gave no token")
    return f"Bearer {token}"

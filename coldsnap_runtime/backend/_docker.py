"""The Docker Engine backend (aiodocker over the engine's Unix socket; never the CLI).

aiodocker, aiohttp and socket errors are translated in exactly one place,
:func:`docker_errors`; nothing untyped leaves this module. aiodocker's public API is used
wherever it has one; the streaming endpoints it has no raw-bytes API for (pull, push,
build progress, logs, archives) go through one documented wrapper, :meth:`DockerBackend._stream`.

Containers keep the protocol's lifetimes: a named workload that started is a manager key
and is removed only by ``workload-remove``; a run that fails or is cancelled after its
container was created removes that container under a shielded, bounded cleanup. The
containers an RPC owns (anonymous synchronous runs and ``remove_after_exit`` runs) carry
this daemon instance's label and the label of this process's incarnation, so that
:meth:`DockerBackend.recover` can remove what a killed predecessor left behind, and a
name held by such a leftover is reclaimed instead of failing with "Conflict".

Images: with an ``image_ledger``, ``image-remove`` only removes references this provider
pulled, built or tagged (the ledger file records them); it never forces and only untags
that one reference. ``image.id`` is the OCI config digest on either image store: on the
containerd store the inspect's ``Id`` is a manifest or index digest, resolved through
``_digests.py``.

Host paths a manager names are never opened by this process: build contexts are read, and
copy-from destinations written, by ``_archive.py`` running as the session's owner.

Workload names follow Docker's own container-name rule; a name outside it cannot exist,
so it is never sent to the engine (lookups answer "not found", runs are refused).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import aiodocker
import aiohttp
import anyio
import anyio.to_thread
import structlog
from msgspec import UNSET, UnsetType

from ..errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BuildContextError,
    EngineRejected,
    NotFound,
    OutputTooLarge,
    PathNotFound,
    RuntimeFailed,
)
from ..limits import CLEANUP_BUDGET_S, OUTPUT_LIMIT
from ..schema import Execution, ImageBuild, ImageInfo, RuntimeResponse, WorkloadInfo, WorkloadSpec
from ._base import Owner
from ._buildctx import DOCKERFILE_PATH, base_images, rewrite_dockerfile, write_context_tar
from ._digests import (
    Platform,
    RegistryReader,
    config_digest,
    id_needs_resolution,
    registry_is_insecure,
    repository_path,
    uses_containerd_store,
)
from ._gpus import (
    CAPABILITY_PROBE_IMAGE,
    HELD_GPUS_LABEL,
    GpuHolder,
    HostPolicy,
    Realisation,
    gpu_routes,
    realise,
)
from ._hijack import hijack
from ._ledger import ImageLedger, LedgerEntry
from ._translate import (
    MANAGED_LABEL,
    container_config,
    demux,
    encode_registry_auth,
    image_matches,
    parse_reference,
    registry_auth,
)

__all__ = ("INCARNATION_LABEL", "INSTANCE_LABEL", "DockerBackend", "docker_errors", "registry_errors",
           "valid_workload_name")

log = structlog.get_logger(__name__)

# On containers an RPC owns: the daemon instance (stable across restarts) and this process.
INSTANCE_LABEL = "io.coldsnap-provider.instance"
INCARNATION_LABEL = "io.coldsnap-provider.incarnation"
# Docker's own container-name rule (a 64-hex container id also satisfies it).
_CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+")
# The extractor of workload-copy-from, run by path in a child process as the owner.
_ARCHIVE_PROGRAM = str(Path(__file__).with_name("_archive.py"))
_DIAGNOSTIC_BYTES = 16 << 10
_CLEANUP_BUDGET_S = CLEANUP_BUDGET_S
_SHORT = aiohttp.ClientTimeout(total=120)
_UNBOUNDED = aiohttp.ClientTimeout()
_ZERO_TIME = "0001-01-01T00:00:00Z"


@contextmanager
def docker_errors(action: str, *, kind: str = "", ref: str = "") -> Iterator[None]:
    """The one place engine, HTTP and socket errors become ours (`kind`/`ref`: what a 404 means)."""
    try:
        yield
    except aiodocker.DockerError as exc:
        message = str(getattr(exc, "message", exc))
        if exc.status == 404 and kind:
            raise NotFound(kind=kind, ref=ref, action=action) from exc
        if exc.status == 900:  # aiodocker's "cannot connect"
            raise BackendUnavailable(action=action, detail=message) from exc
        raise RuntimeFailed(action=action, detail=message) from exc
    except EngineRejected as exc:
        if exc.status == 404 and kind:
            raise NotFound(kind=kind, ref=ref, action=action) from exc
        raise
    except TimeoutError as exc:  # before the connection errors: aiohttp's timeouts subclass both
        raise BackendTimeout(action=action) from exc
    except aiohttp.ClientConnectionError as exc:
        raise BackendUnavailable(action=action, detail=str(exc) or type(exc).__name__) from exc
    except aiohttp.ClientError as exc:  # payload, redirect, URL and response errors
        raise RuntimeFailed(action=action, detail=f"{type(exc).__name__}: {exc}") from exc
    except (anyio.BrokenResourceError, anyio.EndOfStream) as exc:
        raise BackendUnavailable(action=action, detail="the connection to the engine was lost") from exc
    except OSError as exc:
        raise BackendUnavailable(action=action, detail=exc.strerror or str(exc)) from exc


@contextmanager
def registry_errors(action: str, registry: str) -> Iterator[None]:
    """The same edge for the one place we speak to a registry ourselves (image.id, _digests.py)."""
    try:
        yield
    except TimeoutError as exc:
        raise RuntimeFailed(action=action, detail=f"registry {registry} did not answer in time") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise RuntimeFailed(action=action, detail=f"registry {registry}: {type(exc).__name__}: {exc}") from exc


def valid_workload_name(name: str) -> bool:
    """Whether `name` can be a Docker container name (or a full container id)."""
    return _CONTAINER_NAME.fullmatch(name) is not None


def _labels(info: dict[str, Any]) -> dict[str, str]:
    """The labels of an inspected container (``Config.Labels``; absent or null = none)."""
    return dict((info.get("Config") or {}).get("Labels") or {})


def _text(data: bytes) -> str:
    text = data.decode("utf-8", "replace").strip()
    return text if len(text) <= _DIAGNOSTIC_BYTES else "…" + text[-_DIAGNOSTIC_BYTES:]


def _stdin(value: bytes | UnsetType) -> bytes | None:
    """Bytes to feed, or None when the request did not carry the key (stdin not attached)."""
    return None if isinstance(value, UnsetType) else value


def _split(frames: list[tuple[int, bytes]], *, combined: bool) -> tuple[bytes, bytes]:
    """(output, diagnostics): stdout only unless combined; diagnostics = stderr or the combined stream."""
    stdout = b"".join(p for s, p in frames if s != 2)
    if combined:
        everything = b"".join(p for _, p in frames)
        return everything, everything
    return stdout, b"".join(p for s, p in frames if s == 2)


class DockerBackend:
    """runtime-v1 on one Docker Engine. An async context manager; ``aclose()`` is idempotent.

    `instance` names this daemon instance (stable across restarts, distinct per state
    directory): containers owned by an RPC carry it, and :meth:`recover` removes only this
    instance's leftovers. `image_ledger` is the file recording the references this
    provider pulled, built or tagged; with it, ``image-remove`` removes only those (None:
    any reference, as a library caller may want).
    """

    def __init__(self, *, url: str = "unix:///var/run/docker.sock", credentials_file: str | None = None,
                 spool_dir: str | None = None, instance: str = "", image_ledger: Path | None = None,
                 host_policy: HostPolicy | None = None, registries: frozenset[str] | None = None,
                 copy_max_bytes: int | None = None) -> None:
        if not url.startswith("unix://"):
            raise ValueError(f"docker.url must be a unix:// socket, got {url!r}")
        self._url = url
        self._socket_path = url[len("unix://"):]
        self._credentials_file = credentials_file
        # The registries whose credentials may reach this engine (None: every one in the file).
        self._registries = registries
        self._spool_dir = spool_dir
        # The most bytes one workload-copy-from archive may spool (None: unbounded, for library callers).
        self._copy_max_bytes = copy_max_bytes
        self._instance = instance
        self._host_policy = host_policy
        # This process: containers of the same instance but another incarnation are leftovers.
        self._incarnation = secrets.token_hex(8)
        self._ledger = ImageLedger(image_ledger)
        self._docker: aiodocker.Docker | None = None
        # Containers whose removal failed (engine down or restarting): retried by maintain().
        self._pending_removal: set[str] = set()
        # image.id on the containerd image store (_digests.py): whether the engine uses it (read
        # once: switching stores restarts the engine and empties it), and target -> config digest.
        self._containerd_store: bool | None = None
        self._engine_info: dict[str, Any] = {}
        self._config_digests: dict[str, str] = {}
        # [gpus] exclusive: the holder check and the create it allows are one step (see _create).
        self._gpu_lock = anyio.Lock()

    async def __aenter__(self) -> DockerBackend:
        await self._ledger.load()
        self._docker = aiodocker.Docker(url=self._url, api_version="v1.41", timeout=_SHORT)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        docker, self._docker = self._docker, None
        if docker is not None:
            with anyio.CancelScope(shield=True):
                await docker.close()

    @property
    def docker(self) -> aiodocker.Docker:
        if self._docker is None:
            raise anyio.ClosedResourceError
        return self._docker

    async def ping(self) -> bool:
        try:
            with docker_errors("ping"):
                await self.docker.version()
        except BackendError:
            return False
        return True

    # --- credentials ---------------------------------------------------------------

    def _credentials(self) -> dict[str, Any]:
        """Read per call so an admin can rotate the file without a restart."""
        if not self._credentials_file:
            return {}
        try:
            data = json.loads(Path(self._credentials_file).read_bytes())
        except (OSError, ValueError) as exc:
            raise RuntimeFailed(action="registry", detail=f"credentials file unusable: {exc}") from exc
        return data if isinstance(data, dict) else {}

    def _auth(self, registry: str, credentials: dict[str, Any] | None = None) -> dict[str, str] | None:
        """`registry`'s credentials, if this engine may receive them."""
        if self._registries is not None and registry not in self._registries:
            return None
        return registry_auth(self._credentials() if credentials is None else credentials, registry)

    def _auth_header(self, registry: str) -> dict[str, str]:
        return {"X-Registry-Auth": encode_registry_auth(self._auth(registry))}

    # --- the one wrapper over aiodocker's private request API --------------------------

    @asynccontextmanager
    async def _stream(self, path: str, *, method: str = "GET", params: dict[str, str] | None = None,
                      headers: dict[str, str] | None = None, data: Any = None
                      ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A raw, unbounded engine response whose connection is always closed on exit.

        aiodocker has no public API that streams raw bytes (its logs API decodes text, its
        archive API buffers the whole tar, its pull/push/build APIs hide errors sent inside
        a 200 stream), so these endpoints use its request method ``_query`` here, and only
        here. aiodocker leaves finalisation to the caller; closing is what tells the engine a
        cancelled client is gone (it then cancels the pull or build it was running).
        `path` must already be quoted (engine ids and validated names only).
        """
        async with self.docker._query(path, method=method, params=params, headers=headers, data=data,
                                      timeout=_UNBOUNDED) as response:
            try:
                yield response
            finally:
                response.close()

    # --- streaming JSON progress (pull, push, build) --------------------------------

    async def _progress(self, action: str, path: str, *, params: dict[str, str],
                        headers: dict[str, str], data: Any = None, kind: str = "", ref: str = "") -> None:
        """Consume a progress stream; an error inside a 200 stream is a failure."""
        with docker_errors(action, kind=kind, ref=ref):
            async with self._stream(path, method="POST", params=params, headers=headers, data=data) as response:
                async for event in _json_lines(response.content):
                    if error := event.get("error") or (event.get("errorDetail") or {}).get("message"):
                        raise RuntimeFailed(action=action, detail=str(error))

    # --- the image ledger (_ledger.py) ------------------------------------------------------

    async def image_owner(self, image: str) -> LedgerEntry | None:
        """The ledger's record of `image` (its owner), or None when this provider never recorded it."""
        return self._ledger.entry(image)

    async def claim_image(self, image: str, uid: int) -> None:
        """Record `image` as `uid`'s (kept when it already has an owner)."""
        await self._ledger.update("image-ledger", add=image, owner=uid)

    # --- images ----------------------------------------------------------------------

    async def _image(self, ref: str, action: str) -> dict[str, Any]:
        """Inspect exactly `ref` (the engine's ID-prefix matching is not accepted)."""
        with docker_errors(action, kind="image", ref=ref):
            info: dict[str, Any] = await self.docker.images.inspect(ref)
        if not image_matches(ref, info):
            raise NotFound(kind="image", ref=ref, action=action)
        return info

    async def image_inspect(self, image: str) -> ImageInfo:
        info = await self._image(image, "image-inspect")
        return ImageInfo(id=await self._config_digest(image, info), repo_digests=list(info.get("RepoDigests") or []),
                         size=int(info.get("Size") or 0))

    async def _config_digest(self, image: str, info: dict[str, Any]) -> str:
        """The image's OCI config digest: ``Id`` on the classic store, else read from its target (_digests.py)."""
        image_id = str(info["Id"])
        if self._containerd_store is None and "Descriptor" not in info:
            with docker_errors("image-inspect"):
                self._engine_info = dict(await self.docker.system.info())
            self._containerd_store = uses_containerd_store(self._engine_info)
        if not id_needs_resolution(info, containerd_store=bool(self._containerd_store)):
            return image_id
        if image_id in self._config_digests:  # content-addressed: never stale
            return self._config_digests[image_id]
        sources = [ref for name in info.get("RepoDigests") or []
                   if (ref := parse_reference(name)) is not None and ref.digest == image_id]
        if not sources:
            raise RuntimeFailed(action="image-inspect", detail=(
                f"{image} is on the containerd image store, whose image id {image_id} is not the config "
                "digest, and no registry repository holds it (RepoDigests) to read the config digest from"))
        with docker_errors("image-inspect"):
            if not self._engine_info:
                self._engine_info = dict(await self.docker.system.info())
            platform = Platform.of_engine(dict(await self.docker.version()))
        layers = (info.get("RootFS") or {}).get("Layers")
        failures = []
        for ref in sources:
            registry, repository = ref.registry, repository_path(ref.repository)
            try:
                with registry_errors("image-inspect", registry):
                    async with aiohttp.ClientSession(timeout=_SHORT) as session:
                        reader = RegistryReader(session, registry=registry, repository=repository,
                                                auth=self._auth(registry),
                                                insecure=registry_is_insecure(self._engine_info, registry))
                        found = await config_digest(image_id, reader.read, platform,
                                                    layers=layers if isinstance(layers, list) else None)
            except RuntimeFailed as exc:
                failures.append(f"{ref.normalized_repository}: {exc.detail}")
                continue
            self._config_digests[image_id] = found
            return found
        raise RuntimeFailed(action="image-inspect", detail=(
            f"cannot read the config digest of {image} (image id {image_id}): " + "; ".join(failures)))

    async def image_pull(self, image: str) -> None:
        ref = parse_reference(image)
        if ref is None:
            raise RuntimeFailed(action="image-pull", detail=f"local-only image {image} must already be resident")
        await self._progress("image-pull", "images/create",
                             params={"fromImage": ref.repository, "tag": ref.pull_tag},
                             headers=self._auth_header(ref.registry), kind="image", ref=image)
        await self._ledger.update("image-pull", add=image)

    async def image_push(self, image: str) -> None:
        ref = parse_reference(image)
        if ref is None or ref.digest:
            raise RuntimeFailed(action="image-push", detail=f"{image} is not a tag; only tags can be pushed")
        await self._image(image, "image-push")
        await self._progress("image-push", f"images/{quote(ref.repository, safe='/:')}/push",
                             params={"tag": ref.pull_tag},
                             headers=self._auth_header(ref.registry), kind="image", ref=image)

    async def image_tag(self, source: str, target: str) -> None:
        ref = parse_reference(target)
        if ref is None or ref.digest:
            raise RuntimeFailed(action="image-tag", detail=f"target {target} must be repository[:tag]")
        info = await self._image(source, "image-tag")
        with docker_errors("image-tag", kind="image", ref=source):
            await self.docker.images.tag(info["Id"], ref.repository, tag=ref.pull_tag)
        await self._ledger.update("image-tag", add=target)

    async def image_remove(self, image: str) -> None:
        try:
            await self._image(image, "image-remove")
        except NotFound:
            await self._ledger.update("image-remove", drop=image)
            raise
        if self._ledger.path is not None and self._ledger.entry(image) is None:
            raise RuntimeFailed(action="image-remove", detail=(
                f"{image} was not pulled, built or tagged by this provider; image-remove only removes "
                "references the provider itself pulled, built or tagged"))
        with docker_errors("image-remove", kind="image", ref=image):
            # Exactly this reference: no force, and never prune untagged parents.
            await self.docker.images.delete(image, force=False, noprune=True)
        await self._ledger.update("image-remove", drop=image)

    async def image_build(self, build: ImageBuild, *, owner: Owner | None = None) -> None:
        """Build `build.tag`; the context directories are read as `owner` (None: the daemon itself)."""
        headers = {"Content-Type": "application/x-tar"}
        # Only the credentials of the registries the build's base images come from: the engine needs no more.
        credentials = self._credentials()
        auths = {registry: entry for registry in self._build_registries(build)
                 if (entry := self._auth(registry, credentials))}
        if auths:
            headers["X-Registry-Config"] = base64.urlsafe_b64encode(json.dumps(auths).encode()).decode()
        if not build.pull:
            await self._require_local_bases(build)
        params = {"t": build.tag, "dockerfile": DOCKERFILE_PATH, "rm": "1", "forcerm": "1",
                  "pull": "1" if build.pull else "0", "buildargs": json.dumps(dict(build.arguments))}
        with tempfile.TemporaryFile(dir=self._spool_dir, prefix="coldsnap-build-") as spool:
            await write_context_tar(spool, context=build.context, contexts=dict(build.contexts),
                                    dockerfile=build.dockerfile, owner=owner, max_bytes=self._copy_max_bytes)
            spool.seek(0)
            await self._progress("image-build", "build", params=params, headers=headers, data=spool)
        await self._ledger.update("image-build", add=build.tag)

    @staticmethod
    def _build_registries(build: ImageBuild) -> set[str]:
        try:
            text = rewrite_dockerfile(build.dockerfile.decode("utf-8"), dict(build.contexts))
        except UnicodeDecodeError as exc:
            raise BuildContextError(str(exc)) from exc
        # FROM images, and images copied from (`COPY --from=<ref>`; a stage name has no "/" or ":").
        images = [*base_images(text, dict(build.arguments)),
                  *(name for name in re.findall(r"--from=(\S+)", text) if "/" in name or ":" in name)]
        return {ref.registry for image in images if (ref := parse_reference(image)) is not None}

    async def _require_local_bases(self, build: ImageBuild) -> None:
        """pull=false must never contact a registry, but the classic builder pulls a missing base."""
        try:
            text = rewrite_dockerfile(build.dockerfile.decode("utf-8"), dict(build.contexts))
        except UnicodeDecodeError as exc:
            raise BuildContextError(str(exc)) from exc
        for base in base_images(text, dict(build.arguments)):
            try:
                await self._image(base, "image-build")
            except NotFound as exc:
                raise RuntimeFailed(action="image-build", detail=(
                    f"base image {base} is not resident and pull is false (no registry is contacted)")) from exc

    async def _ensure_image(self, image: str, policy: str, *, allow_pull: bool) -> None:
        if policy == "always":
            if not allow_pull:
                raise RuntimeFailed(action="workload-run",
                                    detail="pull_policy 'always' needs the oci-pull capability")
            await self.image_pull(image)
            return
        try:
            await self._image(image, "workload-run")
        except NotFound:
            if policy == "never" or not allow_pull or parse_reference(image) is None:
                raise
            await self.image_pull(image)

    # --- workloads -------------------------------------------------------------------

    async def _labelled(self, action: str, *selectors: str) -> list[aiodocker.containers.DockerContainer]:
        """Every container (any state) matching all of `selectors` (``key`` or ``key=value`` label filters)."""
        with docker_errors(action):
            return list(await self.docker.containers.list(all="1", filters=json.dumps({"label": list(selectors)})))

    async def _find(self, name: str, action: str) -> dict[str, Any] | None:
        """The managed container named exactly `name` (or with that full id), else None."""
        if not valid_workload_name(name):
            return None  # Docker could never have created it: not a workload
        try:
            with docker_errors(action, kind="workload", ref=name):
                info: dict[str, Any] = await self.docker.containers.container(name).show()
        except NotFound:
            return None
        if info.get("Name") != "/" + name and info.get("Id") != name:
            return None  # the engine matched an id prefix or another name: not this workload
        if _labels(info).get(MANAGED_LABEL) != "true":
            raise RuntimeFailed(action=action, detail=(
                f"container {name} exists but was not created by coldsnap-provider; refusing to touch it"))
        return info

    async def _require(self, name: str, action: str) -> dict[str, Any]:
        info = await self._find(name, action)
        if info is None:
            raise NotFound(kind="workload", ref=name, action=action)
        return info

    async def _force_remove(self, container_id: str) -> None:
        """Remove a container this provider owns; if the engine cannot be reached, keep trying later."""
        with anyio.move_on_after(_CLEANUP_BUDGET_S, shield=True) as scope:
            try:
                with docker_errors("cleanup", kind="workload", ref=container_id):
                    await self.docker.containers.container(container_id).delete(force=True, v=True, timeout=_SHORT)
                self._pending_removal.discard(container_id)
                return
            except NotFound:
                self._pending_removal.discard(container_id)
                return
            except BackendError as exc:
                log.warning("cleanup failed; will retry", container_id=container_id, error=str(exc))
        if scope.cancelled_caught:
            log.error("cleanup timed out; will retry", container_id=container_id)
        self._pending_removal.add(container_id)

    async def maintain(self) -> None:
        """Retry removals that failed while the engine was unreachable (called periodically by the daemon)."""
        for container_id in sorted(self._pending_removal):
            await self._force_remove(container_id)
            if container_id not in self._pending_removal:
                log.info("deferred cleanup done", container_id=container_id)

    def _leftover(self, labels: dict[str, str]) -> bool:
        """Owned by an RPC of this instance that a previous process ran (it cannot still be waiting)."""
        return bool(self._instance) and labels.get(INSTANCE_LABEL) == self._instance and labels.get(
            INCARNATION_LABEL) != self._incarnation

    async def recover(self) -> None:
        """Remove the containers RPCs of an earlier process of this instance left (e.g. after SIGKILL)."""
        if not self._instance:
            return
        for container in await self._labelled("recover", f"{INSTANCE_LABEL}={self._instance}"):
            if self._leftover(dict(container["Labels"] or {})):
                log.info("removing a leftover of an earlier daemon", container_id=container.id)
                await self._force_remove(container.id)

    async def _reclaim(self, name: str) -> bool:
        """Remove a leftover of this instance that holds `name`; whether the name is free now."""
        try:
            with docker_errors("workload-run", kind="workload", ref=name):
                info = await self.docker.containers.container(name).show()
        except NotFound:
            return True
        if info.get("Name") != "/" + name or not self._leftover(_labels(info)):
            return False
        log.info("reclaiming a name held by a leftover of an earlier daemon", container_id=info["Id"])
        await self._force_remove(str(info["Id"]))
        return info["Id"] not in self._pending_removal

    async def gpu_holders(self) -> list[GpuHolder]:
        """Managed containers holding GPUs ([gpus] exclusive): any state but exited or dead, any session.

        What each holds is the HELD_GPUS_LABEL it was created with: one filtered list, which the
        engine keeps across daemon restarts.
        """
        holders = []
        for container in await self._labelled("workload-run", f"{MANAGED_LABEL}=true", HELD_GPUS_LABEL):
            if str(container["State"] or "") in ("exited", "dead"):
                continue
            held = str((container["Labels"] or {}).get(HELD_GPUS_LABEL) or "")
            name = str((container["Names"] or [container.id])[0]).lstrip("/")
            holders.append(GpuHolder(workload=name, gpus=tuple(g for g in held.split(",") if g)))
        return holders

    async def _realise(self, spec: WorkloadSpec, *, exclusive: bool,
                       capabilities: tuple[str, ...] | None) -> Realisation:
        """`gpus` and `privileged` as this host allows ([gpus], [runtime] privileged; see _gpus.py)."""

        async def engine_info() -> dict[str, Any]:
            with docker_errors("workload-run"):
                info = dict(await self.docker.system.info())
            return info

        async def rejects(caps: list[str]) -> str:
            body: dict[str, Any] = {"Image": CAPABILITY_PROBE_IMAGE, "HostConfig": {"CapAdd": caps}}
            try:  # an invalid reference: the engine answers an error and creates nothing
                with docker_errors("workload-run"):
                    created = await self.docker.containers.create(body)
            except RuntimeFailed as exc:  # DockerContainerError is a DockerError: docker_errors maps it
                return exc.detail
            await self._force_remove(created.id)  # never expected; but a probe must leave nothing behind
            return ""

        return await realise(spec, self._host_policy or HostPolicy(), socket_path=self._socket_path,
                             engine_info=engine_info, image_info=lambda ref: self._image(ref, "workload-run"),
                             rejects=rejects, holders=self.gpu_holders if exclusive else None,
                             capabilities=capabilities)

    async def _create(self, spec: WorkloadSpec,
                      capabilities: tuple[str, ...] | None) -> aiodocker.containers.DockerContainer:
        if (self._host_policy or HostPolicy()).gpus.exclusive and gpu_routes(spec, capabilities):
            async with self._gpu_lock:  # two creates for one GPU: the second sees the first's container
                return await self._create_now(spec, exclusive=True, capabilities=capabilities)
        return await self._create_now(spec, exclusive=False, capabilities=capabilities)

    async def _create_now(self, spec: WorkloadSpec, *, exclusive: bool,
                          capabilities: tuple[str, ...] | None) -> aiodocker.containers.DockerContainer:
        realised = await self._realise(spec, exclusive=exclusive, capabilities=capabilities)
        config = container_config(spec, gpus=realised.gpus, privilege=realised.privilege)
        # What it holds is the backend's to say: a manager's own label of that name is dropped.
        config["Labels"] = {k: v for k, v in config["Labels"].items() if k != HELD_GPUS_LABEL}
        if realised.held:
            config["Labels"][HELD_GPUS_LABEL] = ",".join(realised.held)
        if self._instance and not spec.detached and (not spec.name or spec.remove_after_exit):
            # Owned by this RPC: recover() removes it if this process dies before its cleanup ran.
            config["Labels"] = {**config["Labels"], INSTANCE_LABEL: self._instance,
                                INCARNATION_LABEL: self._incarnation}
        with docker_errors("workload-run"):
            try:
                return await self.docker.containers.create(config, name=spec.name or None)
            except aiodocker.DockerError as exc:
                if not (exc.status == 409 and spec.name and await self._reclaim(spec.name)):
                    raise
            return await self.docker.containers.create(config, name=spec.name)

    async def workload_run(self, spec: WorkloadSpec, *, allow_pull: bool,
                           capabilities: tuple[str, ...] | None = None) -> RuntimeResponse:
        """Run `spec`; `capabilities` (an admission profile's grant): `privileged` is exactly these."""
        if spec.name and not valid_workload_name(spec.name):
            raise RuntimeFailed(action="workload-run", detail=(
                f"invalid workload name {spec.name!r}: a name matches [a-zA-Z0-9][a-zA-Z0-9_.-]+"))
        await self._ensure_image(spec.image, spec.pull_policy, allow_pull=allow_pull)
        container = await self._create(spec, capabilities)
        cid = container.id
        try:
            if spec.detached:
                with docker_errors("workload-run", kind="workload", ref=spec.name):
                    await container.start()
                log.info("workload started", container_id=cid)
                return RuntimeResponse(output=f"{cid}\n".encode(), value=cid)
            frames, exit_code = await self._run_attached(cid, spec)
        except BaseException:  # failed or cancelled after create: leave nothing behind
            await self._force_remove(cid)
            raise
        if spec.remove_after_exit:
            await self._force_remove(cid)
        output, diagnostics = _split(frames, combined=spec.combined)
        if exit_code != 0:
            raise RuntimeFailed(action="workload-run", detail=f"exited {exit_code}: {_text(diagnostics)}")
        return RuntimeResponse(output=output)

    async def _run_attached(self, cid: str, spec: WorkloadSpec) -> tuple[list[tuple[int, bytes]], int]:
        query = {"stream": "1", "stdin": "0" if spec.input is UNSET else "1", "stdout": "1", "stderr": "1"}
        with docker_errors("workload-run", kind="workload", ref=cid):
            async with await hijack(self._socket_path, f"/containers/{quote(cid, safe='')}/attach",
                                    action="workload-run", query=query) as stream:
                await self.docker.containers.container(cid).start()
                frames = await stream.communicate(_stdin(spec.input), limit=OUTPUT_LIMIT)
            result = await self.docker.containers.container(cid).wait(timeout=None)
        return frames, int(result.get("StatusCode", -1))

    async def workload_remove(self, name: str) -> None:
        info = await self._find(name, "workload-remove")
        if info is None:
            return  # already absent is success: it precedes every named launch
        try:
            with docker_errors("workload-remove", kind="workload", ref=name):
                await self.docker.containers.container(info["Id"]).delete(force=True, v=True, timeout=_SHORT)
        except NotFound:
            return

    async def workload_inspect(self, name: str, *, include_start_time: bool) -> WorkloadInfo:
        info = await self._require(name, "workload-inspect")
        state = info.get("State") or {}
        started = state.get("StartedAt") or ""
        return WorkloadInfo(
            id=info["Id"],
            image=(info.get("Config") or {}).get("Image") or "",
            state=state.get("Status") or "",
            exit_code=int(state.get("ExitCode") or 0),
            running=bool(state.get("Running")),
            paused=bool(state.get("Paused")),
            labels=_labels(info),
            started_at=started if include_start_time and started and started != _ZERO_TIME else UNSET,
        )

    async def workload_list(self) -> list[tuple[str, WorkloadInfo]]:
        """Every workload this provider manages, by name (containers carrying the managed label)."""
        listed = []
        for container in await self._labelled("workload-list", f"{MANAGED_LABEL}=true"):
            name = str((container["Names"] or ["/"])[0]).lstrip("/")
            try:
                listed.append((name, await self.workload_inspect(name, include_start_time=True)))
            except NotFound:
                continue  # removed meanwhile
        return sorted(listed, key=lambda item: item[0])

    async def workload_stop(self, name: str, *, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (the engine's stop); the container is kept."""
        info = await self._require(name, "workload-stop")
        with docker_errors("workload-stop", kind="workload", ref=name):
            await self.docker.containers.container(info["Id"]).stop(
                t=max(0, round(timeout_s)), timeout=aiohttp.ClientTimeout(total=timeout_s + 30))

    async def workload_exec(self, name: str, execution: Execution) -> bytes:
        info = await self._require(name, "workload-exec")
        with docker_errors("workload-exec", kind="workload", ref=name):
            created = await self.docker.containers.container(info["Id"]).exec(
                list(execution.command), stdin=execution.input is not UNSET, user=execution.user)
            try:
                async with await hijack(self._socket_path, f"/exec/{quote(created.id, safe='')}/start",
                                        action="workload-exec", body={"Detach": False, "Tty": False}) as stream:
                    frames = await stream.communicate(_stdin(execution.input), limit=OUTPUT_LIMIT)
            except BaseException:
                await self._kill_exec(created.id)
                raise
            result = await self.docker.containers.exec(created.id).inspect()
        output, diagnostics = _split(frames, combined=execution.combined)
        exit_code = result.get("ExitCode")
        if exit_code != 0:
            raise RuntimeFailed(action="workload-exec", detail=f"exited {exit_code}: {_text(diagnostics)}")
        return output

    async def _kill_exec(self, exec_id: str) -> None:
        """The engine keeps an exec running after its client leaves: stop it ourselves."""
        with anyio.move_on_after(_CLEANUP_BUDGET_S, shield=True):
            try:
                with docker_errors("cleanup"):
                    state = await self.docker.containers.exec(exec_id).inspect()
            except BackendError:
                return
            pid = int(state.get("Pid") or 0)
            if state.get("Running") and pid > 0:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    async def workload_logs(self, name: str, *, tail: int) -> bytes:
        info = await self._require(name, "workload-logs")
        params = {"stdout": "1", "stderr": "1", "tail": str(tail) if tail else "all"}
        buffer = bytearray()
        chunks: list[bytes] = []
        total = 0  # a running total: summing the chunks on every read was quadratic
        with docker_errors("workload-logs", kind="workload", ref=name):
            async with self._stream(f"containers/{quote(info['Id'], safe='')}/logs", params=params) as response:
                async for data in response.content.iter_any():
                    buffer += data
                    for _, payload in demux(buffer):
                        chunks.append(payload)
                        total += len(payload)
                    if total > OUTPUT_LIMIT:
                        raise OutputTooLarge(action="workload-logs", limit=OUTPUT_LIMIT)
        return b"".join(chunks)

    async def workload_copy_from(self, name: str, path: str, destination: str, *,
                                 owner: Owner | None = None) -> None:
        action = "workload-copy-from"
        info = await self._require(name, action)
        # Spooled in the daemon's own directory; only the extractor, as `owner`, writes at the destination.
        with tempfile.TemporaryFile(dir=self._spool_dir, prefix="coldsnap-copy-") as spool:
            try:
                with docker_errors(action, kind="path", ref=path):
                    async with self._stream(f"containers/{quote(info['Id'], safe='')}/archive",
                                            params={"path": path}) as response:
                        stat = _path_stat(response.headers.get("X-Docker-Container-Path-Stat", ""))
                        await self._spool_copy(response.content, spool)
            except NotFound as exc:
                raise PathNotFound(workload=name, path=path, action=action) from exc
            spool.seek(0)
            root = str(stat.get("name") or os.path.basename(path))
            await extract_archive(spool, root, destination, owner=owner, action=action,
                                  max_bytes=self._copy_max_bytes)

    async def _spool_copy(self, content: aiohttp.StreamReader, spool: IO[bytes]) -> None:
        """The engine's tar into `spool`, bounded by its size (a sparse file counts in full, as the tar
        carries it); runs of zeros become holes, so the spool on disk stays as sparse as the files were."""
        total = 0
        async for data in content.iter_chunked(1 << 20):
            total += len(data)
            if self._copy_max_bytes is not None and total > self._copy_max_bytes:
                raise RuntimeFailed(action="workload-copy-from", detail=(
                    f"the copy exceeds {self._copy_max_bytes} bytes (docker.copy_max_bytes); nothing was placed"))
            with self._spooling():
                if data.count(0) == len(data):
                    spool.seek(len(data), os.SEEK_CUR)
                else:
                    await anyio.to_thread.run_sync(spool.write, data)
        with self._spooling():
            spool.truncate(total)  # a trailing hole has a size too
            await anyio.to_thread.run_sync(spool.flush)

    @contextmanager
    def _spooling(self) -> Iterator[None]:
        """A full or failing spool is ours, not the engine's: say where (docker.spool_dir)."""
        try:
            yield
        except OSError as exc:
            raise RuntimeFailed(action="workload-copy-from", detail=(
                f"cannot spool the copy in {self._spool_dir or tempfile.gettempdir()}: {exc.strerror}")) from exc


def _path_stat(header: str) -> dict[str, Any]:
    """The engine's X-Docker-Container-Path-Stat header (base64 JSON); {} when absent or malformed."""
    try:
        value = json.loads(base64.b64decode(header or "e30="))
    except (ValueError, binascii.Error):
        return {}
    return value if isinstance(value, dict) else {}


async def extract_archive(spool: IO[bytes], root: str, destination: str, *, owner: Owner | None,
                          action: str, max_bytes: int | None) -> None:
    """Run the extractor program with `spool` on stdin; it drops to `owner` before touching the destination,
    and writes at most `max_bytes` (hard links count again)."""
    argv = [sys.executable, "-I", "-S", _ARCHIVE_PROGRAM, root, destination]
    if max_bytes is not None:
        argv += ["--max-bytes", str(max_bytes)]
    if owner is not None:
        argv += ["--as", f"{owner.uid}:{owner.gid}"]
    if os.geteuid() == 0 and (owner is None or owner.uid == 0):
        argv.append("--keep-owner")  # a root writer keeps numeric ownership, as `docker cp` does
        # (only a root daemon: under the unit, uid 0 holds no CAP_CHOWN after the drop)
    try:
        result = await anyio.run_process(argv, stdin=spool, check=False, cwd="/",
                                         env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"})
    except OSError as exc:
        raise RuntimeFailed(action=action, detail=f"cannot start the extractor: {exc}") from exc
    if result.returncode != 0:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise RuntimeFailed(action=action, detail=lines[-1] if lines else f"extractor exited {result.returncode}")


async def _json_lines(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    decoder = json.JSONDecoder()
    buffer = ""
    async for chunk in content.iter_any():
        buffer += chunk.decode("utf-8", "replace")
        while True:
            buffer = buffer.lstrip()
            if not buffer:
                break
            try:
                event, end = decoder.raw_decode(buffer)
            except ValueError:
                break
            buffer = buffer[end:]
            if isinstance(event, dict):
                yield event

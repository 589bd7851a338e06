"""Images on one engine: inspect, pull, push, tag, remove and build, with registry credentials and the ledger.

With an ``image_ledger``, ``image-remove`` only removes references this provider pulled, built or
tagged (the ledger file records them); it never forces and only untags that one reference.
``image.id`` is the OCI config digest on either image store: on the containerd store the inspect's
``Id`` is a manifest or index digest, resolved through ``_digests.py``.

Build contexts are read by ``_archive.py`` running as the session's owner (``_buildctx.py``); only
the credentials of the registries a build's base images come from reach the engine.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import anyio

from .. import dockerfile
from ..errors import BuildContextError, NotFound, RequestRejected, RuntimeFailed
from ..limits import CLEANUP_BUDGET_S
from ..schema import ImageBuild, ImageInfo
from ._base import Owner, requesting_manager
from ._buildctx import DOCKERFILE_PATH, base_images, rewrite_dockerfile, write_context_tar
from ._capture_build import CAPTURE_LABEL, FILES_LABEL
from ._captures import Captures
from ._digests import (
    Platform,
    RegistryReader,
    config_digest,
    id_needs_resolution,
    registry_is_insecure,
    repository_path,
    uses_containerd_store,
)
from ._engine import SHORT, Engine, docker_errors, registry_errors
from ._ledger import ImageLedger
from ._translate import encode_registry_auth, image_matches, parse_reference, registry_auth

__all__ = ("Images",)


class Images:
    """The image actions of one engine. `registries`: those whose credentials may reach it (None: every one
    in `credentials_file`); `copy_max_bytes` bounds a build context (None: unbounded)."""

    def __init__(self, engine: Engine, *, credentials_file: str | None, registries: frozenset[str] | None,
                 ledger: Path | None, spool_dir: str | None, copy_max_bytes: int | None, captures: Captures) -> None:
        self._engine = engine
        self.captures = captures
        self._credentials_file = credentials_file
        self._registries = registries
        self.ledger = ImageLedger(ledger)
        self._spool_dir = spool_dir
        self._copy_max_bytes = copy_max_bytes
        # image.id on the containerd image store (_digests.py): whether the engine uses it (read
        # once: switching stores restarts the engine and empties it), and target -> config digest.
        self._containerd_store: bool | None = None
        self._engine_info: dict[str, Any] = {}
        self._config_digests: dict[str, str] = {}

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

    # --- inspect ---------------------------------------------------------------------

    async def exact(self, ref: str, action: str) -> dict[str, Any]:
        """Inspect exactly `ref` (the engine's ID-prefix matching is not accepted)."""
        with docker_errors(action, kind="image", ref=ref):
            info: dict[str, Any] = await self._engine.docker.images.inspect(ref)
        if not image_matches(ref, info):
            raise NotFound(kind="image", ref=ref, action=action)
        return info

    async def inspect(self, image: str) -> ImageInfo:
        info = await self.exact(image, "image-inspect")
        return ImageInfo(id=await self.config_digest(image, info), repo_digests=list(info.get("RepoDigests") or []),
                         size=int(info.get("Size") or 0))

    async def config_digest(self, image: str, info: dict[str, Any]) -> str:
        """The image's OCI config digest: ``Id`` on the classic store, else read from its target (_digests.py)."""
        image_id = str(info["Id"])
        if self._containerd_store is None and "Descriptor" not in info:
            self._engine_info = await self._engine.info("image-inspect")
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
        if not self._engine_info:
            self._engine_info = await self._engine.info("image-inspect")
        with docker_errors("image-inspect"):
            platform = Platform.of_engine(dict(await self._engine.docker.version()))
        layers = (info.get("RootFS") or {}).get("Layers")
        failures = []
        for ref in sources:
            try:
                found = await self._read_config_digest(image_id, ref.registry, repository_path(ref.repository),
                                                       platform, layers if isinstance(layers, list) else None)
            except RuntimeFailed as exc:
                failures.append(f"{ref.normalized_repository}: {exc.detail}")
                continue
            self._config_digests[image_id] = found
            return found
        raise RuntimeFailed(action="image-inspect", detail=(
            f"cannot read the config digest of {image} (image id {image_id}): " + "; ".join(failures)))

    async def _read_config_digest(self, image_id: str, registry: str, repository: str, platform: Platform,
                                  layers: list[Any] | None) -> str:
        """Ask one registry repository that holds `image_id` for its config digest."""
        with registry_errors("image-inspect", registry):
            async with aiohttp.ClientSession(timeout=SHORT) as session:
                reader = RegistryReader(session, registry=registry, repository=repository,
                                        auth=self._auth(registry),
                                        insecure=registry_is_insecure(self._engine_info, registry))
                return await config_digest(image_id, reader.read, platform, layers=layers)

    # --- pull, push, tag, remove -------------------------------------------------------

    async def pull(self, image: str) -> None:
        ref = parse_reference(image)
        if ref is None:
            raise RuntimeFailed(action="image-pull", detail=f"local-only image {image} must already be resident")
        manager, entry = requesting_manager.get(), self.ledger.entry(image)
        # The capture the manager's own reference carries before the pull moves it: the pull may use its chunks.
        held = await self.captures.carried(image, "image-pull") \
            if manager is not None and entry is not None and entry.owner == manager else None
        before = await self._resident_id(image, "image-pull")
        # Until its capture came from the registry, the reference (its label) reaches no capture (`writing`).
        with self.ledger.writing(image):
            try:
                await self._engine.progress("image-pull", "images/create",
                                            params={"fromImage": ref.repository, "tag": ref.pull_tag},
                                            headers=self._auth_header(ref.registry), kind="image", ref=image)
                await self.ledger.update("image-pull", add=image)
                # The capture the capsule carries comes beside it, straight into the node's store.
                await self.captures.pull(image, await self.exact(image, "image-pull"), self._auth, held=held)
            except BaseException:  # an image whose capture its registry did not give (or not yet: the request was
                # cancelled, review 15) must not run with the node's copy
                with anyio.move_on_after(CLEANUP_BUDGET_S, shield=True):
                    if await self._drop_unchecked(image, before, "image-pull"):
                        await self.ledger.update("image-pull", drop=image)
                raise
            # A reference this pull recorded is now the pulling manager's: a workload-run's pull too, which `dispatch`
            # claims for no one (pull_policy "missing"), and whose run must reach the capture just pulled.
            if manager is not None and entry is None:
                await self.ledger.update("image-pull", add=image, owner=manager)
        await self.captures.read_stubs(image, "image-pull")

    async def push(self, image: str) -> None:
        ref = parse_reference(image)
        if ref is None or ref.digest:
            raise RuntimeFailed(action="image-push", detail=f"{image} is not a tag; only tags can be pushed")
        # Its capture first: once the tag is in the registry, so is everything it names.
        await self.captures.push(image, await self.exact(image, "image-push"), self._auth)
        await self._engine.progress("image-push", f"images/{quote(ref.repository, safe='/:')}/push",
                                    params={"tag": ref.pull_tag},
                                    headers=self._auth_header(ref.registry), kind="image", ref=image)

    async def tag(self, source: str, target: str) -> None:
        ref = parse_reference(target)
        if ref is None or ref.digest:
            raise RuntimeFailed(action="image-tag", detail=f"target {target} must be repository[:tag]")
        info = await self.exact(source, "image-tag")
        # The target becomes this manager's: a tag must not confer the reach of the source's capture.
        await self.captures.require_reach(source, info, "image-tag", outcome="nothing was tagged")
        with docker_errors("image-tag", kind="image", ref=source):
            await self._engine.docker.images.tag(info["Id"], ref.repository, tag=ref.pull_tag)
        await self.ledger.update("image-tag", add=target)

    async def remove(self, image: str) -> None:
        try:
            await self.exact(image, "image-remove")
        except NotFound:
            await self.ledger.update("image-remove", drop=image)
            raise
        if self.ledger.path is not None and self.ledger.entry(image) is None:
            raise RuntimeFailed(action="image-remove", detail=(
                f"{image} was not pulled, built or tagged by this provider; image-remove only removes "
                "references the provider itself pulled, built or tagged"))
        with docker_errors("image-remove", kind="image", ref=image):
            # Exactly this reference: no force, and never prune untagged parents.
            await self._engine.docker.images.delete(image, force=False, noprune=True)
        await self.ledger.update("image-remove", drop=image)

    async def ensure(self, image: str, policy: str, *, allow_pull: bool) -> tuple[list[str], dict[str, Any]]:
        """workload-run's `pull_policy` for `image` (pulling needs `allow_pull`, the oci-pull capability); the
        image's layers (diff IDs, bottom first), which the workload is told (`CAPSULE_LAYERS_ENV`), and its inspect
        (the run's one: the create and the GPU realisation read it rather than asking the engine again)."""
        if policy == "always":
            if not allow_pull:
                raise RuntimeFailed(action="workload-run",
                                    detail="pull_policy 'always' needs the oci-pull capability")
            await self.pull(image)
        else:
            try:
                info = await self.exact(image, "workload-run")
                return _layers(info), info
            except NotFound:
                if policy == "never" or not allow_pull or parse_reference(image) is None:
                    raise
                await self.pull(image)
        info = await self.exact(image, "workload-run")
        return _layers(info), info

    # --- build -----------------------------------------------------------------------

    async def build(self, build: ImageBuild, *, owner: Owner | None, remote_sources: bool = True) -> None:
        """Build `build.tag`; the context directories are read as `owner` (None: the daemon itself)."""
        headers = {"Content-Type": "application/x-tar"}
        # Only the credentials of the registries the build's base images come from: the engine needs no more.
        credentials = self._credentials()
        auths = {registry: entry for registry in _build_registries(build)
                 if (entry := self._auth(registry, credentials))}
        if auths:
            headers["X-Registry-Config"] = base64.urlsafe_b64encode(json.dumps(auths).encode()).decode()
        if build.pull:
            await self._pull_bases(build)
        if not remote_sources:
            await self._refuse_remote_triggers(build)
        elif not build.pull:
            await self._require_local_bases(build)
        # Its bases were pulled above, if at all: the builder pulls none in their place (nor re-points their tags).
        params = {"t": build.tag, "dockerfile": DOCKERFILE_PATH, "rm": "1", "forcerm": "1",
                  "pull": "0", "buildargs": json.dumps(dict(build.arguments))}
        before = await self._resident_id(build.tag, "image-build")
        # Until its capture label was checked, the tag (its label) reaches no capture (`writing`).
        with self.ledger.writing(build.tag):
            try:
                with tempfile.TemporaryFile(dir=self._spool_dir, prefix="coldsnap-build-") as spool, \
                        tempfile.TemporaryFile(dir=self._spool_dir, prefix="coldsnap-build-") as filtered:
                    await write_context_tar(spool, context=build.context, contexts=dict(build.contexts),
                                            dockerfile=build.dockerfile, owner=owner, max_bytes=self._copy_max_bytes)
                    spool.seek(0)
                    stored = await self.captures.filter_context(spool, filtered)
                    await self._engine.progress("image-build", "build", params=params, headers=headers,
                                                data=filtered if stored else spool)
                await self._refuse_forged_capture(build, stored)
            except BaseException:  # cancelled (or failed) before its label was checked: not left under the tag
                with anyio.move_on_after(CLEANUP_BUDGET_S, shield=True):
                    await self._drop_unchecked(build.tag, before, "image-build")
                raise
        await self.ledger.update("image-build", add=build.tag)
        await self.captures.read_stubs(build.tag, "image-build")

    async def _refuse_forged_capture(self, build: ImageBuild, stored: str | None) -> None:
        """The capture labels are the daemon's to write (the capture this build stored) or a base image's: a
        Dockerfile's own LABEL (or a build argument's) naming some capture would mount another manager's files
        at workload-run. A base's capture is inherited only by a manager that reaches it (the built tag becomes
        its own, which would reach it from then on). Such an image is removed and the build refused."""
        def pair(info: dict[str, Any]) -> tuple[str | None, str | None]:
            found = (info.get("Config") or {}).get("Labels") or {}
            return found.get(CAPTURE_LABEL), found.get(FILES_LABEL)

        built = pair(await self.exact(build.tag, "image-build"))
        if built[0] is None or (stored is not None and built[0] == stored):
            return
        for base in base_images(_dockerfile(build), dict(build.arguments)):
            try:
                if pair(info := await self.exact(base, "image-build")) == built:
                    break
            except NotFound:
                continue
        else:
            await self._remove_built(build.tag)
            raise RuntimeFailed(action="image-build", detail=(
                f"{build.tag}: label {CAPTURE_LABEL} is written by the daemon (a capture in the build context) or "
                "inherited from a base image, never set by a Dockerfile; the image was removed"))
        try:
            await self.captures.require_reach(f"base image {base}", info, "image-build",
                                              outcome=f"{build.tag} was removed")
        except RuntimeFailed:
            await self._remove_built(build.tag)
            raise

    async def _resident_id(self, ref: str, action: str) -> str | None:
        """The id of the image `ref` names now (None: none)."""
        try:
            return str((await self.exact(ref, action))["Id"])
        except NotFound:
            return None

    async def _drop_unchecked(self, ref: str, before: str | None, action: str) -> bool:
        """Untag `ref` when a pull or build that failed or was cancelled before its capture was checked left it naming
        another image (`before`: the one it named) that carries a capture: it would reach that capture (review 15).
        Whether it was removed; best effort (the failure being raised says what went wrong)."""
        with contextlib.suppress(Exception):
            info = await self.exact(ref, action)
            if info["Id"] != before and CAPTURE_LABEL in ((info.get("Config") or {}).get("Labels") or {}):
                with docker_errors(action, kind="image", ref=ref):
                    await self._engine.docker.images.delete(ref, force=True)
                return True
        return False

    async def _remove_built(self, tag: str) -> None:
        with docker_errors("image-build", kind="image", ref=tag):
            await self._engine.docker.images.delete(tag, force=True)

    async def _pull_bases(self, build: ImageBuild) -> None:
        """A pulling build's bases, pulled here, not by the builder: its pull re-pointed a reference a manager recorded
        to an image whose capture no registry was asked for, which that reference then reached (review 15). A
        recorded base is pulled as image-pull pulls (its capture checked, removed when its registry lacks it)."""
        for base in base_images(_dockerfile(build), dict(build.arguments)):
            if (ref := parse_reference(base)) is None:
                continue
            if self.ledger.entry(base) is not None:
                await self.pull(base)
            else:  # recorded by no one: it reaches no capture (a tag or build FROM it, or a run, asks for reach)
                await self._engine.progress("image-build", "images/create",
                                            params={"fromImage": ref.repository, "tag": ref.pull_tag},
                                            headers=self._auth_header(ref.registry), kind="image", ref=base)

    async def _refuse_remote_triggers(self, build: ImageBuild) -> None:
        """A base image's ONBUILD triggers run in the build that uses it, and the engine fetches an ADD of a URL
        among them itself, in the host's network namespace, like one written in the Dockerfile (issue 37,
        finding 4). So each base is checked as the builder will use it: resident (pulled first when the build
        pulls: `_pull_bases`; the builder then pulls nothing)."""
        for base in base_images(_dockerfile(build), dict(build.arguments)):
            try:
                info = await self.exact(base, "image-build")
            except NotFound as exc:
                raise RuntimeFailed(action="image-build", detail=(
                    f"base image {base} is not resident and pull is false (no registry is contacted)")) from exc
            triggers = [str(t) for t in (info.get("Config") or {}).get("OnBuild") or []]
            if found := dockerfile.remote_sources("\n".join(triggers)):
                raise RequestRejected(
                    f"build.dockerfile: FROM {base}: its ONBUILD trigger {found[0].instruction} {found[0].source} "
                    "would have the engine fetch from the network itself, in the host's network namespace; "
                    "this manager's profile refuses remote build sources (build_remote_sources)")

    async def _require_local_bases(self, build: ImageBuild) -> None:
        """pull=false must never contact a registry, but the classic builder pulls a missing base."""
        for base in base_images(_dockerfile(build), dict(build.arguments)):
            try:
                await self.exact(base, "image-build")
            except NotFound as exc:
                raise RuntimeFailed(action="image-build", detail=(
                    f"base image {base} is not resident and pull is false (no registry is contacted)")) from exc


def _dockerfile(build: ImageBuild) -> str:
    """The build's Dockerfile as the engine will see it (named contexts rewritten)."""
    try:
        return rewrite_dockerfile(build.dockerfile.decode("utf-8"), dict(build.contexts))
    except UnicodeDecodeError as exc:
        raise BuildContextError(str(exc)) from exc


def _build_registries(build: ImageBuild) -> set[str]:
    text = _dockerfile(build)
    # FROM images, and images copied from (`COPY --from=<ref>`; a stage name has no "/" or ":").
    images = [*base_images(text, dict(build.arguments)),
              *(name for name in re.findall(r"--from=(\S+)", text) if "/" in name or ":" in name)]
    return {ref.registry for image in images if (ref := parse_reference(image)) is not None}


def _layers(info: dict[str, Any]) -> list[str]:
    """An image's layer diff IDs, bottom first (content digests: the same on every node and image store)."""
    return [str(layer) for layer in (info.get("RootFS") or {}).get("Layers") or []]

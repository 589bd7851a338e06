"""The Docker Engine backend (aiodocker over the engine's Unix socket; never the CLI).

:class:`DockerBackend` is runtime-v1 on one engine, composed of one piece per job: the connection
and its one error edge (``_engine.py``), images, credentials and the ledger (``_images.py``), the
managed containers, their ownership labels and deferred removals (``_containers.py``), and
workload-copy-from (``_copy.py``). The workload actions themselves are here.

Containers keep the protocol's lifetimes: a named workload that started is a manager key
and is removed only by ``workload-remove``; a run that fails or is cancelled after its
container was created removes that container under a shielded, bounded cleanup. The
containers an RPC owns carry this daemon instance's labels, so that :meth:`DockerBackend.recover`
can remove what a killed predecessor left behind (``_containers.py``).

Workload names follow Docker's own container-name rule; a name outside it cannot exist,
so it is never sent to the engine (lookups answer "not found", runs are refused).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiodocker
import aiohttp
import anyio
import structlog
from msgspec import UNSET, UnsetType

from ..errors import BackendError, CommandFailed, EngineRejected, NotFound, OutputTooLarge, RuntimeFailed
from ..limits import CLEANUP_BUDGET_S, OUTPUT_LIMIT
from ..schema import Execution, ImageBuild, ImageInfo, RuntimeResponse, WorkloadInfo, WorkloadSpec
from ..store import CaptureStore
from ._base import Owner
from ._captures import CAPTURE_LABEL, Captures
from ._containers import Containers, labels, valid_workload_name
from ._copy import copy_out
from ._engine import SHORT, Engine, docker_errors
from ._gpus import (
    HELD_GPUS_LABEL,
    GpuHolder,
    HostPolicy,
    Realisation,
    gpu_routes,
    realise,
)
from ._hijack import hijack
from ._host_privilege import CAPABILITY_PROBE_IMAGE
from ._images import Images
from ._ledger import LedgerEntry
from ._translate import IMAGE_LABEL, MANAGED_LABEL, container_config, demux

__all__ = ("DockerBackend",)

log = structlog.get_logger(__name__)

_DIAGNOSTIC_BYTES = 16 << 10
_ZERO_TIME = "0001-01-01T00:00:00Z"


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
                 copy_max_bytes: int | None = None, capture_store: Path | None = None) -> None:
        self._engine = Engine(url)
        self._containers = Containers(self._engine, instance)
        self.captures = Captures(self._engine, CaptureStore(capture_store) if capture_store else None,
                                 spool_dir=spool_dir, containers=self._containers,
                                 owned_refs=lambda uid: self._images.ledger.owned_by(uid),
                                 others_refs=lambda uid: self._images.ledger.not_owned_by(uid))
        self._images = Images(self._engine, credentials_file=credentials_file, registries=registries,
                              ledger=image_ledger, spool_dir=spool_dir, copy_max_bytes=copy_max_bytes,
                              captures=self.captures)
        self._spool_dir = spool_dir
        # The most bytes one workload-copy-from archive may spool (None: unbounded, for library callers).
        self._copy_max_bytes = copy_max_bytes
        self._host_policy = host_policy or HostPolicy()
        # [gpus] exclusive: the holder check and the create it allows are one step (see _create).
        self._gpu_lock = anyio.Lock()

    async def __aenter__(self) -> DockerBackend:
        await self._images.ledger.load()
        self._engine.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the engine connection (safe to call twice)."""
        await self._engine.aclose()

    @property
    def docker(self) -> aiodocker.Docker:
        """The aiodocker client of the engine connection (a [[remote]] node's backend inspects its execs with it)."""
        return self._engine.docker

    async def health(self) -> str:
        """"" when the engine answers, else why not (status and the backend_up probe say it)."""
        try:
            with docker_errors("ping"):
                await self.docker.version()
        except BackendError as exc:
            return str(exc)
        return ""

    async def maintain(self) -> None:
        """Retry removals that failed while the engine was unreachable (called periodically by the daemon)."""
        await self._containers.maintain()

    async def recover(self) -> None:
        """Remove the containers RPCs of an earlier process of this instance left (e.g. after SIGKILL)."""
        await self._containers.recover()

    # --- images (_images.py) ------------------------------------------------------------

    async def image_owner(self, image: str) -> LedgerEntry | None:
        """The ledger's record of `image` (its owner), or None when this provider never recorded it."""
        return self._images.ledger.entry(image)

    async def claim_image(self, image: str, uid: int) -> None:
        """Record `image` as `uid`'s (kept when it already has an owner)."""
        await self._images.ledger.update("image-ledger", add=image, owner=uid)

    async def image_inspect(self, image: str) -> ImageInfo:
        """Backend.image_inspect: the config digest read on either image store (_digests.py)."""
        return await self._images.inspect(image)

    async def image_pull(self, image: str) -> None:
        """Backend.image_pull through the engine, with the credentials the entry allows for its registry."""
        await self._images.pull(image)

    async def image_push(self, image: str) -> None:
        """Backend.image_push through the engine; the tag must be held here (NotFound otherwise)."""
        await self._images.push(image)

    async def image_tag(self, source: str, target: str) -> None:
        """Backend.image_tag: `source` resolved to its exact image first, so a tag never follows a moving name."""
        await self._images.tag(source, target)

    async def image_remove(self, image: str) -> None:
        """Backend.image_remove: with a ledger, only references this provider recorded."""
        await self._images.remove(image)

    async def image_build(self, build: ImageBuild, *, owner: Owner | None = None,
                          remote_sources: bool = True) -> None:
        """Build `build.tag`; the context directories are read as `owner` (None: the daemon itself);
        `remote_sources` False: no base image's ONBUILD trigger may have the engine fetch a URL."""
        await self._images.build(build, owner=owner, remote_sources=remote_sources)

    # --- workloads -------------------------------------------------------------------

    async def gpu_holders(self) -> list[GpuHolder]:
        """Managed containers holding GPUs ([gpus] exclusive): any state but exited or dead, any session."""
        return await self._containers.gpu_holders()

    async def _realise(self, spec: WorkloadSpec, image: dict[str, Any], *, exclusive: bool,
                       capabilities: tuple[str, ...] | None) -> Realisation:
        """`gpus` and `privileged` as this host allows ([gpus], [runtime] privileged; see _gpus.py)."""

        async def engine_info() -> dict[str, Any]:
            return await self._engine.info("workload-run")

        async def rejects(caps: list[str]) -> str:
            body: dict[str, Any] = {"Image": CAPABILITY_PROBE_IMAGE, "HostConfig": {"CapAdd": caps}}
            try:  # an invalid reference: the engine answers an error and creates nothing
                with docker_errors("workload-run"):
                    created = await self.docker.containers.create(body)
            except EngineRejected as exc:  # DockerContainerError is a DockerError: docker_errors maps it
                if exc.status >= 500:
                    raise  # the engine failed (overloaded, restarting): no verdict on these capabilities
                return exc.detail
            await self._containers.force_remove(created.id)  # never expected; a probe must leave nothing behind
            return ""

        async def image_info(ref: str) -> dict[str, Any]:  # the run's own inspect of its image (ensure's)
            return image if ref == spec.image else await self._images.exact(ref, "workload-run")

        return await realise(spec, self._host_policy, socket_path=self._engine.socket_path,
                             engine_info=engine_info, image_info=image_info,
                             rejects=rejects, holders=self.gpu_holders if exclusive else None,
                             capabilities=capabilities)

    async def _create(self, spec: WorkloadSpec, capabilities: tuple[str, ...] | None,
                      layers: list[str], info: dict[str, Any]) -> aiodocker.containers.DockerContainer:
        """The container of `spec`, whose image `info` describes (the run's inspect of it)."""
        if CAPTURE_LABEL not in ((info.get("Config") or {}).get("Labels") or {}):
            return await self._create_exclusive(spec, capabilities, layers, info, None)
        # Another manager's capture is never mounted for this one (nor the image read for it): refused first.
        await self.captures.require_reach(spec.image, info, "workload-run", outcome="nothing was started")
        stubs = await self.captures.stubbed(spec.image, info)  # reads the image: not under the node-wide lock
        async with self.captures.lock:  # the files made, then the container that pins them: one step for gc
            captured = await self.captures.mounts(spec.image, info, stubs)
            return await self._create_exclusive(spec, capabilities, layers, info, captured)

    async def _create_exclusive(self, spec: WorkloadSpec, capabilities: tuple[str, ...] | None, layers: list[str],
                                info: dict[str, Any], captured: tuple[str, list[dict[str, Any]]] | None
                                ) -> aiodocker.containers.DockerContainer:
        if self._host_policy.gpus.exclusive and gpu_routes(spec, capabilities):
            async with self._gpu_lock:  # two creates for one GPU: the second sees the first's container
                return await self._create_now(spec, exclusive=True, capabilities=capabilities, layers=layers,
                                              info=info, captured=captured)
        return await self._create_now(spec, exclusive=False, capabilities=capabilities, layers=layers, info=info,
                                      captured=captured)

    async def _create_now(self, spec: WorkloadSpec, *, exclusive: bool, capabilities: tuple[str, ...] | None,
                          layers: list[str], info: dict[str, Any], captured: tuple[str, list[dict[str, Any]]] | None
                          ) -> aiodocker.containers.DockerContainer:
        realised = await self._realise(spec, info, exclusive=exclusive, capabilities=capabilities)
        config = container_config(spec, gpus=realised.gpus, privilege=realised.privilege,
                                  confined=capabilities is not None, image_layers=layers)
        # The image this run checked (its layers, its capture's stubs, what its GPUs need), by id: the tag moved
        # meanwhile (another manager's tag, a pull under it) must not put another image under what was checked
        # (review 2026-12-02, finding 5). The reference asked for is what workload-inspect answers.
        config["Image"] = str(info["Id"])
        config["Labels"] = {**config["Labels"], IMAGE_LABEL: spec.image}
        if captured is not None:  # the capture's files over the image's stubs; the label pins the capture
            config["HostConfig"]["Mounts"] = [*config["HostConfig"].get("Mounts", []), *captured[1]]
            config["Labels"] = {**config["Labels"], CAPTURE_LABEL: captured[0]}
        # What it holds is the backend's to say: a manager's own label of that name is dropped.
        config["Labels"] = {k: v for k, v in config["Labels"].items() if k != HELD_GPUS_LABEL}
        if realised.held:
            config["Labels"][HELD_GPUS_LABEL] = ",".join(realised.held)
        if self._containers.instance and not spec.detached and (not spec.name or spec.remove_after_exit):
            # Owned by this RPC: recover() removes it if this process dies before its cleanup ran.
            config["Labels"] = {**config["Labels"], **self._containers.ownership_labels()}
        with docker_errors("workload-run"):
            try:
                return await self.docker.containers.create(config, name=spec.name or None)
            except aiodocker.DockerError as exc:
                if exc.status != 409 or not spec.name:
                    raise
                if not await self._containers.reclaim(spec.name):
                    # The engine's text names the holder's container id: names are node-global, so whoever holds
                    # the name (another manager's workload included) gets this one answer, as on Kubernetes.
                    raise RuntimeFailed(action="workload-run",
                                        detail=f"Conflict: workload {spec.name} already exists") from exc
            return await self.docker.containers.create(config, name=spec.name)

    async def workload_run(self, spec: WorkloadSpec, *, allow_pull: bool,
                           capabilities: tuple[str, ...] | None = None) -> RuntimeResponse:
        """Run `spec`; `capabilities` (an admission profile's grant): `privileged` is exactly these."""
        if spec.name and not valid_workload_name(spec.name):
            raise RuntimeFailed(action="workload-run", detail=(
                f"invalid workload name {spec.name!r}: a name matches [a-zA-Z0-9][a-zA-Z0-9_.-]+"))
        layers, info = await self._images.ensure(spec.image, spec.pull_policy, allow_pull=allow_pull)
        container = await self._create(spec, capabilities, layers, info)
        cid = container.id
        try:
            if spec.detached:
                with docker_errors("workload-run", kind="workload", ref=spec.name):
                    await container.start()
                log.info("workload started", container_id=cid)
                return RuntimeResponse(output=f"{cid}\n".encode(), value=cid)
            frames, exit_code = await self._run_attached(cid, spec)
        except BaseException:  # failed or cancelled after create: leave nothing behind
            await self._containers.force_remove(cid)
            raise
        if spec.remove_after_exit:
            await self._containers.force_remove(cid)
        output, diagnostics = _split(frames, combined=spec.combined)
        if exit_code != 0:
            raise CommandFailed(action="workload-run", status=f"exited {exit_code}", output=_text(diagnostics))
        return RuntimeResponse(output=output)

    async def _run_attached(self, cid: str, spec: WorkloadSpec) -> tuple[list[tuple[int, bytes]], int]:
        query = {"stream": "1", "stdin": "0" if spec.input is UNSET else "1", "stdout": "1", "stderr": "1"}
        with docker_errors("workload-run", kind="workload", ref=cid):
            async with await hijack(self._engine.socket_path, f"/containers/{quote(cid, safe='')}/attach",
                                    action="workload-run", query=query) as stream:
                await self.docker.containers.container(cid).start()
                frames = await stream.communicate(_stdin(spec.input), limit=OUTPUT_LIMIT)
            result = await self.docker.containers.container(cid).wait(timeout=None)
        return frames, int(result.get("StatusCode", -1))

    async def workload_remove(self, name: str) -> None:
        """Backend.workload_remove: force-removes the managed container and its anonymous volumes."""
        info = await self._containers.find(name, "workload-remove")
        if info is None:
            return  # already absent is success: it precedes every named launch
        try:
            with docker_errors("workload-remove", kind="workload", ref=name):
                await self.docker.containers.container(info["Id"]).delete(force=True, v=True, timeout=SHORT)
        except NotFound:
            return

    async def workload_inspect(self, name: str, *, include_start_time: bool) -> WorkloadInfo:
        """Backend.workload_inspect from the managed container's engine state."""
        info = await self._containers.require(name, "workload-inspect")
        state = info.get("State") or {}
        started = state.get("StartedAt") or ""
        return WorkloadInfo(
            id=info["Id"],
            image=labels(info).get(IMAGE_LABEL) or (info.get("Config") or {}).get("Image") or "",
            state=state.get("Status") or "",
            exit_code=int(state.get("ExitCode") or 0),
            running=bool(state.get("Running")),
            paused=bool(state.get("Paused")),
            labels=labels(info),
            started_at=started if include_start_time and started and started != _ZERO_TIME else UNSET,
        )

    async def workload_list(self) -> list[tuple[str, WorkloadInfo]]:
        """Every workload this provider manages, by name (containers carrying the managed label)."""
        listed = []
        for container in await self._containers.labelled("workload-list", f"{MANAGED_LABEL}=true"):
            name = str((container["Names"] or ["/"])[0]).lstrip("/")
            try:
                listed.append((name, await self.workload_inspect(name, include_start_time=True)))
            except NotFound:
                continue  # removed meanwhile
        return sorted(listed, key=lambda item: item[0])

    async def workload_stop(self, name: str, *, timeout_s: float) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (the engine's stop); the container is kept."""
        info = await self._containers.require(name, "workload-stop")
        with docker_errors("workload-stop", kind="workload", ref=name):
            await self.docker.containers.container(info["Id"]).stop(
                t=max(0, round(timeout_s)), timeout=aiohttp.ClientTimeout(total=timeout_s + 30))

    async def workload_exec(self, name: str, execution: Execution) -> bytes:
        """Backend.workload_exec over a hijacked exec stream; the engine keeps an abandoned exec, so a cancelled one
        is killed here."""
        info = await self._containers.require(name, "workload-exec")
        with docker_errors("workload-exec", kind="workload", ref=name):
            created = await self.docker.containers.container(info["Id"]).exec(
                list(execution.command), stdin=execution.input is not UNSET, user=execution.user)
            try:
                async with await hijack(self._engine.socket_path, f"/exec/{quote(created.id, safe='')}/start",
                                        action="workload-exec", body={"Detach": False, "Tty": False}) as stream:
                    frames = await stream.communicate(_stdin(execution.input), limit=OUTPUT_LIMIT)
            except BaseException:
                await self._kill_exec(created.id)
                raise
            result = await self.docker.containers.exec(created.id).inspect()
        output, diagnostics = _split(frames, combined=execution.combined)
        exit_code = result.get("ExitCode")
        if exit_code != 0:
            raise CommandFailed(action="workload-exec", status=f"exited {exit_code}", output=_text(diagnostics))
        return output

    async def _kill_exec(self, exec_id: str) -> None:
        """The engine keeps an exec running after its client leaves: stop it ourselves."""
        with anyio.move_on_after(CLEANUP_BUDGET_S, shield=True):
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
        """Backend.workload_logs, demultiplexed from the engine's log stream, bounded while it is read."""
        info = await self._containers.require(name, "workload-logs")
        params = {"stdout": "1", "stderr": "1", "tail": str(tail) if tail else "all"}
        buffer = bytearray()
        chunks: list[bytes] = []
        total = 0  # a running total: summing the chunks on every read was quadratic
        with docker_errors("workload-logs", kind="workload", ref=name):
            async with self._engine.stream(f"containers/{quote(info['Id'], safe='')}/logs", params=params) as response:
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
        """Backend.workload_copy_from: the engine's archive spooled (sparse, capped), extracted as `owner` by
        _archive.py."""
        info = await self._containers.require(name, "workload-copy-from")
        await copy_out(self._engine, info["Id"], name=name, path=path, destination=destination, owner=owner,
                       spool_dir=self._spool_dir, max_bytes=self._copy_max_bytes)

"""The Docker Engine backend (aiodocker over the engine's Unix socket; never the CLI).

aiodocker errors are translated in exactly one place, :func:`docker_errors`. Containers
keep the protocol's lifetimes: a named workload that started is a manager key and is
removed only by ``workload-remove``; a run that fails or is cancelled after its
container was created removes that container under a shielded, bounded cleanup.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp
import anyio
import anyio.to_thread
import structlog
from msgspec import UNSET, UnsetType

from ..errors import BackendError, BackendUnavailable, NotFound, OutputTooLarge, PathNotFound, RuntimeFailed
from ..schema import Execution, ImageBuild, ImageInfo, RuntimeResponse, WorkloadInfo, WorkloadSpec
from ._archive import CopyError, extract_copy
from ._buildctx import DOCKERFILE_PATH, BuildContextError, base_images, rewrite_dockerfile, write_context_tar
from ._hijack import HijackError, hijack
from ._translate import (
    MANAGED_LABEL,
    container_config,
    demux,
    encode_registry_auth,
    image_matches,
    parse_reference,
    registry_auth,
)

__all__ = ("DockerBackend", "docker_errors")

log = structlog.get_logger(__name__)

# Raw output kept for one reply: base64 grows 4/3 and the wire cap is 64 MiB.
OUTPUT_LIMIT = 46 << 20
_DIAGNOSTIC_BYTES = 16 << 10
_CLEANUP_BUDGET_S = 30.0
_SHORT = aiohttp.ClientTimeout(total=120)
_UNBOUNDED = aiohttp.ClientTimeout()
_ZERO_TIME = "0001-01-01T00:00:00Z"


@contextmanager
def docker_errors(action: str, *, kind: str = "", ref: str = "") -> Iterator[None]:
    """The one place engine errors become ours."""
    try:
        yield
    except (aiodocker.DockerError, HijackError) as exc:
        status = exc.status
        message = str(getattr(exc, "message", exc))
        if status == 404 and kind:
            raise NotFound(kind=kind, ref=ref, action=action) from exc
        if status == 900:  # aiodocker's "cannot connect"
            raise BackendUnavailable(action=action, detail=message) from exc
        raise RuntimeFailed(action=action, detail=message) from exc
    except aiohttp.ClientConnectionError as exc:
        raise BackendUnavailable(action=action, detail=str(exc) or type(exc).__name__) from exc
    except TimeoutError as exc:
        raise RuntimeFailed(action=action, detail="the container engine did not answer in time") from exc
    except OverflowError as exc:
        raise OutputTooLarge(action=action, limit=OUTPUT_LIMIT) from exc
    except OSError as exc:
        raise BackendUnavailable(action=action, detail=exc.strerror or str(exc)) from exc


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
    """runtime-v1 on one Docker Engine. An async context manager; ``aclose()`` is idempotent."""

    def __init__(self, *, url: str = "unix:///var/run/docker.sock", credentials_file: str | None = None,
                 spool_dir: str | None = None) -> None:
        if not url.startswith("unix://"):
            raise ValueError(f"docker.url must be a unix:// socket, got {url!r}")
        self._url = url
        self._socket_path = url[len("unix://"):]
        self._credentials_file = credentials_file
        self._spool_dir = spool_dir
        self._docker: aiodocker.Docker | None = None
        # Containers whose removal failed (engine down or restarting): retried by maintain().
        self._pending_removal: set[str] = set()

    async def __aenter__(self) -> DockerBackend:
        self._docker = aiodocker.Docker(url=self._url, api_version="v1.41")
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
                await self.docker._query_json("version", timeout=_SHORT)
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
            raise RuntimeFailed(action="registry", detail=f"credentials file unusable: {exc}") from None
        return data if isinstance(data, dict) else {}

    def _auth_header(self, registry: str) -> dict[str, str]:
        return {"X-Registry-Auth": encode_registry_auth(registry_auth(self._credentials(), registry))}

    # --- streaming responses ---------------------------------------------------------

    @asynccontextmanager
    async def _stream(self, path: str, *, method: str = "GET", params: dict[str, str] | None = None,
                      headers: dict[str, str] | None = None, data: Any = None
                      ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A streaming engine response whose connection is always closed on exit.

        aiodocker leaves finalisation to the caller; closing is what tells the engine a
        cancelled client is gone (it then cancels the pull or build it was running).
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
        return ImageInfo(id=info["Id"], repo_digests=list(info.get("RepoDigests") or []),
                         size=int(info.get("Size") or 0))

    async def image_pull(self, image: str) -> None:
        ref = parse_reference(image)
        if ref is None:
            raise RuntimeFailed(action="image-pull", detail=f"local-only image {image} must already be resident")
        await self._progress("image-pull", "images/create",
                             params={"fromImage": ref.repository, "tag": ref.pull_tag},
                             headers=self._auth_header(ref.registry), kind="image", ref=image)

    async def image_push(self, image: str) -> None:
        ref = parse_reference(image)
        if ref is None or ref.digest:
            raise RuntimeFailed(action="image-push", detail=f"{image} is not a tag; only tags can be pushed")
        await self._image(image, "image-push")
        await self._progress("image-push", f"images/{ref.repository}/push", params={"tag": ref.pull_tag},
                             headers=self._auth_header(ref.registry), kind="image", ref=image)

    async def image_tag(self, source: str, target: str) -> None:
        ref = parse_reference(target)
        if ref is None or ref.digest:
            raise RuntimeFailed(action="image-tag", detail=f"target {target} must be repository[:tag]")
        info = await self._image(source, "image-tag")
        with docker_errors("image-tag", kind="image", ref=source):
            await self.docker.images.tag(info["Id"], ref.repository, tag=ref.pull_tag)

    async def image_remove(self, image: str) -> None:
        await self._image(image, "image-remove")
        with docker_errors("image-remove", kind="image", ref=image):
            # Exactly this reference: no force, and never prune untagged parents.
            await self.docker.images.delete(image, force=False, noprune=True)

    async def image_build(self, build: ImageBuild) -> None:
        headers = {"Content-Type": "application/x-tar"}
        credentials = self._credentials()
        auths = {registry: entry for registry in (credentials.get("auths") or {})
                 if (entry := registry_auth(credentials, registry))}
        if auths:
            headers["X-Registry-Config"] = base64.urlsafe_b64encode(json.dumps(auths).encode()).decode()
        if not build.pull:
            await self._require_local_bases(build)
        params = {"t": build.tag, "dockerfile": DOCKERFILE_PATH, "rm": "1", "forcerm": "1",
                  "pull": "1" if build.pull else "0", "buildargs": json.dumps(dict(build.arguments))}
        with tempfile.TemporaryFile(dir=self._spool_dir, prefix="coldsnap-build-") as spool:
            try:
                await anyio.to_thread.run_sync(lambda: write_context_tar(
                    spool, context=build.context, contexts=dict(build.contexts), dockerfile=build.dockerfile))
            except (BuildContextError, OSError, UnicodeDecodeError) as exc:
                raise RuntimeFailed(action="image-build", detail=str(exc)) from None
            spool.seek(0)
            await self._progress("image-build", "build", params=params, headers=headers, data=spool)

    async def _require_local_bases(self, build: ImageBuild) -> None:
        """pull=false must never contact a registry, but the classic builder pulls a missing base."""
        try:
            text = rewrite_dockerfile(build.dockerfile.decode("utf-8"), dict(build.contexts))
        except (BuildContextError, UnicodeDecodeError) as exc:
            raise RuntimeFailed(action="image-build", detail=str(exc)) from None
        for base in base_images(text, dict(build.arguments)):
            try:
                await self._image(base, "image-build")
            except NotFound:
                raise RuntimeFailed(action="image-build", detail=(
                    f"base image {base} is not resident and pull is false (no registry is contacted)")) from None

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

    async def _find(self, name: str, action: str) -> dict[str, Any] | None:
        """The managed container named exactly `name` (or with that full id), else None."""
        try:
            with docker_errors(action, kind="workload", ref=name):
                info: dict[str, Any] = await self.docker._query_json(f"containers/{name}/json", timeout=_SHORT)
        except NotFound:
            return None
        if info.get("Name") != "/" + name and info.get("Id") != name:
            return None  # the engine matched an id prefix or another name: not this workload
        if (info.get("Config", {}).get("Labels") or {}).get(MANAGED_LABEL) != "true":
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
                    await self.docker._query_json(f"containers/{container_id}", method="DELETE",
                                                  params={"force": "1", "v": "1"}, timeout=_SHORT)
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

    async def workload_run(self, spec: WorkloadSpec, *, allow_pull: bool) -> RuntimeResponse:
        await self._ensure_image(spec.image, spec.pull_policy, allow_pull=allow_pull)
        with docker_errors("workload-run"):
            container = await self.docker.containers.create(container_config(spec), name=spec.name or None)
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
            async with await hijack(self._socket_path, f"/containers/{cid}/attach", query=query) as stream:
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
                await self.docker._query_json(f"containers/{info['Id']}", method="DELETE",
                                              params={"force": "1", "v": "1"}, timeout=_SHORT)
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
            labels=dict((info.get("Config") or {}).get("Labels") or {}),
            started_at=started if include_start_time and started and started != _ZERO_TIME else UNSET,
        )

    async def workload_exec(self, name: str, execution: Execution) -> bytes:
        info = await self._require(name, "workload-exec")
        body = {"AttachStdin": execution.input is not UNSET, "AttachStdout": True, "AttachStderr": True, "Tty": False,
                "Cmd": list(execution.command), "User": execution.user}
        with docker_errors("workload-exec", kind="workload", ref=name):
            created = await self.docker._query_json(f"containers/{info['Id']}/exec", method="POST",
                                                    data=json.dumps(body), timeout=_SHORT)
            exec_id = created["Id"]
            try:
                async with await hijack(self._socket_path, f"/exec/{exec_id}/start",
                                        body={"Detach": False, "Tty": False}) as stream:
                    frames = await stream.communicate(_stdin(execution.input), limit=OUTPUT_LIMIT)
            except BaseException:
                await self._kill_exec(exec_id)
                raise
            result = await self.docker._query_json(f"exec/{exec_id}/json", timeout=_SHORT)
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
                    state = await self.docker._query_json(f"exec/{exec_id}/json", timeout=_SHORT)
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
        with docker_errors("workload-logs", kind="workload", ref=name):
            async with self._stream(f"containers/{info['Id']}/logs", params=params) as response:
                async for data in response.content.iter_any():
                    buffer += data
                    chunks.extend(payload for _, payload in demux(buffer))
                    if sum(map(len, chunks)) > OUTPUT_LIMIT:
                        raise OverflowError(OUTPUT_LIMIT)
        return b"".join(chunks)

    async def workload_copy_from(self, name: str, path: str, destination: str) -> None:
        info = await self._require(name, "workload-copy-from")
        action = "workload-copy-from"
        parent = os.path.dirname(destination) or "/"
        if not os.path.isdir(parent):
            raise RuntimeFailed(action=action, detail=f"destination directory {parent} does not exist")
        try:
            spool = tempfile.TemporaryFile(dir=parent, prefix=".coldsnap-copy-")  # noqa: SIM115 - closed below
        except OSError as exc:
            raise RuntimeFailed(action=action, detail=f"cannot write under {parent}: {exc.strerror}") from None
        with spool:
            try:
                with docker_errors(action, kind="path", ref=path):
                    async with self._stream(f"containers/{info['Id']}/archive", params={"path": path}) as response:
                        stat = json.loads(base64.b64decode(
                            response.headers.get("X-Docker-Container-Path-Stat", "") or "e30="))
                        async for data in response.content.iter_chunked(1 << 20):
                            await anyio.to_thread.run_sync(spool.write, data)
            except NotFound:
                raise PathNotFound(workload=name, path=path, action=action) from None
            spool.seek(0)
            root = str(stat.get("name") or os.path.basename(path))
            try:
                await anyio.to_thread.run_sync(extract_copy, spool, root, destination)
            except (CopyError, OSError) as exc:
                raise RuntimeFailed(action=action, detail=str(exc)) from None


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

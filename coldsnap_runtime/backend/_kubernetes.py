"""The Kubernetes backend: runtime-v1 on one Node of a cluster, through the apiserver (kubernetes_asyncio).

One :class:`KubernetesBackend` serves one ColdSnap host = one Node. A workload is a Pod pinned to that
Node (``spec.nodeName``) in the configured namespace; its translation is ``_k8s_translate.py``. Only the
stable core/v1 API is used: Pods, ``pods/log``, ``pods/exec`` and a Node read.

Errors: kubernetes_asyncio, aiohttp and socket errors become ours in one place, ``_k8s_client.kube_errors``;
every apiserver call runs under ``request_timeout_s``, so an apiserver that is down or slow gives a
clear ``runtime_failed`` within that bound. Nothing of a credential reaches an error or a log: messages
are built from the HTTP status and the apiserver's own ``Status.message`` only.

Lifetimes are the Docker backend's: a named workload that started is a manager key removed only by
``workload-remove``; a run that fails or is cancelled after its Pod was created deletes that Pod
(shielded, bounded) and waits until it is gone. Pods carry this process's incarnation label, so a Pod
name held by someone else (a Pod the provider does not manage, or another workload) is refused and
never adopted or deleted.

Exec speaks the apiserver's channel protocol over a WebSocket: ``v5.channel.k8s.io`` where the cluster
has it (Kubernetes 1.30+: stdin can be closed, so ``input`` works), else ``v4.channel.k8s.io``, which
cannot signal the end of stdin, so an exec with ``input`` is refused on such clusters before anything
runs. Frames are bytes (channel byte + payload): binary-safe both ways.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import IO, Any

import aiohttp
import anyio
import anyio.to_thread
import structlog
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config
from msgspec import UNSET

from ..errors import BackendError, CommandFailed, NotFound, OutputTooLarge, PathNotFound, RuntimeFailed
from ..limits import CLEANUP_BUDGET_S, OUTPUT_LIMIT
from ..schema import Execution, ImageBuild, ImageInfo, RuntimeResponse, WorkloadInfo, WorkloadSpec
from ._base import Owner
from ._copy import extract_archive
from ._k8s_client import (
    CHANNEL_CLOSE,
    CHANNEL_ERROR,
    CHANNEL_STDERR,
    CHANNEL_STDIN,
    CHANNEL_STDOUT,
    V5,
    ChannelClient,
    diagnostic_text,
    exec_exit_code,
    exec_status,
    kube_errors,
    status_error,
)
from ._k8s_translate import (
    CONTAINER,
    REMOVE_AFTER_EXIT_LABEL,
    pod_failure,
    pod_manifest,
    pod_name,
    workload_info,
    workload_name,
)
from ._ledger import LedgerEntry
from ._translate import MANAGED_LABEL

__all__ = ("INCARNATION_LABEL", "INSTANCE_LABEL", "KubernetesBackend")

log = structlog.get_logger(__name__)

INSTANCE_LABEL = "io.coldsnap-provider.instance"
INCARNATION_LABEL = "io.coldsnap-provider.incarnation"
_POLL_S = 0.2
# The kubelet's default --node-status-max-images: a Node listing that many may have more.
_NODE_STATUS_MAX_IMAGES = 50


class KubernetesBackend:
    """runtime-v1 on the Node `node` of the cluster `kubeconfig` names; ``aclose()`` is idempotent.

    `instance` names this daemon instance (stable across restarts): Pods an RPC owns carry it, and
    :meth:`recover` deletes what an earlier process of the instance left. `spool_dir` holds copy-from's
    archive before extraction.
    """

    def __init__(self, *, kubeconfig: str, namespace: str, node: str, instance: str = "",
                 request_timeout_s: float = 30.0, start_timeout_s: float = 120.0,
                 spool_dir: str | None = None, copy_max_bytes: int | None = None) -> None:
        self._kubeconfig = kubeconfig
        self._namespace = namespace
        self._node = node
        self._instance = instance
        self._request_timeout_s = request_timeout_s
        self._start_timeout_s = start_timeout_s
        self._spool_dir = spool_dir
        self._copy_max_bytes = copy_max_bytes
        self._incarnation = secrets.token_hex(8)
        self._api: k8s.ApiClient | None = None
        self._ws: ChannelClient | None = None
        self._pending_removal: set[str] = set()
        # Whether the apiserver speaks v5.channel.k8s.io (1.30+), read once: exec `input` needs it.
        self._closes_stdin: bool | None = None

    @property
    def node_name(self) -> str:
        """The Node this backend's workloads are pinned to (spec.nodeName)."""
        return self._node

    @property
    def namespace(self) -> str:
        """The namespace its Pods live in."""
        return self._namespace

    async def __aenter__(self) -> KubernetesBackend:
        configuration = k8s.Configuration()
        with kube_errors("start-up"):
            await k8s_config.load_kube_config(config_file=self._kubeconfig, client_configuration=configuration,
                                              persist_config=False)
        self._api = k8s.ApiClient(configuration=configuration)
        self._ws = ChannelClient(configuration=configuration)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the apiserver client and the exec channel client (safe twice)."""
        api, ws, self._api, self._ws = self._api, self._ws, None, None
        with anyio.CancelScope(shield=True):
            for one in (api, ws):
                if one is not None:
                    await one.close()

    @property
    def _core(self) -> Any:
        """core/v1, always called with ``_preload_content=False`` (raw responses: the generated types
        describe the parsed models only, hence Any)."""
        if self._api is None:
            raise anyio.ClosedResourceError
        return k8s.CoreV1Api(self._api)

    # --- one apiserver call ---------------------------------------------------------

    async def _call(self, action: str, call: Awaitable[Any], *, kind: str = "", ref: str = "") -> dict[str, Any]:
        """Await one core/v1 call made with ``_preload_content=False``; its JSON body, or our error."""
        with kube_errors(action, kind=kind, ref=ref):
            with anyio.fail_after(self._request_timeout_s):
                response = await call
                try:
                    body = await response.read()
                finally:
                    response.release()
            if not 200 <= response.status <= 299:
                raise status_error(action, response.status, body, kind=kind, ref=ref)
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise RuntimeFailed(action=action, detail="the apiserver answered with something not JSON") from exc
        return data if isinstance(data, dict) else {}

    async def health(self) -> str:
        """"" when the apiserver answers /version, else why not (status and the backend_up probe say it)."""
        try:
            await self._call("ping", k8s.VersionApi(self._api).get_code(_preload_content=False))
        except BackendError as exc:
            return str(exc)
        except anyio.ClosedResourceError:
            return "the Kubernetes client is closed"
        return ""

    async def _read_pod(self, pod: str, action: str, *, ref: str) -> dict[str, Any]:
        return await self._call(action, self._core.read_namespaced_pod(pod, self._namespace, _preload_content=False),
                                kind="workload", ref=ref)

    # --- finding a workload ------------------------------------------------------------

    async def _find(self, name: str, action: str) -> dict[str, Any] | None:
        """The managed Pod of workload `name` on this node, else None; a foreign Pod of that name is refused."""
        try:
            pod = await self._read_pod(pod_name(name, self._node), action, ref=name)
        except NotFound:
            return None
        self._check_ours(pod, name, action)
        return pod

    def _check_ours(self, pod: dict[str, Any], name: str, action: str) -> None:
        metadata = pod.get("metadata") or {}
        if (metadata.get("labels") or {}).get(MANAGED_LABEL) != "true" or workload_name(pod) != name \
                or (pod.get("spec") or {}).get("nodeName") != self._node:
            raise RuntimeFailed(action=action, detail=(
                f"Pod {metadata.get('name')} in namespace {self._namespace} exists but is not coldsnap-provider's "
                f"workload {name} on node {self._node}; refusing to touch it"))

    async def _require(self, name: str, action: str) -> dict[str, Any]:
        pod = await self._find(name, action)
        if pod is None:
            raise NotFound(kind="workload", ref=name, action=action)
        return pod

    # --- images: what the apiserver allows ------------------------------------------------

    async def image_inspect(self, image: str) -> ImageInfo:
        """Backend.image_inspect as far as the Node's status tells: NotFound when the Node does not list `image`;
        RuntimeFailed when it does (the apiserver never gives the config digest)."""
        node = await self._call("image-inspect", self._core.read_node(self._node, _preload_content=False),
                                kind="node", ref=self._node)
        images = (node.get("status") or {}).get("images") or []
        listed = {n for entry in images for n in entry.get("names") or []}
        if not {image, f"docker.io/{image}", f"docker.io/library/{image}"} & listed:
            if len(images) >= _NODE_STATUS_MAX_IMAGES:  # the kubelet reports only the largest ones
                raise RuntimeFailed(action="image-inspect", detail=(
                    f"node {self._node} reports only {len(images)} of its images; whether it has {image} is unknown"))
            raise NotFound(kind="image", ref=image, action="image-inspect")
        raise RuntimeFailed(action="image-inspect", detail=(
            f"{image} is on node {self._node}, but the Kubernetes API lists a node's images by name and size "
            "only, never by the OCI config digest runtime-v1's `id` must be; inspect it on the node"))

    async def image_pull(self, image: str) -> None:
        """Refused (RuntimeFailed): the apiserver has no image API; workload-run pulls per its pull_policy."""
        raise RuntimeFailed(action="image-pull", detail=_NO_IMAGE_API + "; workload-run pulls per its pull_policy "
                                                                        "(imagePullPolicy) when the session may pull")

    async def image_push(self, image: str) -> None:
        """Refused (RuntimeFailed): the apiserver has no image API."""
        raise RuntimeFailed(action="image-push", detail=_NO_IMAGE_API)

    async def image_tag(self, source: str, target: str) -> None:
        """Refused (RuntimeFailed): the apiserver has no image API."""
        raise RuntimeFailed(action="image-tag", detail=_NO_IMAGE_API)

    async def image_remove(self, image: str) -> None:
        """Refused (RuntimeFailed): the kubelet's image garbage collection removes unused images."""
        raise RuntimeFailed(action="image-remove", detail=_NO_IMAGE_API + " (the kubelet's image GC removes "
                                                                          "unused images)")

    async def image_build(self, build: ImageBuild, *, owner: Owner | None = None,
                          remote_sources: bool = True) -> None:
        """Refused (RuntimeFailed): build on a Docker host and push to a registry the Node pulls from."""
        raise RuntimeFailed(action="image-build", detail=_NO_IMAGE_API + "; build on a Docker host and push "
                                                                         "to a registry the node pulls from")

    # --- workloads -----------------------------------------------------------------------

    async def image_owner(self, image: str) -> LedgerEntry | None:
        """No image ledger: the provider writes no images on a Kubernetes node (image writes are refused)."""
        return None

    async def claim_image(self, image: str, uid: int) -> None:
        """Nothing to claim: a pull the kubelet makes for a workload-run is the node's, not a ledger entry."""

    async def workload_run(self, spec: WorkloadSpec, *, allow_pull: bool,
                           capabilities: tuple[str, ...] | None = None) -> RuntimeResponse:
        """Run `spec` as a Pod; `capabilities` (an admission profile's grant): `privileged` is exactly these."""
        pod = pod_name(spec.name, self._node)
        extra = {INCARNATION_LABEL: self._incarnation, **({INSTANCE_LABEL: self._instance} if self._instance else {})}
        manifest = pod_manifest(spec, pod=pod, namespace=self._namespace, node=self._node, allow_pull=allow_pull,
                                extra_labels=extra, capabilities=capabilities)
        await self._call("workload-run", self._core.read_node(self._node, _preload_content=False),
                         kind="node", ref=self._node)
        try:
            created = await self._call("workload-run", self._core.create_namespaced_pod(
                self._namespace, manifest, _preload_content=False))
        except RuntimeFailed as exc:
            if "already exists" in exc.detail:
                raise await self._conflict(spec.name, pod) from exc
            await self._delete_own(pod)  # a create that timed out may still have happened
            raise
        except BaseException:
            await self._delete_own(pod)
            raise
        uid = str((created.get("metadata") or {}).get("uid") or "")
        try:
            if spec.detached:
                await self._wait_started(pod, spec.name)
                log.info("workload started", container_id=uid)
                return RuntimeResponse(output=f"{uid}\n".encode(), value=uid)
            output, exit_code = await self._run_attached(pod, spec.name or pod)
        except BaseException:  # failed or cancelled after create: leave nothing behind
            await self._delete_own(pod)
            raise
        if not spec.name or spec.remove_after_exit:
            await self._delete_own(pod)
        if exit_code != 0:
            raise CommandFailed(action="workload-run", status=f"exited {exit_code}", output=diagnostic_text(output))
        return RuntimeResponse(output=output)

    async def _conflict(self, name: str, pod: str) -> RuntimeFailed:
        """Why a create found the Pod name taken (never adopted, never deleted)."""
        try:
            existing = await self._read_pod(pod, "workload-run", ref=name)
        except BackendError:
            existing = {}
        if (existing.get("metadata") or {}).get("labels", {}).get(MANAGED_LABEL) != "true" \
                or workload_name(existing) != name:
            return RuntimeFailed(action="workload-run", detail=(
                f"Pod {pod} in namespace {self._namespace} already exists and is not coldsnap-provider's workload "
                f"{name}; refusing to adopt or delete it"))
        return RuntimeFailed(action="workload-run", detail=f"Conflict: workload {name} already exists (Pod {pod})")

    async def _wait_started(self, pod: str, name: str) -> None:
        """Until the container runs (or ran); a Pod the kubelet will not start is an error naming why."""
        with anyio.move_on_after(self._start_timeout_s) as scope:
            while True:
                current = await self._read_pod(pod, "workload-run", ref=name)
                if reason := pod_failure(current):
                    raise RuntimeFailed(action="workload-run", detail=f"the kubelet did not start Pod {pod}: {reason}")
                state = workload_info(current, include_start_time=False).state
                if state in ("running", "exited"):
                    return
                await anyio.sleep(_POLL_S)
        if scope.cancelled_caught:
            raise RuntimeFailed(action="workload-run", detail=(
                f"Pod {pod} did not start within {self._start_timeout_s:g}s on node {self._node}"))

    async def _run_attached(self, pod: str, name: str) -> tuple[bytes, int]:
        """Wait for the container to end (no deadline: probes run for minutes); its combined output and exit code."""
        while True:
            try:
                current = await self._read_pod(pod, "workload-run", ref=name)
            except NotFound as exc:
                raise RuntimeFailed(action="workload-run",
                                    detail=f"Pod {pod} was deleted while the run waited") from exc
            if reason := pod_failure(current):
                raise RuntimeFailed(action="workload-run", detail=f"the kubelet did not run Pod {pod}: {reason}")
            info = workload_info(current, include_start_time=False)
            if info.state == "exited":
                return await self._logs(pod, name, tail=0, action="workload-run"), info.exit_code
            await anyio.sleep(_POLL_S)

    async def _delete(self, current: dict[str, Any], *, action: str, ref: str) -> None:
        """Delete exactly this Pod (its uid); return once nothing of it runs and the apiserver dropped it.

        A Pod whose container runs is first deleted with 1 s of grace (SIGTERM, then SIGKILL by the kubelet)
        until its container is no longer running, then with grace 0: the object goes at once. Grace 0 alone
        would drop the object while the kubelet still runs the container; grace alone waits for the kubelet's
        whole teardown (volumes, sandbox, cgroups), about ten seconds on the test cluster.
        """
        metadata = current.get("metadata") or {}
        pod, uid = str(metadata.get("name") or ""), metadata.get("uid")
        with anyio.fail_after(self._request_timeout_s + CLEANUP_BUDGET_S):
            if workload_info(current, include_start_time=False).running:
                if not await self._delete_call(pod, uid, grace=1, action=action, ref=ref):
                    return
                while (again := await self._current(pod, uid, action, ref)) is not None:
                    if not workload_info(again, include_start_time=False).running:
                        break
                    await anyio.sleep(_POLL_S)
                else:
                    return
            if not await self._delete_call(pod, uid, grace=0, action=action, ref=ref):
                return
            while await self._current(pod, uid, action, ref) is not None:
                await anyio.sleep(_POLL_S)

    async def _delete_call(self, pod: str, uid: Any, *, grace: int, action: str, ref: str) -> bool:
        """One delete of exactly `uid`; False when it is already gone."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": grace,
                "preconditions": {"uid": uid}}
        try:
            await self._call(action, self._core.delete_namespaced_pod(pod, self._namespace, body=body,
                                                                      _preload_content=False), kind="workload", ref=ref)
        except NotFound:
            return False
        return True

    async def _current(self, pod: str, uid: Any, action: str, ref: str) -> dict[str, Any] | None:
        """The Pod `pod` if it still is the one with `uid`, else None."""
        try:
            again = await self._read_pod(pod, action, ref=ref)
        except NotFound:
            return None
        return again if (again.get("metadata") or {}).get("uid") == uid else None

    async def _delete_own(self, pod: str) -> None:
        """Remove a Pod this process created (checked by its incarnation label); retried by maintain() on failure."""
        with anyio.move_on_after(CLEANUP_BUDGET_S, shield=True) as scope:
            try:
                current = await self._read_pod(pod, "cleanup", ref=pod)
                if ((current.get("metadata") or {}).get("labels") or {}).get(INCARNATION_LABEL) != self._incarnation:
                    return  # not ours (another process's, or someone else's): never touched
                await self._delete(current, action="cleanup", ref=pod)
                self._pending_removal.discard(pod)
                return
            except NotFound:
                self._pending_removal.discard(pod)
                return
            except (BackendError, TimeoutError) as exc:
                log.warning("cleanup failed; will retry", container_id=pod, error=str(exc))
        if scope.cancelled_caught:
            log.error("cleanup timed out; will retry", container_id=pod)
        self._pending_removal.add(pod)

    async def workload_remove(self, name: str) -> None:
        """Backend.workload_remove: deletes exactly the workload's Pod (by uid) and waits until nothing of it runs."""
        pod = await self._find(name, "workload-remove")
        if pod is None:
            return  # already absent is success: it precedes every named launch
        try:
            await self._delete(pod, action="workload-remove", ref=name)
        except TimeoutError as exc:
            raise RuntimeFailed(action="workload-remove", detail=f"Pod of {name} still present after deletion") from exc

    async def workload_inspect(self, name: str, *, include_start_time: bool) -> WorkloadInfo:
        """Backend.workload_inspect from the managed Pod's status."""
        return workload_info(await self._require(name, "workload-inspect"), include_start_time=include_start_time)

    async def _managed_pods(self, action: str, selector: str = "") -> list[dict[str, Any]]:
        listed = await self._call(action, self._core.list_namespaced_pod(
            self._namespace, label_selector=",".join(s for s in (f"{MANAGED_LABEL}=true", selector) if s),
            field_selector=f"spec.nodeName={self._node}", _preload_content=False))
        return list(listed.get("items") or [])

    async def workload_list(self) -> list[tuple[str, WorkloadInfo]]:
        """Every named workload this provider manages on this node."""
        pods = await self._managed_pods("workload-list")
        return sorted(((workload_name(p), workload_info(p, include_start_time=True)) for p in pods
                       if workload_name(p)), key=lambda item: item[0])

    async def workload_stop(self, name: str, *, timeout_s: float) -> None:
        """Refused (RuntimeFailed) for an existing workload: a Pod cannot be stopped and kept."""
        await self._require(name, "workload-stop")
        raise RuntimeFailed(action="workload-stop", detail=(
            "a Pod's container cannot be stopped and kept on Kubernetes (restartPolicy Never ends it only by "
            "deletion); remove the workload instead"))

    async def workload_logs(self, name: str, *, tail: int) -> bytes:
        """Backend.workload_logs through pods/log, bounded while it is read."""
        pod = await self._require(name, "workload-logs")
        return await self._logs(str(pod["metadata"]["name"]), name, tail=tail, action="workload-logs")

    async def _logs(self, pod: str, name: str, *, tail: int, action: str) -> bytes:
        kwargs: dict[str, Any] = {"container": CONTAINER, "_preload_content": False}
        if tail:
            kwargs["tail_lines"] = tail
        chunks: list[bytes] = []
        total = 0
        with kube_errors(action, kind="workload", ref=name):
            with anyio.fail_after(self._request_timeout_s):
                response = await self._core.read_namespaced_pod_log(pod, self._namespace, **kwargs)
            try:
                if not 200 <= response.status <= 299:
                    raise status_error(action, response.status, await response.read(), kind="workload", ref=name)
                async for data in response.content.iter_any():
                    chunks.append(data)
                    total += len(data)
                    if total > OUTPUT_LIMIT:
                        raise OutputTooLarge(action=action, limit=OUTPUT_LIMIT)
            finally:
                response.release()
        return b"".join(chunks)

    # --- exec and copy-from -----------------------------------------------------------------

    async def workload_exec(self, name: str, execution: Execution) -> bytes:
        """Backend.workload_exec through pods/exec; the exit code comes from the status channel."""
        if execution.user:
            raise RuntimeFailed(action="workload-exec", detail=(
                "`user` cannot be realised on Kubernetes: an exec runs as the container's user"))
        pod = await self._require(name, "workload-exec")
        stdin = b"" if execution.input is UNSET else execution.input
        stdout, stderr, exit_code = await self._exec(str(pod["metadata"]["name"]), name, list(execution.command),
                                                     stdin=stdin if isinstance(stdin, bytes) else b"",
                                                     action="workload-exec")
        if exit_code != 0:
            both = stdout + stderr if execution.combined else stderr
            raise CommandFailed(action="workload-exec", status=f"exited {exit_code}", output=diagnostic_text(both))
        return stdout + stderr if execution.combined else stdout

    @asynccontextmanager
    async def _channel(self, pod: str, command: list[str], *, stdin: bool) -> AsyncIterator[Any]:
        if self._ws is None:
            raise anyio.ClosedResourceError
        core: Any = k8s.CoreV1Api(self._ws)  # raw mode: a WebSocket context, not the declared str
        with anyio.fail_after(self._request_timeout_s):
            connecting = await core.connect_get_namespaced_pod_exec(
                pod, self._namespace, command=command, container=CONTAINER, stdin=stdin, stdout=True, stderr=True,
                tty=False, _preload_content=False)
            ws = await connecting.__aenter__()
        try:
            yield ws
        finally:
            with anyio.CancelScope(shield=True):
                await connecting.__aexit__(None, None, None)

    async def _exec(self, pod: str, name: str, command: list[str], *, stdin: bytes, action: str,
                    sink: IO[bytes] | None = None) -> tuple[bytes, bytes, int]:
        """Run `command` in the workload container: (stdout, stderr, exit code from the status channel).

        With `sink`, stdout goes there instead (copy-from's archive, capped at ``copy_max_bytes``).
        """
        out, err = bytearray(), bytearray()
        sunk = 0
        status: dict[str, Any] | None = None
        if stdin and not await self._can_close_stdin():  # decided before anything runs in the container
            raise RuntimeFailed(action=action, detail=(
                "`input` cannot be realised on this cluster: its exec protocol (v4.channel.k8s.io) cannot signal "
                "the end of stdin, so the command would never see it end (v5.channel.k8s.io, Kubernetes 1.30+, can)"))
        with kube_errors(action, kind="workload", ref=name):
            async with self._channel(pod, command, stdin=bool(stdin)) as ws:
                if stdin:
                    if ws.protocol != V5:
                        raise RuntimeFailed(action=action, detail=f"the apiserver chose {ws.protocol}, not {V5}")
                    await ws.send_bytes(bytes([CHANNEL_STDIN]) + stdin)
                    await ws.send_bytes(bytes([CHANNEL_CLOSE, CHANNEL_STDIN]))
                async for message in ws:
                    if message.type != aiohttp.WSMsgType.BINARY or not message.data:
                        continue
                    channel, payload = message.data[0], message.data[1:]
                    if channel == CHANNEL_STDOUT and sink is not None:
                        sunk += len(payload)
                        if self._copy_max_bytes is not None and sunk > self._copy_max_bytes:
                            raise RuntimeFailed(action=action, detail=(
                                f"the copy exceeds {self._copy_max_bytes} bytes (docker.copy_max_bytes); "
                                "nothing was placed"))
                        await anyio.to_thread.run_sync(sink.write, payload)
                    elif channel == CHANNEL_STDOUT:
                        out += payload
                    elif channel == CHANNEL_STDERR:
                        err += payload
                    elif channel == CHANNEL_ERROR:
                        status = exec_status(payload)
                    if len(out) + len(err) > OUTPUT_LIMIT:
                        raise OutputTooLarge(action=action, limit=OUTPUT_LIMIT)
        return bytes(out), bytes(err), exec_exit_code(status, action)

    async def _can_close_stdin(self) -> bool:
        if self._closes_stdin is None:
            version = await self._call("workload-exec", k8s.VersionApi(self._api).get_code(_preload_content=False))
            try:
                major, minor = int(version.get("major") or 0), int(str(version.get("minor") or "0").rstrip("+"))
            except ValueError:
                major, minor = 0, 0
            self._closes_stdin = (major, minor) >= (1, 30)
        return self._closes_stdin

    async def workload_copy_from(self, name: str, path: str, destination: str, *,
                                 owner: Owner | None = None) -> None:
        """`tar` in the container (as ``kubectl cp`` does: the image needs tar), extracted as `owner`."""
        action = "workload-copy-from"
        pod = await self._require(name, action)
        parent, base = os.path.split(path)
        command = ["tar", "cf", "-", "-C", parent or "/", base or "."]
        # Spooled in the daemon's own directory; only the extractor, as `owner`, writes at the destination.
        with tempfile.TemporaryFile(dir=self._spool_dir, prefix="coldsnap-copy-") as spool:
            _, stderr, exit_code = await self._exec(str(pod["metadata"]["name"]), name, command, stdin=b"",
                                                    action=action, sink=spool)
            if exit_code != 0:
                if b"No such file" in stderr or b"not found" in stderr.lower():
                    raise PathNotFound(workload=name, path=path, action=action)
                raise CommandFailed(action=action, status=f"tar in the container exited {exit_code}",
                                    output=diagnostic_text(stderr))
            await anyio.to_thread.run_sync(spool.flush)
            spool.seek(0)
            await extract_archive(spool, base or "root", destination, owner=owner, action=action,
                                  max_bytes=self._copy_max_bytes)

    # --- maintenance -----------------------------------------------------------------------

    async def maintain(self) -> None:
        """Retry failed removals; delete ended detached runs that asked for remove_after_exit."""
        for pending in sorted(self._pending_removal):
            await self._delete_own(pending)
        try:
            pods = await self._managed_pods("maintain", f"{REMOVE_AFTER_EXIT_LABEL}=true")
        except BackendError as exc:
            log.warning("maintenance could not list workloads", error=str(exc))
            return
        for pod in pods:
            if workload_info(pod, include_start_time=False).state == "exited":
                with anyio.move_on_after(CLEANUP_BUDGET_S, shield=True):
                    try:
                        await self._delete(pod, action="cleanup", ref=workload_name(pod))
                    except (BackendError, TimeoutError) as exc:
                        log.warning("remove_after_exit failed; will retry", error=str(exc))

    async def recover(self) -> None:
        """Delete the Pods RPCs of an earlier process of this instance left (anonymous runs; never named ones)."""
        if not self._instance:
            return
        for pod in await self._managed_pods("recover", f"{INSTANCE_LABEL}={self._instance}"):
            metadata = pod.get("metadata") or {}
            if workload_name(pod) or (metadata.get("labels") or {}).get(INCARNATION_LABEL) == self._incarnation:
                continue
            log.info("removing a leftover of an earlier daemon", container_id=str(metadata.get("name")))
            with anyio.move_on_after(CLEANUP_BUDGET_S, shield=True):
                try:
                    await self._delete(pod, action="recover", ref=str(metadata.get("name")))
                except (BackendError, TimeoutError) as exc:
                    log.warning("leftover removal failed", error=str(exc))


_NO_IMAGE_API = ("Kubernetes has no image API: a node's images belong to its container runtime, which neither "
                 "the apiserver nor this provider reaches")

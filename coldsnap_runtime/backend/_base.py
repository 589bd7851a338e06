"""The seam between the protocol and a container engine.

A backend implements one coroutine per runtime-v1 action, ``recover()`` and
``aclose()``. Requests reach it already validated and already authorised (capability
gating is the provider's job: this package knows no wire text); :func:`dispatch` applies
the rules that do not depend on the engine (manager labels, image ownership, the host
identity that owns copied files) and routes by action. Which workloads a manager reaches is
not decided here: the provider applies that rule above its hosts, once for every host kind
(``coldsnap_provider/_ownership.py``), since a host kind may serve an action without dispatch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol

import msgspec

from ..errors import RuntimeFailed
from ..schema import (
    Execution,
    ImageBuild,
    ImageBuildAction,
    ImageInfo,
    ImageInspect,
    ImagePull,
    ImagePush,
    ImageRemove,
    ImageTag,
    Mount,
    RuntimeRequest,
    RuntimeResponse,
    WorkloadCopyFrom,
    WorkloadExec,
    WorkloadInfo,
    WorkloadInspect,
    WorkloadLogs,
    WorkloadRemove,
    WorkloadRun,
    WorkloadSpec,
)
from ._ledger import LedgerEntry

__all__ = ("MANAGER_UID_LABEL", "REPORT_DIR_LABEL", "REPORT_ENV", "REPORT_TARGET", "WORKLOAD_LABEL",
           "Backend", "LedgerEntry", "Owner", "RuntimeContext", "dispatch", "requesting_manager", "running_for",
           "with_manager_labels", "with_report_dir")

# The manager a runtime request runs for (None: root, the daemon's account, a library caller), for what a backend
# shares out per manager (the capture store's blob-fetch slots) and the captures it reaches (`_captures.py`). Set
# (`running_for`) by `dispatch` and the provider's probe for the request's task and the tasks it starts;
# context-local, so one request never sees another's.
requesting_manager: ContextVar[int | None] = ContextVar("coldsnap_requesting_manager", default=None)


@contextlib.contextmanager
def running_for(uid: int | None) -> Iterator[None]:
    """The backend calls made inside run for manager `uid` (None: one that reaches everything): `requesting_manager`."""
    token = requesting_manager.set(uid)
    try:
        yield
    finally:
        requesting_manager.reset(token)

WORKLOAD_LABEL = "io.sparksq.coldsnap.workload"
MANAGER_UID_LABEL = "io.coldsnap-provider.manager-uid"
# A unit given a report directory: the directory's name (the daemon reaps those no unit holds).
REPORT_DIR_LABEL = "io.coldsnap-provider.report-dir"
# Where the unit sees its report directory, and the variable that tells its worker.
REPORT_TARGET = "/run/coldsnap/reports"
REPORT_ENV = "COLDSNAP_REPORT_DIR"


class Owner(msgspec.Struct, frozen=True):
    """A host identity: the uid and gid whose files a backend writes on the host."""

    uid: int
    gid: int


class RuntimeContext(msgspec.Struct, frozen=True, kw_only=True):
    """What the caller's session authorizes, independent of any engine."""

    host: str
    # workload-run may pull a missing image (pull_policy "missing"/"always").
    allow_pull: bool
    # The host identity of everything the backend reads or writes on the host for the caller
    # (image-build's context directories, workload-copy-from's destination): every such
    # access happens with this identity. None: the daemon's own identity.
    owner: Owner | None = None
    # Labels the placement manager attached at session-open; added to workloads whose
    # `io.sparksq.coldsnap.workload` label equals `cluster_id`.
    cluster_id: str = ""
    manager_labels: dict[str, str] = {}
    # The placement manager whose session runs this: recorded on every workload it runs
    # (MANAGER_UID_LABEL) and every image reference it records. Which workloads a manager reaches
    # is decided above the hosts, by the provider (one rule for every host kind), not here.
    manager_uid: int | None = None
    # Whether this caller reaches every image reference (root and the daemon's uid); otherwise it
    # pushes, removes and re-points only the references its sessions recorded (require_own_image).
    reaches_all: bool = True
    # The admission policy's grant: `privileged: true` realised as exactly these capabilities
    # (None: as the host's [runtime] privileged says).
    capabilities: tuple[str, ...] | None = None
    # A host directory for the in-capsule worker's reports, mounted read-write at REPORT_TARGET of
    # a workload-run (the daemon's phase metrics); "" = none.
    report_dir: str = ""
    # Whether image-build may have the engine fetch from the network itself (an ADD of a URL): it does
    # so in the host's network namespace. False: the admission policy refused such ADDs in the Dockerfile,
    # and the backend refuses a base image whose ONBUILD triggers hold one.
    remote_build_sources: bool = True


class Backend(Protocol):
    """One host's runtime: one coroutine per runtime-v1 action, plus what the daemon's lifecycle calls.

    The contract every implementation keeps (``DockerBackend``, ``KubernetesBackend``): requests arrive validated
    and authorised (``dispatch`` applied the engine-independent rules; the provider the ownership rule), every
    failure is a :class:`~coldsnap_runtime.errors.BackendError` (``NotFound`` for an absent image or workload,
    ``RuntimeFailed`` and its ``CommandFailed``/``OutputTooLarge``, ``BackendTimeout``, ``BackendUnavailable``),
    never an engine's or a client library's own exception, and a method that cannot be done on this host kind
    raises ``RuntimeFailed`` saying why rather than half-doing it. Cancellation (a client that hangs up, the
    daemon's drain) may arrive at any await: what the call created for itself is removed under a shielded,
    bounded cleanup, and what it was asked to keep (a named workload) stays.
    """

    async def image_inspect(self, image: str) -> ImageInfo:
        """The image `image` as runtime-v1 describes it (`id` is its OCI config digest); NotFound when the host
        does not hold it; RuntimeFailed when the host cannot tell the config digest. Reads only."""
        ...

    async def image_pull(self, image: str) -> None:
        """Pull `image` from its registry with the credentials the host's configuration allows for that registry,
        and record it in the image ledger. An error inside the engine's progress stream is a failure (RuntimeFailed),
        never a success; pulling what is already present is a pull like any other (idempotent)."""
        ...

    async def image_push(self, image: str) -> None:
        """Push the tag `image` (a digest reference is refused: RuntimeFailed); NotFound when the host does not hold
        it. Pushing again pushes the same bytes (idempotent)."""
        ...

    async def image_tag(self, source: str, target: str) -> None:
        """Point the reference `target` (repository[:tag]) at the image `source` and record `target` in the ledger;
        NotFound when `source` is absent. Re-tagging to the same image changes nothing."""
        ...

    async def image_remove(self, image: str) -> None:
        """Remove exactly the reference `image` (never forced, never pruning untagged parents); NotFound when it is
        absent (its ledger entry goes too); RuntimeFailed for a reference this provider never recorded."""
        ...

    async def image_build(self, build: ImageBuild, *, owner: Owner | None = None,
                          remote_sources: bool = True) -> None:
        """Build `build.tag` from its context directories, read as `owner` (None: the daemon itself), and record the
        tag. `remote_sources` False refuses a base image whose ONBUILD triggers would have the engine fetch a URL.
        A build error inside the engine's stream is RuntimeFailed; a context that cannot be read, BuildContextError."""
        ...

    async def image_owner(self, image: str) -> LedgerEntry | None:
        """The image ledger's record of `image` (None: never pulled, built or tagged by this provider). Reads only;
        `dispatch` asks it before a manager's image write (the image-ownership rule)."""
        ...

    async def claim_image(self, image: str, uid: int) -> None:
        """Record `image` as manager `uid`'s after a write succeeded (an owner already recorded is kept:
        idempotent)."""
        ...

    async def workload_run(self, spec: WorkloadSpec, *, allow_pull: bool,
                           capabilities: tuple[str, ...] | None = None) -> RuntimeResponse:
        """Run `spec`, realising every field or refusing the request (RuntimeFailed naming the field) before
        anything is created; `allow_pull` lets `pull_policy` pull; `capabilities` (an admission grant) is exactly
        what `privileged` becomes. Detached: started, answered with its id. Attached: waited for with no deadline,
        answered with its output; a non-zero exit is CommandFailed. A name already taken is RuntimeFailed (never
        adopted, never replaced; only a leftover of an earlier daemon's own RPC is reclaimed). Cancelled or failed
        after the create, the workload is removed (shielded) unless it is a named, detached one already started."""
        ...

    async def workload_remove(self, name: str) -> None:
        """Remove the managed workload `name`, killing it if it runs. An absent one is success (idempotent: it
        precedes every named launch); a name held by something this provider does not manage is refused."""
        ...

    async def workload_inspect(self, name: str, *, include_start_time: bool) -> WorkloadInfo:
        """The managed workload `name` (state, exit code, labels; `started_at` only with `include_start_time`);
        NotFound when there is none. Reads only."""
        ...

    async def workload_list(self) -> list[tuple[str, WorkloadInfo]]:
        """Every named workload this provider manages on this host, sorted by name, each as `workload_inspect` sees
        it (one removed meanwhile is left out). Reads only; the caller filters by manager."""
        ...

    async def workload_stop(self, name: str, *, timeout_s: float) -> None:
        """SIGTERM the workload `name`, SIGKILL after `timeout_s`, and keep it (its logs and state stay readable);
        NotFound when absent; RuntimeFailed where the host kind cannot stop and keep (a Pod)."""
        ...

    async def workload_exec(self, name: str, execution: Execution) -> bytes:
        """Run `execution` in the running workload `name` as its `user`, feeding its `input`; its stdout (with
        stderr when `combined`). NotFound when absent; CommandFailed on a non-zero exit; OutputTooLarge past the
        reply limit. Cancelled, the exec's process is killed: nothing keeps running for a client that left."""
        ...

    async def workload_logs(self, name: str, *, tail: int) -> bytes:
        """The workload's combined output, its last `tail` lines (0: all); NotFound when absent; OutputTooLarge
        past the reply limit. Reads only."""
        ...

    async def workload_copy_from(self, name: str, path: str, destination: str, *,
                                 owner: Owner | None = None) -> None:
        """Copy `path` out of the workload `name` to the host path `destination`, written as `owner` (None: the
        daemon), never following a link there; spooled within the copy cap. NotFound when the workload is absent,
        PathNotFound when `path` is."""
        ...

    async def health(self) -> str:
        """"" when the runtime answers, else why not (the text of the error that asking it raised). Never raises;
        `status` and the `backend_up` metric call it, each within its own deadline."""
        ...

    async def recover(self) -> None:
        """Called once at daemon start-up: remove what RPCs of an earlier instance left behind (anonymous runs
        only; named workloads are managers' keys and stay). Safe to call again."""
        ...

    async def maintain(self) -> None:
        """Called by the daemon's maintenance loop: retry removals that failed while the runtime was unreachable.
        Idempotent; a runtime still down leaves them pending for the next call."""
        ...

    async def aclose(self) -> None:
        """Release the connection to the runtime. Safe to call twice; releases even when cancelled."""
        ...


def with_manager_labels(spec: WorkloadSpec, ctx: RuntimeContext) -> WorkloadSpec:
    """Add the session's manager labels to the workload of its own cluster (they win on conflict)."""
    if not ctx.cluster_id or not ctx.manager_labels or spec.labels.get(WORKLOAD_LABEL) != ctx.cluster_id:
        return spec
    return msgspec.structs.replace(spec, labels={**spec.labels, **ctx.manager_labels})


def with_report_dir(spec: WorkloadSpec, ctx: RuntimeContext) -> WorkloadSpec:
    """Mount the unit's report directory and name it in the environment, unless the manager took the target."""
    if not ctx.report_dir or any(m.target == REPORT_TARGET for m in spec.mounts):
        return spec
    return msgspec.structs.replace(
        spec, mounts=[*spec.mounts, Mount(source=ctx.report_dir, target=REPORT_TARGET)],
        environment={**spec.environment, REPORT_ENV: REPORT_TARGET},
        labels={**spec.labels, REPORT_DIR_LABEL: os.path.basename(ctx.report_dir)})


_EMPTY = RuntimeResponse()


async def require_own_image(backend: Backend, request: RuntimeRequest, ctx: RuntimeContext) -> str:
    """The reference a manager's image request records (""), after refusing what it may not touch.

    Images are node-global and readable by all (inspect, run, a tag's source), but a manager pushes and
    removes only references its sessions recorded, and pulls, tags or builds only into references no
    other manager (nor root, nor the ledger's format 1) recorded: a capsule carries CRIU dumps of an
    engine, and re-pointing another manager's tag would hand it other bytes (issue 24, finding 4)."""
    match request:
        case ImagePush(image=ref) | ImageRemove(image=ref):
            action, writes = str(request.__struct_config__.tag), False
        case ImagePull(image=ref) | ImageTag(target=ref):
            action, writes = str(request.__struct_config__.tag), True
        case ImageBuildAction(build=build):
            action, writes, ref = "image-build", True, build.tag
        case WorkloadRun(workload=spec) if spec.pull_policy == "always" and ctx.allow_pull:
            action, writes, ref = "workload-run", True, spec.image  # it pulls into `image` first
        case _:
            return ""
    if ctx.manager_uid is None:
        return ""
    entry = await backend.image_owner(ref)
    if ctx.reaches_all:
        return ref if writes else ""
    mine = entry is not None and entry.owner == ctx.manager_uid
    if writes:
        if entry is not None and not mine:
            raise RuntimeFailed(action=action, detail=(
                f"{ref} belongs to another manager (its sessions pulled, built or tagged it); a manager pulls, "
                "tags and builds only into references that are its own or that no session recorded"))
        return ref
    if not mine and not (isinstance(request, ImageRemove) and entry is None):
        raise RuntimeFailed(action=action, detail=(
            f"{ref} was not pulled, built or tagged by this manager's sessions; a manager pushes and removes "
            "only its own references"))
    return ""  # an unrecorded remove: the backend answers not_found, or that the provider never recorded it


async def dispatch(backend: Backend, request: RuntimeRequest, ctx: RuntimeContext) -> RuntimeResponse:
    """Run one validated runtime request; raises a ColdsnapError subclass on failure."""
    with running_for(None if ctx.reaches_all else ctx.manager_uid):
        if claim := await require_own_image(backend, request, ctx):
            response = await _dispatch(backend, request, ctx)
            assert ctx.manager_uid is not None
            await backend.claim_image(claim, ctx.manager_uid)
            return response
        return await _dispatch(backend, request, ctx)


async def _dispatch(backend: Backend, request: RuntimeRequest, ctx: RuntimeContext) -> RuntimeResponse:
    match request:
        case ImageInspect(image=image):
            return RuntimeResponse(image=await backend.image_inspect(image))
        case ImagePull(image=image):
            await backend.image_pull(image)
        case ImagePush(image=image):
            await backend.image_push(image)
        case ImageTag(source=source, target=target):
            await backend.image_tag(source, target)
        case ImageRemove(image=image):
            await backend.image_remove(image)
        case ImageBuildAction(build=build):
            await backend.image_build(build, owner=ctx.owner, remote_sources=ctx.remote_build_sources)
        case WorkloadRun(workload=spec):
            spec = with_report_dir(with_manager_labels(spec, ctx), ctx)
            if ctx.manager_uid is not None:
                spec = msgspec.structs.replace(spec, labels={**spec.labels, MANAGER_UID_LABEL: str(ctx.manager_uid)})
            return await backend.workload_run(spec, allow_pull=ctx.allow_pull, capabilities=ctx.capabilities)
        case WorkloadRemove(name=name):
            await backend.workload_remove(name)
        case WorkloadInspect(name=name, include_start_time=include_start_time):
            info = await backend.workload_inspect(name, include_start_time=include_start_time)
            return RuntimeResponse(workload=info)
        case WorkloadExec(name=name, execution=execution):
            return RuntimeResponse(output=await backend.workload_exec(name, execution))
        case WorkloadLogs(name=name, tail=tail):
            return RuntimeResponse(output=await backend.workload_logs(name, tail=tail))
        case WorkloadCopyFrom(name=name, path=path, destination=destination):
            await backend.workload_copy_from(name, path, destination, owner=ctx.owner)
        case _:  # pragma: no cover - the union is closed
            raise TypeError(f"unhandled runtime request {request!r}")
    return _EMPTY

"""The control socket's handler: placement managers open, list and close sessions, ask status, probe,
and look after the workloads their sessions ran (list, inspect, logs, stop) once the operation is over
(another manager's workload is absent to them: the one ownership rule of ``_ownership.py``).

Who may use it is decided before a byte is read (SO_PEERCRED: root, the daemon's uid,
``server.control_uids`` and ``server.control_gids``); what each may touch is the session
manager's uid rule. Every reply, the one log line per request, its metrics and its audit
event are built here (``_answer``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog
from msgspec import UNSET

from coldsnap_probe import ProfileError
from coldsnap_runtime import Backend
from coldsnap_runtime.backend import running_for
from coldsnap_runtime.errors import ColdsnapError, RequestRejected

from . import __version__
from ._audit import AUDITED_CONTROL, Audit, AuditEvent, loggable
from ._capture_admin import capture_verb
from ._config import ServerConfig
from ._control import (
    CaptureCollect,
    CaptureInspect,
    CaptureList,
    CaptureRemove,
    ControlReply,
    ControlRequest,
    Probe,
    Reload,
    SessionClose,
    SessionList,
    SessionOpen,
    Status,
    WorkloadInspect,
    WorkloadList,
    WorkloadLogs,
    WorkloadRemove,
    WorkloadStop,
    decode_control,
    encode_control,
)
from ._envelope import lenient_id
from ._errors import ConfigError
from ._health import BackendHealth
from ._listener import InFlight, Peer, ServerState, is_admin
from ._log_follow import Followers, followed_logs
from ._logging import outcome_level
from ._operations import Operations
from ._ownership import reaches
from ._probe import ProbeOptions, run_probe
from ._sessions import SessionManager, SessionRecord, hosts_from_request

if TYPE_CHECKING:
    from coldsnap_runtime.backend import Captures

    from ._metrics import Metrics  # prometheus_client is needed only with [metrics] on

__all__ = ("ControlHandler",)

log = structlog.get_logger(__name__)

_MAX_REQUEST_BYTES = 1 << 20


class ControlHandler:
    max_request_bytes = _MAX_REQUEST_BYTES  # control requests are small: a ColdSnap request at most
    request_name = "control request"

    def __init__(
        self,
        server: ServerConfig,
        *,
        sessions: SessionManager,
        operations: Operations,
        backend: Backend,
        state: ServerState,
        health: BackendHealth,
        metrics: Metrics | None = None,
        audit: Audit | None = None,
        reload: Callable[[], dict[str, list[str]]] | None = None,
        captures: Captures | None = None,
    ) -> None:
        self._captures = captures  # this node's capture store (None: a backend without one)
        self._server = server
        self._health = health
        self._reload = reload  # _reload.Reloader.reload: the configuration file applied, or ConfigError
        self._metrics = metrics
        self._audit = audit
        self._sessions = sessions
        self._operations = operations
        self._backend = backend
        self._state = state
        self._started = time.monotonic()
        self._followers = Followers()

    def admit(self, peer: Peer) -> bytes | None:
        server = self._server
        if is_admin(peer.uid) or peer.uid in server.control_uids or peer.gid in server.control_gids:
            return None
        error = f"uid {peer.uid} (gid {peer.gid}) may not use the control socket"
        log.warning("control", peer_uid=peer.uid, ok=False, error=error)
        if self._metrics is not None:
            self._metrics.request(socket="control", operation="", action="", outcome="rejected", seconds=0.0)
        if self._audit is not None:  # a refused peer never sends its request: the attempt is the event
            self._audit.record(AuditEvent(time=time.time(), socket="control", operation="connect",
                                          outcome="rejected", uid=peer.uid, peer_uid=peer.uid, peer_pid=peer.pid,
                                          error=error))
        return encode_control(ControlReply(format=1, id="", ok=False, error=error))

    async def handle(self, line: bytearray, peer: Peer, flight: InFlight) -> bytes:
        started = time.monotonic()
        request: ControlRequest | None = None
        try:
            request = decode_control(line)
            reply = ControlReply(format=1, id=request.id, ok=True, result=await self._run(request, peer))
        except ColdsnapError as exc:
            return self._failed(exc, line, peer, request=request, outcome=exc.error_code or "rejected",
                                started=started)
        except Exception:
            log.exception("control request failed unexpectedly")
            return self._failed(RuntimeError("internal error; see the daemon log"), line, peer, request=request,
                                outcome="internal", started=started)
        except anyio.get_cancelled_exc_class():
            # A probe or a stop whose peer left, or that shutdown cancelled, is accounted for all the same.
            # The accounting never awaits (the audit write is one blocking write): no cancellation can cut it.
            flight.leave(self._failed(flight.error(), line, peer, request=request, outcome=flight.outcome,
                                      started=started))
            raise
        return self._answer(reply, peer, request=request, outcome="ok", started=started)

    def refuse(self, error: ColdsnapError, line: bytes | bytearray, peer: Peer) -> bytes:
        return self._failed(error, line, peer, request=None, outcome="rejected", started=time.monotonic())

    def _failed(self, error: Exception, line: bytes | bytearray, peer: Peer, *, request: ControlRequest | None,
                outcome: str, started: float) -> bytes:
        """The ok:false reply to `error`, accounted for; logs and the audit get its loggable text."""
        code = getattr(error, "error_code", None)  # a runtime failure's wire class, as the envelope carries it
        reply = ControlReply(format=1, id=request.id if request else lenient_id(line), ok=False, error=str(error),
                             error_code=code if isinstance(code, str) else UNSET)
        return self._answer(reply, peer, request=request, outcome=outcome, started=started,
                            logged_error=loggable(error))

    def _answer(self, reply: ControlReply, peer: Peer, *, request: ControlRequest | None, outcome: str,
                started: float, logged_error: str = "") -> bytes:
        """The one place a control request is accounted for: its log line, its metrics, its audit event
        (`logged_error`: the error as logs and the audit may carry it, never a program's output)."""
        seconds = time.monotonic() - started
        operation = str(request.__struct_config__.tag) if request is not None else ""
        log.log(outcome_level(outcome), "control", request_id=reply.id, peer_uid=peer.uid,
                operation=operation or None, ok=reply.ok, outcome=outcome,
                error=logged_error if not reply.ok else None, duration_ms=round(seconds * 1000, 3))
        if self._metrics is not None:
            self._metrics.request(socket="control", operation=operation, action="", outcome=outcome, seconds=seconds)
        if self._audit is not None and operation in AUDITED_CONTROL:
            self._audit.record(AuditEvent(
                time=time.time(), socket="control", operation=operation, outcome=outcome, uid=peer.uid,
                peer_uid=peer.uid, peer_pid=peer.pid, session=_session_of(request, reply),
                target=_target_of(request), request_id=reply.id, error=logged_error,
                duration_ms=round(seconds * 1000, 3)))
        return encode_control(reply)

    async def _run(self, request: ControlRequest, peer: Peer) -> Any:
        match request:
            case SessionOpen():
                return await self._open(request, peer)
            case SessionClose(session=session):
                await self._sessions.close(session, uid=peer.uid)
                return {"session": session, "closed": True}
            case SessionList():
                return [_describe(record) for record in self._sessions.visible_to(peer.uid)]
            case Status():
                return await self.status()
            case WorkloadList(host=host):
                listed = await self._operations.workload_backend(host).workload_list()
                return [{"name": name, **msgspec.to_builtins(info)} for name, info in listed
                        if reaches(peer.uid, info)]
            case WorkloadInspect(name=name, host=host):
                _, info = await self._operations.managed_workload(host, name, uid=peer.uid, action="workload-inspect")
                return msgspec.to_builtins(info)
            case WorkloadLogs(name=name, host=host, tail=tail, follow=follow, offset=offset, wait_s=wait_s):
                backend, info = await self._operations.managed_workload(host, name, uid=peer.uid,
                                                                        action="workload-logs")
                if follow:
                    async with self._followers.hold(peer.uid):
                        return await followed_logs(backend, name, workload_id=info.id, tail=tail, offset=offset,
                                                   wait_s=wait_s)
                return {"output": await backend.workload_logs(name, tail=tail)}
            case WorkloadStop(name=name, host=host, timeout_s=timeout_s):
                backend, _ = await self._operations.managed_workload(host, name, uid=peer.uid, action="workload-stop")
                await backend.workload_stop(name, timeout_s=timeout_s)
                return {"name": name, "stopped": True}
            case WorkloadRemove(name=name, host=host):
                backend, _ = await self._operations.managed_workload(host, name, uid=peer.uid,
                                                                     action="workload-remove")
                await backend.workload_remove(name)
                return {"name": name, "removed": True}
            case Probe():
                return await self._probe(request, peer)
            case Reload():
                return self._reloaded(peer)
            case CaptureList() | CaptureInspect() | CaptureRemove() | CaptureCollect():
                return await capture_verb(self._captures, request, peer.uid)
        raise TypeError(f"unhandled control request {request!r}")  # pragma: no cover

    def _reloaded(self, peer: Peer) -> dict[str, list[str]]:
        """What SIGHUP does, answered: only the daemon's administrators change its configuration."""
        if not is_admin(peer.uid):
            raise RequestRejected(f"reload: uid {peer.uid} may not reload the configuration (root and the "
                                  "daemon's account may)")
        if self._reload is None:
            raise RequestRejected("reload: this daemon has no configuration file to reload")
        try:
            return self._reload()
        except ConfigError as exc:
            raise RequestRejected(f"reload refused; nothing changed: {exc}") from exc

    async def _probe(self, request: Probe, peer: Peer) -> Any:
        """The probe under the caller's admission profile, with the capabilities it grants (finding 3)."""
        policy = self._operations.policy
        decision = policy.admit_probe(request.image, uid=peer.uid, gid=peer.gid, host_process=request.host_process)
        options = ProbeOptions(driver=request.driver, device=request.device, image=request.image,
                               host_process=request.host_process,
                               capabilities=decision.capabilities,
                               seccomp_unconfined=policy.seccomp_unconfined(peer.uid, peer.gid),
                               manager_uid=peer.uid)
        result = "failed"
        cached = False
        try:
            # The capsule's run is the caller's: a capture its image carries is mounted only if the caller reaches it.
            with running_for(None if is_admin(peer.uid) else peer.uid):
                answer = await run_probe(options, state_dir=self._sessions.store.state_dir,
                                         backend=self._backend, identity=self._operations.identity)
            result, cached = ("admitted" if answer.get("admitted") else "refused"), bool(answer.get("cached"))
            return answer
        except (ValueError, ProfileError) as exc:
            raise RequestRejected(f"probe: {exc}") from exc
        finally:
            if self._metrics is not None:
                self._metrics.probe(driver=request.driver, result=result, cached=cached)

    async def _open(self, request: SessionOpen, peer: Peer) -> dict[str, Any]:
        session, hosts = request.session, list(request.hosts)
        if request.request is not UNSET:
            request_session, request_hosts = hosts_from_request(request.request)
            if session and session != request_session:
                raise RequestRejected(f"session {session!r} differs from request.id {request_session!r}")
            session = request_session
            hosts += [h for h in request_hosts if h not in hosts]
        if not session:
            raise RequestRejected("session-open needs `session` (or a `request` whose `id` names it)")
        if not hosts:
            raise RequestRejected("session-open needs at least one host")
        self._operations.policy.admit_session_labels(request.labels, uid=peer.uid, gid=peer.gid, session=session)
        _, token = await self._sessions.open(session, hosts=hosts, uid=peer.uid, gid=peer.gid,
                                             labels=request.labels, cluster_id=request.cluster_id)
        socket_path = str(self._sessions.store.socket_path(session))
        return {
            "session": session,
            "token": token,
            "socket": socket_path,
            "environment": {
                "COLDSNAP_HOST_PROVIDER_SOCKET": socket_path,
                "COLDSNAP_HOST_PROVIDER_TOKEN": token,
            },
        }

    async def status(self) -> dict[str, Any]:
        """The daemon's state and every backend's answer; `healthy` is false when one does not answer (the CLI's
        `status` then exits 3). Fields are only ever added: managers parse this."""
        report = await self._health.check()
        up = {(s.backend, s.host): s.up for s in report.states}
        kubernetes = self._operations.kubernetes
        state = self._state
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "sessions": len(self._sessions),
            "connections": state.connections,
            "in_flight": state.operations,
            "docker_reachable": any(s.up for s in report.states if s.backend == "docker"),
            "capabilities": list(self._operations.capabilities),
            "state_dir": str(self._sessions.store.state_dir),
            "budgets": state.statistics(),
            "remotes": report.remotes,
            "kubernetes": kubernetes.status({h: up[("kubernetes", h)] for h in kubernetes.hosts})
            if kubernetes is not None else [],
            "healthy": all(s.up for s in report.states),
            "backends": msgspec.to_builtins(report.states),
        }


def _target_of(request: ControlRequest | None) -> str:
    """What a control request acts on, for its audit event: a workload, a probe's driver, a capture."""
    return str(getattr(request, "name", "") or getattr(request, "driver", "") or getattr(request, "capture", ""))


def _session_of(request: ControlRequest | None, reply: ControlReply) -> str:
    """The session a control request concerns (session-open learns it from its `request` too)."""
    if isinstance(reply.result, dict) and isinstance(reply.result.get("session"), str):
        return str(reply.result["session"])
    return str(getattr(request, "session", "") or "")


def _describe(record: SessionRecord) -> dict[str, Any]:
    return {"session": record.session, "hosts": record.hosts, "uid": record.uid,
            "labels": record.labels, "cluster_id": record.cluster_id, "created_unix": record.created_unix}

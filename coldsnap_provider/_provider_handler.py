"""The provider socket's handler: one session's requests, from bytes to reply.

decode (strict, once) ─► authenticate (token + session, constant time) ─► capability gate
─► operations (an outcome) ─► reply; every reply, success or error, the one log line per
request, its metrics and its audit event are built here (``_answer``), whatever ends the request:
an answer, an error, the client hanging up, or the daemon cancelling it (issue 37, finding 5).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from coldsnap_runtime.errors import ColdsnapError, RequestRejected
from coldsnap_runtime.schema import RuntimeResponse

from ._audit import Audit, AuditEvent, audited_action, loggable, runtime_target
from ._envelope import (
    Capabilities,
    HuggingfacePublish,
    OciPull,
    OciPush,
    Reply,
    Request,
    Runtime,
    Upload,
    decode_request,
    encode_reply,
    error_reply,
    lenient_id,
    required_capability,
)
from ._exec import ExecResult
from ._framing import MAX_MESSAGE_BYTES
from ._listener import InFlight, Peer, ServerState
from ._logging import outcome_level
from ._operations import Operation, Operations, Outcome
from ._policy import Decision, PolicyRefused
from ._sessions import SessionRecord

if TYPE_CHECKING:
    from ._metrics import Metrics  # prometheus_client is needed only with [metrics] on

__all__ = ("ProviderHandler",)

log = structlog.get_logger(__name__)

_UNAUTHORIZED = "host-provider session is unauthorized"
_INTERNAL = "host-provider internal error; see the daemon log"


class ProviderHandler:
    """Answers one session's socket (its directory admits only the session's owner and root)."""

    max_request_bytes = MAX_MESSAGE_BYTES
    request_name = "host-provider request"

    def __init__(self, record: SessionRecord, operations: Operations, state: ServerState, *,
                 metrics: Metrics | None = None, audit: Audit | None = None) -> None:
        self.record = record
        self.operations = operations
        self._state = state
        self._metrics = metrics
        self._audit = audit

    def admit(self, peer: Peer) -> bytes | None:
        return None

    async def handle(self, line: bytearray, peer: Peer, flight: InFlight) -> bytearray:
        started = time.monotonic()
        fields: dict[str, Any] = {"session": self.record.session}
        request: Request | None = None
        decision: Decision | None = None
        try:
            request = decode_request(line)
            fields.update(_describe(request))
            self._authorize(request)
            if isinstance(request, Capabilities):
                reply = Reply(format=1, id=request.id, ok=True, provider=self.operations.provider_name,
                              capabilities=list(self.operations.capabilities))
            else:
                decision = self.operations.admit(request, self.record)
                self._state.operations += 1
                try:
                    reply = _success(request, await self.operations.run(request, self.record, decision))
                finally:
                    self._state.operations -= 1
        except PolicyRefused as exc:
            return self._failed(exc, line, fields, started, request=request, peer=peer, decision=exc.decision)
        except ColdsnapError as exc:
            return self._failed(exc, line, fields, started, request=request, peer=peer, decision=decision)
        except Exception:
            log.exception("request failed unexpectedly", **fields)
            return self._failed(RuntimeError(_INTERNAL), line, fields, started, request=request, peer=peer,
                                decision=decision, outcome="internal")
        except anyio.get_cancelled_exc_class():
            # The client hung up or the daemon is stopping: what ran stays done (an exec's files), so the
            # request is accounted for like any other. The accounting never awaits (the audit write is one
            # blocking write), so no further cancellation can cut it short.
            flight.leave(self._failed(flight.error(), line, fields, started, request=request, peer=peer,
                                      decision=decision, outcome=flight.outcome))
            raise
        return self._answer(reply, fields, started, request=request, peer=peer, decision=decision)

    def refuse(self, error: ColdsnapError, line: bytes | bytearray, peer: Peer) -> bytearray:
        fields = {"session": self.record.session}
        return self._failed(error, line, fields, time.monotonic(), request=None, peer=peer)

    def _failed(self, error: Exception, line: bytes | bytearray, fields: dict[str, Any], started: float, *,
                request: Request | None, peer: Peer, decision: Decision | None = None,
                outcome: str | None = None) -> bytearray:
        """The ok:false reply to `error`, accounted for; logs and the audit get its loggable text."""
        reply = error_reply(request.id if request is not None else lenient_id(line), error)
        return self._answer(reply, fields, started, request=request, peer=peer, decision=decision, outcome=outcome,
                            logged_error=loggable(error))

    def _authorize(self, request: Request) -> None:
        if not self.record.token_matches(request.token, request.session):
            raise RequestRejected(_UNAUTHORIZED)
        capability = required_capability(request)
        if capability is not None and capability not in self.operations.capabilities:
            raise RequestRejected(f"unsupported host-provider capability '{capability}'")

    def _answer(self, reply: Reply, fields: dict[str, Any], started: float, *, request: Request | None,
                peer: Peer, decision: Decision | None = None, outcome: str | None = None,
                logged_error: str = "") -> bytearray:
        """The one place a request is accounted for: its log line, its metrics, its audit event.

        `outcome` overrides what the reply says (internal, client-gone, cancelled); `logged_error` is the
        error as logs and the audit may carry it (never a command's output, which the reply may)."""
        seconds = time.monotonic() - started
        outcome = outcome or ("ok" if reply.ok else reply.error_code or "rejected")
        fields.update(ok=reply.ok, outcome=outcome, duration_ms=round(seconds * 1000, 3))
        if decision is not None:
            fields["profile"] = decision.profile
        if not reply.ok:
            fields.update(error_code=reply.error_code or None, error=logged_error)
        log.log(outcome_level(outcome), "request", **fields)
        operation, action = fields.get("operation", ""), fields.get("action", "")
        if self._metrics is not None:
            self._metrics.request(socket="session", operation=operation, action=action, outcome=outcome,
                                  seconds=seconds)
        if self._audit is not None and request is not None and (
                audited_action(operation, action) or reply.error == _UNAUTHORIZED):
            self._audit.record(AuditEvent(
                time=time.time(), socket="session", operation=operation, action=action, outcome=outcome,
                uid=self.record.uid, peer_uid=peer.uid, peer_pid=peer.pid, session=self.record.session,
                host=fields.get("host", ""), request_id=request.id, target=_target(request),
                error=logged_error, duration_ms=fields["duration_ms"],
                decision="" if decision is None else "admitted" if decision.admitted else "refused",
                profile="" if decision is None else decision.profile))
        return encode_reply(reply)


def _describe(request: Request) -> dict[str, Any]:
    fields: dict[str, Any] = {"request_id": request.id, "operation": request.__struct_config__.tag}
    if not isinstance(request, Capabilities):
        fields["host"] = request.host
    if isinstance(request, Runtime):
        fields["action"] = request.runtime.__struct_config__.tag
    return fields


def _target(request: Request) -> str:
    """What the audit names as acted on: never exec arguments or input (they may carry secrets)."""
    match request:
        case Runtime(runtime=runtime):
            return runtime_target(runtime)
        case Upload(destination=destination):
            return destination
        case HuggingfacePublish(repository=repository, revision=revision, destination=destination):
            return f"{repository}@{revision}:{destination}"
        case OciPull(image=image) | OciPush(image=image):
            return image
    return ""  # exec: its arguments and input may carry secrets


def _success(request: Operation, outcome: Outcome) -> Reply:
    """The ok:true reply of an operation: exactly the keys the protocol gives its outcome."""
    if isinstance(outcome, ExecResult):
        return Reply(format=1, id=request.id, ok=True, exit_code=outcome.exit_code, output=outcome.stdout,
                     error_output=outcome.stderr)
    if isinstance(outcome, RuntimeResponse):
        return Reply(format=1, id=request.id, ok=True, runtime=outcome)
    if isinstance(outcome, str):
        return Reply(format=1, id=request.id, ok=True, value=outcome)
    return Reply(format=1, id=request.id, ok=True)

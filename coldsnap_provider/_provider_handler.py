"""The provider socket's handler: one session's requests, from bytes to reply.

decode (strict, once) ─► authenticate (token + session, constant time) ─► capability gate
─► operations (an outcome) ─► reply; every reply, success or error, and the one log line per
request are built here.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from coldsnap_runtime.errors import ColdsnapError, RequestRejected
from coldsnap_runtime.schema import RuntimeResponse

from ._envelope import (
    Capabilities,
    Reply,
    Request,
    Runtime,
    decode_request,
    encode_reply,
    error_reply,
    lenient_id,
    required_capability,
)
from ._exec import ExecResult
from ._framing import MAX_MESSAGE_BYTES
from ._listener import Peer, ServerState
from ._operations import Operation, Operations, Outcome
from ._sessions import SessionRecord

__all__ = ("ProviderHandler",)

log = structlog.get_logger(__name__)

_UNAUTHORIZED = "host-provider session is unauthorized"
_INTERNAL = "host-provider internal error; see the daemon log"


class ProviderHandler:
    """Answers one session's socket (its directory admits only the session's owner and root)."""

    max_request_bytes = MAX_MESSAGE_BYTES
    request_name = "host-provider request"

    def __init__(self, record: SessionRecord, operations: Operations, state: ServerState) -> None:
        self.record = record
        self.operations = operations
        self._state = state

    def admit(self, peer: Peer) -> bytes | None:
        return None

    async def handle(self, line: bytearray, peer: Peer) -> bytearray:
        started = time.monotonic()
        fields: dict[str, Any] = {"session": self.record.session}
        request_id = ""
        try:
            request = decode_request(line)
            request_id = request.id
            fields.update(_describe(request))
            self._authorize(request)
            if isinstance(request, Capabilities):
                reply = Reply(format=1, id=request.id, ok=True, provider=self.operations.provider_name,
                              capabilities=list(self.operations.capabilities))
            else:
                self._state.operations += 1
                try:
                    reply = _success(request, await self.operations.run(request, self.record))
                finally:
                    self._state.operations -= 1
        except ColdsnapError as exc:
            reply = error_reply(request_id or lenient_id(line), exc)
        except Exception:
            log.exception("request failed unexpectedly", **fields)
            reply = error_reply(request_id or lenient_id(line), RuntimeError(_INTERNAL))
        return self._answer(reply, fields, started)

    def refuse(self, error: ColdsnapError, line: bytes | bytearray, peer: Peer) -> bytearray:
        fields = {"session": self.record.session}
        return self._answer(error_reply(lenient_id(line), error), fields, time.monotonic())

    def _authorize(self, request: Request) -> None:
        if not self.record.token_matches(request.token, request.session):
            raise RequestRejected(_UNAUTHORIZED)
        capability = required_capability(request)
        if capability is not None and capability not in self.operations.capabilities:
            raise RequestRejected(f"unsupported host-provider capability '{capability}'")

    @staticmethod
    def _answer(reply: Reply, fields: dict[str, Any], started: float) -> bytearray:
        fields.update(ok=reply.ok, duration_ms=round((time.monotonic() - started) * 1000, 3))
        if not reply.ok:
            fields.update(error_code=reply.error_code or None, error=reply.error)
        log.info("request", **fields)
        return encode_reply(reply)


def _describe(request: Request) -> dict[str, Any]:
    fields: dict[str, Any] = {"request_id": request.id, "operation": request.__struct_config__.tag}
    if not isinstance(request, Capabilities):
        fields["host"] = request.host
    if isinstance(request, Runtime):
        fields["action"] = request.runtime.__struct_config__.tag
    return fields


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

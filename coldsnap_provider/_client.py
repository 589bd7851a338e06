"""A client exactly as strict as the upstream Go one (and the CLI's transport).

Per call: dial, send one compact JSON line, half-close, read to EOF (at most 64 MiB),
decode strictly (unknown keys at any depth fail), reject trailing data, then check
``format`` and ``id`` before looking at ``ok``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec

from ._control import ControlReply
from ._envelope import MAX_MESSAGE_BYTES, Reply
from ._errors import ProtocolError, ReplyError, reply_error
from ._framing import exchange

__all__ = ("ProtocolError", "ReplyError", "call", "call_control", "exchange")


_reply_decoder = msgspec.json.Decoder(Reply)
_control_decoder = msgspec.json.Decoder(ControlReply)
_encoder = msgspec.json.Encoder()


def check_reply(data: bytes, request_id: str) -> Reply:
    try:
        reply = _reply_decoder.decode(data)
    except msgspec.DecodeError as exc:
        if "trailing" in str(exc).lower():
            raise ProtocolError("response has trailing data") from exc
        raise ProtocolError(f"response is invalid: {exc}") from exc
    if reply.format != 1 or reply.id != request_id:
        raise ProtocolError("host provider response identity is invalid")
    return reply


async def call(socket_path: str | os.PathLike[str], request: dict[str, Any], *, check: bool = True) -> Reply:
    """One RPC. With `check`, ok:false raises ReplyError (typed by error_code)."""
    payload = _encoder.encode(request) + b"\n"
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"request exceeds {MAX_MESSAGE_BYTES} bytes")
    reply = check_reply(await exchange(socket_path, payload), str(request.get("id", "")))
    if check and not reply.ok:
        raise reply_error(reply.error if isinstance(reply.error, str) else "",
                          reply.error_code if isinstance(reply.error_code, str) else "")
    return reply


async def call_control(state_dir: Path, request: dict[str, Any]) -> Any:
    """One control-socket RPC; returns `result` or raises ReplyError."""
    request = {"format": 1, "id": str(time.time_ns()), **request}
    data = await exchange(state_dir / "control.sock", _encoder.encode(request) + b"\n")
    try:
        reply = _control_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"control response is invalid: {exc}") from exc
    if reply.format != 1 or reply.id != request["id"]:
        raise ProtocolError("control response identity is invalid")
    if not reply.ok:
        raise reply_error(reply.error if isinstance(reply.error, str) else "",
                          reply.error_code if isinstance(reply.error_code, str) else "")
    return reply.result


"""The format-1 envelope: request union, reply shape and the one decoder/encoder pair.

Decoding is strict and happens once, here. Anything that fails becomes a
:class:`RequestRejected` whose message names the field and the rule; the request
``id`` is still recovered (leniently) so the reply can echo it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from coldsnap_runtime.errors import RequestRejected
from coldsnap_runtime.schema import RuntimeRequest, RuntimeResponse, explain

__all__ = (
    "MAX_MESSAGE_BYTES",
    "Capabilities",
    "Exec",
    "Reply",
    "Request",
    "Runtime",
    "Upload",
    "decode_request",
    "encode_reply",
    "error_reply",
    "peek_id",
)

MAX_MESSAGE_BYTES = 64 << 20

NonEmpty = Annotated[str, Meta(min_length=1)]
# Text the Go client would accept in a header-like field: no CR, LF or NUL.
Token = Annotated[str, Meta(min_length=1, pattern=r"^[^\r\n\x00]+$")]
Arg = Annotated[str, Meta(pattern=r"^[^\x00]*$")]


class _Envelope(Struct, tag_field="operation", forbid_unknown_fields=True, frozen=True, kw_only=True):
    format: Literal[1]
    id: NonEmpty
    token: Token
    session: Token


class Capabilities(_Envelope, tag="capabilities", frozen=True):
    pass


class _Targeted(_Envelope, frozen=True):
    host: NonEmpty


class Exec(_Targeted, tag="exec", frozen=True):
    arguments: Annotated[list[Arg], Meta(min_length=1)]
    input: bytes = b""
    combined: bool = False

    def __post_init__(self) -> None:
        if not self.arguments[0]:
            raise ValueError("`arguments[0]` (the program) must be non-empty")


class Upload(_Targeted, tag="upload", frozen=True):
    sources: Annotated[list[Annotated[str, Meta(min_length=1, pattern=r"^/[^\x00]*$")]], Meta(min_length=1)]
    destination: Annotated[str, Meta(min_length=1, pattern=r"^/[^\x00]*$")]
    recursive: bool = False


class Runtime(_Targeted, tag="runtime", frozen=True):
    runtime: RuntimeRequest


Request = Capabilities | Exec | Upload | Runtime


class Reply(Struct, omit_defaults=True, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Exactly the response keys of the protocol; `format`, `id` and `ok` are always sent."""

    format: int
    id: str
    ok: bool
    exit_code: int | UnsetType = UNSET
    output: bytes | UnsetType = UNSET
    error_output: bytes | UnsetType = UNSET
    error_code: str | UnsetType = UNSET
    error: str | UnsetType = UNSET
    value: str | UnsetType = UNSET
    provider: str | UnsetType = UNSET
    capabilities: list[str] | UnsetType = UNSET
    runtime: RuntimeResponse | UnsetType = UNSET


class _IdOnly(Struct):
    id: Any = ""


_decoder = msgspec.json.Decoder(Request)
_id_decoder = msgspec.json.Decoder(_IdOnly)
_encoder = msgspec.json.Encoder()

_INVALID_TAG = re.compile(r"^Invalid value (.*) - at `\$\.(operation|runtime\.action)`$")
_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `([^`]*)`(?: - at `(\$[^`]*)`)?$")


def peek_id(line: bytes) -> str:
    """The request id if the line is a JSON object with a string id, else ''."""
    try:
        value = _id_decoder.decode(line).id
    except msgspec.MsgspecError:
        return ""
    return value if isinstance(value, str) else ""


def decode_request(line: bytes) -> Request:
    """Decode one request line; every failure is a RequestRejected naming what is wrong."""
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise RequestRejected(_describe(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise RequestRejected(f"host-provider request is not valid JSON: {exc}") from None


def _describe(message: str) -> str:
    if m := _INVALID_TAG.match(message):
        if m.group(2) == "operation":
            return f"unsupported host-provider operation {m.group(1)}"
        return f"unsupported manager runtime action {m.group(1)}"
    if m := _UNKNOWN_FIELD.match(message):
        where = f" - at `{m.group(2)}`" if m.group(2) else ""
        return f"host-provider request has unknown fields: {m.group(1)}{where}"
    if message.startswith("Expected `object`, got") and "- at" not in message:
        return "host-provider request must be a JSON object"
    return f"host-provider request is invalid: {explain(message)}"


def encode_reply(reply: Reply) -> bytes:
    """Compact JSON plus the newline; an oversize reply becomes a small ok:false."""
    data = _encoder.encode(reply) + b"\n"
    if len(data) > MAX_MESSAGE_BYTES:
        data = _encoder.encode(error_reply(reply.id, RequestRejected(
            f"host-provider response exceeds {MAX_MESSAGE_BYTES} bytes"))) + b"\n"
    return data


def error_reply(request_id: str, exc: Exception) -> Reply:
    code = getattr(exc, "error_code", None)
    return Reply(format=1, id=request_id, ok=False, error=str(exc) or type(exc).__name__,
                 error_code=code if code else UNSET)

"""The format-1 envelope: request union, reply shape and the one decoder/encoder pair.

Decoding is strict and happens once, here. Anything that fails becomes a
:class:`RequestRejected` whose message names the field and the rule; the request
``id`` is still recovered (leniently) so the reply can echo it.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from coldsnap_runtime.errors import RequestRejected
from coldsnap_runtime.schema import PlainString, RuntimeRequest, RuntimeResponse, explain
from coldsnap_runtime.schema import Reference as RuntimeReference

from ._framing import MAX_MESSAGE_BYTES

__all__ = (
    "MAX_MESSAGE_BYTES",
    "Capabilities",
    "Exec",
    "HuggingfacePublish",
    "HuggingfaceResolve",
    "OciPull",
    "OciPush",
    "Reply",
    "Request",
    "Runtime",
    "Upload",
    "check_unique_keys",
    "decode_request",
    "encode_reply",
    "error_reply",
    "lenient_id",
    "required_capability",
)

NonEmpty = Annotated[str, Meta(min_length=1)]
# Text the Go client would accept in a header-like field: no CR, LF or NUL.
Token = Annotated[str, Meta(min_length=1, pattern=r"^[^\r\n\x00]+\Z")]
Arg = PlainString


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
    sources: Annotated[list[Annotated[str, Meta(min_length=1, pattern=r"^/[^\x00]*\Z")]], Meta(min_length=1)]
    destination: Annotated[str, Meta(min_length=1, pattern=r"^/[^\x00]*\Z")]
    recursive: bool = False


class Runtime(_Targeted, tag="runtime", frozen=True):
    runtime: RuntimeRequest


# An OCI image reference as Docker parses it ([domain/]path[:tag][@digest]) or a bare `sha256:` id.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_DOMAIN = rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_PATTERN = (
    rf"^(?:(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,})?"
    r"|sha256:[0-9a-f]{64})\Z"
)
ImageReference = Annotated[str, Meta(max_length=4096, pattern=_IMAGE_PATTERN,
                                     description="OCI image reference ([domain/]path[:tag][@digest] or sha256:<id>)")]
# A Hub repository id: `namespace/name` (letters, digits, '-', '_', '.'; no '--' or '..'; name <= 96).
HubRepository = Annotated[str, Meta(
    pattern=r"^(?!.*(?:--|\.\.))[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}\Z",
    description="Hugging Face repository id: namespace/name")]
# A branch, tag or commit: git's ref-name rules, roughly (no whitespace, '..', '~^:?*[\\', leading '-' or '/').
HubRevision = Annotated[str, Meta(
    max_length=255, pattern=r"^(?!.*\.\.)(?![-/])[^\s\x00-\x1f\x7f~^:?*\[\\]+(?<![/.])\Z",
    description="Hugging Face revision: a branch, tag or commit name")]
# A path inside the repository: relative, normalised, no NUL.
HubPath = Annotated[str, Meta(
    max_length=1024, pattern=r"^(?!/)(?:(?!\.\.?(?:/|$))[^/\x00]+)(?:/(?!\.\.?(?:/|$))[^/\x00]+)*\Z",
    description="path in the repository: relative, normalised (no '.', '..', '//', leading or trailing '/')")]

_Source = Annotated[str, Meta(pattern=r"^/[^\x00]*[^/\x00]\Z", description="host-local absolute path of a file")]


class HuggingfacePublish(_Targeted, tag="huggingface-publish", frozen=True):
    """Upload the host-local file `source` to `repository` at `revision` as `destination`."""

    image: ImageReference
    repository: HubRepository
    revision: HubRevision
    source: _Source
    destination: HubPath


class HuggingfaceResolve(_Targeted, tag="huggingface-resolve", frozen=True):
    """Resolve the mutable `revision` of `repository` to its immutable commit."""

    image: ImageReference
    repository: HubRepository
    revision: HubRevision


class OciPull(_Targeted, tag="oci-pull", frozen=True):
    """Legacy top-level form of runtime `image-pull`."""

    image: RuntimeReference


class OciPush(_Targeted, tag="oci-push", frozen=True):
    """Legacy top-level form of runtime `image-push`."""

    image: RuntimeReference


Request = Capabilities | Exec | Upload | Runtime | HuggingfacePublish | HuggingfaceResolve | OciPull | OciPush


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


_Buffer = bytes | bytearray


def lenient_id(line: _Buffer) -> str:
    """The request id if the line is a JSON object with a string id, else '' (never raises).

    A line cut short (the head of a refused request) still yields an id written plainly
    near its start, as every client writes it."""
    try:
        value = _id_decoder.decode(line).id
    except (msgspec.MsgspecError, RecursionError):
        match = _ID_NEAR_START.search(bytes(line[:_ID_SEARCH_BYTES]))
        return match.group(1).decode() if match else ""
    return value if isinstance(value, str) else ""


_ID_SEARCH_BYTES = 4096
_ID_NEAR_START = re.compile(rb'^\{[^{}\[\]]*?"id"\s*:\s*"([A-Za-z0-9._:-]{1,128})"')


def check_unique_keys(line: _Buffer, *, what: str) -> None:
    """Refuse an object that names a key twice: JSON decoders disagree on which one wins."""

    def unique(pairs: list[tuple[str, Any]]) -> None:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RequestRejected(f"{what} repeats the key {key!r}; every key may appear once")
            seen.add(key)

    try:
        json.loads(line, object_pairs_hook=unique)
    except (ValueError, RecursionError) as exc:  # already decoded strictly; only depth can differ
        raise RequestRejected(f"{what} is not acceptable JSON: {exc}") from exc


def decode_request(line: _Buffer) -> Request:
    """Decode one request line; every failure is a RequestRejected naming what is wrong."""
    try:
        request = _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise RequestRejected(_describe(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise RequestRejected(f"host-provider request is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise RequestRejected("host-provider request nests deeper than the decoder allows") from exc
    check_unique_keys(line, what="host-provider request")
    return request


def required_capability(request: Request) -> str | None:
    """The capability an operation needs (spec 3.8); registry actions need their own too."""
    if isinstance(request, Capabilities):
        return None
    if isinstance(request, Runtime):
        return _REGISTRY_ACTIONS.get(request.runtime.__struct_config__.tag, "runtime-v1")  # type: ignore[arg-type]
    tag = request.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


_REGISTRY_ACTIONS = {"image-pull": "oci-pull", "image-push": "oci-push"}


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
    return f"host-provider request is invalid: {_explain_own(explain(message))}"


def _explain_own(message: str) -> str:
    """Name the rules of this module's patterned strings instead of quoting their regexes."""
    for alias in (ImageReference, HubRepository, HubRevision, HubPath, _Source):
        meta = typing.get_args(alias)[1]
        message = message.replace(f"Expected `str` matching regex {meta.pattern!r}", f"Expected {meta.description}")
    return message


def encode_reply(reply: Reply) -> bytearray:
    """Compact JSON plus the newline (encoded in place: no second copy of a large reply);
    an oversize reply becomes a small ok:false."""
    data = bytearray()
    _encoder.encode_into(reply, data)
    if len(data) >= MAX_MESSAGE_BYTES:
        data.clear()
        _encoder.encode_into(error_reply(reply.id, RequestRejected(
            f"host-provider response exceeds {MAX_MESSAGE_BYTES} bytes")), data)
    data += b"\n"
    return data


def error_reply(request_id: str, exc: Exception) -> Reply:
    code = getattr(exc, "error_code", None)
    return Reply(format=1, id=request_id, ok=False, error=str(exc) or type(exc).__name__,
                 error_code=code if code else UNSET)

"""runtime-v1 schema: the msgspec Structs are the single source of truth.

Requests decode strictly (unknown keys at any depth, wrong JSON types, booleans where
integers are expected and malformed base64 are all errors naming the JSON path). The
predicates of the protocol (text, reference, path, mapping, ...) are ``Meta``
constraints on the types, so they also appear in the generated JSON Schemas; rules
spanning fields live in ``__post_init__``.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

__all__ = (
    "ACTIONS",
    "Device",
    "Execution",
    "ImageBuild",
    "ImageBuildAction",
    "ImageInfo",
    "ImageInspect",
    "ImagePull",
    "ImagePush",
    "ImageRemove",
    "ImageTag",
    "Mount",
    "RuntimeRequest",
    "RuntimeResponse",
    "WorkloadCopyFrom",
    "WorkloadExec",
    "WorkloadInfo",
    "WorkloadInspect",
    "WorkloadLogs",
    "WorkloadRemove",
    "WorkloadRun",
    "WorkloadSpec",
    "explain",
)

# --- predicates (spec 6.2) -------------------------------------------------------------
# msgspec checks `pattern` with re.search, where `$` also matches before a final "\n":
# every pattern is anchored with `\A` ... `\Z` so a trailing newline is never accepted.
# Identifiers, paths and mapping keys also refuse control characters anywhere (a path
# "/x\n" is not a path a manager means, and Docker would create it verbatim).

_CONTROL = r"\x00-\x1f\x7f"

Text = Annotated[str, Meta(min_length=1, pattern=r"\A[^\x00]+\Z", description="text: non-empty, no NUL")]
Reference = Annotated[
    str,
    Meta(
        pattern=r"\A[^\s\x00-][^\s\x00]*\Z",
        description="reference: non-empty, no whitespace or NUL, must not start with '-'",
    ),
]
OptionalReference = Annotated[
    str,
    Meta(pattern=r"\A(?:[^\s\x00-][^\s\x00]*)?\Z", description="optional reference: '' or a reference"),
]
# An absolute path in normal form: no '.', '..' or empty segments, no trailing '/', no ':'.
_SEGMENT = rf"(?!\.\.?(?:/|\Z))[^/:{_CONTROL}]+"
Path = Annotated[
    str,
    Meta(
        pattern=rf"\A/(?:{_SEGMENT}(?:/{_SEGMENT})*)?\Z",
        description="path: absolute, normalised (no '.', '..', '//' or trailing '/'), no ':' or control character",
    ),
]
PlainString = Annotated[str, Meta(pattern=r"\A[^\x00]*\Z", description="string without NUL")]
MappingKey = Annotated[
    str,
    Meta(pattern=rf"\A[^={_CONTROL}]+\Z", description="mapping key: non-empty, no '=' or control character"),
]
Mapping = dict[MappingKey, PlainString]
GpuId = Annotated[
    str,
    Meta(
        pattern=r'\A[^\s\x00,"-][^\s\x00,"]*\Z',
        description="GPU device id: a reference without ',' or '\"'",
    ),
]
NonNegative = Annotated[int, Meta(ge=0)]

PullPolicy = Literal["", "always", "missing", "never"]
NetworkMode = Literal["", "default", "host", "none"]


class _Object(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Every object of the protocol: strict, immutable, keyword-only."""


# --- nested request objects ------------------------------------------------------------


class Mount(_Object, frozen=True):
    source: Path
    target: Path
    read_only: bool = False


class Device(_Object, frozen=True):
    source: Path
    target: Path | UnsetType = UNSET


class Execution(_Object, frozen=True):
    command: list[PlainString]
    input: bytes | UnsetType = UNSET
    combined: bool = False
    user: OptionalReference = ""

    def __post_init__(self) -> None:
        if not self.command or not self.command[0]:
            raise ValueError("`command` must be a non-empty list whose first element is non-empty")


class ImageBuild(_Object, frozen=True):
    dockerfile: bytes
    context: Path
    tag: Reference
    contexts: dict[MappingKey, Path] = {}
    arguments: Mapping = {}
    pull: bool = False

    def __post_init__(self) -> None:
        if not self.dockerfile:
            raise ValueError("`dockerfile` must be non-empty")


class WorkloadSpec(_Object, frozen=True):
    image: Reference
    name: OptionalReference = ""
    detached: bool = False
    remove_after_exit: bool = False
    pull_policy: PullPolicy = ""
    network: NetworkMode = ""
    privileged: bool = False
    seccomp_unconfined: bool = False
    memlock_unlimited: bool = False
    shared_memory_bytes: NonNegative = 0
    gpus: list[GpuId] = []
    user: OptionalReference = ""
    entrypoint: PlainString = ""
    environment: Mapping = {}
    labels: Mapping = {}
    mounts: list[Mount] = []
    devices: list[Device] = []
    command: list[PlainString] = []
    # Presence matters: a detached run must not carry the key at all.
    input: bytes | UnsetType = UNSET
    combined: bool = False

    def __post_init__(self) -> None:
        if self.detached and (not self.name or self.input is not UNSET or self.combined):
            raise ValueError(
                "detached workloads need a non-empty `name` and separate output, without stdin "
                "(`input` must be absent and `combined` false)"
            )


# --- the runtime request: a union tagged by `action` -----------------------------------


class _Action(_Object, tag_field="action", frozen=True):
    pass


class ImageInspect(_Action, tag="image-inspect", frozen=True):
    image: Reference


class ImagePull(_Action, tag="image-pull", frozen=True):
    image: Reference


class ImagePush(_Action, tag="image-push", frozen=True):
    image: Reference


class ImageRemove(_Action, tag="image-remove", frozen=True):
    image: Reference


class ImageTag(_Action, tag="image-tag", frozen=True):
    source: Reference
    target: Reference


class ImageBuildAction(_Action, tag="image-build", frozen=True):
    build: ImageBuild


class WorkloadRun(_Action, tag="workload-run", frozen=True):
    workload: WorkloadSpec


class WorkloadRemove(_Action, tag="workload-remove", frozen=True):
    name: Reference


class WorkloadInspect(_Action, tag="workload-inspect", frozen=True):
    name: Reference
    include_start_time: bool = False


class WorkloadExec(_Action, tag="workload-exec", frozen=True):
    name: Reference
    execution: Execution


class WorkloadLogs(_Action, tag="workload-logs", frozen=True):
    name: Reference
    tail: NonNegative = 0


class WorkloadCopyFrom(_Action, tag="workload-copy-from", frozen=True):
    name: Reference
    path: Path
    destination: Path


RuntimeRequest = (
    ImageInspect
    | ImagePull
    | ImagePush
    | ImageRemove
    | ImageTag
    | ImageBuildAction
    | WorkloadRun
    | WorkloadRemove
    | WorkloadInspect
    | WorkloadExec
    | WorkloadLogs
    | WorkloadCopyFrom
)

ACTIONS: frozenset[str] = frozenset(
    str(t.__struct_config__.tag) for t in typing.get_args(RuntimeRequest)
)

# --- replies: exactly the keys the Go client knows -------------------------------------


class _Reply(Struct, omit_defaults=True, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ImageInfo(_Reply, frozen=True):
    id: str
    repo_digests: list[str]
    size: int


class WorkloadInfo(_Reply, frozen=True):
    id: str
    image: str
    state: str
    exit_code: int
    running: bool
    paused: bool
    labels: dict[str, str]
    # Only when the request asked for it: older controllers reject the key.
    started_at: str | UnsetType = UNSET


class RuntimeResponse(_Reply, frozen=True):
    output: bytes | UnsetType = UNSET
    value: str | UnsetType = UNSET
    image: ImageInfo | UnsetType = UNSET
    workload: WorkloadInfo | UnsetType = UNSET


def _rules() -> tuple[tuple[str, str], ...]:
    rules = []
    for alias in (Text, Reference, OptionalReference, Path, PlainString, MappingKey, GpuId):
        meta = typing.get_args(alias)[1]
        rules.append((f"Expected `str` matching regex {meta.pattern!r}", f"Expected {meta.description}"))
    return tuple(rules)


_RULES = _rules()


def explain(message: str) -> str:
    """Replace msgspec's regex text in a validation message with the rule's name."""
    for regex_text, rule in _RULES:
        message = message.replace(regex_text, rule)
    return message

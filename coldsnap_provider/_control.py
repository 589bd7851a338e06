"""The control socket's own small protocol (same framing as the provider sockets)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from coldsnap_runtime.errors import RequestRejected
from coldsnap_runtime.schema import Reference

from ._envelope import check_unique_keys

__all__ = (
    "CaptureCollect",
    "CaptureInspect",
    "CaptureList",
    "CaptureRemove",
    "CaptureVerb",
    "ControlReply",
    "ControlRequest",
    "Probe",
    "Reload",
    "SessionClose",
    "SessionList",
    "SessionOpen",
    "Status",
    "WorkloadInspect",
    "WorkloadList",
    "WorkloadLogs",
    "WorkloadRemove",
    "WorkloadStop",
    "decode_control",
    "encode_control",
)

NonEmpty = Annotated[str, Meta(min_length=1)]


class _Control(Struct, tag_field="operation", forbid_unknown_fields=True, frozen=True, kw_only=True):
    format: Literal[1]
    id: NonEmpty


class SessionOpen(_Control, tag="session-open", frozen=True):
    """Either `session` + `hosts`, or a whole ColdSnap `request` (id and launch.units[*].host)."""

    session: str = ""
    hosts: list[NonEmpty] = []
    labels: dict[NonEmpty, str] = {}
    cluster_id: str = ""
    request: dict[str, Any] | UnsetType = UNSET


class SessionClose(_Control, tag="session-close", frozen=True):
    session: NonEmpty


class SessionList(_Control, tag="session-list", frozen=True):
    pass


class Status(_Control, tag="status", frozen=True):
    pass


class Reload(_Control, tag="reload", frozen=True):
    """Reload the configuration file as SIGHUP does, and answer what changed (root and the daemon's uid only)."""


class Probe(_Control, tag="probe", frozen=True):
    """Probe, admit and cache the host feature profile for one device (see `coldsnap-provider probe`)."""

    driver: Literal["n580", "n610"]
    device: NonEmpty = "0"
    image: str = ""
    host_process: bool = False


class WorkloadList(_Control, tag="workload-list", frozen=True):
    """The managed workloads the caller's sessions ran (root and the daemon's uid: all of them)."""

    # "" = this node's engine; else a Kubernetes host this daemon serves ([[kubernetes]]).
    host: str = ""


class _Named(_Control, frozen=True):
    name: Reference
    host: str = ""  # as for workload-list


class WorkloadInspect(_Named, tag="workload-inspect", frozen=True):
    pass


class WorkloadLogs(_Named, tag="workload-logs", frozen=True):
    """The workload's output. To follow it, ask with `follow` (the answer then carries `offset` and `running`),
    then again with the last answer's `offset` and a `wait_s`: the answer comes once there is output past
    `offset`, the workload has ended, or `wait_s` has passed."""

    tail: Annotated[int, Meta(ge=0)] = 0
    follow: bool = False
    offset: Annotated[int, Meta(ge=0)] = 0
    wait_s: Annotated[float, Meta(ge=0, le=60)] = 0.0


class WorkloadStop(_Named, tag="workload-stop", frozen=True):
    """SIGTERM, then SIGKILL after `timeout_s`; the workload is kept (remove it through runtime-v1)."""

    timeout_s: Annotated[float, Meta(ge=0, le=3600)] = 10.0


class WorkloadRemove(_Named, tag="workload-remove", frozen=True):
    """Remove the workload (stopping it first, as runtime-v1's workload-remove does); only the caller's own."""


Digest = Annotated[str, Meta(pattern=r"^sha256:[0-9a-f]{64}\Z")]


class CaptureList(_Control, tag="capture-list", frozen=True):
    """The node's capture store: every capture the caller reaches (those of the images its sessions recorded;
    root and the daemon's uid: all), with its bytes on disk, shared and zero, tiers and last use."""


class CaptureInspect(_Control, tag="capture-inspect", frozen=True):
    capture: Digest


class CaptureRemove(_Control, tag="capture-remove", frozen=True):
    """Remove one capture from the node's store (refused while a container uses it)."""

    capture: Digest


class CaptureCollect(_Control, tag="capture-gc", frozen=True):
    """Collect captures no container uses: those unused for `older_than_s`, then the least recently used until
    the store holds at most `max_bytes` (root and the daemon's uid only: it touches every manager's)."""

    max_bytes: Annotated[int, Meta(ge=0)] | None = None
    older_than_s: Annotated[float, Meta(ge=0)] | None = None


CaptureVerb = CaptureList | CaptureInspect | CaptureRemove | CaptureCollect

ControlRequest = (SessionOpen | SessionClose | SessionList | Status | Probe
                  | WorkloadList | WorkloadInspect | WorkloadLogs | WorkloadStop | WorkloadRemove | Reload
                  | CaptureList | CaptureInspect | CaptureRemove | CaptureCollect)


class ControlReply(Struct, omit_defaults=True, frozen=True, kw_only=True, forbid_unknown_fields=True):
    format: int
    id: str
    ok: bool
    error: str | UnsetType = UNSET
    error_code: str | UnsetType = UNSET  # as in the envelope: not_found, runtime_failed...; absent when refused
    result: Any = UNSET


_decoder = msgspec.json.Decoder(ControlRequest)
_encoder = msgspec.json.Encoder()


def decode_control(line: bytes | bytearray) -> ControlRequest:
    try:
        request = _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise RequestRejected(f"control request is invalid: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise RequestRejected(f"control request is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise RequestRejected("control request nests deeper than the decoder allows") from exc
    check_unique_keys(line, what="control request")
    return request


def encode_control(reply: ControlReply) -> bytes:
    return _encoder.encode(reply) + b"\n"

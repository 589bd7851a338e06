"""The typed async client placement managers import: the control socket and a session's socket.

::

    from coldsnap_provider.client import ControlClient, SessionClient

    control = ControlClient("/run/coldsnap-provider")
    opened = await control.open_session("op-1", hosts=["node-a"])
    session = SessionClient(opened.socket, opened.token, opened.session)
    print(await session.capabilities())
    await control.close_session("op-1")

Each call is one connection: one JSON line, a half-close, the reply to EOF (docs/control-protocol.md).
Failures raise the package's error tree: :class:`ProtocolError` (the reply broke the protocol),
:class:`ReplyError` (the daemon answered ok:false) and its subclasses by ``error_code``
(:class:`NotFoundError`, :class:`PathNotFoundError`, :class:`RuntimeFailedError`), and ``OSError``
when the socket cannot be reached. It runs on any anyio backend (asyncio, trio).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from coldsnap_runtime.schema import RuntimeResponse

from ._client import call, call_control
from ._envelope import Reply
from ._errors import (
    ClientError,
    NotFoundError,
    PathNotFoundError,
    ProtocolError,
    ReplyError,
    RuntimeFailedError,
)

__all__ = (
    "FOLLOW_WAIT_S",
    "Capture",
    "ClientError",
    "Collected",
    "ControlClient",
    "LogChunk",
    "NotFoundError",
    "OpenedSession",
    "PathNotFoundError",
    "ProtocolError",
    "ReplyError",
    "RuntimeFailedError",
    "Session",
    "SessionClient",
    "Workload",
)

FOLLOW_WAIT_S = 20.0  # one long-poll of a followed log: short enough to notice a daemon that went away


class OpenedSession(Struct, frozen=True, kw_only=True):
    """A session just opened: give the controller `environment` (the socket and the token)."""

    session: str
    token: str
    socket: str
    environment: dict[str, str]


class Session(Struct, frozen=True, kw_only=True):
    """An open session as `session-list` shows it (the token is never listed)."""

    session: str
    hosts: list[str]
    uid: int
    labels: dict[str, str]
    cluster_id: str
    created_unix: float


class Workload(Struct, frozen=True, kw_only=True):
    """A managed workload; `name` is empty in `inspect_workload`'s answer (the caller named it)."""

    id: str
    image: str
    state: str
    exit_code: int
    running: bool
    paused: bool
    labels: dict[str, str]
    name: str = ""
    started_at: str | UnsetType = UNSET


class LogChunk(Struct, frozen=True, kw_only=True):
    """Output past the offset a follower asked with; `offset` is the next one to ask with."""

    output: bytes
    offset: int
    running: bool


_T = TypeVar("_T")


def _as(kind: type[_T], value: Any) -> _T:
    """`value` as `kind` (a Struct, or a list or dict of them); a result of another shape breaks the protocol."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"control result has an unexpected shape: {exc}") from exc


class Collected(Struct, frozen=True, kw_only=True):
    """What a collection freed (coldsnap_runtime.store.Collected): the captures removed, the blobs deleted (of them,
    `orphans`: blobs no capture named, an interrupted pull's or a failed build's) and the disk bytes given back."""

    removed: list[str]
    blobs: int
    orphans: int
    bytes: int


class Capture(Struct, frozen=True, kw_only=True):
    """A capture in the node's capture store (coldsnap_runtime.store.CaptureInfo): its id (the digest of its
    registry artifact), files, bytes (apparent, stored, shared with other captures, zero), tiers, times."""

    capture: str
    files: int
    size: int
    stored: int
    shared: int
    zero: int
    tree: int
    created: float
    used: float
    tiers: list[str]


class ControlClient:
    """The daemon's control socket, `<state_dir>/control.sock`: sessions, status and managed workloads."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.state_dir = Path(state_dir)

    @property
    def socket(self) -> Path:
        return self.state_dir / "control.sock"

    async def request(self, operation: str, **fields: Any) -> Any:
        """One control operation by name; its `result` (the typed methods below are built on it)."""
        return await call_control(self.state_dir, {"operation": operation, **fields})

    async def open_session(self, session: str = "", *, hosts: Sequence[str] = (),
                           labels: Mapping[str, str] | None = None, cluster_id: str = "",
                           request: Mapping[str, Any] | None = None) -> OpenedSession:
        """Open a session for `hosts` (or for a whole ColdSnap `request`: its id and launch.units[*].host)."""
        fields: dict[str, Any] = {"labels": dict(labels or {})}
        if session:
            fields["session"] = session
        if hosts:
            fields["hosts"] = list(hosts)
        if cluster_id:
            fields["cluster_id"] = cluster_id
        if request is not None:
            fields["request"] = dict(request)
        return _as(OpenedSession, await self.request("session-open", **fields))

    async def close_session(self, session: str) -> None:
        await self.request("session-close", session=session)

    async def sessions(self) -> list[Session]:
        """The open sessions the caller may see (its own; root and the daemon's uid: all)."""
        return _as(list[Session], await self.request("session-list"))

    async def status(self) -> dict[str, Any]:
        """The daemon's status; keys are only ever added (`healthy`, `backends`, `sessions`, ...)."""
        return _as(dict[str, Any], await self.request("status"))

    async def reload(self) -> dict[str, list[str]]:
        """Apply the configuration file again, as SIGHUP does: {"changed": [...], "needs_restart": [...]}."""
        return _as(dict[str, list[str]], await self.request("reload"))

    async def workloads(self, *, host: str = "") -> list[Workload]:
        """The managed workloads the caller's sessions ran ("" = this node's engine, else a Kubernetes host)."""
        return _as(list[Workload], await self.request("workload-list", host=host))

    async def inspect_workload(self, name: str, *, host: str = "") -> Workload:
        return _as(Workload, await self.request("workload-inspect", name=name, host=host))

    async def workload_logs(self, name: str, *, host: str = "", tail: int = 0) -> bytes:
        """The log (its last `tail` lines; 0 = all)."""
        answer = await self.request("workload-logs", name=name, host=host, tail=tail)
        return _as(LogChunk, {"offset": 0, "running": False, **answer}).output

    async def logs_after(self, name: str, *, host: str = "", tail: int = 0, offset: int = 0,
                         wait_s: float = 0.0) -> LogChunk:
        """Followed: what came after `offset` (the first time, the last `tail` lines), waiting up to `wait_s`."""
        return _as(LogChunk, await self.request("workload-logs", name=name, host=host, tail=tail, follow=True,
                                                offset=offset, wait_s=wait_s))

    async def follow_logs(self, name: str, *, host: str = "", tail: int = 0) -> AsyncIterator[bytes]:
        """The log as it grows, chunk by chunk, until the workload is no longer running."""
        chunk = await self.logs_after(name, host=host, tail=tail)
        while True:
            if chunk.output:
                yield chunk.output
            if not chunk.running:
                return
            chunk = await self.logs_after(name, host=host, offset=chunk.offset, wait_s=FOLLOW_WAIT_S)

    async def stop_workload(self, name: str, *, host: str = "", timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; the workload is kept."""
        await self.request("workload-stop", name=name, host=host, timeout_s=timeout_s)

    async def remove_workload(self, name: str, *, host: str = "") -> None:
        """Remove one of the caller's own workloads (running or not)."""
        await self.request("workload-remove", name=name, host=host)

    async def captures(self) -> list[Capture]:
        """The node store's captures the caller reaches (those of images its sessions recorded; admins: all)."""
        return _as(list[Capture], await self.request("capture-list"))

    async def inspect_capture(self, capture: str) -> Capture:
        return _as(Capture, await self.request("capture-inspect", capture=capture))

    async def remove_capture(self, capture: str) -> None:
        """Remove one capture (refused while a container uses it)."""
        await self.request("capture-remove", capture=capture)

    async def collect_captures(self, *, max_bytes: int | None = None,
                               older_than_s: float | None = None) -> Collected:
        """Collect the blobs no capture names, then captures no container uses, by age and then by capacity; what
        it freed."""
        return _as(Collected, await self.request("capture-gc", max_bytes=max_bytes, older_than_s=older_than_s))


class SessionClient:
    """A session's provider socket, as a controller's adapter uses it (format-1 envelopes)."""

    def __init__(self, socket: str | os.PathLike[str], token: str, session: str) -> None:
        self.socket, self.token, self.session = Path(socket), token, session

    async def call(self, operation: str, *, check: bool = True, **fields: Any) -> Reply:
        """One envelope; with `check`, ok:false raises ReplyError (or its subclass by error_code)."""
        request = {"format": 1, "id": str(time.time_ns()), "token": self.token, "session": self.session,
                   "operation": operation, **fields}
        return await call(self.socket, request, check=check)

    async def capabilities(self) -> list[str]:
        reply = await self.call("capabilities")
        return list(reply.capabilities) if isinstance(reply.capabilities, list) else []

    async def runtime(self, host: str, runtime: Mapping[str, Any]) -> RuntimeResponse:
        """One runtime-v1 request (`{"action": "workload-inspect", "name": ...}`) on `host`; its `runtime` answer."""
        reply = await self.call("runtime", host=host, runtime=dict(runtime))
        if isinstance(reply.runtime, UnsetType):
            raise ProtocolError("runtime reply has no `runtime` object")
        return reply.runtime

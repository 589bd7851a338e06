"""The daemon: the control socket, one provider socket per session, and their connections.

Task ownership::

    Daemon.run ─┬─ control server ── its connections
                ├─ one task per session (its CancelScope = session lifetime)
                │     └─ accept loop (its own scope: cancelled at shutdown) ── its connections
                └─ watchdog

Shutdown: stop every accept loop, let in-flight requests finish for ``shutdown_grace_s``,
then cancel the rest. Closing a session cancels that session's task only.
"""

from __future__ import annotations

import errno
import grp
import os
import select
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import structlog
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskStatus
from msgspec import UNSET

from coldsnap_probe import ProfileError
from coldsnap_runtime import Backend
from coldsnap_runtime.errors import ColdsnapError, RequestRejected, RuntimeFailed

from . import __version__
from ._config import Config
from ._control import (
    ControlReply,
    ControlRequest,
    Probe,
    SessionClose,
    SessionList,
    SessionOpen,
    Status,
    decode_control,
    encode_control,
)
from ._dispatch import Operations
from ._envelope import Capabilities, Reply, Runtime, decode_request, encode_reply, error_reply, peek_id
from ._framing import FramingError, read_request_line
from ._probe import ProbeOptions, run_probe
from ._sessions import SessionRecord, SessionStore, hosts_from_request
from ._systemd import notify, watchdog_interval

__all__ = ("Daemon",)

log = structlog.get_logger(__name__)

_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_HANGUP_POLL_S = 0.2
_BUSY_READ_S = 1.0
_ABORT_BUDGET_S = 40.0  # backend cleanups are bounded at 30 s
_MAINTENANCE_S = 2.0

Responder = Callable[[bytes, SocketStream], Awaitable[bytes | None]]


@dataclass(eq=False)
class _LiveSession:
    record: SessionRecord
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    accept_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


def peer_credentials(stream: SocketStream) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return pid, uid, gid


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        state_dir: Path,
        operations: Operations,
        backend: Backend,
        control_fd: int | None = None,
    ) -> None:
        self.config = config
        self.store = SessionStore(state_dir)
        self.operations = operations
        self.backend = backend
        self.control_path = state_dir / "control.sock"
        self._control_fd = control_fd
        self._sessions: dict[str, _LiveSession] = {}
        self._control_accept = anyio.CancelScope()
        self._stop = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._connections = 0
        self._in_flight = 0  # every request being answered (what shutdown drains)
        self._operations = 0  # provider-socket operations among them (what status reports)
        self._started = time.monotonic()
        self._watched: dict[int, anyio.CancelScope] = {}  # in-flight request scopes by socket fd
        self._aborting = False

    # --- lifecycle -------------------------------------------------------------------

    def stop(self) -> None:
        """Begin a graceful shutdown (safe to call more than once)."""
        self._stop.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.store.prepare()
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            await tg.start(self._serve_control)
            for record in self.store.load_all():
                try:
                    await tg.start(self._serve_session, record)
                except OSError as exc:
                    log.error("could not re-bind session socket", session=record.session, error=str(exc))
            log.info("ready", version=__version__, state_dir=str(self.store.state_dir),
                     sessions=len(self._sessions))
            notify("READY=1")
            task_status.started()
            tg.start_soon(self._watch_hangups)
            tg.start_soon(self._maintain_backend)
            if (interval := watchdog_interval()) is not None:
                tg.start_soon(self._watchdog, interval)
            await self._stop.wait()
            notify("STOPPING=1")
            log.info("stopping", in_flight=self._in_flight)
            self._control_accept.cancel()
            for live in list(self._sessions.values()):
                live.accept_scope.cancel()
            with anyio.move_on_after(self.config.server.shutdown_grace_s) as drain:
                while self._in_flight:
                    await anyio.sleep(0.05)
            if drain.cancelled_caught:
                log.warning("shutdown grace expired; cancelling in-flight operations", in_flight=self._in_flight)
                # Cancel each request on its own so it still answers (and its cleanup runs) before exit.
                self._aborting = True
                for scope in list(self._watched.values()):
                    scope.cancel()
                with anyio.move_on_after(_ABORT_BUDGET_S):
                    while self._in_flight:
                        await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        log.info("stopped")

    async def _watch_hangups(self) -> None:
        """Cancel the request of every peer that has closed its connection entirely.

        One poll over all in-flight sockets instead of a task per request. The Go client
        half-closes after its request (POLLRDHUP), so only POLLHUP (both directions shut)
        or an error means it went away.
        """
        while True:
            await anyio.sleep(_HANGUP_POLL_S)
            if not self._watched:
                continue
            poller = select.poll()
            for fd in self._watched:
                poller.register(fd, select.POLLHUP | select.POLLERR)
            for fd, _ in poller.poll(0):
                if (scope := self._watched.get(fd)) is not None:
                    scope.cancel()

    async def _maintain_backend(self) -> None:
        """Deferred backend cleanups (e.g. containers left while dockerd was restarting)."""
        while True:
            await anyio.sleep(_MAINTENANCE_S)
            try:
                await self.backend.maintain()
            except Exception:
                log.exception("backend maintenance failed")

    async def _watchdog(self, interval: float) -> None:
        while True:
            notify("WATCHDOG=1")
            await anyio.sleep(interval)

    # --- listeners -------------------------------------------------------------------

    async def _serve_control(self, *, task_status: TaskStatus[None]) -> None:
        if self._control_fd is not None:
            listener: SocketListener = await SocketListener.from_socket(self._control_fd)
        else:
            self.control_path.unlink(missing_ok=True)
            listener = await anyio.create_unix_listener(self.control_path, mode=0o660)
            self._apply_control_group()
        async with anyio.create_task_group() as conns:
            task_status.started()
            try:
                with self._control_accept:
                    await self._accept_loop(listener, conns, self._respond_control)
            finally:
                await listener.aclose()

    def _apply_control_group(self) -> None:
        group = self.config.server.control_group
        if not group:
            return
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        os.chown(self.control_path, -1, gid)

    async def _serve_session(self, record: SessionRecord, *, task_status: TaskStatus[None]) -> None:
        live = _LiveSession(record)
        path = self.store.socket_path(record.session)
        with live.scope:
            path.unlink(missing_ok=True)
            listener = await anyio.create_unix_listener(path, mode=0o600)
            try:
                if (record.uid, record.gid) != (os.geteuid(), os.getegid()):
                    os.chown(path, record.uid, record.gid)
            except BaseException:
                await listener.aclose()
                raise
            self._sessions[record.session] = live
            try:
                async with anyio.create_task_group() as conns:
                    task_status.started()
                    try:
                        with live.accept_scope:
                            await self._accept_loop(listener, conns, self._provider_responder(record))
                    finally:
                        await listener.aclose()
            finally:
                if self._sessions.get(record.session) is live:
                    del self._sessions[record.session]

    async def _accept_loop(
        self, listener: SocketListener, conns: anyio.abc.TaskGroup, respond: Responder
    ) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _CAPACITY_ERRNOS:
                    raise
                log.error("accept failed; backing off", error=errno.errorcode[exc.errno or 0])
                await anyio.sleep(0.1)
                continue
            conns.start_soon(self._connection, stream, respond)

    # --- one connection = one request ------------------------------------------------

    async def _connection(self, stream: SocketStream, respond: Responder) -> None:
        async with stream:
            if self._connections >= self.config.server.max_connections:
                await self._refuse_busy(stream)
                return
            self._connections += 1
            try:
                reply = await self._exchange(stream, respond)
                if reply is not None:
                    try:
                        await stream.send(reply)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        log.debug("client went away before the reply")
            finally:
                self._connections -= 1

    async def _exchange(self, stream: SocketStream, respond: Responder) -> bytes | None:
        timeout = self.config.server.request_read_timeout_s
        with anyio.move_on_after(timeout) as reading:
            try:
                line = await read_request_line(stream)
            except FramingError as exc:
                return encode_reply(error_reply(peek_id(exc.partial), exc))
            except (anyio.BrokenResourceError, OSError):
                return None
        if reading.cancelled_caught:
            return encode_reply(error_reply("", RequestRejected(
                f"host-provider request was not received within {timeout:g} s")))
        self._in_flight += 1
        fd = stream.extra(SocketAttribute.raw_socket).fileno()
        scope = anyio.CancelScope()
        self._watched[fd] = scope
        try:
            with scope:
                return await respond(line, stream)
            if self._aborting:
                return encode_reply(error_reply(peek_id(line), RuntimeFailed(
                    action="request", detail="cancelled: the provider is shutting down")))
            log.warning("client disconnected mid-operation; operation cancelled", request_id=peek_id(line))
            return None
        finally:
            del self._watched[fd]
            self._in_flight -= 1

    async def _refuse_busy(self, stream: SocketStream) -> None:
        request_id = ""
        with anyio.move_on_after(_BUSY_READ_S):
            try:
                request_id = peek_id(await read_request_line(stream))
            except (FramingError, anyio.BrokenResourceError, OSError):
                pass
        limit = self.config.server.max_connections
        reply = encode_reply(error_reply(request_id, RequestRejected(
            f"host-provider is at its connection limit ({limit}); retry later")))
        log.warning("connection refused: at connection limit", limit=limit)
        try:
            await stream.send(reply)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass

    # --- provider sockets ------------------------------------------------------------

    def _provider_responder(self, record: SessionRecord) -> Responder:
        async def respond(line: bytes, stream: SocketStream) -> bytes:
            return encode_reply(await self._provider_reply(line, record))

        return respond

    async def _provider_reply(self, line: bytes, record: SessionRecord) -> Reply:
        started = time.monotonic()
        fields: dict[str, Any] = {"session": record.session}
        request_id = ""
        try:
            request = decode_request(line)
            request_id = request.id
            fields.update(request_id=request.id, operation=request.__struct_config__.tag)
            if not isinstance(request, Capabilities):
                fields["host"] = request.host
            if isinstance(request, Runtime):
                fields["action"] = request.runtime.__struct_config__.tag
            self._operations += 1
            try:
                reply = await self.operations.handle(request, record)
            finally:
                self._operations -= 1
        except ColdsnapError as exc:
            reply = error_reply(request_id or peek_id(line), exc)
        except Exception:
            log.exception("request failed unexpectedly", **fields)
            reply = error_reply(request_id or peek_id(line), RuntimeError(
                "host-provider internal error; see the daemon log"))
        fields.update(ok=reply.ok, duration_ms=round((time.monotonic() - started) * 1000, 3))
        if not reply.ok:
            fields.update(error_code=reply.error_code or None, error=reply.error)
        log.info("request", **fields)
        return reply

    # --- control socket --------------------------------------------------------------

    async def _respond_control(self, line: bytes, stream: SocketStream) -> bytes:
        _, uid, gid = peer_credentials(stream)
        request_id = peek_id(line)
        try:
            if not self._control_allowed(uid, gid):
                raise RequestRejected(f"uid {uid} (gid {gid}) may not use the control socket")
            request = decode_control(line)
            result = await self._control(request, uid, gid)
            reply = ControlReply(format=1, id=request.id, ok=True, result=result)
        except ColdsnapError as exc:
            reply = ControlReply(format=1, id=request_id, ok=False, error=str(exc))
        except Exception:
            log.exception("control request failed unexpectedly")
            reply = ControlReply(format=1, id=request_id, ok=False, error="internal error; see the daemon log")
        log.info("control", request_id=request_id, peer_uid=uid, ok=reply.ok,
                 error=reply.error if not reply.ok else None)
        return encode_control(reply)

    def _control_allowed(self, uid: int, gid: int) -> bool:
        server = self.config.server
        return uid in (0, os.geteuid()) or uid in server.control_uids or gid in server.control_gids

    async def _control(self, request: ControlRequest, uid: int, gid: int) -> Any:
        match request:
            case SessionOpen():
                return await self.open_session(request, uid=uid, gid=gid)
            case SessionClose(session=session):
                await self.close_session(session, uid=uid)
                return {"session": session, "closed": True}
            case SessionList():
                return [self._describe(live.record) for live in self._sessions.values()
                        if uid in (0, os.geteuid()) or live.record.uid == uid]
            case Status():
                return await self.status()
            case Probe():
                options = ProbeOptions(driver=request.driver, device=request.device, image=request.image,
                                       host_process=request.host_process, criu=request.criu)
                try:
                    return await run_probe(options, state_dir=self.store.state_dir, backend=self.backend)
                except (ValueError, ProfileError) as exc:
                    raise RequestRejected(f"probe: {exc}") from None
        raise TypeError(f"unhandled control request {request!r}")  # pragma: no cover

    async def open_session(self, request: SessionOpen, *, uid: int, gid: int) -> dict[str, Any]:
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
        if self._task_group is None:
            raise RuntimeError("daemon is not running")
        record, token = self.store.create(session, hosts=hosts, uid=uid, gid=gid,
                                          labels=request.labels, cluster_id=request.cluster_id)
        try:
            await self._task_group.start(self._serve_session, record)
        except BaseException:
            self.store.remove(session)
            raise
        socket_path = str(self.store.socket_path(session))
        log.info("session opened", session=session, hosts=hosts, owner_uid=uid)
        return {
            "session": session,
            "token": token,
            "socket": socket_path,
            "environment": {
                "COLDSNAP_HOST_PROVIDER_SOCKET": socket_path,
                "COLDSNAP_HOST_PROVIDER_TOKEN": token,
            },
        }

    async def close_session(self, session: str, *, uid: int) -> None:
        live = self._sessions.get(session)
        if live is not None and uid not in (0, os.geteuid()) and live.record.uid != uid:
            raise RequestRejected(f"session {session!r} belongs to another user")
        self.store.remove(session)  # raises, changing nothing, when the session does not exist
        if live is not None:
            # Gone from listings now: the session's task leaves the table only once it has unwound.
            del self._sessions[session]
            live.scope.cancel()
        log.info("session closed", session=session)

    async def status(self) -> dict[str, Any]:
        docker_ok = False
        with anyio.move_on_after(2):
            docker_ok = await self.backend.ping()
        return {
            "version": __version__,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "sessions": len(self._sessions),
            "connections": self._connections,
            "in_flight": self._operations,
            "docker_reachable": docker_ok,
            "capabilities": list(self.operations.capabilities),
            "state_dir": str(self.store.state_dir),
        }

    @staticmethod
    def _describe(record: SessionRecord) -> dict[str, Any]:
        return {"session": record.session, "hosts": record.hosts, "uid": record.uid,
                "labels": record.labels, "cluster_id": record.cluster_id, "created_unix": record.created_unix}



"""The connection layer: accept, budget, frame, time out, watch for hang-ups. It knows bytes and peers only.

One connection carries one request. For each accepted connection::

    peer credentials ─► handler.admit(peer) ─► a connection slot (total and per uid)
        ─► read one line (read timeout, byte budget) ─► handler.handle(line, peer, flight) ─► send (write timeout)

What the bytes mean, and every reply, belong to the handler (see ``_provider_handler`` and
``_control_handler``). Failures stay inside their connection: a handler that raises, a peer
that goes away or never reads, cost that connection only.

Resource handling: every stream is closed when its task ends, whatever happened; the listener
is closed when :meth:`ConnectionServer.serve` returns. Error handling: only the capacity
errnos of ``accept`` (EMFILE, ENFILE, ENOMEM, ENOBUFS) are retried, after 100 ms.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import anyio
import anyio.abc
import structlog
from anyio.abc import SocketAttribute, SocketListener, SocketStream, TaskStatus

from coldsnap_runtime.errors import ColdsnapError, RequestRejected, RuntimeFailed

from ._framing import (
    Account,
    ByteBudget,
    FramingError,
    current_account,
    discard_briefly,
    discard_rest,
    read_head,
    read_request_line,
)

__all__ = ("CANCELLED", "CLIENT_GONE", "ConnectionServer", "Handler", "InFlight", "Limits", "Peer", "ServerState",
           "is_admin")

log = structlog.get_logger(__name__)

_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_HANGUP_POLL_S = 0.2
# Why a request's handling was cancelled: the outcome its handler records (audit, log line, metrics).
CLIENT_GONE = "client-gone"  # the peer closed its connection before the reply (the hang-up watcher)
CANCELLED = "cancelled"  # the daemon cancelled it: shutdown past its grace, or the daemon's own end


def is_admin(uid: int) -> bool:
    """Root and the daemon's own uid: they see and manage everything, and are never starved."""
    return uid in (0, os.geteuid())


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a Unix socket (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, stream: SocketStream) -> Peer:
        sock: socket.socket = stream.extra(SocketAttribute.raw_socket)
        data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return cls(*struct.unpack("3i", data))


@dataclass(eq=False, slots=True)
class InFlight:
    """One request being answered: the scope its handling runs in, and why that scope was cancelled.

    Whoever cancels says why first (:meth:`cancel`), so the handler, which accounts for every request it
    decoded, records the right outcome; a cancellation nobody explained (the daemon's task group ending) is
    :data:`CANCELLED`. The handler leaves in `reply` what the peer is answered, if anything."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ended_by: str = ""  # the first reason given: CLIENT_GONE or CANCELLED
    reply: bytes | bytearray | None = None  # the answer to a cancelled request (None: nobody to answer)

    def cancel(self, why: str) -> None:
        self.ended_by = self.ended_by or why
        self.scope.cancel()

    @property
    def outcome(self) -> str:
        return self.ended_by or CANCELLED

    def error(self) -> RuntimeFailed:
        """What a cancelled request is answered, and accounted for, with."""
        why = "the client hung up before the reply" if self.outcome == CLIENT_GONE else "the provider is shutting down"
        return RuntimeFailed(action="request", detail=f"cancelled: {why}")

    def leave(self, answer: bytes | bytearray) -> None:
        """The handler's answer to a cancelled request: sent, unless nobody is left to read it."""
        self.reply = None if self.outcome == CLIENT_GONE else answer


class Handler(Protocol):
    """What one kind of socket answers; it builds every reply, success or error."""

    max_request_bytes: int  # the longest request line it takes
    request_name: str  # how its framing errors name a request ("host-provider request")

    def admit(self, peer: Peer) -> bytes | None:
        """A refusal for a peer that may not use this socket at all (sent before reading), else None."""

    async def handle(self, line: bytearray, peer: Peer, flight: InFlight) -> bytes | bytearray:
        """The reply to one request line; never raises for a bad request. Cancelled (`flight.scope`), it
        accounts for the request with `flight.outcome`, leaves any answer in `flight.reply` and re-raises."""

    def refuse(self, error: ColdsnapError, line: bytes | bytearray, peer: Peer) -> bytes | bytearray:
        """The reply to bytes that are not one request, or to a request that cannot be served now."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_connections: int
    max_connections_per_uid: int
    read_timeout_s: float
    write_timeout_s: float


@dataclass(eq=False)
class ServerState:
    """What every listener of one daemon shares: slots, the byte budget, in-flight requests."""

    limits: Limits
    budget: ByteBudget
    connections: int = 0
    by_uid: Counter[int] = field(default_factory=Counter)
    in_flight: int = 0  # every request being answered (what shutdown drains)
    operations: int = 0  # provider-socket operations among them (what status reports)
    # In-flight requests by socket fd: the hang-up watcher cancels those whose peer left.
    watched: dict[int, InFlight] = field(default_factory=dict)

    def statistics(self) -> dict[str, Any]:
        return {
            "connections": self.connections,
            "connections_by_uid": {str(uid): n for uid, n in sorted(self.by_uid.items()) if n},
            "max_connections": self.limits.max_connections,
            "max_connections_per_uid": self.limits.max_connections_per_uid,
            "buffered_bytes": self.budget.used,
            "buffered_bytes_by_uid": {str(uid): n for uid, n in sorted(self.budget.by_uid.items()) if n},
            "max_buffered_bytes": self.budget.limit,
            "max_buffered_bytes_per_uid": self.budget.per_uid,
        }

    def cancel_in_flight(self) -> None:
        """Shutdown after the grace: each request is cancelled on its own so it still answers."""
        for flight in list(self.watched.values()):
            flight.cancel(CANCELLED)

    async def wait_drained(self) -> None:
        while self.in_flight:
            await anyio.sleep(0.05)

    async def watch_hangups(self) -> None:
        """Cancel the request of every peer that has closed its connection entirely.

        One poll over all in-flight sockets instead of a task per request. The Go client
        half-closes after its request (POLLRDHUP), so only POLLHUP (both directions shut)
        or an error means it went away.
        """
        while True:
            await anyio.sleep(_HANGUP_POLL_S)
            if not self.watched:
                continue
            poller = select.poll()
            for fd in self.watched:
                poller.register(fd, select.POLLHUP | select.POLLERR)
            for fd, _ in poller.poll(0):
                if (flight := self.watched.get(fd)) is not None:
                    flight.cancel(CLIENT_GONE)

    def slot_refusal(self, uid: int) -> RequestRejected | None:
        limits = self.limits
        if self.connections >= limits.max_connections:
            return RequestRejected(
                f"host-provider is at its connection limit ({limits.max_connections}); retry later")
        if self.by_uid[uid] >= limits.max_connections_per_uid:
            return RequestRejected(f"host-provider is at its connection limit for uid {uid} "
                                   f"({limits.max_connections_per_uid}); retry later")
        return None


class ConnectionServer:
    """Serves one listening socket with one handler; owns the tasks of its connections."""

    def __init__(self, listener: SocketListener, handler: Handler, state: ServerState) -> None:
        self._listener = listener
        self._handler = handler
        self._state = state
        self._accepting = anyio.CancelScope()

    def stop_accepting(self) -> None:
        """Close the door; connections already accepted are answered (serve returns after them)."""
        self._accepting.cancel()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as connections:
            task_status.started()
            try:
                with self._accepting:
                    await self._accept_loop(connections)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._listener.aclose()

    async def _accept_loop(self, connections: anyio.abc.TaskGroup) -> None:
        while True:
            try:
                stream = await self._listener.accept()
            except (OSError, anyio.BrokenResourceError) as exc:
                # anyio reports accept's OSError as the cause of a BrokenResourceError.
                cause = exc if isinstance(exc, OSError) else exc.__cause__
                if not isinstance(cause, OSError) or cause.errno not in _CAPACITY_ERRNOS:
                    raise
                log.error("accept failed; backing off", error=errno.errorcode[cause.errno or 0])
                await anyio.sleep(0.1)
                continue
            connections.start_soon(self._connection, stream)

    async def _connection(self, stream: SocketStream) -> None:
        async with stream:
            try:
                peer = Peer.of(stream)
            except OSError:
                return  # gone before we could ask who it was
            state = self._state
            # A peer refused here holds no slot and no budget: an unauthorised one is answered
            # before a byte is read; one over its slots gets its request's head read (for the id).
            refusal: bytes | bytearray | None = self._handler.admit(peer)
            if refusal is None and (busy := state.slot_refusal(peer.uid)) is not None:
                log.warning("connection refused: at connection limit", peer_uid=peer.uid)
                refusal = self._handler.refuse(busy, await read_head(stream), peer)
            if refusal is not None:
                await self._send(stream, refusal)
                await discard_briefly(stream)
                return
            state.connections += 1
            state.by_uid[peer.uid] += 1
            account = state.budget.account(peer.uid, trusted=is_admin(peer.uid))
            try:
                reply = await self._exchange(stream, peer, account)
                if reply is not None:
                    account.hold(len(reply))
                    await self._send(stream, reply)
            finally:
                account.close()
                state.connections -= 1
                state.by_uid[peer.uid] -= 1
                if not state.by_uid[peer.uid]:
                    del state.by_uid[peer.uid]

    async def _exchange(self, stream: SocketStream, peer: Peer, account: Account) -> bytes | bytearray | None:
        handler, state = self._handler, self._state
        timeout = state.limits.read_timeout_s
        with anyio.move_on_after(timeout) as reading:
            try:
                line = await read_request_line(stream, account, limit=handler.max_request_bytes,
                                               what=handler.request_name)
            except FramingError as exc:
                account.close()  # what was read is dropped; the rest of the request is read and discarded
                await discard_rest(stream)
                return handler.refuse(exc, exc.partial, peer)
            except (anyio.BrokenResourceError, OSError):
                return None
        if reading.cancelled_caught:
            return handler.refuse(RequestRejected(
                f"{handler.request_name} was not received within {timeout:g} s"), b"", peer)
        state.in_flight += 1
        fd = stream.extra(SocketAttribute.raw_socket).fileno()
        flight = InFlight()
        state.watched[fd] = flight
        charged = current_account.set(account)
        try:
            with flight.scope:
                return await handler.handle(line, peer, flight)
            return flight.reply  # cancelled: the handler accounted for it and left the answer, if any
        finally:
            current_account.reset(charged)
            del state.watched[fd]
            state.in_flight -= 1

    async def _send(self, stream: SocketStream, reply: bytes | bytearray) -> None:
        """Send, but never wait longer than the write timeout for a peer that does not read."""
        with anyio.move_on_after(self._state.limits.write_timeout_s) as writing:
            try:
                await stream.send(cast(bytes, reply))  # bytes-like: a large reply is not copied again
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                log.debug("client went away before the reply")
        if writing.cancelled_caught:
            log.warning("reply not read within the write timeout; connection dropped",
                        timeout_s=self._state.limits.write_timeout_s)

"""The JSON-line socket protocol of the capsule's local channels, written once.

One request per connection: the asker sends one JSON line (descriptors may ride with its first bytes,
SCM_RIGHTS), the server answers one JSON line and closes; the asker reads the answer to EOF. The engine's
hydration control socket, the node hydrator and the bench engines all speak it.

This module is the capsule side's one implementation of it: no other module of the probe or the engines reads
these sockets' bytes (``tests/test_architecture.py``). Two other ends exist, across boundaries no code crosses:
the daemon's sockets speak the same shape (``coldsnap_provider/_framing.py``, anyio, the asker half-closes),
which this module cannot import (it runs on a capsule's python3, standard library only), and the CUDA
interposer's control socket is its server end in C inside the engine process
(``hydration/interposer/connection.c``, its parser ``request.c``), which the worker asks through `request`
(descriptors in pages, `send`'s `page`).

Who may ask is decided before anything is read: a listener is created by `listen` with its mode set before
`bind` (so it never exists with the umask's bits), and `LineServer` checks each peer's SO_PEERCRED against a
`Peers` rule; a refused peer gets ``{"ok": false, "error": ...}`` and nothing else. A `LineServer` ends
cleanly when its listener is closed (`close()` shuts it down, wakes the accept and joins its threads); it
answers each connection on a thread of its own, `threads` at once (one by default).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ChannelError

__all__ = ("MAX_ANSWER_FDS", "MAX_REQUEST", "PAGE_MARK", "REQUEST_TIMEOUT", "Answer", "LineServer", "Peer", "Peers",
           "listen", "parse_request", "read_line", "read_request", "read_request_with_fds", "request",
           "request_with_fds", "send", "send_line")

MAX_REQUEST = 1 << 20  # bytes of one request line (regions lists stay far below it)
REQUEST_TIMEOUT = 30.0  # seconds a connection has to send its whole request
PARKED_PER_UID = 64  # a capped uid's connections waiting for one of its threads (LineServer's per_uid)
DRAIN_TIMEOUT = 1.0  # seconds, in all, an answered asker has to close before the server closes on it
# An answer read by a root worker may come from an engine's socket (its hydration or interposer control):
# bounded in bytes (a 70B engine's device dump manifest is a few MiB) and in descriptors.
MAX_ANSWER, MAX_ANSWER_FDS = 64 << 20, 16
PAGE_MARK = b"."  # the byte a page of descriptors rides with, after a request line (`send`'s `page`)
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})  # accept on a closed/shut listener

Answer = dict[str, Any] | tuple[dict[str, Any], list[int]]  # a JSON answer, or one with descriptors to pass


@dataclass(frozen=True, slots=True)
class Peer:
    """The asking process, as the kernel saw it connect (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, conn: socket.socket) -> Peer:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", raw)
        return cls(pid, uid, gid)


@dataclass(frozen=True, slots=True)
class Peers:
    """Which peers may ask: root, this process's own uid, and the uids and gids given."""

    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    def admits(self, peer: Peer) -> bool:
        # Root and our own uid could ptrace this process anyway: refusing them would protect nothing.
        return peer.uid in (0, os.geteuid()) or peer.uid in self.uids or peer.gid in self.gids


def listen(path: str | Path, *, group: int | None = None) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 (0660 and group `group` when given) from its creation.

    The mode is set on the socket before `bind`, which creates the file with it (Linux), so no one connects
    in between. A stale socket at `path` is replaced; anything else there is refused, never removed. The
    directory must be writable only by this process's user (as every socket directory of the capsule is)."""
    path = str(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ChannelError(f"{path} exists and is not a socket: not replacing it")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o660 if group is not None else 0o600)
        sock.bind(path)
        if group is not None:  # until here the file is ours, with our group and at most 0660 (the umask applies)
            os.chown(path, -1, group, follow_symlinks=False)
            if not stat.S_ISSOCK(os.lstat(path).st_mode):  # chmod follows links: a swap is refused (#24)
                raise ChannelError(f"{path} was replaced while it was created")
            os.chmod(path, 0o660)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


class LineServer:
    """Answers a listener's connections for peers `peers` admits, each on a thread of its own, at most `threads`
    at once (more wait in the listen backlog); the accept loop runs on a thread it owns.

    `answer(conn, peer)` reads its request (`read_request`) and returns the answer (the last line: an answer
    that streams, such as generated tokens, sends its earlier lines itself with `send_line`); an exception
    becomes ``{"ok": false, "error": "<Type>: <message>"}`` to that peer only. Each connection has
    `request_timeout` for its whole request, so a silent peer holds only its own thread. With ``threads=1`` (the
    default) each connection is answered on the accept thread itself, one after another, as before threads
    existed: for owners whose `answer` must not run twice at once (an engine's arena control) or relies on its
    thread's state (an engine's current CUDA context, torch's current stream and grad mode are per thread).
    `idle` runs on the accept thread, after each connection is answered (with more threads: handed over, so it
    runs while others are answered) and at least every `idle_every` seconds. The loop ends when the listener
    is closed (`close()`).

    With `per_uid` (and more than one thread), one uid is answered on at most that many threads at once: its
    further connections wait, holding no thread, for one of its own to end (at most PARKED_PER_UID of them; more
    are closed unanswered). Root and this process's uid are not capped (they could stop the process anyway). So a
    tenant that opens connections and stays silent, each within its deadline, cannot keep every thread and starve
    the others (whose connections would wait in the backlog behind its own), and a burst of one tenant's requests
    (an engine's ranks adopting at once) waits its turn rather than being refused."""

    def __init__(self, listener: socket.socket, answer: Callable[[socket.socket, Peer], Answer], *,
                 peers: Peers, idle: Callable[[], None] | None = None, idle_every: float = 1.0,
                 request_timeout: float = REQUEST_TIMEOUT, threads: int = 1, per_uid: int | None = None,
                 name: str = "coldsnap-jsonline") -> None:
        if threads < 1:
            raise ChannelError(f"a LineServer needs at least one thread, not {threads}")
        if per_uid is not None and per_uid < 1:
            raise ChannelError(f"a LineServer's per_uid must be at least one connection, not {per_uid}")
        self.listener, self.peers = listener, peers
        self._answer, self._idle, self._request_timeout = answer, idle, request_timeout
        self._idle_every, self._name = idle_every, name
        self._threads, self._slots = threads, threading.BoundedSemaphore(threads)  # one per connection being answered
        self._serving: set[threading.Thread] = set()  # the connections' threads still running (close joins them)
        self._serving_lock = threading.Lock()  # also over `_by_uid` and `_parked`
        # Invariant: a capped uid has `_by_uid[uid]` connections being answered (at most per_uid), and connections
        # parked only while that is at per_uid; the thread that ends one of them answers the next parked.
        self._per_uid, self._by_uid, self._parked = per_uid, dict[int, int](), dict[int, deque[socket.socket]]()
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)

    def start(self) -> LineServer:
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop accepting (a blocked accept wakes up), close the listener, wait for the accept thread and the
        connections still being answered (`timeout` for all of them)."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never listened, or closed already
        self.listener.close()
        deadline = time.monotonic() + timeout
        for first in (True, False):  # the accept thread first: a connection it hands over meanwhile is then seen
            with self._serving_lock:
                threads = [self._thread] if first else list(self._serving)
            for thread in threads:
                if thread.is_alive() and thread is not threading.current_thread():
                    thread.join(max(0.0, deadline - time.monotonic()))
            if first:  # nothing is accepted any more: what waits for a thread of its uid is not answered
                with self._serving_lock:
                    waiting = [conn for parked in self._parked.values() for conn in parked]
                    self._parked.clear()
                for conn in waiting:
                    conn.close()

    def run(self) -> None:
        """The accept loop, in the calling thread; returns once the listener is closed."""
        wait = self._idle_every if self._idle else None
        self.listener.settimeout(wait)
        while True:
            # A slot first, then accept: while every slot is busy, new askers wait in the backlog.
            if not self._slots.acquire(timeout=self._idle_every):
                if self.listener.fileno() == -1:
                    return
                if self._idle:
                    self._idle()
                continue
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                self._slots.release()
                if self._idle:
                    self._idle()
                continue
            except OSError as exc:
                self._slots.release()
                if self.listener.fileno() == -1 or exc.errno in _CLOSED_ERRNOS:
                    return
                if exc.errno in _CAPACITY_ERRNOS:  # out of descriptors: back off, the asker retries
                    time.sleep(0.1)
                    continue
                raise
            self._hand_over(conn)
            if self._idle:
                self._idle()

    def _hand_over(self, conn: socket.socket) -> None:
        """Answer `conn` on a thread of its own (here, with one thread), which then answers its uid's parked
        connections, if any, and gives its slot back when done; or park it (its uid is at its cap)."""
        uid = self._capped_uid(conn)

        def serve() -> None:
            current: socket.socket | None = conn
            try:
                while current is not None:
                    with current:
                        self._one(current)
                    current = self._next_parked(uid)
            finally:
                if current is not None:  # `_one` raised: the uid's count goes, its parked ones are closed
                    for parked in self._forget(uid):
                        parked.close()
                with self._serving_lock:
                    self._serving.discard(threading.current_thread())
                self._slots.release()

        if self._threads == 1:  # on the accept thread itself (see the class docstring)
            serve()
            return
        if not self._enter(uid, conn):  # parked (or, beyond PARKED_PER_UID, closed): no thread, no slot
            self._slots.release()
            return
        thread = threading.Thread(target=serve, name=f"{self._name}-conn", daemon=True)
        with self._serving_lock:
            self._serving.add(thread)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (the process's limit): this asker is dropped, the loop goes on
            with self._serving_lock:
                self._serving.discard(thread)
            self._slots.release()
            conn.close()
            for parked in self._forget(uid):  # its uid's count goes back; those waiting on it would wait forever
                parked.close()
            time.sleep(0.1)

    def _one(self, conn: socket.socket) -> None:
        conn.settimeout(self._request_timeout)  # the whole request, see read_line
        fds: list[int] = []
        try:
            peer = Peer.of(conn)
            if not self.peers.admits(peer):
                reply: dict[str, Any] = {"ok": False, "error": f"peer uid {peer.uid} gid {peer.gid} is not "
                                                                "allowed on this socket"}
            else:
                answer = self._answer(conn, peer)
                reply, fds = answer if isinstance(answer, tuple) else (answer, [])
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            send(conn, json.dumps(reply).encode() + b"\n", fds)
            _drain(conn)
        except OSError:
            pass  # the asker left; the next one is served
        finally:
            for fd in fds:
                os.close(fd)

    def _capped_uid(self, conn: socket.socket) -> int | None:
        """The uid of `conn`'s peer when it is capped (`per_uid`, more than one thread, neither root nor ours)."""
        if self._per_uid is None or self._threads == 1:
            return None
        try:
            uid = Peer.of(conn).uid
        except OSError:
            return None  # `_one` answers it (and finds the same)
        return None if uid in (0, os.geteuid()) else uid

    def _enter(self, uid: int | None, conn: socket.socket) -> bool:
        """Whether `conn` is answered now (counted in for its uid); if not, it was parked or closed."""
        if uid is None or self._per_uid is None:
            return True
        with self._serving_lock:
            if (count := self._by_uid.get(uid, 0)) < self._per_uid:
                self._by_uid[uid] = count + 1
                return True
            parked = self._parked.setdefault(uid, deque())
            if len(parked) < PARKED_PER_UID:
                parked.append(conn)
                return False
        conn.close()  # the asker sees the connection end unanswered: it may ask again
        return False

    def _next_parked(self, uid: int | None) -> socket.socket | None:
        """After one of `uid`'s connections: its next parked one (answered on the same thread), or None (its count
        goes down)."""
        if uid is None:
            return None
        with self._serving_lock:
            if parked := self._parked.get(uid):
                conn = parked.popleft()
                if not parked:
                    del self._parked[uid]
                return conn
            self._by_uid[uid] -= 1
            if not self._by_uid[uid]:
                del self._by_uid[uid]
            return None

    def _forget(self, uid: int | None) -> list[socket.socket]:
        """One of `uid`'s connections ended in an error: its count goes down; its parked ones, returned, are the
        caller's to close."""
        if uid is None:
            return []
        with self._serving_lock:
            self._by_uid[uid] -= 1
            if not self._by_uid[uid]:
                del self._by_uid[uid]
            return list(self._parked.pop(uid, ()))


def _drain(conn: socket.socket) -> None:
    """After the answer: end our side and read what the asker still sends until it closes, within DRAIN_TIMEOUT
    in all (an asker trickling bytes holds the thread no longer than a silent one), because closing a socket with
    unread input resets the connection and the asker may lose the answer."""
    conn.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + DRAIN_TIMEOUT
    received = 0
    while received <= MAX_REQUEST and (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        if not (part := conn.recv(65536)):
            return
        received += len(part)


def read_line(conn: socket.socket, data: bytes = b"") -> bytes:
    """One request line (after `data`, already read), within the connection's timeout as a whole, so that an
    asker trickling bytes cannot hold a server's thread longer than a silent one."""
    given = conn.gettimeout()
    deadline = time.monotonic() + (given or REQUEST_TIMEOUT)
    try:
        while not data.endswith(b"\n"):
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            part = conn.recv(65536)
            if not part:
                break
            data += part
            if len(data) > MAX_REQUEST:
                raise ChannelError(f"request longer than {MAX_REQUEST} bytes")
    finally:
        conn.settimeout(given)  # the answer's sends get the connection's whole timeout again
    return data


def read_request(conn: socket.socket) -> dict[str, Any]:
    """The request line as one JSON object (ChannelError when it is anything else)."""
    return parse_request(read_line(conn))


def read_request_with_fds(conn: socket.socket, max_fds: int) -> tuple[dict[str, Any], list[int]]:
    """`read_request` for a request whose descriptors ride with its first bytes (`send`): the object and at most
    `max_fds` descriptors, which the caller closes. One deadline, the connection's timeout, covers the wait for the
    first bytes and the rest of the line. More descriptors than `max_fds` (the kernel closed the extra ones) or a
    request that is not one JSON object is a ChannelError, and the descriptors received are closed."""
    given = conn.gettimeout()
    started = time.monotonic()
    data, fds, flags, _addr = socket.recv_fds(conn, MAX_REQUEST, max_fds)
    try:
        if flags & socket.MSG_CTRUNC:
            raise ChannelError(f"a request carries at most {max_fds} descriptor(s)")
        conn.settimeout(max(0.001, (given or REQUEST_TIMEOUT) - (time.monotonic() - started)))
        try:
            line = read_line(conn, data)
        finally:
            conn.settimeout(given)  # the answer's sends get the connection's whole timeout
        return parse_request(line), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def parse_request(line: bytes) -> dict[str, Any]:
    """A request line (bytes as read, its newline included or not) as one JSON object; ChannelError when it is
    anything else, whatever the bytes (no I/O)."""
    try:
        value = json.loads(line)
    except ValueError as exc:  # UnicodeDecodeError included
        raise ChannelError(f"the request is not JSON: {exc}") from exc
    except RecursionError as exc:  # "[[[[...": the decoder's nesting is bounded by the interpreter's stack
        raise ChannelError("the request nests deeper than its decoder goes") from exc
    if not isinstance(value, dict):
        raise ChannelError("the request is not one JSON object")
    return value


def send_line(sock: socket.socket, value: dict[str, Any]) -> None:
    """One JSON line (a streamed part of an answer)."""
    send(sock, json.dumps(value).encode() + b"\n")


def send(sock: socket.socket, payload: bytes, fds: Sequence[int] = (), *, page: int = 0) -> None:
    """All of `payload`, the descriptors with its first bytes (one sendmsg may send only part); with `page`,
    the payload alone, then the descriptors in pages of at most `page`, each riding with one byte `PAGE_MARK`
    (a server that reads a bounded number per message: the CUDA interposer's control socket)."""
    if page:
        sock.sendall(payload)
        for first in range(0, len(fds), page):
            socket.send_fds(sock, [PAGE_MARK], list(fds[first:first + page]))
        return
    sent = socket.send_fds(sock, [payload], list(fds)) if fds else 0
    sock.sendall(payload[sent:])


def request(path: str | Path, message: dict[str, Any], *, fds: Sequence[int] = (), page: int = 0,
            timeout: float = 300.0, sent: Callable[[], object] | None = None) -> dict[str, Any]:
    """One JSON request to the socket at `path` (`fds` sent as `send` does); its JSON answer (read to EOF).
    `sent` is called once the request and its descriptors are sent, before the answer is read."""
    answer, received = request_with_fds(path, message, fds=fds, page=page, timeout=timeout, sent=sent)
    for fd in received:
        os.close(fd)
    return answer


def request_with_fds(path: str | Path, message: dict[str, Any], *, fds: Sequence[int] = (), page: int = 0,
                     timeout: float = 300.0,
                     sent: Callable[[], object] | None = None) -> tuple[dict[str, Any], list[int]]:
    """`request`, also returning the descriptors the answer carried (the caller closes them). `timeout` bounds
    the whole exchange, not each read: a peer trickling bytes holds the asker no longer than a silent one."""
    received: list[int] = []
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
            send(sock, json.dumps(message).encode() + b"\n", fds, page=page)
            if sent is not None:  # the kernel holds what is in flight: the asker may let its descriptors go
                sent()
            data = b""
            while True:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                # Room for a whole answer's descriptors: the kernel closes those that do not fit (MSG_CTRUNC).
                part, more, flags, _addr = socket.recv_fds(sock, 1 << 20, MAX_ANSWER_FDS)
                received += more
                if flags & socket.MSG_CTRUNC:
                    raise ChannelError(f"channel {path}: an answer's message carried over {MAX_ANSWER_FDS} "
                                       "descriptors")
                if not part:
                    break
                data += part
                if len(data) > MAX_ANSWER or len(received) > MAX_ANSWER_FDS:
                    raise ChannelError(f"channel {path}: an answer over {MAX_ANSWER} bytes or "
                                       f"{MAX_ANSWER_FDS} descriptors")
        except (OSError, ChannelError) as exc:
            for fd in received:
                os.close(fd)
            if isinstance(exc, ChannelError):
                raise
            raise ChannelError(f"channel {path}: {exc}") from exc
    try:
        answer = json.loads(data)
    except (ValueError, RecursionError):  # "[[[[...": nested past the decoder's stack, an answer as malformed
        answer = None
    if not isinstance(answer, dict):
        for fd in received:
            os.close(fd)
        raise ChannelError(f"channel {path} answered {data[:200]!r}")
    return answer, received

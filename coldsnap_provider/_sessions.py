"""Sessions: one ColdSnap operation = id + token + authorized hosts (+ manager labels).

On disk (survives a daemon restart)::

    <state>/records/<id>.json           0600, daemon-owned; the token only as its SHA-256
    <state>/sessions/<id>/              0700, owned by the uid that opened the session
    <state>/sessions/<id>/provider.sock 0600, same owner
    <state>/bind/                       0700, daemon-owned: sockets are bound, chmod'ed and
                                        chown'ed here, where no session owner can race us,
                                        then renamed into place (rename never follows a link)

:class:`SessionManager` is the one owner of the records, the live table and the uid rule.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any

import anyio
import anyio.abc
import msgspec
import structlog
from anyio.abc import SocketListener, TaskStatus

from coldsnap_runtime.errors import RequestRejected
from coldsnap_runtime.files import write_atomically

from ._listener import ConnectionServer, is_admin

__all__ = (
    "SOCKET_NAME",
    "Session",
    "SessionManager",
    "SessionRecord",
    "SessionState",
    "SessionStore",
    "hosts_from_request",
    "validate_session_id",
)

log = structlog.get_logger(__name__)

SOCKET_NAME = "provider.sock"
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SUN_PATH_MAX = 107  # Linux sun_path is 108 bytes including the NUL
_ID_MAX = (1 << 32) - 1  # uid_t/gid_t; (uid_t)-1 means "unchanged" to chown


class SessionRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    session: str
    token_sha256: str
    hosts: list[str]
    uid: Annotated[int, msgspec.Meta(ge=0, lt=_ID_MAX)]
    gid: Annotated[int, msgspec.Meta(ge=0, lt=_ID_MAX)]
    labels: dict[str, str] = {}
    cluster_id: str = ""
    created_unix: float = 0.0

    def token_matches(self, token: str, session: str) -> bool:
        """Constant-time check of both the bearer token and the session id."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        token_ok = hmac.compare_digest(digest, self.token_sha256)
        session_ok = hmac.compare_digest(session.encode("utf-8", "surrogatepass"), self.session.encode())
        return token_ok & session_ok


def validate_session_id(session: str) -> str:
    if not _SESSION_ID.fullmatch(session):
        raise RequestRejected(
            f"session id {session!r} is invalid: it must match ^{_SESSION_ID.pattern}$ "
            "(it names a directory and travels in every request)"
        )
    return session


def hosts_from_request(request: Any) -> tuple[str, list[str]]:
    """(session id, hosts) from a ColdSnap request: its `id` and every `launch.units[*].host`."""
    if not isinstance(request, dict):
        raise RequestRejected("request must be a JSON object (a ColdSnap operation request)")
    session = request.get("id")
    if not isinstance(session, str) or not session:
        raise RequestRejected("request.id must be a non-empty string (it becomes the session id)")
    launch = request.get("launch")
    units = launch.get("units") if isinstance(launch, dict) else None
    if not isinstance(units, list) or not units:
        raise RequestRejected("request.launch.units must be a non-empty list")
    hosts: list[str] = []
    for index, unit in enumerate(units):
        host = unit.get("host") if isinstance(unit, dict) else None
        if not isinstance(host, str) or not host:
            raise RequestRejected(f"request.launch.units[{index}].host must be a non-empty string")
        if host not in hosts:
            hosts.append(host)
    return session, hosts


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SessionRecord)


class SessionStore:
    """The persisted session records and their socket directories under one state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._records = state_dir / "records"
        self._sessions = state_dir / "sessions"
        self._bind = state_dir / "bind"

    def prepare(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Traversable by session owners, not listable.
        os.chmod(self.state_dir, 0o711)
        for directory, mode in ((self._records, 0o700), (self._sessions, 0o711), (self._bind, 0o700)):
            directory.mkdir(mode=mode, exist_ok=True)
            os.chmod(directory, mode)
        for leftover in self._bind.iterdir():
            leftover.unlink(missing_ok=True)

    def socket_path(self, session: str) -> Path:
        return self._sessions / session / SOCKET_NAME

    def create(
        self,
        session: str,
        *,
        hosts: Iterable[str],
        uid: int,
        gid: int,
        labels: dict[str, str] | None = None,
        cluster_id: str = "",
    ) -> tuple[SessionRecord, str]:
        """Persist a new session and create its private directory; returns (record, token)."""
        validate_session_id(session)
        host_list = list(dict.fromkeys(hosts))
        if not host_list or any(not h or any(c in h for c in "\r\n\x00") for h in host_list):
            raise RequestRejected("hosts must be a non-empty list of non-empty names without CR/LF/NUL")
        sock = self.socket_path(session)
        if len(os.fsencode(sock)) > _SUN_PATH_MAX:
            raise RequestRejected(
                f"socket path {sock} exceeds {_SUN_PATH_MAX} bytes; use a shorter --state-dir or session id"
            )
        token = secrets.token_urlsafe(32)
        record = SessionRecord(
            session=session,
            token_sha256=hashlib.sha256(token.encode()).hexdigest(),
            hosts=host_list,
            uid=uid,
            gid=gid,
            labels=dict(labels or {}),
            cluster_id=cluster_id,
            created_unix=time.time(),
        )
        record_path = self._records / f"{session}.json"
        try:  # whole or absent, even across a crash; never over an existing record
            write_atomically(record_path, _encoder.encode(record), exclusive=True)
        except FileExistsError as exc:
            raise RequestRejected(f"session {session!r} already exists") from exc
        try:
            directory = self._sessions / session
            if directory.exists() or directory.is_symlink():
                shutil.rmtree(directory)  # left over from a session whose record is gone (fd-based: no links followed)
        except BaseException:
            record_path.unlink(missing_ok=True)
            raise
        return record, token

    def bind_socket(self, record: SessionRecord) -> socket.socket:
        """A listening socket at the session's path, owned by the session's uid, mode 0600.

        The session directory belongs to its owner, who could swap a symlink in at any
        moment: so nothing there is touched by path. The socket is bound and given its owner
        in the daemon-only ``bind/`` directory, then renamed into the session directory,
        which is itself checked and fixed through a descriptor opened with O_NOFOLLOW.
        """
        directory_fd = self._private_dir(record)
        staging = self._bind / secrets.token_hex(8)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(os.fspath(staging))
            os.chmod(staging, 0o600)
            if (record.uid, record.gid) != (os.geteuid(), os.getegid()):
                os.chown(staging, record.uid, record.gid)
            sock.listen(128)
            os.rename(staging, SOCKET_NAME, dst_dir_fd=directory_fd)
        except BaseException:
            sock.close()
            staging.unlink(missing_ok=True)
            raise
        finally:
            os.close(directory_fd)
        return sock

    def _private_dir(self, record: SessionRecord) -> int:
        """Open (creating if needed) sessions/<id> as a real directory, 0700, owned by the session's uid."""
        sessions_fd = os.open(self._sessions, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            try:
                os.mkdir(record.session, 0o700, dir_fd=sessions_fd)
            except FileExistsError:
                pass
            fd = os.open(record.session, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=sessions_fd)
        finally:
            os.close(sessions_fd)
        try:
            info = os.fstat(fd)
            if (info.st_uid, info.st_gid) != (record.uid, record.gid):
                os.fchown(fd, record.uid, record.gid)
            if info.st_mode & 0o7777 != 0o700:
                os.fchmod(fd, 0o700)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def load(self, session: str) -> SessionRecord | None:
        """The persisted record of `session`, or None when there is none (or it is damaged)."""
        validate_session_id(session)
        try:
            return _decoder.decode((self._records / f"{session}.json").read_bytes())
        except (OSError, msgspec.MsgspecError):
            return None

    def remove(self, session: str) -> None:
        validate_session_id(session)
        record_path = self._records / f"{session}.json"
        if not record_path.exists():
            raise RequestRejected(f"session {session!r} does not exist")
        shutil.rmtree(self._sessions / session, ignore_errors=True)
        record_path.unlink(missing_ok=True)

    def load_all(self) -> Iterator[SessionRecord]:
        """Every valid persisted record; a damaged one is logged and skipped, never fatal."""
        for path in sorted(self._records.glob("*.json")):
            try:
                record = _decoder.decode(path.read_bytes())
                validate_session_id(record.session)
                if path.stem != record.session:
                    raise ValueError("file name does not match the session id")
            except (OSError, msgspec.MsgspecError, ValueError, RequestRejected) as exc:
                log.error("skipping damaged session record", path=str(path), reason=str(exc))
                continue
            yield record


class SessionState(enum.Enum):
    NEW = "new"  # created, socket not bound yet
    OPEN = "open"  # bound and answering
    CLOSED = "closed"  # closed; its socket and record are gone


class Session:
    """One ColdSnap operation's socket: its record, and the server task answering on it."""

    def __init__(self, record: SessionRecord, server_for: ServerFactory) -> None:
        self.record = record
        self._server_for = server_for
        self._scope = anyio.CancelScope()
        self._server: ConnectionServer | None = None
        self.state = SessionState.NEW

    async def run(self, sock: socket.socket, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the session's socket until :meth:`aclose` (owned by the manager's task group)."""
        with self._scope:
            try:
                listener = await SocketListener.from_socket(sock)
            except BaseException:
                sock.close()
                raise
            self._server = self._server_for(self.record, listener)
            self.state = SessionState.OPEN
            await self._server.serve(task_status=task_status)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.stop_accepting()

    async def aclose(self) -> None:
        """Stop serving at once (in-flight requests are cancelled); safe to call twice."""
        self.state = SessionState.CLOSED
        self._scope.cancel()


ServerFactory = Callable[[SessionRecord, SocketListener], ConnectionServer]


class SessionManager:
    """The one owner of session records, the live table and the uid rule."""

    def __init__(self, store: SessionStore, server_for: ServerFactory, *, max_per_uid: int) -> None:
        self.store = store
        self._server_for = server_for
        self._max_per_uid = max_per_uid
        self._live: dict[str, Session] = {}
        self._task_group: anyio.abc.TaskGroup | None = None

    def __len__(self) -> int:
        return len(self._live)

    async def start(self, *, task_group: anyio.abc.TaskGroup) -> None:
        """Re-serve every persisted session; one that cannot be bound is logged and skipped."""
        self._task_group = task_group
        for record in self.store.load_all():
            try:
                await self._serve(record)
            except (OSError, OverflowError, ValueError) as exc:
                log.error("could not re-bind session socket", session=record.session, error=str(exc))

    async def _serve(self, record: SessionRecord) -> None:
        if self._task_group is None:
            raise RuntimeError("the session manager has not been started")
        sock = self.store.bind_socket(record)
        session = Session(record, self._server_for)
        await self._task_group.start(self._run, session, sock)

    async def _run(self, session: Session, sock: socket.socket, *, task_status: TaskStatus[None]) -> None:
        self._live[session.record.session] = session
        try:
            await session.run(sock, task_status=task_status)
        finally:
            if self._live.get(session.record.session) is session:
                del self._live[session.record.session]

    async def open(
        self, session: str, *, hosts: list[str], uid: int, gid: int, labels: dict[str, str], cluster_id: str
    ) -> tuple[SessionRecord, str]:
        """Persist and serve a new session; nothing is left behind if it cannot be served."""
        held = sum(live.record.uid == uid for live in self._live.values())
        if not is_admin(uid) and held >= self._max_per_uid:
            raise RequestRejected(f"uid {uid} already holds {held} sessions (server.max_sessions_per_uid); "
                                  "close one first")
        record, token = self.store.create(session, hosts=hosts, uid=uid, gid=gid, labels=labels,
                                          cluster_id=cluster_id)
        try:
            await self._serve(record)
        except OSError as exc:  # e.g. out of descriptors: refused, not an internal error
            self.store.remove(session)
            raise RequestRejected(f"session {session!r} cannot be served now: {exc.strerror or exc}") from exc
        except BaseException:
            self.store.remove(session)
            raise
        log.info("session opened", session=session, hosts=hosts, owner_uid=uid)
        return record, token

    async def close(self, session: str, *, uid: int) -> None:
        """Close a session its caller owns (root and the daemon's uid own every one)."""
        live = self._live.get(session)
        record = live.record if live is not None else self.store.load(session)
        if record is not None and not (is_admin(uid) or record.uid == uid):
            raise RequestRejected(f"session {session!r} belongs to another user")
        self.store.remove(session)  # raises, changing nothing, when the session does not exist
        if live is not None:
            # Gone from listings now: the session's task leaves the table only once it has unwound.
            del self._live[session]
            await live.aclose()
        log.info("session closed", session=session)

    def visible_to(self, uid: int) -> list[SessionRecord]:
        return [live.record for live in self._live.values() if is_admin(uid) or live.record.uid == uid]

    def stop_accepting(self) -> None:
        for live in list(self._live.values()):
            live.stop_accepting()

"""Sessions: one ColdSnap operation = id + token + authorized hosts (+ manager labels).

On disk (survives a daemon restart)::

    <state>/records/<id>.json           0600, daemon-owned; the token only as its SHA-256
    <state>/sessions/<id>/              0700, owned by the uid that opened the session
    <state>/sessions/<id>/provider.sock 0600, same owner
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import structlog

from coldsnap_runtime.errors import RequestRejected

__all__ = ("SOCKET_NAME", "SessionRecord", "SessionStore", "hosts_from_request", "validate_session_id")

log = structlog.get_logger(__name__)

SOCKET_NAME = "provider.sock"
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SUN_PATH_MAX = 107  # Linux sun_path is 108 bytes including the NUL


class SessionRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    session: str
    token_sha256: str
    hosts: list[str]
    uid: int
    gid: int
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
    if not _SESSION_ID.match(session):
        raise RequestRejected(
            f"session id {session!r} is invalid: it must match {_SESSION_ID.pattern} "
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

    def prepare(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Traversable by session owners, not listable.
        os.chmod(self.state_dir, 0o711)
        self._records.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self._records, 0o700)
        self._sessions.mkdir(mode=0o711, exist_ok=True)
        os.chmod(self._sessions, 0o711)

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
        try:
            fd = os.open(record_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise RequestRejected(f"session {session!r} already exists") from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_encoder.encode(record))
                f.flush()
                os.fsync(f.fileno())
            self._make_private_dir(session, uid, gid)
        except BaseException:
            record_path.unlink(missing_ok=True)
            shutil.rmtree(self._sessions / session, ignore_errors=True)
            raise
        return record, token

    def _make_private_dir(self, session: str, uid: int, gid: int) -> None:
        directory = self._sessions / session
        if directory.exists():
            shutil.rmtree(directory)  # left over from a session whose record is gone
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)
        if (uid, gid) != (os.geteuid(), os.getegid()):
            os.chown(directory, uid, gid)

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

"""The SSH link to one remote node: one kept-alive asyncssh connection, opened on first use.

It is re-opened after a failure and closed at shutdown. The host key is checked strictly against the
entry's ``known_hosts`` as a plain key: no OpenSSH host certificates (a ``@cert-authority`` line would
let its CA vouch for any host) and no X.509 trust. The connection also forwards a private local Unix
socket to the node's Docker Engine socket (:mod:`._remote_docker` talks to it).

Errors: every failure of the link (asyncssh, OSError, timeouts) becomes a :class:`RemoteUnavailable`
naming the host, in :meth:`RemoteLink.link_errors`, the one place asyncssh errors are translated.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import asyncssh
import structlog

from coldsnap_runtime.errors import BackendError

from ._config import RemoteConfig

__all__ = ("HOST_KEY_ALGORITHMS", "RemoteLink", "RemoteUnavailable")

log = structlog.get_logger(__name__)

_KEEPALIVE_COUNT = 3
# Plain host keys only (no *-cert-v01@openssh.com, no x509v3-*): the key itself must be in known_hosts.
HOST_KEY_ALGORITHMS = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
                       "rsa-sha2-512", "rsa-sha2-256")


class RemoteUnavailable(BackendError):
    """The remote node's sshd could not be reached, refused us, or the link dropped (names the host)."""

    def __init__(self, *, host: str, action: str, detail: str) -> None:
        super().__init__(f"{action} failed: remote host {host}: {detail}", action=action)
        self.host, self.detail = host, detail


class _State(enum.Enum):
    NEW = "new"  # constructed; nothing opened
    OPEN = "open"  # usable; the SSH connection opens on first use
    CLOSED = "closed"  # closed; every use raises ClosedResourceError


class _Client(asyncssh.SSHClient):
    """Notices a dropped link at once (the keepalive notices a silent one)."""

    def __init__(self) -> None:
        self.lost = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class RemoteLink:
    """One `[[remote]]` entry's connection; `docker_path` is the local end of the forwarded engine socket."""

    def __init__(self, config: RemoteConfig, *, work_dir: Path) -> None:
        self.config = config
        self.name = config.hosts[0]
        self.work_dir = work_dir
        self.docker_path = work_dir / "docker.sock"
        self._state = _State.NEW
        self._lock = anyio.Lock()
        self._conn: asyncssh.SSHClientConnection | None = None
        self._client: _Client | None = None
        # Session channels at once (sshd's MaxSessions, 10 by default): exec, SFTP and our helper commands.
        self.sessions = anyio.CapacityLimiter(config.max_sessions)
        self.last_error = ""

    def open(self) -> None:
        if self._state is not _State.NEW:
            raise RuntimeError(f"remote {self.name} was already opened")
        self._state = _State.OPEN

    async def aclose(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        with anyio.CancelScope(shield=True):
            await self._drop()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            with anyio.move_on_after(5):
                await conn.wait_closed()
        self.docker_path.unlink(missing_ok=True)

    @property
    def connected(self) -> bool:
        return self._conn is not None and not (self._client is not None and self._client.lost)

    @contextmanager
    def link_errors(self, action: str) -> Iterator[None]:
        """The one place SSH-side failures become ours; all of them name the host."""
        cfg = self.config
        try:
            yield
        except asyncssh.HostKeyNotVerifiable as exc:
            self.last_error = f"host key not accepted ({exc.reason})"
            log.error("remote host key refused", host=self.name, address=cfg.address, error=exc.reason)
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"host key of {cfg.address}:{cfg.port} is not in {cfg.known_hosts} "
                f"or has changed; refusing to connect ({exc.reason})")) from exc
        except asyncssh.PermissionDenied as exc:
            self.last_error = "authentication failed"
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"{cfg.user}@{cfg.address} refused our key ({exc.reason})")) from exc
        except asyncssh.ConnectionLost as exc:
            self.last_error = "link dropped"
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"the SSH link dropped ({exc.reason}); what ran there is cleaned up once it is back")) from exc
        except (asyncssh.Error, asyncssh.SFTPError) as exc:
            reason = getattr(exc, "reason", "") or str(exc) or type(exc).__name__
            self.last_error = reason
            raise RemoteUnavailable(host=self.name, action=action, detail=f"SSH failed: {reason}") from exc
        except TimeoutError as exc:
            self.last_error = "timed out"
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"sshd at {cfg.address}:{cfg.port} did not answer within {cfg.connect_timeout_s:g} s")) from exc
        except OSError as exc:
            self.last_error = exc.strerror or str(exc)
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"cannot reach sshd at {cfg.address}:{cfg.port}: {exc.strerror or exc}")) from exc

    async def connect(self, action: str) -> asyncssh.SSHClientConnection:
        """The live connection, opened (or re-opened after a failure) on demand."""
        if self._state is not _State.OPEN:
            raise anyio.ClosedResourceError
        async with self._lock:
            if self._conn is not None and self.connected:
                return self._conn
            if self._conn is not None:
                log.warning("remote link lost; reconnecting", host=self.name)
                await self._drop()
            for directory in (self.work_dir.parent, self.work_dir):  # private: the forwarded engine socket
                directory.mkdir(mode=0o700, exist_ok=True)
                os.chmod(directory, 0o700)
            with self.link_errors(action):
                client = _Client()
                conn = await self._open(client)
                try:
                    self.docker_path.unlink(missing_ok=True)
                    await conn.forward_local_path(str(self.docker_path), self.config.docker_socket)
                    os.chmod(self.docker_path, 0o600)
                except BaseException:
                    conn.close()
                    raise
            self._conn, self._client, self.last_error = conn, client, ""
            log.info("remote connected", host=self.name, address=self.config.address)
            return conn

    async def _open(self, client: _Client) -> asyncssh.SSHClientConnection:
        cfg = self.config
        with anyio.fail_after(cfg.connect_timeout_s * 2):  # connect + login, each bounded below
            conn, _ = await asyncssh.create_connection(
                lambda: client, cfg.address, port=cfg.port, username=cfg.user,
                client_keys=[cfg.identity_file], known_hosts=cfg.known_hosts, config=[],
                server_host_key_algs=list(HOST_KEY_ALGORITHMS), x509_trusted_certs=None,
                agent_path=None, password_auth=False, kbdint_auth=False, host_based_auth=False,
                gss_auth=False, connect_timeout=cfg.connect_timeout_s, login_timeout=cfg.connect_timeout_s,
                keepalive_interval=cfg.keepalive_interval_s, keepalive_count_max=_KEEPALIVE_COUNT)
        return conn

    async def run_quiet(self, command: str) -> int:
        """A helper command on the node (ours, not a manager's); its exit status. Needs a live link."""
        conn = self._conn
        if conn is None or not self.connected:
            raise RemoteUnavailable(host=self.name, action="cleanup", detail="not connected")
        async with self.sessions:
            with self.link_errors("cleanup"):
                result = await conn.run(command, check=False, encoding=None, stdin=asyncssh.DEVNULL)
        return int(result.exit_status or 0)

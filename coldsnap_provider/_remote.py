"""Hosts beyond this node: one SSH connection per remote, exec there, its Docker Engine, files over SFTP.

A remote node needs only ``sshd`` and ``dockerd``. Per ``[[remote]]`` entry, :class:`RemoteNode` keeps one
asyncssh connection (opened on first use, kept alive, re-opened after a failure, closed at shutdown; host keys
checked strictly against the entry's ``known_hosts``). Over it:

* ``exec`` runs the exact argv through the remote login shell, each argument ``shlex``-quoted; a small
  prelude reports the process's pid and start time on stderr first, so a cancelled or failed exec can kill
  the remote process group from a second channel, or, when the link is down, once it returns;
* ``runtime`` actions go to the remote Engine API through a local Unix socket (in a 0700 directory of the
  state directory) forwarded to the remote ``docker_socket``, with the same :class:`DockerBackend`;
* ``upload`` and ``workload-copy-from`` write on the remote host over SFTP as the SSH user
  (:mod:`._remote_files`).

Errors: every failure of the link (asyncssh, OSError, timeouts) becomes a :class:`RemoteUnavailable` naming
the host, in :meth:`RemoteNode._link_errors`, the one place asyncssh errors are translated.
"""

from __future__ import annotations

import enum
import hashlib
import os
import posixpath
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import asyncssh
import structlog

from coldsnap_runtime import OUTPUT_LIMIT, Backend, Owner, RuntimeContext, dispatch
from coldsnap_runtime.backend import DockerBackend
from coldsnap_runtime.errors import (
    BackendError,
    BackendUnavailable,
    ColdsnapError,
    OutputTooLarge,
    RequestRejected,
    RuntimeFailed,
)
from coldsnap_runtime.schema import ImageBuild, RuntimeRequest, RuntimeResponse

from ._config import RemoteConfig
from ._envelope import Exec, OciPull, OciPush, Runtime, Upload
from ._errors import PlacementError
from ._exec import ExecIdentity, ExecResult, as_identity, child_environment
from ._framing import charge
from ._operations import Operation, Outcome, legacy_registry_action
from ._remote_files import place_tar

__all__ = ("RemoteNode", "RemoteUnavailable", "Remotes")

log = structlog.get_logger(__name__)

_KILL_BUDGET_S = 20.0
_STATUS_BUDGET_S = 5.0
_KEEPALIVE_COUNT = 3
_MARKER = b"coldsnap-exec "
_MAX_MARKER = 256
# Prints "coldsnap-exec <pid> <start time in ticks>" on stderr, then becomes the program. sshd made the shell
# a session (and process group) leader, so the program and its children share that group.
_PRELUDE = (
    "printf 'coldsnap-exec %s %s\\n' \"$$\" \"$(sed 's/.*) //' /proc/$$/stat 2>/dev/null | cut -d' ' -f20)\" >&2;"
)
# Kills process group PID if its leader is still the process that started at START (pid reuse is not us).
_KILL = (
    "p={pid}; s={start}; t=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f20);"
    " [ -n \"$t\" ] && [ \"$t\" = \"$s\" ] || exit 3;"
    " kill -TERM -- -$p 2>/dev/null; i=0;"
    " while [ $i -lt 50 ] && kill -0 -- -$p 2>/dev/null; do sleep 0.1; i=$((i+1)); done;"
    " kill -KILL -- -$p 2>/dev/null; exit 0"
)


class RemoteUnavailable(BackendError):
    """The remote node's sshd could not be reached, refused us, or the link dropped (names the host)."""

    def __init__(self, *, host: str, action: str, detail: str) -> None:
        super().__init__(f"{action} failed: remote host {host}: {detail}", action=action)
        self.host, self.detail = host, detail


def remote_command(argv: list[str], *, combined: bool) -> str:
    """The shell command line that makes the remote login shell exec exactly `argv`."""
    if any("\x00" in a for a in argv):
        raise RequestRejected("exec arguments must not contain NUL")
    # bash's `exec` takes options (so `--` ends them); dash's takes none (and would run a program named `--`).
    words = " ".join(shlex.quote(a) for a in argv)
    return f"{_PRELUDE} exec ${{BASH_VERSION:+--}} {words}" + (" 2>&1" if combined else "")


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


class _RemoteDocker(DockerBackend):
    """The node's Docker Engine over the forwarded socket; host paths are on the remote node."""

    def __init__(self, node: RemoteNode, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._node = node

    async def workload_copy_from(self, name: str, path: str, destination: str, *,
                                 owner: Owner | None = None) -> None:
        """Fetch through the engine into a private local staging tree, then place it remotely over SFTP.

        On the remote node every write is the SSH user's (the identity remote exec runs as); `owner`, a local
        identity, does not apply there.
        """
        with tempfile.TemporaryDirectory(dir=self._node.work_dir, prefix="copy-") as staging:
            root = posixpath.basename(path) or "root"
            await super().workload_copy_from(name, path, os.path.join(staging, root))
            await self._node.place_local_tree(os.path.join(staging, root), root, destination,
                                              action="workload-copy-from")

    async def image_build(self, build: ImageBuild, *, owner: Owner | None = None) -> None:
        """The context directories are on the remote node: fetch them (SFTP, no links followed), then build.

        The fetch reads as the SSH user (the identity remote exec runs as); the fetched copy is the
        daemon's own, so it is packed as the daemon: `owner`, a local identity, does not apply there.
        """
        import msgspec

        with tempfile.TemporaryDirectory(dir=self._node.work_dir, prefix="build-") as staging:
            context = await self._node.fetch_tree(build.context, os.path.join(staging, "context"))
            contexts = {key: await self._node.fetch_tree(value, os.path.join(staging, f"context-{i}"))
                        for i, (key, value) in enumerate(sorted(build.contexts.items()))}
            await super().image_build(msgspec.structs.replace(build, context=context, contexts=contexts))

    async def _kill_exec(self, exec_id: str) -> None:
        """The exec's pid is in the remote node's namespace: kill it there, never a local process."""
        with anyio.move_on_after(_KILL_BUDGET_S, shield=True):
            try:
                state = await self.docker.containers.exec(exec_id).inspect()
            except Exception as exc:  # engine or link gone: the exec dies with its engine connection
                log.warning("cannot inspect the cancelled remote exec", error=str(exc))
                return
            pid = int(state.get("Pid") or 0)
            if state.get("Running") and pid > 0:
                await self._node.run_quiet(f"kill -KILL {pid}")


class RemoteNode:
    """One `[[remote]]` entry: its SSH connection, Docker backend and pending cleanups."""

    def __init__(self, config: RemoteConfig, *, work_dir: Path, credentials_file: str | None = None,
                 spool_dir: str | None = None) -> None:
        self.config = config
        self.name = config.hosts[0]
        self.work_dir = work_dir
        self._state = _State.NEW
        self._lock = anyio.Lock()
        self._conn: asyncssh.SSHClientConnection | None = None
        self._client: _Client | None = None
        self._forward: asyncssh.SSHListener | None = None
        self._docker_path = work_dir / "docker.sock"
        # Its own instance id (RPC-owned leftovers of an earlier daemon are recovered on first connect) and
        # image ledger (image-remove touches only what this provider pulled, built or tagged there).
        self._docker = _RemoteDocker(self, url=f"unix://{self._docker_path}", credentials_file=credentials_file,
                                     spool_dir=spool_dir, image_ledger=work_dir / "images.json",
                                     instance=hashlib.sha256(os.fsencode(work_dir.absolute())).hexdigest()[:16])
        self._recovered = False
        # Session channels at once (sshd's MaxSessions, 10 by default): exec, SFTP and our helper commands.
        self.sessions = anyio.CapacityLimiter(config.max_sessions)
        # (pid, start) of remote exec process groups to kill once the link is back.
        self._pending_kills: set[tuple[int, str]] = set()
        self.last_error = ""

    # --- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> RemoteNode:
        if self._state is not _State.NEW:
            raise RuntimeError(f"remote {self.name} was already opened")
        await self._docker.__aenter__()
        self._state = _State.OPEN
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        with anyio.CancelScope(shield=True):
            await self._docker.aclose()
            await self._drop()

    async def _drop(self) -> None:
        conn, self._conn, self._forward = self._conn, None, None
        if conn is not None:
            conn.close()
            with anyio.move_on_after(5):
                await conn.wait_closed()
        self._docker_path.unlink(missing_ok=True)

    @property
    def connected(self) -> bool:
        return self._conn is not None and not (self._client is not None and self._client.lost)

    # --- the link ------------------------------------------------------------------------

    @contextmanager
    def _link_errors(self, action: str) -> Iterator[None]:
        """The one place SSH-side failures become ours; all of them name the host."""
        try:
            yield
        except asyncssh.HostKeyNotVerifiable as exc:
            self.last_error = f"host key not accepted ({exc.reason})"
            log.error("remote host key refused", host=self.name, address=self.config.address, error=exc.reason)
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"host key of {self.config.address}:{self.config.port} is not in {self.config.known_hosts} "
                f"or has changed; refusing to connect ({exc.reason})")) from exc
        except asyncssh.PermissionDenied as exc:
            self.last_error = "authentication failed"
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"{self.config.user}@{self.config.address} refused our key ({exc.reason})")) from exc
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
                f"sshd at {self.config.address}:{self.config.port} did not answer within "
                f"{self.config.connect_timeout_s:g} s")) from exc
        except OSError as exc:
            self.last_error = exc.strerror or str(exc)
            raise RemoteUnavailable(host=self.name, action=action, detail=(
                f"cannot reach sshd at {self.config.address}:{self.config.port}: {exc.strerror or exc}")) from exc

    async def connection(self, action: str) -> asyncssh.SSHClientConnection:
        """The live connection, opened (or re-opened after a failure) on demand."""
        if self._state is not _State.OPEN:
            raise anyio.ClosedResourceError
        async with self._lock:
            if self._conn is not None and self.connected:
                return self._conn
            if self._conn is not None:
                log.warning("remote link lost; reconnecting", host=self.name)
                await self._drop()
            cfg = self.config
            for directory in (self.work_dir.parent, self.work_dir):  # private: the forwarded engine socket
                directory.mkdir(mode=0o700, exist_ok=True)
                os.chmod(directory, 0o700)
            with self._link_errors(action):
                client = _Client()
                with anyio.fail_after(cfg.connect_timeout_s * 2):  # connect + login, each bounded below
                    conn, _ = await asyncssh.create_connection(
                        lambda: client, cfg.address, port=cfg.port, username=cfg.user,
                        client_keys=[cfg.identity_file], known_hosts=cfg.known_hosts, config=[],
                        agent_path=None, password_auth=False, kbdint_auth=False, host_based_auth=False,
                        gss_auth=False, connect_timeout=cfg.connect_timeout_s, login_timeout=cfg.connect_timeout_s,
                        keepalive_interval=cfg.keepalive_interval_s, keepalive_count_max=_KEEPALIVE_COUNT)
                try:
                    self._docker_path.unlink(missing_ok=True)
                    self._forward = await conn.forward_local_path(str(self._docker_path), cfg.docker_socket)
                    os.chmod(self._docker_path, 0o600)
                except BaseException:
                    conn.close()
                    raise
            self._conn, self._client, self.last_error = conn, client, ""
            log.info("remote connected", host=self.name, address=cfg.address)
        if not self._recovered:
            with anyio.move_on_after(_KILL_BUDGET_S):
                try:
                    await self._docker.recover()
                    self._recovered = True
                except BackendError as exc:
                    log.warning("remote leftovers not recovered yet", host=self.name, error=str(exc))
        if self._pending_kills:  # the link is back: first end what was abandoned while it was down
            with anyio.move_on_after(_KILL_BUDGET_S):
                try:
                    await self._run_pending_kills()
                except RemoteUnavailable as exc:
                    log.warning("remote exec not killed yet; will retry", host=self.name, error=str(exc))
        return conn

    # --- exec ----------------------------------------------------------------------------

    async def exec(self, argv: list[str], *, stdin: bytes = b"", combined: bool = False) -> ExecResult:
        """Run exactly `argv` on the node as the SSH user; 127/126 as locally; cancellation kills it there."""
        command = remote_command(argv, combined=combined)
        conn = await self.connection("exec")
        marker: list[tuple[int, str]] = []
        try:
            async with self.sessions:  # the channel is released before any kill below needs one
                with self._link_errors("exec"):
                    process = await conn.create_process(command, encoding=None)
                try:
                    with self._link_errors("exec"):
                        stdout, stderr = await self._collect(process, stdin, marker)
                        await process.wait_closed()
                finally:
                    process.close()
            status, signal_name = process.exit_status, process.exit_signal
            if status is None or (status < 0 and signal_name is None):
                raise RemoteUnavailable(host=self.name, action="exec", detail=(
                    "the SSH link dropped before the program finished; it is killed once the link is back"))
        except BaseException:
            if marker:
                with anyio.CancelScope(shield=True):
                    await self._kill(*marker[0])
            raise
        code = 128 + _signal_number(signal_name[0]) if signal_name is not None else status
        return ExecResult(code, stdout, stderr)

    async def _collect(self, process: asyncssh.SSHClientProcess[bytes], stdin: bytes,
                       marker: list[tuple[int, str]]) -> tuple[bytes, bytes]:
        out, err = bytearray(), bytearray()
        head = bytearray()  # stderr until the prelude's line is complete
        reading_head = True

        failure: list[BaseException] = []  # raised here, in this task, not as a group from the children

        async def feed() -> None:
            try:
                if stdin:
                    process.stdin.write(stdin)
                    await process.stdin.drain()
                process.stdin.write_eof()
            except (asyncssh.Error, OSError):
                pass  # the program stopped reading (or the link broke, which the readers report)

        async def drain(reader: asyncssh.SSHReader[bytes], buf: bytearray, *, is_stderr: bool) -> None:
            nonlocal reading_head
            try:
                while chunk := await reader.read(1 << 16):
                    if is_stderr and reading_head:
                        head.extend(chunk)
                        if b"\n" not in head and len(head) < _MAX_MARKER:
                            continue
                        reading_head = False
                        line, sep, rest = bytes(head).partition(b"\n")
                        found = _parse_marker(line) if sep else []
                        marker.extend(found)
                        chunk = rest if found else bytes(head)
                    buf.extend(chunk)
                    if len(out) + len(err) > OUTPUT_LIMIT:
                        raise OutputTooLarge(action="exec", limit=OUTPUT_LIMIT)
                    charge(len(chunk))  # the daemon's byte budget, as for a local exec
            except (asyncssh.Error, OSError, ColdsnapError) as exc:
                failure.append(exc)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            tg.start_soon(lambda: drain(process.stdout, out, is_stderr=False))
            tg.start_soon(lambda: drain(process.stderr, err, is_stderr=True))
        if failure:
            raise failure[0]
        if reading_head:  # stderr ended inside its first line: not ours
            err[:0] = head
        return bytes(out), bytes(err)

    async def _kill(self, pid: int, start: str) -> None:
        """Kill a remote exec's process group now, or once the link is back."""
        self._pending_kills.add((pid, start))
        with anyio.move_on_after(_KILL_BUDGET_S) as scope:
            try:
                if self.connected:
                    await self._run_pending_kills()
            except RemoteUnavailable as exc:
                log.warning("remote exec not killed yet; will retry when the link is back", host=self.name,
                            error=str(exc))
        if scope.cancelled_caught:
            log.error("killing a remote exec timed out; will retry", host=self.name)

    async def _run_pending_kills(self) -> None:
        for pid, start in sorted(self._pending_kills):
            code = await self.run_quiet(_KILL.format(pid=pid, start=shlex.quote(start or "")))
            self._pending_kills.discard((pid, start))
            log.info("remote exec killed" if code == 0 else "remote exec already gone", host=self.name, pid=pid)

    async def run_quiet(self, command: str) -> int:
        """A helper command on the node (ours, not a manager's); its exit status."""
        conn = self._conn
        if conn is None or not self.connected:
            raise RemoteUnavailable(host=self.name, action="cleanup", detail="not connected")
        async with self.sessions:
            with self._link_errors("cleanup"):
                result = await conn.run(command, check=False, encoding=None, stdin=asyncssh.DEVNULL)
        return int(result.exit_status or 0)

    @property
    def pending_kills(self) -> int:
        return len(self._pending_kills)

    # --- runtime -------------------------------------------------------------------------

    async def runtime(self, request: RuntimeRequest, ctx: RuntimeContext) -> RuntimeResponse:
        await self.connection("runtime")
        backend: Backend = self._docker
        try:
            return await dispatch(backend, request, ctx)
        except BackendUnavailable as exc:  # the forwarded engine socket: the link or the remote dockerd
            raise RemoteUnavailable(host=self.name, action=exc.action, detail=(
                f"its Docker Engine ({self.config.docker_socket}) is unreachable: {exc.detail}")) from exc

    # --- files ---------------------------------------------------------------------------

    async def _sftp_place(self, archive_path: str, root: str, destination: str, *, action: str) -> None:
        conn = await self.connection(action)
        archive = await anyio.to_thread.run_sync(lambda: open(archive_path, "rb"))  # noqa: SIM115 - closed below
        try:
            with self._link_errors(action):
                async with self.sessions, conn.start_sftp_client() as sftp:
                    try:
                        await place_tar(sftp, archive, root, destination)
                    except PlacementError as exc:
                        raise RuntimeFailed(action=action, detail=str(exc)) from exc
                    except asyncssh.SFTPError as exc:
                        raise RuntimeFailed(action=action, detail=f"on host {self.name}: {exc.reason}") from exc
        finally:
            archive.close()

    async def place_local_tree(self, local: str, root: str, destination: str, *, action: str) -> None:
        """Send a private local tree (already checked) to `destination` on the node."""
        import tarfile

        fd, archive = tempfile.mkstemp(dir=self.work_dir, prefix="tree-", suffix=".tar")
        os.close(fd)
        try:
            def pack() -> None:
                with tarfile.open(archive, "w") as tar:
                    tar.add(local, arcname=root, recursive=True)

            await anyio.to_thread.run_sync(pack)
            await self._sftp_place(archive, root, destination, action=action)
        finally:
            os.unlink(archive)

    async def upload(self, sources: list[str], destination: str, *, recursive: bool,
                     identity: ExecIdentity) -> None:
        """`cp [-R] SOURCES DESTINATION` from this node (read as exec.user) to the remote node (SFTP)."""
        conn = await self.connection("upload")
        if len(sources) > 1:
            with self._link_errors("upload"):
                async with self.sessions, conn.start_sftp_client() as sftp:
                    if not await sftp.isdir(destination):
                        raise RuntimeFailed(action="upload", detail=f"target {destination} is not a directory")
        for source in sources:
            parent, base = os.path.split(source.rstrip("/") or "/")
            if not base:
                raise RuntimeFailed(action="upload", detail="cannot copy /")
            fd, archive = tempfile.mkstemp(dir=self.work_dir, prefix="upload-", suffix=".tar")
            try:
                code, message = await _tar_as(identity, parent or "/", base, fd, recursive=recursive)
                os.close(fd)
                fd = -1
                if code != 0:
                    raise RuntimeFailed(action="upload", detail=f"cannot read {source}: {message}")
                if not recursive and await anyio.to_thread.run_sync(_first_is_dir, archive):
                    raise RuntimeFailed(action="upload", detail=f"-r not specified; omitting directory {source}")
                await self._sftp_place(archive, base, destination, action="upload")
            finally:
                if fd >= 0:
                    os.close(fd)
                os.unlink(archive)

    async def fetch_tree(self, remote: str, local: str) -> str:
        """Copy a remote directory tree here (symbolic links kept as links, never followed)."""
        conn = await self.connection("image-build")
        with self._link_errors("image-build"):
            async with self.sessions, conn.start_sftp_client() as sftp:
                try:
                    await sftp.get(remote, local, recurse=True, follow_symlinks=False)
                except asyncssh.SFTPError as exc:
                    raise RuntimeFailed(action="image-build", detail=(
                        f"build context {remote} on host {self.name}: {exc.reason}")) from exc
        return local

    # --- status --------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        cfg = self.config
        entry: dict[str, Any] = {"hosts": list(cfg.hosts), "address": cfg.address, "port": cfg.port,
                                 "user": cfg.user, "reachable": False, "rtt_ms": None, "error": "",
                                 "pending_kills": len(self._pending_kills)}
        with anyio.move_on_after(min(_STATUS_BUDGET_S, cfg.connect_timeout_s * 2)) as scope:
            try:
                await self.connection("status")
                started = time.perf_counter()
                await self.run_quiet(":")
                entry["rtt_ms"] = round((time.perf_counter() - started) * 1000, 3)
                entry["reachable"] = True
            except RemoteUnavailable as exc:
                entry["error"] = str(exc)
        if scope.cancelled_caught:
            entry["error"] = f"remote host {self.name}: no answer within {_STATUS_BUDGET_S:g} s"
        entry["docker_reachable"] = entry["reachable"] and await self._docker.ping()
        return entry

    async def maintain(self) -> None:
        """Retry what waits for the link (kills of abandoned execs) and the backend's deferred removals."""
        if self._pending_kills and not self.connected:
            try:
                await self.connection("cleanup")  # reconnecting runs the pending kills
            except RemoteUnavailable:
                return
        if self.connected:
            await self._docker.maintain()


class Remotes:
    """Every configured remote node, by ColdSnap host name; an async context manager."""

    def __init__(self, configs: list[RemoteConfig], *, state_dir: Path, credentials_file: str | None = None,
                 spool_dir: str | None = None) -> None:
        self._nodes = [RemoteNode(c, work_dir=state_dir / "remotes" / str(i), credentials_file=credentials_file,
                                  spool_dir=spool_dir) for i, c in enumerate(configs)]
        self._by_host = {host: node for node in self._nodes for host in node.config.hosts}

    @property
    def hosts(self) -> frozenset[str]:
        return frozenset(self._by_host)

    def serves(self, host: str) -> bool:
        return host in self._by_host

    def link_states(self) -> list[tuple[str, bool]]:
        """(host, its node's SSH link is up) for every configured host: coldsnap_provider_remote_up."""
        return [(host, node.connected) for host, node in sorted(self._by_host.items())]

    def node(self, host: str) -> RemoteNode:
        return self._by_host[host]

    async def __aenter__(self) -> Remotes:
        entered: list[RemoteNode] = []
        try:
            for node in self._nodes:
                await node.__aenter__()
                entered.append(node)
        except BaseException:
            for node in entered:
                await node.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for node in self._nodes:
            await node.aclose()

    async def run(self, request: Operation, ctx: RuntimeContext, identity: ExecIdentity) -> Outcome:
        """One authorized operation for a host this object serves (Operations routes them here)."""
        node = self.node(ctx.host)
        match request:
            case Exec():
                return await node.exec(request.arguments, stdin=request.input, combined=request.combined)
            case Upload():
                await node.upload(request.sources, request.destination, recursive=request.recursive,
                                  identity=identity)
                return None
            case Runtime():
                return await node.runtime(request.runtime, ctx)
            case OciPull() | OciPush():
                await node.runtime(legacy_registry_action(request), ctx)
                return None
        operation = str(type(request).__struct_config__.tag)
        raise RequestRejected(f"host-provider operation {operation!r} is not served for remote host {ctx.host!r}")

    async def status(self) -> list[dict[str, Any]]:
        """One entry per remote node: reachability and round trip of a no-op command (concurrently)."""
        results: list[dict[str, Any]] = [{} for _ in self._nodes]

        async def one(index: int, node: RemoteNode) -> None:
            results[index] = await node.status()

        async with anyio.create_task_group() as tg:
            for index, node in enumerate(self._nodes):
                tg.start_soon(one, index, node)
        return results

    async def maintain(self) -> None:
        for node in self._nodes:
            try:
                await node.maintain()
            except Exception:
                log.exception("remote maintenance failed", host=node.name)

    async def run_maintenance(self, interval_s: float = 10.0) -> None:
        """Periodic :meth:`maintain` (started by the daemon's task group)."""
        while True:
            await anyio.sleep(interval_s)
            await self.maintain()


def _parse_marker(line: bytes) -> list[tuple[int, str]]:
    if not line.startswith(_MARKER):
        return []
    fields = line[len(_MARKER):].decode("ascii", "replace").split(" ")
    if not fields or not fields[0].isdigit():
        return []
    return [(int(fields[0]), fields[1] if len(fields) > 1 and fields[1].isdigit() else "")]


def _signal_number(name: str) -> int:
    try:
        return int(signal.Signals[f"SIG{name}"])
    except KeyError:
        return 0


def _first_is_dir(archive: str) -> bool:
    import tarfile

    with tarfile.open(archive, "r:") as tar:
        first = tar.next()
        return first is not None and first.isdir()


async def _tar_as(identity: ExecIdentity, parent: str, base: str, fd: int, *, recursive: bool) -> tuple[int, str]:
    """`tar` of parent/base into `fd`, run as exec.user (so only what that user may read is sent)."""
    argv = ["tar", "-c", "-f", "-", "-C", parent, *([] if recursive else ["--no-recursion", "-h"]), "--", base]
    async with await anyio.open_process(as_identity(argv, identity), stdin=subprocess.DEVNULL, stdout=fd,
                                        stderr=subprocess.PIPE, env=child_environment(identity),
                                        start_new_session=True) as process:
        assert process.stderr is not None
        message = bytearray()
        async for chunk in process.stderr:
            message += chunk[: 4096 - len(message)]
        code = await process.wait()
    return code, message.decode("utf-8", "replace").strip()

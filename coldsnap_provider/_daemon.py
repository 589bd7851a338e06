"""The daemon: wiring and draining, nothing else.

Task ownership::

    Daemon.run ─┬─ control ConnectionServer ── its connections
                ├─ SessionManager: one Session task per session ── its ConnectionServer ── its connections
                ├─ metrics endpoint ── its connections; capsule report collector ([metrics])
                ├─ hang-up watcher, maintenance (backend and remote nodes), watchdog
                ├─ backend health probe ([metrics]: coldsnap_provider_backend_up)

Start: take the state directory's lock (one daemon per state directory), finish what a
killed predecessor left (process groups, RPC-owned containers), bind, re-serve sessions,
READY. Shutdown: stop every accept loop, let in-flight requests finish for
``shutdown_grace_s``, then cancel each one so that it still answers, then everything.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import grp
import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import structlog
from anyio.abc import SocketListener, TaskStatus

from coldsnap_runtime import CLEANUP_BUDGET_S, Backend, BackendError

from . import __version__
from ._audit import Audit
from ._config import Config, local_host_label
from ._control_handler import ControlHandler
from ._errors import ConfigError
from ._framing import ByteBudget
from ._health import BackendHealth
from ._hydrator_stages import HydratorStages
from ._listener import ConnectionServer, Limits, ServerState
from ._operations import Operations
from ._provider_handler import ProviderHandler
from ._sessions import SessionManager, SessionRecord, SessionStore
from ._systemd import notify, watchdog_interval

if TYPE_CHECKING:
    from coldsnap_runtime.backend import Captures

    from ._metrics import Metrics  # prometheus_client is needed only with [metrics] on
    from ._metrics_http import MetricsEndpoint

__all__ = ("Daemon",)

log = structlog.get_logger(__name__)

_ABORT_BUDGET_S = CLEANUP_BUDGET_S + 10.0  # a cancelled request's shielded cleanup, then its answer
_MAINTENANCE_S = 2.0
# Remote maintenance may reconnect (bounded by connect_timeout_s): less often than the local backend's.
_REMOTE_MAINTENANCE_S = 10.0
_RECOVER_S = 10.0


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        state_dir: Path,
        operations: Operations,
        backend: Backend,
        control_fd: int | None = None,
        metrics: Metrics | None = None,
        captures: Captures | None = None,
    ) -> None:
        self.config = config
        self.captures = captures  # this node's capture store (the control socket's capture verbs)
        self.metrics = metrics  # None: no [metrics] address
        self.state_dir = state_dir
        self.operations = operations
        self.backend = backend
        self._control_fd = control_fd
        self._stop = anyio.Event()
        server = config.server
        self.state = ServerState(
            Limits(max_connections=server.max_connections, max_connections_per_uid=server.max_connections_per_uid,
                   read_timeout_s=server.request_read_timeout_s, write_timeout_s=server.reply_write_timeout_s),
            ByteBudget(server.max_buffered_bytes, per_uid=server.max_buffered_bytes_per_uid),
        )
        self.sessions = SessionManager(SessionStore(state_dir), self._session_server,
                                       max_per_uid=server.max_sessions_per_uid)
        self.audit = Audit(config.audit.file)  # closed when run() ends
        self.health = BackendHealth(backend=backend, local_host=local_host_label(config), remotes=operations.remotes,
                                    kubernetes=operations.kubernetes)
        # The control socket's `reload`, set by serve: _reload.Reloader.reload (SIGHUP calls it too).
        self.reload: Callable[[], dict[str, list[str]]] | None = None
        # The node hydrators' own stage counts (their sockets are the operator's configuration).
        self.hydrator_stages = HydratorStages(config.metrics.hydrator_sockets) \
            if metrics is not None and config.metrics.hydrator_sockets else None
        if metrics is not None:
            remotes = operations.remotes
            metrics.watch(sessions=lambda: len(self.sessions), connections=lambda: self.state.connections,
                          remotes=remotes.link_states if remotes is not None else None, backends=self.health.states,
                          capture_tiers=captures.tier_stats if captures is not None and captures.store else None,
                          hydrator_stages=self.hydrator_stages.totals if self.hydrator_stages is not None else None)

    def stop(self) -> None:
        """Begin a graceful shutdown (safe to call more than once)."""
        self._stop.set()

    def _session_server(self, record: SessionRecord, listener: SocketListener) -> ConnectionServer:
        handler = ProviderHandler(record, self.operations, self.state, metrics=self.metrics, audit=self.audit)
        return ConnectionServer(listener, handler, self.state)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        _raise_descriptor_limit()
        with _single_instance(self.state_dir), contextlib.closing(self.audit):
            self.sessions.store.prepare()
            if self.operations.reports is not None:
                self.operations.reports.prepare()
            if self.operations.groups is not None:
                self.operations.groups.prepare()
                self.operations.groups.sweep()
            recovered = await self._recover()
            endpoint = await self._metrics_endpoint()  # bound before serving: a taken address stops the start
            control = ConnectionServer(
                await self._control_listener(),
                ControlHandler(self.config.server, sessions=self.sessions, operations=self.operations,
                               backend=self.backend, state=self.state, health=self.health, metrics=self.metrics,
                               audit=self.audit, reload=self.reload, captures=self.captures),
                self.state,
            )
            async with anyio.create_task_group() as tg:
                await tg.start(control.serve)
                if endpoint is not None:
                    await tg.start(endpoint.serve)
                    log.info("metrics endpoint", address=self.config.metrics.address)
                await self.sessions.start(task_group=tg)
                log.info("ready", version=__version__, state_dir=str(self.state_dir), sessions=len(self.sessions))
                notify("READY=1")
                task_status.started()
                tg.start_soon(self.state.watch_hangups)
                tg.start_soon(self._maintain, recovered)
                if self.operations.reports is not None:
                    tg.start_soon(self.operations.reports.run, self.backend)
                if self.metrics is not None:  # coldsnap_provider_backend_up stays current without a status call
                    tg.start_soon(functools.partial(self.health.run,
                                                    interval_s=self.config.metrics.backend_probe_interval_s))
                if self.hydrator_stages is not None:
                    tg.start_soon(functools.partial(self.hydrator_stages.run,
                                                    interval_s=self.config.metrics.backend_probe_interval_s))
                if (interval := watchdog_interval()) is not None:
                    tg.start_soon(_watchdog, interval)
                await self._stop.wait()
                notify("STOPPING=1")
                log.info("stopping", in_flight=self.state.in_flight)
                control.stop_accepting()
                self.sessions.stop_accepting()
                await self._drain()
                tg.cancel_scope.cancel()
        log.info("stopped")

    async def _metrics_endpoint(self) -> MetricsEndpoint | None:
        if self.metrics is None or not self.config.metrics.address:
            return None
        from ._metrics_http import MetricsEndpoint, open_listener

        return MetricsEndpoint(await open_listener(self.config.metrics.address), self.metrics)

    async def _drain(self) -> None:
        with anyio.move_on_after(self.config.server.shutdown_grace_s) as drain:
            await self.state.wait_drained()
        if drain.cancelled_caught:
            log.warning("shutdown grace expired; cancelling in-flight operations", in_flight=self.state.in_flight)
            self.state.cancel_in_flight()
            with anyio.move_on_after(_ABORT_BUDGET_S):
                await self.state.wait_drained()

    async def _control_listener(self) -> SocketListener:
        if self._control_fd is not None:
            return await SocketListener.from_socket(self._control_fd)
        path = self.state_dir / "control.sock"
        path.unlink(missing_ok=True)
        listener = await anyio.create_unix_listener(path, mode=0o660)
        if group := self.config.server.control_group:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            os.chown(path, -1, gid)  # the state directory is the daemon's alone: no one can race this path
        return listener

    async def _recover(self) -> bool:
        """Remove what RPCs of a killed predecessor left in the engine; False if it cannot be asked yet."""
        with anyio.move_on_after(_RECOVER_S):
            try:
                await self.backend.recover()
            except BackendError as exc:
                log.warning("backend recovery deferred", error=str(exc))
                return False
            return True
        log.warning("backend recovery deferred", error=f"no answer within {_RECOVER_S:g} s")
        return False

    async def _maintain(self, recovered: bool) -> None:
        """The one maintenance loop: deferred recovery if the engine was down at start and the backend's
        cleanups every 2 s; the remote nodes' pending kills and cleanups, and the Kubernetes hosts' recovery and
        cleanups, every 10 s."""
        remotes, kubernetes = self.operations.remotes, self.operations.kubernetes
        remote_due = anyio.current_time() + _REMOTE_MAINTENANCE_S
        while True:
            await anyio.sleep(_MAINTENANCE_S)
            try:
                recovered = recovered or await self._recover()
                await self.backend.maintain()
            except Exception:
                log.exception("backend maintenance failed")
            if anyio.current_time() >= remote_due:
                if remotes is not None:
                    await remotes.maintain()  # contains each node's failure
                if kubernetes is not None:
                    await kubernetes.maintain()  # likewise, per Kubernetes host
                remote_due = anyio.current_time() + _REMOTE_MAINTENANCE_S


async def _watchdog(interval: float) -> None:
    while True:
        notify("WATCHDOG=1")
        await anyio.sleep(interval)


@contextlib.contextmanager
def _single_instance(state_dir: Path) -> Iterator[None]:
    """Hold ``<state>/daemon.lock``: a second daemon on the same state directory refuses to start."""
    fd = os.open(state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(f"{state_dir} is already served by another coldsnap-provider (pid {holder})") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _raise_descriptor_limit() -> None:
    """Every connection and session socket is a descriptor: take the hard limit, not the default 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        log.info("descriptor limit raised", soft=soft, hard=hard)

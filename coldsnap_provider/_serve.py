"""The composition root of `coldsnap-provider serve`: build the backend, remotes, Kubernetes hosts, operations and
daemon, turn SIGTERM/SIGINT into a graceful stop and SIGHUP into a reload.

Task ownership::

    serve ─┬─ Daemon.run (everything the daemon owns, including the one maintenance loop)
           └─ signal watcher: SIGTERM/SIGINT → Daemon.stop(); SIGHUP → Reloader.reload() (_reload.py)

`cli.py` parses arguments, checks the configuration and calls :func:`serve` under ``anyio.run``.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from coldsnap_runtime import DockerBackend
from coldsnap_runtime.backend import GpuPolicy, HostPolicy

from ._capsule_reports import CapsuleReports
from ._config import Config, node_names, spool_dir
from ._daemon import Daemon
from ._errors import ConfigError
from ._exec import ExecIdentity, GroupLedger, resolve_identity
from ._hosts import instance_id
from ._hub_owners import HubOwners
from ._kubernetes import KubernetesHosts, NodeAgent
from ._operations import Operations
from ._policy import Policy
from ._reload import Reloader
from ._remote_nodes import Remotes
from ._spool import Spool
from ._systemd import listen_fds

if TYPE_CHECKING:
    from ._huggingface import HuggingfaceClient
    from ._metrics import Metrics

__all__ = ("host_policy", "serve", "uvloop_available")


def host_policy(config: Config, *, remote: bool = False) -> HostPolicy:
    """[gpus] and [runtime] for a Docker backend; a remote node's facts are never read on this node."""
    return HostPolicy(gpus=GpuPolicy(mode=config.gpus.mode,
                                     driver_paths=() if remote else tuple(config.gpus.driver_paths),
                                     exclusive=config.gpus.exclusive),
                      privileged=config.runtime.privileged, root=None if remote else "/")


async def serve(config: Config, state_dir: Path, *, config_path: str | None = None, log_level: str = "info") -> None:
    """Run the daemon until SIGTERM/SIGINT, then drain it (ConfigError if the state directory is served);
    SIGHUP reloads `config_path` (None: the embedded default) and `log_level` is --log-level's."""
    identity = resolve_identity(config.exec.user)
    fds = listen_fds()
    metrics = _metrics(config)
    reports = (CapsuleReports(state_dir / "capsule-reports", metrics)
               if metrics is not None and config.metrics.capsule_reports else None)
    credentials = config.registry.credentials_file or None
    spool = Spool(directory=spool_dir(config), max_bytes=config.docker.copy_max_bytes)
    async with DockerBackend(
        url=config.docker.url,
        credentials_file=credentials,
        spool_dir=spool.directory,
        copy_max_bytes=spool.max_bytes,
        host_policy=host_policy(config),
        instance=instance_id(state_dir),
        image_ledger=state_dir / "images.json",
        capture_store=Path(config.docker.capture_store) if config.docker.capture_store else None,
    ) as backend:
        remotes = Remotes(config.remote, state_dir=state_dir, identity=identity, spool=spool,
                          credentials_file=credentials, host_policy=host_policy(config, remote=True))
        # A Kubernetes host that is also a [[remote]] entry reaches its node over that connection.
        agents: dict[str, NodeAgent] = {host: remotes.node(host) for host in remotes.hosts}
        kubernetes = KubernetesHosts(config.kubernetes, state_dir=state_dir, agents=agents, spool_dir=spool.directory,
                                     copy_max_bytes=spool.max_bytes, instance=instance_id(state_dir / "kubernetes"))
        operations = Operations(
            provider_name=config.provider.name,
            backend=backend,
            node_names=node_names(config),
            identity=identity,
            allow_pull=config.registry.pull,
            allow_push=config.registry.push,
            groups=GroupLedger(state_dir / "exec-groups"),
            huggingface=_huggingface_client(config, identity),
            # Read at start even without a token: ownership outlives a configuration without [huggingface].
            hub_owners=HubOwners(state_dir / "huggingface-owners.json"),
            remotes=remotes,
            kubernetes=kubernetes,
            policy=_policy(config, state_dir),
            reports=reports,
        )
        daemon = Daemon(config, state_dir=state_dir, operations=operations, backend=backend,
                        control_fd=fds[0] if fds else None, metrics=metrics, captures=backend.captures)
        reloader = Reloader(config_path, daemon, log_level=log_level, policy=lambda c: _policy(c, state_dir))
        daemon.reload = reloader.reload
        async with remotes, kubernetes, anyio.create_task_group() as tg:
            tg.start_soon(_handle_signals, daemon, reloader)
            await daemon.run()
            tg.cancel_scope.cancel()


async def _handle_signals(daemon: Daemon, reloader: Reloader) -> None:
    """Each SIGTERM/SIGINT asks for a graceful stop (the daemon's drain bounds how long it takes); each
    SIGHUP reloads the configuration (`systemctl reload`, logrotate's postrotate)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum != signal.SIGHUP:
                daemon.stop()
                continue
            with contextlib.suppress(ConfigError):  # logged by reload(); the daemon serves on unchanged
                reloader.reload()


def _metrics(config: Config) -> Metrics | None:
    """The daemon's metrics when `[metrics] address` is set (prometheus_client is imported only then)."""
    if not config.metrics.address:
        return None
    import prometheus_client

    from ._metrics import Metrics

    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # `_created` doubles a scrape
    return Metrics()


def _policy(config: Config, state_dir: Path) -> Policy:
    """[policy], with the paths no restricted profile mounts: the engine sockets, the state directory,
    and the files holding credentials."""
    engine = config.docker.url.removeprefix("unix://")
    protected = [engine, str(state_dir), config.registry.credentials_file, config.huggingface.token_file,
                 *(path for remote in config.remote for path in (remote.docker_socket, remote.identity_file,
                                                                  remote.known_hosts))]
    return Policy(config.policy, protected=protected)


def _huggingface_client(config: Config, identity: ExecIdentity) -> HuggingfaceClient | None:
    """The Hub client when `[huggingface] token_file` is set (README: Hugging Face)."""
    if not config.huggingface.token_file:
        return None
    from ._huggingface import HuggingfaceClient, configure_client_timeouts  # huggingface_hub is slow to import

    configure_client_timeouts(config.huggingface.request_timeout_s)
    return HuggingfaceClient(endpoint=config.huggingface.endpoint, token_file=config.huggingface.token_file,
                             identity=identity, request_timeout_s=config.huggingface.request_timeout_s,
                             operation_timeout_s=config.huggingface.operation_timeout_s)


def uvloop_available() -> bool:
    """uvloop roughly halves the daemon's per-request event-loop cost (bench/README.md); optional."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True

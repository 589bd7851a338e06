"""Whether each configured backend answers: the local Docker Engine, each ``[[remote]]`` node (its SSH link and
its Docker Engine) and each ``[[kubernetes]]`` host's apiserver.

One :class:`BackendHealth` per daemon asks them all at once, each within ``PROBE_TIMEOUT_S``, whenever the
control socket's ``status`` runs and, with ``[metrics]`` on, every ``metrics.backend_probe_interval_s`` in a
task of the daemon's task group. The last answers feed ``coldsnap_provider_backend_up{backend, host}``; a
request never waits for a probe it did not ask for. Host labels are configuration (docs/metrics.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import structlog

from coldsnap_runtime import Backend

if TYPE_CHECKING:
    from ._kubernetes import KubernetesHosts
    from ._remote_nodes import Remotes

__all__ = ("PROBE_TIMEOUT_S", "BackendHealth", "BackendState", "HealthReport")

log = structlog.get_logger(__name__)

# Each backend's answer within this (the status command's and a scrape's view of it stay current enough;
# a hung apiserver or sshd costs the probe this long, never a request).
PROBE_TIMEOUT_S = 5.0


class BackendState(msgspec.Struct, frozen=True, kw_only=True):
    """One backend's last answer; `status` replies carry these as its `backends` list."""

    backend: str  # docker, remote or kubernetes
    host: str  # the configured host name it serves (a [[remote]] entry: its first host)
    up: bool
    error: str = ""  # why not, when not up


class HealthReport(msgspec.Struct, frozen=True, kw_only=True):
    """One probe of every backend: the states, and the remote nodes' status entries (their round trips)."""

    states: list[BackendState]
    remotes: list[dict[str, Any]]


class BackendHealth:
    """Probes every backend of one daemon; keeps the last answers for the gauge."""

    def __init__(self, *, backend: Backend, local_host: str, remotes: Remotes | None,
                 kubernetes: KubernetesHosts | None) -> None:
        self._backend = backend
        self._local_host = local_host
        self._remotes = remotes
        self._kubernetes = kubernetes
        # Invariant: one entry per configured backend once a probe ran; empty before (no gauge samples yet).
        self._last: list[BackendState] = []

    def states(self) -> list[tuple[str, str, bool]]:
        """(backend, host, up) of the last probe: read by coldsnap_provider_backend_up at scrape time."""
        return [(state.backend, state.host, state.up) for state in self._last]

    async def check(self) -> HealthReport:
        """Ask every backend now, concurrently, each bounded by PROBE_TIMEOUT_S."""
        docker: list[BackendState] = []
        remotes: list[dict[str, Any]] = []
        kubernetes: list[BackendState] = []

        async def local() -> None:
            docker.append(BackendState(backend="docker", host=self._local_host,
                                       **_answer(await _bounded(self._backend.health))))

        async def remote(nodes: Remotes) -> None:
            remotes.extend(await nodes.status())  # bounded per node (_remote.py)

        async def cluster(hosts: KubernetesHosts) -> None:
            answers: dict[str, str] = {}
            async with anyio.create_task_group() as tg:
                for host in sorted(hosts.hosts):
                    tg.start_soon(_into, answers, host, hosts.node(host).backend.health)
            kubernetes.extend(BackendState(backend="kubernetes", host=host, **_answer(answers[host]))
                              for host in sorted(answers))

        async with anyio.create_task_group() as tg:
            tg.start_soon(local)
            if self._remotes is not None:
                tg.start_soon(remote, self._remotes)
            if self._kubernetes is not None:
                tg.start_soon(cluster, self._kubernetes)
        states = [*docker, *(_remote_state(entry) for entry in remotes), *kubernetes]
        self._last = states
        return HealthReport(states=states, remotes=remotes)

    async def run(self, *, interval_s: float) -> None:
        """Probe every `interval_s` until cancelled (the first after one interval: links open on first use)."""
        while True:
            await anyio.sleep(interval_s)
            try:
                report = await self.check()
            except Exception:  # a probe's bug must not end the daemon's task group
                log.exception("backend probe failed")
                continue
            for state in report.states:
                if not state.up:
                    log.warning("backend unreachable", backend=state.backend, host=state.host, error=state.error)


async def _bounded(health: Any) -> str:
    """A backend's health() within PROBE_TIMEOUT_S: "" when it answered, else why not."""
    with anyio.move_on_after(PROBE_TIMEOUT_S):
        return str(await health())
    return f"no answer within {PROBE_TIMEOUT_S:g} s"


async def _into(answers: dict[str, str], host: str, health: Any) -> None:
    answers[host] = await _bounded(health)


def _answer(error: str) -> dict[str, Any]:
    return {"up": not error, "error": error}


def _remote_state(entry: dict[str, Any]) -> BackendState:
    """A [[remote]] node is up when its link and its Docker Engine both answer."""
    up = bool(entry.get("reachable")) and bool(entry.get("docker_reachable"))
    error = "" if up else (str(entry.get("error") or "") or "its Docker Engine does not answer")
    return BackendState(backend="remote", host=str(entry["hosts"][0]), up=up, error=error)

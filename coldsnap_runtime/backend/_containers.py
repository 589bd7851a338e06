"""Finding, listing and removing the containers this provider manages on one engine.

The containers an RPC owns (anonymous synchronous runs and ``remove_after_exit`` runs) carry this
daemon instance's label and the label of this process's incarnation, so that :meth:`Containers.recover`
can remove what a killed predecessor left behind, and a name held by such a leftover is reclaimed
instead of failing with "Conflict". A removal the engine could not take is kept and retried by
:meth:`Containers.maintain`.

Workload names follow Docker's own container-name rule; a name outside it cannot exist, so it is
never sent to the engine (lookups answer "not found").
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import aiodocker
import anyio
import structlog

from ..errors import BackendError, NotFound, RuntimeFailed
from ..limits import CLEANUP_BUDGET_S
from ._engine import SHORT, Engine, docker_errors
from ._gpus import HELD_GPUS_LABEL, GpuHolder
from ._translate import MANAGED_LABEL

__all__ = ("INCARNATION_LABEL", "INSTANCE_LABEL", "Containers", "labels", "valid_workload_name")

log = structlog.get_logger(__name__)

# On containers an RPC owns: the daemon instance (stable across restarts) and this process.
INSTANCE_LABEL = "io.coldsnap-provider.instance"
INCARNATION_LABEL = "io.coldsnap-provider.incarnation"
# Docker's own container-name rule (a 64-hex container id also satisfies it).
_CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]+")


def valid_workload_name(name: str) -> bool:
    """Whether `name` can be a Docker container name (or a full container id)."""
    return _CONTAINER_NAME.fullmatch(name) is not None


def labels(info: dict[str, Any]) -> dict[str, str]:
    """The labels of an inspected container (``Config.Labels``; absent or null = none)."""
    return dict((info.get("Config") or {}).get("Labels") or {})


class Containers:
    """The managed containers of one engine, for one daemon instance (`instance`; "" = no ownership labels)."""

    def __init__(self, engine: Engine, instance: str) -> None:
        self._engine = engine
        self.instance = instance
        # This process: containers of the same instance but another incarnation are leftovers.
        self.incarnation = secrets.token_hex(8)
        # Containers whose removal failed (engine down or restarting): retried by maintain().
        self.pending_removal: set[str] = set()

    def ownership_labels(self) -> dict[str, str]:
        """The labels of a container an RPC owns: recover() removes it if this process dies first."""
        return {INSTANCE_LABEL: self.instance, INCARNATION_LABEL: self.incarnation}

    async def labelled(self, action: str, *selectors: str) -> list[aiodocker.containers.DockerContainer]:
        """Every container (any state) matching all of `selectors` (``key`` or ``key=value`` label filters)."""
        with docker_errors(action):
            return list(await self._engine.docker.containers.list(
                all="1", filters=json.dumps({"label": list(selectors)})))

    async def find(self, name: str, action: str) -> dict[str, Any] | None:
        """The managed container named exactly `name` (or with that full id), else None."""
        if not valid_workload_name(name):
            return None  # Docker could never have created it: not a workload
        try:
            with docker_errors(action, kind="workload", ref=name):
                info: dict[str, Any] = await self._engine.docker.containers.container(name).show()
        except NotFound:
            return None
        if info.get("Name") != "/" + name and info.get("Id") != name:
            return None  # the engine matched an id prefix or another name: not this workload
        if labels(info).get(MANAGED_LABEL) != "true":
            raise RuntimeFailed(action=action, detail=(
                f"container {name} exists but was not created by coldsnap-provider; refusing to touch it"))
        return info

    async def require(self, name: str, action: str) -> dict[str, Any]:
        info = await self.find(name, action)
        if info is None:
            raise NotFound(kind="workload", ref=name, action=action)
        return info

    async def force_remove(self, container_id: str) -> None:
        """Remove a container this provider owns; if the engine cannot be reached, keep trying later."""
        with anyio.move_on_after(CLEANUP_BUDGET_S, shield=True) as scope:
            try:
                with docker_errors("cleanup", kind="workload", ref=container_id):
                    await self._engine.docker.containers.container(container_id).delete(
                        force=True, v=True, timeout=SHORT)
                self.pending_removal.discard(container_id)
                return
            except NotFound:
                self.pending_removal.discard(container_id)
                return
            except BackendError as exc:
                log.warning("cleanup failed; will retry", container_id=container_id, error=str(exc))
        if scope.cancelled_caught:
            log.error("cleanup timed out; will retry", container_id=container_id)
        self.pending_removal.add(container_id)

    async def maintain(self) -> None:
        """Retry removals that failed while the engine was unreachable."""
        for container_id in sorted(self.pending_removal):
            await self.force_remove(container_id)
            if container_id not in self.pending_removal:
                log.info("deferred cleanup done", container_id=container_id)

    def _leftover(self, container_labels: dict[str, str]) -> bool:
        """Owned by an RPC of this instance that a previous process ran (it cannot still be waiting)."""
        return (bool(self.instance) and container_labels.get(INSTANCE_LABEL) == self.instance
                and container_labels.get(INCARNATION_LABEL) != self.incarnation)

    async def recover(self) -> None:
        """Remove the containers RPCs of an earlier process of this instance left (e.g. after SIGKILL)."""
        if not self.instance:
            return
        for container in await self.labelled("recover", f"{INSTANCE_LABEL}={self.instance}"):
            if self._leftover(dict(container["Labels"] or {})):
                log.info("removing a leftover of an earlier daemon", container_id=container.id)
                await self.force_remove(container.id)

    async def reclaim(self, name: str) -> bool:
        """Remove a leftover of this instance that holds `name`; whether the name is free now."""
        try:
            with docker_errors("workload-run", kind="workload", ref=name):
                info = await self._engine.docker.containers.container(name).show()
        except NotFound:
            return True
        if info.get("Name") != "/" + name or not self._leftover(labels(info)):
            return False
        log.info("reclaiming a name held by a leftover of an earlier daemon", container_id=info["Id"])
        await self.force_remove(str(info["Id"]))
        return info["Id"] not in self.pending_removal

    async def gpu_holders(self) -> list[GpuHolder]:
        """Managed containers holding GPUs ([gpus] exclusive): any state but exited or dead, any session.

        What each holds is the HELD_GPUS_LABEL it was created with: one filtered list, which the
        engine keeps across daemon restarts.
        """
        holders = []
        for container in await self.labelled("workload-run", f"{MANAGED_LABEL}=true", HELD_GPUS_LABEL):
            if str(container["State"] or "") in ("exited", "dead"):
                continue
            held = str((container["Labels"] or {}).get(HELD_GPUS_LABEL) or "")
            name = str((container["Names"] or [container.id])[0]).lstrip("/")
            holders.append(GpuHolder(workload=name, gpus=tuple(g for g in held.split(",") if g)))
        return holders

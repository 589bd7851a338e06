"""Prepare-only, then activate: ColdSnap's restore sequence as the controller drives it, using only
runtime-v1 calls over the provider socket, against the real dockerd and the busybox test image.

Preparation (`restore --prepare-only`) inspects the capsule and runs the synchronous compatibility
probes in it; it must never touch the workload that is serving. Activation then removes the serving
workload and starts the restored one under the same logical name, waits for readiness through
`workload-exec`, and checks it with `workload-inspect`. README.md ("Prepare-only, then activate")
walks through the same calls.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest

from tests.conftest import docker
from tests.helpers import Session, running_daemon

pytestmark = pytest.mark.usefixtures("no_leftovers")

_READINESS_ATTEMPTS = 200


@dataclass(frozen=True)
class Unit:
    cluster_id: str
    rank: int = 0

    @property
    def name(self) -> str:  # restore unit names are <cluster_id>_node_<rank>
        return f"{self.cluster_id}_node_{self.rank}"

    def labels(self, capture: str) -> dict[str, str]:
        return {"io.sparksq.coldsnap.capture": capture, "io.sparksq.coldsnap.driver": "n610",
                "io.sparksq.coldsnap.managed": "true", "io.sparksq.coldsnap.workload": self.cluster_id,
                "io.sparksq.coldsnap.rank": str(self.rank), "io.sparksq.coldsnap.unit": f"unit-{self.rank}"}


@asynccontextmanager
async def provider() -> AsyncIterator[Session]:
    async with running_daemon() as daemon:
        yield await daemon.open_session(hosts=["localhost"])


async def activate(session: Session, unit: Unit, *, image: str, capture: str) -> str:
    """Evict whatever serves under the unit's name, start the restored workload, wait until ready."""
    removed = await session.runtime("workload-remove", name=unit.name)
    assert removed.ok, removed.error
    started = await session.runtime("workload-run", workload={
        "name": unit.name, "image": image, "detached": True, "network": "none", "labels": unit.labels(capture),
        "entrypoint": "sh", "command": ["-c", f"echo {capture} > /tmp/ready; exec sleep 600"]})
    assert started.ok, started.error
    assert await serving_capture(session, unit) == capture
    return started.runtime.value  # type: ignore[return-value]


async def serving_capture(session: Session, unit: Unit) -> str:
    """Readiness as the controller checks it: exec in the workload until it answers."""
    for _ in range(_READINESS_ATTEMPTS):
        reply = await session.runtime("workload-exec", name=unit.name,
                                      execution={"command": ["cat", "/tmp/ready"]})
        if reply.ok:
            return reply.runtime.output.decode().strip()  # type: ignore[union-attr]
        await anyio.sleep(0.05)
    raise AssertionError(f"{unit.name} never became ready")


async def prepare(session: Session, *, capsule: str, probe: list[str]) -> str | None:
    """`restore --prepare-only`: capsule present (inspect), compatibility probe in it (synchronous,
    anonymous, removed after exit). Returns why preparation failed, or None."""
    inspected = await session.runtime("image-inspect", image=capsule)
    if not inspected.ok:
        return inspected.error  # type: ignore[return-value]
    probed = await session.runtime("workload-run", workload={
        "name": "", "image": capsule, "remove_after_exit": True, "pull_policy": "never", "network": "none",
        "entrypoint": "sh", "command": ["-c", *probe], "combined": True})
    return None if probed.ok else probed.error  # type: ignore[return-value]


async def inspect(session: Session, unit: Unit) -> dict[str, object]:
    reply = await session.runtime("workload-inspect", name=unit.name)
    assert reply.ok, reply.error
    workload = reply.runtime.workload  # type: ignore[union-attr]
    return {"id": workload.id, "running": workload.running, "capture": workload.labels[  # type: ignore[union-attr]
        "io.sparksq.coldsnap.capture"]}


@asynccontextmanager
async def capsule_image(session: Session, busybox_image: str) -> AsyncIterator[str]:
    """A capsule tag for the next generation (the busybox image under a capture-specific tag)."""
    tag = f"coldsnap-test/capsule:{secrets.token_hex(4)}"
    tagged = await session.runtime("image-tag", source=busybox_image, target=tag)
    assert tagged.ok, tagged.error
    try:
        yield tag
    finally:
        await session.runtime("image-remove", image=tag)


async def test_restore_failed_preparation_leaves_the_serving_workload_untouched(busybox_image: str) -> None:
    unit = Unit(cluster_id=f"rs-{secrets.token_hex(4)}")
    async with provider() as session:
        try:
            serving_id = await activate(session, unit, image=busybox_image, capture="cap-1")
            async with capsule_image(session, busybox_image) as capsule:
                absent = await prepare(session, capsule=capsule + "-absent", probe=["true"])
                assert absent is not None and "no such image" in absent
                failed = await prepare(session, capsule=capsule,
                                       probe=["echo 'CRIU check failed' >&2; exit 1"])
                assert failed is not None and "CRIU check failed" in failed
            # Nothing was evicted: the same container still serves the previous capture.
            assert await inspect(session, unit) == {"id": serving_id, "running": True, "capture": "cap-1"}
            assert await serving_capture(session, unit) == "cap-1"
        finally:
            assert (await session.runtime("workload-remove", name=unit.name)).ok


async def test_restore_successful_preparation_then_activation_replaces_the_workload(busybox_image: str) -> None:
    unit = Unit(cluster_id=f"rs-{secrets.token_hex(4)}")
    async with provider() as session:
        try:
            old_id = await activate(session, unit, image=busybox_image, capture="cap-1")
            async with capsule_image(session, busybox_image) as capsule:
                assert await prepare(session, capsule=capsule, probe=["echo 'Looks good.'"]) is None
                # Preparation alone changed nothing.
                assert await inspect(session, unit) == {"id": old_id, "running": True, "capture": "cap-1"}
                new_id = await activate(session, unit, image=capsule, capture="cap-2")
                assert new_id != old_id
                assert await inspect(session, unit) == {"id": new_id, "running": True, "capture": "cap-2"}
                assert docker("inspect", old_id, check=False).returncode != 0  # the old one is gone
                assert (await session.runtime("workload-remove", name=unit.name)).ok
        finally:
            assert (await session.runtime("workload-remove", name=unit.name)).ok

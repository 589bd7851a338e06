"""One workload ownership rule on every host kind, for every workload action (issue 37, finding 3).

Manager A (uid 65534) runs a workload on this node's Docker, on node-b over SSH ([[remote]]) and on node-k (the
real Kubernetes cluster, with node-b as its node agent); manager B (uid 65533) then asks for each workload action
on it. B's answer must be exactly the answer for a workload that does not exist, A's own request must work, and
what exists afterwards is asked of the engine, node-b's filesystem or the apiserver directly.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from coldsnap_provider import Reply
from tests.conftest import docker
from tests.helpers import EXEC_AS_NOBODY, Daemon, Session, control_as, running_daemon, session_as
from tests.kubernetes import IMAGE, NAMESPACE, Cluster
from tests.provider.test_remote import NodeB, node_b  # noqa: F401 - fixture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="node-b and the cluster need root")

OWNER, OTHER = 65534, 65533
SECRET = b"s3cret\n"
COMMAND = ["sh", "-c", "mkdir -p /out && echo s3cret > /out/secret && echo ready && exec sleep 3600"]
# Both managers share one profile that admits what every action needs on every host kind (copy-from's
# destination on [[remote]] and Kubernetes nodes is written by the node's SSH user: remote_ssh_user).
POLICY = (f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{OWNER}, {OTHER}]\n"
          "[policy.profiles.tenant]\nremote_ssh_user = true\n"
          f'[[policy.assign]]\nuids = [{OWNER}, {OTHER}]\nprofile = "tenant"\n')


@dataclass
class Place:
    """One host kind as the test sees it: its host name, image, and how to ask it directly."""

    host: str
    image: str
    config: str
    exists: Callable[[str], bool]
    copied: Callable[[str], Path]  # a copy-from destination as this machine reads it
    destination: Callable[[], str]  # a fresh copy-from destination on the host's node
    cleanup: Callable[[str], None]


def _local(busybox_image: str) -> Place:
    directory = Path(tempfile.mkdtemp(prefix="cs-own-", dir="/tmp"))
    directory.chmod(0o777)  # copy-from destinations are written as exec.user (nobody)

    def cleanup(name: str) -> None:
        docker("rm", "-f", name, check=False)
        shutil.rmtree(directory, ignore_errors=True)

    return Place(host="localhost", image=busybox_image, config=POLICY,
                 exists=lambda name: docker("container", "inspect", name, check=False).returncode == 0,
                 copied=Path, destination=lambda: str(directory / secrets.token_hex(4)), cleanup=cleanup)


def _remote(node: NodeB, busybox_image: str) -> Place:
    made: list[str] = []

    def destination() -> str:
        made.append(f"/tmp/cs-own-{secrets.token_hex(4)}")
        return made[-1]

    def cleanup(name: str) -> None:
        node.docker("rm", "-f", name, check=False)
        for path in made:
            shutil.rmtree(node.path(path), ignore_errors=True)

    return Place(host="node-b", image=busybox_image, config=POLICY + node.config(),
                 exists=lambda name: node.docker("container", "inspect", name, check=False).returncode == 0,
                 copied=node.path, destination=destination, cleanup=cleanup)


def _kubernetes(node: NodeB, cluster: Cluster) -> Place:
    remote = _remote(node, IMAGE)
    config = (POLICY + node.config(hosts=("node-k",))
              + f'[[kubernetes]]\nhosts = ["node-k"]\nkubeconfig = "{cluster.kubeconfig}"\n'
                f'namespace = "{NAMESPACE}"\nstart_timeout_s = 60.0\n')

    def cleanup(name: str) -> None:
        for pod in cluster.workload_pods(name):
            cluster.delete_pod(pod["metadata"]["name"])
        remote.cleanup(name)

    return Place(host="node-k", image=IMAGE, config=config, exists=lambda name: bool(cluster.workload_pods(name)),
                 copied=node.path, destination=remote.destination, cleanup=cleanup)


def _place(kind: str, request: pytest.FixtureRequest) -> Place:
    busybox_image: str = request.getfixturevalue("busybox_image")
    if kind == "local":
        return _local(busybox_image)
    node: NodeB = request.getfixturevalue("node_b")
    if kind == "remote":
        return _remote(node, busybox_image)
    return _kubernetes(node, request.getfixturevalue("cluster"))


@asynccontextmanager
async def owned_workload(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[
        tuple[Place, Daemon, Session, Session, str]]:
    """A daemon, A's and B's sessions on the host kind, and a running workload of A's."""
    place = _place(kind, request)
    name = f"own-{kind[:4]}-{secrets.token_hex(3)}"
    try:
        async with running_daemon(place.config) as daemon:
            owner = session_as(OWNER, daemon, hosts=(place.host,), prefix="op-own")
            other = session_as(OTHER, daemon, hosts=(place.host,), prefix="op-oth")
            run = await owner.runtime("workload-run", host=place.host, workload={
                "image": place.image, "name": name, "detached": True, "pull_policy": "never", "command": COMMAND})
            assert run.ok, run.error
            yield place, daemon, owner, other, name
    finally:
        place.cleanup(name)


def _answer(reply: Reply, name: str, absent: str) -> tuple[bool, str | None, str]:
    """A reply in the form the two managers' answers are compared in (the absent name read as `name`)."""
    error = reply.error if isinstance(reply.error, str) else ""
    return reply.ok, reply.error_code, error.replace(absent, name)


async def _logs(session: Session, host: str, name: str) -> bytes:
    with anyio.fail_after(20):
        while True:
            reply = await session.runtime("workload-logs", host=host, name=name)
            assert reply.ok, reply.error
            if output := reply.runtime.output:  # type: ignore[union-attr]
                return bytes(output)
            await anyio.sleep(0.1)


ACTIONS: dict[str, Callable[[Place], dict[str, Any]]] = {
    "workload-inspect": lambda place: {"include_start_time": True},
    "workload-logs": lambda place: {"tail": 10},
    "workload-exec": lambda place: {"execution": {"command": ["cat", "/out/secret"]}},
    "workload-copy-from": lambda place: {"path": "/out", "destination": place.destination()},
    "workload-remove": lambda place: {},
}


async def _session_action_absent_to_the_other(place: Place, owner: Session, other: Session, name: str,
                                               action: str) -> None:
    """B's answer for `action` on A's workload is the answer for one that does not exist; then A's own works."""
    absent = f"own-absent-{secrets.token_hex(3)}"
    fields = ACTIONS[action](place)
    answer = await other.runtime(action, host=place.host, name=name, **fields)
    expected = await other.runtime(action, host=place.host, name=absent, **ACTIONS[action](place))
    assert _answer(answer, name, absent) == _answer(expected, name, absent), (action, answer, expected)
    if action == "workload-remove":
        assert answer.ok and place.exists(name)  # absent to B: success, nothing removed
    else:
        assert (answer.error_code, answer.error) == ("not_found", f"{action}: no such workload: {name}")
    if action == "workload-copy-from":
        assert not place.copied(fields["destination"]).exists()

    fields = ACTIONS[action](place)
    if action == "workload-logs":
        assert await _logs(owner, place.host, name) == b"ready\n"
        return
    mine = await owner.runtime(action, host=place.host, name=name, **fields)
    assert mine.ok, (action, mine.error)
    if action == "workload-inspect":
        assert mine.runtime.workload.running  # type: ignore[union-attr]
    elif action == "workload-exec":
        assert mine.runtime.output == SECRET  # type: ignore[union-attr]
    elif action == "workload-copy-from":
        assert (place.copied(fields["destination"]) / "secret").read_bytes() == SECRET
    else:
        with anyio.fail_after(30):
            while place.exists(name):  # a Pod takes its grace period to go
                await anyio.sleep(0.2)


CONTROL_ACTIONS = ["workload-list", "workload-inspect", "workload-logs", "workload-stop"]


def _control(uid: int, daemon: Daemon, **request: Any) -> dict[str, Any]:
    return control_as(uid, daemon.state_dir, request)


async def _control_verb_absent_to_the_other(kind: str, place: Place, daemon: Daemon, name: str, action: str) -> None:
    """Regression: #37 finding 3: the control socket answered "was run by another manager's session" where the
    session socket answers not_found; both now give the answer for a workload that does not exist."""
    host = "" if kind == "local" else place.host
    if action == "workload-list":
        theirs = await anyio.to_thread.run_sync(lambda: _control(OTHER, daemon, operation=action, host=host))
        mine = await anyio.to_thread.run_sync(lambda: _control(OWNER, daemon, operation=action, host=host))
        assert theirs["ok"] and name not in [w["name"] for w in theirs["result"]]
        assert mine["ok"] and name in [w["name"] for w in mine["result"]]
        return
    absent = f"own-absent-{secrets.token_hex(3)}"
    extra = {"timeout_s": 1} if action == "workload-stop" else {}
    answer = await anyio.to_thread.run_sync(lambda: _control(OTHER, daemon, operation=action, host=host,
                                                             name=name, **extra))
    expected = await anyio.to_thread.run_sync(lambda: _control(OTHER, daemon, operation=action, host=host,
                                                               name=absent, **extra))
    assert answer == {"format": 1, "id": "as-uid", "ok": False, "error": f"{action}: no such workload: {name}",
                      "error_code": "not_found"}
    assert json.dumps(expected).replace(absent, name) == json.dumps(answer)
    assert place.exists(name)
    mine = await anyio.to_thread.run_sync(lambda: _control(OWNER, daemon, operation=action, host=host, name=name,
                                                           **extra))
    if action == "workload-stop" and kind == "kubernetes":
        assert "cannot be stopped and kept on Kubernetes" in mine["error"]  # the owner reaches it
    else:
        assert mine["ok"], (action, mine)


async def _running_over_the_name_tells_only_that_it_is_taken(place: Place, owner: Session, other: Session,
                                                             name: str) -> None:
    """Names are node-global, so B's workload-run over A's name must fail; its answer is the one A gets running
    over its own workload, and names nothing of A's workload (the engine's conflict text named its container id)."""
    spec = {"image": place.image, "name": name, "detached": True, "pull_policy": "never", "command": COMMAND}
    theirs = await other.runtime("workload-run", host=place.host, workload=spec)
    mine = await owner.runtime("workload-run", host=place.host, workload=spec)
    assert _answer(theirs, name, name) == _answer(mine, name, name), (theirs, mine)
    assert (theirs.ok, theirs.error_code, theirs.error) == (False, "runtime_failed", theirs.error)
    assert isinstance(theirs.error, str) and f"workload {name} already exists" in theirs.error
    inspected = await owner.runtime("workload-inspect", host=place.host, name=name)
    assert inspected.ok and inspected.runtime.workload.running  # type: ignore[union-attr]
    workload_id = inspected.runtime.workload.id  # type: ignore[union-attr]
    assert workload_id not in theirs.error and workload_id[:12] not in theirs.error


@pytest.mark.parametrize("kind", ["local", "remote", "kubernetes"])
async def test_another_managers_workload_is_absent_to_every_action_on_every_host_kind(
        kind: str, request: pytest.FixtureRequest) -> None:
    """Regression: #37 finding 3: on Kubernetes, manager B's workload-copy-from read manager A's Pod.

    One workload of A's per host kind (a Pod takes seconds to start) meets every action in turn, B's first, then
    A's: those that leave it running (workload-run over its name, the session socket's reads, the control socket's
    verbs where the host kind has them), then the control socket's stop, then workload-remove."""
    async with owned_workload(kind, request) as (place, daemon, owner, other, name):
        await _running_over_the_name_tells_only_that_it_is_taken(place, owner, other, name)
        for action in ACTIONS:
            if action != "workload-remove":
                await _session_action_absent_to_the_other(place, owner, other, name, action)
        if kind != "remote":
            for action in CONTROL_ACTIONS:
                await _control_verb_absent_to_the_other(kind, place, daemon, name, action)
        await _session_action_absent_to_the_other(place, owner, other, name, "workload-remove")

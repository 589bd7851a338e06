"""A session spanning a Docker host (localhost) and a Kubernetes host (node-k, the real cluster of scripts/_k8s.sh).

The same controller flow runs on both through one daemon: run, inspect, exec, logs, remove. Node-local work on
node-k (exec, the destination of copy-from) is refused naming the host and what is missing, since node-k has no
[[remote]] entry here. What exists afterwards is asked of the apiserver and of dockerd directly.
"""

from __future__ import annotations

import base64
import functools
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from coldsnap_provider import ReplyError
from tests.conftest import BUSYBOX_IMAGE, docker
from tests.helpers import ROOT, Daemon, Session, module_daemon, running_daemon
from tests.kubernetes import IMAGE, NAMESPACE, Cluster


def _config(cluster: Cluster) -> str:
    return f"""
[node]
names = ["localhost"]

[[kubernetes]]
hosts = ["node-k"]
kubeconfig = "{cluster.kubeconfig}"
namespace = "{NAMESPACE}"
start_timeout_s = 60.0
"""


async def _flow(s: Session, host: str, image: str, name: str) -> dict[str, Any]:
    """The controller's workload flow on one host; what it saw."""
    labels = {"io.sparksq.coldsnap.workload": "mixed", "io.sparksq.coldsnap.rank": "0"}
    run = await s.runtime("workload-run", host=host, workload={
        "image": image, "name": name, "detached": True, "pull_policy": "never", "labels": labels,
        "command": ["sh", "-c", "echo ready; exec sleep 3600"]})
    assert run.ok, run.error
    seen: dict[str, Any] = {}
    inspect = await s.runtime("workload-inspect", host=host, name=name, include_start_time=True)
    assert inspect.ok, inspect.error
    workload = inspect.runtime.workload  # type: ignore[union-attr]
    seen["state"], seen["running"] = workload.state, workload.running
    seen["labels"] = {k: v for k, v in workload.labels.items() if k.startswith("io.sparksq.")}
    seen["started"] = bool(workload.started_at)
    exec_reply = await s.runtime("workload-exec", host=host, name=name,
                                 execution={"command": ["printf", "\\001%s", "x"]})
    assert exec_reply.ok, exec_reply.error
    seen["exec"] = exec_reply.runtime.output  # type: ignore[union-attr]
    for _ in range(100):
        logs = await s.runtime("workload-logs", host=host, name=name, tail=1)
        assert logs.ok, logs.error
        if logs.runtime.output:  # type: ignore[union-attr]
            break
        await anyio.sleep(0.1)
    seen["logs"] = logs.runtime.output  # type: ignore[union-attr]
    removed = await s.runtime("workload-remove", host=host, name=name)
    assert removed.ok, removed.error
    gone = await s.runtime("workload-inspect", host=host, name=name)
    seen["after_remove"] = gone.error_code
    return seen


async def test_one_session_runs_the_same_flow_on_docker_and_kubernetes(cluster: Cluster) -> None:
    name = f"cluster_node_{secrets.token_hex(3)}"
    async with running_daemon(_config(cluster)) as daemon:
        s = await daemon.open_session(hosts=["localhost", "node-k"])
        on_docker = await _flow(s, "localhost", BUSYBOX_IMAGE, name)
        on_kubernetes = await _flow(s, "node-k", IMAGE, name)
    assert on_docker == on_kubernetes == {
        "state": "running", "running": True, "started": True, "exec": b"\x01x", "logs": b"ready\n",
        "labels": {"io.sparksq.coldsnap.workload": "mixed", "io.sparksq.coldsnap.rank": "0"},
        "after_remove": "not_found"}
    assert cluster.workload_pods(name) == []
    assert docker("inspect", name, check=False).returncode != 0


@dataclass(frozen=True)
class NodeK:
    """A daemon with node-k and no [[remote]] entry for it, a session there, and one workload of that session's
    running on the cluster (it logs `from-k8s` once, then sleeps)."""

    daemon: Daemon
    session: Session
    name: str


async def _sleeper_on_node_k(daemon: Daemon, name: str) -> Session:
    s = await daemon.open_session(hosts=["node-k"])
    run = await s.runtime("workload-run", host="node-k", workload={
        "image": IMAGE, "name": name, "detached": True, "pull_policy": "never",
        "command": ["sh", "-c", "echo from-k8s; exec sleep 3600"]})
    assert run.ok, run.error
    return s


@pytest.fixture(scope="module")
def node_k(cluster: Cluster) -> Iterator[NodeK]:
    """One daemon and one Pod for the tests that read the workload or are refused beside it (a Pod takes seconds
    to start and to go); none of them changes it."""
    name = f"cluster_node_{secrets.token_hex(3)}"
    with closing(module_daemon(None, _config(cluster))) as daemons:
        daemon = next(daemons)
        s = anyio.run(_sleeper_on_node_k, daemon, name)
        try:
            yield NodeK(daemon, s, name)
        finally:
            anyio.run(functools.partial(s.runtime, "workload-remove", host="node-k", name=name))


async def test_node_local_work_on_a_kubernetes_host_without_remote_is_refused_naming_it(cluster: Cluster,
                                                                                       node_k: NodeK) -> None:
    s, name = node_k.session, node_k.name
    refused = await s.call("exec", host="node-k", arguments=["true"])
    assert not refused.ok
    assert "host 'node-k' is a [[kubernetes]] Node without a [[remote]] entry" in (refused.error or "")
    copy = await s.runtime("workload-copy-from", host="node-k", name=name, path="/bin", destination="/tmp/x")
    assert not copy.ok and "workload-copy-from (its destination) on host 'node-k'" in (copy.error or "")
    gpus = await s.runtime("workload-run", host="node-k", workload={
        "image": IMAGE, "name": name + "g", "detached": True, "gpus": ["0"], "command": ["true"]})
    assert not gpus.ok and gpus.error_code == "runtime_failed"
    assert "`gpus` cannot be realised on Kubernetes" in (gpus.error or "")
    assert cluster.workload_pods(name + "g") == []
    assert len(cluster.workload_pods(name)) == 1


async def test_exec_output_is_binary_safe_through_the_daemon(node_k: NodeK) -> None:
    payload = bytes(range(256))
    octal = "".join(f"\\{b:03o}" for b in payload)
    reply = await node_k.session.runtime("workload-exec", host="node-k", name=node_k.name,
                                         execution={"command": ["printf", octal]})
    assert reply.ok, reply.error
    assert reply.runtime.output == payload  # type: ignore[union-attr]


def _node_b() -> dict[str, str]:
    """node-b (scripts/_node_b.sh): an sshd in its own namespaces, standing in for node-k's own SSH here."""
    up = subprocess.run(["bash", str(ROOT / "scripts" / "_node_b.sh"), "up"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"node-b set-up failed:\n{up.stderr}")
    return dict(line.split("=", 1) for line in up.stdout.split())


async def test_node_local_work_goes_over_the_hosts_remote_entry(cluster: Cluster) -> None:
    """exec and the copy-from destination reach the node over SSH; the workload runs on the cluster."""
    env = _node_b()
    name = f"cluster_node_{secrets.token_hex(3)}"
    destination = f"/tmp/k8s-copy-{secrets.token_hex(3)}"
    remote = f"""
[[remote]]
hosts = ["node-k"]
address = "{env['NODE_B_ADDRESS']}"
port = {env['NODE_B_PORT']}
user = "root"
identity_file = "{env['NODE_B_CLIENT_KEY']}"
known_hosts = "{env['NODE_B_KNOWN_HOSTS']}"
docker_socket = "{env['NODE_B_DOCKER_SOCKET']}"
"""
    node_b_root = Path(f"/proc/{Path(env['NODE_B_SSHD_PID_FILE']).read_text().strip()}/root")
    async with running_daemon(_config(cluster) + remote) as daemon:
        s = await daemon.open_session(hosts=["node-k"])
        where = await s.call("exec", host="node-k", arguments=["hostname"])
        assert where.ok and where.output == b"node-b\n", where  # the node's own shell, not this machine's
        assert (await s.runtime("workload-run", host="node-k", workload={
            "image": IMAGE, "name": name, "detached": True, "pull_policy": "never",
            "command": ["sh", "-c", "mkdir -p /out && printf k8s > /out/f && exec sleep 3600"]})).ok
        try:
            assert len(cluster.workload_pods(name)) == 1  # the workload is a Pod, not a node-b container
            copy = await s.runtime("workload-copy-from", host="node-k", name=name, path="/out", destination=destination)
            assert copy.ok, copy.error
            assert (node_b_root / destination.lstrip("/") / "f").read_bytes() == b"k8s"
            assert not Path(destination).exists()  # nothing on this machine's own /tmp
        finally:
            await s.runtime("workload-remove", host="node-k", name=name)
            await s.call("exec", host="node-k", arguments=["rm", "-rf", destination])


async def test_control_workload_verbs_reach_kubernetes_workloads(node_k: NodeK) -> None:
    daemon, name = node_k.daemon, node_k.name
    status = await daemon.control(operation="status")
    assert status["kubernetes"] == [{"host": "node-k", "node": "node-k", "namespace": NAMESPACE,
                                     "apiserver_reachable": True, "node_agent": False}]
    listed = await daemon.control(operation="workload-list", host="node-k")
    assert name in [w["name"] for w in listed]
    info = await daemon.control(operation="workload-inspect", host="node-k", name=name)
    assert info["running"] is True and info["labels"]["io.coldsnap-provider.manager-uid"] == "0"
    for _ in range(50):
        logs = await daemon.control(operation="workload-logs", host="node-k", name=name)
        if logs["output"]:
            break
        await anyio.sleep(0.1)
    assert base64.b64decode(logs["output"]) == b"from-k8s\n"
    with pytest.raises(ReplyError, match="cannot be stopped and kept on Kubernetes"):
        await daemon.control(operation="workload-stop", host="node-k", name=name)
    with pytest.raises(ReplyError, match="neither this node nor a Kubernetes host"):
        await daemon.control(operation="workload-inspect", host="node-z", name=name)
    with pytest.raises(ReplyError, match="no such workload"):  # this node's engine has no such container
        await daemon.control(operation="workload-inspect", name=name)

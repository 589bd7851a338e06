"""KubernetesBackend against the real single-node cluster of scripts/_k8s.sh (apiserver, kubelet, containerd).

Every Pod really runs on node-k; what exists afterwards is asked of the apiserver with the admin credential
(tests/kubernetes.py), not of the backend under test.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

pytest.importorskip("kubernetes_asyncio", reason="the Kubernetes client is not installed (the GPU machine's wheels)")
from coldsnap_runtime import RuntimeContext, dispatch
from coldsnap_runtime.backend import KubernetesBackend
from coldsnap_runtime.backend._k8s_translate import NAME_ANNOTATION, pod_name
from coldsnap_runtime.errors import BackendTimeout, BackendUnavailable, NotFound, PathNotFound, RuntimeFailed
from coldsnap_runtime.schema import Execution, WorkloadRun, WorkloadSpec
from tests.kubernetes import IMAGE, NAMESPACE, Cluster

MANAGED = "io.coldsnap-provider.managed"


def _name() -> str:
    return f"cluster_node_{secrets.token_hex(3)}"  # not a DNS-1123 name, as ColdSnap's are not


@asynccontextmanager
async def _backend(cluster: Cluster, **kwargs: object) -> AsyncIterator[KubernetesBackend]:
    options: dict[str, object] = {"kubeconfig": cluster.kubeconfig, "namespace": NAMESPACE, "node": cluster.node,
                                  "start_timeout_s": 60.0, **kwargs}
    async with KubernetesBackend(**options) as backend:  # type: ignore[arg-type]
        yield backend


def _sleeper(name: str, **fields: object) -> WorkloadSpec:
    return WorkloadSpec(image=IMAGE, name=name, detached=True, pull_policy="never",
                        # (the pause orders the two lines: the node's log merges its streams by time)
                        command=["sh", "-c", "echo started; sleep 0.3; echo to-stderr >&2; exec sleep 3600"],
                        **fields)  # type: ignore[arg-type]


async def test_detached_workload_runs_inspects_logs_execs_and_is_removed(cluster: Cluster) -> None:
    name = _name()
    async with _backend(cluster) as backend:
        labels = {"io.sparksq.coldsnap.workload": "c1", "note": "spaces and / are fine here"}
        reply = await backend.workload_run(_sleeper(name, labels=labels, environment={"GREETING": "hi"}),
                                           allow_pull=False)
        try:
            pod = cluster.pod(pod_name(name, cluster.node))
            assert pod is not None and pod["spec"]["nodeName"] == cluster.node
            assert pod["metadata"]["annotations"][NAME_ANNOTATION] == name
            assert pod["metadata"]["labels"][MANAGED] == "true"
            assert reply.value == pod["metadata"]["uid"]

            info = await backend.workload_inspect(name, include_start_time=True)
            assert (info.state, info.running, info.id) == ("running", True, pod["metadata"]["uid"])
            assert info.labels["io.sparksq.coldsnap.workload"] == "c1"
            assert info.labels["note"] == "spaces and / are fine here"  # exact, though no Pod label could hold it
            assert isinstance(info.started_at, str) and info.started_at.startswith("20")

            deadline = time.monotonic() + 20
            while b"to-stderr" not in (logs := await backend.workload_logs(name, tail=0)):
                assert time.monotonic() < deadline, logs
                await anyio.sleep(0.2)
            assert b"started" in logs
            assert await backend.workload_logs(name, tail=1) == b"to-stderr\n"

            binary = await backend.workload_exec(name, Execution(command=["printf", "\\000\\377%s", "$GREETING"]))
            assert binary == b"\x00\xff$GREETING"  # argv, not a shell: no expansion
            env = await backend.workload_exec(name, Execution(command=["sh", "-c", "echo $GREETING; echo e >&2"]))
            assert env == b"hi\n"
            both = await backend.workload_exec(name, Execution(command=["sh", "-c", "echo o; echo e >&2"],
                                                               combined=True))
            assert sorted(both.split()) == [b"e", b"o"]
            with pytest.raises(RuntimeFailed, match="exited 3: why"):
                await backend.workload_exec(name, Execution(command=["sh", "-c", "echo why >&2; exit 3"]))
        finally:
            await backend.workload_remove(name)
        assert cluster.pod(pod_name(name, cluster.node)) is None  # gone before the reply
        with pytest.raises(NotFound):
            await backend.workload_inspect(name, include_start_time=False)
        await backend.workload_remove(name)  # absent is success


async def test_dispatch_adds_manager_and_provider_labels_to_the_pod(cluster: Cluster) -> None:
    name = _name()
    ctx = RuntimeContext(host="node-k", allow_pull=False, cluster_id="c9", manager_labels={"team": "a"},
                         manager_uid=4321)
    spec = _sleeper(name, labels={"io.sparksq.coldsnap.workload": "c9"})
    async with _backend(cluster, instance="inst-1") as backend:
        await dispatch(backend, WorkloadRun(workload=spec), ctx)
        try:
            labels = cluster.pod(pod_name(name, cluster.node))["metadata"]["labels"]  # type: ignore[index]
            assert labels["team"] == "a" and labels["io.coldsnap-provider.manager-uid"] == "4321"
            assert labels[MANAGED] == "true" and labels["io.coldsnap-provider.instance"] == "inst-1"
            listed = dict(await backend.workload_list())
            assert listed[name].labels["io.coldsnap-provider.manager-uid"] == "4321"
        finally:
            await backend.workload_remove(name)


@pytest.mark.parametrize(("field", "spec"), [
    pytest.param("gpus", {"gpus": ["0"]}, id="gpus"),
    pytest.param("memlock_unlimited", {"memlock_unlimited": True}, id="memlock"),
    pytest.param("network", {"network": "none"}, id="network-none"),
    pytest.param("user", {"user": "nobody"}, id="user-name"),
    pytest.param("devices", {"devices": [{"source": "/dev/null"}]}, id="devices-unprivileged"),
])
async def test_unrealisable_field_is_refused_naming_it_and_creates_nothing(cluster: Cluster, field: str,
                                                                            spec: dict[str, object]) -> None:
    import msgspec

    name = _name()
    workload = msgspec.convert({"image": IMAGE, "name": name, "detached": True, **spec}, WorkloadSpec)
    async with _backend(cluster) as backend:
        with pytest.raises(RuntimeFailed, match=f"`{field}` cannot be realised on Kubernetes"):
            await backend.workload_run(workload, allow_pull=False)
    assert cluster.pod(pod_name(name, cluster.node)) is None


async def test_pod_the_kubelet_cannot_start_is_deleted_and_the_reason_returned(cluster: Cluster) -> None:
    name = _name()
    spec = WorkloadSpec(image="docker.io/local/absent:1", name=name, detached=True, pull_policy="never")
    async with _backend(cluster) as backend:
        with pytest.raises(RuntimeFailed, match="ErrImageNeverPull"):
            await backend.workload_run(spec, allow_pull=False)
    assert cluster.pod(pod_name(name, cluster.node)) is None


async def test_synchronous_run_returns_output_and_exit_code_and_leaves_no_pod(cluster: Cluster) -> None:
    async with _backend(cluster) as backend:
        incarnation = f"io.coldsnap-provider.incarnation={backend._incarnation}"
        reply = await backend.workload_run(WorkloadSpec(image=IMAGE, pull_policy="never", combined=True,
                                                        command=["sh", "-c", "echo out; echo err >&2"]),
                                           allow_pull=False)
        assert sorted((reply.output or b"").split()) == [b"err", b"out"]
        with pytest.raises(RuntimeFailed, match="exited 7: bad"):
            await backend.workload_run(WorkloadSpec(image=IMAGE, pull_policy="never", combined=True,
                                                    command=["sh", "-c", "echo bad; exit 7"]), allow_pull=False)
        with pytest.raises(RuntimeFailed, match="`combined` cannot be realised"):
            await backend.workload_run(WorkloadSpec(image=IMAGE, command=["true"]), allow_pull=False)
    assert cluster.pods(incarnation) == []  # anonymous runs belong to their RPC


async def test_name_held_by_a_foreign_pod_is_refused_never_adopted_or_deleted(cluster: Cluster) -> None:
    name = _name()
    foreign = pod_name(name, cluster.node)
    cluster.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": foreign},
                        "spec": {"nodeName": cluster.node, "automountServiceAccountToken": False,
                                 "containers": [{"name": "x", "image": IMAGE, "imagePullPolicy": "Never",
                                                 "command": ["sleep", "3600"]}]}})
    try:
        async with _backend(cluster) as backend:
            with pytest.raises(RuntimeFailed, match="not coldsnap-provider's workload"):
                await backend.workload_run(_sleeper(name), allow_pull=False)
            for call in (backend.workload_inspect(name, include_start_time=False), backend.workload_remove(name),
                         backend.workload_exec(name, Execution(command=["true"]))):
                with pytest.raises(RuntimeFailed, match="refusing to touch it"):
                    await call
        assert cluster.pod(foreign) is not None
    finally:
        cluster.delete_pod(foreign)


async def test_pod_deleted_behind_the_daemons_back_is_not_found(cluster: Cluster) -> None:
    name = _name()
    async with _backend(cluster) as backend:
        await backend.workload_run(_sleeper(name), allow_pull=False)
        cluster.delete_pod(pod_name(name, cluster.node))
        deadline = time.monotonic() + 30
        while True:
            try:
                info = await backend.workload_inspect(name, include_start_time=False)
            except NotFound:
                break
            assert info.state == "removing" or info.running, info
            assert time.monotonic() < deadline
            await anyio.sleep(0.2)


async def _run_sleeper(cluster: Cluster, name: str) -> None:
    async with _backend(cluster) as backend:
        await backend.workload_run(_sleeper(name), allow_pull=False)


async def _remove(cluster: Cluster, name: str) -> None:
    async with _backend(cluster) as backend:
        await backend.workload_remove(name)


@pytest.fixture(scope="module")
def sleeper(cluster: Cluster) -> Iterator[str]:
    """One running sleeper Pod for the tests that only exec in it and copy from it, each in its own paths (a Pod
    takes seconds to start and to go)."""
    name = _name()
    anyio.run(_run_sleeper, cluster, name)
    try:
        yield name
    finally:
        anyio.run(_remove, cluster, name)


async def test_copy_from_extracts_the_container_path_on_the_host(cluster: Cluster, sleeper: str,
                                                                  tmp_path: Path) -> None:
    async with _backend(cluster) as backend:
        await backend.workload_exec(sleeper, Execution(command=["sh", "-c",
                                                                "mkdir -p /tmp/out/sub && printf a > /tmp/out/sub/f"]))
        await backend.workload_copy_from(sleeper, "/tmp/out", str(tmp_path / "copy"))
        assert (tmp_path / "copy" / "sub" / "f").read_bytes() == b"a"
        with pytest.raises(PathNotFound):
            await backend.workload_copy_from(sleeper, "/no/such", str(tmp_path / "none"))
        assert not (tmp_path / "none").exists()


async def test_exec_input_is_refused_where_stdin_cannot_be_closed(cluster: Cluster, sleeper: str) -> None:
    async with _backend(cluster) as backend:
        with pytest.raises(RuntimeFailed, match="`input` cannot be realised on this cluster"):
            await backend.workload_exec(sleeper, Execution(command=["sh", "-c", "cat > /tmp/got"], input=b"x"))
        # Nothing ran: the file the command would have created does not exist.
        with pytest.raises(RuntimeFailed, match="exited 1"):
            await backend.workload_exec(sleeper, Execution(command=["cat", "/tmp/got"]))


async def test_wrong_credential_is_a_clear_error_without_the_secret(cluster: Cluster) -> None:
    async with _backend(cluster, kubeconfig=cluster.bad_kubeconfig) as backend:
        with pytest.raises(RuntimeFailed, match="refused the kubeconfig's credential") as caught:
            await backend.workload_inspect(_name(), include_start_time=False)
    assert "not-a-valid-token" not in str(caught.value)


async def test_apiserver_down_or_silent_fails_within_the_bound(cluster: Cluster, tmp_path: Path) -> None:
    text = Path(cluster.kubeconfig).read_text()
    refused = tmp_path / "refused.kubeconfig"
    refused.write_text(text.replace("https://10.77.0.1:6443", "https://10.77.0.1:1"))
    async with _backend(cluster, kubeconfig=str(refused)) as backend:
        with pytest.raises(BackendUnavailable, match="apiserver"):
            await backend.workload_run(_sleeper(_name()), allow_pull=False)
    silent = tmp_path / "silent.kubeconfig"
    silent.write_text(text.replace("https://10.77.0.1:6443", "https://10.77.0.99:6443"))  # nobody answers
    started = time.monotonic()
    async with _backend(cluster, kubeconfig=str(silent), request_timeout_s=1.0) as backend:
        with pytest.raises((BackendTimeout, BackendUnavailable)):
            await backend.workload_inspect(_name(), include_start_time=False)
    assert time.monotonic() - started < 10


async def test_images_are_refused_with_the_reason(cluster: Cluster) -> None:
    async with _backend(cluster) as backend:
        with pytest.raises(RuntimeFailed, match="Kubernetes has no image API"):
            await backend.image_pull(IMAGE)
        with pytest.raises(NotFound):
            await backend.image_inspect("docker.io/local/absent:1")
        with pytest.raises(RuntimeFailed, match="by name and size only"):
            await backend.image_inspect(IMAGE)


async def test_exec_in_a_container_that_exits_mid_stream_is_a_clear_failure(cluster: Cluster) -> None:
    name = _name()
    spec = WorkloadSpec(image=IMAGE, name=name, detached=True, pull_policy="never",
                        command=["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 0.2; done"])
    async with _backend(cluster) as backend:
        await backend.workload_run(spec, allow_pull=False)
        try:
            with anyio.fail_after(30), pytest.raises(RuntimeFailed, match="workload-exec failed"):
                await backend.workload_exec(name, Execution(command=["sh", "-c", "echo partial; kill 1; sleep 20"]))
            deadline = time.monotonic() + 20
            while (info := await backend.workload_inspect(name, include_start_time=False)).running:
                assert time.monotonic() < deadline
                await anyio.sleep(0.2)
            assert (info.state, info.exit_code) == ("exited", 0)
        finally:
            await backend.workload_remove(name)


async def test_maintenance_deletes_ended_detached_runs_that_asked_for_it(cluster: Cluster) -> None:
    ended, kept = _name(), _name()
    async with _backend(cluster) as backend:
        await backend.workload_run(WorkloadSpec(image=IMAGE, name=ended, detached=True, pull_policy="never",
                                                remove_after_exit=True, command=["true"]), allow_pull=False)
        await backend.workload_run(WorkloadSpec(image=IMAGE, name=kept, detached=True, pull_policy="never",
                                                command=["true"]), allow_pull=False)
        try:
            deadline = time.monotonic() + 30
            while (await backend.workload_inspect(ended, include_start_time=False)).state != "exited":
                assert time.monotonic() < deadline
                await anyio.sleep(0.2)
            await backend.maintain()
            assert cluster.workload_pods(ended) == []
            assert len(cluster.workload_pods(kept)) == 1  # ended too, but a manager key: kept
        finally:
            await backend.workload_remove(kept)
            await backend.workload_remove(ended)


async def test_recover_deletes_only_anonymous_leftovers_of_its_own_instance(cluster: Cluster) -> None:
    instance = f"inst-{secrets.token_hex(3)}"
    token = secrets.token_hex(4)
    pods = {f"cs-run-{token}-a": (instance, {}),  # an earlier process's anonymous run: deleted
            f"cs-named-{token}": (instance, {NAME_ANNOTATION: "cluster_node_9"}),  # a manager key
            f"cs-run-{token}-b": ("another-instance", {})}  # another daemon's
    for pod, (owner, notes) in pods.items():
        cluster.create_pod({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": pod, "annotations": notes, "labels": {
                MANAGED: "true", "io.coldsnap-provider.instance": owner,
                "io.coldsnap-provider.incarnation": "an-earlier-process"}},
            "spec": {"nodeName": cluster.node, "automountServiceAccountToken": False, "containers": [
                {"name": "workload", "image": IMAGE, "imagePullPolicy": "Never", "command": ["sleep", "3600"]}]}})
    try:
        async with _backend(cluster, instance=instance) as backend:
            await backend.recover()
        left = {pod for pod in pods if cluster.pod(pod) is not None}
        assert left == set(list(pods)[1:])
    finally:
        for pod in pods:
            cluster.delete_pod(pod)


async def test_pod_the_apiserver_refuses_returns_its_reason_and_creates_nothing(cluster: Cluster) -> None:
    name = _name()
    spec = _sleeper(name, environment={"1-not-an-env-name": "x"})  # valid runtime-v1, invalid on Kubernetes 1.20
    async with _backend(cluster) as backend:
        with pytest.raises(RuntimeFailed, match=r"apiserver answered 422: .*env\[0\]\.name"):
            await backend.workload_run(spec, allow_pull=False)
    assert cluster.workload_pods(name) == []

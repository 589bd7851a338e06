"""The pure WorkloadSpec -> Pod translation (no cluster): names, labels, every realised field."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coldsnap_runtime.backend._k8s_translate import (
    LABELS_ANNOTATION,
    NAME_ANNOTATION,
    pod_manifest,
    pod_name,
    workload_info,
)
from coldsnap_runtime.errors import RuntimeFailed
from coldsnap_runtime.schema import Device, WorkloadSpec

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def _pod(**fields: object) -> dict[str, object]:
    spec = msgspec.convert({"image": "img:1", "name": "w", "detached": True, **fields}, WorkloadSpec)
    return pod_manifest(spec, pod="p", namespace="ns", node="node-k", allow_pull=True, extra_labels={})


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=200))
def test_pod_name_is_always_a_dns_label(name: str) -> None:
    assert _DNS_LABEL.fullmatch(pod_name(name, "node-k"))


def test_pod_name_differs_by_case_and_by_node() -> None:
    names = {pod_name("Cluster_node_0", "a"), pod_name("cluster_node_0", "a"), pod_name("cluster_node_0", "b")}
    assert len(names) == 3
    assert pod_name("cluster_node_0", "a").startswith("cs-cluster-node-0-")


def test_every_label_round_trips_exactly_through_the_annotation() -> None:
    labels = {"io.sparksq.coldsnap.workload": "c1", "free": "a value with spaces / and more than sixty-three " * 2}
    pod = _pod(labels=labels)
    metadata = pod["metadata"]
    assert metadata["annotations"][NAME_ANNOTATION] == "w"  # type: ignore[index]
    assert "free" not in metadata["labels"]  # type: ignore[index]  # not a valid label value: annotation only
    assert metadata["labels"]["io.sparksq.coldsnap.workload"] == "c1"  # type: ignore[index]
    info = workload_info({"metadata": metadata, "spec": pod["spec"], "status": {}}, include_start_time=True)
    assert {k: v for k, v in info.labels.items() if k in labels} == labels
    assert LABELS_ANNOTATION in metadata["annotations"]  # type: ignore[operator]


def test_fields_are_realised_in_the_pod() -> None:
    pod = _pod(network="host", privileged=True, seccomp_unconfined=True, shared_memory_bytes=1 << 20, user="10:20",
               entrypoint="/bin/sh", command=["-c", "x"], environment={"A": "1"}, pull_policy="never",
               mounts=[{"source": "/data", "target": "/in", "read_only": True}],
               devices=[{"source": "/dev/null", "target": "/dev/x"}])
    spec = pod["spec"]
    container = spec["containers"][0]  # type: ignore[index]
    assert spec["nodeName"] == "node-k" and spec["hostNetwork"] is True and spec["restartPolicy"] == "Never"  # type: ignore[index]
    assert container["command"] == ["/bin/sh"] and container["args"] == ["-c", "x"]
    assert container["imagePullPolicy"] == "Never" and container["env"] == [{"name": "A", "value": "1"}]
    assert container["securityContext"] == {"privileged": True, "seccompProfile": {"type": "Unconfined"},
                                            "runAsUser": 10, "runAsGroup": 20}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/in"]["readOnly"] is True and "/dev/shm" in mounts and "/dev/x" in mounts


def test_pull_policy_never_pulls_without_the_capability() -> None:
    spec = WorkloadSpec(image="img:1", name="w", detached=True)
    pod = pod_manifest(spec, pod="p", namespace="ns", node="n", allow_pull=False, extra_labels={})
    assert pod["spec"]["containers"][0]["imagePullPolicy"] == "Never"
    with pytest.raises(RuntimeFailed, match="oci-pull"):
        pod_manifest(msgspec.structs.replace(spec, pull_policy="always"), pod="p", namespace="ns", node="n",
                     allow_pull=False, extra_labels={})


def test_label_key_kubernetes_cannot_hold_is_refused_naming_labels() -> None:
    with pytest.raises(RuntimeFailed, match="`labels` cannot be realised on Kubernetes: key 'bad key'"):
        _pod(labels={"bad key": "v"})


def test_state_follows_the_container_status() -> None:
    base = {"metadata": {"uid": "u"}, "spec": {"containers": [{"image": "i"}]}}
    running = {**base, "status": {"containerStatuses": [{"name": "workload", "state": {
        "running": {"startedAt": "2026-12-01T00:00:00Z"}}}]}}
    ended = {**base, "status": {"containerStatuses": [{"name": "workload", "state": {
        "terminated": {"exitCode": 3, "startedAt": "2026-12-01T00:00:00Z"}}}]}}
    evicted = {**base, "status": {"phase": "Failed", "reason": "Evicted"}}
    assert workload_info(running, include_start_time=True).started_at == "2026-12-01T00:00:00Z"
    assert (workload_info(ended, include_start_time=False).state, workload_info(ended, include_start_time=False)
            .exit_code) == ("exited", 3)
    assert workload_info(evicted, include_start_time=False).state == "exited"


def test_privileged_under_a_capability_grant_is_refused_for_want_of_the_capsule_seccomp_profile() -> None:
    """Issue 37 finding 1: a profile's capsule runs only under the provider's seccomp profile (no mount)."""
    spec = WorkloadSpec(image="img:1", name="w", detached=True, privileged=True)
    unconfined = msgspec.structs.replace(spec, privileged=False, seccomp_unconfined=True)
    for asked, field in ((spec, "privileged"), (unconfined, "seccomp_unconfined")):
        with pytest.raises(RuntimeFailed, match=f"`{field}` cannot be realised on Kubernetes: under an admission"):
            pod_manifest(asked, pod="p", namespace="ns", node="n", allow_pull=False, extra_labels={},
                         capabilities=("SYS_ADMIN", "SYS_PTRACE"))
    with pytest.raises(RuntimeFailed, match="`devices` cannot be realised"):
        pod_manifest(msgspec.structs.replace(spec, privileged=False, devices=[msgspec.convert(
            {"source": "/dev/null"}, Device)]), pod="p", namespace="ns", node="n", allow_pull=False, extra_labels={},
            capabilities=("SYS_ADMIN",))
    unrestricted = pod_manifest(spec, pod="p", namespace="ns", node="n", allow_pull=False, extra_labels={})
    assert unrestricted["spec"]["containers"][0]["securityContext"] == {"privileged": True}

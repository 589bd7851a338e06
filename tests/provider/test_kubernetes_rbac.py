"""packaging/kubernetes/*.yaml on the real cluster: the backend's whole flow as that service account, nothing more.

The shipped Namespace, ServiceAccount (with its token Secret), Role, RoleBinding, ClusterRole and ClusterRoleBinding
are applied with the cluster's admin credential; the kubeconfig is written from the Secret as docs/kubernetes.md
says; a daemon then runs a workload's flow (run, inspect, list, exec, logs, remove) through the backend as the
service account. Requests outside the Role (a watch, a patch, Secrets, another namespace, a Node delete) answer
403. Everything applied is deleted afterwards. Without the Role, the first workload-run fails with 403.
"""

from __future__ import annotations

import base64
import json
import secrets
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from tests.helpers import ROOT, running_daemon
from tests.kubernetes import IMAGE, NAMESPACE, Cluster

MANIFESTS = [ROOT / "packaging" / "kubernetes" / name for name in ("namespace.yaml", "serviceaccount.yaml",
                                                                    "rbac.yaml")]
SHIPPED_NAMESPACE = "coldsnap"
ACCOUNT = "coldsnap-provider"
# The collection each kind is created in (the manifests' objects are namespaced to SHIPPED_NAMESPACE or global).
_COLLECTIONS = {
    "Namespace": "/api/v1/namespaces",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Secret": "/api/v1/namespaces/{ns}/secrets",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
}


def _objects() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _path(obj: dict[str, Any]) -> str:
    return _COLLECTIONS[obj["kind"]].format(ns=obj["metadata"].get("namespace", ""))


def _server(cluster: Cluster) -> str:
    config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    return str(config["clusters"][0]["cluster"]["server"])


def _as_account(cluster: Cluster, token: str, method: str, path: str, body: dict[str, Any] | None = None) -> int:
    """The HTTP status the apiserver gives the service account for one request."""
    context = ssl.create_default_context(cafile=str(Path(cluster.env["K8S_DIR"]) / "pki" / "ca.crt"))
    request = urllib.request.Request(f"{_server(cluster)}{path}", method=method,
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/merge-patch+json" if method == "PATCH"
                                              else "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _delete_all(cluster: Cluster) -> None:
    """Remove what the manifests make (the namespace takes its objects with it) and wait until it is gone."""
    for obj in reversed(_objects()):
        if obj["kind"] in ("ClusterRoleBinding", "ClusterRole", "Namespace"):
            cluster._request("DELETE", f"{_path(obj)}/{obj['metadata']['name']}")
    deadline = time.monotonic() + 90
    while cluster._request("GET", f"/api/v1/namespaces/{SHIPPED_NAMESPACE}")[0] != 404:
        assert time.monotonic() < deadline, f"namespace {SHIPPED_NAMESPACE} still terminating after 90 s"
        time.sleep(0.5)


@pytest.fixture
def applied(cluster: Cluster) -> Iterator[str]:
    """The shipped manifests applied with the admin credential; the service account's token."""
    _delete_all(cluster)  # a run killed before its clean-up
    try:
        for obj in _objects():
            status, body = cluster._request("POST", _path(obj), obj)
            assert status == 201, (obj["kind"], body)
        deadline = time.monotonic() + 60
        token = ""
        while not token:
            assert time.monotonic() < deadline, "the token controller did not fill coldsnap-provider-token in 60 s"
            _, secret = cluster._request("GET", f"/api/v1/namespaces/{SHIPPED_NAMESPACE}/secrets/{ACCOUNT}-token")
            token = base64.b64decode((secret.get("data") or {}).get("token", "")).decode()
            # Pods need the namespace's default account, which the controller-manager makes.
            if cluster._request("GET", f"/api/v1/namespaces/{SHIPPED_NAMESPACE}/serviceaccounts/default")[0] != 200:
                token = ""
            time.sleep(0 if token else 0.25)
        yield token
    finally:
        _delete_all(cluster)


def _kubeconfig(cluster: Cluster, token: str, directory: Path) -> Path:
    """docs/kubernetes.md's recipe: server, the Secret's ca.crt and token, the namespace as context default."""
    _, secret = cluster._request("GET", f"/api/v1/namespaces/{SHIPPED_NAMESPACE}/secrets/{ACCOUNT}-token")
    config = {"apiVersion": "v1", "kind": "Config", "current-context": ACCOUNT,
              "clusters": [{"name": "cluster", "cluster": {"server": _server(cluster),
                                                           "certificate-authority-data": secret["data"]["ca.crt"]}}],
              "users": [{"name": ACCOUNT, "user": {"token": token}}],
              "contexts": [{"name": ACCOUNT, "context": {"cluster": "cluster", "user": ACCOUNT,
                                                         "namespace": SHIPPED_NAMESPACE}}]}
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def test_the_role_names_exactly_the_calls_the_backend_makes() -> None:
    """Each verb is accounted for by a call in the backend (the rule's comment); no wildcard anywhere."""
    backend = (ROOT / "coldsnap_runtime" / "backend" / "_kubernetes.py").read_text()
    rules = {(o["kind"], r["resources"][0]): sorted(r["verbs"]) for o in _objects() if "rules" in o
             for r in o["rules"]}
    assert rules == {("Role", "pods"): ["create", "delete", "get", "list"], ("Role", "pods/log"): ["get"],
                     ("Role", "pods/exec"): ["create", "get"], ("ClusterRole", "nodes"): ["get"]}
    for call in ("read_namespaced_pod(", "list_namespaced_pod(", "create_namespaced_pod(", "delete_namespaced_pod(",
                 "read_namespaced_pod_log(", "connect_get_namespaced_pod_exec(", "read_node("):
        assert call in backend, f"the backend no longer calls {call}: revisit packaging/kubernetes/rbac.yaml"
    for needless in ("watch_", "patch_", "replace_", "_secret", "_config_map", "list_node("):
        assert needless not in backend, f"the backend calls {needless}: packaging/kubernetes/rbac.yaml lacks it"


@pytest.mark.timeout(240)
async def test_the_shipped_rbac_runs_the_backends_flow_and_refuses_the_rest(cluster: Cluster, applied: str,
                                                                             tmp_path: Path) -> None:
    kubeconfig = _kubeconfig(cluster, applied, tmp_path)
    name = f"rbac_{secrets.token_hex(3)}"
    config = f"""
[node]
names = ["localhost"]

[[kubernetes]]
hosts = ["node-k"]
kubeconfig = "{kubeconfig}"
namespace = "{SHIPPED_NAMESPACE}"
start_timeout_s = 60.0
"""
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["node-k"])
        run = await s.runtime("workload-run", host="node-k", workload={
            "image": IMAGE, "name": name, "detached": True, "pull_policy": "never",
            "command": ["sh", "-c", "echo ready; exec sleep 3600"]})
        assert run.ok, run.error
        try:
            inspect = await s.runtime("workload-inspect", host="node-k", name=name)
            assert inspect.ok and inspect.runtime.workload.running, inspect.error  # type: ignore[union-attr]
            listed = await daemon.control(operation="workload-list", host="node-k")  # list_namespaced_pod
            assert name in [w["name"] for w in listed]
            status = await daemon.control(operation="status")
            assert [k["apiserver_reachable"] for k in status["kubernetes"]] == [True]
            executed = await s.runtime("workload-exec", host="node-k", name=name,
                                       execution={"command": ["echo", "as-the-account"]})
            assert executed.ok and executed.runtime.output == b"as-the-account\n", executed.error  # type: ignore[union-attr]
            logs = b""
            for _ in range(50):
                reply = await s.runtime("workload-logs", host="node-k", name=name, tail=1)
                assert reply.ok, reply.error
                if logs := reply.runtime.output:  # type: ignore[union-attr]
                    break
                await anyio.sleep(0.1)
            assert logs == b"ready\n"
        finally:
            removed = await s.runtime("workload-remove", host="node-k", name=name)
        assert removed.ok, removed.error
        assert (await s.runtime("workload-inspect", host="node-k", name=name)).error_code == "not_found"

    pods = f"/api/v1/namespaces/{SHIPPED_NAMESPACE}/pods"
    allowed = _as_account(cluster, applied, "GET", pods)
    refused = {
        "watch pods": _as_account(cluster, applied, "GET", f"{pods}?watch=true&timeoutSeconds=1"),
        "patch a pod": _as_account(cluster, applied, "PATCH", f"{pods}/x", {"metadata": {"labels": {"a": "b"}}}),
        "read secrets": _as_account(cluster, applied, "GET", f"/api/v1/namespaces/{SHIPPED_NAMESPACE}/secrets"),
        "pods elsewhere": _as_account(cluster, applied, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods"),
        "list nodes": _as_account(cluster, applied, "GET", "/api/v1/nodes"),
        "delete the node": _as_account(cluster, applied, "DELETE", f"/api/v1/nodes/{cluster.node}"),
    }
    assert allowed == 200
    assert refused == dict.fromkeys(refused, 403)

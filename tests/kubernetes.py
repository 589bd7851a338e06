"""The single-node Kubernetes cluster of scripts/_k8s.sh ("node-k"), as the tests see it.

The cluster is real (apiserver, etcd, controller-manager, scheduler, kubelet, containerd) and shared by the
whole session: :func:`cluster` brings it up once (idempotent; a no-op when it already runs). Assertions about
what exists ask the apiserver directly with the cluster's admin credential, never the code under test.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "_k8s.sh"
NAMESPACE = "coldsnap-test"  # created by scripts/_k8s.sh with the provider's Role bound in it
IMAGE = "docker.io/local/busybox:1"  # imported into the node's containerd by scripts/_k8s.sh
ROOT_REQUIRED = "the Kubernetes cluster needs root (namespaces, cgroups, containerd)"


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]

    @property
    def node(self) -> str:
        return self.env["K8S_NODE"]

    @property
    def kubeconfig(self) -> str:
        """The provider's credential: an ordinary user with a Role in NAMESPACE (and Node reads)."""
        return self.env["K8S_KUBECONFIG"]

    @property
    def bad_kubeconfig(self) -> str:
        return self.env["K8S_BAD_KUBECONFIG"]

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        directory = Path(self.env["K8S_DIR"])
        context = ssl.create_default_context(cafile=str(directory / "pki" / "ca.crt"))
        token = (directory / "pki" / "token-admin").read_text().strip()
        request = urllib.request.Request(f"https://10.77.0.1:6443{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def pod(self, name: str) -> dict[str, Any] | None:
        """The Pod `name` in NAMESPACE as the apiserver has it, or None."""
        status, body = self._request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        if status == 404:
            return None
        assert status == 200, body
        return body

    def pods(self, selector: str) -> list[dict[str, Any]]:
        status, body = self._request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}")
        assert status == 200, body
        return list(body.get("items") or [])

    def workload_pods(self, name: str) -> list[dict[str, Any]]:
        """The Pods in NAMESPACE whose workload-name annotation is `name` (found without the code under test)."""
        return [p for p in self.pods("io.coldsnap-provider.managed=true")
                if (p["metadata"].get("annotations") or {}).get("coldsnap-provider.io/workload-name") == name]

    def create_pod(self, manifest: dict[str, Any]) -> None:
        status, body = self._request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", manifest)
        assert status == 201, body

    def delete_pod(self, name: str) -> None:
        self._request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", {"gracePeriodSeconds": 0})


def bring_up() -> Cluster:
    """Start the cluster unless it runs (scripts/_k8s.sh up), then read its paths."""
    if os.geteuid() != 0:
        pytest.skip(ROOT_REQUIRED)
    up = subprocess.run(["bash", str(SCRIPT), "up"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"Kubernetes set-up failed (scripts/_k8s.sh up):\n{up.stderr[-4000:]}")
    env = subprocess.run(["bash", str(SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    return Cluster(env=dict(line.split("=", 1) for line in env.split()))

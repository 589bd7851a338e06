"""Kubernetes host vs Docker host, side by side, through one real daemon (same run).

    .venv/bin/python bench/kubernetes.py [--calls 100]

node-k is the single-node cluster of the tests (scripts/_k8s.sh: Kubernetes v1.20.2 apiserver, kubelet and
containerd in their own namespaces on this machine). One daemon serves `localhost` (the machine's dockerd) and
`node-k`; one session spans them; one detached busybox workload runs on each. Printed: per-call p50/p99 of
`workload-inspect` and `workload-exec` (`true`) on each host, and one detached `workload-run` + `workload-remove`.
"""

from __future__ import annotations

import argparse
import secrets
import subprocess
import time
from pathlib import Path

import anyio
from _common import Session, running_daemon, summary, table

ROOT = Path(__file__).resolve().parent.parent
IMAGES = {"localhost": "coldsnap-test/busybox:1", "node-k": "docker.io/local/busybox:1"}


def _cluster() -> dict[str, str]:
    subprocess.run(["bash", str(ROOT / "scripts" / "_k8s.sh"), "up"], capture_output=True, check=True)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "_k8s.sh"), "env"], capture_output=True, text=True,
                         check=True).stdout
    return dict(line.split("=", 1) for line in out.split())


def _config(env: dict[str, str]) -> str:
    return f"""
[node]
names = ["localhost"]

[[kubernetes]]
hosts = ["node-k"]
kubeconfig = "{env['K8S_KUBECONFIG']}"
namespace = "coldsnap-test"
"""


async def _timed(s: Session, host: str, action: str, **fields: object) -> float:
    started = time.perf_counter()
    reply = await s.runtime(action, host=host, **fields)
    if not reply.ok:
        raise RuntimeError(f"{action} on {host}: {reply.error}")
    return time.perf_counter() - started


async def main(calls: int) -> None:
    env = await anyio.to_thread.run_sync(_cluster)
    name = f"k8s_vs_docker_{secrets.token_hex(3)}"
    async with running_daemon(_config(env)) as daemon:
        s = await daemon.open_session(hosts=["localhost", "node-k"])
        lifecycle: dict[str, list[float]] = {}
        for host, image in IMAGES.items():
            run = await _timed(s, host, "workload-run", workload={
                "image": image, "name": name, "detached": True, "pull_policy": "never", "command": ["sleep", "3600"]})
            lifecycle[host] = [run]
        rows = []
        try:
            for label, action, fields in (
                    ("workload-inspect", "workload-inspect", {"name": name}),
                    ("workload-exec `true`", "workload-exec", {"name": name, "execution": {"command": ["true"]}})):
                per_host: dict[str, dict[str, float]] = {}
                for host in IMAGES:
                    for _ in range(3):  # warm connections and pools
                        await _timed(s, host, action, **fields)
                    per_host[host] = summary([await _timed(s, host, action, **fields) for _ in range(calls)])
                docker, kube = per_host["localhost"], per_host["node-k"]
                rows.append([label, f"{docker['p50']:.2f} / {docker['p99']:.2f}",
                             f"{kube['p50']:.2f} / {kube['p99']:.2f}", f"{kube['p50'] - docker['p50']:+.2f}",
                             f"{kube['p50'] / docker['p50']:.1f}x"])
        finally:
            for host in IMAGES:
                try:
                    lifecycle[host].append(await _timed(s, host, "workload-remove", name=name))
                except RuntimeError as exc:  # e.g. removed meanwhile by another client of a shared dockerd
                    print(f"note: {exc}")
                    lifecycle[host].append(float("nan"))
        run_remove = [f"{lifecycle[h][0] * 1000:.0f} + {lifecycle[h][1] * 1000:.0f}" for h in IMAGES]
        rows.append(["workload-run + workload-remove (once, ms)", *run_remove, "", ""])
        print(f"## Kubernetes (node-k) vs Docker (localhost), {calls} sequential calls each, one daemon\n")
        print(table(["operation", "docker p50/p99 ms", "kubernetes p50/p99 ms", "added p50 ms", "k8s/docker"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    anyio.run(main, args.calls, backend="asyncio")

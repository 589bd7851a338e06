"""Remote host (node-b over SSH) vs local, side by side, through one real daemon.

    .venv/bin/python bench/remote.py [--calls 100] [--concurrency 1,8,32,64]

node-b is the second node of the tests (scripts/_node_b.sh: sshd on 127.0.0.2 in its own namespaces, a second
dockerd). One daemon serves both `localhost` and `node-b`; one session spans them. Printed: per-call p50/p99 of
`image-inspect` and `exec true` on each host, and how many concurrent remote calls the one SSH connection
sustains (throughput, latency, errors) as the number of clients grows.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

import anyio
from _common import Session, running_daemon, summary, table

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "coldsnap-test/busybox:1"


def _node_b() -> dict[str, str]:
    up = subprocess.run(["bash", str(ROOT / "scripts" / "_node_b.sh"), "up"], capture_output=True, text=True,
                        check=True)
    env = dict(line.split("=", 1) for line in up.stdout.split())
    node = ["docker", "-H", f"unix://{env['NODE_B_DOCKER_SOCKET']}"]
    if subprocess.run([*node, "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        saved = subprocess.run(["docker", "save", IMAGE], capture_output=True, check=True).stdout
        subprocess.run([*node, "load"], input=saved, capture_output=True, check=True)
    return env


def _config(env: dict[str, str]) -> str:
    return f"""
[[remote]]
hosts = ["node-b"]
address = "{env['NODE_B_ADDRESS']}"
port = {env['NODE_B_PORT']}
user = "root"
identity_file = "{env['NODE_B_CLIENT_KEY']}"
known_hosts = "{env['NODE_B_KNOWN_HOSTS']}"
docker_socket = "{env['NODE_B_DOCKER_SOCKET']}"
"""


async def _call(s: Session, kind: str, host: str) -> bool:
    if kind == "image-inspect":
        reply = await s.runtime("image-inspect", host=host, image=IMAGE)
        return bool(reply.ok)
    reply = await s.call("exec", host=host, arguments=["true"])
    return bool(reply.ok and not reply.exit_code)


async def _latency(s: Session, kind: str, host: str, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        if not await _call(s, kind, host):
            raise RuntimeError(f"{kind} on {host} failed")
        samples.append(time.perf_counter() - started)
    return samples


async def _concurrent(s: Session, kind: str, clients: int, per_client: int) -> tuple[float, dict[str, float], int]:
    samples: list[float] = []
    errors = 0

    async def client() -> None:
        nonlocal errors
        for _ in range(per_client):
            started = time.perf_counter()
            ok = await _call(s, kind, "node-b")
            samples.append(time.perf_counter() - started)
            errors += not ok

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(clients):
            tg.start_soon(client)
    elapsed = time.perf_counter() - started
    return len(samples) / elapsed, summary(samples), errors


async def main(calls: int, levels: list[int]) -> None:
    env = await anyio.to_thread.run_sync(_node_b)
    async with running_daemon(_config(env)) as daemon:
        s = await daemon.open_session(hosts=["localhost", "node-b"])
        for kind in ("image-inspect", "exec"):  # warm both paths (connection, forwarder, pools)
            for host in ("localhost", "node-b"):
                await _latency(s, kind, host, 3)
        rows = []
        for kind, label in (("image-inspect", "image-inspect"), ("exec", "exec `true`")):
            local = summary(await _latency(s, kind, "localhost", calls))
            remote = summary(await _latency(s, kind, "node-b", calls))
            rows.append([label, f"{local['p50']:.2f} / {local['p99']:.2f}",
                         f"{remote['p50']:.2f} / {remote['p99']:.2f}",
                         f"{remote['p50'] - local['p50']:+.2f}", f"{remote['p50'] / local['p50']:.1f}x"])
        print(f"## Remote vs local ({calls} sequential calls each)\n")
        print(table(["operation", "local p50/p99 ms", "node-b p50/p99 ms", "added p50 ms", "node-b/local"], rows))
        conc_rows = []
        for kind in ("image-inspect", "exec"):
            for clients in levels:
                per_client = max(2, (4 * calls) // max(clients, 1) // 4)
                rate, lat, errors = await _concurrent(s, kind, clients, per_client)
                conc_rows.append([kind, clients, clients * per_client, f"{rate:.0f}", f"{lat['p50']:.1f}",
                                  f"{lat['p99']:.1f}", errors])
        print("\n## Concurrent calls to node-b over its one SSH connection\n")
        print(table(["operation", "clients", "calls", "calls/s", "p50 ms", "p99 ms", "errors"], conc_rows))
        status = await daemon.control(operation="status")
        print("\nstatus remotes:", status.get("remotes"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--concurrency", default="1,8,32,64")
    args = parser.parse_args()
    anyio.run(main, args.calls, [int(c) for c in args.concurrency.split(",")], backend="asyncio")

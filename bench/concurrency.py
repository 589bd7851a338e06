"""Concurrent clients issuing mixed calls, and the daemon's fds and RSS across a long run.

    .venv/bin/python bench/concurrency.py [--requests 2000] [--soak 100000]

For 1, 16, 64 and 256 concurrent clients: throughput, p50/p99 and errors for a fixed
number of mixed requests (capabilities, exec `true`, image-inspect, workload-inspect).
Then `--soak` requests (capabilities and image-inspect) with open fds and RSS of the
daemon read before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import time

import anyio
from _common import Session, process_stats, running_daemon, summary, table

IMAGE = "coldsnap-test/busybox:1"
WORKLOAD = "bench-concurrency"


def mixed(session: Session) -> itertools.cycle:  # type: ignore[type-arg]
    return itertools.cycle([
        lambda: session.call("capabilities"),
        lambda: session.runtime("image-inspect", image=IMAGE),
        lambda: session.runtime("workload-inspect", name=WORKLOAD),
        lambda: session.call("exec", host="localhost", arguments=["true"]),
    ])


async def drive(session: Session, clients: int, requests: int, calls: itertools.cycle) -> dict[str, object]:  # type: ignore[type-arg]
    latencies: list[float] = []
    errors = 0
    remaining = requests

    async def client() -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            try:
                reply = await next(calls)()
                if not reply.ok:
                    errors += 1
            except Exception:
                errors += 1
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(clients):
            tg.start_soon(client)
    elapsed = time.perf_counter() - started
    return {"clients": clients, "requests": len(latencies), "seconds": elapsed,
            "throughput": len(latencies) / elapsed, "errors": errors, **summary(latencies)}


async def main(requests: int, soak: int) -> None:
    subprocess.run(["docker", "rm", "-f", WORKLOAD], capture_output=True, check=False)
    async with running_daemon("[server]\nmax_connections = 1024\n") as daemon:
        assert daemon.process is not None
        session = await daemon.open_session()
        assert (await session.runtime("workload-run", workload={
            "name": WORKLOAD, "image": IMAGE, "detached": True, "command": ["sleep", "3600"]})).ok
        rows, results = [], []
        for clients in (1, 16, 64, 256):
            r = await drive(session, clients, requests, mixed(session))
            results.append(r)
            rows.append([clients, r["requests"], f"{r['throughput']:.0f}", f"{r['p50']:.1f}", f"{r['p99']:.1f}",
                         r["errors"]])
        print(table(["clients", "requests", "req/s", "p50 ms", "p99 ms", "errors"], rows))
        before = process_stats(daemon.process.pid)
        light = itertools.cycle([lambda: session.call("capabilities"),
                                 lambda: session.runtime("image-inspect", image=IMAGE)])
        r = await drive(session, 64, soak, light)
        await anyio.sleep(1)
        after = process_stats(daemon.process.pid)
        print()
        print(table(["soak requests", "clients", "req/s", "errors", "fds before", "fds after", "RSS before KiB",
                     "RSS after KiB"],
                    [[r["requests"], 64, f"{r['throughput']:.0f}", r["errors"], before[0], after[0], before[1],
                      after[1]]]))
        soak_result = {**r, "fds": [before[0], after[0]], "rss_kib": [before[1], after[1]]}
        print(json.dumps({"levels": results, "soak": soak_result}))
        await session.runtime("workload-remove", name=WORKLOAD)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--soak", type=int, default=100_000)
    args = parser.parse_args()
    anyio.run(main, args.requests, args.soak, backend="asyncio")

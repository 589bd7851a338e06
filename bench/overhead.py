"""Per-call overhead: the provider against aiodocker directly and the docker CLI, side by side.

    .venv/bin/python bench/overhead.py [--calls 300] [--only metrics]

Every path does the same operation against the same dockerd in the same run; the table
gives p50/p99 in milliseconds and the ratios provider/aiodocker and CLI/provider.

A second table (issue 26) gives the cost of observability: the same requests against two
daemons of the same run, one plain and one with `[metrics]` and `[audit] file` on, measured in
alternating rounds so that drift hits both alike; a third daemon, plain too, gives the
run-to-run spread the difference is compared with.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiodocker
import anyio
from _common import Session, running_daemon, summary, table

IMAGE = "coldsnap-test/busybox:1"
WORKLOAD = "bench-overhead"


async def measure(calls: int, fn: Callable[[], Awaitable[object]]) -> list[float]:
    for _ in range(min(20, calls)):  # warm-up: connections, caches
        await fn()
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - started)
    return samples


def cli(*args: str) -> Callable[[], Awaitable[object]]:
    async def run() -> object:
        return await anyio.run_process(["docker", *args], check=True)
    return run


async def main(calls: int) -> None:
    subprocess.run(["docker", "rm", "-f", WORKLOAD], capture_output=True, check=False)
    async with running_daemon() as daemon, aiodocker.Docker(api_version="v1.41") as docker:
        session: Session = await daemon.open_session()
        run = await session.runtime("workload-run", workload={"name": WORKLOAD, "image": IMAGE, "detached": True,
                                                               "command": ["sleep", "3600"]})
        assert run.ok, run.error
        container = docker.containers.container(WORKLOAD)

        async def provider(action: str, **fields: object) -> object:
            reply = await session.runtime(action, **fields)
            assert reply.ok, reply.error
            return reply

        async def capabilities() -> object:
            reply = await session.call("capabilities")
            assert reply.ok
            return reply

        async def direct_exec() -> object:
            execution = await container.exec(["true"])
            async with execution.start(detach=False) as stream:
                while await stream.read_out() is not None:
                    pass
            return await execution.inspect()

        def blocking(envelope: dict[str, object]) -> Callable[[], Awaitable[object]]:
            """A lean client, closer to the Go one (lean_call)."""
            return lean_call(session.socket, (json.dumps(envelope) + "\n").encode())

        cases: list[tuple[str, Callable[[], Awaitable[object]] | None, Callable[[], Awaitable[object]] | None,
                          Callable[[], Awaitable[object]]]] = [
            ("capabilities", capabilities, None, None),  # type: ignore[list-item]
            ("capabilities, blocking-socket client", blocking(session.envelope("capabilities")), None,
             None),  # type: ignore[list-item]
            ("workload-inspect, blocking-socket client",
             blocking(session.envelope("runtime", host="localhost",
                                       runtime={"action": "workload-inspect", "name": WORKLOAD})),
             lambda: docker._query_json(f"containers/{WORKLOAD}/json"), None),
            ("image-inspect, blocking-socket client",
             blocking(session.envelope("runtime", host="localhost",
                                       runtime={"action": "image-inspect", "image": IMAGE})),
             lambda: docker.images.inspect(IMAGE), None),
            ("workload-inspect", lambda: provider("workload-inspect", name=WORKLOAD),
             lambda: docker._query_json(f"containers/{WORKLOAD}/json"), cli("inspect", WORKLOAD)),
            ("image-inspect", lambda: provider("image-inspect", image=IMAGE),
             lambda: docker.images.inspect(IMAGE), cli("image", "inspect", IMAGE)),
            ("workload-exec `true`", lambda: provider("workload-exec", name=WORKLOAD, execution={"command": ["true"]}),
             direct_exec, cli("exec", WORKLOAD, "true")),
        ]
        rows, results = [], {}
        for name, via_provider, via_aiodocker, via_cli in cases:
            p = summary(await measure(calls, via_provider))  # type: ignore[arg-type]
            a = summary(await measure(calls, via_aiodocker)) if via_aiodocker else None
            c = summary(await measure(max(30, calls // 5), via_cli)) if via_cli else None
            results[name] = {"provider": p, "aiodocker": a, "cli": c}
            rows.append([name, f"{p['p50']:.2f} / {p['p99']:.2f}",
                         f"{a['p50']:.2f} / {a['p99']:.2f}" if a else "-",
                         f"{c['p50']:.1f} / {c['p99']:.1f}" if c else "-",
                         f"{p['p50'] / a['p50']:.2f}x" if a else "-",
                         f"{c['p50'] / p['p50']:.1f}x" if c else "-"])
        await session.runtime("workload-remove", name=WORKLOAD)
    print(table(["operation", "provider p50/p99 ms", "aiodocker p50/p99 ms", "docker CLI p50/p99 ms",
                 "provider/aiodocker (p50)", "CLI/provider (p50)"], rows))
    print(json.dumps(results))


def lean_call(socket_path: str, request: bytes) -> Callable[[], Awaitable[object]]:
    """connect, one line, half-close, read to EOF (the Go client's exchange)."""
    import socket as socket_module

    async def call() -> object:
        with socket_module.socket(socket_module.AF_UNIX) as sock:
            sock.connect(socket_path)
            sock.sendall(request)
            sock.shutdown(socket_module.SHUT_WR)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert b'"ok":true' in data, data
        return data
    return call


async def metrics_cost(calls: int, rounds: int = 10) -> None:
    """Plain daemon vs. metrics + audit daemon vs. a second plain daemon, interleaved rounds."""
    scratch = Path(tempfile.mkdtemp(prefix="cs-ov-", dir="/tmp"))
    observed = f'[metrics]\naddress = "unix:{scratch}/m.sock"\n[audit]\nfile = "{scratch}/audit.jsonl"\n'
    # No long-lived container: other suites on the same dockerd remove containers they did not expect.
    name = f"{WORKLOAD}-m-{os.getpid()}"
    async with running_daemon() as plain, running_daemon(observed) as on, running_daemon() as plain2:
        daemons = {"off": plain, "on": on, "off (2nd daemon)": plain2}
        sessions = {k: await d.open_session() for k, d in daemons.items()}
        cases = {
            "capabilities": lambda s: s.envelope("capabilities"),
            "exec `true`": lambda s: s.envelope("exec", host="localhost", arguments=["true"]),
            "image-inspect": lambda s: s.envelope("runtime", host="localhost",
                                                  runtime={"action": "image-inspect", "image": IMAGE}),
            "workload-run, audited (detached, then removed)": None,
        }
        samples: dict[tuple[str, str], list[float]] = {}
        per_round = max(10, calls // rounds)
        for _ in range(rounds):
            for case, build in cases.items():
                for index, (which, session) in enumerate(sessions.items()):
                    if build is None:
                        fn = run_and_remove(session, f"{name}-{index}")
                        count = max(3, per_round // 10)
                    else:
                        fn = lean_call(session.socket, (json.dumps(build(session)) + "\n").encode())
                        count = per_round
                    samples.setdefault((case, which), []).extend(await measure(count, fn))
    rows = []
    for case in cases:
        off, on_, off2 = (summary(samples[(case, k)]) for k in daemons)
        rows.append([case, f"{off['p50']:.2f} / {off['p99']:.2f}", f"{on_['p50']:.2f} / {on_['p99']:.2f}",
                     f"{on_['p50'] - off['p50']:+.3f}", f"{off2['p50'] - off['p50']:+.3f}"])
    print(table(["request (lean client)", "metrics off p50/p99 ms", "metrics + audit on p50/p99 ms",
                 "on - off (p50 ms)", "spread: off - off (p50 ms)"], rows))


def run_and_remove(session: Session, name: str) -> Callable[[], Awaitable[object]]:
    """A detached run and its removal; a fresh name each time (the engine may still be removing the last)."""
    count = itertools.count()

    async def call() -> object:
        unit = f"{name}-{next(count)}"
        reply = await session.runtime("workload-run", workload={"name": unit, "image": IMAGE, "detached": True,
                                                                "command": ["true"]})
        assert reply.ok, reply.error
        return await session.runtime("workload-remove", name=unit)
    return call


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--only", choices=["metrics"], help="only the metrics on/off table")
    args = parser.parse_args()
    if args.only != "metrics":
        anyio.run(main, args.calls, backend="asyncio")
    anyio.run(metrics_cost, args.calls, backend="asyncio")

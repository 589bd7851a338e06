"""What a Prometheus scrape costs a busy daemon (issue 26: under 5 ms at 1,000 sessions' worth of series).

    .venv/bin/python bench/metrics_scrape.py [--sessions 1000] [--scrapes 300]

A real daemon with `[metrics]` on holds `--sessions` open sessions; every session sends a request
of each kind the protocol has (each runtime action, exec, upload, capabilities, bad ones), so
that every label combination the daemon can make exists, and a capsule report of each kind is
accepted. Then `--scrapes` scrapes over HTTP (a fresh connection each, as Prometheus does) are
timed from connect to the last byte, in the text format and in OpenMetrics, with the daemon's own CPU
time per scrape (/proc: what the scrape costs the daemon however loaded the machine is). Labels never carry
a session, so the series count does not grow with sessions: the table shows both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import anyio
from _common import Session, running_daemon, summary, table

IMAGE = "coldsnap-test/busybox:1"


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (the daemon's cost, whatever else the machine runs)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(path: Path, accept: str = "") -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        extra = f"Accept: {accept}\r\n" if accept else ""
        sock.sendall(f"GET /metrics HTTP/1.1\r\nHost: bench\r\n{extra}\r\n".encode())
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return data.partition(b"\r\n\r\n")[2]


async def every_kind(session: Session, index: int) -> None:
    """One request of each kind (ok and failing) from one session."""
    name = f"bench-scrape-absent-{index}"
    calls = [
        session.call("capabilities"),
        session.call("exec", host="localhost", arguments=["true"]),
        session.call("exec", host="elsewhere", arguments=["true"]),
        session.call("upload", host="localhost", sources=["/nonexistent"], destination="/tmp/x"),
        session.runtime("image-inspect", image=IMAGE),
        session.runtime("image-inspect", image="coldsnap-test/absent:1"),
        session.runtime("workload-inspect", name=name),
        session.runtime("workload-logs", name=name, tail=1),
        session.runtime("workload-exec", name=name, execution={"command": ["true"]}),
        session.runtime("workload-remove", name=name),
        session.runtime("image-remove", image="coldsnap-test/absent:1"),
        session.runtime("image-tag", source="coldsnap-test/absent:1", target="coldsnap-test/absent:2"),
        session.runtime("image-push", image="coldsnap-test/absent:1"),
        session.runtime("image-pull", image="coldsnap-test/absent:1"),
        session.raw(b'{"format":1,"id":"1","operation":"nonsense"}\n'),
    ]
    for call in calls:
        await call


async def main(sessions: int, scrapes: int) -> None:
    sock = Path(tempfile.mkdtemp(prefix="cs-sc-", dir="/tmp")) / "metrics.sock"
    config = f'[metrics]\naddress = "unix:{sock}"\n[server]\nmax_connections = 2048\n'
    async with running_daemon(config) as daemon:
        opened: list[Session] = []
        for _ in range(sessions):
            opened.append(await daemon.open_session())
        for index, session in enumerate(opened[:8]):  # every label combination; more sessions add no series
            await every_kind(session, index)
        for session in opened[8:]:
            assert (await session.call("capabilities")).ok
        report = {"format": 1, "kind": "coldsnap-cuda-criu-restore", "restore_seconds": 3.0, "ready_seconds": 4.0,
                  "criu_restore_seconds": 2.0, "cuda_restore_seconds": 0.5, "all_pages_in_seconds": 2.5,
                  "hydration": {"phase_seconds": 0.4}, "communicator_recreate_seconds": 0.1}
        script = f"printf %s '{json.dumps(report)}' > $COLDSNAP_REPORT_DIR/r.json"
        reply = await opened[0].runtime("workload-run", workload={"name": "", "image": IMAGE, "remove_after_exit": True,
                                                                  "entrypoint": "sh",
                                                                  "command": ["-c", script]})
        assert reply.ok, reply.error
        await anyio.sleep(1.5)  # the collector's scan
        rows = []
        for label, accept in (("text 0.0.4", ""), ("OpenMetrics 1.0", "application/openmetrics-text")):
            body = await anyio.to_thread.run_sync(scrape, sock, accept)
            series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
            samples = []
            assert daemon.process is not None
            cpu = cpu_seconds(daemon.process.pid)
            for _ in range(scrapes):
                started = time.perf_counter()
                await anyio.to_thread.run_sync(scrape, sock, accept)
                samples.append(time.perf_counter() - started)
            cpu_ms = (cpu_seconds(daemon.process.pid) - cpu) / scrapes * 1000
            s = summary(samples)
            rows.append([label, sessions, series, len(body), f"{cpu_ms:.2f}", f"{s['p50']:.2f}", f"{s['p99']:.2f}"])
        status = await daemon.control(operation="status")
        assert status["sessions"] == sessions
    print(table(["format", "open sessions", "series", "bytes", "daemon CPU ms / scrape", "scrape p50 ms",
                 "scrape p99 ms"], rows))
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average during the run: {' '.join(load)} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--scrapes", type=int, default=300)
    arguments = parser.parse_args()
    anyio.run(main, arguments.sessions, arguments.scrapes, backend="asyncio")

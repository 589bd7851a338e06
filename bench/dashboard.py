"""Render docs/grafana/coldsnap-provider.json from a real scrape: a real daemon under load, a real Prometheus.

    .venv/bin/python bench/dashboard.py [--seconds 150] [--out docs/grafana/dashboard.png]

Needs Debian's `prometheus` (apt-get install prometheus) and matplotlib. Steps:

1. `coldsnap-provider serve` with `[metrics]` on a local TCP port;
2. `prometheus` scraping it every second into a scratch TSDB;
3. load for `--seconds`: sessions sending a mix of requests (ok, not found, refused, undecodable),
   busybox capsule units leaving restore and capture reports in their report directory (the phase
   values replay the H200 ranges in bench/README.md, since this machine has no GPU) and, now and then,
   a hostile unit leaving junk, and one probe of an image without the worker; with node-b up
   (scripts/_node_b.sh), a remote node that answers and one that does not;
4. every panel's PromQL from the dashboard JSON, evaluated through Prometheus' HTTP API (Grafana's
   `$__rate_interval`, `$__range`, `$job` and `$instance` substituted), drawn with matplotlib in the
   dashboard's own grid.

Grafana itself is not installable here; the queries are the dashboard's, the data is the scrape's.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import anyio
from _common import Session, free_port, running_daemon

from coldsnap_provider import ReplyError

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "coldsnap-provider.json"
IMAGE = "coldsnap-test/busybox:1"
JOB = "coldsnap-provider"
# H200 ranges (bench/README.md: 8B engine, hydrated restores), replayed by the busybox capsules.
RESTORE = {"criu_restore_seconds": (0.62, 0.85), "cuda_restore_seconds": (0.21, 0.40),
           "hydration": (0.004, 0.02), "restore_seconds": (0.9, 1.3), "ready_seconds": (1.0, 1.5)}
CAPTURE = {"cuda_lock": (0.005, 0.02), "cuda_checkpoint": (1.5, 2.5), "criu_dump": (3.0, 5.0)}



def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def start_prometheus(scratch: Path, target: str, port: int) -> subprocess.Popen[bytes]:
    config = scratch / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: {JOB}\n    static_configs:\n      - targets: ['{target}']\n")
    with open(scratch / "prometheus.log", "wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(["prometheus", f"--config.file={config}",
                                    f"--storage.tsdb.path={scratch / 'tsdb'}",
                                    f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                   stdout=subprocess.DEVNULL, stderr=log)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
            return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError((scratch / "prometheus.log").read_text())


def report_script(rng: random.Random) -> str:
    pick = {k: round(rng.uniform(*v), 4) for k, v in RESTORE.items()}
    restore = {"format": 1, "kind": "coldsnap-cuda-criu-restore", "criu_restore_seconds": pick["criu_restore_seconds"],
               "cuda_restore_seconds": pick["cuda_restore_seconds"], "restore_seconds": pick["restore_seconds"],
               "ready_seconds": pick["ready_seconds"], "hydration": {"phase_seconds": pick["hydration"]}}
    capture = {"format": 1, "kind": "coldsnap-cuda-criu-capture", "hydration": {"released_bytes": 1 << 34},
               "timings_s": {k: round(rng.uniform(*v), 4) for k, v in CAPTURE.items()}}
    lines = [f"printf %s '{json.dumps(restore)}' > $COLDSNAP_REPORT_DIR/r.json"]
    if rng.random() < 0.4:
        lines.append(f"printf %s '{json.dumps(capture)}' > $COLDSNAP_REPORT_DIR/c.json")
    if rng.random() < 0.15:
        lines.append("printf 'junk' > $COLDSNAP_REPORT_DIR/bad.json; ln -s /etc/shadow $COLDSNAP_REPORT_DIR/l.json")
    return "; ".join(lines)


async def client(session: Session, until: float, rng: random.Random) -> None:
    while time.monotonic() < until:
        choice = rng.random()
        if choice < 0.35:
            await session.call("capabilities")
        elif choice < 0.6:
            await session.call("exec", host="localhost", arguments=["true"])
        elif choice < 0.8:
            await session.runtime("image-inspect", image=IMAGE)
        elif choice < 0.9:
            await session.runtime("workload-inspect", name="dashboard-absent")
        elif choice < 0.95:
            await session.call("exec", host="not-this-node", arguments=["true"])
        else:
            await session.raw(b'{"format":1,"id":"1","operation":"nonsense"}\n')
        await anyio.sleep(rng.uniform(0.01, 0.08))


async def remote_client(session: Session, until: float) -> None:
    """node-b's link is opened by its first use (remote_up is 1 from then on)."""
    while time.monotonic() < until:
        await session.call("exec", host="node-b", arguments=["true"])
        await anyio.sleep(2)


async def capsules(session: Session, until: float, rng: random.Random) -> None:
    while time.monotonic() < until:
        await session.runtime("workload-run", workload={"name": "", "image": IMAGE, "remove_after_exit": True,
                                                         "entrypoint": "sh", "command": ["-c", report_script(rng)]})
        await anyio.sleep(rng.uniform(1.0, 3.0))


def remotes() -> str:
    """node-b (scripts/_node_b.sh, up) and a node that does not answer (down), when node-b is there."""
    found = subprocess.run(["bash", str(ROOT / "scripts" / "_node_b.sh"), "env"], capture_output=True, text=True,
                           check=False)
    env = dict(line.split("=", 1) for line in found.stdout.splitlines() if "=" in line)
    if found.returncode != 0 or not Path(env.get("NODE_B_CLIENT_KEY", "/nonexistent")).exists():
        return ""
    entry = ('[[remote]]\nhosts = ["{host}"]\naddress = "{address}"\nport = {port}\nuser = "root"\n'
             f'identity_file = "{env["NODE_B_CLIENT_KEY"]}"\nknown_hosts = "{env["NODE_B_KNOWN_HOSTS"]}"\n'
             f'docker_socket = "{env["NODE_B_DOCKER_SOCKET"]}"\nconnect_timeout_s = 2.0\n')
    return (entry.format(host="node-b", address=env["NODE_B_ADDRESS"], port=env["NODE_B_PORT"])
            + entry.format(host="node-down", address="127.0.0.3", port=9))


async def load(seconds: float, sock_port: int) -> float:
    """Run the load; returns the time of its end, while the daemon still serves (its series are fresh)."""
    rng = random.Random(26)
    config = f'[metrics]\naddress = "127.0.0.1:{sock_port}"\n{remotes()}'
    async with running_daemon(config) as daemon:
        hosts = ["localhost", "node-b"] if "node-b" in config else ["localhost"]
        sessions = [await daemon.open_session(hosts=hosts) for _ in range(12)]
        until = time.monotonic() + seconds
        try:  # no GPU here: the probe fails, and is counted as such
            await daemon.control(operation="probe", driver="n610", image=IMAGE)
        except ReplyError:
            pass
        async with anyio.create_task_group() as tg:
            for index, session in enumerate(sessions[:8]):
                tg.start_soon(client, session, until, random.Random(index))
            tg.start_soon(capsules, sessions[8], until, rng)
            if "node-b" in config:
                tg.start_soon(remote_client, sessions[8], until)
            for session in sessions[9:]:  # sessions come and go
                await daemon.control(operation="session-close", session=session.session)
        await anyio.sleep(3)  # the last scrapes
        return time.time()


def substitute(expr: str, seconds: float) -> str:
    return (expr.replace("$__rate_interval", "15s").replace("$__range", f"{int(seconds)}s")
            .replace("$instance", ".*").replace("$job", JOB))


def legend(template: str, metric: dict[str, str]) -> str:
    """Grafana's legend: {{label}} replaced by its value, by nothing when the series lacks it (empty label)."""
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), template)
    return " ".join(text.split()) or "value"


def render(prom: str, start: float, end: float, out: Path) -> dict[str, int]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.style.use("dark_background")
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    figure = plt.figure(figsize=(24, rows * 0.62), facecolor="#111217")
    grid = figure.add_gridspec(rows, 24, hspace=3.2, wspace=2.4, top=0.95, bottom=0.02, left=0.06, right=0.98)
    seconds = end - start
    counts: dict[str, int] = {}
    for panel in panels:
        g = panel["gridPos"]
        ax = figure.add_subplot(grid[g["y"]:g["y"] + g["h"] - 1, g["x"]:g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        ax.set_title(panel["title"], loc="left", fontsize=12, color="#d8d9da")
        series = []
        for target in panel["targets"]:
            query = substitute(target["expr"], seconds)
            if panel["type"] == "timeseries":
                url = f"{prom}/api/v1/query_range?" + urllib.parse.urlencode(
                    {"query": query, "start": start, "end": end, "step": 2})
            else:
                url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": query, "time": end})
            answer = get_json(url)
            assert answer["status"] == "success", answer
            for item in answer["data"]["result"]:
                series.append((legend(target.get("legendFormat", ""), item["metric"]), item))
        counts[panel["title"]] = len(series)
        unit = panel["fieldConfig"]["defaults"].get("unit", "short")
        draw(ax, panel["type"], series, unit, start)
    figure.suptitle("coldsnap-provider  (docs/grafana/coldsnap-provider.json, rendered from a live Prometheus by "
                    "bench/dashboard.py)", x=0.01, y=0.985, ha="left", fontsize=14, color="#d8d9da")
    figure.savefig(out, dpi=72, facecolor=figure.get_facecolor(), bbox_inches="tight")
    return counts


def draw(ax: Any, kind: str, series: list[tuple[str, dict[str, Any]]], unit: str, start: float) -> None:
    for spine in ax.spines.values():
        spine.set_color("#2c3235")
    ax.tick_params(colors="#9fa7b3", labelsize=8)
    if not series:
        ax.text(0.5, 0.5, "No data", ha="center", va="center", color="#9fa7b3", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    if kind == "timeseries":
        for name, item in series:
            points = [(float(t) - start, float(v)) for t, v in item["values"] if v not in ("NaN", "+Inf")]
            if points:
                ax.plot(*zip(*points, strict=True), label=name, linewidth=1.4)
        ax.set_xlabel("seconds into the run", fontsize=8, color="#9fa7b3")
        ax.grid(color="#2c3235", linewidth=0.6)
        ax.legend(fontsize=7, loc="upper left", framealpha=0.3, ncol=2)
        if unit == "s":
            ax.set_ylabel("seconds", fontsize=8, color="#9fa7b3")
    elif kind == "bargauge":
        values = sorted(((name, float(item["value"][1])) for name, item in series), key=lambda nv: nv[1])
        ax.barh([n for n, _ in values], [v for _, v in values], color="#73bf69")
        top = max(v for _, v in values) or 1.0
        ax.set_xlim(0, top * 1.2)
        for i, (_, v) in enumerate(values):
            ax.text(v + top * 0.01, i, f"{v:.3g}{' s' if unit == 's' else ''}", va="center", fontsize=8,
                    color="#d8d9da")
        ax.grid(axis="x", color="#2c3235", linewidth=0.6)
    else:  # stat
        ax.set_xticks([])
        ax.set_yticks([])
        text = "\n".join(f"{name}: {float(item['value'][1]):g}" for name, item in series)
        ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=16, color="#73bf69", transform=ax.transAxes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "grafana" / "dashboard.png")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="cs-dash-", dir="/tmp"))
    metrics_port, prom_port = free_port(), free_port()
    prometheus = start_prometheus(scratch, f"127.0.0.1:{metrics_port}", prom_port)
    try:
        start = time.time()
        end = anyio.run(load, args.seconds, metrics_port, backend="asyncio")
        counts = render(f"http://127.0.0.1:{prom_port}", start, end, args.out)
    finally:
        prometheus.terminate()
        prometheus.wait(10)
    for title, count in counts.items():
        print(f"{count:3d} series  {title}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

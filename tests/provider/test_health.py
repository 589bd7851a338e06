"""Backend health (issue 38, item 5): `status` exits non-zero naming a backend that does not answer, and
coldsnap_provider_backend_up says the same on the metrics endpoint. Real daemons, the real dockerd, node-b's
sshd and dockerd, closed ports for what is down; the shipped alert rules and Grafana files checked against a
real scrape."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tests.helpers import ROOT, running_daemon, short_dir
from tests.provider.test_metrics import scrape

CLI = [sys.executable, "-m", "coldsnap_provider"]
RULES = ROOT / "packaging" / "prometheus" / "coldsnap-provider.rules.yml"
GRAFANA = ROOT / "packaging" / "grafana"


def _status(state_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "status", "--state-dir", str(state_dir), "-o", "json"], capture_output=True, text=True,
                          check=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.3", 0))
        return int(s.getsockname()[1])


def _metrics(sock: Path, *, node: str = "node-a") -> str:
    return (f'[node]\nnames = ["{node}", "localhost"]\n'
            f'[metrics]\naddress = "unix:{sock}"\nbackend_probe_interval_s = 1.0\n')


def _gauge(text: str, backend: str, host: str) -> float | None:
    match = re.search(rf'^coldsnap_provider_backend_up\{{backend="{backend}",host="{host}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


async def _probed(sock: Path, backend: str, host: str) -> str:
    """A scrape once the periodic probe has answered for (backend, host) (it runs every second here)."""
    with anyio.fail_after(20):
        while _gauge(text := await anyio.to_thread.run_sync(scrape, sock), backend, host) is None:
            await anyio.sleep(0.2)
    return text


def _node_b() -> dict[str, str]:
    if os.geteuid() != 0:
        pytest.skip("node-b needs root (namespaces, a second dockerd)")
    up = subprocess.run(["bash", str(ROOT / "scripts" / "_node_b.sh"), "up"], capture_output=True, text=True,
                        check=False)
    assert up.returncode == 0, up.stderr
    return dict(line.split("=", 1) for line in up.stdout.split())


def _remote(env: dict[str, str], host: str, address: str, port: int | str) -> str:
    return (f'[[remote]]\nhosts = ["{host}"]\naddress = "{address}"\nport = {port}\nuser = "root"\n'
            f'identity_file = "{env["NODE_B_CLIENT_KEY"]}"\nknown_hosts = "{env["NODE_B_KNOWN_HOSTS"]}"\n'
            f'docker_socket = "{env["NODE_B_DOCKER_SOCKET"]}"\nconnect_timeout_s = 2.0\n')


def _scratch() -> Path:
    return short_dir("cs-h-")


async def test_status_exits_0_and_backend_up_is_1_when_every_backend_answers() -> None:
    """Regression: #38 item 5: the local engine and node-b answer: exit 0, healthy, every gauge 1."""
    env = _node_b()
    sock = _scratch() / "metrics.sock"
    config = _metrics(sock) + _remote(env, "node-b", env["NODE_B_ADDRESS"], env["NODE_B_PORT"])
    async with running_daemon(config) as daemon:
        status = await anyio.to_thread.run_sync(_status, daemon.state_dir)
        text = await _probed(sock, "remote", "node-b")
    assert status.returncode == 0, status.stderr
    result = json.loads(status.stdout)
    assert result["healthy"] is True and result["docker_reachable"] is True
    assert result["backends"] == [{"backend": "docker", "host": "node-a", "up": True, "error": ""},
                                  {"backend": "remote", "host": "node-b", "up": True, "error": ""}]
    assert _gauge(text, "docker", "node-a") == 1.0 and _gauge(text, "remote", "node-b") == 1.0


async def test_status_exits_3_naming_a_remote_on_a_closed_port_and_its_gauge_is_0() -> None:
    """Regression: #38 item 5: `status` exited 0 with a [[remote]] node down; now 3, naming it and why."""
    env = _node_b()
    sock = _scratch() / "metrics.sock"
    config = (_metrics(sock) + _remote(env, "node-b", env["NODE_B_ADDRESS"], env["NODE_B_PORT"])
              + _remote(env, "node-down", "127.0.0.3", _closed_port()))
    async with running_daemon(config) as daemon:
        text = await _probed(sock, "remote", "node-down")
        status = await anyio.to_thread.run_sync(_status, daemon.state_dir)
    assert status.returncode == 3, (status.stdout, status.stderr)
    assert "the remote backend of host 'node-down' is unreachable" in status.stderr
    assert "127.0.0.3" in status.stderr and "node-b" not in status.stderr
    result = json.loads(status.stdout)
    assert result["healthy"] is False
    down = [b for b in result["backends"] if not b["up"]]
    assert [b["host"] for b in down] == ["node-down"] and "node-down" in down[0]["error"]
    assert _gauge(text, "remote", "node-down") == 0.0
    assert _gauge(text, "docker", "node-a") == 1.0 and _gauge(text, "remote", "node-b") == 1.0


async def test_status_exits_3_naming_a_kubernetes_host_whose_apiserver_is_down(tmp_path: Path) -> None:
    """Regression: #38 item 5: an apiserver that does not answer (a closed port) makes status exit 3."""
    kubeconfig = tmp_path / "down.kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: down\n  cluster: {{server: 'https://127.0.0.3:{_closed_port()}', "
        "insecure-skip-tls-verify: true}\n"
        "users:\n- name: u\n  user: {token: not-a-secret}\n"
        "contexts:\n- name: down\n  context: {cluster: down, user: u}\ncurrent-context: down\n")
    sock = _scratch() / "metrics.sock"
    config = (_metrics(sock) + f'[[kubernetes]]\nhosts = ["node-k8s-down"]\nkubeconfig = "{kubeconfig}"\n'
              'request_timeout_s = 2.0\n')
    async with running_daemon(config) as daemon:
        status = await anyio.to_thread.run_sync(_status, daemon.state_dir)
        text = await _probed(sock, "kubernetes", "node-k8s-down")
    assert status.returncode == 3, (status.stdout, status.stderr)
    assert "the kubernetes backend of host 'node-k8s-down' is unreachable" in status.stderr
    result = json.loads(status.stdout)
    assert result["kubernetes"][0]["apiserver_reachable"] is False
    assert _gauge(text, "kubernetes", "node-k8s-down") == 0.0 and _gauge(text, "docker", "node-a") == 1.0


# --- the shipped alert rules and Grafana provisioning --------------------------------------


def _exported_names(text: str) -> set[str]:
    """Every series name a scrape carries, with the names of the histograms' and counters' families."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _used_names(expression: str) -> set[str]:
    return set(re.findall(r"\b(coldsnap_[a-z_]+)", expression))


def _unknown(used: set[str], exported: set[str]) -> set[str]:
    """Names neither exported nor a sample of an exported family (a histogram with no observation yet)."""
    suffixes = ("_bucket", "_sum", "_count")
    return {n for n in used if n not in exported
            and not any(n.endswith(s) and n.removesuffix(s) in exported for s in suffixes)}


async def test_alert_rules_pass_promtool_and_use_only_metrics_the_daemon_exports() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus package) is installed by scripts/test"
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    sock = _scratch() / "metrics.sock"
    async with running_daemon(_metrics(sock)) as daemon:
        await daemon.control(operation="status")  # fills backend_up
        exported = _exported_names(await anyio.to_thread.run_sync(scrape, sock))
    import yaml  # kubernetes_asyncio's dependency

    groups = yaml.safe_load(RULES.read_text())["groups"]
    expressions = [rule["expr"] for group in groups for rule in group["rules"]]
    assert len(expressions) >= 5 and all(rule.get("alert") for group in groups for rule in group["rules"])
    used = set().union(*(_used_names(e) for e in expressions))
    assert {"coldsnap_provider_backend_up", "coldsnap_provider_requests_total"} <= used
    assert not _unknown(used, exported)


async def test_grafana_provisioning_names_the_dashboard_and_its_queries_use_exported_metrics() -> None:
    import yaml  # kubernetes_asyncio's dependency

    provider = yaml.safe_load((GRAFANA / "dashboards.yml").read_text())
    assert provider["apiVersion"] == 1
    [entry] = provider["providers"]
    assert entry["type"] == "file" and entry["options"]["path"]
    dashboard = json.loads((ROOT / "docs" / "grafana" / "coldsnap-provider.json").read_text())
    assert "__inputs" not in dashboard  # a provisioned dashboard gets no import dialog to fill inputs
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    sources = [p["datasource"] for p in dashboard["panels"]] + [t["datasource"] for p in dashboard["panels"]
                                                                 for t in p.get("targets", [])]
    assert sources and all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources)
    sock = _scratch() / "metrics.sock"
    async with running_daemon(_metrics(sock)) as daemon:
        await daemon.control(operation="status")
        exported = _exported_names(await anyio.to_thread.run_sync(scrape, sock))
    used = set().union(*(_used_names(t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])))
    assert "coldsnap_provider_backend_up" in used and not _unknown(used, exported)

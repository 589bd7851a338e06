"""`[[kubernetes]]` in the configuration: checked by check-config (and so at start-up, which loads it the same way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

_ENTRY = '[[kubernetes]]\nhosts = {hosts}\nkubeconfig = "{kubeconfig}"\n{extra}\n'


def _entry(tmp_path: Path, hosts: str = '["node-k"]', extra: str = "", kubeconfig: str = "") -> str:
    if not kubeconfig:
        kubeconfig = str(tmp_path / "kubeconfig")
        Path(kubeconfig).write_text(  # check-config loads it as the backend will (#38 item 7): a whole one
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:6443'}\n"
            "users:\n- name: u\n  user: {token: not-a-secret}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
            "current-context: x\n")
    return _ENTRY.format(hosts=hosts, kubeconfig=kubeconfig, extra=extra)


def _check(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.toml"
    path.write_text('[node]\nnames = ["node-a"]\n' + text)
    return subprocess.run([sys.executable, "-m", "coldsnap_provider", "check-config", "-o", "json", str(path)],
                          capture_output=True, text=True, cwd=ROOT)


def test_check_config_kubernetes_entry_is_accepted_with_defaults(tmp_path: Path) -> None:
    result = _check(_entry(tmp_path, extra='node_names = { "node-k" = "ip-10-0-3-17" }'), tmp_path)
    assert result.returncode == 0, result.stderr
    entry = json.loads(result.stdout)["config"]["kubernetes"][0]
    assert entry["namespace"] == "coldsnap" and entry["node_names"] == {"node-k": "ip-10-0-3-17"}
    assert entry["request_timeout_s"] == 30.0


def test_check_config_kubernetes_host_also_local_is_an_error(tmp_path: Path) -> None:
    result = _check(_entry(tmp_path, hosts='["node-a"]'), tmp_path)
    assert result.returncode == 2
    assert "kubernetes[0]: host 'node-a' is also served locally (node.names); list it once" in result.stderr


def test_check_config_kubernetes_host_in_two_entries_is_an_error(tmp_path: Path) -> None:
    result = _check(_entry(tmp_path) + _entry(tmp_path, hosts='["node-l", "node-k"]'), tmp_path)
    assert result.returncode == 2
    assert "kubernetes[1]: host 'node-k' is already listed by kubernetes[0]; list it once" in result.stderr


def test_check_config_node_names_for_a_host_not_listed_is_an_error(tmp_path: Path) -> None:
    result = _check(_entry(tmp_path, extra='node_names = { "node-x" = "n1" }'), tmp_path)
    assert result.returncode == 2
    assert "kubernetes[0].node_names: 'node-x' is not one of this entry's hosts" in result.stderr


def test_check_config_bad_namespace_names_the_field(tmp_path: Path) -> None:
    result = _check(_entry(tmp_path, extra='namespace = "Cold_Snap"'), tmp_path)
    assert result.returncode == 2
    assert "$.kubernetes[0].namespace" in result.stderr


def test_check_config_missing_kubeconfig_names_the_entry(tmp_path: Path) -> None:
    result = _check(_entry(tmp_path, kubeconfig=str(tmp_path / "absent")), tmp_path)
    assert result.returncode == 2
    assert f"kubernetes[0].kubeconfig: {tmp_path / 'absent'}: No such file or directory" in result.stderr

"""`check-config` checks the files a configuration names, as the account the unit runs as (issue 38, item 7).

Real files: kubeconfigs (malformed ones, and the test cluster's own), SSH keys made by ssh-keygen, a real
`coldsnap-provider serve` refusing a malformed kubeconfig in one line. Readability is checked for another
account (nobody) by the CLI itself, as root."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kubernetes import Cluster

CLI = [sys.executable, "-m", "coldsnap_provider"]
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="checking as another account needs root")


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=False, timeout=timeout)


@pytest.fixture
def work(top: Path) -> Path:
    """A directory every account may traverse (pytest's tmp_path is 0700: nobody could reach anything in it)."""
    return top


def _config(work: Path, text: str) -> str:
    path = work / "config.toml"
    path.write_text(text)
    return str(path)


def _kubernetes(work: Path, kubeconfig: str) -> str:
    return _config(work, f'[[kubernetes]]\nhosts = ["node-k"]\nkubeconfig = "{kubeconfig}"\n')


_CLUSTER = "clusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:6443'%s}\n"
_USER = "users:\n- name: u\n  user: {token: not-a-secret}\n"
_CONTEXT = "contexts:\n- name: x\n  context: {cluster: c, user: %s}\n"


@pytest.mark.parametrize(("text", "problem"), [
    pytest.param("apiVersion: v1\nclusters: [\n", "not YAML: while parsing a flow node (line 3, column 1)",
                 id="not-yaml"),
    pytest.param("- just\n- a list\n",
                 "not a kubeconfig (a YAML mapping with clusters, users, contexts and current-context)",
                 id="not-a-mapping"),
    pytest.param(_CLUSTER % "" + _USER + _CONTEXT % "u", "current-context is missing or empty",
                 id="no-current-context"),
    pytest.param(_CLUSTER % "" + _USER + _CONTEXT % "u" + "current-context: y\n",
                 "current-context 'y' is not one of its contexts", id="unknown-context"),
    pytest.param(_CLUSTER % "" + _USER + _CONTEXT % "nobody" + "current-context: x\n",
                 "context 'x' names user 'nobody', which its users do not list", id="no-such-user"),
    pytest.param(_CLUSTER % ", certificate-authority: /nonexistent/ca.crt" + _USER + _CONTEXT % "u"
                 + "current-context: x\n", "kubernetes_asyncio refuses it: File does not exists: /nonexistent/ca.crt",
                 id="missing-ca-file"),
])
def test_check_config_refuses_a_malformed_kubeconfig_naming_the_key_and_the_problem(
        work: Path, text: str, problem: str) -> None:
    """Regression: #38 item 7: check-config passed these (it only opened the file)."""
    kubeconfig = work / "kubeconfig"
    kubeconfig.write_text(text)
    result = cli("check-config", _kubernetes(work, str(kubeconfig)))
    assert result.returncode == 2, result.stdout
    assert result.stderr == f"coldsnap-provider: kubernetes[0].kubeconfig: {kubeconfig}: {problem}\n"


def test_serve_refuses_a_malformed_kubeconfig_in_one_line_not_a_traceback(work: Path) -> None:
    """Regression: #38 item 7: serve died with a 41-line traceback (a TypeError in the client's loader)."""
    kubeconfig = work / "kubeconfig"
    kubeconfig.write_text(_CLUSTER % "" + _USER + _CONTEXT % "nobody" + "current-context: x\n")
    result = cli("serve", "--config", _kubernetes(work, str(kubeconfig)), "--state-dir", str(work / "state"))
    assert result.returncode == 2
    assert result.stderr == (f"coldsnap-provider: kubernetes[0].kubeconfig: {kubeconfig}: context 'x' names user "
                             "'nobody', which its users do not list\n")


@NEEDS_ROOT
def test_the_test_clusters_kubeconfig_passes_as_root_and_is_unreadable_to_nobody(cluster: Cluster,
                                                                                 work: Path) -> None:
    config = _kubernetes(work, cluster.kubeconfig)
    assert cli("check-config", config).returncode == 0
    result = cli("check-config", config, "--as-user", "nobody")
    assert result.returncode == 2
    assert (f"kubernetes[0].kubeconfig: {cluster.kubeconfig}: not readable by user nobody (uid 65534"
            in result.stderr and "Permission denied" in result.stderr)


def _keys(work: Path) -> tuple[Path, Path]:
    """A passphrase-less ed25519 key (0600) and a known_hosts file holding its public half."""
    key = work / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    known = work / "known_hosts"
    known.write_text("[127.0.0.1]:2222 " + " ".join(Path(f"{key}.pub").read_text().split()[:2]) + "\n")
    return key, known


def _remote(work: Path, key: Path, known: Path, extra: str = "") -> str:
    return _config(work, f'[[remote]]\nhosts = ["node-x"]\naddress = "127.0.0.1"\nport = 2222\nuser = "root"\n'
                         f'identity_file = "{key}"\nknown_hosts = "{known}"\n{extra}')


def test_check_config_accepts_a_good_key_and_known_hosts(work: Path) -> None:
    key, known = _keys(work)
    result = cli("check-config", _remote(work, key, known))
    assert result.returncode == 0, result.stderr


def test_check_config_refuses_ssh_files_the_daemon_could_not_use(work: Path) -> None:
    """Regression: #38 item 7: a group-readable key, a key behind a passphrase, and junk, all passed."""
    key, known = _keys(work)
    key.chmod(0o644)
    result = cli("check-config", _remote(work, key, known))
    assert result.returncode == 2
    assert f"remote[0].identity_file: {key}: mode 0644 opens the private key to group or other" in result.stderr
    locked = work / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "a passphrase", "-f", str(locked)], check=True)
    known.write_text("garbage\n")
    result = cli("check-config", _remote(work, locked, known))
    assert result.returncode == 2
    assert f"remote[0].identity_file: {locked}: not a private key asyncssh can load without a passphrase" \
        in result.stderr
    assert f"remote[0].known_hosts: {known}: Invalid known hosts entry" in result.stderr


def test_check_config_refuses_unusable_credential_and_token_files(work: Path) -> None:
    credentials, token = work / "auth.json", work / "hf-token"
    credentials.write_text("[1, 2]")
    token.write_text("two\nlines\n")
    result = cli("check-config", _config(work, f'[registry]\ncredentials_file = "{credentials}"\n'
                                               f'[huggingface]\ntoken_file = "{token}"\n'))
    assert result.returncode == 2
    assert f"registry.credentials_file: {credentials}: must hold a JSON object" in result.stderr
    assert f"huggingface.token_file: {token}: must hold one token (non-empty, one line)" in result.stderr


@NEEDS_ROOT
def test_a_key_readable_by_root_only_fails_as_nobody_and_passes_once_nobody_owns_it(work: Path) -> None:
    """Regression: #38 item 7: check-config could not say whether the unit's account can read a file."""
    key, known = _keys(work)
    config = _remote(work, key, known)
    assert cli("check-config", config).returncode == 0  # root reads it
    result = cli("check-config", config, "--as-user", "nobody")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"coldsnap-provider: remote[0].identity_file: {key}: not readable by user nobody (uid 65534, groups "
        f"{','.join(str(g) for g in sorted(set(os.getgrouplist('nobody', pwd.getpwnam('nobody').pw_gid))))}): "
        "Permission denied"]
    os.chown(key, pwd.getpwnam("nobody").pw_uid, -1)
    assert cli("check-config", config, "--as-user", "nobody").returncode == 0
    assert json.loads(cli("check-config", config, "--as-user", "65534", "-o", "json").stdout)["ok"] is True


def test_check_config_as_an_unknown_user_names_it(work: Path) -> None:
    result = cli("check-config", _config(work, ""), "--as-user", "no-such-user-coldsnap")
    assert result.returncode == 2 and "--as-user 'no-such-user-coldsnap': no such user" in result.stderr

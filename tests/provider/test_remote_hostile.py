"""A hostile remote node (#24 findings 1 and 9): its SSH user serves its own SFTP server and its own tar.

A second real sshd runs in node-b's namespaces (same host key, its own port and authorized_keys), with a
per-key `command=` that answers the SFTP subsystem and our context `tar` with a planted tree
(``_hostile_peer.py``): what a remote user can do without any privilege. Each trick must fail the build with
a clear error and write nothing outside the staging tree (a victim directory on this node stays untouched).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import running_daemon
from tests.provider.test_remote import NodeB, node_b  # noqa: F401 - the node-b fixture

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="node-b needs root (namespaces, a second dockerd)")

_PEER = Path(__file__).with_name("_hostile_peer.py")
_CONTEXT = "/tmp/coldsnap-hostile-context"


@dataclass(frozen=True)
class Hostile:
    directory: Path
    port: int
    known_hosts: Path  # the plain host key
    cert_known_hosts: Path  # only a @cert-authority line for the CA that signed the host key

    def config(self, node: NodeB, *, known_hosts: Path | None = None) -> str:
        return node.config(port=self.port, known_hosts=str(known_hosts or self.known_hosts))

    def plant(self, tree: list[dict[str, Any]]) -> None:
        (self.directory / "tree.json").write_text(json.dumps({"base": _CONTEXT, "tree": tree}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def hostile(node_b: NodeB) -> Iterator[Hostile]:  # noqa: F811 - the imported fixture
    data = Path(node_b.env["NODE_B_DATA"])
    directory = Path(tempfile.mkdtemp(prefix=f"hostile-{os.getpid()}-", dir=data))  # 0700 root: StrictModes
    port = _free_port()
    host_key = data / "ssh" / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / "ca")], check=True)
    shutil.copy(host_key, directory / "host")
    shutil.copy(f"{host_key}.pub", directory / "host.pub")
    subprocess.run(["ssh-keygen", "-q", "-s", str(directory / "ca"), "-I", "node-b", "-h", "-n", "127.0.0.2",
                    str(directory / "host.pub")], check=True)
    client = Path(node_b.env["NODE_B_CLIENT_KEY"] + ".pub").read_text().strip()
    shutil.copy(_PEER, directory / "peer.py")
    (directory / "authorized_keys").write_text(
        f'command="/usr/bin/python3 {directory}/peer.py {directory}/tree.json",no-pty {client}\n')
    os.chmod(directory / "authorized_keys", 0o600)
    (directory / "sshd_config").write_text(f"""ListenAddress 127.0.0.2:{port}
HostKey {directory}/host
HostCertificate {directory}/host-cert.pub
PidFile {directory}/sshd.pid
AuthorizedKeysFile {directory}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowStreamLocalForwarding yes
AllowTcpForwarding local
MaxSessions 64
Subsystem sftp internal-sftp
""")
    entry = f"[127.0.0.2]:{port}"
    known = directory / "known_hosts"
    known.write_text(f"{entry} {' '.join(Path(f'{host_key}.pub').read_text().split()[:2])}\n")
    cert_known = directory / "cert_known_hosts"
    cert_known.write_text(f"@cert-authority {entry} {' '.join((directory / 'ca.pub').read_text().split()[:2])}\n")
    log = open(directory / "sshd.log", "wb")
    sshd = subprocess.Popen(["nsenter", f"--target={node_b.sshd_pid()}", "--mount", "--uts", "--",
                             "/usr/sbin/sshd", "-D", "-e", "-f", str(directory / "sshd_config")],
                            stdout=log, stderr=log)
    try:
        for _ in range(100):  # bounded: 10 s
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.2", port)) == 0:
                    break
            if sshd.poll() is not None:
                pytest.fail((directory / "sshd.log").read_text())
            subprocess.run(["sleep", "0.1"], check=True)
        yield Hostile(directory=directory, port=port, known_hosts=known, cert_known_hosts=cert_known)
    finally:
        sshd.terminate()
        sshd.wait(10)
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def victim() -> Iterator[Path]:
    """A directory on this node that a hostile remote must not reach: one file in it, known content."""
    path = Path(tempfile.mkdtemp(prefix="cs-victim-", dir="/var/tmp"))
    (path / "victim").write_text("original\n")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _chain(victim: Path) -> str:
    """A link target that lexically stays in the tree (each `d/u/..` cancels) but climbs to `/` (d/u -> ..)."""
    return "d/u/" * 12 + "../" * 24 + str(victim / "victim").lstrip("/")


def _tricks(victim: Path) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """Each trick's tree (in listing order) and the rule the refusal must name."""
    root = {"name": "ctx", "type": "dir"}
    up = [{"name": "ctx/d", "type": "dir"}, {"name": "ctx/d/u", "type": "link", "target": ".."}]
    return {
        # A link that passes a lexical check, then the same name again as a file: the write follows the link.
        "listed-twice": ([root, *up, {"name": "ctx/x", "type": "link", "target": _chain(victim)},
                          {"name": "ctx/x", "type": "file", "data": "pwned\n"}], "listed twice"),
        "through-link": ([root, *up, {"name": "ctx/d/u/" + "../" * 24 + str(victim / "victim").lstrip("/"),
                                      "type": "file", "data": "pwned\n"}], "outside the copied path"),
        "below-link": ([root, *up, {"name": "ctx/d/u/escape", "type": "file", "data": "pwned\n"}],
                       "passes through a symbolic link"),
        "absolute": ([root, {"name": str(victim / "victim"), "type": "file", "data": "pwned\n"}],
                     "outside the copied path"),
        "hard-link-out": ([root, {"name": "ctx/h", "type": "hardlink", "target": str(victim / "victim")}],
                          "points outside the copied path"),
        "root-is-a-link": ([{"name": "ctx", "type": "link", "target": str(victim)}],
                           "does not start with the context directory"),
    }


@pytest.mark.parametrize("trick", ["listed-twice", "through-link", "below-link", "absolute", "hard-link-out",
                                   "root-is-a-link"])
async def test_build_context_from_hostile_node_writes_nothing_outside_and_fails_clearly(
        node_b: NodeB, hostile: Hostile, victim: Path, trick: str) -> None:  # noqa: F811
    """Regression: #24 finding 1 (a planted link made the root daemon write any file on this node)."""
    tree, rule = _tricks(victim)[trick]
    hostile.plant(tree)
    tag = f"coldsnap-test/hostile-{trick}:{os.getpid()}"
    dockerfile = base64.b64encode(b"FROM scratch\nCOPY . /\n").decode()
    before = sorted(os.listdir(victim))
    try:
        async with running_daemon(hostile.config(node_b)) as daemon:
            s = await daemon.open_session(hosts=["node-b"])
            reply = await s.runtime("image-build", host="node-b", build={
                "dockerfile": dockerfile, "context": _CONTEXT, "tag": tag})
    finally:
        node_b.docker("rmi", "-f", tag, check=False)
    assert (victim / "victim").read_text() == "original\n"
    assert sorted(os.listdir(victim)) == before
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert reply.error.startswith("image-build failed") and rule in reply.error, reply.error


async def test_remote_host_certificate_is_not_trusted_only_plain_keys(node_b: NodeB, hostile: Hostile) -> None:  # noqa: F811
    """Regression: #24 finding 9 (a @cert-authority line let its CA vouch for the node's host key)."""
    hostile.plant([{"name": "ctx", "type": "dir"}])
    async with running_daemon(hostile.config(node_b, known_hosts=hostile.cert_known_hosts)) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        refused = await s.call("exec", host="node-b", arguments=["true"])
    async with running_daemon(hostile.config(node_b)) as daemon:  # the same node, its plain key pinned
        s = await daemon.open_session(hosts=["node-b"])
        accepted = await s.call("exec", host="node-b", arguments=["true"])
    assert not refused.ok and "host key" in refused.error and "remote host node-b" in refused.error
    assert accepted.ok and accepted.exit_code == 0, accepted.error


async def test_build_context_hard_links_from_hostile_node_count_against_copy_max_bytes(
        node_b: NodeB, hostile: Hostile) -> None:  # noqa: F811
    """Review of #24 finding 8: a remote user's tar of 1 MiB of data and 64 hard links to it (a 1 MiB stream,
    under a 4 MiB cap) was extracted by this node as root into its state directory as 65 MiB."""
    tree: list[dict[str, Any]] = [{"name": "ctx", "type": "dir"},
                                  {"name": "ctx/f", "type": "file", "data": "x" * (1 << 20)}]
    tree += [{"name": f"ctx/l{i}", "type": "hardlink", "target": "ctx/f"} for i in range(64)]
    hostile.plant(tree)
    tag = f"coldsnap-test/hostile-links:{os.getpid()}"
    dockerfile = base64.b64encode(b"FROM scratch\nCOPY . /\n").decode()
    try:
        async with running_daemon(hostile.config(node_b) + "[docker]\ncopy_max_bytes = 4194304\n") as daemon:
            s = await daemon.open_session(hosts=["node-b"])
            reply = await s.runtime("image-build", host="node-b", build={
                "dockerfile": dockerfile, "context": _CONTEXT, "tag": tag})
            leftovers = [p for p in daemon.state_dir.rglob("*") if p.is_file() and p.stat().st_size >= 1 << 20]
    finally:
        node_b.docker("rmi", "-f", tag, check=False)
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert "the copy's files hold more than 4194304 bytes" in reply.error, reply.error
    assert leftovers == []

"""Remote hosts over SSH ([[remote]]): a real second node on this machine (scripts/_node_b.sh).

node-b is an sshd on 127.0.0.2 in its own UTS and mount namespaces (hostname node-b, its own /tmp) and a second
dockerd in node-b's mount namespace and a network namespace of its own. Every assertion about "where" asks the
node itself: node-b's engine socket, node-b's /tmp (through /proc/<its sshd>/root), or exec on node-b.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import Registry, docker
from tests.helpers import EXEC_AS_NOBODY, ROOT, Daemon, Session, module_daemon, running_daemon, session_as

_NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="node-b needs root (namespaces, a second dockerd)")

_SCRIPT = ROOT / "scripts" / "_node_b.sh"


@dataclass(frozen=True)
class NodeB:
    env: dict[str, str]

    @property
    def socket(self) -> str:
        return self.env["NODE_B_DOCKER_SOCKET"]

    def sshd_pid(self) -> int:
        return int(Path(self.env["NODE_B_SSHD_PID_FILE"]).read_text())

    def dockerd_pid(self) -> int:
        return int(Path(self.env["NODE_B_DOCKERD_PID_FILE"]).read_text())

    def path(self, path: str) -> Path:
        """`path` as node-b sees it (its mount namespace)."""
        return Path(f"/proc/{self.sshd_pid()}/root") / path.lstrip("/")

    def docker(self, *args: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["docker", "-H", f"unix://{self.socket}", *args], input=input, capture_output=True,
                              check=check)

    def config(self, *, hosts: tuple[str, ...] = ("node-b",), known_hosts: str | None = None,
               address: str | None = None, port: int | None = None, extra: str = "") -> str:
        return f"""
[[remote]]
hosts = {json.dumps(list(hosts))}
address = "{address or self.env['NODE_B_ADDRESS']}"
port = {port or self.env['NODE_B_PORT']}
user = "root"
identity_file = "{self.env['NODE_B_CLIENT_KEY']}"
known_hosts = "{known_hosts or self.env['NODE_B_KNOWN_HOSTS']}"
docker_socket = "{self.socket}"
connect_timeout_s = 3.0
keepalive_interval_s = 2.0
{extra}
"""

    def drop_links(self) -> None:
        """Kill every per-connection sshd of node-b (the listener stays): a dropped link, as seen by both ends."""
        children = subprocess.run(["pgrep", "-P", str(self.sshd_pid())], capture_output=True, text=True).stdout
        for pid in children.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="session")
def node_b(busybox_image: str) -> NodeB:
    up = subprocess.run(["bash", str(_SCRIPT), "up"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"node-b set-up failed:\n{up.stderr}")
    env = dict(line.split("=", 1) for line in up.stdout.split())
    node = NodeB(env=env)
    if node.docker("image", "inspect", busybox_image, check=False).returncode != 0:
        saved = docker("save", busybox_image).stdout  # the same rootfs and image id as the local test image
        node.docker("load", input=saved)
    return node


@pytest.fixture(scope="module")
def remote_daemon(node_b: NodeB) -> Iterator[Daemon]:
    """One daemon with node-b's [[remote]] entry for the tests that only run commands and workloads through it,
    each in its own session (a start and an SSH connect: over a second); the tests that drop its link, break
    node-b or read its log start their own."""
    yield from module_daemon(None, node_b.config())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _output(reply: Any) -> bytes:
    return reply.output or b""


async def _exec(s: Session, host: str, *argv: str, **fields: Any) -> Any:
    return await s.call("exec", host=host, arguments=list(argv), **fields)


async def _wait_until(predicate: Any, what: str) -> None:
    """Poll a condition owned by another process (bounded by the test timeout, not asserted on time)."""
    with anyio.fail_after(15):
        while not await anyio.to_thread.run_sync(predicate):
            await anyio.sleep(0.1)


async def _running_on_node_b(s: Session, pid: int) -> bool:
    """Ask node-b whether `pid` is a live process there (a zombie awaiting its reaper is not)."""
    asked = await _exec(s, "node-b", "grep", "-q", "^State:[[:space:]]*[^Z[:space:]]", f"/proc/{pid}/status")
    return bool(asked.exit_code == 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] if Path(
        f"/proc/{pid}/stat").exists() else "X"
    return state != "Z"


# --- configuration --------------------------------------------------------------------------


def _check_config(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "coldsnap_provider", "check-config", "-o", "json", str(path)],
                          capture_output=True, text=True, cwd=ROOT)


def test_check_config_host_local_and_remote_is_an_error(tmp_path: Path) -> None:
    text = '[node]\nnames = ["node-a"]\n' + NodeB(env=_fake_env()).config(hosts=("node-a",))
    result = _check_config(text, tmp_path)
    assert result.returncode == 2
    assert "remote[0]: host 'node-a' is also served locally (node.names); list it once" in result.stderr


def test_check_config_host_in_two_remotes_is_an_error(tmp_path: Path) -> None:
    node = NodeB(env=_fake_env())
    result = _check_config(node.config(hosts=("node-b",)) + node.config(hosts=("node-c", "node-b")), tmp_path)
    assert result.returncode == 2
    assert "remote[1]: host 'node-b' is already listed by remote[0]; list it once" in result.stderr


def test_check_config_relative_known_hosts_is_an_error(tmp_path: Path) -> None:
    result = _check_config(NodeB(env=_fake_env()).config(known_hosts="known_hosts"), tmp_path)
    assert result.returncode == 2
    assert "$.remote[0].known_hosts" in result.stderr


def test_check_config_remote_entry_is_accepted_with_defaults(tmp_path: Path) -> None:
    key = tmp_path / "id"  # check-config loads the key and known_hosts as the daemon will (#38 item 7)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (tmp_path / "known_hosts").write_text("[127.0.0.2]:2222 " + " ".join((tmp_path / "id.pub").read_text().split()[:2]))
    env = {**_fake_env(), "NODE_B_CLIENT_KEY": str(key), "NODE_B_KNOWN_HOSTS": str(tmp_path / "known_hosts")}
    text = NodeB(env=env).config().replace("connect_timeout_s = 3.0\n", "").replace(
        'docker_socket = "/x/docker.sock"\n', "")
    result = _check_config(text, tmp_path)
    assert result.returncode == 0, result.stderr
    remote = json.loads(result.stdout)["config"]["remote"][0]
    assert remote["hosts"] == ["node-b"] and remote["docker_socket"] == "/var/run/docker.sock"
    assert remote["connect_timeout_s"] == 10.0


def _fake_env() -> dict[str, str]:
    return {"NODE_B_ADDRESS": "127.0.0.2", "NODE_B_PORT": "2222", "NODE_B_CLIENT_KEY": "/k/id",
            "NODE_B_KNOWN_HOSTS": "/k/known_hosts", "NODE_B_DOCKER_SOCKET": "/x/docker.sock"}


def _maps_the_ssh_stack(daemon: Daemon) -> bool:
    """Whether the daemon process has cryptography's compiled core mapped (asyncssh's import loads it)."""
    assert daemon.process is not None
    return "/cryptography/" in Path(f"/proc/{daemon.process.pid}/maps").read_text()


async def test_a_daemon_loads_the_ssh_stack_only_when_a_remote_entry_is_configured(node_b: NodeB) -> None:
    """asyncssh and cryptography (about 0.2 s of imports) wait for a [[remote]] entry: most daemons have none."""
    async with running_daemon() as plain, running_daemon(node_b.config()) as remote:
        assert not _maps_the_ssh_stack(plain)
        assert _maps_the_ssh_stack(remote)


# --- exec -----------------------------------------------------------------------------------


async def test_exec_session_spanning_both_nodes_runs_each_on_its_node(remote_daemon: Daemon, node_b: NodeB) -> None:
    s = await remote_daemon.open_session(hosts=["localhost", "node-b"])
    remote = await _exec(s, "node-b", "hostname")
    local = await _exec(s, "localhost", "hostname")
    assert remote.ok and _output(remote) == b"node-b\n"
    assert local.ok and _output(local) == (socket.gethostname() + "\n").encode()


async def test_exec_remote_argv_with_shell_metacharacters_arrives_exactly(remote_daemon: Daemon, node_b: NodeB) -> None:
    argv = ["printf", "[%s]\\n", "a b", "", "$HOME", "*", ";", "''", '"', "\\", "`id`", "x\ny", "-n", "&&", "|"]
    s = await remote_daemon.open_session(hosts=["localhost", "node-b"])
    remote = await _exec(s, "node-b", *argv)
    local = await _exec(s, "localhost", *argv)
    assert remote.ok and remote.exit_code in (0, None)
    assert _output(remote) == _output(local)
    assert _output(remote).startswith(b"[a b]\n[]\n[$HOME]\n[*]\n[;]\n[''")


async def test_exec_remote_stdin_exit_codes_and_combined_match_local(remote_daemon: Daemon, node_b: NodeB) -> None:
    s = await remote_daemon.open_session(hosts=["localhost", "node-b"])
    fed = await _exec(s, "node-b", "cat", input=_b64(b"bytes \x00\xff fed on stdin"))
    assert _output(fed) == b"bytes \x00\xff fed on stdin"
    empty = await _exec(s, "node-b", "cat")  # no input: stdin is closed at once
    assert empty.ok and _output(empty) == b""
    split = await _exec(s, "node-b", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert (split.exit_code, _output(split), split.error_output) == (3, b"out\n", b"err\n")
    both = await _exec(s, "node-b", "sh", "-c", "echo out; echo err >&2; exit 4", combined=True)
    assert (both.exit_code, _output(both), both.error_output or b"") == (4, b"out\nerr\n", b"")
    missing = await _exec(s, "node-b", "no-such-program-coldsnap")
    local_missing = await _exec(s, "localhost", "no-such-program-coldsnap")
    assert missing.exit_code == local_missing.exit_code == 127
    killed = await _exec(s, "node-b", "sh", "-c", "kill -9 $$")
    assert killed.exit_code == 137


async def test_exec_remote_client_disconnect_kills_the_remote_process(remote_daemon: Daemon, node_b: NodeB) -> None:
    marker = f"/tmp/coldsnap-remote-{os.getpid()}-disconnect"
    s = await remote_daemon.open_session(hosts=["node-b"])
    script = f"sleep 300 & echo $! > {marker}; wait"
    request = s.envelope("exec", host="node-b", arguments=["sh", "-c", script])
    stream = await anyio.connect_unix(s.socket)
    await stream.send(json.dumps(request).encode() + b"\n")
    await stream.send_eof()
    pid_file = node_b.path(marker)
    await _wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the remote child")
    pid = int(pid_file.read_text())
    assert not Path(marker).exists()  # written in node-b's /tmp, not ours
    await stream.aclose()
    await _wait_until(lambda: not _alive(pid), "the remote child to be killed")
    assert not await _running_on_node_b(s, pid)  # and node-b agrees
    node_b.path(marker).unlink(missing_ok=True)


async def test_exec_host_neither_local_nor_remote_keeps_todays_refusal(remote_daemon: Daemon, node_b: NodeB) -> None:
    s = await remote_daemon.open_session(hosts=["node-z", "node-b"])
    reply = await _exec(s, "node-z", "true")
    assert not reply.ok
    assert reply.error.startswith("host-provider target 'node-z' is authorized but not served by this node")


# --- runtime --------------------------------------------------------------------------------


async def test_runtime_actions_for_node_b_reach_only_node_b_engine(remote_daemon: Daemon, node_b: NodeB,
                                                                   busybox_image: str) -> None:
    name = f"coldsnap-remote-{os.getpid()}"
    tag = f"coldsnap-test/remote-tag:{os.getpid()}"
    built = f"coldsnap-test/remote-built:{os.getpid()}"
    context = f"/tmp/coldsnap-remote-context-{os.getpid()}"
    s = await remote_daemon.open_session(hosts=["localhost", "node-b"])
    try:
        inspected = await s.runtime("image-inspect", host="node-b", image=busybox_image)
        assert inspected.ok, inspected.error
        run = await s.runtime("workload-run", host="node-b", workload={
            "image": busybox_image, "name": name, "detached": True,
            "command": ["sh", "-c", "echo started; mkdir -p /out/d; echo payload > /out/d/f; sleep 300"]})
        assert run.ok, run.error
        assert node_b.docker("container", "inspect", name, check=False).returncode == 0
        assert docker("container", "inspect", name, check=False).returncode != 0  # not on this node
        local_view = await s.runtime("workload-inspect", host="localhost", name=name)
        assert local_view.error_code == "not_found"
        info = await s.runtime("workload-inspect", host="node-b", name=name)
        assert info.ok and info.runtime.workload.running
        executed = await s.runtime("workload-exec", host="node-b", name=name,
                                   execution={"command": ["hostname"]})
        assert executed.ok and _output(executed.runtime).strip() == info.runtime.workload.id[:12].encode()

        async def logged() -> bool:
            logs = await s.runtime("workload-logs", host="node-b", name=name, tail=5)
            return b"started" in _output(logs.runtime)

        with anyio.fail_after(10):
            while not await logged():
                await anyio.sleep(0.1)
        while (await s.runtime("workload-exec", host="node-b", name=name,
                               execution={"command": ["cat", "/out/d/f"]})).error_code:
            await anyio.sleep(0.1)
        copied = await s.runtime("workload-copy-from", host="node-b", name=name, path="/out",
                                 destination=f"/tmp/{name}-copy")
        assert copied.ok, copied.error
        assert node_b.path(f"/tmp/{name}-copy/d/f").read_text() == "payload\n"
        assert not Path(f"/tmp/{name}-copy").exists()
        missing = await s.runtime("workload-copy-from", host="node-b", name=name, path="/nowhere",
                                  destination=f"/tmp/{name}-none")
        assert missing.error_code == "path_not_found"

        tagged = await s.runtime("image-tag", host="node-b", source=busybox_image, target=tag)
        assert tagged.ok, tagged.error
        assert node_b.docker("image", "inspect", tag, check=False).returncode == 0
        assert docker("image", "inspect", tag, check=False).returncode != 0
        removed = await s.runtime("image-remove", host="node-b", image=tag)
        assert removed.ok, removed.error
        assert node_b.docker("image", "inspect", tag, check=False).returncode != 0

        made = await _exec(s, "node-b", "sh", "-c", f"mkdir -p {context} && echo from-node-b > {context}/f")
        assert made.exit_code == 0
        dockerfile = f"FROM {busybox_image}\nCOPY f /f\n".encode()
        build = await s.runtime("image-build", host="node-b", build={
            "dockerfile": _b64(dockerfile), "context": context, "tag": built})
        assert build.ok, build.error
        assert node_b.docker("image", "inspect", built, check=False).returncode == 0
        assert docker("image", "inspect", built, check=False).returncode != 0
        check = node_b.docker("run", "--rm", built, "cat", "/f")
        assert check.stdout == b"from-node-b\n"

        gone = await s.runtime("workload-remove", host="node-b", name=name)
        assert gone.ok
        assert node_b.docker("container", "inspect", name, check=False).returncode != 0
    finally:
        node_b.docker("rm", "-f", name, check=False)
        node_b.docker("rmi", "-f", tag, built, check=False)
        shutil.rmtree(node_b.path(context), ignore_errors=True)
        shutil.rmtree(node_b.path(f"/tmp/{name}-copy"), ignore_errors=True)


async def test_runtime_workload_exec_on_node_b_cancelled_is_killed_there(remote_daemon: Daemon, node_b: NodeB,
                                                                         busybox_image: str) -> None:
    name = f"coldsnap-remote-exec-{os.getpid()}"

    def running_in_container() -> bool:
        top = node_b.docker("top", name, check=False).stdout.decode()
        return "sleep 301" in top

    s = await remote_daemon.open_session(hosts=["node-b"])
    try:
        run = await s.runtime("workload-run", host="node-b", workload={
            "image": busybox_image, "name": name, "detached": True, "command": ["sleep", "300"]})
        assert run.ok, run.error
        request = s.envelope("runtime", host="node-b", runtime={
            "action": "workload-exec", "name": name, "execution": {"command": ["sleep", "301"]}})
        stream = await anyio.connect_unix(s.socket)
        await stream.send(json.dumps(request).encode() + b"\n")
        await stream.send_eof()
        await _wait_until(running_in_container, "the exec to start in node-b's container")
        await stream.aclose()
        await _wait_until(lambda: not running_in_container(), "the abandoned exec to be killed on node-b")
    finally:
        node_b.docker("rm", "-f", name, check=False)


@pytest.fixture
def node_b_registry(node_b: NodeB, registry: Registry) -> Iterator[Registry]:
    """The test registry also answering inside node-b's network namespace (same address, storage, users)."""
    base = registry.credentials_file.parent
    log = open(base / "registry-node-b.log", "wb")
    process = subprocess.Popen(["nsenter", f"--net=/proc/{node_b.dockerd_pid()}/ns/net", "docker-registry",
                                "serve", str(base / "config.yml")], stdout=log, stderr=log)
    host, port = registry.address.split(":")

    def listening() -> bool:
        probe = subprocess.run(["nsenter", f"--net=/proc/{node_b.dockerd_pid()}/ns/net", "bash", "-c",
                                f"exec 3<>/dev/tcp/{host}/{port}"], capture_output=True)
        return probe.returncode == 0

    try:
        while not listening():  # bounded by the test timeout
            if process.poll() is not None:
                pytest.fail((base / "registry-node-b.log").read_text())
            threading.Event().wait(0.05)
        yield registry
    finally:
        process.terminate()
        process.wait(10)
        log.close()


async def test_runtime_pull_and_push_for_node_b_use_node_b_engine_with_credentials(
        node_b: NodeB, node_b_registry: Registry, busybox_image: str) -> None:
    pushed = f"{node_b_registry.address}/coldsnap/remote-push:{os.getpid()}"
    allowed = f'registries = ["{node_b_registry.address}"]'
    config = node_b.config(extra=allowed) + f'\n[registry]\ncredentials_file = "{node_b_registry.credentials_file}"\n'
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["localhost", "node-b"])
        try:
            assert (await s.runtime("image-tag", host="node-b", source=busybox_image, target=pushed)).ok
            push = await s.runtime("image-push", host="node-b", image=pushed)
            assert push.ok, push.error
            assert (await s.runtime("image-remove", host="node-b", image=pushed)).ok
            pull = await s.runtime("image-pull", host="node-b", image=pushed)
            assert pull.ok, pull.error
            assert node_b.docker("image", "inspect", pushed, check=False).returncode == 0
            assert docker("image", "inspect", pushed, check=False).returncode != 0
            # Credentials travel per call; node-b's engine keeps none.
            assert not node_b.path("/root/.docker/config.json").exists()
        finally:
            node_b.docker("rmi", "-f", pushed, check=False)


# --- upload ---------------------------------------------------------------------------------


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    """A directory exec.user (nobody) can traverse (pytest's own tmp tree is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="cs-up-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_upload_to_node_b_lands_in_node_b_tmp_only(node_b: NodeB, world_readable_dir: Path) -> None:
    tmp_path = world_readable_dir
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("deep\n")
    (tree / "top").write_text("top\n")
    os.chmod(tree / "top", 0o4755)  # a setuid bit never reaches the remote node
    os.symlink("top", tree / "link")
    for p in (tmp_path, tree, tree / "sub"):
        os.chmod(p, 0o755)
    os.chmod(tree / "sub" / "f", 0o644)
    single = tmp_path / "single.txt"
    single.write_text("single\n")
    os.chmod(single, 0o644)
    secret = tmp_path / "secret.txt"
    secret.write_text("root only\n")
    os.chmod(secret, 0o600)
    dest = f"/tmp/coldsnap-upload-{os.getpid()}"
    async with running_daemon(node_b.config() + '\n[exec]\nuser = "nobody"\n') as daemon:
        s = await daemon.open_session(hosts=["localhost", "node-b"])
        try:
            one = await s.call("upload", host="node-b", sources=[str(single)], destination=f"{dest}-single")
            assert one.ok, one.error
            assert node_b.path(f"{dest}-single").read_text() == "single\n"
            assert not Path(f"{dest}-single").exists()
            assert (await _exec(s, "node-b", "mkdir", dest)).exit_code == 0
            rec = await s.call("upload", host="node-b", sources=[str(tree)], destination=dest, recursive=True)
            assert rec.ok, rec.error
            landed = node_b.path(f"{dest}/tree")
            assert (landed / "sub" / "f").read_text() == "deep\n"
            assert os.readlink(landed / "link") == "top"
            assert os.stat(landed / "top").st_mode & 0o7777 == 0o755
            not_recursive = await s.call("upload", host="node-b", sources=[str(tree)], destination=f"{dest}/x")
            assert not not_recursive.ok and "omitting directory" in not_recursive.error
            unreadable = await s.call("upload", host="node-b", sources=[str(secret)], destination=f"{dest}/s")
            assert not unreadable.ok and "Permission denied" in unreadable.error  # read as exec.user
            assert not node_b.path(f"{dest}/s").exists()
        finally:
            shutil.rmtree(node_b.path(dest), ignore_errors=True)
            node_b.path(f"{dest}-single").unlink(missing_ok=True)


# --- status and faults ----------------------------------------------------------------------


def _silent_listener() -> tuple[socket.socket, int]:
    """A TCP listener on loopback that accepts and never speaks (an sshd that hangs)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    return listener, int(listener.getsockname()[1])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.3", 0))
        return int(s.getsockname()[1])


async def test_status_reports_each_remote_reachability_and_round_trip(node_b: NodeB) -> None:
    config = node_b.config() + node_b.config(hosts=("node-c",), address="127.0.0.3", port=_closed_port())
    async with running_daemon(config) as daemon:
        status = await daemon.control(operation="status")
    by_host = {entry["hosts"][0]: entry for entry in status["remotes"]}
    assert by_host["node-b"]["reachable"] is True and by_host["node-b"]["docker_reachable"] is True
    assert by_host["node-b"]["rtt_ms"] > 0
    assert by_host["node-c"]["reachable"] is False and by_host["node-c"]["rtt_ms"] is None
    assert "node-c" in by_host["node-c"]["error"]


async def test_remote_sshd_down_or_silent_fails_naming_the_host(node_b: NodeB) -> None:
    listener, silent_port = _silent_listener()
    try:
        config = (node_b.config(hosts=("node-c",), address="127.0.0.3", port=_closed_port())
                  + node_b.config(hosts=("node-d",), address="127.0.0.1", port=silent_port))
        async with running_daemon(config) as daemon:
            s = await daemon.open_session(hosts=["node-c", "node-d"])
            down = await _exec(s, "node-c", "true")
            silent = await s.runtime("image-inspect", host="node-d", image="busybox")
    finally:
        listener.close()
    assert not down.ok and down.error_code == "runtime_failed"
    assert "remote host node-c" in down.error and "127.0.0.3" in down.error
    assert not silent.ok and silent.error_code == "runtime_failed"
    assert "remote host node-d" in silent.error


async def test_remote_changed_host_key_is_refused_and_logged(node_b: NodeB, tmp_path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    entry = Path(node_b.env["NODE_B_KNOWN_HOSTS"]).read_text().split()[0]
    other_key = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    known = tmp_path / "known_hosts"
    known.write_text(f"{entry} {other_key}\n")
    async with running_daemon(node_b.config(known_hosts=str(known))) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        reply = await _exec(s, "node-b", "true")
        events = daemon.log_events()
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert "host key" in reply.error and "remote host node-b" in reply.error
    assert any(e.get("event") == "remote host key refused" and e.get("host") == "node-b" for e in events)


async def test_remote_dockerd_restart_fails_then_recovers_naming_the_host(node_b: NodeB, busybox_image: str) -> None:
    async with running_daemon(node_b.config()) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        assert (await s.runtime("image-inspect", host="node-b", image=busybox_image)).ok
        pid = node_b.dockerd_pid()
        os.kill(pid, signal.SIGTERM)
        await _wait_until(lambda: not _alive(pid), "node-b's dockerd to stop")
        down = await s.runtime("image-inspect", host="node-b", image=busybox_image)
        assert not down.ok and down.error_code == "runtime_failed" and "remote host node-b" in down.error
        await anyio.to_thread.run_sync(lambda: subprocess.run(["bash", str(_SCRIPT), "up"], check=True,
                                                              capture_output=True))
        again = await s.runtime("image-inspect", host="node-b", image=busybox_image)
        assert again.ok, again.error


async def _exec_abandoned_by_a_dropped_link(s: Session, node_b: NodeB, marker: str) -> int:
    """Start a long exec on node-b, drop the link under it; the remote child's pid (still alive)."""
    assert (await _exec(s, "node-b", "true")).ok  # the link is up
    script = f"sleep 300 & echo $! > {marker}; wait"
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def run() -> None:
            result.append(await _exec(s, "node-b", "sh", "-c", script))

        tg.start_soon(run)
        pid_file = node_b.path(marker)
        await _wait_until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the remote child")
        pid = int(pid_file.read_text())
        node_b.drop_links()
    reply = result[0]
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert "remote host node-b" in reply.error and "dropped" in reply.error
    assert _alive(pid)  # nothing could reach node-b while the link was down
    return pid


async def test_remote_link_dropped_mid_exec_is_reported_and_cleaned_when_it_returns(node_b: NodeB) -> None:
    marker = f"/tmp/coldsnap-remote-{os.getpid()}-drop"
    async with running_daemon(node_b.config()) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        pid = await _exec_abandoned_by_a_dropped_link(s, node_b, marker)
        again = await _exec(s, "node-b", "true")  # the link returns: the pending kill runs first
        assert again.ok
        await _wait_until(lambda: not _alive(pid), "the abandoned remote child to be killed")
        assert not await _running_on_node_b(s, pid)
        node_b.path(marker).unlink(missing_ok=True)


async def test_remote_link_dropped_mid_exec_is_cleaned_by_the_daemons_maintenance_without_a_call(
        node_b: NodeB) -> None:
    """No request reopens the link: the daemon's one maintenance loop (remote nodes every 10 s) does, and runs
    the pending kill."""
    marker = f"/tmp/coldsnap-remote-{os.getpid()}-drop-idle"
    async with running_daemon(node_b.config()) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        pid = await _exec_abandoned_by_a_dropped_link(s, node_b, marker)
        with anyio.fail_after(30):  # at most one remote maintenance period (10 s) plus a reconnect
            while await anyio.to_thread.run_sync(_alive, pid):
                await anyio.sleep(0.2)
        node_b.path(marker).unlink(missing_ok=True)


# A registry that never finishes a pull: refuses TLS (the engine falls back to plain HTTP for a
# loopback registry), answers the `/v2/` ping, then never answers the manifest request. It prints
# "hanging" when that request arrives (and "closed" if its client ever hangs up).
_HANGING_REGISTRY = """
import socket, threading
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
def serve(c):
    if c.recv(1, socket.MSG_PEEK) == b"\\x16":
        c.close(); return
    data = b""
    while True:
        chunk = c.recv(65536)
        if not chunk:
            return
        data += chunk
        while b"\\r\\n\\r\\n" in data:
            head, _, data = data.partition(b"\\r\\n\\r\\n")
            if head.split(b" ")[1] == b"/v2/":
                c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n"
                          b"Docker-Distribution-API-Version: registry/2.0\\r\\n\\r\\n{}")
                continue
            print("hanging", flush=True)
            while c.recv(65536):
                pass
            print("closed", flush=True)
            return
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


async def test_remote_link_dropped_mid_pull_is_reported_and_the_next_call_reconnects(
        node_b: NodeB, busybox_image: str, tmp_path: Path) -> None:
    """A pull stuck inside node-b's engine (a registry in node-b's network that never answers) loses its link."""
    hang = subprocess.Popen(["nsenter", f"--net=/proc/{node_b.dockerd_pid()}/ns/net", sys.executable, "-c",
                             _HANGING_REGISTRY], stdout=subprocess.PIPE, text=True)
    try:
        assert hang.stdout is not None
        port = int(hang.stdout.readline())
        async with running_daemon(node_b.config()) as daemon:
            s = await daemon.open_session(hosts=["node-b"])
            result: list[Any] = []
            async with anyio.create_task_group() as tg:
                async def pull() -> None:
                    result.append(await s.runtime("image-pull", host="node-b", image=f"127.0.0.1:{port}/hangs:1"))

                tg.start_soon(pull)
                line = await anyio.to_thread.run_sync(hang.stdout.readline)
                assert line == "hanging\n"  # node-b's engine is inside the pull
                node_b.drop_links()
            assert not result[0].ok and result[0].error_code == "runtime_failed"
            assert "remote host node-b" in result[0].error
            # What node-b's engine does with the abandoned pull is its own (dockerd 20.10 keeps waiting on the
            # manifest, as it does when a local client hangs up); the link and the next call are ours.
            again = await s.runtime("image-inspect", host="node-b", image=busybox_image)
            assert again.ok, again.error
    finally:
        hang.kill()
        hang.wait()


async def test_policy_is_enforced_for_remote_hosts_too(node_b: NodeB, busybox_image: str) -> None:
    """Regression: #24: the admission profile holds on [[remote]] nodes, checked before the SSH link is used."""
    name = f"coldsnap-remote-pol-{os.getpid()}"
    config = (f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{_NOBODY}, {_NOBODY - 1}]\n" + node_b.config()
              + '[policy.profiles.tenant]\nmount_roots = ["/srv/coldsnap"]\n'
              + f'[[policy.assign]]\nuids = [{_NOBODY}, {_NOBODY - 1}]\nprofile = "tenant"\n')
    async with running_daemon(config) as daemon:
        def session(uid: int) -> Session:
            return session_as(uid, daemon, hosts=("node-b",), prefix="op-rp")

        owner, other = session(_NOBODY), session(_NOBODY - 1)
        try:
            refused = await owner.runtime("workload-run", host="node-b", workload={
                "image": busybox_image, "name": name, "command": ["true"],
                "mounts": [{"source": "/etc", "target": "/e"}]})
            assert refused.error == "workload.mounts[0].source: /etc is outside the allowed roots of profile tenant"
            assert node_b.docker("container", "inspect", name, check=False).returncode != 0
            run = await owner.runtime("workload-run", host="node-b", workload={
                "image": busybox_image, "name": name, "detached": True, "privileged": True,
                "command": ["sleep", "60"]})
            assert run.ok, run.error
            host = json.loads(node_b.docker("container", "inspect", name).stdout)[0]["HostConfig"]
            assert host["Privileged"] is False and "SYS_ADMIN" in {c.removeprefix("CAP_") for c in host["CapAdd"]}
            theirs = await other.runtime("workload-exec", host="node-b", name=name,
                                         execution={"command": ["hostname"]})
            assert theirs.error_code == "not_found"
        finally:
            node_b.docker("rm", "-f", name, check=False)


async def test_policy_refuses_a_restricted_manager_the_remote_ssh_user(node_b: NodeB, busybox_image: str,
                                                                        tmp_path: Path) -> None:
    """Review of #24: exec, upload, copy-from destinations and build contexts on a [[remote]] node run as its
    SSH user, who holds that node's Docker socket: a `capsule` manager's `exec id -u` answered 0 there, around
    every rule of its profile. Refused unless the profile says `remote_ssh_user = true`; nothing reaches the node."""
    name = f"coldsnap-remote-ssh-{os.getpid()}"
    marker = f"/tmp/coldsnap-remote-ssh-{os.getpid()}"
    (tmp_path / "f").write_text("x\n")
    tmp_path.chmod(0o755)
    (tmp_path / "f").chmod(0o644)
    config = (f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{_NOBODY}, {_NOBODY - 1}]\n" + node_b.config()
              + "[policy.profiles.trusted]\nremote_ssh_user = true\n"
              + f'[[policy.assign]]\nuids = [{_NOBODY - 1}]\nprofile = "trusted"\n')
    async with running_daemon(config) as daemon:
        def session(uid: int) -> Session:
            return session_as(uid, daemon, hosts=("node-b",), prefix="op-rs")

        capsule, trusted = session(_NOBODY), session(_NOBODY - 1)
        rule = ("host node-b runs it as that node's SSH user, who controls its container engine (root there); "
                "profile capsule does not admit that (remote_ssh_user)")
        try:
            refused = await _exec(capsule, "node-b", "sh", "-c", f"id -u; touch {marker}")
            assert not refused.ok and not refused.error_code and refused.error == f"exec: {rule}", refused.error
            refused = await capsule.call("upload", host="node-b", sources=[str(tmp_path / "f")], destination=marker)
            assert refused.error == f"upload: {rule}", refused.error
            run = await capsule.runtime("workload-run", host="node-b", workload={
                "image": busybox_image, "name": name, "detached": True, "command": ["sleep", "60"]})
            assert run.ok, run.error  # the engine itself is the profile's to rule
            refused = await capsule.runtime("workload-copy-from", host="node-b", name=name, path="/etc/hostname",
                                            destination=marker)
            assert refused.error == f"workload-copy-from: {rule}", refused.error
            dockerfile = base64.b64encode(f"FROM {busybox_image}\n".encode()).decode()
            refused = await capsule.runtime("image-build", host="node-b", build={
                "dockerfile": dockerfile, "context": "/root", "tag": f"coldsnap-test/rs:{os.getpid()}"})
            assert refused.error == f"image-build: {rule}", refused.error
            assert not node_b.path(marker).exists()
            allowed = await _exec(trusted, "node-b", "id", "-u")
            assert allowed.ok and _output(allowed) == b"0\n", allowed
        finally:
            node_b.docker("rm", "-f", name, check=False)
            node_b.path(marker).unlink(missing_ok=True)


# --- under the shipped systemd unit (docs/systemd.md) ------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="reproduces the unit's account: needs root")
async def test_exec_upload_and_engine_on_node_b_work_under_the_shipped_unit(
        node_b: NodeB, world_readable_dir: Path, busybox_image: str) -> None:
    """The unit once allowed only AF_UNIX sockets: SSH to a remote node failed. The upload's local tar
    runs as exec.user with no capability: a root-only file stays unreadable (the unit's daemon holds
    CAP_DAC_OVERRIDE, which the tar once inherited)."""
    source = world_readable_dir / "payload.txt"
    source.write_text("under the unit\n")
    source.chmod(0o644)
    secret = world_readable_dir / "secret.txt"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    dest = f"/tmp/coldsnap-unit-upload-{os.getpid()}"
    async with running_daemon(node_b.config() + '\n[exec]\nuser = "nobody"\n', unit=True) as daemon:
        s = await daemon.open_session(hosts=["localhost", "node-b"])
        try:
            remote = await _exec(s, "node-b", "hostname")
            assert remote.ok and _output(remote) == b"node-b\n", remote
            uploaded = await s.call("upload", host="node-b", sources=[str(source)], destination=dest)
            assert uploaded.ok, uploaded.error
            assert node_b.path(dest).read_text() == "under the unit\n"
            refused = await s.call("upload", host="node-b", sources=[str(secret)], destination=f"{dest}-secret")
            assert not refused.ok and "Permission denied" in str(refused.error)
            assert not node_b.path(f"{dest}-secret").exists()
            inspected = await s.runtime("image-inspect", host="node-b", image=busybox_image)
            assert inspected.ok, inspected.error
        finally:
            node_b.path(dest).unlink(missing_ok=True)

"""sd_notify READY/STOPPING/WATCHDOG, socket activation, the unit files, and the daemon as the unit runs it."""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import pytest

from coldsnap_provider import Reply
from coldsnap_provider._client import exchange
from tests import unit_sandbox
from tests.helpers import ROOT, Session, running_daemon


def _receive_all(sock: socket.socket, until: bytes, timeout: float = 10.0) -> list[bytes]:
    messages: list[bytes] = []
    deadline = time.monotonic() + timeout
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            messages.append(sock.recv(4096))
        except TimeoutError:
            continue
        if until in messages[-1]:
            break
    return messages


async def test_sd_notify_ready_watchdog_and_stopping() -> None:
    directory = Path(tempfile.mkdtemp(prefix="cs-notify-", dir="/tmp"))
    path = directory / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        async with running_daemon(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"}) as daemon:
            first = _receive_all(sock, b"READY=1")
            assert b"READY=1" in first
            # Sockets are bound before READY: the control socket answers at once.
            assert (await daemon.control(operation="status"))["version"]
            pings = _receive_all(sock, b"never", timeout=0.8)
            assert pings.count(b"WATCHDOG=1") >= 3
            assert daemon.process is not None
            daemon.process.send_signal(signal.SIGTERM)
            assert b"STOPPING=1" in b"".join(_receive_all(sock, b"STOPPING=1"))
            assert await anyio.to_thread.run_sync(daemon.process.wait, 10) == 0
    shutil.rmtree(directory, ignore_errors=True)


async def test_socket_activation_serves_the_passed_control_socket() -> None:
    state = Path(tempfile.mkdtemp(prefix="cs-", dir="/tmp"))
    config = state.parent / f"{state.name}.toml"
    config.write_text("")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(state / "activated.sock"))
    listener.listen()
    fd = listener.fileno()
    process = subprocess.Popen(
        ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@"', "sh", sys.executable, "-m", "coldsnap_provider",
         "serve", "--config", str(config), "--state-dir", str(state)],
        pass_fds=(3,), preexec_fn=lambda: os.dup2(fd, 3),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        listener.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                data = await exchange(state / "activated.sock", b'{"format":1,"id":"a","operation":"status"}\n')
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                await anyio.sleep(0.1)
        assert b'"ok":true' in data and b'"version"' in data
        assert not (state / "control.sock").exists()  # nothing bound besides the passed socket
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0, process.stderr.read() if process.stderr else ""
        shutil.rmtree(state, ignore_errors=True)
        config.unlink(missing_ok=True)


def test_unit_files_verify_clean() -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is installed by scripts/test"
    executable = shutil.which("coldsnap-provider") or str(Path(sys.executable).parent / "coldsnap-provider")
    with tempfile.TemporaryDirectory() as directory:
        for name in ("coldsnap-provider.service", "coldsnap-provider.socket"):
            text = (ROOT / "systemd" / name).read_text().replace("/usr/local/bin/coldsnap-provider", executable)
            Path(directory, name).write_text(text)
        result = subprocess.run(
            [analyze, "verify", "--man=no", f"{directory}/coldsnap-provider.service",
             f"{directory}/coldsnap-provider.socket"], capture_output=True, text=True, check=False)
        problems = [line for line in (result.stdout + result.stderr).splitlines()
                    if "coldsnap-provider" in line]
        assert result.returncode == 0 and not problems, result.stdout + result.stderr
    assert "Type=notify" in (ROOT / "systemd" / "coldsnap-provider.service").read_text()


# --- the daemon as the shipped unit runs it (tests/unit_sandbox.py) ----------------------------------------------

_CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_KILL": 5, "CAP_SETGID": 6,
                "CAP_SETUID": 7, "CAP_SETPCAP": 8}
_STATUS = "grep -E '^(Uid|Gid|Groups|Cap[A-Za-z]+|NoNewPrivs):' /proc/self/status"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="reproduces the unit's account: needs root")


def _status(text: str) -> dict[str, str]:
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def _unit_mask() -> int:
    return sum(1 << _CAP_NUMBERS[name] for name in unit_sandbox.service_settings()["AmbientCapabilities"])


async def _exec(session: Session, *argv: str) -> Reply:
    return await session.call("exec", host="localhost", arguments=list(argv))


def _assert_holds_nothing(status: dict[str, str]) -> None:
    for key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[key], 16) == 0, (key, status)
    assert status["NoNewPrivs"] == "1", status


@needs_root
async def test_exec_as_nobody_under_the_unit_holds_no_capability_and_cannot_read_shadow() -> None:
    async with running_daemon('[exec]\nuser = "nobody"\n', unit=True) as daemon:
        assert daemon.process is not None
        own = _status(Path(f"/proc/{daemon.process.pid}/status").read_text())
        assert own["Uid"].split()[0] == str(unit_sandbox.account().pw_uid)  # the unit's account, not root
        assert int(own["CapAmb"], 16) == int(own["CapEff"], 16) == _unit_mask()  # what the drop must shed
        s = await daemon.open_session()
        status = await _exec(s, "sh", "-c", _STATUS)
        assert status.ok and status.exit_code == 0, status
        fields = _status(status.output.decode())
        assert fields["Uid"].split() == ["65534"] * 4 and fields["Groups"] == ""
        _assert_holds_nothing(fields)
        shadow = await _exec(s, "head", "-c", "1", "/etc/shadow")
        assert shadow.exit_code != 0 and b"Permission denied" in shadow.error_output
        setuid = await _exec(s, "setpriv", "--reuid=0", "--regid=0", "--clear-groups", "true")
        assert setuid.exit_code != 0 and b"Operation not permitted" in setuid.error_output


@needs_root
async def test_exec_as_the_units_own_account_holds_no_capability() -> None:
    async with running_daemon("", unit=True) as daemon:
        s = await daemon.open_session()
        status = await _exec(s, "sh", "-c", _STATUS)
        fields = _status(status.output.decode())
        assert fields["Uid"].split()[0] == str(unit_sandbox.account().pw_uid)
        _assert_holds_nothing(fields)
        shadow = await _exec(s, "head", "-c", "1", "/etc/shadow")
        assert shadow.exit_code != 0 and b"Permission denied" in shadow.error_output


@needs_root
async def test_build_context_under_the_unit_cannot_include_a_root_only_directory(top: Path, busybox_image: str) -> None:
    context = top / "context"
    (context / "private").mkdir(parents=True)
    (context / "private").chmod(0o700)  # root's: exec.user (nobody) cannot list it
    (context / "private" / "secret").write_text("root only\n")
    (context / "public.txt").write_text("public\n")
    tag = f"coldsnap-capsule/unit-{os.getpid()}-{time.monotonic_ns()}:1"
    dockerfile = base64.b64encode(f"FROM {busybox_image}\nCOPY . /ctx\n".encode()).decode()
    async with running_daemon('[exec]\nuser = "nobody"\n', unit=True) as daemon:
        s = await daemon.open_session()
        reply = await s.runtime("image-build", build={"dockerfile": dockerfile, "context": str(context), "tag": tag})
    try:
        assert not reply.ok and reply.error_code == "runtime_failed", reply
        assert f"{context}/private" in str(reply.error) and "Permission denied" in str(reply.error)
        assert subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode != 0
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True)


@needs_root
async def test_exec_upload_and_copy_from_into_a_home_directory_work_under_the_unit(busybox_image: str) -> None:
    home = Path(tempfile.mkdtemp(prefix="cs-unit-home-", dir="/home"))
    os.chown(home, 65534, 65534)
    source = Path(tempfile.mkdtemp(prefix="cs-unit-src-", dir="/tmp"))
    source.chmod(0o755)
    (source / "payload").write_text("uploaded\n")
    (source / "payload").chmod(0o644)
    name = f"cs-unit-copy-{os.getpid()}-{time.monotonic_ns()}"
    try:
        async with running_daemon('[exec]\nuser = "nobody"\n', unit=True) as daemon:
            s = await daemon.open_session()
            touched = await _exec(s, "sh", "-c", f"echo exec > {home}/exec.txt")
            assert touched.exit_code == 0, touched.error_output
            uploaded = await s.call("upload", host="localhost", sources=[str(source / "payload")],
                                    destination=str(home / "uploaded.txt"))
            assert uploaded.ok, uploaded.error
            started = await s.runtime("workload-run", workload={
                "name": name, "image": busybox_image, "detached": True, "pull_policy": "never",
                "command": ["sh", "-c", "echo copied > /tmp/copied.txt && sleep 60"]})
            assert started.ok, started.error
            deadline = time.monotonic() + 20
            while not (ready := await s.runtime("workload-exec", name=name, execution={
                    "command": ["test", "-s", "/tmp/copied.txt"]})).ok:
                assert time.monotonic() < deadline, ready  # the last answer says why
                await anyio.sleep(0.1)
            copied = await s.runtime("workload-copy-from", name=name, path="/tmp/copied.txt",
                                     destination=str(home / "copied.txt"))
            assert copied.ok, copied.error
            await s.runtime("workload-remove", name=name)
        assert (home / "exec.txt").read_text() == "exec\n"
        assert (home / "uploaded.txt").read_text() == "uploaded\n"
        assert (home / "copied.txt").read_text() == "copied\n"
        assert {p.stat().st_uid for p in home.iterdir()} == {65534}
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(source, ignore_errors=True)


@needs_root
def test_a_daemon_holding_capabilities_without_setpcap_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[exec]\nuser = "nobody"\n')
    config.chmod(0o644)
    tmp_path.chmod(0o755)
    caps = "+chown,+dac_override,+fowner,+kill,+setuid,+setgid"  # the unit of 445646e: no CAP_SETPCAP
    account = unit_sandbox.account()
    result = subprocess.run(
        ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups",
         f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", f"--bounding-set=-all,{caps}", "--",
         sys.executable, "-m", "coldsnap_provider", "check-config", str(config)],
        capture_output=True, text=True, check=False)
    assert result.returncode == 2, result
    assert "not CAP_SETPCAP" in result.stderr and "cannot clear the bounding set" in result.stderr


def test_unit_security_exposure_stays_at_most_the_documented_score() -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is installed by scripts/test"
    with tempfile.TemporaryDirectory() as directory:
        unit = Path(directory, "coldsnap-provider.service")
        unit.write_text(unit_sandbox.UNIT.read_text())
        result = subprocess.run([analyze, "security", "--offline=true", "--no-pager", str(unit)],
                                capture_output=True, text=True, check=False)
    match = re.search(r"Overall exposure level for coldsnap-provider\.service: (\d+\.\d)", result.stdout)
    assert match, result.stdout + result.stderr
    documented = re.search(r"exposure level\s+(\d+\.\d)", (ROOT / "docs" / "systemd.md").read_text())
    assert documented and float(match.group(1)) <= float(documented.group(1)), match.group(0)


# What tests/unit_sandbox.py claims to reproduce, checked from inside it (errno per call, or "ok").
_SANDBOX_PROBE = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def call(fn, *args):
    return "ok" if fn(*args) >= 0 else errno.errorcode[ctypes.get_errno()]
def sock(family):
    try:
        socket.socket(family, socket.SOCK_STREAM if family != socket.AF_NETLINK else socket.SOCK_RAW).close()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
def write(path):
    try:
        open(path, "w").close()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]
print({"inet": sock(socket.AF_INET), "netlink": sock(socket.AF_NETLINK),
       "unshare-user": call(libc.unshare, 0x10000000), "ptrace": call(libc.ptrace, 0, 0, 0, 0),
       "modify_ldt": call(libc.syscall, 154, 0, ctypes.create_string_buffer(16), 16),  # @cpu-emulation
       "etc": write("/etc/cs-unit-probe"), "sys": write("/sys/cs-unit-probe"),
       "uid": os.getuid(), "nnp": open("/proc/self/status").read().count("NoNewPrivs:\t1")})
"""


@needs_root
def test_the_unit_sandbox_enforces_what_it_claims_to_reproduce() -> None:
    result = subprocess.run(unit_sandbox.wrap([sys.executable, "-I", "-S", "-c", _SANDBOX_PROBE]),
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str({
        "inet": "ok", "netlink": "EAFNOSUPPORT", "unshare-user": "EPERM", "ptrace": "EPERM", "modify_ldt": "EPERM",
        "etc": "EROFS", "sys": "EROFS", "uid": unit_sandbox.account().pw_uid, "nnp": 1})

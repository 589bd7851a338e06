"""The shipped units under a booted systemd: `systemctl stop` then `start` keeps the control socket and sessions.

A container boots this machine's own systemd as PID 1 (its /usr and Python bound read-only, a copy of its /etc),
the units are installed with `install-units`, and a manager's session is opened, then the service is stopped and
started. Under `RuntimeDirectoryPreserve=restart` (the unit before issue 38) systemd removed /run/coldsnap-provider
on the stop, the .socket unit's control.sock with it: `session list` answered "No such file or directory" and the
restarted daemon served 0 sessions.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import docker
from tests.helpers import ROOT

SYSTEMD = Path("/lib/systemd/systemd")
IMAGE = "coldsnap-test/systemd-boot:1"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not SYSTEMD.exists() or not shutil.which("docker"),
                                reason="boots systemd in a container: needs root, docker and systemd")
# Docker's capability names, without those this machine's bounding set lacks (docker refuses to grant them).
_CAPS = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
         "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
         "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
         "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
         "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ"]
# systemd mounts its own cgroup hierarchy writable inside the container's cgroup namespace, then boots a target
# that pulls in nothing but sysinit (no getty, no sshd, no dockerd from the copied /etc).
_BOOT = ("if [ -d /sys/fs/cgroup/systemd ]; then mount -o remount,rw /sys/fs/cgroup/systemd; "
         "else mount -o remount,rw /sys/fs/cgroup; fi; exec /lib/systemd/systemd --unit=coldsnap-test.target")
_TARGET = b"[Unit]\nDescription=coldsnap-provider test boot\nRequires=sysinit.target\nAfter=sysinit.target\n"


def _capabilities() -> list[str]:
    bounding = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("CapBnd:")), 16)
    return [name for bit, name in enumerate(_CAPS) if bounding >> bit & 1]


def _rootfs() -> bytes:
    """An image tar: /usr-merged links, empty mount points, this machine's /etc with no unit enabled."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("bin", "sbin", "lib", "lib64"):
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, f"usr/{name}"
            tar.addfile(link)
        for name in ("usr", "proc", "sys", "dev", "run", "tmp", "var/lib", "var/log", "var/tmp", "root", "home"):
            directory = tarfile.TarInfo(name)
            directory.type, directory.mode = tarfile.DIRTYPE, 0o1777 if name.endswith("tmp") else 0o755
            tar.addfile(directory)

        def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            wants = ("etc/systemd/system/multi-user.target.wants/", "etc/systemd/system/sockets.target.wants/")
            secret = info.name.startswith("etc/ssh/ssh_host_")  # the image is local and removed, but still
            return None if info.name.startswith(wants) or info.name == "etc/machine-id" or secret else info

        tar.add("/etc", arcname="etc", filter=keep)
        for name, data in (("etc/machine-id", b""), ("etc/systemd/system/coldsnap-test.target", _TARGET)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _binds() -> list[str]:
    """Read-only binds at the same paths: /usr, the interpreter's installation, the venv, the tree under test."""
    paths: list[Path] = []
    wanted = {Path("/usr"), Path(sys.base_prefix).resolve(), Path(sys.prefix), ROOT}
    for path in sorted(wanted, key=lambda p: len(p.parts)):
        if not any(path.is_relative_to(kept) for kept in paths):
            paths.append(path)
    return [option for path in paths for option in ("-v", f"{path}:{path}:ro")]


@contextmanager
def boot_container(name: str, image: str = IMAGE, boot: str = _BOOT, *run_options: str) -> Iterator[str]:
    """A container `name` of `image` (this machine's root, imported) whose PID 1 is systemd started by `boot`,
    running (a skip when this machine cannot boot one); removed, with its image, afterwards. `run_options` go to
    `docker run` before the image (more tmpfs mounts, ...)."""
    docker("import", "-", image, input=_rootfs())
    started = docker("run", "-d", "--name", name, "--cap-drop", "ALL",
                     *(f"--cap-add={c}" for c in _capabilities()), "--security-opt", "seccomp=unconfined",
                     "--cgroupns=private", "--tmpfs", "/run", "--tmpfs", "/run/lock", "--tmpfs", "/tmp",
                     *run_options, "-e", "container=docker", *_binds(), image, "/bin/bash", "-c", boot,
                     check=False)
    try:
        if started.returncode != 0:
            pytest.skip(f"no container with systemd here: {started.stderr.decode().strip()}")
        state = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and state not in ("running", "degraded"):
            time.sleep(0.2)
            state = _in(name, "systemctl is-system-running").stdout.strip()
        if state not in ("running", "degraded"):
            pytest.skip(f"systemd did not boot in the container ({state!r}): "
                        + docker("logs", name, check=False).stderr.decode()[-2000:])
        yield name
    finally:
        docker("rm", "-f", name, check=False)
        docker("rmi", image, check=False)


@pytest.fixture
def booted() -> Iterator[str]:
    """A container whose PID 1 is systemd, running; removed afterwards."""
    with boot_container(f"coldsnap-test-systemd-{os.getpid()}") as name:
        yield name


def _in(container: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "exec", container, "bash", "-c", script], capture_output=True, text=True,
                          check=False)


@pytest.mark.timeout(120)
def test_stop_then_start_keeps_the_control_socket_and_the_sessions(booted: str) -> None:
    program = Path(sys.prefix, "bin", "coldsnap-provider")
    # The daemon runs the tree under test (not whatever the venv was installed from).
    install = f"""set -e
        cd / && {sys.executable} -m coldsnap_provider install-units --prefix /stage --exec {program} >/dev/null
        dropins=/etc/systemd/system/coldsnap-provider.service.d
        mkdir -p /etc/sysusers.d /etc/tmpfiles.d /etc/coldsnap-provider $dropins
        cp /stage/etc/systemd/system/* /etc/systemd/system/
        cp /stage/usr/lib/sysusers.d/coldsnap-provider.conf /etc/sysusers.d/
        cp /stage/usr/lib/tmpfiles.d/coldsnap-provider.conf /etc/tmpfiles.d/
        cp /stage/etc/coldsnap-provider/config.toml /etc/coldsnap-provider/
        printf '[Service]\\nEnvironment=PYTHONPATH={ROOT}\\n' > $dropins/tree.conf
        systemd-sysusers && systemd-tmpfiles --create && systemctl daemon-reload
        systemctl enable --now coldsnap-provider.socket coldsnap-provider.service"""
    installed = _in(booted, f"export PYTHONPATH={ROOT}\n{install}")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    csp = f"cd / && PYTHONPATH={ROOT} {sys.executable} -m coldsnap_provider"
    opened = _in(booted, f"{csp} session open --session kept --host localhost")
    assert opened.returncode == 0, opened.stderr + _in(booted, "journalctl -u coldsnap-provider -o cat").stdout

    for _ in range(2):
        stopped = _in(booted, "systemctl stop coldsnap-provider.service; systemctl is-active coldsnap-provider.service")
        assert stopped.stdout.strip() == "inactive", stopped
        began = time.monotonic()
        started = _in(booted, f"systemctl start coldsnap-provider.service && {csp} session list -o json")
        took = time.monotonic() - began
        assert started.returncode == 0, started.stderr + _in(booted, "ls -la /run/coldsnap-provider").stdout
        assert [s["session"] for s in json.loads(started.stdout)] == ["kept"]
        # The goal is 2 s (measured: about 1 s on 2 cores); the bound leaves room for a loaded CI machine.
        assert took < 5.0, f"start and a control request took {took:.2f} s"
        socket = _in(booted, "test -S /run/coldsnap-provider/sessions/kept/provider.sock && "
                             "stat -c '%a %U' /run/coldsnap-provider/control.sock")
        assert socket.stdout.split() == ["660", "coldsnap-provider"], socket

    # The upgrade of docs/upgrade.md: the units installed again, daemon-reload, a restart of the service only.
    # (/usr is the host's, read-only: the staged files go to /etc, where systemd reads them first.)
    upgraded = _in(booted, f"""set -e
        cd / && PYTHONPATH={ROOT} {sys.executable} -m coldsnap_provider install-units --prefix /stage --exec {program}
        cp /stage/etc/systemd/system/* /etc/systemd/system/
        systemctl daemon-reload && systemctl restart coldsnap-provider.service && {csp} session list -o json""")
    assert upgraded.returncode == 0, upgraded.stderr
    assert [s["session"] for s in json.loads(upgraded.stdout.splitlines()[-1])] == ["kept"]

"""The .deb (debian/, `scripts/package deb`): lintian-clean, and installed, upgraded and removed under a booted systemd.

The package is built once per source hash (scripts/package caches it under /var/cache/coldsnap-deb) at Debian
revision 1; revision 2, the upgrade, is that package with a new Version, repacked with dpkg-deb. The container is
test_systemd_boot.py's (this machine's systemd as PID 1, its /usr), with an overlay on /usr so that dpkg can write
there, and a copy of this machine's dpkg database so that the package's dependencies are met as they are here. The
manager's side talks to the control socket with Debian's python3 and the standard library only, as any manager
would.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldsnap_provider import __version__
from tests.builds import Builds
from tests.conftest import docker
from tests.provider.test_systemd_boot import SYSTEMD, _in, boot_container

IMAGE = "coldsnap-test/systemd-deb:1"
BACKGROUND_BUILDS = ("deb",)  # tests/builds.py: started as the session begins
LINTIAN_CACHE = Path("/var/cache/coldsnap-deb/lintian")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not SYSTEMD.exists() or not shutil.which("docker"),
                                reason="builds a .deb and boots systemd in a container: needs root, docker and systemd")
# An overlay makes the bound /usr writable (the writes land in a tmpfs), then the same boot as test_systemd_boot.py.
_BOOT = ("mkdir -p /overlay/upper /overlay/work && mount -t overlay overlay "
         "-o lowerdir=/usr,upperdir=/overlay/upper,workdir=/overlay/work /usr && "
         "if [ -d /sys/fs/cgroup/systemd ]; then mount -o remount,rw /sys/fs/cgroup/systemd; "
         "else mount -o remount,rw /sys/fs/cgroup; fi; exec /lib/systemd/systemd --unit=coldsnap-test.target")
# A manager's control request with the standard library: one JSON line, half-close, one JSON reply.
_CONTROL = """import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect("/run/coldsnap-provider/control.sock")
s.sendall(json.dumps({"format": 1, "id": "deb-test", **json.loads(sys.argv[1])}).encode() + b"\\n")
s.shutdown(socket.SHUT_WR); print(b"".join(iter(lambda: s.recv(65536), b"")).decode())
"""


def _built(done: subprocess.CompletedProcess[str]) -> Path:
    """The package the background "deb" build made (`scripts/package deb --revision 1`, tests/builds.py)."""
    assert done.returncode == 0, done.stderr[-4000:]
    deb = Path(done.stdout.splitlines()[-1])
    assert deb.name == f"coldsnap-provider_{__version__}-1_amd64.deb", deb
    return deb


def _at_revision(deb: Path, revision: int) -> Path:
    """`deb` at Debian revision `revision`, made with Debian's own tools (dpkg-deb -R, Version in DEBIAN/control,
    dpkg-deb -b): the same files, conffiles and maintainer scripts, so dpkg installs it as an upgrade of `deb` as it
    would a rebuild, without a second build (about 30 s of a core)."""
    tree = deb.parent / f"tree-{revision}"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True, timeout=120)
    control = tree / "DEBIAN" / "control"
    text = control.read_text()
    versioned = re.sub(r"^Version: (\S+)-\d+$", rf"Version: \g<1>-{revision}", text, count=1, flags=re.MULTILINE)
    assert versioned != text, text
    control.write_text(versioned)
    upgrade = deb.with_name(f"coldsnap-provider_{__version__}-{revision}_amd64.deb")
    # Uncompressed (70 MB, 2 s): gzip took 7 s of a core for the 70 MB tree, and dpkg installs either.
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Znone", "-b", str(tree), str(upgrade)], check=True,
                   capture_output=True, timeout=120)
    shutil.rmtree(tree)
    return upgrade


@dataclass(frozen=True)
class Debs:
    first: Path  # revision 1
    second: Path  # revision 2, the upgrade
    lintian: Future[str]  # lintian's report on the first


@pytest.fixture(scope="module")
def debs(background_builds: Builds) -> Iterator[Debs]:
    """The package at Debian revision 1, built in the background since the session began (about 25 s of one core
    when the source changed, as it has in every CI run), and at revision 2 (the upgrade) repacked from it;
    lintian's report on the first is read in the background (about 25 s of one core) while the install test
    runs."""
    first = _built(background_builds.result("deb"))
    with ThreadPoolExecutor(max_workers=1) as pool:
        lintian = pool.submit(_lintian, first)
        yield Debs(first, _at_revision(first, 2), lintian)


def _lintian(deb: Path) -> str:
    """lintian's report on `deb`, cached per package digest (it takes about 25 s)."""
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()[:24]
    cached = LINTIAN_CACHE / f"{digest}.txt"
    if not cached.exists():
        if not shutil.which("lintian"):
            return "E: lintian is not installed (scripts/package deb installs it)"
        report = subprocess.run(["lintian", "--tag-display-limit", "0", str(deb)], capture_output=True, text=True,
                                check=False, timeout=300)
        LINTIAN_CACHE.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(report.stdout + report.stderr)
        partial.replace(cached)
    return cached.read_text()


@pytest.fixture
def booted() -> Iterator[str]:
    """test_systemd_boot.py's container, with a writable /usr overlay and this machine's dpkg database."""
    with boot_container(f"coldsnap-test-deb-{os.getpid()}", IMAGE, _BOOT, "--tmpfs", "/overlay") as name:
        docker("cp", "/var/lib/dpkg", f"{name}:/var/lib/")
        # This machine is itself an image whose /usr/sbin/policy-rc.d forbids starting services (exit 101); a real
        # machine has none, and with it postinst would start nothing. Removed in the overlay only.
        assert _in(name, "rm -f /usr/sbin/policy-rc.d").returncode == 0
        yield name


def _control(container: str, request: dict[str, object]) -> dict[str, object]:
    answer = _in(container, f"/usr/bin/python3 -I -c '{_CONTROL}' '{json.dumps(request)}'")
    assert answer.returncode == 0, answer.stderr
    reply: dict[str, object] = json.loads(answer.stdout)
    return reply


def _state(container: str) -> dict[str, str]:
    """Each unit's ActiveState, the service's main pid, and the control socket's inode."""
    show = _in(container, "systemctl show -p ActiveState --value coldsnap-provider.socket; "
                          "systemctl show -p ActiveState --value coldsnap-provider.service; "
                          "systemctl show -p MainPID --value coldsnap-provider.service; "
                          "stat -c %i /run/coldsnap-provider/control.sock")
    return dict(zip(("socket", "service", "pid", "inode"), show.stdout.split(), strict=False))


def _journal(container: str) -> str:
    return _in(container, "journalctl -u coldsnap-provider -o cat --no-pager | tail -30").stdout


@pytest.mark.timeout(600)  # the first test: it may wait for the package's build (tests/builds.py)
def test_install_upgrade_and_remove_under_systemd(debs: Debs, booted: str) -> None:
    first, second = debs.first, debs.second
    for deb in (first, second):
        docker("cp", str(deb), f"{booted}:/root/{deb.name}")

    installed = _in(booted, f"dpkg -i /root/{first.name}")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # postinst: the account (sysusers), /run/coldsnap-provider (tmpfiles), both units enabled and started.
    assert _in(booted, "id -nG coldsnap-provider").stdout.split() == ["coldsnap-provider", "docker"]
    enabled = _in(booted, "systemctl is-enabled coldsnap-provider.socket coldsnap-provider.service")
    assert enabled.stdout.split() == ["enabled", "enabled"], enabled
    version = _in(booted, "coldsnap-provider --version")
    assert version.stdout == f"coldsnap-provider {__version__}\n", version.stdout + version.stderr
    opened = _control(booted, {"operation": "session-open", "session": "kept", "hosts": ["localhost"]})
    assert opened.get("ok") is True, (opened, _journal(booted))
    before = _state(booted)
    assert before["socket"] == before["service"] == "active", before

    upgraded = _in(booted, f"dpkg -i /root/{second.name}")
    assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
    assert _in(booted, "dpkg-query -W -f '${Version}' coldsnap-provider").stdout == f"{__version__}-2"
    after = _state(booted)
    # The service was restarted (a new main pid), the socket unit was not (the same listening socket file).
    assert after["socket"] == after["service"] == "active", (after, _journal(booted))
    assert after["pid"] != before["pid"] and after["inode"] == before["inode"], (before, after)
    listed = _control(booted, {"operation": "session-list"})
    assert listed.get("ok") is True, listed
    assert [s["session"] for s in listed["result"]] == ["kept"], listed  # type: ignore[index]
    assert _in(booted, "test -S /run/coldsnap-provider/sessions/kept/provider.sock").returncode == 0

    removed = _in(booted, "dpkg -r coldsnap-provider")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    units = _in(booted, "systemctl is-active coldsnap-provider.socket coldsnap-provider.service")
    assert units.stdout.split() == ["inactive", "inactive"], units
    assert _in(booted, "pgrep -f coldsnap-provider").stdout == ""
    assert _in(booted, "test -e /usr/bin/coldsnap-provider || test -e /lib/systemd/system/coldsnap-provider.service"
               ).returncode == 1
    # The configuration stays until a purge (a conffile), then goes.
    assert _in(booted, "test -f /etc/coldsnap-provider/config.toml").returncode == 0
    purged = _in(booted, "dpkg -P coldsnap-provider && test ! -e /etc/coldsnap-provider/config.toml")
    assert purged.returncode == 0, purged.stdout + purged.stderr


@pytest.mark.timeout(600)  # after the install test, during which lintian read the package
def test_the_package_has_no_lintian_errors(debs: Debs) -> None:
    report = debs.lintian.result(timeout=300)
    errors = [line for line in report.splitlines() if line.startswith("E:")]
    assert not errors, report

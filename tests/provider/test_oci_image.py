"""The daemon's OCI image (packaging/oci/, `scripts/package image`): built, pushed to and pulled from the real registry,
run against the mounted Engine socket, and a manager's session opened through its bind-mounted control socket.

The image is built offline (a debootstrap root cached in /var/cache/coldsnap-oci-base, the .deb cached per source
hash), in the background as the session begins (tests/builds.py). Everything the test makes (tags, the pulled
image, the container, the runtime directory) is removed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import anyio
import pytest

from coldsnap_provider import __version__
from tests.builds import Builds
from tests.conftest import BUSYBOX_IMAGE, Registry, docker
from tests.helpers import Session

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("docker"),
                                reason="builds the image from the .deb: needs root and docker")
BACKGROUND_BUILDS = ("image",)  # tests/builds.py: started as the session begins


def _control(runtime_dir: Path, request: dict[str, object]) -> dict[str, object]:
    """One control exchange as a manager makes it: a JSON line, half-close, one JSON reply."""
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(20)
        sock.connect(str(runtime_dir / "control.sock"))
        sock.sendall(json.dumps({"format": 1, "id": "oci-test", **request}).encode() + b"\n")
        sock.shutdown(socket.SHUT_WR)
        reply: dict[str, object] = json.loads(b"".join(iter(lambda: sock.recv(65536), b"")))
    return reply


@pytest.mark.timeout(900)  # the first run on a machine makes the debootstrap root (about 2 minutes)
async def test_the_image_goes_through_the_registry_and_serves_a_session(registry: Registry,
                                                                        background_builds: Builds) -> None:
    built = background_builds.result("image")  # `scripts/package image --tag ...`, since the session began
    assert built.returncode == 0, built.stderr[-4000:]
    local = built.stdout.splitlines()[-1]
    remote = f"{registry.address}/coldsnap-test/provider:{__version__}-{secrets.token_hex(4)}"
    config = Path(tempfile.mkdtemp(prefix="cs-dockercfg-"))
    runtime_dir = Path(tempfile.mkdtemp(prefix="cs-oci-", dir="/tmp"))  # short: session socket paths live here
    name = f"coldsnap-test-oci-{os.getpid()}"
    try:
        login = docker("--config", str(config), "login", "-u", registry.username, "--password-stdin",
                       registry.address, input=registry.password.encode(), check=False)
        assert login.returncode == 0, login.stderr
        docker("tag", local, remote)
        pushed = docker("--config", str(config), "push", remote, check=False)
        assert pushed.returncode == 0, pushed.stderr
        docker("rmi", local, remote)
        assert docker("image", "inspect", remote, check=False).returncode != 0
        pulled = docker("--config", str(config), "pull", remote, check=False)
        assert pulled.returncode == 0, pulled.stderr
        labels = json.loads(docker("image", "inspect", "-f", "{{json .Config.Labels}}", remote).stdout)
        assert labels["org.opencontainers.image.version"] == __version__

        started = docker("run", "-d", "--name", name, "-v", "/var/run/docker.sock:/var/run/docker.sock",
                         "-v", f"{runtime_dir}:/run/coldsnap-provider", remote, check=False)
        assert started.returncode == 0, started.stderr
        deadline = time.monotonic() + 30
        while not (runtime_dir / "control.sock").exists():
            logs = docker("logs", name, check=False)
            assert time.monotonic() < deadline, (logs.stdout + logs.stderr).decode()[-3000:]
            await anyio.sleep(0.2)
        version = docker("exec", name, "coldsnap-provider", "--version")
        assert version.stdout.decode() == f"coldsnap-provider {__version__}\n"

        opened = _control(runtime_dir, {"operation": "session-open", "session": "oci", "hosts": ["localhost"]})
        assert opened.get("ok") is True, (opened, docker("logs", name, check=False).stderr.decode()[-3000:])
        result = opened["result"]
        assert isinstance(result, dict)
        # The session socket the container reports, reached through the bind mount.
        inside = Path(result["socket"])
        session = Session(socket=str(runtime_dir / inside.relative_to("/run/coldsnap-provider")),
                          token=result["token"], session=result["session"])
        # The host's Engine answers through the mounted socket: the image this test suite loaded is there.
        inspected = await session.runtime("image-inspect", image=BUSYBOX_IMAGE)
        assert inspected.ok, inspected.error
        listed = _control(runtime_dir, {"operation": "session-list"})
        assert [s["session"] for s in listed["result"]] == ["oci"], listed  # type: ignore[union-attr]
    finally:
        docker("rm", "-f", name, check=False)
        docker("rmi", remote, local, check=False)
        shutil.rmtree(config, ignore_errors=True)
        shutil.rmtree(runtime_dir, ignore_errors=True)
    assert docker("image", "inspect", remote, check=False).returncode != 0

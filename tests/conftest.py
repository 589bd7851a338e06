"""Shared fixtures: a real dockerd (started by scripts/test), a local busybox image, a real registry."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import pytest
from hypothesis import HealthCheck, settings

from tests.builds import Builds, wanted
from tests.helpers import MADE, ROOT, refuse_engine, remove_short_dirs
from tests.kubernetes import Cluster, bring_up

if TYPE_CHECKING:
    from coldsnap_runtime.backend import CaptureRegistry, KnownBlobs
    from coldsnap_runtime.store import CaptureStore

# A 2-core CI box under a live dockerd is slow to generate data; correctness, not speed, is under test.
settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")

# `scripts/device gpu-tests` runs every GPU test of the repository once, chosen by what the tests themselves say
# they need (a skip mark whose reason says it needs, or skips for want of, an NVIDIA driver) rather than by a list
# kept by hand beside them; the reasons of the no-driver tests ("this host has an NVIDIA driver", "asserts the
# no-driver path") do not match.
GPU_REASON = re.compile(r"^(needs an|no) NVIDIA driver\b")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-only", action="store_true",
                     help="run only the tests marked as needing an NVIDIA driver (scripts/device gpu-tests)")


def needs_gpu(item: pytest.Item) -> bool:
    """Whether a skip mark of the test names the NVIDIA driver as what it needs."""
    return any(GPU_REASON.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--gpu-only"):
        return
    kept = [item for item in items if needs_gpu(item)]
    config.hook.pytest_deselected(items=[item for item in items if not needs_gpu(item)])
    items[:] = kept


BUSYBOX_IMAGE = "coldsnap-test/busybox:1"
MANAGED_LABEL = "io.coldsnap-provider.managed"


def docker(*args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """The Docker CLI, used only by test set-up and assertions, never by the code under test. A container it
    creates carries this process's label and is recorded by name and id (tests.helpers.Made)."""
    refuse_engine("the Docker CLI")
    verb = 1 if args[:1] == ("container",) else 0
    creates = args[verb:verb + 1] in (("run",), ("create",))
    if creates:
        args = (*args[:verb + 1], "--label", f"{MADE.LABEL}={MADE.token}", *args[verb + 1:])
        for index, arg in enumerate(args):
            if arg == "--name" and index + 1 < len(args):
                MADE.add(args[index + 1])
            elif arg.startswith("--name="):
                MADE.add(arg.removeprefix("--name="))
    done = subprocess.run(["docker", *args], input=input, capture_output=True, check=check)
    if creates and done.returncode == 0 and re.fullmatch(
            rb"[0-9a-f]{64}", last := done.stdout.strip().rsplit(b"\n", 1)[-1]):
        MADE.add(last.decode())  # `create` and `run -d` print the container's id
    return done


@pytest.fixture
def top() -> Iterator[Path]:
    """A root-owned 0755 directory in /tmp that `nobody` can reach into (pytest's own tree is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="cs-top-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def scratch_in_pytest_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Scratch files made with `tempfile` land in pytest's temp tree, not loose in /tmp.

    (State directories keep an explicit dir="/tmp": socket paths must stay short; those made with
    tests.helpers.short_dir are removed here, when the session ends.)
    """
    previous = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("scratch"))
    yield
    tempfile.tempdir = previous
    remove_short_dirs()


@pytest.fixture(scope="session", autouse=True)
def background_builds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds]:
    """The slow builds that the collected modules name in BACKGROUND_BUILDS (tests/builds.py), started as the
    session begins; a test takes its build's outcome with `background_builds.result(name)`."""
    builds = Builds(tmp_path_factory.mktemp("builds"))
    builds.start(wanted(request.session.items))
    yield builds
    builds.close()


@pytest.fixture(scope="session")
def busybox_image() -> str:
    """A tiny local-only image made from Debian's busybox-static (nothing is pulled)."""
    refuse_engine("the busybox image")
    if docker("image", "inspect", BUSYBOX_IMAGE, check=False).returncode == 0:
        return BUSYBOX_IMAGE
    busybox = shutil.which("busybox") or "/bin/busybox"
    with tempfile.TemporaryDirectory() as root:
        rootfs = Path(root)
        for d in ("bin", "etc", "tmp", "root", "data"):
            (rootfs / d).mkdir()
        os.chmod(rootfs / "tmp", 0o1777)
        shutil.copy2(busybox, rootfs / "bin" / "busybox")
        applets = subprocess.run([busybox, "--list"], capture_output=True, check=True, text=True).stdout.split()
        for applet in applets:
            if applet != "busybox":
                (rootfs / "bin" / applet).symlink_to("busybox")
        (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        (rootfs / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
        (rootfs / "data" / "hello.txt").write_text("hello from the image\n")
        tar = subprocess.run(["tar", "-C", root, "-c", "."], capture_output=True, check=True).stdout
        docker("import", "--change", "ENV PATH=/bin", "--change", 'CMD ["sh"]', "-", BUSYBOX_IMAGE, input=tar)
    return BUSYBOX_IMAGE


@dataclass(frozen=True)
class WorkerCapsule:
    context: Path  # the image build's context: its Dockerfile and rootfs/
    stdout: str  # what scripts/_capsule_rootfs.py printed (the capsule's interpreter among it)


@pytest.fixture(scope="session")
def worker_capsule(tmp_path_factory: pytest.TempPathFactory) -> WorkerCapsule:
    """scripts/_capsule_rootfs.py --worker, built once for the tests that read or build it (never write into it):
    CRIU stood in by a dynamically linked program. Its bytecode pass over the interpreter's library costs seconds."""
    base = tmp_path_factory.mktemp("worker-capsule")
    criu = base / "criu-root/usr/sbin/criu"
    criu.parent.mkdir(parents=True)
    shutil.copy2("/bin/true", criu)
    context = base / "ctx"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/_capsule_rootfs.py"), str(context), "--busybox",
                           shutil.which("busybox") or "/bin/busybox", "--criu-root", str(base / "criu-root"),
                           "--worker", str(ROOT / "coldsnap_probe")], capture_output=True, text=True, check=False,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return WorkerCapsule(context=context, stdout=done.stdout)


@dataclass(frozen=True)
class Registry:
    address: str
    username: str
    password: str
    credentials_file: Path
    log: Path  # its log: every request's access line ("HEAD /v2/<repository>/blobs/<digest> HTTP/1.1" ...)

    def client(self, store: CaptureStore, repository: str, action: str, *, address: str | None = None,
               known: KnownBlobs | None = None, slots: int = 8) -> CaptureRegistry:
        """The daemon's registry client for the captures of `store` in `repository`, with this registry's
        credentials (`address`: another way to reach it, a relay in front of it), `slots` threads each way."""
        from coldsnap_runtime.backend import CaptureRegistry

        return CaptureRegistry(store, registry=address or self.address, repository=repository, insecure=True,
                               auth={"username": self.username, "password": self.password}, action=action,
                               fetches=anyio.CapacityLimiter(slots), share=anyio.CapacityLimiter(slots),
                               uploads=anyio.CapacityLimiter(slots), known=known)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """Debian's docker-registry on 127.0.0.1 with htpasswd (bcrypt) credentials."""
    refuse_engine("the registry")
    base = tmp_path_factory.mktemp("registry")
    user, password = "coldsnap", "s3cret-pass"
    subprocess.run(["htpasswd", "-Bbc", str(base / "htpasswd"), user, password], check=True, capture_output=True)
    port = _free_port()
    (base / "config.yml").write_text(f"""version: 0.1
storage:
  filesystem:
    rootdirectory: {base / 'data'}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
auth:
  htpasswd:
    realm: coldsnap-test
    path: {base / 'htpasswd'}
""")
    log = open(base / "registry.log", "wb")
    process = subprocess.Popen(["docker-registry", "serve", str(base / "config.yml")], stdout=log, stderr=log)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError((base / "registry.log").read_text()) from None
            time.sleep(0.1)
    address = f"127.0.0.1:{port}"
    import base64
    import json

    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    credentials = base / "docker-config.json"
    credentials.write_text(json.dumps({"auths": {address: {"auth": auth}}}))
    credentials.chmod(0o600)
    try:
        yield Registry(address=address, username=user, password=password, credentials_file=credentials,
                       log=base / "registry.log")
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def managed_containers() -> list[str]:
    out = docker("ps", "-aq", "--filter", f"label={MANAGED_LABEL}=true").stdout.decode().split()
    return out


def all_containers() -> set[str]:
    return set(docker("ps", "-aq", "--no-trunc").stdout.decode().split())


def leftovers(before: set[str]) -> dict[str, str]:
    """The containers (id: name) that appeared since `before` and that this process's tests made
    (tests.helpers.Made): what other clients of the engine made meanwhile is not counted."""
    new = sorted(all_containers() - before)
    if not new:
        return {}
    # A container removed since the listing is simply gone: inspect reports the others.
    infos = json.loads(docker("inspect", *new, check=False).stdout or b"[]")
    return {info["Id"]: info["Name"].lstrip("/") for info in infos if MADE.owns(info)}


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Fail the test if it leaves behind a container it made (removing those, and only those)."""
    before = all_containers()
    yield
    left = leftovers(before)
    for cid in left:
        docker("rm", "-f", cid, check=False)
    assert not left, f"containers left behind: {sorted(left.values())}"


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    """The real single-node Kubernetes cluster (tests/kubernetes.py), up once per session; skipped unless root."""
    refuse_engine("the Kubernetes cluster")
    return bring_up()

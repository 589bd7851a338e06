"""Capsules that carry a capture, through the node's capture store (DESIGN decision 16, issue 34): image-build puts
the capture's large files in the store, image-push moves its chunks beside the image, image-pull on another node
(here: another daemon with its own store, on the same engine) fetches them, workload-run shows the same bytes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from coldsnap_provider.client import ReplyError
from coldsnap_runtime.chunking import MIN_BYTES
from coldsnap_runtime.store import CHUNK_BYTES, CaptureStore
from tests.conftest import Registry, docker
from tests.helpers import EXEC_AS_NOBODY, Daemon, Session, control_as, module_daemon, session_as
from tests.provider.test_metrics import sample, scrape
from tests.runtime.conftest import uniq
from tests.runtime.test_images import build_request

pytestmark = pytest.mark.usefixtures("no_leftovers")


OTHER_UID = 4242  # a manager that is not root (server.control_uids)
THIRD_UID = 4243  # and another


def _metrics_socket(store: Path) -> Path:
    return Path("/tmp") / f"csm-{store.name[-8:]}.sock"


def _store_daemon(registry: Registry, tag: str) -> Iterator[tuple[Daemon, Path]]:
    store = Path(tempfile.mkdtemp(prefix=f"cs-store-{tag}-", dir="/var/tmp"))
    try:
        for daemon in module_daemon(registry.credentials_file,
                                    f'[server]\ncontrol_uids = [{OTHER_UID}, {THIRD_UID}]\n{EXEC_AS_NOBODY}'
                                    f'[docker]\ncapture_store = "{store}"\n'
                                    f'[metrics]\naddress = "unix:{_metrics_socket(store)}"\n'):
            yield daemon, store
    finally:
        shutil.rmtree(store, ignore_errors=True)


@pytest.fixture(scope="module")
def node_a(registry: Registry, busybox_image: str) -> Iterator[tuple[Daemon, Path]]:
    yield from _store_daemon(registry, "a")


@pytest.fixture(scope="module")
def node_b(registry: Registry, busybox_image: str) -> Iterator[tuple[Daemon, Path]]:
    yield from _store_daemon(registry, "b")


def _session(daemon: Daemon) -> Session:
    return anyio.run(lambda: daemon.open_session(hosts=["localhost"]))


PAGES_RANDOM = 8 << 20  # the page file's random bytes before its zeros: a few dozen chunks cut by content


def _random(size: int) -> bytes:
    """Random bytes that neither start nor end with a zero (a run of zeros beside them is cut to the byte)."""
    data = bytearray(os.urandom(size))
    data[0] = data[-1] = 0xA5
    return bytes(data)


@pytest.fixture(scope="module")
def capture_context() -> Iterator[tuple[Path, dict[str, str]]]:
    """A unit's build context with an images directory: a page file (random bytes, then zeros past a 64 MiB chunk, a
    random tail; CRIU's page image: cut by content), a device dump of zeros only, and small files that stay in the
    image. The files' SHA-256."""
    root = Path(tempfile.mkdtemp(prefix="cs-capctx-", dir="/var/tmp"))
    root.chmod(0o755)  # the build reads it as exec.user
    images = root / "images"
    (images / "dump").mkdir(parents=True)
    (images / "capture.json").write_text('{"ok": true}\n')
    (images / "small.img").write_bytes(os.urandom(4096))
    with open(images / "pages-1.img", "wb") as out:
        out.write(_random(PAGES_RANDOM))
        out.seek(2 * CHUNK_BYTES)
        out.write(_random(3 << 20))
    with open(images / "dump" / "seg-0.bin", "wb") as out:
        out.truncate(CHUNK_BYTES + (1 << 20))
    sums = {str(p.relative_to(images)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in images.rglob("*") if p.is_file()}
    yield root, sums
    shutil.rmtree(root, ignore_errors=True)


# The store's listing (the daemon's MADE_FILES_TARGET) and the identities of two capture files as the workload sees
# them: device, inode, size.
_SEEN_MADE = " && echo --- && cat /run/coldsnap-capture-store/files.json && echo --- && " \
    "stat -c '%d %i %s' pages-1.img dump/seg-0.bin"


def _checksums_command(then: str = "") -> list[str]:
    return ["sh", "-c", "cd /capsule/images && sha256sum capture.json small.img pages-1.img dump/seg-0.bin" + then]


def _sums(output: bytes) -> dict[str, str]:
    return {name: digest for digest, name in (line.split() for line in output.decode().splitlines())}


def _store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "blobs").rglob("*") if p.is_file())


def test_capsule_through_the_store_build_push_pull_run_on_another_node(
        node_a: tuple[Daemon, Path], node_b: tuple[Daemon, Path], registry: Registry, busybox_image: str,
        capture_context: tuple[Path, dict[str, str]]) -> None:
    root, sums = capture_context
    (daemon_a, store_a), (daemon_b, store_b) = node_a, node_b
    session_a, session_b = _session(daemon_a), _session(daemon_b)
    tag = f"{registry.address}/capsules/{uniq('cap')}:1"
    dockerfile = f"FROM {busybox_image}\nWORKDIR /capsule\nCOPY images images/\n"

    async def run() -> None:
        built = await session_a.runtime("image-build", build=build_request(dockerfile, str(root), tag))
        assert built.ok, built.error
        labels = json.loads(docker("image", "inspect", tag).stdout)[0]["Config"]["Labels"]
        capture = labels["io.coldsnap-provider.capture"]
        # Stored: the random bytes and the tail; none of the zeros, not the small files.
        assert _store_bytes(store_a) < PAGES_RANDOM + (4 << 20) + 8192
        image_size = json.loads(docker("image", "inspect", tag).stdout)[0]["Size"]
        assert image_size < 8 << 20  # the capture's bytes are not in the layers
        here = await session_a.runtime("workload-run", workload={
            "name": "", "image": tag, "remove_after_exit": True, "command": _checksums_command()})
        assert here.ok, here.error
        assert _sums(here.runtime.output) == sums  # type: ignore[union-attr]
        pushed = await session_a.runtime("image-push", image=tag)
        assert pushed.ok, pushed.error
        assert (await session_a.runtime("image-remove", image=tag)).ok
        pulled = await session_b.runtime("image-pull", image=tag)
        assert pulled.ok, pulled.error
        assert (store_b / "captures" / f"{capture.split(':')[1]}.json").exists()
        # The pull made the capture's files: the first run after it mounts them at once (tier "tree").
        assert (store_b / "trees" / capture.split(":")[1] / "images" / "pages-1.img").is_file()
        there = await session_b.runtime("workload-run", workload={
            "name": "", "image": tag, "remove_after_exit": True, "command": _checksums_command(_SEEN_MADE)})
        assert there.ok, there.error
        checksums, listing, seen = there.runtime.output.decode().split("---\n")  # type: ignore[union-attr]
        assert _sums(checksums.encode()) == sums
        # The store's listing of the files it made, as the workload sees them: what lets a restore's worker stage
        # the pulled device dump like the release's own (coldsnap_probe's store_made / verification).
        made = json.loads(listing)
        assert made["kind"] == "coldsnap-capture-store-files" and made["capture"] == capture
        assert {tuple(line.split()) for line in seen.splitlines()} <= {
            (str(dev), str(ino), str(size)) for dev, ino, size, _mtime, _ctime in made["files"]}
        # Zero chunks come back as holes: the tree's page file holds only its non-zero chunks.
        tree = store_b / "trees" / capture.split(":")[1] / "images"
        assert (tree / "dump" / "seg-0.bin").stat().st_blocks == 0
        assert (tree / "pages-1.img").stat().st_blocks * 512 < PAGES_RANDOM + (8 << 20)
        metrics = scrape(_metrics_socket(store_b))
        assert sample(metrics, "coldsnap_provider_capture_store_hits_total", tier="registry") == 1
        # The random bytes and the tail, and of the zeros only what finishes the chunk before them (a run of zeros
        # ends a data chunk once that is MIN_BYTES long): never the run itself.
        moved = sample(metrics, "coldsnap_provider_capture_store_read_bytes_total", tier="registry")
        assert PAGES_RANDOM + (3 << 20) <= moved < PAGES_RANDOM + (3 << 20) + MIN_BYTES
        # The pull wrote each chunk once, into the files (nothing copied from the node's disk); no blob of them.
        assert not sample(metrics, "coldsnap_provider_capture_store_hits_total", tier="disk")
        assert len(list((store_b / "blobs" / "sha256").iterdir())) == 1  # the data document
        assert sample(metrics, "coldsnap_provider_capture_store_hits_total", tier="tree") == 1  # the run
        assert (await session_b.runtime("image-remove", image=tag)).ok

    try:
        anyio.run(run)
    finally:
        docker("image", "rm", "-f", tag, check=False)


@pytest.fixture(scope="module")
def capsule(node_a: tuple[Daemon, Path], registry: Registry, busybox_image: str,
            capture_context: tuple[Path, dict[str, str]]) -> Iterator[tuple[str, str]]:
    """A capsule built and pushed by node A (its image stays on the engine both daemons share): (tag, capture)."""
    root, _ = capture_context
    session = _session(node_a[0])
    tag = f"{registry.address}/capsules/{uniq('capf')}:1"
    dockerfile = f"FROM {busybox_image}\nCOPY images /capsule/images\n"

    async def build() -> None:
        assert (built := await session.runtime("image-build", build=build_request(dockerfile, str(root), tag))).ok, \
            built.error
        assert (pushed := await session.runtime("image-push", image=tag)).ok, pushed.error

    anyio.run(build)
    labels = json.loads(docker("image", "inspect", tag).stdout)[0]["Config"]["Labels"]
    yield tag, labels["io.coldsnap-provider.capture"]
    docker("image", "rm", "-f", tag, check=False)


def _pull(daemon: Daemon, tag: str) -> None:
    session = _session(daemon)
    reply = anyio.run(lambda: session.runtime("image-pull", image=tag))
    assert reply.ok, reply.error


def _interrupted(store: Path, capture: str) -> Path:
    """What a pull interrupted before listing `capture` leaves (its files, partial/<hex>; here whole): the page file."""
    hexa = capture.split(":")[1]
    (store / "captures" / f"{hexa}.json").unlink()
    (store / "trees" / f"{hexa}.made.json").unlink()
    os.rename(store / "trees" / hexa, store / "partial" / hexa)
    return store / "partial" / hexa / "images" / "pages-1.img"


def test_an_interrupted_pull_resumes_from_the_verified_chunks(node_b: tuple[Daemon, Path], capsule: tuple[str, str],
                                                              capture_context: tuple[Path, dict[str, str]]) -> None:
    (daemon, store), (tag, capture) = node_b, capsule
    _pull(daemon, tag)
    pages = _interrupted(store, capture)
    with open(pages, "r+b") as damaged:  # the tail "not fetched yet"
        damaged.seek(2 * CHUNK_BYTES)
        damaged.write(bytes(3 << 20))
    inode = pages.stat().st_ino
    _pull(daemon, tag)
    pages = store / "trees" / capture.split(":")[1] / "images" / "pages-1.img"
    assert pages.stat().st_ino == inode  # the same files, resumed
    assert hashlib.sha256(pages.read_bytes()).hexdigest() == capture_context[1]["pages-1.img"]


def test_an_interrupted_pulls_chunks_are_collected_and_gc_says_what_it_freed(node_b: tuple[Daemon, Path],
                                                                             capsule: tuple[str, str]) -> None:
    """Review (issue 34, item 1): the chunks of a pull that never listed its capture stayed for ever."""
    (daemon, store), (tag, capture) = node_b, capsule
    _pull(daemon, tag)
    blobs = {p.name: p.stat().st_blocks * 512 for p in (store / "blobs" / "sha256").iterdir()}
    _interrupted(store, capture)  # the pull "died" before listing it
    files = sum(p.stat().st_blocks * 512 for p in (store / "partial").rglob("*") if p.is_file())
    assert not any((store / "captures").iterdir())  # no other capture names these blobs
    cli = subprocess.run([sys.executable, "-m", "coldsnap_provider", "capture", "gc", "--state-dir",
                          str(daemon.state_dir), "--older-than", "1000d", "-o", "json"], capture_output=True,
                         text=True, check=True)
    assert json.loads(cli.stdout) == {"removed": [], "blobs": len(blobs), "orphans": len(blobs),
                                      "bytes": sum(blobs.values()) + files}
    assert not any((store / "blobs" / "sha256").iterdir()) and not any((store / "trees").iterdir())
    assert not any((store / "partial").iterdir())
    _pull(daemon, tag)  # and a pull brings it back whole


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_blob_in_the_registry_fails_the_pull_naming_it_and_nothing_of_it_is_kept(
        node_b: tuple[Daemon, Path], capsule: tuple[str, str], registry: Registry, damage: str) -> None:
    """The chunk comes through a worker thread's stream (_blob_fetch.py): checked against its digest and size
    before it takes its name; the capture is not listed."""
    (daemon, store), (tag, capture) = node_b, capsule
    _pull(daemon, tag)
    spans = [span for f in CaptureStore(store).data(capture).files for span in f.spans() if span[0]]
    chunk = max(spans, key=lambda span: span[2])[0]
    name = str(chunk).split(":")[1]
    blobs = registry.credentials_file.parent / "data/docker/registry/v2/blobs/sha256"  # the registry's storage
    served = blobs / name[:2] / name / "data"
    record = store / "captures" / f"{capture.split(':')[1]}.json"
    original = served.read_bytes()
    _interrupted(store, capture)
    shutil.rmtree(store / "partial")  # nothing of it on the node
    (store / "partial").mkdir()
    served.write_bytes(original[:-1] + bytes([original[-1] ^ 1]) if damage == "corrupt" else original[:-4096])
    try:
        session = _session(daemon)
        reply = anyio.run(lambda: session.runtime("image-pull", image=tag))
        assert not reply.ok and f"registry {registry.address}: blob {chunk} is corrupt or truncated" \
            in str(reply.error), reply.error
        assert not record.exists() and not list((store / "tmp").iterdir())
        assert not (store / "trees" / capture.split(":")[1]).exists()
    finally:
        served.write_bytes(original)
    _pull(daemon, tag)
    assert record.exists()


def test_a_damaged_chunk_refuses_the_run_naming_it_before_anything_starts(node_b: tuple[Daemon, Path],
                                                                         capsule: tuple[str, str]) -> None:
    (daemon, store), (tag, capture) = node_b, capsule
    _pull(daemon, tag)
    CaptureStore(store).drop_tree(capture)  # reclaimed: its chunks kept as blobs
    blob = max((store / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    original = blob.read_bytes()
    blob.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    session = _session(daemon)
    try:
        run = anyio.run(lambda: session.runtime("workload-run", workload={
            "name": "", "image": tag, "remove_after_exit": True, "command": ["true"]}))
        assert not run.ok and f"chunk sha256:{blob.name} is corrupt or truncated" in str(run.error)
        assert "nothing was started" in str(run.error)
    finally:
        blob.write_bytes(original)


def test_the_registry_down_is_named(node_a: tuple[Daemon, Path], capsule: tuple[str, str]) -> None:
    session = _session(node_a[0])
    with socket_closed() as address:
        target = f"{address}/capsules/{uniq('down')}:1"

        async def push() -> None:
            assert (await session.runtime("image-tag", source=capsule[0], target=target)).ok
            try:
                pushed = await session.runtime("image-push", image=target)
                assert not pushed.ok and f"registry {address}" in str(pushed.error), pushed.error
            finally:
                await session.runtime("image-remove", image=target)

        anyio.run(push)


@contextlib.contextmanager
def socket_closed() -> Iterator[str]:
    """A 127.0.0.1 port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    yield address


def test_collection_never_takes_a_capture_in_use_and_managers_see_only_their_own(
        node_b: tuple[Daemon, Path], capsule: tuple[str, str]) -> None:
    (daemon, store), (tag, capture) = node_b, capsule
    _pull(daemon, tag)
    name = uniq("capuse")

    async def run() -> None:
        session = await daemon.open_session(hosts=["localhost"])
        assert (await session.runtime("workload-run", workload={
            "name": name, "image": tag, "detached": True, "command": ["sleep", "60"]})).ok
        try:
            listed = await daemon.control(operation="capture-list")
            assert capture in [c["capture"] for c in listed]
            cli = await anyio.run_process([sys.executable, "-m", "coldsnap_provider", "capture", "inspect",
                                           "--state-dir", str(daemon.state_dir), capture])
            # zeros: the page file's (up to its tail at 128 MiB) and the whole device dump (65 MiB), never stored; of
            # the page file's run, less what finishes the chunk before it (under MIN_BYTES)
            zero = (2 * CHUNK_BYTES - PAGES_RANDOM + CHUNK_BYTES + (1 << 20)) / 2**20
            found = re.search(rf"capture: +{capture}\n(?:.*\n)*zero: +([0-9.]+) MiB \(never stored\)",
                              cli.stdout.decode())
            assert found is not None and zero - MIN_BYTES / 2**20 - 0.05 <= float(found.group(1)) <= zero
            assert (await daemon.control(operation="capture-gc", max_bytes=0))["removed"] == []
            with pytest.raises(ReplyError, match="in use by a container"):
                await daemon.control(operation="capture-remove", capture=capture)
        finally:
            assert (await session.runtime("workload-remove", name=name)).ok
        assert capture in (await daemon.control(operation="capture-gc", max_bytes=0))["removed"]
        assert not list((store / "captures").iterdir())
        with pytest.raises(ReplyError, match=r"capture-inspect: no such capture: sha256:[0-9a-f]{64}"):
            await daemon.control(operation="capture-inspect", capture=capture)

    anyio.run(run)
    os.chmod(daemon.state_dir / "control.sock", 0o666)
    other = control_as(OTHER_UID, daemon.state_dir, {"operation": "capture-list"})
    assert other["ok"] and other["result"] == []  # root's images: not this manager's
    refused = control_as(OTHER_UID, daemon.state_dir, {"operation": "capture-gc", "max_bytes": 0})
    assert not refused["ok"] and "may not collect" in refused["error"]


def test_a_host_without_a_store_refuses_a_capsule_that_needs_one(daemon: Daemon, capsule: tuple[str, str]) -> None:
    session = _session(daemon)
    run = anyio.run(lambda: session.runtime("workload-run", workload={
        "name": "", "image": capsule[0], "remove_after_exit": True, "command": ["true"]}))
    assert not run.ok and "has no capture store" in str(run.error)


def test_an_image_label_naming_a_path_outside_the_capture_is_refused(
        node_a: tuple[Daemon, Path], capsule: tuple[str, str], busybox_image: str) -> None:
    """review: the files label is the image's own (any Dockerfile's LABEL): a source with .. must not become a
    bind of a host path."""
    import base64

    (daemon, _), (_, capture) = node_a, capsule
    secret = Path(tempfile.mkdtemp(prefix="cs-secret-", dir="/var/tmp"))
    (secret / "key").write_text("host-only-secret\n")
    context = Path(tempfile.mkdtemp(prefix="cs-lblctx-", dir="/var/tmp"))
    context.chmod(0o755)
    files = base64.urlsafe_b64encode(json.dumps({"/leak": "../" * 24 + str(secret / "key").lstrip("/")}).encode())
    dockerfile = (f"FROM {busybox_image}\nLABEL io.coldsnap-provider.capture={capture} "
                  f"io.coldsnap-provider.capture-files={files.decode()}\n")
    tag = f"localhost/{uniq('leak')}:1"
    session = _session(daemon)

    async def run() -> None:
        built = await session.runtime("image-build", build=build_request(dockerfile, str(context), tag))
        if not built.ok:  # refused at build (a Dockerfile may not set the label): then nothing is left to run
            assert "is written by the daemon" in str(built.error), built.error
            return
        ran = await session.runtime("workload-run", workload={
            "name": "", "image": tag, "remove_after_exit": True, "command": ["cat", "/leak"]})
        assert not ran.ok, ran.runtime.output  # type: ignore[union-attr]
        assert "is not a file of capture" in str(ran.error)

    try:
        anyio.run(run)
    finally:
        docker("image", "rm", "-f", tag, check=False)
        shutil.rmtree(secret, ignore_errors=True)
        shutil.rmtree(context, ignore_errors=True)


def test_a_dockerfile_may_not_name_a_capture_itself(node_a: tuple[Daemon, Path], capsule: tuple[str, str],
                                                    busybox_image: str) -> None:
    """review: a manager's own LABEL naming another's capture (its id from an image it can see) would mount that
    capture's files into its container: refused at build, the image removed; a capsule's derivation (FROM it)
    keeps the label it inherits."""
    import base64

    (daemon, _), (capsule_tag, capture) = node_a, capsule
    context = Path(tempfile.mkdtemp(prefix="cs-forgectx-", dir="/var/tmp"))
    context.chmod(0o755)
    files = base64.urlsafe_b64encode(json.dumps({"/stolen": "images/pages-1.img"}).encode()).decode()
    forged = f"localhost/{uniq('forged')}:1"
    derived = f"localhost/{uniq('derived')}:1"
    session = _session(daemon)

    async def run() -> None:
        built = await session.runtime("image-build", build=build_request(
            f"FROM {busybox_image}\nLABEL io.coldsnap-provider.capture={capture} "
            f"io.coldsnap-provider.capture-files={files}\n", str(context), forged))
        assert not built.ok and "is written by the daemon" in str(built.error), built.error
        assert docker("image", "inspect", forged, check=False).returncode != 0
        built = await session.runtime("image-build", build=build_request(
            f"FROM {capsule_tag}\nENV X=1\n", str(context), derived))
        assert built.ok, built.error

    try:
        anyio.run(run)
    finally:
        docker("image", "rm", "-f", forged, check=False)
        docker("image", "rm", "-f", derived, check=False)
        shutil.rmtree(context, ignore_errors=True)


def test_a_later_layer_over_a_stub_path_is_what_the_workload_sees(
        node_a: tuple[Daemon, Path], capsule: tuple[str, str], capture_context: tuple[Path, dict[str, str]]) -> None:
    """Regression: review #14. An image built FROM a capsule (its capture labels inherited) puts its own file at a
    stub path: the workload sees that file, as the image shows it without a store (the capture's file is not bound
    over it), and the capture's other files still come from the store."""
    (daemon, _), (capsule_tag, _) = node_a, capsule
    _, sums = capture_context
    context = Path(tempfile.mkdtemp(prefix="cs-overctx-", dir="/var/tmp"))
    context.chmod(0o755)
    (context / "mine.img").write_bytes(b"the manager's own pages\n")
    (context / "mine.img").chmod(0o644)
    derived = f"localhost/{uniq('over')}:1"
    session = _session(daemon)

    async def run() -> None:
        built = await session.runtime("image-build", build=build_request(
            f"FROM {capsule_tag}\nCOPY mine.img /capsule/images/pages-1.img\n", str(context), derived))
        assert built.ok, built.error
        for _ in range(2):  # the second run of the image is answered from what the first one read of it
            ran = await session.runtime("workload-run", workload={
                "name": "", "image": derived, "remove_after_exit": True, "command": [
                    "sh", "-c", "head -c 64 /capsule/images/pages-1.img; sha256sum /capsule/images/dump/seg-0.bin"]})
            assert ran.ok, ran.error
            output = ran.runtime.output  # type: ignore[union-attr]
            assert output.startswith(b"the manager's own pages\n"), output[:64]
            assert sums["dump/seg-0.bin"].encode() in output

    try:
        anyio.run(run)
    finally:
        docker("image", "rm", "-f", derived, check=False)
        shutil.rmtree(context, ignore_errors=True)


def test_a_pulled_image_naming_a_capture_its_registry_lacks_is_refused(
        node_a: tuple[Daemon, Path], capsule: tuple[str, str], registry: Registry, busybox_image: str) -> None:
    """review: an image from a registry whose label names a capture the node already holds (another manager's)
    was pulled without asking the registry for the capture, then ran with that capture's files."""
    import base64
    import subprocess

    (daemon, _), (_, capture) = node_a, capsule
    files = base64.urlsafe_b64encode(json.dumps({"/stolen": "images/pages-1.img"}).encode()).decode()
    tag = f"{registry.address}/forged/{uniq('pulled')}:1"
    config = Path(tempfile.mkdtemp(prefix="cs-dockercfg-", dir="/var/tmp"))
    shutil.copy(registry.credentials_file, config / "config.json")
    try:
        subprocess.run(["docker", "--config", str(config), "build", "-q", "-t", tag,
                        "--label", f"io.coldsnap-provider.capture={capture}",
                        "--label", f"io.coldsnap-provider.capture-files={files}", "-"],
                       input=f"FROM {busybox_image}\n".encode(), check=True, capture_output=True)
        subprocess.run(["docker", "--config", str(config), "push", "-q", tag], check=True, capture_output=True)
        docker("image", "rm", "-f", tag)
        session = _session(daemon)
        pulled = anyio.run(lambda: session.runtime("image-pull", image=tag))
        assert not pulled.ok and capture in str(pulled.error), pulled.error
        assert docker("image", "inspect", tag, check=False).returncode != 0  # nothing left to run
    finally:
        docker("image", "rm", "-f", tag, check=False)
        shutil.rmtree(config, ignore_errors=True)


def test_a_manager_holding_the_same_bytes_cannot_remove_a_capture_others_images_carry(
        node_a: tuple[Daemon, Path], capsule: tuple[str, str], registry: Registry, busybox_image: str,
        capture_context: tuple[Path, dict[str, str]]) -> None:
    """Captures are content-addressed: a manager who builds the same capture (the same Dockerfile over the same
    bytes) reaches it, but removing it would take it from the capsule root built (review, finding 10)."""
    daemon, store = node_a
    tag = f"{registry.address}/capsules/{uniq('capo')}:1"
    session = session_as(OTHER_UID, daemon, prefix="op-cap")
    dockerfile = f"FROM {busybox_image}\nCOPY images /capsule/images\n"
    built = anyio.run(lambda: session.runtime("image-build", build=build_request(dockerfile, str(capture_context[0]),
                                                                                 tag)))
    try:
        assert built.ok, built.error
        assert json.loads(docker("image", "inspect", tag).stdout)[0]["Config"]["Labels"][
            "io.coldsnap-provider.capture"] == capsule[1]
        listed = control_as(OTHER_UID, daemon.state_dir, {"operation": "capture-list"})
        assert listed["ok"] and [c["capture"] for c in listed["result"]] == [capsule[1]]
        refused = control_as(OTHER_UID, daemon.state_dir, {"operation": "capture-remove", "capture": capsule[1]})
        assert not refused["ok"] and "also carried by images this manager did not record" in refused["error"]
        assert (store / "captures" / f"{capsule[1].split(':')[1]}.json").exists()
    finally:
        docker("image", "rm", "-f", tag, check=False)


@pytest.fixture(scope="module")
def small_capture_context() -> Iterator[tuple[Path, bytes]]:
    """A build context whose capture has one stored file (1 MiB of random bytes): (the context, its first bytes)."""
    root = Path(tempfile.mkdtemp(prefix="cs-reachctx-", dir="/var/tmp"))
    root.chmod(0o755)  # the build reads it as the manager
    (root / "images").mkdir(mode=0o755)
    (root / "images" / "capture.json").write_text('{"ok": true}\n')
    data = _random(1 << 20)
    (root / "images" / "pages-1.img").write_bytes(data)
    for path in (root / "images").iterdir():
        path.chmod(0o644)
    yield root, data[:16]
    shutil.rmtree(root, ignore_errors=True)


def test_a_manager_runs_tags_and_builds_from_only_the_captures_it_reaches(
        node_a: tuple[Daemon, Path], busybox_image: str, small_capture_context: tuple[Path, bytes]) -> None:
    """Regression: review of issue 34 (a manager tagged another's capsule and reached its capture; ran it by its tag
    or id and had its files mounted). B is refused before anything is made (a probe of it too); A and root run it."""
    daemon, _ = node_a
    context, head = small_capture_context
    a, b = session_as(OTHER_UID, daemon, prefix="reach-a"), session_as(THIRD_UID, daemon, prefix="reach-b")
    root = _session(daemon)
    tag_a, tag_a2 = f"localhost/{uniq('reacha')}:1", f"localhost/{uniq('reacha')}:2"
    tag_b, built_b = f"localhost/{uniq('reachb')}:1", f"localhost/{uniq('reachb')}:2"
    read = ["head", "-c", "16", "/capsule/images/pages-1.img"]

    async def run() -> None:
        built = await a.runtime("image-build", build=build_request(
            f"FROM {busybox_image}\nCOPY images /capsule/images\n", str(context), tag_a))
        assert built.ok, built.error
        inspected = json.loads(docker("image", "inspect", tag_a).stdout)[0]
        capture, image_id = inspected["Config"]["Labels"]["io.coldsnap-provider.capture"], inspected["Id"]
        rule = f"carries capture {capture}, which this manager does not reach"

        tagged = await b.runtime("image-tag", source=tag_a, target=tag_b)
        assert not tagged.ok and rule in str(tagged.error) and "nothing was tagged" in str(tagged.error), tagged.error
        assert docker("image", "inspect", tag_b, check=False).returncode != 0
        for image in (tag_a, image_id):  # by A's tag or by the image's id
            name = uniq("reach")
            ran = await b.runtime("workload-run", workload={
                "name": name, "image": image, "pull_policy": "never", "detached": True, "command": ["sleep", "60"]})
            assert not ran.ok and f"{image} {rule}" in str(ran.error) and "nothing was started" in str(ran.error)
            assert docker("inspect", name, check=False).returncode != 0
        derived = await b.runtime("image-build", build=build_request(
            f"FROM {tag_a}\nENV X=1\n", str(context), built_b))
        assert not derived.ok and f"base image {tag_a} {rule}" in str(derived.error), derived.error
        assert docker("image", "inspect", built_b, check=False).returncode != 0
        probed = control_as(THIRD_UID, daemon.state_dir, {"operation": "probe", "driver": "n610", "image": tag_a})
        assert not probed["ok"] and rule in probed["error"], probed  # the probe runs the capsule as the caller

        # A's own image and its own tag of it, and root (every capture): the capture's file is mounted.
        assert (tagged := await a.runtime("image-tag", source=tag_a, target=tag_a2)).ok, tagged.error
        for session, image in ((a, tag_a2), (root, tag_a)):
            ran = await session.runtime("workload-run", workload={
                "name": "", "image": image, "remove_after_exit": True, "command": read})
            assert ran.ok, ran.error
            assert ran.runtime.output == head  # type: ignore[union-attr]

    try:
        anyio.run(run)
    finally:
        for tag in (tag_a, tag_a2, tag_b, built_b):
            docker("image", "rm", "-f", tag, check=False)


def test_a_capsule_a_manager_pulls_is_its_own_to_run_also_when_its_run_pulled_it(
        node_a: tuple[Daemon, Path], registry: Registry, busybox_image: str,
        small_capture_context: tuple[Path, bytes]) -> None:
    """A run's own pull (pull_policy "missing") records the reference as the pulling manager's once the registry gave
    the capture, so that run (and the next) reaches it; a pull of it again is the manager's own."""
    daemon, _ = node_a
    context, head = small_capture_context
    a, b = session_as(OTHER_UID, daemon, prefix="reach-a"), session_as(THIRD_UID, daemon, prefix="reach-b")
    tag = f"{registry.address}/reach/{uniq('pulled')}:1"

    async def run() -> None:
        built = await a.runtime("image-build", build=build_request(
            f"FROM {busybox_image}\nCOPY images /capsule/images\n", str(context), tag))
        assert built.ok, built.error
        assert (pushed := await a.runtime("image-push", image=tag)).ok, pushed.error
        assert (removed := await a.runtime("image-remove", image=tag)).ok, removed.error
        for _ in range(2):  # pulled by the run, then resident
            ran = await b.runtime("workload-run", workload={
                "name": "", "image": tag, "pull_policy": "missing", "remove_after_exit": True,
                "command": ["head", "-c", "16", "/capsule/images/pages-1.img"]})
            assert ran.ok, ran.error
            assert ran.runtime.output == head  # type: ignore[union-attr]
        assert (pulled := await b.runtime("image-pull", image=tag)).ok, pulled.error

    try:
        anyio.run(run)
    finally:
        docker("image", "rm", "-f", tag, check=False)


def _forge_in_registry(registry: Registry, tag: str, labels: dict[str, str], base: str) -> None:
    """Put at `tag` in the registry an image FROM `base` with `labels` (as the registry's owner would: not through
    the daemon), the node's own `tag` left as it was. A label of its own makes it another image than `base` (whose
    RepoDigests the push would otherwise grow)."""
    labels = {**labels, "io.coldsnap-provider.test": tag}
    config = Path(tempfile.mkdtemp(prefix="cs-dockercfg-", dir="/var/tmp"))
    shutil.copy(registry.credentials_file, config / "config.json")
    before = docker("image", "inspect", "-f", "{{.Id}}", tag, check=False).stdout.decode().strip()
    try:
        subprocess.run(["docker", "--config", str(config), "build", "-q", "-t", tag,
                        *(arg for key, value in labels.items() for arg in ("--label", f"{key}={value}")), "-"],
                       input=f"FROM {base}\n".encode(), check=True, capture_output=True)
        subprocess.run(["docker", "--config", str(config), "push", "-q", tag], check=True, capture_output=True)
    finally:
        shutil.rmtree(config, ignore_errors=True)
    if before:
        docker("image", "tag", before, tag)
    else:
        docker("image", "rm", "-f", tag)


def _remove_forged(tag: str) -> None:
    """The images `_forge_in_registry` put at `tag`, under any name (a pull's digest reference keeps one)."""
    for image in docker("images", "-aq", "--filter", f"label=io.coldsnap-provider.test={tag}").stdout.split():
        docker("image", "rm", "-f", image.decode(), check=False)


def test_a_build_that_pulls_its_base_confers_no_reach_to_a_capture_its_registry_lacks(
        node_a: tuple[Daemon, Path], registry: Registry, busybox_image: str,
        small_capture_context: tuple[Path, bytes]) -> None:
    """Regression: review 15. A build with pull: true had the engine pull its base into the manager's own reference,
    unchecked: a registry's image there labelled with another manager's capture (seen in its image) then reached it,
    and its run mounted that capture's files. The base's capture is now asked of its registry, as a pull's is."""
    daemon, _ = node_a
    context, head = small_capture_context
    owner, thief = session_as(OTHER_UID, daemon, prefix="reach-o"), session_as(THIRD_UID, daemon, prefix="reach-t")
    capsule, built = f"localhost/{uniq('own')}:1", f"localhost/{uniq('thief')}:1"
    base = f"{registry.address}/forged/{uniq('base')}:1"
    labels = ("io.coldsnap-provider.capture", "io.coldsnap-provider.capture-files")

    async def run() -> None:
        made = await owner.runtime("image-build", build=build_request(
            f"FROM {busybox_image}\nCOPY images /capsule/images\n", str(context), capsule))
        assert made.ok, made.error
        found = json.loads(docker("image", "inspect", capsule).stdout)[0]["Config"]["Labels"]
        _forge_in_registry(registry, base, {}, busybox_image)  # a plain image, the thief's own reference
        assert (pulled := await thief.runtime("image-pull", image=base)).ok, pulled.error
        _forge_in_registry(registry, base, {key: found[key] for key in labels}, capsule)  # its stubs too
        derived = await thief.runtime("image-build", build=build_request(
            f"FROM {base}\nENV X=1\n", str(context), built, pull=True))
        assert not derived.ok and found[labels[0]] in str(derived.error), derived.error
        ran = await thief.runtime("workload-run", workload={
            "name": "", "image": base, "pull_policy": "never", "remove_after_exit": True,
            "command": ["head", "-c", "16", "/capsule/images/pages-1.img"]})
        assert not (ran.ok and ran.runtime.output == head), "the thief read another manager's capture"  # type: ignore[union-attr]
        assert docker("image", "inspect", built, check=False).returncode != 0

    try:
        anyio.run(run)
    finally:
        for tag in (capsule, built, base):
            docker("image", "rm", "-f", tag, check=False)
        _remove_forged(base)


class _StallingProxy:
    """The registry behind another address (its credentials added by the proxy): a request for `stall`'s manifest is
    never answered; `stalled` is set when one arrives, `released` when its client hung up."""

    def __init__(self, registry: Registry, stall: str) -> None:
        import base64
        import http.client
        import http.server
        import select
        import threading

        auth = "Basic " + base64.b64encode(f"{registry.username}:{registry.password}".encode()).decode()
        self.stalled, self.released, closing = threading.Event(), threading.Event(), threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                if f"/manifests/{stall}" in self.path:
                    proxy.stalled.set()
                    while not closing.is_set():  # until the client leaves: then its pull was cancelled
                        readable = select.select([self.connection], [], [], 0.05)[0]
                        if readable and not self.connection.recv(1, socket.MSG_PEEK):
                            proxy.released.set()
                            return
                    return
                upstream = http.client.HTTPConnection(registry.address, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("accept", "range")}
                upstream.request(self.command, self.path, headers={**headers, "Authorization": auth})
                answer = upstream.getresponse()
                body = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                upstream.close()

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._closing = closing
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()


def test_a_pull_cancelled_before_its_capture_came_leaves_nothing_that_reaches_it(
        node_a: tuple[Daemon, Path], registry: Registry, busybox_image: str,
        small_capture_context: tuple[Path, bytes]) -> None:
    """Regression: review 15. A pull re-points the manager's own reference before its capture is asked of the
    registry; a manager that hung up then (its registry slow to answer) kept that image, labelled with another
    manager's capture, under its own reference, which reached the capture: its run mounted the files."""
    daemon, _ = node_a
    context, head = small_capture_context
    owner, thief = session_as(OTHER_UID, daemon, prefix="reach-o"), session_as(THIRD_UID, daemon, prefix="reach-t")
    capsule, repository = f"localhost/{uniq('own')}:1", f"forged/{uniq('slow')}:1"
    labels = ("io.coldsnap-provider.capture", "io.coldsnap-provider.capture-files")
    made = anyio.run(lambda: owner.runtime("image-build", build=build_request(
        f"FROM {busybox_image}\nCOPY images /capsule/images\n", str(context), capsule)))
    assert made.ok, made.error
    found = json.loads(docker("image", "inspect", capsule).stdout)[0]["Config"]["Labels"]
    proxy = _StallingProxy(registry, found[labels[0]])
    tag = f"{proxy.address}/{repository}"

    async def run() -> None:
        _forge_in_registry(registry, f"{registry.address}/{repository}", {}, busybox_image)
        assert (pulled := await thief.runtime("image-pull", image=tag)).ok, pulled.error  # its own reference
        _forge_in_registry(registry, f"{registry.address}/{repository}", {key: found[key] for key in labels},
                           capsule)  # its stubs too
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: thief.runtime("image-pull", image=tag))
            assert await anyio.to_thread.run_sync(proxy.stalled.wait, 60)
            group.cancel_scope.cancel()  # the thief hangs up while its registry holds the capture's manifest back
        assert await anyio.to_thread.run_sync(proxy.released.wait, 60)
        ran = await thief.runtime("workload-run", workload={
            "name": "", "image": tag, "pull_policy": "never", "remove_after_exit": True,
            "command": ["head", "-c", "16", "/capsule/images/pages-1.img"]})
        assert not (ran.ok and ran.runtime.output == head), "the thief read another manager's capture"  # type: ignore[union-attr]

    try:
        anyio.run(run)
    finally:
        proxy.close()
        for image in (capsule, tag, f"{registry.address}/{repository}"):
            docker("image", "rm", "-f", image, check=False)
        _remove_forged(f"{registry.address}/{repository}")


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_second_capture_of_the_same_model_adds_only_its_new_pages_to_the_store_and_the_registry(
        node_a: tuple[Daemon, Path], registry: Registry, busybox_image: str) -> None:
    """Issue 34's goal, small: the same weights in host pages that moved (the heap before them grew by 3 pages) and
    the same device dump; what the second build and push add, read from the store's and the registry's storage."""
    daemon, store = node_a
    session = _session(daemon)
    weights, dump, mib = os.urandom(24 << 20), os.urandom(8 << 20), 1 << 20
    registry_data = registry.credentials_file.parent / "data"
    roots, tags = [], [f"{registry.address}/capsules/{uniq('second')}:{n}" for n in (1, 2)]

    async def build_and_push(n: int, heap: bytes) -> str:
        root = Path(tempfile.mkdtemp(prefix="cs-second-", dir="/var/tmp"))
        roots.append(root)
        root.chmod(0o755)  # the build reads it as exec.user
        (root / "images" / "device-1").mkdir(parents=True)
        (root / "images" / "capture.json").write_text(f'{{"capture": {n}}}\n')
        (root / "images" / "pages-1.img").write_bytes(heap + weights)
        (root / "images" / "device-1" / "seg-0.bin").write_bytes(dump)
        dockerfile = f"FROM {busybox_image}\nCOPY images /capsule/images\n"
        assert (built := await session.runtime("image-build", build=build_request(dockerfile, str(root), tags[n - 1]))
                ).ok, built.error
        assert (pushed := await session.runtime("image-push", image=tags[n - 1])).ok, pushed.error
        return str(json.loads(docker("image", "inspect", tags[n - 1]).stdout)[0]["Config"]["Labels"][
            "io.coldsnap-provider.capture"])

    async def run() -> None:
        first = await build_and_push(1, os.urandom(mib))
        stored, pushed = _store_bytes(store), _bytes_under(registry_data)
        second = await build_and_push(2, os.urandom(mib + 3 * 4096))
        added_store, added_registry = _store_bytes(store) - stored, _bytes_under(registry_data) - pushed
        assert first != second
        assert 0 < added_store <= 5 * mib, added_store  # of 33 MiB: the new heap and a chunk or two around it
        assert added_store < added_registry <= added_store + (256 << 10), added_registry  # and the image's stubs
        files = [{f.path: f for f in CaptureStore(store).data(c).files} for c in (first, second)]
        dumps = [f["images/device-1/seg-0.bin"] for f in files]
        assert dumps[0].chunks == dumps[1].chunks and dumps[0].lengths is None  # 64 MiB from the file's start
        assert all(f["images/pages-1.img"].lengths for f in files)  # CRIU's page image: cut by content

    try:
        anyio.run(run)
    finally:
        for tag in tags:
            docker("image", "rm", "-f", tag, check=False)
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)

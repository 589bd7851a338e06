"""Capsules that carry a capture, through the node's capture store (DESIGN decision 16, issue 34): image-build puts
the capture's large files in the store, image-push moves its chunks beside the image, image-pull on another node
(here: another daemon with its own store, on the same engine) fetches them, workload-run shows the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from coldsnap_runtime.store import CHUNK_BYTES
from tests.conftest import Registry, docker
from tests.helpers import Daemon, Session
from tests.runtime.conftest import module_daemon, uniq
from tests.runtime.test_images import build_request

pytestmark = pytest.mark.usefixtures("no_leftovers")


def _store_daemon(registry: Registry, tag: str) -> Iterator[tuple[Daemon, Path]]:
    store = Path(tempfile.mkdtemp(prefix=f"cs-store-{tag}-", dir="/var/tmp"))
    try:
        for daemon in module_daemon(registry, f'[docker]\ncapture_store = "{store}"\n'):
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


@pytest.fixture(scope="module")
def capture_context() -> Iterator[tuple[Path, dict[str, str]]]:
    """A unit's build context with an images directory: a page file (one random chunk, a zero chunk, a random
    tail), a device dump of zeros only, and small files that stay in the image. The files' SHA-256."""
    root = Path(tempfile.mkdtemp(prefix="cs-capctx-", dir="/var/tmp"))
    images = root / "images"
    (images / "dump").mkdir(parents=True)
    (images / "capture.json").write_text('{"ok": true}\n')
    (images / "small.img").write_bytes(os.urandom(4096))
    random_chunk = os.urandom(CHUNK_BYTES)
    with open(images / "pages-1.img", "wb") as out:
        out.write(random_chunk)
        out.seek(2 * CHUNK_BYTES)
        out.write(os.urandom(3 << 20))
    with open(images / "dump" / "seg-0.bin", "wb") as out:
        out.truncate(CHUNK_BYTES + (1 << 20))
    sums = {str(p.relative_to(images)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in images.rglob("*") if p.is_file()}
    yield root, sums
    shutil.rmtree(root, ignore_errors=True)


def _checksums_command() -> list[str]:
    return ["sh", "-c", "cd /capsule/images && sha256sum capture.json small.img pages-1.img dump/seg-0.bin"]


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
        # Stored: one random chunk and the tail; neither zero chunk, not the small files.
        assert _store_bytes(store_a) < CHUNK_BYTES + (4 << 20) + 8192
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
        there = await session_b.runtime("workload-run", workload={
            "name": "", "image": tag, "remove_after_exit": True, "command": _checksums_command()})
        assert there.ok, there.error
        assert _sums(there.runtime.output) == sums  # type: ignore[union-attr]
        # Zero chunks come back as holes: the tree's page file holds only its non-zero chunks.
        tree = store_b / "trees" / capture.split(":")[1] / "images"
        assert (tree / "dump" / "seg-0.bin").stat().st_blocks == 0
        assert (tree / "pages-1.img").stat().st_blocks * 512 < CHUNK_BYTES + (8 << 20)
        assert (await session_b.runtime("image-remove", image=tag)).ok

    try:
        anyio.run(run)
    finally:
        docker("image", "rm", "-f", tag, check=False)

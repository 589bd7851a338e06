"""workload-run of a capsule runs exactly what it checked: the image by id (a tag moved meanwhile changes nothing),
and each capture file bound only over its own stub (review 2026-12-02, findings 5 and 9). The backend runs in
this process against the real dockerd, so a test can hold the capture lock a run waits for."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from coldsnap_runtime.backend import DockerBackend
from coldsnap_runtime.errors import RuntimeFailed
from coldsnap_runtime.schema import ImageBuild, WorkloadSpec
from tests.conftest import docker
from tests.runtime.conftest import uniq

pytestmark = pytest.mark.usefixtures("no_leftovers")


async def _build(store: Path, dockerfile: str, context: Path, tag: str) -> None:
    async with DockerBackend(capture_store=store) as backend:
        await backend.image_build(ImageBuild(dockerfile=dockerfile.encode(), context=str(context), tag=tag))


@pytest.fixture(scope="module")
def capsule(busybox_image: str) -> Iterator[tuple[Path, str]]:
    """A capsule whose two page files (1 MiB each) are in a store of its own: (the store, its tag)."""
    store = Path(tempfile.mkdtemp(prefix="cs-runstore-", dir="/var/tmp"))
    context = Path(tempfile.mkdtemp(prefix="cs-runctx-", dir="/var/tmp"))
    (context / "images").mkdir()
    (context / "images" / "capture.json").write_text('{"ok": true}\n')
    for name in ("a", "b"):
        (context / "images" / f"pages-{name}.img").write_bytes(name.encode() * (1 << 20))
    tag = f"localhost/{uniq('runcap')}:1"
    try:
        anyio.run(_build, store, f"FROM {busybox_image}\nCOPY images /capsule/images\n", context, tag)
        yield store, tag
    finally:
        docker("image", "rm", "-f", tag, check=False)
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(context, ignore_errors=True)


def _image_id(ref: str) -> str:
    return str(json.loads(docker("image", "inspect", ref).stdout)[0]["Id"])


async def test_a_tag_moved_while_a_capsule_run_waits_does_not_change_the_image_it_runs(
        capsule: tuple[Path, str], busybox_image: str) -> None:
    """Regression: review 2026-12-02, finding 5 (the image was checked by id and created by tag: a retag between
    the two ran another image under the capture's files)."""
    store, capsule_tag = capsule
    moving = f"localhost/{uniq('moving')}:1"
    docker("tag", capsule_tag, moving)
    checked = _image_id(moving)
    name = uniq("retag")
    spec = msgspec.convert({"name": name, "image": moving, "detached": True, "command": ["sleep", "60"]},
                           WorkloadSpec)
    try:
        async with DockerBackend(capture_store=store) as backend:
            async with anyio.create_task_group() as tg:
                async with backend.captures.lock:  # the run checks its image, then waits here to create
                    tg.start_soon(lambda: backend.workload_run(spec, allow_pull=False))
                    with anyio.fail_after(30):
                        while backend.captures.lock.statistics().tasks_waiting == 0:
                            await anyio.sleep(0.01)
                    docker("tag", busybox_image, moving)  # another manager's tag, or a pull under it
            try:
                created = json.loads(docker("inspect", name).stdout)[0]
                assert created["Image"] == checked  # what was checked, whatever the tag names now
                assert (await backend.workload_inspect(name, include_start_time=False)).image == moving
            finally:
                await backend.workload_remove(name)
    finally:
        docker("image", "rm", "-f", moving, check=False)


async def test_a_stub_moved_over_another_stubs_path_is_refused_naming_that_path(
        capsule: tuple[Path, str], tmp_path: Path) -> None:
    """Regression: review 2026-12-02, finding 9 (every stub had the same bytes: a derived image that moved one
    over another had the other path's capture file bound there, where the image holds the first file)."""
    store, capsule_tag = capsule
    derived = f"localhost/{uniq('moved')}:1"
    (tmp_path / "empty").mkdir()
    os.chmod(tmp_path, 0o755)
    try:
        await _build(store, f"FROM {capsule_tag}\nRUN mv /capsule/images/pages-a.img /capsule/images/pages-b.img\n",
               tmp_path / "empty", derived)
        spec = msgspec.convert({"image": derived, "remove_after_exit": True,
                                "command": ["head", "-c", "1", "/capsule/images/pages-b.img"]}, WorkloadSpec)
        async with DockerBackend(capture_store=store) as backend:
            with pytest.raises(RuntimeFailed, match=r"/capsule/images/pages-b\.img holds a capture stub that is not "
                                                    r"its own \('capture sha256:[0-9a-f]{64}\\nfile images/pages-a"):
                await backend.workload_run(spec, allow_pull=False)
            # The capsule itself: each path holds its own stub, and its own file is bound there.
            ran = await backend.workload_run(msgspec.convert(
                {"image": capsule_tag, "remove_after_exit": True,
                 "command": ["sh", "-c", "cd /capsule/images && head -c 1 pages-a.img && head -c 1 pages-b.img"]},
                WorkloadSpec), allow_pull=False)
        assert ran.output == b"ab", ran.output
    finally:
        docker("image", "rm", "-f", derived, check=False)

"""What a copy may cost the node (#24 finding 8): a byte cap on every spooled copy, spooled on disk, sparse
files kept sparse. Real containers; the spool and the destination are small tmpfs mounts, so a copy that
expanded a sparse file, or spooled past the cap, would run out of room there."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import docker
from tests.helpers import running_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 16 MiB tmpfs, world-traversable (the destination of a copy written as exec.user)."""
    path = Path(tempfile.mkdtemp(prefix="cs-small-", dir="/var/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "cs-small", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()


def _workload(name: str, image: str, script: str) -> dict[str, object]:
    return {"image": image, "name": name, "detached": True, "command": ["sh", "-c", f"{script}; sleep 300"]}


async def _ready(s: object, name: str, path: str) -> None:
    import anyio

    with anyio.fail_after(10):
        while (await s.runtime("workload-exec", name=name,  # type: ignore[attr-defined]
                               execution={"command": ["test", "-e", path]})).error_code:
            await anyio.sleep(0.1)


async def test_copy_from_sparse_file_is_spooled_and_placed_sparse(busybox_image: str, small_tmpfs: Path) -> None:
    """Regression: #24 finding 8 (a 1 GiB sparse file became a 1 GiB spool as root)."""
    name = f"coldsnap-sparse-{os.getpid()}"
    spool, dest = small_tmpfs / "spool", small_tmpfs / "dest"
    spool.mkdir(mode=0o700)
    dest.mkdir()
    config = f'[docker]\nspool_dir = "{spool}"\n'
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["localhost"])
        try:
            run = await s.runtime("workload-run", workload=_workload(
                name, busybox_image, "mkdir /out && echo head > /out/small && truncate -s 256M /out/sparse"))
            assert run.ok, run.error
            await _ready(s, name, "/out/sparse")
            copied = await s.runtime("workload-copy-from", name=name, path="/out", destination=str(dest / "out"))
        finally:
            docker("rm", "-f", name, check=False)
    assert copied.ok, copied.error
    placed = os.stat(dest / "out" / "sparse")
    assert placed.st_size == 256 << 20
    assert placed.st_blocks * 512 < 1 << 20  # holes, not zeros
    assert (dest / "out" / "small").read_text() == "head\n"
    assert os.listdir(spool) == []  # the spool is gone with the copy


async def test_copy_from_past_copy_max_bytes_fails_and_places_nothing(busybox_image: str, tmp_path: Path) -> None:
    """Regression: #24 finding 8 (no bound on what copy-from spools as the daemon)."""
    name = f"coldsnap-capped-{os.getpid()}"
    config = "[docker]\ncopy_max_bytes = 1048576\n"
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["localhost"])
        try:
            run = await s.runtime("workload-run", workload=_workload(
                name, busybox_image, "mkdir /out && head -c 2097152 /dev/urandom > /out/big && touch /out/done"))
            assert run.ok, run.error
            await _ready(s, name, "/out/done")
            refused = await s.runtime("workload-copy-from", name=name, path="/out", destination=str(tmp_path / "o"))
            small = await s.runtime("workload-copy-from", name=name, path="/out/done",
                                    destination=str(tmp_path / "done"))
        finally:
            docker("rm", "-f", name, check=False)
    assert not refused.ok and refused.error_code == "runtime_failed"
    assert "exceeds 1048576 bytes (docker.copy_max_bytes)" in refused.error
    assert not (tmp_path / "o").exists()
    assert small.ok, small.error  # under the cap: copied as before
    assert (tmp_path / "done").exists()


def test_check_config_copy_max_bytes_below_one_mebibyte_is_an_error(tmp_path: Path) -> None:
    import sys

    from tests.helpers import ROOT

    path = tmp_path / "config.toml"
    path.write_text("[docker]\ncopy_max_bytes = 1024\n")
    done = subprocess.run([sys.executable, "-m", "coldsnap_provider", "check-config", str(path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0
    assert "copy_max_bytes" in done.stderr and "1048576" in done.stderr


async def test_build_context_past_copy_max_bytes_fails_and_builds_nothing(busybox_image: str, tmp_path: Path) -> None:
    """Regression: #24 finding 8 (a build context was spooled as the daemon without a bound)."""
    import base64

    context = tmp_path / "context"
    context.mkdir()
    (context / "big").write_bytes(os.urandom(2 << 20))
    tag = f"coldsnap-test/capped-build:{os.getpid()}"
    dockerfile = base64.b64encode(f"FROM {busybox_image}\nCOPY big /big\n".encode()).decode()
    async with running_daemon("[docker]\ncopy_max_bytes = 1048576\n") as daemon:
        s = await daemon.open_session(hosts=["localhost"])
        try:
            built = await s.runtime("image-build", build={"dockerfile": dockerfile, "context": str(context),
                                                          "tag": tag, "pull": False})
            present = docker("image", "inspect", tag, check=False).returncode == 0
        finally:
            docker("rmi", "-f", tag, check=False)
    assert not built.ok and "the build context exceeds 1048576 bytes (docker.copy_max_bytes)" in built.error
    assert not present


async def test_copy_from_hard_links_count_their_data_against_copy_max_bytes(busybox_image: str,
                                                                            small_tmpfs: Path) -> None:
    """Review of #24 finding 8: the tar carries a file's data once and every hard link to it as a header,
    but the extractor writes each link as a copy: 1 MiB and 40 links (a 1.1 MiB tar, under a 4 MiB cap)
    became 41 MiB at the destination (and so did a remote node's build context, written as root)."""
    name = f"coldsnap-links-{os.getpid()}"
    dest = small_tmpfs / "dest"
    dest.mkdir()
    config = "[docker]\ncopy_max_bytes = 4194304\n"
    script = "mkdir /out && head -c 1048576 /dev/urandom > /out/f && for i in $(seq 40); do ln /out/f /out/l$i; done"
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["localhost"])
        try:
            run = await s.runtime("workload-run", workload=_workload(name, busybox_image, f"{script}; touch /done"))
            assert run.ok, run.error
            await _ready(s, name, "/done")
            refused = await s.runtime("workload-copy-from", name=name, path="/out", destination=str(dest / "out"))
            linked = await s.runtime("workload-exec", name=name, execution={
                "command": ["sh", "-c", "mkdir /few && head -c 1048576 /dev/urandom > /few/f && ln /few/f /few/g"]})
            assert linked.ok, linked.error
            few = await s.runtime("workload-copy-from", name=name, path="/few", destination=str(dest / "few"))
        finally:
            docker("rm", "-f", name, check=False)
    assert not refused.ok and refused.error_code == "runtime_failed"
    assert refused.error == ("workload-copy-from failed: the copy's files hold more than 4194304 bytes "
                             "(docker.copy_max_bytes; a hard link counts its file's bytes again); nothing was placed")
    assert sorted(os.listdir(dest)) == ["few"]
    assert few.ok, few.error  # under the cap, hard links included: copied as before
    assert (dest / "few" / "f").read_bytes() == (dest / "few" / "g").read_bytes()

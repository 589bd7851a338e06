"""The release's direct path on a GPU (dump_direct.c, issue 35 item 3): an unchanged torch process (1 GiB of
tensors, 160 MiB of zeros, a cuBLAS matmul, a CUDA graph) released into tmpfs has the device copy straight into the
dump files' registered pages (128 MiB windows here, so a window of two chunks and a short one are both met); the
manifest says `direct`, nothing of the files stays mapped in the engine, the chunks of zeros are holes, and the
dump goes through the CUDA checkpoint and back and hydrates to the same bytes and graph. Released again into a
disk directory it goes staged, saying why, and writes the very same files byte for byte (hydrate.c, the node
hydrator and hydration/_digests.py read either). Skipped without an NVIDIA driver."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe.hydration import build_library, check_dump
from tests.probe.test_interposer_gpu import Target, checkpoint_and_restore
from tests.probe.test_main import has_nvidia_driver

pytestmark = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
MIB = 1 << 20


def fs_type(path: Path) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("interposer-direct")
    library, diagnostics = build_library(root / "lib")
    assert diagnostics == ""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COLDSNAP_CUDA_INTERPOSER_WINDOW_MIB", "128")
        env.setenv("COLDSNAP_CUDA_INTERPOSER_DIRECT", "1")  # any tmpfs: /dev/shm is often huge=never
        target = Target(root, library)
    try:
        yield target
    finally:
        os.killpg(target.proc.pid, 9)
        target.proc.wait()


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory on /dev/shm (tmpfs), the images' usual home."""
    if fs_type(Path("/dev/shm")) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    root = Path("/dev/shm") / f"cs-direct-{os.getpid()}"
    root.mkdir(mode=0o700)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_release_into_tmpfs_goes_direct_and_round_trips_through_the_checkpoint(target: Target,
                                                                                  shm: Path) -> None:
    status = target.request({"op": "status"})
    assert status["direct"] == "on" and status["window_bytes"] == 128 * MIB, status
    dump = target.release(shm / "dump")
    assert dump.dump_path == "direct", dump.dump_path
    timings = dump.timings_s
    assert timings["direct_share"] == 1.0 and timings["dump_register_thread_s"] > 0, timings
    assert timings["dump_write_thread_s"] == 0.0, timings  # no pwrite: the device wrote the pages
    check_dump(dump, shm / "dump", content=True)  # the digests of the mapped pages are the files' (Python's)
    maps = Path(f"/proc/{target.proc.pid}/maps").read_text()
    assert str(shm) not in maps, "a dump file stayed mapped in the engine"
    zero_chunks = sum(bin(s.zero).count("1") for s in dump.segments)
    held = sum((shm / "dump" / s.file).stat().st_blocks * 512 for s in dump.segments)
    assert zero_chunks >= 2 and held <= dump.bytes - 128 * MIB, (zero_chunks, held, dump.bytes)
    checkpoint_and_restore(target.proc.pid)  # nothing registered or mapped is left for the checkpoint to refuse
    report = target.request({"op": "hydrate", "policy": "same-gpu"})["report"]
    assert report["bytes"] == dump.bytes
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}


def test_a_release_into_a_disk_directory_goes_staged_and_writes_the_same_files(target: Target, shm: Path,
                                                                               tmp_path: Path) -> None:
    candidates = [tmp_path / "dump", Path(__file__).resolve().parent.parent.parent / ".direct-test-dump"]
    disks = [d for d in candidates if fs_type(d.parent) != "tmpfs"]  # /tmp, else the checkout
    if not disks:
        pytest.skip("/tmp and the checkout are on tmpfs: no disk directory to compare with")
    disk = disks[0]
    direct = target.release(shm / "dump")
    target.request({"op": "hydrate"})
    try:
        staged = target.release(disk)
        assert staged.dump_path.startswith("staged: the dump directory is on a filesystem of type 0x"), \
            staged.dump_path
        assert staged.timings_s["direct_share"] == 0.0 and staged.timings_s["dump_write_thread_s"] > 0
        assert [s.digest for s in staged.segments] == [s.digest for s in direct.segments]
        assert [s.zero for s in staged.segments] == [s.zero for s in direct.segments]
        for s in direct.segments:
            assert filecmp.cmp(shm / "dump" / s.file, disk / s.file, shallow=False), s.file
        target.request({"op": "hydrate"})
        assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
    finally:
        shutil.rmtree(disk, ignore_errors=True)

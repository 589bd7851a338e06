"""coldsnap_probe/_shm_files.py on real processes and files: which /dev/shm files of a tree are kept, the record
checked before CRIU, and the files put back as captured (never through a link planted at their path, nothing left
beside them by a worker that dies)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe._shm_files import RECORD, load_shared_files, put_back, save_shared_files, shared_files
from coldsnap_probe.errors import WorkerError
from tests.helpers import ROOT

HOLDER = """
import mmap, os, sys, time
from multiprocessing import shared_memory
ring = shared_memory.SharedMemory(create=True, size=1 << 16, name=sys.argv[1] + "-ring")   # rw-s: kept
ring.buf[:5] = b"hello"
with open(f"/dev/shm/{sys.argv[1]}-ro", "rb") as f:                                          # r--s: not written
    ro = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
gone = os.open(f"/dev/shm/{sys.argv[1]}-gone", os.O_RDWR | os.O_CREAT, 0o600)             # unlinked: CRIU's
os.ftruncate(gone, 4096)
gone_map = mmap.mmap(gone, 4096)
os.unlink(f"/dev/shm/{sys.argv[1]}-gone")
log = os.open(f"/dev/shm/{sys.argv[1]}-log", os.O_WRONLY | os.O_CREAT, 0o600)              # written: kept
dump = os.open(f"/dev/shm/{sys.argv[1]}-dir/seg-0.bin", os.O_WRONLY | os.O_CREAT, 0o600)   # in a folder: not one
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"coldsnap-test-{secrets.token_hex(4)}"
    Path(f"/dev/shm/{name}-ro").write_bytes(b"x" * 4096)
    Path(f"/dev/shm/{name}-dir").mkdir()
    yield name
    shutil.rmtree(f"/dev/shm/{name}-dir")
    for suffix in ("ring", "ro", "gone", "log"):
        Path(f"/dev/shm/{name}-{suffix}").unlink(missing_ok=True)


def test_the_files_a_tree_maps_shared_and_writable_or_writes_are_kept_and_no_others(prefix: str) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, prefix], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)  # its resource tracker complains of the killed segment
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        assert shared_files([holder.pid]) == [f"/dev/shm/{prefix}-log", f"/dev/shm/{prefix}-ring"]
    finally:
        holder.kill()
        holder.wait()


def test_kept_files_come_back_as_captured_replacing_a_link_planted_at_their_path(tmp_path: Path, prefix: str) -> None:
    path = Path(f"/dev/shm/{prefix}-ring")
    path.write_bytes(b"captured" * 512)
    path.chmod(0o640)
    images = tmp_path / "images"
    images.mkdir()
    [saved] = save_shared_files([str(path)], images)
    assert saved.bytes == 4096 and saved.mode == 0o640 and json.loads((images / RECORD).read_text())["files"]
    path.unlink()
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    path.symlink_to(victim)  # whoever could write /dev/shm meanwhile
    put_back(load_shared_files(images), images)
    assert not path.is_symlink() and path.read_bytes() == b"captured" * 512
    assert path.stat().st_mode & 0o777 == 0o640 and victim.read_bytes() == b"untouched"
    assert [p.name for p in path.parent.glob(f"{path.name}.coldsnap-*")] == []  # nothing left beside it


@pytest.mark.parametrize("bad", ["/etc/passwd", "/dev/shm/../etc/passwd", "/dev/shm/", "/dev/shm/a/b"])
def test_a_record_naming_a_file_outside_dev_shm_refuses_the_restore(tmp_path: Path, bad: str) -> None:
    (tmp_path / RECORD).write_text(json.dumps({"format": 1, "kind": "coldsnap-shared-files", "files": [
        {"path": bad, "bytes": 1, "mode": 0o600, "uid": 0, "gid": 0, "sha256": "0" * 64}]}))
    with pytest.raises(WorkerError, match=f"{RECORD}: .*{bad!r} is not a file directly in /dev/shm/"):
        load_shared_files(tmp_path)


def test_images_without_a_record_put_nothing_back(tmp_path: Path) -> None:
    assert load_shared_files(tmp_path) == [] and save_shared_files([], tmp_path) == []
    assert os.listdir(tmp_path) == []


def test_a_record_cannot_put_back_a_set_id_file(tmp_path: Path, prefix: str) -> None:
    """review: the record's mode is the images' (a manager's image): a setuid root file in /dev/shm is never made."""
    path = Path(f"/dev/shm/{prefix}-ring")
    path.write_bytes(b"#!/bin/sh\nid\n")
    images = tmp_path / "images"
    images.mkdir()
    save_shared_files([str(path)], images)
    record = json.loads((images / RECORD).read_text())
    record["files"][0].update(mode=0o6755, uid=0, gid=0)
    (images / RECORD).write_text(json.dumps(record))
    put_back(load_shared_files(images), images)
    assert path.stat().st_mode & 0o7777 == 0o755


# A restore worker whose guard is started, stuck putting back a file: its copy in the images is a FIFO nobody writes.
STUCK_PUT_BACK = """
import os, sys
from pathlib import Path
from coldsnap_probe._shm_files import COPIES, _name, put_back, save_shared_files
from coldsnap_probe._worker_guard import WorkerGuard
path, images = sys.argv[1], Path(sys.argv[2])
images.mkdir()
saved = save_shared_files([path], images)
copy = images / COPIES / _name(path)
copy.unlink()
os.mkfifo(copy)
guard = WorkerGuard()
guard.start("restore")
put_back(saved, images, guard.note)
"""


def test_a_worker_killed_while_putting_a_file_back_leaves_nothing_beside_it(tmp_path: Path, prefix: str) -> None:
    """Regression (temporary files a worker did not journal): the file written beside the one put back goes with
    the dead worker's guard; the file at the path is as it was."""
    path = Path(f"/dev/shm/{prefix}-ring")
    path.write_bytes(b"as it was")
    run = subprocess.Popen([sys.executable, "-c", STUCK_PUT_BACK, str(path), str(tmp_path / "images")], cwd=ROOT,
                           text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = Path(f"{path}.coldsnap-{run.pid}")
    deadline = time.monotonic() + 30
    while not partial.exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate(timeout=5)
        time.sleep(0.005)
    run.kill()
    _out, err = run.communicate(timeout=30)
    assert "restore guard: the worker died" in err, err
    assert not partial.exists() and path.read_bytes() == b"as it was"

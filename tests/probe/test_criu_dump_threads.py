"""CRIU's dump by threads (third_party/criu/dump-threads.patch, docs/criu-dump-threads.md) on the CPU: what it writes
is what stock CRIU's path writes and restores, and a fault fails it cleanly. The CRIU and the helpers are
test_criu_restore.py's (scripts/criu/build's CRIU; skipped only where it was never built or not as root)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.criu import CRIU, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_criu_restore import bare_dump, end, pages_of_zeros, verified, wait_file, worker

pytestmark = pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
MIB = 1 << 20


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


@pytest.fixture
def mounted() -> Iterator[Callable[..., Path]]:
    """mounted(path, kind, *options, source=kind): a filesystem of `kind` mounted at `path` (made) until the test
    ends."""
    mounts: list[Path] = []

    def mount(path: Path, kind: str, *options: str, source: str = "") -> Path:
        path.mkdir()
        subprocess.run(["mount", "-t", kind, *(["-o", ",".join(options)] if options else []), source or kind,
                        str(path)], check=True)
        mounts.append(path)
        return path
    try:
        yield mount
    finally:
        for path in mounts:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def test_pages_dumped_by_threads_are_stock_criu_s_bytes_and_restore(tmp_path: Path, criu: str,
                                                                     mounted: Callable[..., Path]) -> None:
    """dump-threads.patch (issue 35 item 3): N threads read the pages straight into pages.img; the images hold the
    bytes stock CRIU's one-thread path writes (pages of zeros left out alike), in the same order (but the page
    holding the thread's rseq area), and a restore of them brings every byte back. On a filesystem that reserves
    no room (ramfs: no fallocate) the threads write the same bytes instead of mapping the image. A bad thread count
    fails the dump before anything is seized or written; unset, the CPUs CRIU may use decide (the stock path below
    4)."""
    control = tmp_path / "control"
    control.mkdir()
    ramfs = mounted(tmp_path / "ramfs", "ramfs")
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control), "--mib",
                               "24", "--thp-mib", "8", "--zero-mib", "16", "--file-mib", "8", "--shared-mib", "4"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    pid = int(wait_file(control / "ready"))
    try:
        refused = bare_dump(criu, pid, tmp_path / "refused", "skip", "lots")
        assert refused.returncode != 0
        refusal = (tmp_path / "refused/dump.log").read_text()
        assert "CRIU_DUMP_THREADS=lots: must be a whole number from 1 to 64" in refusal
        assert not list((tmp_path / "refused").glob("*.img"))
        os.kill(pid, signal.SIGSTOP)  # the dumps see the same memory
        for images, threads in ((tmp_path / "1", "1"), (tmp_path / "4", "4"), (ramfs / "4", "4"),
                                (tmp_path / "unset", "")):
            done = bare_dump(criu, pid, images, "skip", threads)
            assert done.returncode == 0, (images / "dump.log").read_text()[-2000:]
    finally:
        os.kill(pid, signal.SIGKILL)
        target.wait()
    log, written = (tmp_path / "4/dump.log").read_text(), (ramfs / "4/dump.log").read_text()
    assert f"dump-threads: {pid}: " in log and " pages by 4 threads, " in log and "reserves no room" not in log
    assert "dump-threads: pages.img's filesystem reserves no room (fallocate): the threads write it" in written
    assert " pages by 4 threads, " in written
    assert "dump-threads: " not in (tmp_path / "1/dump.log").read_text()  # 1: stock CRIU's parasite and pipes
    cpus, unset = len(os.sched_getaffinity(0)), (tmp_path / "unset/dump.log").read_text()
    if cpus < 4:  # unset: the CPUs CRIU may use, the stock path below 4 (it beat 2 threads on 2 CPUs)
        assert "dump-threads: " not in unset
    else:
        assert f" pages by {min(cpus, 64)} threads, " in unset
    pages = sorted(p.name for p in (tmp_path / "1").glob("pages-*.img"))
    assert pages == sorted(p.name for p in (tmp_path / "4").glob("pages-*.img")) and pages
    for name in pages:  # the kernel writes the CPU a task last ran on into its rseq area: the parasite ran it
        one, four, ram = ((d / name).read_bytes() for d in (tmp_path / "1", tmp_path / "4", ramfs / "4"))
        assert len(one) == len(four) == len(ram), name
        assert sum(one[at:at + 4096] != four[at:at + 4096] for at in range(0, len(one), 4096)) <= 1, name
        assert sum(one[at:at + 4096] != ram[at:at + 4096] for at in range(0, len(one), 4096)) <= 1, name
    assert pages_of_zeros(tmp_path / "4")[1] == 649  # only the file mapping's private pages of zeros are kept
    done = subprocess.run([criu, "restore", "--images-dir", str(tmp_path / "4"), "--restore-detached", "-v4",
                           "--log-file", "restore.log"], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, (tmp_path / "4/restore.log").read_text()[-2000:]
    try:
        os.kill(pid, signal.SIGCONT)  # dumped stopped, so restored stopped
        assert verified(control)["ok"]
    finally:
        end(control, pid)


def fill_once_sized(images: Path, filler: Path, stop: threading.Event) -> None:
    """Fills what is left of the filesystem of `images` as soon as a pages image there has its size (another
    writer, between the dump's sizing of pages.img and its copy): woken by inotify as the size is set."""
    libc = ctypes.CDLL(None, use_errno=True)
    while not images.is_dir():
        if stop.wait(0.001):
            return
    watch = libc.inotify_init1(os.O_NONBLOCK)
    assert watch >= 0 and libc.inotify_add_watch(watch, bytes(images), 0x2) >= 0  # IN_MODIFY
    try:
        while not any(p.stat().st_size for p in images.glob("pages-*.img")):
            if stop.is_set():
                return
            select.select([watch], [], [], 0.05)
            with contextlib.suppress(BlockingIOError):
                os.read(watch, 65536)
    finally:
        os.close(watch)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # a MiB at a time (a call that finds no room takes none), leaving a MiB for the dump's other images
        size = 0
        while (free := os.statvfs(images)).f_bavail * free.f_frsize > 2 * MIB:
            os.posix_fallocate(fd, size, MIB)
            size += MIB
    except OSError:  # the room was taken meanwhile
        pass
    finally:
        os.close(fd)


def test_a_full_images_filesystem_fails_the_threads_dump_naming_it_and_the_process_runs_on(
        tmp_path: Path, criu: str, mounted: Callable[..., Path]) -> None:
    """dump-threads.patch: pages.img is written through a mapping, where a full tmpfs fails each copy (EFAULT): its
    room is reserved first (fallocate). Where there is too little, the dump is refused before any copy, naming the
    room it needs, keeping nothing of the reservation, and the process goes on as it was. Where there is enough, a
    writer filling the filesystem once pages.img is sized (between a check and the copy) takes what is left and
    the dump succeeds (review 11: it used to fail)."""
    control = tmp_path / "control"
    control.mkdir()
    small = mounted(tmp_path / "small", "tmpfs", "size=16m")
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control), "--mib",
                               "32"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        pid = int(wait_file(control / "ready"))
        done = bare_dump(criu, pid, small / "images", "skip", "4")
        assert done.returncode != 0
        refused = re.search(r"pages\.img needs (\d+) bytes, its filesystem has \d+ free: No space left on device",
                            (small / "images/dump.log").read_text())
        assert refused
        assert [p.stat().st_size for p in (small / "images").glob("pages-*.img")] == [0]  # the room given back
        assert verified(control)["ok"]  # unfrozen, its memory as it was
        # The capture worker's dump the same: it fails naming the room, leaves nothing of the images but CRIU's
        # log, and the tree runs on.
        images = small / "worker"
        images.mkdir()
        done = worker("capture", "--pid", str(pid), "--images", str(images), "--boundary", "n580", "--criu", criu,
                      env={"CRIU_DUMP_THREADS": "4"})
        assert done.returncode != 0 and "phase criu-dump" in done.stderr, done.stderr
        assert re.search(r"pages\.img needs \d+ bytes, its filesystem has \d+ free", done.stderr), done.stderr[-3000:]
        assert [p.name for p in images.iterdir()] == ["dump.log"]
        assert verified(control)["ok"]
        # Room for pages.img and 6 MiB more: the writer leaves 1-2 MiB of it (the dump's other images fit)
        roomy = mounted(tmp_path / "roomy", "tmpfs", f"size={int(refused[1]) + 6 * MIB}")
        stop = threading.Event()
        filler = threading.Thread(target=fill_once_sized, args=(roomy / "images", roomy / "filler", stop))
        filler.start()
        try:
            done = bare_dump(criu, pid, roomy / "images", "skip", "4")
        finally:
            stop.set()
            filler.join()
        log = (roomy / "images/dump.log").read_text()
        assert done.returncode == 0, log[-2000:]
        room = os.statvfs(roomy)
        assert (roomy / "filler").stat().st_size > 0 and room.f_bavail * room.f_frsize <= 2 * MIB  # it took the rest
        assert re.search(rf"dump-threads: {pid}: (\d+) pages by 4 threads", log)
        assert verified(control)["ok"]
    finally:
        (control / "exit").touch()
        target.wait()


def test_a_full_filesystem_that_reserves_no_room_fails_the_written_dump_naming_the_write(
        tmp_path: Path, criu: str, mounted: Callable[..., Path]) -> None:
    """dump-threads.patch: where `fallocate` is not supported (ext2: EOPNOTSUPP) the threads write pages.img
    (pwrite) instead of mapping it, so a full disk there is the write's ENOSPC, named with the offset, and the
    process goes on as it was."""
    if not Path("/dev/loop-control").exists() or not shutil.which("mkfs.ext2"):
        pytest.skip("needs loop devices and mkfs.ext2 (a filesystem without fallocate)")
    image = tmp_path / "ext2.img"
    with open(image, "wb") as out:
        out.truncate(16 * MIB)
    subprocess.run(["mkfs.ext2", "-q", "-F", str(image)], check=True)
    try:
        small = mounted(tmp_path / "ext2", "ext2", "loop", source=str(image))
    except subprocess.CalledProcessError:  # no loop device free or allowed (a container)
        pytest.skip("cannot mount a loop device here (a filesystem without fallocate)")
    control = tmp_path / "control"
    control.mkdir()
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control), "--mib",
                               "32"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        pid = int(wait_file(control / "ready"))
        (small / "images").mkdir()
        work = tmp_path / "work"  # CRIU's log off the full filesystem, whole
        work.mkdir()
        done = subprocess.run([criu, "dump", "--tree", str(pid), "--images-dir", str(small / "images"),
                               "--work-dir", str(work), "--leave-running", "-v4", "--log-file", "dump.log"],
                              capture_output=True, text=True, check=False, timeout=120,
                              env={**os.environ, "CRIU_DUMP_THREADS": "4", "CRIU_DUMP_ZERO_PAGES": "skip"})
        log = (work / "dump.log").read_text()
        assert done.returncode != 0
        assert "pages.img's filesystem reserves no room (fallocate): the threads write it" in log
        assert re.search(r"Can't write pages\.img at offset \d+: No space left on device", log), log[-2000:]
        assert verified(control)["ok"]
    finally:
        (control / "exit").touch()
        target.wait()

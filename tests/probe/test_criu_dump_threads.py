"""CRIU's dump by threads (third_party/criu/dump-threads.patch, docs/criu-dump-threads.md) on the CPU: what it writes
is what stock CRIU's path writes and restores, and a fault fails it cleanly. The CRIU and the helpers are
test_criu_restore.py's (scripts/criu/build's CRIU; skipped only where it was never built or not as root)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.criu import CRIU, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_criu_restore import bare_dump, end, pages_of_zeros, verified, wait_file

pytestmark = pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


def test_pages_dumped_by_threads_are_stock_criu_s_bytes_and_restore(tmp_path: Path, criu: str) -> None:
    """dump-threads.patch (issue 35 item 3): N threads read the pages straight into pages.img; the images hold the
    bytes stock CRIU's one-thread path writes (pages of zeros left out alike), in the same order (but the page
    holding the thread's rseq area), and a restore of them brings every byte back. A bad thread count fails the
    dump before anything is seized or written."""
    control = tmp_path / "control"
    control.mkdir()
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
        os.kill(pid, signal.SIGSTOP)  # both dumps see the same memory
        for threads in ("1", "4"):
            done = bare_dump(criu, pid, tmp_path / threads, "skip", threads)
            assert done.returncode == 0, (tmp_path / threads / "dump.log").read_text()[-2000:]
    finally:
        os.kill(pid, signal.SIGKILL)
        target.wait()
    log = (tmp_path / "4/dump.log").read_text()
    assert f"dump-threads: {pid}: " in log and " pages by 4 threads, " in log
    assert "dump-threads: " not in (tmp_path / "1/dump.log").read_text()  # 1: stock CRIU's parasite and pipes
    pages = sorted(p.name for p in (tmp_path / "1").glob("pages-*.img"))
    assert pages == sorted(p.name for p in (tmp_path / "4").glob("pages-*.img")) and pages
    for name in pages:  # the kernel writes the CPU a task last ran on into its rseq area: the parasite ran it
        one, four = (tmp_path / "1" / name).read_bytes(), (tmp_path / "4" / name).read_bytes()
        assert len(one) == len(four), name
        assert sum(one[at:at + 4096] != four[at:at + 4096] for at in range(0, len(one), 4096)) <= 1, name
    assert pages_of_zeros(tmp_path / "4")[1] == 649  # only the file mapping's private pages of zeros are kept
    done = subprocess.run([criu, "restore", "--images-dir", str(tmp_path / "4"), "--restore-detached", "-v4",
                           "--log-file", "restore.log"], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, (tmp_path / "4/restore.log").read_text()[-2000:]
    try:
        os.kill(pid, signal.SIGCONT)  # dumped stopped, so restored stopped
        assert verified(control)["ok"]
    finally:
        end(control, pid)


def test_a_full_images_filesystem_fails_the_threads_dump_naming_it_and_the_process_runs_on(tmp_path: Path,
                                                                                             criu: str) -> None:
    """dump-threads.patch: pages.img is written through a mapping, where a full tmpfs fails each copy: the dump is
    refused before any, naming the room it needs, and the process goes on as it was."""
    control, small = tmp_path / "control", tmp_path / "small"
    control.mkdir()
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], check=True)
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control), "--mib",
                               "32"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        pid = int(wait_file(control / "ready"))
        done = bare_dump(criu, pid, small / "images", "skip", "4")
        assert done.returncode != 0
        assert re.search(r"pages\.img needs \d+ bytes, its filesystem has \d+ free: No space left on device",
                         (small / "images/dump.log").read_text())
        assert verified(control)["ok"]  # unfrozen, its memory as it was
    finally:
        (control / "exit").touch()
        target.wait()
        subprocess.run(["umount", str(small)], check=True)

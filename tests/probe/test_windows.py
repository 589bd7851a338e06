"""Registered windows (`_windows.py`, the copy engine's `Registered` reader): the window plan, which filesystem goes
to the ring before anything is pinned (real tmpfs mounts, huge=always and huge=never), the rate that sends the
rest to it, the reader a hydrator's `--stage-reader` picks, and the SIGBUS guard with real truncated files (pinned
on the CPU with mlock, the kernel's own page lock through get_user_pages, as cuMemHostRegister pins). The GPU
tests run a real hydrator: a stage from registered windows (a file of several windows, a chunk of zeros) adopted
with the files' bytes, `auto` on a tmpfs of 4 KiB pages reading through the ring, and a dump truncated while it is
staged (the hydrator answers and lives on)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration.__main__ import main
from coldsnap_probe.hydration._copy import Pread, Registered, miss_reader
from coldsnap_probe.hydration._digests import DIGEST_CHUNK
from coldsnap_probe.hydration._windows import (
    MIN_PIN_RATE,
    WINDOW,
    check_whole,
    in_page_cache,
    map_window,
    plan_windows,
    ring_reason,
    slow_pin,
)
from tests.helpers import ROOT
from tests.probe._staged import stage_and_read
from tests.probe.test_main import has_nvidia_driver

MIB = 1 << 20
KEY = "sha256:" + hashlib.sha256(b"registered-windows").hexdigest()


@contextlib.contextmanager
def tmpfs(huge: str) -> Iterator[Path]:
    """A real tmpfs of 64 MiB mounted with `huge=huge`, unmounted after."""
    with tempfile.TemporaryDirectory(prefix="cs-windows-") as point:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64m,huge={huge}", "cs-windows-test", point], check=True)
        try:
            yield Path(point)
        finally:
            subprocess.run(["umount", point], check=True)


class TestPlan:
    def test_pieces_are_cut_at_window_multiples_of_the_file_and_grouped_per_file_in_order(self) -> None:
        pieces = [(0, "/b", 0, 12 * MIB), (100 * MIB, "/a", 4 * MIB, 2 * MIB), (200 * MIB, "/b", 14 * MIB, 2 * MIB)]
        windows = plan_windows(pieces, 8 * MIB)
        assert [(w.source, w.runs) for w in windows] == [
            ("/b", ((0, 8 * MIB),)), ("/b", ((8 * MIB, 4 * MIB), (14 * MIB, 2 * MIB))), ("/a", ((4 * MIB, 2 * MIB),))]
        # every byte copied once, from the same file offset to the same device address
        assert sorted(p for w in windows for p in w.pieces) == sorted([
            (0, "/b", 0, 8 * MIB), (8 * MIB, "/b", 8 * MIB, 4 * MIB), (200 * MIB, "/b", 14 * MIB, 2 * MIB),
            (100 * MIB, "/a", 4 * MIB, 2 * MIB)])

    def test_a_window_pins_whole_pages_around_unaligned_pieces(self) -> None:
        (window,) = plan_windows([(0, "/a", 5000, 3000), (9000, "/a", 9000, 100)], WINDOW)
        assert window.runs == ((4096, 8192),)  # 5000..8000 and 9000..9100 on the pages 4096..12288

    @pytest.mark.parametrize("size", [0, -4096, 4097], ids=["zero", "negative", "not-pages"])
    def test_a_window_that_is_not_whole_pages_is_refused_naming_the_rule(self, size: int) -> None:
        with pytest.raises(HydrationError, match=f"a window must be a positive multiple of 4096 bytes, not {size}"):
            plan_windows([(0, "/a", 0, MIB)], size)


class TestFallbackChoice:
    def test_a_tmpfs_of_small_pages_goes_to_the_ring_and_one_of_huge_pages_is_pinned(self, tmp_path: Path) -> None:
        """Pinning 8 GiB of a 4 KiB-page tmpfs took 2.6 s on the H200 (the ring is faster there); a huge=always
        tmpfs has 2 MiB pages and a disk's page cache large folios: those are tried (then timed)."""
        for huge, expected in (("never", "tmpfs of 4 KiB pages"), ("always", ""), ("within_size", "")):
            with tmpfs(huge) as point:
                (point / "seg").write_bytes(b"x" * MIB)
                fd = os.open(point / "seg", os.O_RDONLY)
                try:
                    assert ring_reason(fd) == expected, huge
                finally:
                    os.close(fd)
        (tmp_path / "seg").write_bytes(b"x" * MIB)
        fd = os.open(tmp_path / "seg", os.O_RDONLY)
        try:
            assert ring_reason(fd) == ""  # not a tmpfs: the first window's timing decides
        finally:
            os.close(fd)

    def test_a_window_not_wholly_in_the_page_cache_is_told_apart_without_reading_it(self, tmp_path: Path) -> None:
        """A cold file (issue 34: a capture pulled to a disk, its cache dropped) would be faulted in a page at a
        time by the pinning: mincore says so first, and reading it does not count as having read it."""
        path = tmp_path / "seg-0.bin"
        path.write_bytes(os.urandom(8 * MIB))
        fd = os.open(path, os.O_RDONLY)
        try:
            (window,) = plan_windows([(0, str(path), 0, 8 * MIB)], WINDOW)
            cases = []
            for step in ("written", "dropped", "half read", "read"):
                if step == "dropped":
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                elif step != "written":
                    os.pread(fd, 4 * MIB if step == "half read" else 8 * MIB, 0)
                mapped = map_window(fd, window)
                cases.append((step, in_page_cache(mapped)))
                mapped.close(None)
            assert cases == [("written", True), ("dropped", False), ("half read", False), ("read", True)]
        finally:
            os.close(fd)

    def test_a_window_pinned_below_the_rate_sends_its_filesystem_to_the_ring(self) -> None:
        size = 512 * MIB
        assert slow_pin(size, size / MIN_PIN_RATE * 0.9) == ""
        assert "the ring is faster" in slow_pin(size, size / MIN_PIN_RATE * 1.1)
        assert slow_pin(MIB, 1.0) == ""  # too small to judge: the driver call's own cost would decide

    def test_the_stage_reader_option_picks_the_ring_registered_windows_or_both(self) -> None:
        ring = Pread(threads=2, chunk=MIB)
        assert miss_reader("ring", {}, ring) is ring
        auto, forced = miss_reader("auto", {"/a": 3}, ring), miss_reader("registered", {"/a": 3}, ring)
        assert isinstance(auto, Registered) and auto.measure and auto.fallback is ring and auto.opened == {"/a": 3}
        assert isinstance(forced, Registered) and not forced.measure
        with pytest.raises(HydrationError, match="a stage reader is one of auto, ring, registered, not 'fast'"):
            miss_reader("fast", {}, ring)

    def test_serve_refuses_an_unknown_stage_reader_naming_the_option(self, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--staging", "--socket", str(tmp_path / "h.sock"), "--stage-reader", "fast"])
        assert exited.value.code == 2
        assert "argument --stage-reader: invalid choice: 'fast'" in capsys.readouterr().err
        assert not (tmp_path / "h.sock").exists()


_TRUNCATED = r"""
import ctypes, os, sys
from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration._windows import Window, check_whole, map_window
libc = ctypes.CDLL(None, use_errno=True)
libc.mlock.argtypes = libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
path, size = sys.argv[1], 8 << 20
fd = os.open(path, os.O_RDWR)
window = Window(path, ((0, size),), ((0, path, 0, size),))
# 1. Truncated after it was mapped, before it is pinned: the kernel's pinning fails, no signal reaches us.
mapped = map_window(fd, window)
os.ftruncate(fd, size // 2)
print("pin of a truncated mapping:", "refused" if libc.mlock(mapped.address, size) else "pinned")
mapped.close(None)
# 2. Truncated below what the stage reads before it is mapped: refused, naming the file.
try:
    map_window(fd, window)
except HydrationError as exc:
    print("map:", exc)
# 3. Pinned, then truncated: unpinned and unmapped without a touch; the size check names the file.
os.ftruncate(fd, size)
mapped = map_window(fd, window)
assert libc.mlock(mapped.address, size) == 0
os.ftruncate(fd, 0)
libc.munlock(mapped.address, size)
mapped.close(None)
try:
    check_whole({path: fd}, {path: size})
except HydrationError as exc:
    print("check:", exc)
"""


class TestTruncation:
    """A dump file is its peer's: truncated while the hydrator reads it, it must cost the hydrator nothing (a
    SIGBUS there would end every tenant's stages). A real process, real truncations, the kernel's own pinning."""

    @pytest.mark.parametrize("where", ["disk", "tmpfs"])
    def test_a_truncated_file_is_refused_or_named_never_a_sigbus(self, tmp_path: Path, where: str) -> None:
        with contextlib.ExitStack() as stack:
            directory = stack.enter_context(tmpfs("always")) if where == "tmpfs" else tmp_path
            path = directory / "seg-0.bin"
            path.write_bytes(os.urandom(8 * MIB))
            done = subprocess.run([sys.executable, "-c", _TRUNCATED, str(path)], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60, check=False)
        assert done.returncode == 0, (done.returncode, done.stderr)  # -7: SIGBUS
        assert done.stdout.splitlines() == [
            "pin of a truncated mapping: refused",
            f"map: source {path} holds {4 * MIB} bytes: its stage reads to {8 * MIB}",
            f"check: source {path} ended at 0 while its stage read to {8 * MIB}"], done.stdout

    def test_a_window_is_mapped_only_within_the_size_the_descriptor_has(self, tmp_path: Path) -> None:
        path = tmp_path / "seg"
        path.write_bytes(b"x" * (MIB + 100))  # the last page partly beyond the file's end
        fd = os.open(path, os.O_RDONLY)
        try:
            (window,) = plan_windows([(0, str(path), 0, MIB + 100)], WINDOW)
            assert window.runs == ((0, MIB + 4096),)
            mapped = map_window(fd, window)
            assert mapped.size == MIB + 100 and mapped.ranges == ((0, MIB + 100),)
            mapped.close(None)
            check_whole({str(path): fd}, {str(path): MIB + 100})  # whole: nothing raised
        finally:
            os.close(fd)


def _dump(path: Path, chunks: int, zero: int = 0) -> bytes:
    """A dump file of `chunks` DIGEST_CHUNKs, those `zero` marks left holes (as the interposer writes them)."""
    with path.open("wb") as f:
        f.truncate(chunks * DIGEST_CHUNK)
        for chunk in range(chunks):
            if not zero >> chunk & 1:
                f.seek(chunk * DIGEST_CHUNK)
                f.write(os.urandom(DIGEST_CHUNK))
    return path.read_bytes()


@contextlib.contextmanager
def hydrator(tmp_path: Path, reader: str) -> Iterator[tuple[subprocess.Popen[bytes], str, dict[str, object]]]:
    control = str(tmp_path / f"{reader}.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--stage-reader", reader], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        yield proc, control, json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_stage_from_registered_windows_holds_the_files_bytes(tmp_path: Path) -> None:
    """The real hydrator, `--stage-reader registered`: a file of several windows (one chunk of zeros, set on the
    device) and a small one, staged with no ring (`reader: registered`, nothing to the fallback), adopted with the
    files' bytes. Prints the answer's rate and pin seconds."""
    first = _dump(tmp_path / "seg-0.bin", WINDOW // DIGEST_CHUNK + 2, zero=0b10)
    second = _dump(tmp_path / "seg-1.bin", 1)
    parts = [{"file": str(tmp_path / "seg-0.bin"), "bytes": len(first), "region": 0, "zero": 0b10},
             {"file": str(tmp_path / "seg-1.bin"), "bytes": len(second), "region": 0}]
    with hydrator(tmp_path, "registered") as (_proc, control, ready):
        staged, held = stage_and_read(None, control, KEY, parts, str(ready["device_uuid"]))
    assert held == first + second
    assert staged["reader"] == "registered" and staged["zero_bytes"] == DIGEST_CHUNK, staged
    copy = staged["copy"]
    assert copy["ring_bytes"] == 0 and copy["registered_bytes"] == len(first) + len(second) - DIGEST_CHUNK, copy
    assert copy["windows"] == 3 and staged["pin_s"] > 0, copy
    print(json.dumps({"registered_windows": {k: staged[k] for k in ("reader", "reader_gbps", "pin_s", "copy_s")}}))


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_auto_reads_a_tmpfs_of_small_pages_through_the_ring_and_a_huge_one_from_windows(tmp_path: Path) -> None:
    """The real hydrator, `--stage-reader auto` (the default): a dump on a huge=never tmpfs is read through the ring
    without pinning a page (`fallback` says why), one on a huge=always tmpfs from registered windows."""
    with hydrator(tmp_path, "auto") as (_proc, control, ready):
        assert ready["stage_reader"] == "auto", ready
        for huge, reader in (("never", "ring"), ("always", "registered")):
            with tmpfs(huge) as point:
                (point / "seg-0.bin").write_bytes(data := os.urandom(32 * MIB))
                parts = [{"file": str(point / "seg-0.bin"), "bytes": len(data), "region": 0}]
                staged, held = stage_and_read(None, control, KEY, parts, str(ready["device_uuid"]))
            assert held == data and staged["reader"] == reader, (huge, staged)
            if reader == "ring":
                assert staged["copy"]["fallback"] == "tmpfs of 4 KiB pages", staged


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_dump_truncated_while_it_is_staged_costs_the_hydrator_nothing(tmp_path: Path) -> None:
    """Its owner truncates a dump file while the hydrator stages it from registered windows: the stage either
    read it whole first or fails naming the file; the hydrator lives on, and stages an intact dump afterwards."""
    from coldsnap_probe.jsonline import request

    victim, intact = tmp_path / "victim.bin", tmp_path / "intact.bin"
    _dump(victim, 2 * WINDOW // DIGEST_CHUNK)
    data = _dump(intact, 1)
    with hydrator(tmp_path, "registered") as (proc, control, ready):
        cut = threading.Timer(0.05, os.truncate, (victim, 0))
        cut.start()
        answer = request(control, {"op": "stage-dump", "key": KEY, "device_uuid": ready["device_uuid"],
                                   "parts": [{"file": str(victim), "bytes": 2 * WINDOW, "region": 0}]}, timeout=60.0)
        cut.join()
        assert answer["ok"] or str(victim) in answer["error"], answer
        time.sleep(0.2)
        assert proc.poll() is None  # not killed by a SIGBUS
        staged, held = stage_and_read(None, control, KEY, [{"file": str(intact), "bytes": len(data), "region": 0}],
                                      str(ready["device_uuid"]))
    assert held == data, staged

"""The node hydrator's device tier (`_device_tier.DeviceTier`, `serve --device-tier-bytes`): a dump staged once is
kept on the hydrator's GPU and the next stage of the same files is a copy within the GPU (`tier: device`), its bytes
the files' even after the engine wrote over what it adopted; a file rewritten is a miss; a dump larger than the
budget is not kept; files removed free the entry at the next idle call; the option's refusals. The real hydrator
on a real GPU (the tier holds device memory: nothing here runs without one but the option checks)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe.hydration import _device_tier
from coldsnap_probe.hydration.__main__ import main
from coldsnap_probe.hydration._device_tier import DeviceTier, _Entry
from coldsnap_probe.hydration._ram_tier import identity
from tests.helpers import ROOT
from tests.probe._staged import stage_and_read
from tests.probe.test_main import has_nvidia_driver

MIB = 1 << 20
KEY = "sha256:" + hashlib.sha256(b"device-tier").hexdigest()


def dump(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


@pytest.fixture
def hydrator(tmp_path: Path) -> Iterator[Any]:
    """Start a staging hydrator with the given device tier budget (no RAM tier): (its socket, its ready line)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(budget: str) -> tuple[str, dict[str, Any]]:
        control = str(tmp_path / f"hydrator-{len(procs)}.sock")
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                                 "--staging", "--device-tier-bytes", budget], stdout=subprocess.PIPE, cwd=ROOT)
        procs.append(proc)
        return control, json.loads(proc.stdout.readline())  # type: ignore[union-attr]
    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def status(control: str) -> dict[str, Any]:
    from coldsnap_probe.jsonline import request

    return request(control, {"op": "status"}, timeout=10.0)


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_the_next_stage_of_a_kept_dump_is_a_copy_within_the_gpu_with_the_files_bytes(tmp_path: Path,
                                                                                      hydrator: Any) -> None:
    """Stage 1 reads the files (`disk`) and keeps them; stage 2 is a `device` hit with the files' bytes although the
    engine wrote over the allocation stage 1 handed it; a file rewritten in place is a miss again (its new bytes);
    the files removed, the entry goes at the next idle call. Prints each stage's seconds."""
    first, second = dump(tmp_path / "seg-0.bin", 256 * MIB), dump(tmp_path / "seg-1.bin", 64 * MIB)
    parts = [{"file": str(first), "bytes": 256 * MIB, "region": 0},
             {"file": str(second), "bytes": 64 * MIB, "region": 0}]
    control, ready = hydrator("1G")
    assert ready["device_tier_bytes"] == 1 << 30, ready
    from coldsnap_probe._cuda import Driver

    driver = Driver()
    driver.context(0)
    expected = first.read_bytes() + second.read_bytes()
    cold, cold_bytes = stage_and_read(driver, control, KEY, parts, ready["device_uuid"], scribble=True)
    assert cold["tier"] == "disk" and cold_bytes == expected, cold
    tier = status(control)["device_tier"]
    assert (tier["entries"], tier["bytes"], tier["kept"], tier["misses"]) == (1, 320 * MIB, 1, 1), tier
    hot, hot_bytes = stage_and_read(driver, control, KEY, parts, ready["device_uuid"], scribble=True)
    assert hot["tier"] == "device" and hot_bytes == expected, hot  # not the engine's scribbles
    again, again_bytes = stage_and_read(driver, control, KEY, parts, ready["device_uuid"])
    assert again["tier"] == "device" and again_bytes == expected, again
    answer = status(control)
    assert (answer["device_tier"]["hits"], answer["device_tier"]["in_use"]) == (2, 0), answer
    # The daemon's metrics read the device tier's stages beside the RAM tier's (coldsnap_provider/_hydrator_stages).
    assert answer["ram_tier"]["stages"]["device"] == 2, answer
    assert answer["ram_tier"]["read_bytes"]["device"] == 2 * 320 * MIB, answer
    with open(second, "r+b") as f:  # rewritten in place: another mtime and ctime, another identity
        f.write(b"\x01" * 4096)
    changed, changed_bytes = stage_and_read(driver, control, KEY, parts, ready["device_uuid"])
    assert changed["tier"] == "disk" and changed_bytes == first.read_bytes() + second.read_bytes(), changed
    first.unlink()
    second.unlink()
    deadline = time.monotonic() + 10
    while (tier := status(control)["device_tier"])["entries"]:
        assert time.monotonic() < deadline, tier
        time.sleep(0.1)
    assert tier["dropped"] == 2, tier
    print(json.dumps({"device_tier_gpu": {name: {k: stage[k] for k in ("stage_s", "copy_s", "bytes")}
                                          for name, stage in (("disk", cold), ("device", hot))}}))


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_dump_larger_than_the_budget_is_staged_and_not_kept(tmp_path: Path, hydrator: Any) -> None:
    path = dump(tmp_path / "seg-0.bin", 64 * MIB)
    parts = [{"file": str(path), "bytes": 64 * MIB, "region": 0}]
    control, ready = hydrator("32M")
    for _ in range(2):
        staged, data = stage_and_read(None, control, KEY, parts, ready["device_uuid"])
        assert staged["tier"] == "disk" and data == path.read_bytes(), staged
    tier = status(control)["device_tier"]
    assert (tier["entries"], tier["skipped"]["too_large"], tier["hits"]) == (0, 2, 0), tier


class TestPeersDescriptors:
    """An entry's descriptors are its peer's files, maybe on the peer's own FUSE mount, where fstat and close wait
    for the peer: only the tier's files thread touches them, so a filesystem that never answers holds no lock, no
    connection and not the accept thread (the idle call). The tier here holds no device memory (its entries are
    made as `_keep` makes them, without their allocations), so it runs without a GPU."""

    @staticmethod
    def kept(tier: DeviceTier, path: Path) -> int:
        fd = os.open(path, os.O_RDONLY)
        tier._entries[("dump", str(path))] = _Entry(1000, 2 * MIB, fds={str(path): fd}, ids={str(path): identity(fd)},
                                                   used=time.monotonic(), ready=True)
        return fd

    @staticmethod
    def within(seconds: float, call: Any) -> None:
        """`call()` returns within `seconds` (on a thread: a wait there must not hang the test)."""
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        thread.join(seconds)
        assert not thread.is_alive(), f"{call} waited for the peer's filesystem"

    def test_a_filesystem_that_never_answers_holds_neither_the_idle_call_nor_make_room_nor_status(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        tier = DeviceTier(1 << 30, driver=None, context=None, total=2 << 30, reserve=1 << 30, streams=1)
        self.kept(tier, dump(tmp_path / "seg-0.bin", 4096))
        answers, asked = threading.Event(), threading.Event()
        real = _device_tier._stale

        def stale(entry: Any) -> bool:  # an fstat a FUSE daemon does not answer, until `answers`
            asked.set()
            answers.wait(30)
            return real(entry)
        monkeypatch.setattr(_device_tier, "_stale", stale)
        try:
            self.within(5, tier.prune)
            assert asked.wait(5)  # the files thread is in the fstat now
            self.within(5, tier.prune)  # a second idle call queues no second check
            self.within(5, lambda: tier.make_room(1))
            assert tier.status()["entries"] == 0 and tier.status()["closing"] == 1, tier.status()
        finally:
            answers.set()
        deadline = time.monotonic() + 5
        while tier.status()["closing"]:  # closed once the check let go of it
            assert time.monotonic() < deadline, tier.status()
            time.sleep(0.01)
        assert tier.status()["evictions"] == 1 and tier.status()["dropped"] == 0, tier.status()

    def test_an_entry_whose_file_was_removed_is_dropped_by_the_files_thread_after_the_idle_call(
            self, tmp_path: Path) -> None:
        tier = DeviceTier(1 << 30, driver=None, context=None, total=2 << 30, reserve=1 << 30, streams=1)
        path = dump(tmp_path / "seg-0.bin", 4096)
        self.kept(tier, path)
        self.kept(tier, dump(tmp_path / "seg-1.bin", 4096))
        path.unlink()
        tier.prune()
        deadline = time.monotonic() + 5
        while (status := tier.status())["entries"] != 1 or status["closing"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.01)
        assert status["dropped"] == 1, status


class TestOptions:
    def test_a_budget_without_staging_is_refused(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--socket", str(tmp_path / "h.sock"), "--device-tier-bytes", "1G"])
        assert exited.value.code == 2
        assert "argument --device-tier-bytes: only with --staging" in capsys.readouterr().err

    @pytest.mark.parametrize("value", ["lots", "-1", "1.5G"])
    def test_a_bad_budget_is_refused_naming_the_option_before_anything_starts(
            self, tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]) -> None:
        sock = tmp_path / "h.sock"
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--staging", "--socket", str(sock), f"--device-tier-bytes={value}"])
        assert exited.value.code == 2 and not sock.exists()
        err = capsys.readouterr().err
        assert "argument --device-tier-bytes: must be a positive size" in err, err

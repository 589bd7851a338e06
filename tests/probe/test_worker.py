"""The capture/restore worker: argument and audit paths everywhere; the real thing on a GPU host."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe._host import DEVICE_SELECTOR_ENV, nvml_identity
from coldsnap_probe._process import anonymous_memory, audit_pre_cuda, process_age_s
from coldsnap_probe._target import check_target, comparable
from coldsnap_probe._worker import image_digest, process_tree
from coldsnap_probe.errors import TargetRefused, WorkerError
from tests.helpers import ROOT
from tests.probe.test_main import has_nvidia_driver


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=280)


def test_capture_refuses_a_non_empty_images_directory(tmp_path: Path) -> None:
    (tmp_path / "old.img").write_text("x")
    done = worker("capture", "--pid", str(os.getpid()), "--images", str(tmp_path))
    assert done.returncode == 1 and "is not empty" in done.stderr


@pytest.mark.skipif(has_nvidia_driver(), reason="asserts the no-driver path")
def test_n610_capture_without_cuda_fails_before_touching_anything(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        done = worker("capture", "--pid", str(child.pid), "--images", str(tmp_path / "img"))
        assert done.returncode == 1 and "libcuda.so.1 could not be loaded" in done.stderr
        assert child.poll() is None  # still running
    finally:
        child.kill()
        child.wait()


def test_restore_needs_a_capture(tmp_path: Path) -> None:
    done = worker("restore", "--images", str(tmp_path))
    assert done.returncode == 1 and "capture.json" in done.stderr


def test_anonymous_memory_names_the_written_private_mappings_and_nothing_of_a_gone_process(tmp_path: Path) -> None:
    """What the capture reports before and after the CUDA checkpoint: private pages written, by mapping (an
    anonymous one, and a private file mapping's pages once written: copies), the largest first."""
    backing = tmp_path / "private file"  # a name with a space: the report keeps it whole
    backing.write_bytes(b"\1" * (4 << 20))
    script = ("import mmap, sys, time\n"
              "a = mmap.mmap(-1, 24 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
              "f = open(sys.argv[1], 'r+b'); b = mmap.mmap(f.fileno(), 4 << 20, flags=mmap.MAP_PRIVATE)\n"
              "for m in (a, b):\n    for at in range(0, len(m), 4096): m[at] = 7\n"
              "print('ready', flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(backing)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        seen = anonymous_memory(child.pid)
    finally:
        child.kill()
        child.wait()
    largest = seen["largest"]
    assert largest == sorted(largest, reverse=True) and largest[0][0] >= 24 << 20 and largest[0][1] == "[anon]"
    assert [4 << 20, str(backing)] in [list(entry) for entry in largest]
    assert seen["anonymous_bytes"] >= (28 << 20)
    assert anonymous_memory(child.pid) == {}


def test_a_process_s_age_counts_from_its_start_to_the_clock_tick() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        age = process_age_s(child.pid)
    finally:
        child.kill()
        child.wait()
    assert 0.3 - 0.02 <= age < 5  # one tick (10 ms) of rounding, either way
    with pytest.raises(FileNotFoundError):
        process_age_s(child.pid)  # reaped: gone


def test_process_tree_lists_parents_before_children() -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(process_tree(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 3
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_n580_audit_refuses_a_process_that_maps_a_cuda_driver_library(tmp_path: Path) -> None:
    fake = tmp_path / "libcuda.so.1"
    fake.write_bytes(b"\0" * 4096)
    holder = ("import mmap, sys, time; f = open(sys.argv[1], 'rb'); "
              "m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ); print('ready', flush=True); time.sleep(30)")
    mapping = subprocess.Popen([sys.executable, "-c", holder, str(fake)], stdout=subprocess.PIPE, text=True)
    clean = subprocess.Popen(["sleep", "30"])
    try:
        assert mapping.stdout is not None and mapping.stdout.readline() == "ready\n"
        with pytest.raises(WorkerError, match=r"is not a pre-CUDA template: it holds libcuda\.so"):
            audit_pre_cuda([clean.pid, mapping.pid])
        audit_pre_cuda([clean.pid])  # a process without CUDA passes
    finally:
        for process in (mapping, clean):
            process.kill()
            process.wait()


H200 = {"architecture": "x86_64", "driver_version": "580.159.04", "gpu_name": "NVIDIA H200"}


def test_a_procfs_identity_that_matches_an_older_capture_is_kept() -> None:
    current = {**H200, "gpu_identity_source": "procfs"}
    assert comparable(H200, current, "n610") == (H200, current)
    upgraded = {**H200, "driver_version": "610.43.02", "gpu_identity_source": "procfs"}
    assert comparable(H200, upgraded, "n580") == (H200, upgraded)  # a template compares no GPU fact


@pytest.mark.parametrize("changed", [{"driver_version": "610.43.02"}, {"driver_version": "575.1"},
                                     {"gpu_name": "NVIDIA H200 NVL"}, {"driver_version": None}])
def test_against_an_older_capture_procfs_leaves_any_difference_to_nvml(changed: dict[str, Any]) -> None:
    """A capture without its procfs facts: procfs only confirms an exact match; NVML (the capture's source)
    decides the rest: here, without a driver, the driver version is then unknown and the restore refuses; on the
    GPU host NVML's real facts are compared."""
    captured, confirmed = comparable(H200, {**H200, **changed, "gpu_identity_source": "procfs"}, "n610")
    nvml = nvml_identity(os.environ.get(DEVICE_SELECTOR_ENV, "0"))
    assert captured == H200 and confirmed["gpu_identity_source"] == "nvml" and confirmed["architecture"] == "x86_64"
    assert {k: confirmed.get(k) for k in ("driver_version", "gpu_uuid", "gpu_name")} == {
        k: nvml.get(k) for k in ("driver_version", "gpu_uuid", "gpu_name")}
    if not has_nvidia_driver():
        with pytest.raises(TargetRefused, match="driver-unknown"):
            check_target(captured, confirmed, "n610")


def test_a_capture_that_recorded_procfs_is_compared_procfs_to_procfs_without_nvml() -> None:
    """Issue 36 item 4 (<= 50 ms): a mismatch read from procfs is refused on procfs's own words, as a match is
    accepted, when the capture recorded them (`identity.procfs`)."""
    criu = {"version": "Version: 4.2", "version_exit_code": 0}
    recorded = {**H200, "criu": criu, "gpu_name": "NVIDIA H200 (NVML)",
                "procfs": {"driver_version": "580.159.04", "gpu_uuid": "GPU-1", "gpu_name": "NVIDIA H200"}}
    here = {**H200, "criu": criu, "gpu_uuid": "GPU-1", "gpu_identity_source": "procfs"}
    captured, current = comparable(recorded, here, "n610")
    assert current is here and check_target(captured, current, "n610") == "exact"
    elsewhere = {**here, "gpu_name": "NVIDIA GB10"}
    captured, current = comparable(recorded, elsewhere, "n610")
    assert current is elsewhere  # no NVML read
    with pytest.raises(TargetRefused, match=r"gpu-model-mismatch \(gpu_name: captured 'NVIDIA H200', this host "
                                            r"'NVIDIA GB10'\)"):
        check_target(captured, current, "n610")


def test_image_digest_sees_any_write(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(b"a" * 100)
    before = image_digest(tmp_path)
    assert image_digest(tmp_path) == before
    os.utime(tmp_path / "pages-1.img")
    assert image_digest(tmp_path) != before


# --- on a GPU host (scripts/device gpu-tests runs these there) ----------------------------

gpu = pytest.mark.skipif(not has_nvidia_driver() or shutil.which("criu") is None,
                         reason="needs an NVIDIA driver and CRIU (run on the GPU host)")


@pytest.fixture
def subreaper() -> None:
    """Restored trees are reparented to this process, which must reap them."""
    ctypes.CDLL(None).prctl(36, 1)


def start_target(mode: str, directory: Path, *extra: str) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen([sys.executable, "-m", "tests.probe._gpu_target", mode, str(directory), *extra],
                               cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    wait_file(directory / "ready")
    return process


def wait_file(path: Path, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def verify(directory: Path, n: int) -> bool:
    (directory / f"verify-{n}").touch()
    return bool(wait_file(directory / f"answer-verify-{n}")["matches"])


def kill_and_reap(pid: int) -> None:
    os.killpg(pid, signal.SIGKILL)
    while True:
        try:
            if os.waitpid(-1, 0)[0] == pid:
                return
        except ChildProcessError:
            return


def captured(tmp_path: Path, mib: int) -> tuple[Path, Path, int, dict[str, Any]]:
    """A target holding `mib` MiB of device memory, verified, captured (n610) and reaped:
    (its control directory, the images, its PID, the capture report)."""
    control, images = tmp_path / "control", tmp_path / "images"
    target = start_target("n610", control, str(mib))
    assert verify(control, 0)
    done = worker("capture", "--pid", str(target.pid), "--images", str(images), "--criu", shutil.which("criu") or "")
    assert done.returncode == 0, done.stderr
    target.wait()  # CRIU killed it; reap so the PID is free again
    return control, images, target.pid, json.loads(done.stdout)


@gpu
@pytest.mark.usefixtures("subreaper")
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy-pages"])
def test_n610_capture_then_two_restores_from_unchanged_images(tmp_path: Path, lazy: bool) -> None:
    control, images, pid, capture = captured(tmp_path, 64)
    assert capture["cuda_pids"] == [pid] and capture["image_bytes"] > 64 << 20
    # kdat_wait: the dump loaded the kernel probe the worker ran while it locked and checkpointed (`_criu_kdat`)
    assert {"cuda_lock", "cuda_checkpoint", "criu_dump", "kdat_wait"} <= set(capture["timings_s"])
    digest = image_digest(images)
    for attempt in (1, 2):
        done = worker("restore", "--images", str(images), "--work-dir", str(tmp_path / f"work-{attempt}"),
                      *(["--lazy-pages"] if lazy else []))
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        names = [m["name"] for m in report["timeline"]]
        # CRIU started once the host is checked, the records checked while it runs (a CUDA tree is restored paused);
        # lazily: held stopped after the CUDA restore until every page is in, and only then resumed
        assert names == ["restore_begin", "criu_restore_begin", "validated", "cuda_driver_ready", "criu_restore_end",
                         "deferred_cuda_restore_begin", "deferred_cuda_restore_end",
                         *(["all_pages_in"] if lazy else []), "process_resumed", "ready"]
        # CRIU's seconds are its own run: the worker's wait for the driver (cuInit, meanwhile) is not in them
        marks = {m["name"]: m["unix_ns"] for m in report["timeline"]}
        assert report["criu_restore_seconds"] * 1e9 <= marks["criu_restore_end"] - marks["criu_restore_begin"] + 1e6
        assert report["restored_pid"] == pid and verify(control, attempt)
        assert report["identity_compatibility"] == "exact"
        assert "kdat_carried_s" in report["criu_restore_phases"]  # the capture's kernel probe, carried: none ran
        kill_and_reap(report["restored_pid"])
    assert image_digest(images) == digest


@gpu
@pytest.mark.usefixtures("subreaper")
def test_a_lazy_pages_daemon_that_fails_restores_nothing(tmp_path: Path) -> None:
    control, images, pid, _capture = captured(tmp_path, 16)
    broken = tmp_path / "criu"  # the real criu, except that its lazy-pages daemon fails at once
    broken.write_text(f'#!/bin/sh\n[ "$1" = lazy-pages ] && exit 3\nexec {shutil.which("criu")} "$@"\n')
    broken.chmod(0o755)
    done = worker("restore", "--images", str(images), "--criu", str(broken), "--lazy-pages")
    assert done.returncode == 1 and "criu lazy-pages did not start (exit 3)" in done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # nothing was restored
    done = worker("restore", "--images", str(images), "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr  # the images are intact: an eager restore still works
    assert verify(control, 1)
    kill_and_reap(json.loads(done.stdout)["restored_pid"])


@gpu
def test_failed_dump_rolls_back_and_the_workload_keeps_running(tmp_path: Path) -> None:
    control = tmp_path / "control"
    target = start_target("n610", control, "16")
    try:
        done = worker("capture", "--pid", str(target.pid), "--images", str(tmp_path / "images"), "--criu", "/bin/false")
        assert done.returncode == 1 and "criu dump exited 1" in done.stderr
        assert target.poll() is None and verify(control, 1)  # unlocked, restored, still serving
    finally:
        os.killpg(target.pid, signal.SIGKILL)
        target.wait()


@gpu
@pytest.mark.usefixtures("subreaper")
def test_n580_template_restores_and_initializes_cuda_fresh(tmp_path: Path) -> None:
    control, images = tmp_path / "control", tmp_path / "images"
    template = start_target("n580", control)
    done = worker("capture", "--pid", str(template.pid), "--images", str(images), "--boundary", "n580",
                  "--criu", shutil.which("criu") or "")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cuda_pids"] == []
    template.wait()
    done = worker("restore", "--images", str(images))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (control / "release").touch()
    initialized = wait_file(control / "initialized")
    assert initialized["cuda"] is True and initialized["pid"] == template.pid and verify(control, 1)
    kill_and_reap(report["restored_pid"])


@gpu
def test_n580_capture_refuses_a_process_with_cuda_state(tmp_path: Path) -> None:
    control = tmp_path / "control"
    target = start_target("n610", control, "16")
    try:
        done = worker("capture", "--pid", str(target.pid), "--images", str(tmp_path / "images"),
                      "--boundary", "n580", "--criu", shutil.which("criu") or "")
        assert done.returncode == 1 and "is not a pre-CUDA template" in done.stderr
        assert target.poll() is None and verify(control, 1)
    finally:
        os.killpg(target.pid, signal.SIGKILL)
        target.wait()

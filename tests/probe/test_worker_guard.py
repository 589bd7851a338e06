"""coldsnap_probe._worker_guard and _phase, for real: a capture worker SIGKILLed from outside while CRIU dumps its
target (a watcher that reads the worker's live phase from its report directory and waits until CRIU has seized
the tree) leaves the target running with every page intact and no images; the guard's account ends the worker's
stderr; a failed restore names its phase; a finished worker leaves no live phase behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe._phase import PhaseLog
from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_criu_restore import end, gone_within, verified, wait_file, worker
from tests.probe.test_main import has_nvidia_driver

TARGET_MIB = 256


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


def start_target(control: Path) -> subprocess.Popen[bytes]:
    control.mkdir()
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control),
                               "--mib", str(TARGET_MIB)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    wait_file(control / "ready")
    return target


def traced(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line for line in status.splitlines() if line.startswith("TracerPid:")).split()[1] != "0"


def live_phase(reports: Path, pid: int) -> str:
    try:
        return str(json.loads((reports / f".phase-{pid}").read_text())["phase"])
    except (OSError, ValueError):
        return ""


def criu_restoring(images: Path) -> bool:
    words = [b"restore", b"--images-dir", str(images).encode()]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(argv[i:i + 3] == words for i in range(len(argv) - 2)):
            return True
    return False


def kill_in_dump(reports: Path, run: subprocess.Popen[str], target: int) -> None:
    """The watcher: the worker's live phase is criu-dump and CRIU holds the tree (ptrace), then SIGKILL."""
    deadline = time.monotonic() + 60
    while not (live_phase(reports, run.pid) == "criu-dump" and traced(target)):
        assert run.poll() is None and time.monotonic() < deadline, "the capture ended before it could be killed"
        time.sleep(0.0005)
    os.kill(run.pid, signal.SIGKILL)


@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
def test_a_worker_killed_during_the_dump_leaves_its_target_running_and_no_images(tmp_path: Path, criu: str) -> None:
    control, images, reports = tmp_path / "control", tmp_path / "images", tmp_path / "reports"
    reports.mkdir()
    target = start_target(control)
    try:
        run = subprocess.Popen([sys.executable, "-m", "coldsnap_probe", "capture", "--pid", str(target.pid),
                                "--images", str(images), "--boundary", "n580", "--criu", criu], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "COLDSNAP_REPORT_DIR": str(reports)})
        kill_in_dump(reports, run, target.pid)
        killed = time.monotonic()
        out, err = run.communicate(timeout=60)  # EOF once the guard, which shares stderr, is done
        undone_s = time.monotonic() - killed
        assert run.returncode == -signal.SIGKILL and out == ""
        assert "coldsnap-worker: capture phase criu-dump\n" in err
        assert "capture guard: the worker died" in err and f"images {images} removed" in err, err
        assert undone_s < 2.0, f"the guard took {undone_s:.2f} s"
        assert not images.exists()  # nothing half-written, nothing complete without its capture.json
        assert target.poll() is None and Path(f"/proc/{target.pid}/stat").read_text().split(") ")[1][0] != "T"
        assert verified(control) == {"ok": True, "bad": [], "bytes": TARGET_MIB << 20, "pid": target.pid}
        assert live_phase(reports, run.pid) == "criu-dump"  # a killed worker's last phase stays for the operator
    finally:
        end(control, target.pid)
        target.wait()


@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
def test_a_capture_and_a_failed_restore_name_their_phases_and_leave_no_live_phase(tmp_path: Path, criu: str) -> None:
    control, images, reports = tmp_path / "control", tmp_path / "images", tmp_path / "reports"
    reports.mkdir()
    target = start_target(control)
    env = {"COLDSNAP_REPORT_DIR": str(reports)}
    done = worker("capture", "--pid", str(target.pid), "--images", str(images), "--boundary", "n580", "--criu", criu,
                  env=env)
    assert done.returncode == 0, done.stderr
    target.wait()  # the worker ended the dumped tree once the images were complete
    assert [line for line in done.stderr.splitlines() if "phase" in line] == [
        f"coldsnap-worker: capture phase {p}" for p in ("audit", "criu-dump", "finish")]
    assert "capture guard" not in done.stderr
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    os.truncate(pages, pages.stat().st_size // 2)
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"), env=env)
    assert done.returncode == 1
    assert "\nerror: restore phase criu-restore: WorkerError: criu restore exited" in done.stderr, done.stderr
    assert not alive(target.pid)
    # both workers ended: no live phase; the capture's report (a failed restore leaves none)
    assert [p.name.split("-")[:4] for p in reports.iterdir()] == [["coldsnap", "cuda", "criu", "capture"]]


def test_a_phase_log_replaces_its_file_whole_and_removes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLDSNAP_REPORT_DIR", str(tmp_path))
    phases = PhaseLog("restore")
    for phase in ("validate", "criu-restore"):
        phases.enter(phase)
    state = json.loads((tmp_path / f".phase-{os.getpid()}").read_text())
    assert (state["kind"], state["phase"], state["pid"]) == ("restore", "criu-restore", os.getpid())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".phase-{os.getpid()}"]  # no temporary left
    phases.close()
    assert list(tmp_path.iterdir()) == [] and phases.current == "criu-restore"
    assert capsys.readouterr().err == ("coldsnap-worker: restore phase validate\n"
                                       "coldsnap-worker: restore phase criu-restore\n")


def test_a_phase_log_without_a_report_directory_still_says_the_phase(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("COLDSNAP_REPORT_DIR", raising=False)
    phases = PhaseLog("capture")
    phases.enter("cuda-lock")
    phases.close()
    assert capsys.readouterr().err == "coldsnap-worker: capture phase cuda-lock\n"


gpu_and_criu = pytest.mark.skipif(not (has_nvidia_driver() and shutil.which("criu")),
                                  reason="needs an NVIDIA driver and CRIU (run on the GPU host)")


@gpu_and_criu
@pytest.mark.parametrize("phase", ["cuda-lock", "cuda-checkpoint", "criu-dump"])
def test_a_worker_killed_in_a_gpu_phase_leaves_its_target_running_on_the_gpu(tmp_path: Path, phase: str) -> None:
    """Issue 35 item 4: the capture worker SIGKILLed from outside as `phase` begins (its live phase read from its
    report directory): the guard unlocks and restores the target, which computes on its device memory as before,
    the driver says `running`, and no image is left."""
    from coldsnap_probe._cuda import Driver
    from tests.probe.test_worker import start_target, verify

    control, images, reports = tmp_path / "control", tmp_path / "images", tmp_path / "reports"
    reports.mkdir()
    target = start_target("n610", control, "64")
    try:
        assert verify(control, 0)
        run = subprocess.Popen([sys.executable, "-m", "coldsnap_probe", "capture", "--pid", str(target.pid),
                                "--images", str(images), "--criu", shutil.which("criu") or ""], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "COLDSNAP_REPORT_DIR": str(reports)})
        order = ["find-cuda", "wait-idle", "release-memory", "cuda-lock", "cuda-checkpoint", "criu-dump"]
        deadline = time.monotonic() + 120
        while live_phase(reports, run.pid) not in order[order.index(phase):]:  # a lock of milliseconds: or just after
            assert run.poll() is None and time.monotonic() < deadline, f"the capture ended before {phase}"
            time.sleep(0.0002)
        os.kill(run.pid, signal.SIGKILL)
        killed = time.monotonic()
        _out, err = run.communicate(timeout=120)
        assert "capture guard: the worker died" in err and f"capture phase {phase}\n" in err, err
        assert time.monotonic() - killed < 2.0 and not images.exists()
        driver = Driver()
        driver.call("cuInit", 0)
        assert driver.state(target.pid) == "running"
        assert target.poll() is None and verify(control, 1)  # unlocked, restored, computing as before
    finally:
        os.killpg(target.pid, signal.SIGKILL)
        target.wait()


@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
@pytest.mark.parametrize("phase", ["criu-restore", "resume"])
def test_a_restore_worker_killed_mid_restore_leaves_no_restored_tree(tmp_path: Path, criu: str, phase: str) -> None:
    """A restore worker SIGKILLed from outside as `phase` begins: its guard waits for the orphaned CRIU restore and
    kills the restored tree (a worker run on a host has no container whose end would)."""
    control, images, reports = tmp_path / "control", tmp_path / "images", tmp_path / "reports"
    reports.mkdir()
    target = start_target(control)
    done = worker("capture", "--pid", str(target.pid), "--images", str(images), "--boundary", "n580", "--criu", criu)
    assert done.returncode == 0, done.stderr
    target.wait()
    for _attempt in range(5):  # a short phase on a busy machine can pass unseen: the restore is done again
        run = subprocess.Popen([sys.executable, "-m", "coldsnap_probe", "restore", "--images", str(images), "--criu",
                                criu, "--work-dir", str(tmp_path / "work")], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "COLDSNAP_REPORT_DIR": str(reports)})
        deadline = time.monotonic() + 60
        # in criu-restore: once CRIU restores (its command line); in resume: as the phase begins
        while not (live_phase(reports, run.pid) == phase and (phase != "criu-restore" or criu_restoring(images))):
            if run.poll() is not None:
                break
            assert time.monotonic() < deadline, f"no {phase} within 60 s"
            time.sleep(0.0002)
        else:
            break
        run.communicate(timeout=60)  # it restored before the watcher saw the phase: undo that and try again
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target.pid, signal.SIGKILL)
        assert gone_within(target.pid, 5), f"the restored tree ({target.pid}) could not be removed"
    else:
        pytest.fail(f"the restore passed {phase} unseen 5 times")
    os.kill(run.pid, signal.SIGKILL)
    killed = time.monotonic()
    out, err = run.communicate(timeout=60)
    assert out == "" and f"restore phase {phase}\n" in err and "restore guard: the worker died" in err, err
    assert time.monotonic() - killed < 2.0
    assert gone_within(target.pid, 5), f"the restored tree ({target.pid}) outlived its killed worker: {err}"

"""coldsnap_probe._worker_guard and _phase, for real: a capture worker SIGKILLed from outside while CRIU dumps its
target (a watcher that reads the worker's live phase from its report directory and waits until CRIU has seized
the tree) leaves the target running with every page intact, no images (or only the failed dump's log, in an images
directory that was there before) and no scratch directory; the guard's account ends the worker's stderr; the guard
acts only on what its journal names, never on a process merely named like CRIU; a failed restore names its phase;
a finished worker leaves no live phase behind."""

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

from coldsnap_probe import pids_by_argv
from coldsnap_probe._phase import PhaseLog
from coldsnap_probe._worker_guard import WorkerGuard
from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_criu_restore import end, gone_within, verified, wait_file, worker
from tests.probe.test_main import has_nvidia_driver

TARGET_MIB = 256
GUARD_PROMPT_S = 10.0  # a prompt undo, told from waiting out a timeout (the 60-120 s these tests give a worker)


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


def start_target(control: Path, mib: int = TARGET_MIB) -> subprocess.Popen[bytes]:
    control.mkdir()
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control),
                               "--mib", str(mib)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
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
    return bool(pids_by_argv(["restore", "--images-dir", str(images), "--restore-detached"]))


@contextlib.contextmanager
def decoy(*words: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process merely named like a worker's CRIU (another capsule's, a user's program): no guard may wait for it
    or signal it."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *words],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def kill_in_dump(reports: Path, run: subprocess.Popen[str], target: int) -> None:
    """The watcher: the worker's live phase is criu-dump and CRIU holds the tree (ptrace), then SIGKILL."""
    deadline = time.monotonic() + 60
    while not (live_phase(reports, run.pid) == "criu-dump" and traced(target)):
        assert run.poll() is None and time.monotonic() < deadline, "the capture ended before it could be killed"
        time.sleep(0.0005)
    os.kill(run.pid, signal.SIGKILL)


@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
@pytest.mark.parametrize("images_existed", [False, True], ids=["new-images", "existing-images"])
def test_a_worker_killed_during_the_dump_leaves_its_target_running_and_no_images(tmp_path: Path, criu: str,
                                                                                 images_existed: bool) -> None:
    """Also regression (review #12, and the leaked CRIU work directory): a process named like CRIU's dump of the
    tree neither holds the guard up nor is touched; the worker's scratch directory goes, its dump log kept only in
    an images directory that stays."""
    control, images, reports, scratch = (tmp_path / name for name in ("control", "images", "reports", "tmp"))
    reports.mkdir()
    scratch.mkdir()
    if images_existed:
        images.mkdir()
    target = start_target(control)
    try:
        with decoy("dump", "--tree", str(target.pid)) as named_like_criu:
            run = subprocess.Popen([sys.executable, "-m", "coldsnap_probe", "capture", "--pid", str(target.pid),
                                    "--images", str(images), "--boundary", "n580", "--criu", criu], cwd=ROOT,
                                   text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env={**os.environ, "COLDSNAP_REPORT_DIR": str(reports), "TMPDIR": str(scratch)})
            kill_in_dump(reports, run, target.pid)
            killed = time.monotonic()
            out, err = run.communicate(timeout=60)  # EOF once the guard, which shares stderr, is done
            undone_s = time.monotonic() - killed
            assert named_like_criu.poll() is None
        assert run.returncode == -signal.SIGKILL and out == ""
        assert "coldsnap-worker: capture phase criu-dump\n" in err
        assert "capture guard: the worker died" in err and f"images {images} removed" in err, err
        # prompt, not a timeout (the guard's 2 s goal is measured by bench/restore_faults.py, not asserted on a
        # loaded 2-core CI machine, where 2.5 s was seen once)
        assert undone_s < GUARD_PROMPT_S, f"the guard took {undone_s:.2f} s"
        # nothing half-written, nothing complete without its capture.json; the dump's log where the images stay
        assert [p.name for p in images.iterdir()] == ["dump.log"] if images_existed else not images.exists()
        assert list(scratch.iterdir()) == [], err
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
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = worker("restore", "--images", str(images), "--criu", criu, env={**env, "TMPDIR": str(scratch)})
    assert done.returncode == 1
    assert "\nerror: restore phase criu-restore: WorkerError: criu restore exited" in done.stderr, done.stderr
    assert not alive(target.pid)
    assert list(scratch.iterdir()) == []  # the restore's own work directory (its log's tail is in the error)
    # both workers ended: no live phase; the capture's report (a failed restore leaves none)
    assert [p.name.split("-")[:4] for p in reports.iterdir()] == [["coldsnap", "cuda", "criu", "capture"]]


def test_a_relative_tmpdir_gives_an_absolute_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As tempfile's: the kernel probe's CRIU runs in the scratch itself and is told the cache's path there, which
    a relative TMPDIR would resolve a second time (its cache never found: every restore probed for itself)."""
    (tmp_path / "relative").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", "relative")
    scratch = WorkerGuard().scratch("coldsnap-test-")
    assert scratch.is_absolute() and scratch.parent == tmp_path / "relative" and scratch.is_dir()


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
        assert time.monotonic() - killed < GUARD_PROMPT_S and not images.exists()
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
    kills the restored tree (a worker run on a host has no container whose end would), and removes the worker's
    scratch directory. Regression (review #12): a process named like a CRIU restore or lazy-pages daemon of these
    images neither holds the guard up nor is killed."""
    control, images, reports, scratch = (tmp_path / name for name in ("control", "images", "reports", "tmp"))
    reports.mkdir()
    scratch.mkdir()
    target = start_target(control)
    done = worker("capture", "--pid", str(target.pid), "--images", str(images), "--boundary", "n580", "--criu", criu)
    assert done.returncode == 0, done.stderr
    target.wait()
    with decoy("restore", "--images-dir", str(images), "lazy-pages", "--images-dir", str(images)) as named_like_criu:
        run = _restore_killed_in(phase, images, criu, reports, scratch, target.pid)
        killed = time.monotonic()
        out, err = run.communicate(timeout=60)
        undone_s = time.monotonic() - killed
        assert named_like_criu.poll() is None, err
    assert out == "" and f"restore phase {phase}\n" in err and "restore guard: the worker died" in err, err
    assert undone_s < GUARD_PROMPT_S, f"the guard took {undone_s:.2f} s"
    assert gone_within(target.pid, 5), f"the restored tree ({target.pid}) outlived its killed worker: {err}"
    assert list(scratch.iterdir()) == [], err


def _restore_killed_in(phase: str, images: Path, criu: str, reports: Path, scratch: Path,
                       tree: int) -> subprocess.Popen[str]:
    """A restore worker SIGKILLed as `phase` begins (in criu-restore: once CRIU restores)."""
    for _attempt in range(5):  # a short phase on a busy machine can pass unseen: the restore is done again
        run = subprocess.Popen([sys.executable, "-m", "coldsnap_probe", "restore", "--images", str(images), "--criu",
                                criu], cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "COLDSNAP_REPORT_DIR": str(reports), "TMPDIR": str(scratch)})
        deadline = time.monotonic() + 60
        while not (live_phase(reports, run.pid) == phase and (phase != "criu-restore" or criu_restoring(images))):
            if run.poll() is not None:
                break
            assert time.monotonic() < deadline, f"no {phase} within 60 s"
            time.sleep(0.0002)
        else:
            os.kill(run.pid, signal.SIGKILL)
            # A short last phase can end the worker between the watcher's look and the kill: peek at how it ended
            # (WNOWAIT: the caller still reaps it) and count only a worker the kill ended.
            ended = os.waitid(os.P_PID, run.pid, os.WEXITED | os.WNOWAIT)
            if ended is not None and ended.si_code == os.CLD_KILLED:
                return run
        run.communicate(timeout=60)  # it restored before the watcher saw the phase: undo that and try again
        with contextlib.suppress(ProcessLookupError):
            os.killpg(tree, signal.SIGKILL)
        assert gone_within(tree, 5), f"the restored tree ({tree}) could not be removed"
    pytest.fail(f"the restore passed {phase} unseen 5 times")


# A restore worker that starts its lazy-pages daemon (`named`: as the restore does; else the worker dies between
# starting it and naming it: only the socket is journalled), says the daemon's pid and waits to be killed.
LAZY_WORKER = """
import subprocess, sys, time
from pathlib import Path
from coldsnap_probe._process import criu_environment
from coldsnap_probe._restore import _start_lazy_pages
from coldsnap_probe._worker_guard import WorkerGuard
criu, images, named = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "named"
guard = WorkerGuard()
guard.start("restore")
work = guard.scratch("coldsnap-restore-")
if named:
    daemon = _start_lazy_pages(criu, images, work, guard, {})
else:
    guard.note(lazy_socket=str(work / "lazy-pages.socket"))
    daemon = subprocess.Popen([criu, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work),
                               "--log-file", str(images.parent / "lazy-pages.log"), "-v4"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=criu_environment(criu))
    while not (work / "lazy-pages.socket").exists():
        time.sleep(0.001)
print(daemon.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
@pytest.mark.parametrize("named", [True, False], ids=["named", "started-not-named"])
def test_a_lazy_pages_daemon_ends_with_its_dead_workers_guard(tmp_path: Path, criu: str, named: bool) -> None:
    """Regression (review #12): the guard ends the lazy-pages daemon its worker journalled, through its pidfd, or
    through the socket the worker journalled before starting it (a connection that sends nothing ends its wait),
    never by its name; the worker's scratch directory goes too."""
    control, images, scratch = tmp_path / "control", tmp_path / "images", tmp_path / "tmp"
    scratch.mkdir()
    target = start_target(control, mib=16)
    done = worker("capture", "--pid", str(target.pid), "--images", str(images), "--boundary", "n580", "--criu", criu)
    assert done.returncode == 0, done.stderr
    target.wait()
    run = subprocess.Popen([sys.executable, "-c", LAZY_WORKER, criu, str(images), "named" if named else "not"],
                           cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**os.environ, "TMPDIR": str(scratch)})
    assert run.stdout is not None
    daemon = int(run.stdout.readline() or 0)
    assert daemon and alive(daemon), run.communicate(timeout=30)
    run.kill()
    _out, err = run.communicate(timeout=30)
    assert "restore guard: the worker died" in err, err
    log = tmp_path / "lazy-pages.log"
    assert gone_within(daemon, 5), (f"the lazy-pages daemon {daemon} outlived its worker's guard: {err}"
                                    f"{log.read_text()[-3000:] if log.exists() else ''}")
    assert list(scratch.iterdir()) == [], err

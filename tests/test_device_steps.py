"""scripts/device, the one entry point for runs on the GPU machine (issue 39): its steps, their helpers, the
dry run, and how `gpu-tests` chooses the GPU tests (by skip reason, `pytest --gpu-only`). A real bash runs the
real script; what needs a GPU is not run here, only what the step would run and what it refuses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def device(*args: str, out: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(ROOT / "scripts/device"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def steps(help_text: str) -> dict[str, str]:
    return {m[1]: m[2] for m in re.finditer(r"^  ([a-z][a-z0-9-]*) +(.+)$", help_text, re.M) if m[1] != "step"}


def test_there_are_at_most_three_device_entry_points() -> None:
    """Regression (issue 39): 16 scripts/device-* files, five of them hand-picked GPU test lists."""
    entry_points = sorted(p.name for p in (ROOT / "scripts").glob("device*"))
    assert entry_points == ["device"]


def test_help_lists_each_step_with_its_bound_and_every_step_has_its_helper(tmp_path: Path) -> None:
    done = device("--help", out=tmp_path)
    listed = steps(done.stdout)
    assert done.returncode == 0 and {"gpu-tests", "ttft", "e2e", "serve", "criu", "confine", "tp", "qualify"} <= set(
        listed)
    for name, line in listed.items():
        assert re.match(r"(<=|~) \d+ (s|min)", line), f"{name}: no expected duration in {line!r}"
        dry = device("--dry-run", name, out=tmp_path) if name != "gpu-tests" else None
        if dry is not None:
            assert dry.returncode == 0 and f"step {name} " in dry.stdout, dry.stdout + dry.stderr
            helper = re.search(r"would run: bash (\S+)", dry.stdout)
            assert helper and Path(helper[1]).is_file() and Path(helper[1]).name.startswith("_device_")


def test_an_unknown_step_is_refused_with_the_list(tmp_path: Path) -> None:
    done = device("device-e2e", out=tmp_path)
    assert done.returncode == 2 and "unknown step 'device-e2e'" in done.stderr and "gpu-tests" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_line_rate_refuses_parts_that_do_not_fit_one_call(tmp_path: Path) -> None:
    """The four parts together are bounded by 880 s: one call may run 600 s."""
    done = device("line-rate", "16,64,64h,release", out=tmp_path)
    assert done.returncode == 2 and "880 s" in done.stdout and "16,64 and 64h,release" in done.stdout
    assert device("line-rate", "16,bogus", out=tmp_path).returncode == 2


def test_gpu_tests_dry_run_collects_the_gpu_tests_and_says_what_it_would_run(tmp_path: Path) -> None:
    done = device("--dry-run", "gpu-tests", "tests/probe/test_interposer_gpu.py", "tests/probe/test_main.py",
                  out=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "11 tests/probe/test_interposer_gpu.py" in re.sub(r" +", " ", done.stdout)
    assert "test_main.py" not in done.stdout.split("would run")[0]  # its tests assert the no-driver path
    command = done.stdout.split("would run", 1)[1]
    assert "pytest --gpu-only" in command and "--junitxml" in command and "timeout -s INT" in command


def test_gpu_only_chooses_tests_by_the_reason_they_skip() -> None:
    """The tests marked as needing an NVIDIA driver are kept, the no-driver ones and the rest are not."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--gpu-only", "--collect-only", "-q", "-p",
                           "no:cacheprovider", "tests/probe/test_interposer_gpu.py", "tests/probe/test_main.py",
                           "tests/probe/test_host.py", "tests/probe/test_interposer_gated.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    chosen = [line for line in done.stdout.splitlines() if "::" in line]
    assert {line.split("::")[0] for line in chosen} == {
        "tests/probe/test_interposer_gpu.py", "tests/probe/test_host.py", "tests/probe/test_interposer_gated.py"}
    # test_interposer_gated.py: only the real driver's exports (its stand-in driver tests run anywhere)
    assert [line for line in chosen if "gated" in line] == [
        "tests/probe/test_interposer_gated.py::test_the_real_driver_exports_every_gated_name"]
    host = [line for line in done.stdout.splitlines() if line.startswith("tests/probe/test_host.py")]
    assert len(host) == 2  # its two driver tests, not its no-kernel-module ones


def test_more_than_eight_result_files_are_packed_into_one_tarball(tmp_path: Path) -> None:
    """The device machine sends back at most 8 files from $OUT: the dispatcher's pack() (run here as the script
    defines it) leaves the tarball and the step's summary, and the tarball holds every other file."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    for index in range(9):
        (out / f"part-{index}.txt").write_text(str(index))
    (out / "logs" / "daemon.log").write_text("log")
    (out / "summary.txt").write_text("summary")
    (out / "line-rate.tar.xz").write_bytes(b"a step's own tarball")
    script = f'source <(sed -n "/^pack() {{/,/^}}/p" "{ROOT}/scripts/device"); OUT="{out}"; pack e2e'
    subprocess.run(["bash", "-c", script], check=True, capture_output=True, timeout=60)
    assert sorted(p.name for p in out.iterdir()) == ["e2e-results.tar.xz", "line-rate.tar.xz", "summary.txt"]
    listed = subprocess.run(["tar", "-tJf", str(out / "e2e-results.tar.xz")], capture_output=True, text=True,
                            check=True).stdout.split()
    assert sorted(listed) == sorted([f"./part-{i}.txt" for i in range(9)] + ["./logs/daemon.log"])
    few = tmp_path / "few"
    few.mkdir()
    (few / "a.txt").write_text("a")
    subprocess.run(["bash", "-c", script.replace(str(out), str(few))], check=True, timeout=60)
    assert [p.name for p in few.iterdir()] == ["a.txt"]  # eight or fewer come back as they are

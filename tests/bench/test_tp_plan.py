"""bench/tp_plan.py and the dry modes that use it (`bench/e2e_tp.py --plan`, `scripts/device tp N SIZE plan`):
what a TP run at size needs, checked on a CPU machine before a GPU machine is spent on it (issues 27, 28)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import tp_plan
from bench.tp_plan import GIB, HOST_HEADROOM, PlanError, cgroup_limit, parse_size, plan, tensor_bytes
from tests.helpers import ROOT


@pytest.mark.parametrize(("shape", "layers", "params"), [
    ("70b", 80, 70.55e9),  # Llama-3-70B without its norms (8 M parameters)
    ("405b", 126, 405.85e9)])  # Llama-3.1-405B, the same
def test_tensor_bytes_of_one_rank_is_the_published_model_size(shape: str, layers: int, params: float) -> None:
    assert tensor_bytes(shape, 1, layers) / 2 == pytest.approx(params, rel=0.002)


def test_tensor_bytes_shards_layers_and_replicates_the_embeddings() -> None:
    whole, embeddings = tensor_bytes("70b", 1, 80), 2 * 128256 * 8192 * 2
    assert tensor_bytes("70b", 2, 80) == pytest.approx(embeddings + (whole - embeddings) / 2, rel=1e-4)
    assert 70e9 < tensor_bytes("70b", 2, 80) < 75e9  # ~70 GB a rank at TP2 (issue 27)
    assert 35e9 < tensor_bytes("70b", 4, 80) < 40e9  # ~35 GB a rank at TP4 (issue 28)


@pytest.mark.parametrize(("text", "value"), [("560G", 560 * GIB), ("143771M", 143771 << 20), ("256GiB", 256 * GIB),
                                             ("1024", 1024), ("1.5T", 3 << 39)])
def test_parse_size_binary_units(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_refuses_what_is_not_a_size() -> None:
    with pytest.raises(PlanError, match="not a size: '12 apples'"):
        parse_size("12 apples")


def test_cgroup_limit_is_the_smallest_memory_max_up_to_the_root(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/machine/job\n")
    root = tmp_path / "fs"
    (root / "machine" / "job").mkdir(parents=True)
    (root / "machine" / "job" / "memory.max").write_text("max\n")
    assert cgroup_limit(proc, root) is None
    (root / "machine" / "memory.max").write_text(f"{300 * GIB}\n")
    (root / "memory.max").write_text(f"{500 * GIB}\n")
    assert cgroup_limit(proc, root) == 300 * GIB
    (root / "machine" / "job" / "memory.max").write_text(f"{200 * GIB}\n")
    assert cgroup_limit(proc, root) == 200 * GIB


def test_plan_70b_fits_two_h200_with_every_layer() -> None:
    p = plan(2, "70b", memory_limit=256 * GIB, memory_source="flag")
    assert p.fits and p.layers == 80 and not p.largest_that_fits
    assert p.hydration_s_at_h2d_ceiling == pytest.approx(p.weights_per_rank / 55e9)


def test_plan_405b_at_tp8_takes_the_largest_layer_count_that_fits() -> None:
    limit = 560 * GIB
    p = plan(8, "405b", memory_limit=limit, memory_source="flag")
    assert p.fits and p.largest_that_fits and 0 < p.layers < 126
    assert p.host_needed <= limit * HOST_HEADROOM
    assert not plan(8, "405b", p.layers + 1, memory_limit=limit, memory_source="flag").fits  # one more does not


@pytest.mark.parametrize(("world", "shape", "layers", "limit", "problem"), [
    (2, "70b", 80, 128 * GIB, "host memory: "),
    (1, "405b", 126, 8192 * GIB, "GPU memory: "),
    (3, "70b", 0, 512 * GIB, "heads 64 does not split over 3 ranks")])
def test_plan_that_does_not_fit_names_the_bound(world: int, shape: str, layers: int, limit: int,
                                                problem: str) -> None:
    p = plan(world, shape, layers, memory_limit=limit, memory_source="flag")
    assert not p.fits and any(problem in x for x in p.problems), p.problems


def test_plan_without_a_memory_limit_is_refused_not_guessed_from_memtotal() -> None:
    with pytest.raises(PlanError, match="pass --memory-limit"):
        plan(2, "70b", memory_limit=None)


def test_plan_refuses_more_layers_than_the_shape_has() -> None:
    with pytest.raises(PlanError, match=r"layers must be within \[1, 80\]"):
        plan(2, "70b", 81, memory_limit=256 * GIB)


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, **(env or {})})


def test_e2e_tp_plan_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    done = _run(sys.executable, "bench/e2e_tp.py", "--plan", "--world-size", "8", "--shape", "405b",
                "--memory-limit", "560G", "--work", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr
    assert "TP8 405b-shaped" in done.stdout and "(the largest that fits)" in done.stdout and "fits" in done.stdout
    assert not (tmp_path / "work").exists()  # nothing was written


def test_e2e_tp_plan_that_does_not_fit_exits_2(tmp_path: Path) -> None:
    done = _run(sys.executable, "bench/e2e_tp.py", "--plan", "--world-size", "2", "--shape", "70b", "--layers", "80",
                "--memory-limit", "100G", "--work", str(tmp_path))
    assert done.returncode == 2 and "DOES NOT FIT: host memory" in done.stdout


@pytest.mark.parametrize(("world", "size"), [(2, "70b"), (4, "70b"), (8, "405b")])
def test_device_script_plan_step_runs_on_cpu(tmp_path: Path, world: int, size: str) -> None:
    done = _run("bash", "scripts/device", "tp", str(world), size, "plan",
                env={"TP_WORK": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"TP{world} {size}-shaped" in done.stdout and "\nfits\n" in done.stdout
    for step in ("weights", "run", "failures"):
        assert f"scripts/device tp {world} {size} {step}" in done.stdout


def test_device_script_refuses_an_unknown_step() -> None:
    done = _run("bash", "scripts/device", "tp", "2", "70b", "everything")
    assert done.returncode == 2 and "unknown step everything" in done.stdout


def test_device_script_runs_a_large_size_in_steps_only() -> None:
    """Weights, run and failures of a 70B engine would not fit the 600 s a device command may run."""
    done = _run("bash", "scripts/device", "tp", "2", "70b", "all")
    assert done.returncode == 2 and "run 70b as weights, run, failures" in done.stdout


def test_plan_json_round_trips_what_the_script_reads() -> None:
    p = tp_plan.plan(4, "70b", memory_limit=512 * GIB, memory_source="flag", shm_size=64 * GIB)
    value = p.to_json()
    assert value["fits"] and value["shm_needed"] > value["shm_size"]  # the script enlarges /dev/shm first

"""bench/tp_units.py: what each rank's unit runs, and how a restore is judged against the cold engine."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench.tp_units import DOWNGRADE_TOLERANCE, Activation, downgrade, hydration_rates


def _args(**overrides: object) -> argparse.Namespace:
    values = {"world_size": 4, "gpus": "own", "layers": 80, "tokens": 16, "shape": "70b", "hydrator": True,
              "weights_dir": ""}
    return argparse.Namespace(**{**values, **overrides})


def test_each_rank_serves_its_shard_through_its_own_hydrator_on_its_own_gpu(tmp_path: Path) -> None:
    tp = Activation(_args(), "sha256:x", tmp_path)
    assert tp.weights == tmp_path / "weights-70b-L80-tp4"  # one weight set per shape, layers and world size
    assert [layout.gpus for layout in tp.layouts] == [("0",), ("1",), ("2",), ("3",)]
    assert tp.hydrators == ["tp-hydrator-0", "tp-hydrator-1", "tp-hydrator-2", "tp-hydrator-3"]
    command = tp.serve_command(2)
    assert command[command.index("--rank") + 1] == "2" and command[command.index("--world-size") + 1] == "4"
    assert command[command.index("--shape") + 1] == "70b" and command[command.index("--layers") + 1] == "80"
    assert command[command.index("--weights") + 1] == "/weights"
    assert command[command.index("--hydrator") + 1] == "/run/engine/hydrator-2.sock"


def test_without_hydrators_each_engine_hydrates_through_its_ring(tmp_path: Path) -> None:
    tp = Activation(_args(hydrator=False, gpus="all", world_size=2), "sha256:x", tmp_path)
    assert tp.hydrators == [] and "--hydrator" not in tp.serve_command(0)
    assert [layout.gpus for layout in tp.layouts] == [("0", "1"), ("0", "1")]


@pytest.mark.parametrize(("decode", "busbw", "ok"), [(100.0, 300.0, True), (98.5, 294.5, True),
                                                     (97.0, 300.0, False), (100.0, 290.0, False)])
def test_downgrade_allows_two_percent_below_cold(decode: float, busbw: float, ok: bool) -> None:
    cold = {"decode_tokens_per_s": 100.0, "busbw_gbps": 300.0}
    verdict = downgrade(cold, {"decode_tokens_per_s": decode, "busbw_gbps": busbw})
    assert verdict["ok"] is ok and DOWNGRADE_TOLERANCE == 0.02
    assert verdict["decode_tokens_per_s"] == pytest.approx(decode / 100.0)


def test_downgrade_without_measurements_is_not_ok() -> None:
    assert downgrade({}, {"decode_tokens_per_s": 1.0})["ok"] is False


def test_hydration_rates_per_rank_and_aggregate_over_the_slowest_rank() -> None:
    staged = [{"hydration": {"staged": {"bytes": 55_000_000_000, "copy_s": 1.0}, "phase_seconds": 0.1}},
              {"hydration": {"staged": {"bytes": 55_000_000_000, "copy_s": 1.1}, "phase_seconds": 0.1}}]
    rates = hydration_rates(staged)
    assert [r["gbps"] for r in rates["ranks"]] == pytest.approx([55.0, 50.0])
    assert rates["aggregate_gbps"] == pytest.approx(110e9 / 1.1 / 1e9)
    ring = hydration_rates([{"hydration": {"bytes": 8e9, "seconds": 2.0}}])
    assert ring["ranks"][0]["staged"] is False and ring["aggregate_gbps"] == pytest.approx(4.0)


def test_forget_other_runs_frees_other_weight_sets_then_earlier_captures(tmp_path: Path) -> None:
    tp = Activation(_args(), "sha256:x", tmp_path)
    tp.prepare()
    (tmp_path / "weights-405b-L60-tp8").mkdir()
    (tp.weights / "weights-rank-0.bin").write_bytes(b"kept")
    (tp.images / "tp4-old" / "rank-0").mkdir(parents=True)
    (tp.coord / "restore-1").mkdir()
    assert tp.forget_other_runs(weights=True) == ["weights-405b-L60-tp8"]
    assert (tp.weights / "weights-rank-0.bin").read_bytes() == b"kept" and (tp.images / "tp4-old").exists()
    assert sorted(tp.forget_other_runs(weights=False)) == ["restore-1", "tp4-old"]
    assert not list(tp.images.iterdir()) and not list(tp.coord.iterdir()) and tp.weights.exists()

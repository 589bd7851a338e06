"""bench/e2e_tp.py's fan-out and rollback against the real daemon and dockerd, for 2, 4 and 8 ranks (the GPU path
runs on nvidia-h200-x2/x4/x8 through scripts/device tp): every rank's restore unit is launched at once, and
when any rank's unit fails or the activation's deadline passes, every rank's unit is removed and the error names
each rank's cause, as a controller must see a failed TP activation."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import anyio
import pytest

from bench.e2e_restore import WEIGHTS, Driver, E2EError
from bench.e2e_tp import cold_start, failures, fault_weights, remove, restore
from bench.tp_units import Activation
from tests.helpers import ROOT, module_daemon
from tests.probe.test_coordinator import rank_images, stand_in_criu, with_weights

pytestmark = pytest.mark.usefixtures("no_leftovers")

CONFIG = '[runtime]\nprivileged = "host-capabilities"\n'


@pytest.fixture(scope="module")
def driver() -> Iterator[Driver]:
    """One daemon and one controller session for the module, as a controller keeps them across activations (a
    daemon start is about a second); every test ends with its units gone."""
    with closing(module_daemon(None, CONFIG)) as daemons:
        d = Driver(next(daemons).state_dir)
        anyio.run(d.open)
        yield d


def _activation(tmp_path: Path, image: str, world: int, *, python: str = "python3") -> Activation:
    """`world` ranks of the busybox test image as a capsule without the worker: no python3, no GPU."""
    args = argparse.Namespace(world_size=world, gpus="own", layers=1, tokens=1, shape="small", hydrator=True,
                              weights_dir="")
    tp = Activation(args, image, tmp_path)
    tp.layouts = [dataclasses.replace(layout, host_mounts=(), gpus=(), python=python) for layout in tp.layouts]
    for path in (tp.run_dir, tp.images, tp.coord, tp.weights):
        path.mkdir()
    return tp


@pytest.mark.parametrize("world", [2, 4, 8])
async def test_failed_rank_units_are_all_removed_naming_each_rank(driver: Driver, busybox_image: str, tmp_path: Path,
                                                                  world: int) -> None:
    tp = _activation(tmp_path, busybox_image, world)
    assert [layout.network for layout in tp.layouts] == ["host"] * world
    assert [layout.gpus for layout in Activation(tp.args, busybox_image, tmp_path).layouts] == [
        (str(r),) for r in range(world)]  # each rank's unit gets its own GPU
    with pytest.raises(E2EError) as caught:
        await restore(driver, tp, "cap-1", "restore-1", {}, deadline=30)
    assert all([await driver.gone(f"tp_node_{r}") for r in range(world)])
    message = str(caught.value)
    assert caught.value.code == "runtime_failed"
    for rank in range(world):
        assert f"rank {rank}: restore unit exited (code 1) before its readiness check" in message
    assert "python3: not found" in message


async def test_activation_deadline_removes_every_rank_unit(driver: Driver, busybox_image: str, tmp_path: Path) -> None:
    """Four units that run but never become ready: one activation deadline ends them all, naming each rank."""
    tp = _activation(tmp_path, busybox_image, 4, python="sleep 60; false")
    started = time.monotonic()
    with pytest.raises(E2EError) as caught:
        await restore(driver, tp, "cap-1", "restore-1", {}, deadline=3)
    assert time.monotonic() - started < 45  # not the units' 60 s: the deadline ended the activation
    assert all([await driver.gone(f"tp_node_{r}") for r in range(4)])
    for rank in range(4):
        assert f"rank {rank}: readiness check `test -s" in str(caught.value)


async def test_failure_cases_restore_what_they_break_and_leave_no_unit(driver: Driver, busybox_image: str,
                                                                     tmp_path: Path) -> None:
    """The bench's own fault injection, through dockerd: every case's units are removed, the copies of tampered
    images and the fault directories are deleted, and the real weight files were never touched."""
    tp = _activation(tmp_path, busybox_image, 2)
    for rank in range(2):
        images = tp.images / "cap-1" / f"rank-{rank}"
        images.mkdir(parents=True)
        (images / "capture.json").write_text(json.dumps({"identity": {"gpu_name": "NVIDIA H200"}}))
        (images / "graph.json").write_text(json.dumps({"record": {"decision": "x"}, "execution": {}}))
        (tp.weights / f"weights-rank-{rank}.bin").write_bytes(os.urandom(1 << 16))
    source = tp.weights / "weights-rank-1.bin"
    before, inode = source.read_bytes(), source.stat().st_ino
    rows = await failures(driver, tp, "cap-1", {})
    assert all([await driver.gone(f"tp_node_{r}") for r in range(2)])
    assert len(rows) == 6
    assert all(row["units_left"] == [] and row["error_code"] == "runtime_failed" for row in rows), rows
    assert not any(row["ok"] for row in rows)  # busybox has no worker: no case fails for the reason it names
    assert source.read_bytes() == before and source.stat().st_ino == inode
    assert sorted(p.name for p in tp.images.iterdir()) == ["cap-1"]
    assert not list(tmp_path.glob("fault-*"))


async def test_cold_start_rank_unit_that_exits_silently_ends_the_wait_naming_it(driver: Driver, busybox_image: str,
                                                                                 tmp_path: Path) -> None:
    """Three serving units that run and one that exits before it could log anything: the cold start fails at
    once (not after its 480 s limit), naming that rank."""
    tp = _activation(tmp_path, busybox_image, 4, python="sh")
    tp.serve_command = lambda rank: ["-c", "exit 3" if rank == 3 else "sleep 60"]  # type: ignore[method-assign]
    names = [f"tp-serving-{r}" for r in range(4)]
    started = time.monotonic()
    try:
        with pytest.raises(E2EError, match=r"rank\(s\) \[3\] failed before they were ready"):
            await cold_start(driver, tp)
        assert time.monotonic() - started < 15
    finally:
        await remove(driver, names)
    assert all([await driver.gone(name) for name in names])


# --- the worker itself in each rank's unit (the host's python3 and this checkout mounted into busybox units) -----

def _worker_activation(tmp_path: Path, image: str, world: int) -> Activation:
    """`world` restore units that run the real worker, up to the point where CRIU would run: their CRIU is a
    stand-in that answers `--version` (the worker checks first that its CRIU runs) and fails anything else."""
    tp = _activation(tmp_path, image, world)
    environment = {"PYTHONPATH": str(ROOT)}
    criu = stand_in_criu(tmp_path)
    tp.layouts = [dataclasses.replace(layout, host_mounts=("/usr", "/lib", "/lib64", str(ROOT), str(tmp_path)),
                                      python="/usr/bin/python3", extra_environment=environment, criu=str(criu))
                  for layout in tp.layouts]
    for rank in range(world):  # the units see the weights directory at /weights
        with_weights(rank_images(tp.images / "cap-1" / f"rank-{rank}", rank, world), rank, tp.weights,
                     seen_at=WEIGHTS)
    return tp


@pytest.mark.parametrize(("world", "case"), [(4, "missing"), (8, "corrupt")])
async def test_hydration_source_of_one_rank_stops_every_rank_unit_naming_it(driver: Driver, busybox_image: str,
                                                                            tmp_path: Path, world: int,
                                                                            case: str) -> None:
    """Regression: issue 27 item 4. The ranks' workers in their units, through the daemon: one rank's weights
    file missing or corrupt (as its unit sees it) fails every rank's restore before CRIU, naming the rank and
    the file, and no unit is left."""
    tp = _worker_activation(tmp_path, busybox_image, world)
    culprit = world - 1
    source = tp.weights / f"weights-rank-{culprit}.bin"
    before = source.read_bytes()
    with pytest.raises(E2EError) as caught:
        await restore(driver, tp, "cap-1", "restore-1", {}, deadline=30, weights={culprit: fault_weights(tp, case)})
    assert all([await driver.gone(f"tp_node_{r}") for r in range(world)])
    message = str(caught.value)
    expected = "cannot be read" if case == "missing" else "does not match the digest"
    assert f"region rank-{culprit}: source /weights/weights-rank-{culprit}.bin {expected}" in message
    for rank in range(world):
        assert f"rank {rank}: restore unit exited (code 1)" in message
    assert message.count(f"activation aborted at validated: rank {culprit} restore") >= world - 1  # every peer
    assert "criu" not in message.lower()  # no rank got as far as CRIU
    assert source.read_bytes() == before  # the real file was never touched


async def test_intact_sources_get_every_rank_unit_past_validation(driver: Driver, busybox_image: str,
                                                                  tmp_path: Path) -> None:
    """The control case: the same four units with every source intact all pass validation and fail only at CRIU,
    which these units do not have."""
    tp = _worker_activation(tmp_path, busybox_image, 4)
    with pytest.raises(E2EError) as caught:
        await restore(driver, tp, "cap-1", "restore-1", {}, deadline=30)
    assert all([await driver.gone(f"tp_node_{r}") for r in range(4)])
    assert len(list((tp.coord / "restore-1" / "validated").glob("*.json"))) == 4
    assert "hydration cannot succeed" not in str(caught.value) and "criu" in str(caught.value).lower()


async def test_bench_failure_cases_through_worker_units_name_what_the_worker_reports(driver: Driver, busybox_image: str,
                                                                                     tmp_path: Path) -> None:
    """The GPU run's failure step on four worker units: each case that needs no GPU and no CRIU (tampered record,
    missing peer, missing or corrupt source) is refused by every rank, names what the bench expects, and leaves
    no unit. The other two (another GPU, a process killed after CRIU) need the GPU machine."""
    tp = _worker_activation(tmp_path, busybox_image, 4)
    rows = {row["case"]: row for row in await failures(driver, tp, "cap-1", {})}
    cpu = ["tampered graph record on the last rank", "peer unit never arrives (rank 0 alone, 5 s barrier)",
           "rank 3's hydration source missing", "rank 3's hydration source corrupt (same size, other bytes)"]
    assert {case: (rows[case]["ok"], rows[case]["not_named"]) for case in cpu} == dict.fromkeys(cpu, (True, []))
    assert all(row["units_left"] == [] for row in rows.values())

"""bench/e2e_tp.py's rollback against the real daemon and dockerd (the GPU path runs on two H200 through
scripts/device-e2e-tp): when any rank's restore unit fails, every rank's unit is removed and the error names
each rank's cause, as a controller must see a failed TP activation."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from bench.e2e_restore import Driver, E2EError
from bench.e2e_tp import Activation, restore
from tests.helpers import running_daemon

pytestmark = pytest.mark.usefixtures("no_leftovers")

CONFIG = '[runtime]\nprivileged = "host-capabilities"\n'


def _activation(tmp_path: Path, image: str) -> Activation:
    """Two ranks of the busybox test image as a capsule without the worker: no python3, no GPU."""
    args = argparse.Namespace(world_size=2, gpus="own", layers=1, tokens=1)
    tp = Activation(args, image, tmp_path)
    tp.layouts = [dataclasses.replace(layout, host_mounts=(), gpus=(), python="python3") for layout in tp.layouts]
    for path in (tp.run_dir, tp.images, tp.coord):
        path.mkdir()
    return tp


async def test_failed_rank_units_are_all_removed_naming_each_rank(busybox_image: str, tmp_path: Path) -> None:
    tp = _activation(tmp_path, busybox_image)
    assert [layout.network for layout in tp.layouts] == ["host", "host"]
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        with pytest.raises(E2EError) as caught:
            await restore(d, tp, "cap-1", "restore-1", {}, readiness_timeout=15)
        assert await d.gone("tp_node_0") and await d.gone("tp_node_1")
    message = str(caught.value)
    assert caught.value.code == "runtime_failed"
    for rank in (0, 1):
        assert f"rank {rank}: restore unit exited (code 1) before its readiness check" in message
    assert "python3: not found" in message

"""bench/e2e_restore.py's failure paths against the real daemon and dockerd (the GPU path runs on the H200
through scripts/device e2e): a capsule without the restore worker, and a restore unit whose readiness check
never passes, each fail as `runtime_failed` naming the cause, with no container left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.e2e_restore import (
    READY,
    Driver,
    E2EError,
    Layout,
    check_worker,
    restore_unit,
    start_cell,
    start_phases,
    unit_labels,
    unix,
)
from tests.helpers import running_daemon

pytestmark = pytest.mark.usefixtures("no_leftovers")

# The restore unit is privileged; dockerd's bounding set here lacks CAP_SYS_RESOURCE, as on the H200.
CONFIG = '[runtime]\nprivileged = "host-capabilities"\n'


def _layout(tmp_path: Path) -> Layout:
    """The busybox test image as a capsule without the worker: no python3, no coldsnap_probe, no GPU."""
    for sub in ("run", "images", "weights"):
        (tmp_path / sub).mkdir()
    return Layout(run_dir=tmp_path / "run", images_dir=tmp_path / "images", weights=tmp_path / "weights",
                  python="python3", host_mounts=(), gpus=())


async def test_check_worker_capsule_without_worker_fails_runtime_failed(busybox_image: str, tmp_path: Path) -> None:
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        with pytest.raises(E2EError) as caught:
            await check_worker(d, busybox_image, _layout(tmp_path))
    assert caught.value.code == "runtime_failed"
    assert "carries no usable restore worker" in str(caught.value)
    assert "python3" in str(caught.value)  # the cause: the worker's interpreter is not in the capsule


async def test_restore_unit_without_worker_fails_naming_cause_and_removes(busybox_image: str,
                                                                          tmp_path: Path) -> None:
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        with pytest.raises(E2EError) as caught:
            await restore_unit(d, busybox_image, _layout(tmp_path), "e2etest_node_0", "cap-1",
                               labels=unit_labels("cap-1", "e2etest"), readiness_timeout=15)
        assert await d.gone("e2etest_node_0")
    message = str(caught.value)
    assert caught.value.code == "runtime_failed"
    assert "exited (code 1) before its readiness check" in message
    assert "python3: not found" in message  # the unit's own last words name the missing worker
    assert "removed" in message


async def test_restore_unit_readiness_never_passes_fails_and_removes(busybox_image: str, tmp_path: Path) -> None:
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        with pytest.raises(E2EError) as caught:
            await restore_unit(d, busybox_image, _layout(tmp_path), "e2etest_node_0", "cap-1",
                               labels=unit_labels("cap-1", "e2etest"), readiness_timeout=1.0,
                               command=["-c", "echo restoring; exec sleep 600"])
        assert await d.gone("e2etest_node_0")
    message = str(caught.value)
    assert caught.value.code == "runtime_failed"
    assert f"readiness check `test -s {READY}` never passed within 1 s" in message
    assert "restoring" in message  # the log tail comes with it


def test_start_phases_are_read_from_the_workers_marks_and_dockers_start_time() -> None:
    def mark(name: str, seconds: float) -> dict[str, Any]:
        return {"name": name, "unix_ns": round(seconds * 1e9), "since_restore_begin_s": 0.0}

    report = {"worker_start": [mark("worker_main", 100.25), mark("imports_done", 100.30)],
              "timeline": [mark("restore_begin", 100.31), mark("criu_restore_begin", 100.35),
                           mark("cuda_driver_ready", 100.62), mark("criu_restore_end", 100.63)],
              "criu_restore_seconds": 0.25}
    found = start_phases(report, 100.0, "1970-01-01T00:01:40.123456789Z")
    assert found == pytest.approx({"container_started_s": 0.123456789, "worker_main_s": 0.25,
                                   "worker_imported_s": 0.30, "criu_started_s": 0.35, "cuda_driver_ready_s": 0.62,
                                   "criu_returned_s": 0.63})
    before = {"timeline": [report["timeline"][0], report["timeline"][3]], "criu_restore_seconds": 0.28}
    assert start_phases(before, 100.0, None) == pytest.approx({  # a worker without the marks: CRIU's start derived
        "container_started_s": None, "worker_main_s": None, "worker_imported_s": None, "criu_started_s": 0.35,
        "cuda_driver_ready_s": None, "criu_returned_s": 0.63})
    assert start_cell(found) == ("container started 0.123, worker main 0.250, imported 0.300, CRIU started 0.350, "
                                 "driver ready 0.620, CRIU returned 0.630")
    assert "driver ready -, CRIU returned 0.630" in start_cell(start_phases(before, 100.0, None))
    assert unix("2026-12-01T22:50:00Z") == 1796165400.0

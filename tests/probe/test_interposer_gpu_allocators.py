"""Issue 36 item 1 on a GPU: PyTorch's two other allocators moved at line rate by the interposer, the engine
unchanged. With `expandable_segments:True` torch maps its own cuMemCreate pages into one large reservation; with
`backend:cudaMallocAsync` it allocates stream-ordered from the device's pool. Each: tensors, a cuBLAS matmul and a
captured CUDA graph; the status and the release say ≥ 95 % of the device bytes go at line rate (`moved`), the rest
named in `uncovered`; release, CUDA checkpoint and restore from a second process, hydrate: same digests and graph
output; then frees and allocations after the restore (torch's cache emptied: expandable pages unmapped and released
through the engine's handles, the pool trimmed) read back what they were given, and a second release and hydration
still holds. Through the workers (CRIU): the capture report's `moved` and `uncovered`. Skipped without a driver."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe.hydration import DeviceDump, build_library, check_dump, dump_identities
from coldsnap_probe.hydration._interposer import interposer_request
from tests.probe.test_interposer_gpu import MIB, Target, checkpoint_and_restore, dump_hydrator  # noqa: F401 - a fixture
from tests.probe.test_main import has_nvidia_driver

pytestmark = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
CONFS = {"expandable_segments:True": ("vmm_by_engine", "native"), "backend:cudaMallocAsync": ("stream_ordered",
                                                                                                "cudaMallocAsync")}
HOST_KINDS = {"host_registered", "host_pinned", "unwrapped_entry_points"}  # not device memory
MOVED_MIB = 1024  # beside it, what stays is small: a graph-owned output, cuBLAS workspaces made in the capture


def coverage(moved: dict[str, dict[str, int]], uncovered: dict[str, dict[str, int]]) -> float:
    """The share of device bytes moved at line rate: moved over moved plus what stayed on the checkpoint path."""
    at_line_rate = sum(k["bytes"] for k in moved.values())
    stayed = sum(v["bytes"] for kind, v in uncovered.items() if kind not in HOST_KINDS)
    return at_line_rate / max(1, at_line_rate + stayed)


@pytest.fixture(params=sorted(CONFS))
def conf_target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Target]]:
    library, diagnostics = build_library(tmp_path / "lib")
    assert diagnostics == ""
    target = Target(tmp_path, library, socket="cuda-%p.sock", mib=MOVED_MIB, alloc_conf=request.param)
    try:
        yield request.param, target
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target.proc.pid, 9)
        target.proc.wait()


def socket_of(target: Target) -> str:
    return target.socket.replace("%p", str(target.proc.pid))


def status(target: Target) -> dict[str, Any]:
    from coldsnap_probe.hydration._interposer import interposer_request

    return interposer_request(socket_of(target), {"op": "status"}, "status")


def test_each_allocator_is_moved_at_line_rate_through_a_cuda_checkpoint(conf_target: tuple[str, Target],
                                                                      tmp_path: Path) -> None:
    conf, target = conf_target
    source, backend = CONFS[conf]
    target.socket = socket_of(target)
    assert target.ready["backend"] == backend, target.ready  # the setting took
    before = status(target)
    assert before["moved"][source]["bytes"] >= MOVED_MIB * MIB, before
    assert coverage(before["moved"], before["uncovered"]) >= 0.95, (before["moved"], before["uncovered"])
    dump = target.release(tmp_path / "dump")  # (freed stream-ordered regions kept for reuse are let go first)
    assert dump.moved[source]["bytes"] >= MOVED_MIB * MIB and dump.bytes == sum(k["bytes"] for k in dump.moved.values())
    assert coverage(dump.moved, dump.uncovered) >= 0.95, (dump.moved, dump.uncovered)
    check_dump(dump, tmp_path / "dump", content=True)
    released = status(target)
    assert released["released"] is True and released["mapped_bytes"] == 0 and released["gate"] == "closed"
    checkpoint_and_restore(target.proc.pid)
    report = target.request({"op": "hydrate", "policy": "same-gpu"})["report"]
    assert report["bytes"] == dump.bytes and report["regions"] == len(dump.regions)
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
    churned = target.ask("churn")
    assert churned["ok"] is True and churned["matmul"] == target.ready["matmul"], churned
    after = status(target)
    assert after["gate"] == "open" and after["mapped_bytes"] == after["bytes"], after
    again = target.release(tmp_path / "again")  # what the allocator made or let go after the restore moves too
    assert coverage(again.moved, again.uncovered) >= 0.95, (again.moved, again.uncovered)
    target.request({"op": "hydrate", "verify": "sampled"})
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}


criu_and_gpu = pytest.mark.skipif(not has_nvidia_driver() or shutil.which("criu") is None,
                                  reason="needs an NVIDIA driver and CRIU (run on the GPU host)")


@criu_and_gpu
def test_the_capture_report_says_what_was_moved_and_what_stayed(conf_target: tuple[str, Target],
                                                                tmp_path: Path) -> None:
    from tests.probe.test_worker import kill_and_reap, worker

    conf, target = conf_target
    source, _backend = CONFS[conf]
    ctypes.CDLL(None).prctl(36, 1)  # a subreaper: the restored tree is reparented here
    images = tmp_path / "images"
    done = worker("capture", "--pid", str(target.proc.pid), "--images", str(images), "--criu",
                  shutil.which("criu") or "")
    assert done.returncode == 0, done.stderr
    target.proc.wait()
    [released] = json.loads(done.stdout)["device_memory"]
    assert released["state"] == "released" and released["moved"][source]["bytes"] >= MOVED_MIB * MIB, released
    assert coverage(released["moved"], released["uncovered"]) >= 0.95, released
    done = worker("restore", "--images", str(images), "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [hydrated] = report["device_memory"]
    assert hydrated["bytes"] == released["bytes"]
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
    assert target.ask("churn")["ok"] is True
    kill_and_reap(report["restored_pid"])


def staged_hydration(target: Target, dump: DeviceDump, images: Path, name: str, hydrator: str) -> dict[str, Any]:
    """The restore worker's staged path for `target`'s dump under `images/name`: the node hydrator stages one
    allocation per page, the interposer adopts them; the interposer's report."""
    from coldsnap_probe.memory._device_dump import DumpRecord, hydrate_devices, stages_for

    record = DumpRecord(target.proc.pid, target.socket, name, dump, dump_identities(dump, images / name), hydrator)
    stages = stages_for([record], images)
    assert stages, "no stage asked"
    [hydrated] = hydrate_devices([record], images, "same-model", stages=stages)
    assert hydrated.bytes == dump.bytes
    return hydrated.interposer


def test_expandable_segments_are_restored_from_a_node_hydrators_stage(dump_hydrator: str,  # noqa: F811
                                                                       tmp_path: Path) -> None:
    """Regression: the H200 staged every page of an expandable-segments engine and then refused them all ("the
    engine's allocation is GPUDirect RDMA capable, the staged one is not": an imported allocation is not RDMA
    capable in the importing process), filling the pages itself after the stage: 2.2-2.6 s to the first token at
    16 GiB instead of 1.1-1.3. Now the hydrator stages the pages grouped (one allocation per 1 GiB of them) and
    the interposer re-creates each page as the engine made it (RDMA capable, the engine's handle kept) and copies
    it from the stage on the device: the fast path is taken (`staged`, `copy_s`, no `adopt_error`), through a
    CUDA checkpoint; the engine then frees and allocates through its own handles, and a second release and staged
    hydration (capture, restore, capture, restore) holds too."""
    from coldsnap_probe.memory._device_dump import stage_groups

    library, diagnostics = build_library(tmp_path / "lib")
    assert diagnostics == ""
    target = Target(tmp_path, library, socket="cuda-%p.sock", mib=MOVED_MIB, alloc_conf="expandable_segments:True")
    try:
        target.socket = socket_of(target)
        dump = target.release(tmp_path / "dump")
        assert dump.moved["vmm_by_engine"]["count"] > 16, dump.moved  # many pages, grouped
        groups = stage_groups([r.size for r in dump.regions])[-1] + 1
        checkpoint_and_restore(target.proc.pid)
        report = staged_hydration(target, dump, tmp_path, "dump", dump_hydrator)
        assert report.get("staged") is True and "copy_s" in report and "adopt_error" not in report["stage"], report
        assert report["regions"] == len(dump.regions) and report["stage"]["allocations"] == groups < len(dump.regions)
        # The target's 160 MiB of zeros: set on the device by the stage and again by the copy, never read nor copied.
        assert report["zero_bytes"] >= 128 * MIB and report["stage"]["zero_bytes"] == report["zero_bytes"], report
        assert (report["zero_set_bytes"], report["stage_copied_bytes"]) == (
            report["zero_bytes"], dump.bytes - report["zero_bytes"]), report
        assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
        assert target.ask("churn")["ok"] is True  # empty_cache: re-created pages unmapped, released by the engine
        again = target.release(tmp_path / "again")
        assert again.moved["vmm_by_engine"]["count"] > 0 and coverage(again.moved, again.uncovered) >= 0.95
        report = staged_hydration(target, again, tmp_path, "again", dump_hydrator)
        assert report.get("staged") is True and "adopt_error" not in report["stage"], report
        assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
        assert interposer_request(dump_hydrator, {"op": "status"}, "hydrator status")["staged"] == []  # all taken
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target.proc.pid, 9)
        target.proc.wait()

"""The worker's typed reports (`_reports.py`): their JSON keeps the keys the daemon and the benches decode."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from coldsnap_probe._reports import (
    CapturedGraphPolicy,
    CaptureReport,
    DumpedDevice,
    HydratedDevice,
    HydratedWeights,
    ReleasedWeights,
    RestoredGraphPolicy,
    RestoreReport,
    StackLimit,
    Timeline,
)
from coldsnap_probe.errors import ChannelError

CAPTURE_ALWAYS = {"format", "kind", "boundary", "root_pid", "tree", "started_unix", "rank", "world_size", "engine",
                  "cuda_pids", "identity", "engine_quiesced", "timings_s", "barrier_wait_s", "image_bytes",
                  "image_files", "completed_unix"}
CAPTURE_OPTIONAL = {"graph_policy", "engine_quiesce", "hydration", "memory_sources", "memory_before_checkpoint",
                    "memory_after_checkpoint", "image_digest", "event_loops", "shared_files", "cuda_ipc"}
RESTORE_ALWAYS = {"format", "kind", "rank", "world_size", "timeline", "barrier_wait_s", "restore_seconds",
                  "ready_seconds"}
RESTORE_OPTIONAL = {"boundary", "captured_root_pid", "cuda_pids", "identity_compatibility", "graph_policy",
                    "criu_restore_seconds", "restored_pid", "peer_criu_restore_seconds", "cuda_restore_seconds",
                    "peer_cuda_restore_seconds", "all_pages_in_seconds", "hydration", "engine_resume",
                    "communicator_recreate_seconds", "memory_sources", "shared_files"}


@dataclass(frozen=True)
class DiskRead:
    """A memory source's report with no field of its own (`memory_sources`, by name)."""

    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes}


def test_a_minimal_capture_report_has_exactly_the_keys_always_written() -> None:
    report = CaptureReport(boundary="n580", root_pid=7, tree=[7, 8], rank=0, world_size=1, engine=None)
    value = report.to_json()
    assert set(value) == CAPTURE_ALWAYS
    assert (value["format"], value["kind"], value["engine"]) == (1, "coldsnap-cuda-criu-capture", None)


def test_a_full_capture_report_adds_each_optional_key_in_its_shape() -> None:
    report = CaptureReport(boundary="n610", root_pid=7, tree=[7], rank=1, world_size=2, engine="/run/e.sock")
    report.graph_policy = CapturedGraphPolicy("auto", "recreate-from-plan", "recreate-from-plan", "why")
    report.engine_quiesce = {"ok": True, "communicators": 0}
    report.hydration = ReleasedWeights(4096, 2, 0.5, "sha256:p", "sha256:m")
    report.memory_before_checkpoint = report.memory_after_checkpoint = {"7": {"anonymous_bytes": 1}}
    report.image_digest = "sha256:i"
    report.memory_sources["disk"] = DiskRead(5)
    report.event_loops = {"7": "uvloop"}
    report.shared_files = [{"path": "/dev/shm/psm_1", "bytes": 4096, "mode": 0o600, "uid": 0, "gid": 0,
                            "sha256": "0" * 64}]
    report.cuda_ipc = {"checked": [7], "unchecked": []}
    value = json.loads(json.dumps(report.to_json()))
    assert value["memory_sources"] == {"disk": {"bytes": 5}}
    assert set(value) == CAPTURE_ALWAYS | CAPTURE_OPTIONAL
    assert value["graph_policy"] == {"requested": "auto", "recorded": "recreate-from-plan",
                                     "effective": "recreate-from-plan", "reason": "why"}
    assert value["hydration"] == {"released_bytes": 4096, "regions": 2, "release_seconds": 0.5,
                                  "plan_digest": "sha256:p", "manifest_digest": "sha256:m"}


def timeline(*names: str) -> Timeline:
    t = Timeline()
    for name in names:
        t.mark(name)
    return t


def test_a_minimal_restore_report_has_exactly_the_keys_always_written() -> None:
    report = RestoreReport(rank=0, world_size=1, timeline=timeline("restore_begin", "process_resumed", "ready"))
    value = report.to_json()
    assert set(value) == RESTORE_ALWAYS
    assert [set(m) for m in value["timeline"]] == [{"name", "unix_ns", "since_restore_begin_s"}] * 3
    assert value["timeline"][0]["since_restore_begin_s"] == 0.0
    assert 0 <= value["restore_seconds"] <= value["ready_seconds"]


def test_a_full_restore_report_adds_each_optional_key_in_its_shape() -> None:
    report = RestoreReport(rank=0, world_size=2, boundary="n610", captured_root_pid=7, cuda_pids=[7],
                           identity_compatibility="exact",
                           graph_policy=RestoredGraphPolicy("recreate-from-plan", "d", "sha256:x"),
                           criu_restore_seconds=1.0, restored_pid=7, peer_criu_restore_seconds=[1.0, 1.1],
                           cuda_restore_seconds=0.5, peer_cuda_restore_seconds=[0.5, 0.6], all_pages_in_seconds=2.0,
                           hydration=HydratedWeights(10, 0.1, 1e-7, 1, {"strategy": "ring"}, None, 0.2),
                           engine_resume={"ok": True}, communicator_recreate_seconds=0.3,
                           timeline=timeline("restore_begin", "process_resumed", "ready"),
                           memory_sources={"disk": DiskRead(5)}, shared_files=["/dev/shm/psm_1"])
    value = json.loads(json.dumps(report.to_json()))
    assert set(value) == RESTORE_ALWAYS | RESTORE_OPTIONAL
    assert value["memory_sources"] == {"disk": {"bytes": 5}}
    assert value["hydration"] == {"bytes": 10, "seconds": 0.1, "gbps": 1e-7, "regions_verified": 1,
                                  "engine": {"strategy": "ring"}, "staged": None, "phase_seconds": 0.2}
    assert value["graph_policy"] == {"effective": "recreate-from-plan", "decision": "d", "plan_sha256": "sha256:x"}


def test_timeline_seconds_between_marks() -> None:
    t = timeline("a", "b")
    assert t.seconds("a", "b") == (t.marks[1].unix_ns - t.marks[0].unix_ns) / 1e9 >= 0


# -- the interposer's stack limit (issue 35): what a release lowered, what the set-back took ------------------------
LOWERED = {"enabled": True, "engine_bytes": 4096, "set_bytes": 256, "contexts": 1, "contexts_left": 0,
           "seconds": 0.0004}


def test_a_release_that_lowered_the_stack_limit_reports_it_in_the_capture() -> None:
    stack = StackLimit.from_json(json.loads(json.dumps(LOWERED)))
    device = DumpedDevice(pid=7, socket="/run/cuda-7.sock", state="released", bytes=1 << 30, stack_limit=stack)
    assert device.to_json()["stack_limit"] == LOWERED  # no `error` key when nothing failed
    failed = StackLimit.from_json({**LOWERED, "set_bytes": 4096, "error": "context 0x1: cuCtxSetLimit: E"})
    assert failed.to_json()["error"] == "context 0x1: cuCtxSetLimit: E" and failed.set_bytes == 4096
    assert "stack_limit" not in DumpedDevice(pid=7, socket="/s", state="empty").to_json()  # nothing released


@pytest.mark.parametrize(("value", "message"), [
    ([], "stack_limit must be an object, got list"),
    ({**LOWERED, "lowered": 1}, r"stack_limit has unknown keys \['lowered'\]"),
    ({**LOWERED, "enabled": 1}, "stack_limit.enabled must be true or false"),
    ({**LOWERED, "engine_bytes": -1}, "stack_limit.engine_bytes must be an integer >= 0, got -1"),
    ({**LOWERED, "set_bytes": True}, "stack_limit.set_bytes must be an integer >= 0, got True"),
    ({k: v for k, v in LOWERED.items() if k != "contexts"}, "stack_limit.contexts must be an integer >= 0, got None"),
    ({**LOWERED, "contexts_left": -2}, "stack_limit.contexts_left must be an integer >= 0, got -2"),
    ({**LOWERED, "seconds": "0"}, r"stack_limit.seconds must be a number of seconds \(0 to 86400\), got '0'"),
    ({**LOWERED, "error": 5}, "stack_limit.error must be a string")])
def test_a_malformed_stack_limit_answer_is_refused_naming_the_field_and_the_rule(value: object, message: str) -> None:
    with pytest.raises(ChannelError, match=message):
        StackLimit.from_json(value)


def test_a_stack_limit_answer_of_an_older_interposer_without_contexts_left_decodes() -> None:
    """Review (issue 34, item 5): an interposer from before `contexts_left` answered without it, and the capture's
    report was refused as malformed."""
    older = {k: v for k, v in LOWERED.items() if k != "contexts_left"}
    assert StackLimit.from_json(older).contexts_left == 0


def test_the_restore_report_says_what_setting_the_stack_limit_back_took() -> None:
    hydrated = HydratedDevice(pid=7, bytes=1, seconds=0.1, gbps=1.0, interposer={"bytes": 1, "stack_restore_s": 0.002})
    assert hydrated.to_json()["stack_restore_s"] == 0.002 == hydrated.stack_restore_s
    older = HydratedDevice(pid=7, bytes=1, seconds=0.1, gbps=1.0, interposer={"bytes": 1})  # an older interposer
    assert "stack_restore_s" not in older.to_json()

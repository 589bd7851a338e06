"""Capsule phase reports: real units write into the directory the daemon mounts; the daemon's scrape
holds their phases, and whatever else a capsule leaves there only counts as rejected (issue 26 item 2)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from coldsnap_provider._capsule_reports import CapsuleReports
from coldsnap_provider._metrics import Metrics
from coldsnap_runtime import REPORT_DIR_LABEL, DockerBackend, RuntimeContext, dispatch
from coldsnap_runtime.schema import WorkloadRun
from tests.helpers import Session, next_id, running_daemon, short_dir
from tests.provider.test_metrics import sample, scrape

# A restore report as the worker writes it (coldsnap_probe/_worker.py), keys the daemon ignores included.
RESTORE_REPORT: dict[str, Any] = {
    "format": 1, "kind": "coldsnap-cuda-criu-restore", "rank": 0, "world_size": 1, "boundary": "n610",
    "cuda_pids": [41], "criu_restore_seconds": 2.5, "cuda_restore_seconds": 0.75, "restored_pid": 41,
    "hydration": {"bytes": 1 << 30, "seconds": 0.2, "gbps": 5.0, "regions_verified": 3, "engine": {},
                  "staged": None, "phase_seconds": 0.3},
    "timeline": [{"name": "restore_begin", "unix_ns": 1, "since_restore_begin_s": 0.0}],
    "restore_seconds": 3.4, "ready_seconds": 3.9, "barrier_wait_s": {},
}
CAPTURE_REPORT: dict[str, Any] = {
    "format": 1, "kind": "coldsnap-cuda-criu-capture", "boundary": "n610", "root_pid": 7, "tree": [7],
    "timings_s": {"cuda_lock": 0.01, "cuda_checkpoint": 1.5, "criu_dump": 4.0, "evil_phase_name": 1.0},
    "identity": {"driver": "x"}, "image_bytes": 10, "image_files": 1,
}


def _metrics_config(sock: Path) -> str:
    return f'[metrics]\naddress = "unix:{sock}"\n'


async def _run_capsule(session: Session, image: str, script: str) -> str:
    reply = await session.runtime("workload-run", workload={
        "name": "", "image": image, "combined": True, "remove_after_exit": True, "entrypoint": "sh",
        "command": ["-c", script]})
    assert reply.ok, reply.error
    assert reply.runtime is not None and isinstance(reply.runtime.output, bytes)
    return reply.runtime.output.decode()


def _write(payload: dict[str, Any], name: str) -> str:
    text = shlex.quote(json.dumps(payload))
    return f'printf %s {text} > "$COLDSNAP_REPORT_DIR/.{name}.tmp" && mv "$COLDSNAP_REPORT_DIR/.{name}.tmp" ' \
           f'"$COLDSNAP_REPORT_DIR/{name}.json"'


async def _scrape_until(sock: Path, done: Any) -> str:
    deadline = time.monotonic() + 10
    while True:
        text = await anyio.to_thread.run_sync(scrape, sock)
        if done(text) or time.monotonic() > deadline:
            return text
        await anyio.sleep(0.25)


def _unit_dirs(state_dir: Path) -> list[Path]:
    return sorted((state_dir / "capsule-reports").iterdir())


@pytest.mark.usefixtures("no_leftovers")
async def test_capsule_reports_feed_the_phase_histograms(busybox_image: str) -> None:
    sock = short_dir("cs-cr-") / "metrics.sock"
    async with running_daemon(_metrics_config(sock)) as daemon:
        session = await daemon.open_session()
        seen = await _run_capsule(session, busybox_image, 'echo "dir=$COLDSNAP_REPORT_DIR"; '
                                  + _write(RESTORE_REPORT, "restore") + " && " + _write(CAPTURE_REPORT, "capture"))
        assert "dir=/run/coldsnap/reports" in seen
        text = await _scrape_until(sock, lambda t: sample(t, "coldsnap_provider_capsule_reports_total",
                                                          kind="capture") == 1)
        assert sample(text, "coldsnap_restore_phase_seconds_count", phase="criu_restore", mode="hydrate") == 1
        assert sample(text, "coldsnap_restore_phase_seconds_sum", phase="criu_restore", mode="hydrate") == 2.5
        assert sample(text, "coldsnap_restore_phase_seconds_sum", phase="cuda_restore", mode="hydrate") == 0.75
        assert sample(text, "coldsnap_restore_phase_seconds_sum", phase="hydration", mode="hydrate") == 0.3
        assert sample(text, "coldsnap_restore_phase_seconds_sum", phase="ready_total", mode="hydrate") == 3.9
        assert sample(text, "coldsnap_capture_phase_seconds_sum", phase="criu_dump", mode="full") == 4.0
        assert sample(text, "coldsnap_provider_capsule_reports_total", kind="restore") == 1
        assert "evil_phase_name" not in text  # an unknown phase makes no series
        units = _unit_dirs(daemon.state_dir)
        assert len(units) == 1 and list(units[0].iterdir()) == []  # read once, then removed
        assert oct(units[0].stat().st_mode & 0o7777) == oct(0o1733)


_HOSTILE = " ; ".join([
    'cd "$COLDSNAP_REPORT_DIR"',
    "printf 'not json at all' > junk.json",
    "ln -s /etc/shadow shadow.json",
    "mkfifo fifo.json",
    "dd if=/dev/zero of=huge.json bs=1024 count=2048 2>/dev/null",
    "mkdir nested.json && echo x > nested.json/inner",
    "printf '%s' '" + json.dumps({**RESTORE_REPORT, "criu_restore_seconds": -5}) + "' > negative.json",
    "printf '%s' '" + json.dumps({**RESTORE_REPORT, "kind": "something-else"}) + "' > kind.json",
    "printf '%s' '" + json.dumps({**RESTORE_REPORT, "restore_seconds": True}) + "' > bool.json",
    "(printf '{\"format\":1,\"x\":'; head -c 300000 /dev/zero | tr '\\0' '['; ) > deep.json",
])


@pytest.mark.usefixtures("no_leftovers")
async def test_hostile_capsule_reports_change_nothing_but_the_rejected_counter(busybox_image: str) -> None:
    sock = short_dir("cs-cr-") / "metrics.sock"
    shadow = Path("/etc/shadow").read_bytes()
    async with running_daemon(_metrics_config(sock)) as daemon:
        session = await daemon.open_session()
        await _run_capsule(session, busybox_image, _HOSTILE)
        # Written aside, then moved in at once: a scan in the middle of a slow loop (a loaded machine) saw some and
        # rejected the rest in a later scan as malformed.
        await _run_capsule(session, busybox_image, 'cd "$COLDSNAP_REPORT_DIR"; mkdir .r; i=0; '
                           'while [ $i -lt 300 ]; do echo x > .r/f$i.json; i=$((i+1)); done; mv .r/* .; rmdir .r')

        def rejected(text: str) -> float:
            return sum(sample(text, "coldsnap_provider_capsule_reports_rejected_total", reason=r)
                       for r in ("not_regular", "too_large", "malformed", "too_many", "unreadable"))

        text = await _scrape_until(sock, lambda t: rejected(t) >= 10)
        assert sample(text, "coldsnap_provider_capsule_reports_rejected_total", reason="not_regular") == 3
        assert sample(text, "coldsnap_provider_capsule_reports_rejected_total", reason="too_large") == 1
        assert sample(text, "coldsnap_provider_capsule_reports_rejected_total", reason="malformed") == 5
        assert sample(text, "coldsnap_provider_capsule_reports_rejected_total", reason="too_many") == 1
        assert sample(text, "coldsnap_provider_capsule_reports_total", kind="restore") == 0
        assert "coldsnap_restore_phase_seconds_count{" not in text
        for unit in _unit_dirs(daemon.state_dir):
            assert list(unit.iterdir()) == []  # everything removed, the link's target untouched
        assert Path("/etc/shadow").read_bytes() == shadow
        assert (await session.call("exec", host="localhost", arguments=["true"])).ok  # still serving


def test_worker_leaves_a_report_the_daemon_accepts(tmp_path: Path) -> None:
    """The worker side (coldsnap_probe/_report_dir.py) and the daemon's decoder agree on the shape."""
    program = ("import json, sys; from coldsnap_probe._report_dir import leave_report; "
               "leave_report(json.loads(sys.argv[1]))")
    unit = tmp_path / "reports" / "unit"
    unit.mkdir(parents=True)
    env = {**os.environ, "COLDSNAP_REPORT_DIR": str(unit)}
    subprocess.run([sys.executable, "-c", program, json.dumps(RESTORE_REPORT)], env=env, check=True)
    names = os.listdir(unit)
    assert len(names) == 1 and names[0].startswith("coldsnap-cuda-criu-restore-") and names[0].endswith(".json")
    metrics = Metrics()
    reports = CapsuleReports(tmp_path / "reports", metrics)
    accepted, rejected = reports._scan_all()
    assert rejected == [] and [(p.kind, p.mode) for p in accepted] == [("restore", "hydrate")]
    assert accepted[0].seconds["criu_restore"] == 2.5 and os.listdir(unit) == []
    # Without the variable the worker writes nothing anywhere.
    env.pop("COLDSNAP_REPORT_DIR")
    subprocess.run([sys.executable, "-c", program, json.dumps(RESTORE_REPORT)], env=env, check=True, cwd=tmp_path)
    assert os.listdir(unit) == []


async def test_report_directories_of_gone_units_are_reaped(busybox_image: str, tmp_path: Path) -> None:
    reports = CapsuleReports(tmp_path / "capsule-reports", Metrics())
    reports.prepare()
    predecessor = tmp_path / "capsule-reports" / "0123456789abcdef"  # left by an earlier daemon
    predecessor.mkdir()
    (predecessor / "x.json").write_text("{}")
    fresh = Path(reports.allocate())  # its workload-run may still be creating the unit
    held = Path(reports.allocate())
    reports._allocated[held.name] -= 3600  # old, but a live unit carries it
    name = f"cs-reap-{next_id()[-8:]}"
    run = msgspec.convert({"action": "workload-run", "workload": {
        "name": name, "image": busybox_image, "detached": True, "entrypoint": "sleep", "command": ["60"]}},
        WorkloadRun)
    async with DockerBackend() as backend:
        try:
            await dispatch(backend, run, RuntimeContext(host="localhost", allow_pull=False, report_dir=str(held)))
            info = await backend.workload_inspect(name, include_start_time=False)
            assert info.labels[REPORT_DIR_LABEL] == held.name
            await reports.reap(backend)
            assert not predecessor.exists() and fresh.exists() and held.exists()
        finally:
            await backend.workload_remove(name)
        reports._allocated[fresh.name] -= 3600
        await reports.reap(backend)  # its unit is gone (or never came): both go now
    assert not fresh.exists() and not held.exists()


def test_reports_of_the_cuda_interposer_have_their_own_mode_and_phases() -> None:
    """A capture whose interposer released device memory, a restore that hydrated it (docs/interposer.md)."""
    from coldsnap_provider._capsule_reports import _decode, phases_of

    capture = {**CAPTURE_REPORT, "timings_s": {**CAPTURE_REPORT["timings_s"], "device_release": 0.9},
               "device_memory": [{"pid": 7, "socket": "/run/cuda-7.sock", "state": "released", "bytes": 1 << 34}]}
    restore = {**RESTORE_REPORT, "device_hydration_seconds": 0.8, "device_memory": [{"pid": 7, "bytes": 1 << 34}]}
    released, hydrated = phases_of(_decode(json.dumps(capture))), phases_of(_decode(json.dumps(restore)))
    assert (released.mode, released.seconds["device_release"]) == ("interposer", 0.9)
    assert (hydrated.mode, hydrated.seconds["device_hydration"]) == ("interposer", 0.8)
    unused = {**capture, "device_memory": [{"pid": 7, "socket": "/run/cuda-7.sock", "state": "not-started"}]}
    assert phases_of(_decode(json.dumps(unused))).mode == "full"
    metrics = Metrics()
    metrics.phases("restore", hydrated.mode, hydrated.seconds)
    assert sample(metrics.render("")[0].decode(), "coldsnap_restore_phase_seconds_sum", phase="device_hydration",
                  mode="interposer") == 0.8


async def test_a_capsules_report_of_its_stages_moves_no_stage_counter(tmp_path: Path) -> None:
    """Regression (review10's open finding, issue 34): the daemon counted the node hydrator's stages per tier from the
    stage answers a capsule's restore report carried, so a capsule could write any tier and any size there. Only the
    hydrators' own counts feed those metrics now (_hydrator_stages.py); the report still counts as a restore."""
    stage = {"staged": True, "stage_s": 0.3, "copy_s": 0.25, "bytes": 3 << 30, "tier": "ram"}
    report = {**RESTORE_REPORT, "device_memory": [{"pid": 41, "bytes": 3 << 30,
                                                   "interposer": {"bytes": 3 << 30, "stage": stage}}]}
    unit = tmp_path / "reports" / "unit"
    unit.mkdir(parents=True)
    program = ("import json, sys; from coldsnap_probe._report_dir import leave_report; "
               "leave_report(json.loads(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", program, json.dumps(report)], check=True,
                   env={**os.environ, "COLDSNAP_REPORT_DIR": str(unit)})
    metrics = Metrics()
    await CapsuleReports(tmp_path / "reports", metrics).scan()
    text = metrics.render("")[0].decode()
    assert sample(text, "coldsnap_provider_capsule_reports_total", kind="restore") == 1
    assert "coldsnap_provider_hydrator_stage" not in text and os.listdir(unit) == []

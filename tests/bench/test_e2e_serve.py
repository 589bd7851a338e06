"""bench/e2e_serve.py's failure paths against the real daemon and dockerd (the GPU path runs on the H200
through scripts/device serve): a server that dies before its first token, and a restore that fails while the
client already waits on the port, each fail as one E2EError naming the cause, with no unit left behind; the
forked-workers case runs its server in a unit and reports its failed capture the same way; the staged path's
node hydrator runs in its own unit and a hydrator that cannot start is reported in its own words."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from bench import e2e_serve
from bench.e2e_restore import Driver, E2EError, Layout, wait_hydrator
from bench.interposer_units import INTERPOSER_RUN
from bench.serve_faults import fault_forked_workers
from bench.serve_units import restore_once, serve_layout, start_cold
from tests.helpers import ROOT, open_session, running_daemon

pytestmark = pytest.mark.usefixtures("no_leftovers")

CONFIG = '[runtime]\nprivileged = "host-capabilities"\n'


def _layout(tmp_path: Path) -> Layout:
    """The busybox test image as a capsule: `sh` runs the launcher (a Python file) and fails; the restore
    worker needs python3, which is not there."""
    for sub in ("run", "images", "weights"):
        (tmp_path / sub).mkdir()
    return Layout(run_dir=tmp_path / "run", images_dir=tmp_path / "images", weights=tmp_path / "weights",
                  python="sh", host_mounts=(), gpus=(), network="host")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_server_that_exits_before_its_first_token_fails_fast(busybox_image: str, tmp_path: Path) -> None:
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        started = time.monotonic()
        with pytest.raises(E2EError) as caught:
            await start_cold(d, busybox_image, _layout(tmp_path), "servetest-cold", _free_port())
        assert time.monotonic() - started < 30  # the watcher, not the client's 600 s connect limit
        await d.expect("removing", "workload-remove", name="servetest-cold")
        assert await d.gone("servetest-cold")
    assert "servetest-cold is no longer running" in str(caught.value)


async def test_failed_restore_cancels_the_waiting_client_and_removes_the_unit(busybox_image: str,
                                                                             tmp_path: Path) -> None:
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        with pytest.raises(E2EError) as caught:  # one error, not an exception group
            # the worker's interpreter is missing: the unit's log names it
            layout = dataclasses.replace(_layout(tmp_path), python="/opt/no-python3")
            await restore_once(d, busybox_image, layout, "servetest_node_0", "cap-1", "servetest",
                               _free_port())
        assert await d.gone("servetest_node_0")
    message = str(caught.value)
    assert "restore unit exited (code 1) before its readiness check" in message
    assert "its log ends" in message and "no-python3" in message and "removed" in message


async def test_forked_workers_case_serves_in_a_unit_then_fails_naming_the_capture_and_leaves_no_unit(
        busybox_image: str, tmp_path: Path) -> None:
    """The forked-workers fault through the daemon without a GPU: the server (the host's python3, standard library
    only) forks its workers in the unit and every one answers on the host network; the capsule has no worker
    and no CUDA, so the capture fails, and the row says so with no unit left."""
    (tmp_path / "weights").mkdir()
    layout = dataclasses.replace(serve_layout(tmp_path, tmp_path / "weights", "full"), python="/usr/bin/python3",
                                 host_mounts=tuple(p for p in ("/usr", "/lib", "/lib64") if Path(p).is_dir()),
                                 gpus=())
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        row = await fault_forked_workers(d, busybox_image, layout, "full", _free_port(), cuda=False)
    assert row["answered_cold"] == [0, 1]
    assert row["ok"] is False and row["no_unit_left"] is True
    assert row["error"].startswith("E2EError: capture of serve-forked-cold by the in-capsule worker"), row["error"]


async def test_the_staged_paths_hydrator_runs_in_its_own_unit_fails_in_its_own_words_and_is_removed(
        busybox_image: str, tmp_path: Path) -> None:
    """The staging hydrator's unit as the staged path starts it, on a node without a GPU: the real
    `python -m coldsnap_probe.hydration serve --staging` (the host's python3 and this checkout's coldsnap_probe
    stand in for the capsule's) runs with the path's mounts on the host network, its socket directory mounted,
    and exits naming the missing CUDA driver; the wait reports that, and the path's cleanup leaves no unit."""
    mode = "full-interposer-hydrator"
    (tmp_path / "model").mkdir()
    layout = serve_layout(tmp_path, tmp_path / "model", mode)
    layout = dataclasses.replace(layout, python="/usr/bin/python3", gpus=(),
                                 host_mounts=(*(p for p in ("/usr", "/lib", "/lib64") if Path(p).is_dir()), str(ROOT)),
                                 extra_environment={**layout.extra_environment, "PYTHONPATH": str(ROOT)})
    layout.prepare()
    result: dict[str, object] = {"ok": True}
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        service = await e2e_serve.start_node_hydrator(d, mode, busybox_image, layout)
        assert service is not None and service["name"] == "serve-full-interposer-hydrator-hydrator"
        with pytest.raises(E2EError) as caught:
            await wait_hydrator(d, service["name"], service["created_unix"], limit=60)
        await e2e_serve.remove_units(d, mode, result)
        for name in e2e_serve.unit_names(mode):
            assert await d.gone(name), name
    assert "the hydrator exited" in str(caught.value) and "CudaLibraryMissing" in str(caught.value), caught.value
    assert "preload" not in str(caught.value)  # not under the interposer (ld.so would warn: no library here)
    assert result == {"ok": True}  # nothing left: no units_left, the verdict untouched
    assert layout.interposer_dir is not None and layout.interposer_dir.is_dir()  # mounted at INTERPOSER_RUN
    assert {m["target"]: m["source"] for m in layout.mounts()}[INTERPOSER_RUN] == str(layout.interposer_dir)


async def test_a_path_with_no_node_hydrator_starts_none(tmp_path: Path) -> None:
    d = Driver(tmp_path)  # never opened: a path without a node hydrator sends nothing
    layout = serve_layout(tmp_path, tmp_path, "full-interposer")
    assert await e2e_serve.start_node_hydrator(d, "full-interposer", "img", layout) is None


async def test_a_run_whose_paths_all_fail_still_reports_every_one_and_leaves_no_unit(
        busybox_image: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver end to end on a capsule without the server: each path fails at its first step (the
    interposer's check, the cold start), the fault cases run what they can, the table and the JSON are still
    written, the exit code says so, and no unit is left."""
    model = tmp_path / "model"
    model.mkdir()
    files = {"config.json": {}, "tokenizer.json": {}, "tokenizer_config.json": {"chat_template": "x"}}
    for name, value in files.items():
        (model / name).write_text(json.dumps(value))
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    out = tmp_path / "out"
    out.mkdir()
    async with running_daemon(CONFIG) as daemon:
        monkeypatch.setattr(sys, "argv", [
            "e2e_serve.py", "--state-dir", str(daemon.state_dir), "--capsule", busybox_image, "--model", str(model),
            "--work", str(tmp_path / "work"), "--out", str(out), "--modes", "full-interposer-hydrator,full",
            "--port", str(_free_port()), "--faults"])
        assert await e2e_serve.main() == 1
        d = Driver(daemon.state_dir)
        d.session = await open_session(daemon.state_dir, "op-e2e-check")  # the run's session is still open
        for name in (*e2e_serve.unit_names("full-interposer-hydrator"), *e2e_serve.unit_names("full"),
                     "serve-forked-cold", "serveforked_node_0"):
            assert await d.gone(name), name
    report = json.loads((out / "serve.json").read_text())
    errors = {r["mode"]: r["error"] for r in report["results"]}
    # The staged path fails at the interposer's check, before its node hydrator or its server start.
    assert "carries no loadable CUDA interposer at /opt/coldsnap/lib/libcoldsnap_cuda.so" in errors[
        "full-interposer-hydrator"]
    assert all("units_left" not in r for r in report["results"])
    assert "starting the server serve-full-cold" in errors["full"]
    cases = {row["case"]: row for row in report["faults"]}
    assert cases["restore cases"]["error"].startswith("no path captured and restored")
    assert cases["a server that forks workers"]["ok"] is False and cases["a server that forks workers"]["no_unit_left"]
    table = (out / "serve-table.md").read_text()
    assert "| full-interposer-hydrator | failed: E2EError: capsule" in table and "| full | failed: E2EError:" in table

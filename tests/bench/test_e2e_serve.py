"""bench/e2e_serve.py's failure paths against the real daemon and dockerd (the GPU path runs on the H200
through scripts/device-serve): a server that dies before its first token, and a restore that fails while the
client already waits on the port, each fail as one E2EError naming the cause, with no unit left behind; the
forked-workers case runs its server in a unit and reports its failed capture the same way."""

from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path

import pytest

from bench.e2e_restore import Driver, E2EError, Layout
from bench.serve_faults import fault_forked_workers
from bench.serve_units import restore_once, serve_layout, start_cold
from tests.helpers import running_daemon

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
            await restore_once(d, busybox_image, _layout(tmp_path), "servetest_node_0", "cap-1", "servetest",
                               _free_port())
        assert await d.gone("servetest_node_0")
    message = str(caught.value)
    assert "restore unit exited (code 1) before its readiness check" in message
    assert "its log ends" in message and "coldsnap_probe" in message and "removed" in message


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

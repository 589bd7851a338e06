"""The node hydrators' own stage counts on the daemon's metrics (`_hydrator_stages.py`): asked of the real hydrator,
never taken from a capsule's report (review10's open finding, issue 34)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from coldsnap_probe import jsonline
from coldsnap_provider._hydrator_stages import HydratorStages, _Tier
from tests.helpers import ROOT, running_daemon
from tests.probe.test_jsonline import _answering
from tests.probe.test_main import has_nvidia_driver
from tests.provider.test_metrics import _scratch, sample, scrape

MIB = 1 << 20


def test_the_counts_grow_by_what_each_hydrator_said_and_a_restarted_one_counts_anew() -> None:
    stages = HydratorStages(["/run/a.sock", "/run/b.sock"])
    assert stages.totals() == [("ram", 0, 0), ("disk", 0, 0), ("device", 0, 0)]
    stages._add("/run/a.sock", _Tier(stages={"ram": 1, "disk": 2}, read_bytes={"ram": 10, "disk": 20}))
    stages._add("/run/b.sock", _Tier(stages={"disk": 1}, read_bytes={"disk": 5, "nvme": 7}))  # unknown tier: not ours
    stages._add("/run/a.sock", _Tier(stages={"ram": 3, "disk": 2, "device": 2},
                                     read_bytes={"ram": 30, "disk": 20, "device": 64}))
    assert stages.totals() == [("ram", 30, 3), ("disk", 25, 3), ("device", 64, 2)]
    stages._add("/run/b.sock", _Tier(stages={"disk": 1}, read_bytes={"disk": 4}))  # b restarted: its 4 are new
    assert stages.totals() == [("ram", 30, 3), ("disk", 29, 4), ("device", 64, 2)]


async def test_a_hydrator_that_does_not_answer_leaves_the_counts_at_zero_and_the_daemon_serving() -> None:
    scratch = _scratch()
    metrics = scratch / "metrics.sock"
    config = (f'[metrics]\naddress = "unix:{metrics}"\nbackend_probe_interval_s = 1.0\n'
              f'hydrator_sockets = ["{scratch / "absent.sock"}"]\n')
    async with running_daemon(config) as daemon:
        await anyio.sleep(1.5)  # two polls asked the absent socket
        text = await anyio.to_thread.run_sync(scrape, metrics)
        assert (await daemon.control(operation="status"))["version"]
        assert daemon.log().count("node hydrator gives no stage counts") == 1  # once, not at every interval
    for name in ("coldsnap_provider_hydrator_stage_bytes_total", "coldsnap_provider_hydrator_stages_total"):
        assert f'{name}{{tier="ram"}} 0.0' in text and f'{name}{{tier="disk"}} 0.0' in text, text


def test_an_answer_nested_past_the_decoder_is_a_hydrator_that_did_not_answer(tmp_path: Path) -> None:
    """Whatever serves a named socket (a hydrator gone wrong, or what took its path while it restarts), its answer
    never raises out of the poll: the poll is a task of the daemon's task group, and a RecursionError from the JSON
    decoder ("[[[[...") escaped it and stopped the whole daemon."""
    path, thread = _answering(tmp_path, lambda conn: conn.sendall(b"[" * 200_000))
    stages = HydratorStages([path])
    anyio.run(stages.poll)
    thread.join(10)
    assert stages.totals() == [("ram", 0, 0), ("disk", 0, 0), ("device", 0, 0)] and \
        "answered" in stages._failing[path], \
        stages._failing


def test_a_refused_status_is_logged_as_the_hydrator_said_it(tmp_path: Path) -> None:
    """Review 11: an `ok: false` answer (here from the channel server hydrators answer on, whose status handler
    failed) was logged as a hydrator keeping its counters from the daemon's uid. It is logged with the hydrator's
    own error, once, and counts nothing."""
    def refuse(conn: socket.socket, peer: jsonline.Peer) -> dict[str, object]:
        jsonline.read_request(conn)
        raise OSError(f"peer uid {peer.uid}: the RAM tier is gone")

    path = tmp_path / "hydrator.sock"
    server = jsonline.LineServer(jsonline.listen(path), refuse, peers=jsonline.Peers()).start()
    stages = HydratorStages([str(path)])
    try:
        with capture_logs() as logs:
            anyio.run(stages.poll)
            anyio.run(stages.poll)
    finally:
        server.close()
    said = [entry for entry in logs if entry["event"] == "node hydrator gives no stage counts"]
    assert [entry["error"] for entry in said] == [
        f"refused its status: OSError: peer uid {os.getuid()}: the RAM tier is gone"], logs
    assert stages.totals() == [("ram", 0, 0), ("disk", 0, 0), ("device", 0, 0)]


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
async def test_the_stage_metrics_are_the_real_hydrators_own_count(tmp_path: Path) -> None:
    """A stage-dump on the real node hydrator: the daemon's scrape says one stage from the disk tier and the bytes
    the hydrator read for it (a chunk of zeros is set on the device, not read: it counts nowhere). The hydrator
    admits the daemon's account with --status-uid (the shipped unit does not run the daemon as root)."""
    import pwd

    from tests import unit_sandbox
    from tests.probe._staged import stage_and_read

    data, zeros = tmp_path / "seg-0.bin", tmp_path / "seg-1.bin"
    data.write_bytes(os.urandom(4 * MIB))
    zeros.write_bytes(bytes(64 * MIB))
    parts = [{"file": str(data), "bytes": 4 * MIB, "region": 0},
             {"file": str(zeros), "bytes": 64 * MIB, "region": 0, "zero": 1}]
    control = str(tmp_path / "hydrator.sock")
    metrics = _scratch() / "metrics.sock"
    config = (f'[metrics]\naddress = "unix:{metrics}"\nbackend_probe_interval_s = 1.0\n'
              f'hydrator_sockets = ["{control}"]\n')
    async with running_daemon(config):  # first: under the unit sandbox its account exists from here on
        uid = pwd.getpwnam("coldsnap-provider").pw_uid if unit_sandbox.enabled() else os.getuid()
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                                 "--staging", "--status-uid", str(uid)], stdout=subprocess.PIPE, cwd=ROOT)
        try:
            ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
            key = "sha256:" + hashlib.sha256(b"hydrator-stages").hexdigest()
            staged, _held = await anyio.to_thread.run_sync(stage_and_read, None, control, key, parts,
                                                           ready["device_uuid"])
            assert staged["copied_bytes"] == 4 * MIB, staged
            with anyio.fail_after(20):
                while not sample(text := await anyio.to_thread.run_sync(scrape, metrics),
                                 "coldsnap_provider_hydrator_stages_total", tier="disk"):
                    await anyio.sleep(0.2)
        finally:
            proc.kill()
            proc.wait()
    assert sample(text, "coldsnap_provider_hydrator_stage_bytes_total", tier="disk") == 4 * MIB
    assert sample(text, "coldsnap_provider_hydrator_stages_total", tier="disk") == 1
    assert sample(text, "coldsnap_provider_hydrator_stages_total", tier="ram") == 0


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_status_uid_gets_the_tiers_counters_and_nothing_else() -> None:
    """`--status-uid`: that uid's status shows the RAM tier's counters (as root's does; another uid's would not),
    and any other request of it is refused before anything is read or allocated."""
    from tests.probe._peers import AS_NOBODY, ask_as

    shared = Path(tempfile.mkdtemp(prefix="cs-status-uid-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        control = shared / "hydrator.sock"
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                                 "--staging", "--status-uid", "65534", "--socket-group", "65534"],
                                stdout=subprocess.PIPE, cwd=ROOT)
        try:
            ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
            status = ask_as(AS_NOBODY, control, {"op": "status"})
            assert status["ok"] and status["ram_tier"]["stages"] == {"ram": 0, "disk": 0}, status
            refused = ask_as(AS_NOBODY, control, {"op": "stage-dump", "key": "sha256:" + "0" * 64,
                                                  "parts": [{"file": "/etc/hostname", "bytes": 2 * MIB, "region": 0}],
                                                  "device_uuid": ready["device_uuid"]})
            assert not refused["ok"] and "uid 65534 may ask this hydrator for its status only" in refused["error"]
        finally:
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(shared)


@pytest.mark.parametrize(("sockets", "rule"), [
    ('["run/hydrator.sock"]', "metrics.hydrator_sockets[0]"),
    ('["/run/h.sock", "/run/h.sock"]', "metrics.hydrator_sockets lists '/run/h.sock' twice"),
], ids=["relative", "twice"])
def test_check_config_refuses_a_hydrator_socket_that_is_relative_or_listed_twice(sockets: str, rule: str) -> None:
    from tests.provider.test_metrics import CLI

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(f'[metrics]\naddress = "127.0.0.1:9464"\nhydrator_sockets = {sockets}\n')
        f.flush()
        result = subprocess.run([*CLI, "check-config", f.name], capture_output=True, text=True, check=False)
    assert result.returncode == 2 and rule in result.stderr, result.stderr

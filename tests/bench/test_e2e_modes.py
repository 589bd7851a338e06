"""bench/e2e_modes.py's modes (it runs bench/e2e_restore.py's steps), CPU-checkable parts: the modes a run plans,
the unit environment and mounts each adds (the interposer's only through the environment, the engine unchanged), the
tuning each mode gets, the images' digest, the tables, the driver's refusals, and a mode's run failing at its
first step through the real daemon and dockerd with nothing left behind (the GPU path: scripts/device e2e)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench import e2e_modes
from bench.e2e_modes import (
    Tuning,
    capture_table,
    images_digest,
    mode_layout,
    node_thp,
    parse,
    plan_modes,
    restore_columns,
    restore_table,
    run_mode,
    table,
)
from bench.e2e_restore import Driver, E2EError, check_worker, inspect_capsule
from bench.interposer_units import INTERPOSER_LIBRARY, INTERPOSER_SOCKET, check_interposer, device_cell, staging_unit
from tests.conftest import WorkerCapsule, docker
from tests.helpers import ROOT, running_daemon

CONFIG = '[runtime]\nprivileged = "host-capabilities"\n'
TUNING = Tuning(criu_threads=16, stack_bytes=256, thp="always")
# A restore report as the worker writes it for the interposer (docs/worker-reports.md), two processes.
REPORT = {"device_hydration_seconds": 0.5,
          "device_memory": [{"pid": 513, "bytes": 16_000_000_000, "interposer": {"verify": "sampled"}},
                            {"pid": 514, "bytes": 1_000_000_000, "interposer": {"verify": "sampled"}}]}


class TestModes:
    def test_a_comma_list_plans_the_modes_in_its_order(self) -> None:
        assert plan_modes(" interposer,hydrator , full") == ["interposer", "hydrator", "full"]

    @pytest.mark.parametrize(("text", "message"), [
        pytest.param("full,full-interposer", "unknown mode full-interposer: the modes are hydrate, hydrator, "
                                             "interposer, interposer-hydrator, full", id="unknown"),
        pytest.param("interposer,full,interposer", "mode interposer named twice", id="twice"),
        pytest.param(",", "no mode named", id="empty")])
    def test_a_bad_list_is_refused_naming_the_entry(self, text: str, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            plan_modes(text)

    @pytest.mark.parametrize(("extra", "message"), [
        pytest.param(["--modes", "full,bogus"], "--modes: unknown mode bogus", id="mode"),
        pytest.param(["--restores", "0"], "--restores 0: at least 1", id="restores"),
        pytest.param(["--stack-bytes", "-1"], "--stack-bytes -1: 0 or more", id="stack"),
        pytest.param(["--criu-threads", "-2"], "--criu-threads -2: 0 or more", id="threads")])
    def test_the_driver_refuses_bad_options_before_it_talks_to_the_daemon(self, tmp_path: Path, extra: list[str],
                                                                          message: str) -> None:
        done = subprocess.run([sys.executable, str(ROOT / "bench/e2e_modes.py"), "--state-dir",
                               str(tmp_path / "no-daemon"), "--capsule", "x", "--weights", str(tmp_path), "--work",
                               str(tmp_path), "--out", str(tmp_path), *extra], capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 2 and message in done.stderr, done.stderr

    def test_a_modes_units_are_named_by_a_cluster_without_dashes(self) -> None:
        assert [e2e_modes.cluster(m) for m in ("interposer-hydrator", "full")] == ["e2einterposerhydrator", "e2efull"]

    def test_defaults_are_three_restores_and_the_drivers_own_tuning(self, tmp_path: Path) -> None:
        args = parse(["--state-dir", "s", "--capsule", "c", "--weights", "w", "--work", "k", "--out", "o"])
        assert (args.modes, args.restores, args.criu_threads, args.stack_bytes) == (["hydrator"], 3, 0, 0)


class TestEnvironment:
    def test_the_interposer_mode_adds_only_the_preload_its_socket_and_their_directory(self, tmp_path: Path) -> None:
        full = mode_layout(tmp_path, tmp_path / "w", "full", TUNING)
        interposer = mode_layout(tmp_path, tmp_path / "w", "interposer", TUNING)
        added = {k: v for k, v in interposer.environment().items() if full.environment().get(k) != v}
        assert added == {"LD_PRELOAD": INTERPOSER_LIBRARY, "COLDSNAP_CUDA_INTERPOSER_SOCKET": INTERPOSER_SOCKET}
        assert INTERPOSER_SOCKET.startswith("/run/coldsnap/")  # the directory mounted below
        targets = {m["target"]: m for m in interposer.mounts()}
        assert targets["/run/coldsnap"] == {"source": str(tmp_path / "interposer/coldsnap"),
                                            "target": "/run/coldsnap"}  # writable: the sockets are bound there
        assert "/run/coldsnap" not in {m["target"] for m in full.mounts()}
        # The serving and every restore unit of a mode are built from the one layout: the same directory.
        assert interposer.unit("a", "img", entrypoint="sh", command=[])["mounts"] == interposer.mounts()

    @pytest.mark.parametrize("mode", e2e_modes.MODES)
    def test_every_mode_gets_the_criu_threads_and_its_images_under_the_root(self, tmp_path: Path, mode: str) -> None:
        layout = mode_layout(tmp_path / "work", tmp_path / "w", mode, TUNING, tmp_path / "shm")
        assert layout.environment()["CRIU_RESTORE_THREADS"] == "16"
        assert layout.images_dir == tmp_path / "shm" / mode
        assert ("LD_PRELOAD" in layout.environment()) == mode.startswith("interposer")
        assert mode_layout(tmp_path, tmp_path, mode, TUNING).images_dir == tmp_path / mode / "images"

    def test_no_criu_threads_variable_when_none_is_given(self, tmp_path: Path) -> None:
        layout = mode_layout(tmp_path, tmp_path, "full", Tuning(criu_threads=0))
        assert "CRIU_RESTORE_THREADS" not in layout.environment()

    def test_the_staged_interposer_mode_names_its_node_hydrator_in_the_same_directory(self, tmp_path: Path) -> None:
        plain = mode_layout(tmp_path, tmp_path / "w", "interposer", TUNING).environment()
        staged = mode_layout(tmp_path, tmp_path / "w", "interposer-hydrator", TUNING)
        added = {k: v for k, v in staged.environment().items() if plain.get(k) != v}
        assert added == {"COLDSNAP_CUDA_INTERPOSER_HYDRATOR": "/run/coldsnap/hydrator.sock"}
        assert "/run/coldsnap" in {m["target"] for m in staged.mounts()}
        hydrator = staging_unit(staged, "img", "e2e-interposer-hydrator-hydrator")
        assert hydrator["command"][-6:] == ["serve", "--staging", "--ram-tier-bytes", "auto", "--socket",
                                            "/run/coldsnap/hydrator.sock"]
        assert hydrator["mounts"] == staged.mounts() and hydrator["gpus"] == ["0"]
        assert not {k for k in hydrator["environment"] if k == "LD_PRELOAD" or "INTERPOSER" in k}  # not under it
        assert hydrator["environment"]["CRIU_RESTORE_THREADS"] == "16"

    def test_only_a_cooperative_engine_is_asked_for_the_stack_limit(self) -> None:
        assert TUNING.engine_options("hydrator") == TUNING.engine_options("hydrate") == ("--stack-bytes", "256")
        assert TUNING.engine_options("interposer") == TUNING.engine_options("interposer-hydrator") == ()
        assert TUNING.engine_options("full") == ()
        assert Tuning(criu_threads=4).engine_options("hydrator") == ()
        assert "engine unchanged: no CUDA stack limit, KV kept" in TUNING.notes("interposer")
        assert "CUDA stack limit 256 B" in TUNING.notes("hydrator") and "THP always" in TUNING.notes("full")

    def test_the_engine_refuses_a_negative_stack_limit_before_it_loads_anything(self, tmp_path: Path) -> None:
        done = subprocess.run([sys.executable, str(ROOT / "engines/engine_llama.py"), "serve", str(tmp_path),
                               "--socket", str(tmp_path / "s"), "--stack-bytes", "-1"], capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 2 and "--stack-bytes -1: give 0" in done.stderr

    @pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"),
                                                ("[always] madvise never", "always"), (None, "unknown")])
    def test_the_nodes_huge_page_mode_is_the_bracketed_word(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            text: str | None, mode: str) -> None:
        path = tmp_path / "enabled"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(e2e_modes, "THP_FILE", path)
        assert node_thp() == mode


class TestDigest:
    def test_a_file_digest_is_its_name_size_times_and_chunk_digests(self, tmp_path: Path) -> None:
        image = tmp_path / "pages-1.img"
        image.write_bytes(b"page" * 1000)
        st = image.stat()
        expected = hashlib.sha256(f"pages-1.img\0{4000}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0".encode()
                                  + b"0\0" + b"4000\0" + hashlib.sha256(b"page" * 1000).digest())
        assert images_digest(tmp_path, 4) == expected.hexdigest()

    def test_any_change_to_the_images_changes_it_whatever_the_threads(self, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(e2e_modes, "DIGEST_CHUNK", 1000)  # several chunks per file, hashed in parallel
        (tmp_path / "device-513").mkdir()
        dump = tmp_path / "device-513/seg-0.bin"
        dump.write_bytes(bytes(range(256)) * 40)
        (tmp_path / "empty.img").write_bytes(b"")
        before = images_digest(tmp_path, 8)
        assert images_digest(tmp_path, 1) == before  # reading changes nothing
        times = dump.stat()
        data = bytearray(dump.read_bytes())
        data[5000] ^= 1
        dump.write_bytes(bytes(data))
        os.utime(dump, ns=(times.st_atime_ns, times.st_mtime_ns))  # a byte changed, the mtime put back
        assert images_digest(tmp_path, 8) != before
        data[5000] ^= 1
        time.sleep(0.05)  # past the file system's timestamp granularity (a jiffy)
        dump.write_bytes(bytes(data))  # the same bytes back: still a write
        assert images_digest(tmp_path, 8) != before
        again = images_digest(tmp_path, 8)
        dump.rename(tmp_path / "device-513/seg-1.bin")
        assert images_digest(tmp_path, 8) != again


def _restore(first: float, ready: float, **extra: Any) -> dict[str, Any]:
    row = {"first_token_s": first, "readiness_s": ready, "worker_started_s": 0.3, "criu_s": 0.2, "cuda_s": 0.25,
           "hydration_s": None, "identical_tokens": True, "identical_first_logits": True, "worker_report": REPORT}
    row.update(extra)
    return {**row, **restore_columns(row)}


class TestStaging:
    def test_a_restore_says_whether_the_node_hydrator_staged_the_dump(self) -> None:
        staged = {**REPORT, "device_memory": [{**p, "interposer": {"stage": {"staged": True, "stage_s": 0.2}}}
                                              for p in REPORT["device_memory"]]}
        row = _restore(1.0, 0.9, worker_report=staged)
        assert row["device_staged"] is True and row["device_stage_errors"] == []
        assert device_cell(row) == "0.50 (34.0 GB/s, staged)"
        set_back = {**staged, "device_memory": [{**p, "stack_restore_s": 0.0012} for p in staged["device_memory"]]}
        assert device_cell(_restore(1.0, 0.9, worker_report=set_back)) == (
            "0.50 (34.0 GB/s, staged, stack set back in 1.2 ms)")

    def test_a_refused_or_unadopted_stage_is_not_staged_and_says_why(self) -> None:
        late = {**REPORT, "device_memory": [
            {"pid": 513, "bytes": 1, "interposer": {"stage": {"staged": True, "adopt_error": "late"}}},
            {"pid": 514, "bytes": 1, "interposer": {"stage": {"staged": False, "error": "ProbeError: refused"}}}]}
        row = _restore(1.0, 0.9, worker_report=late)
        assert row["device_staged"] is False and row["device_stage_errors"] == ["ProbeError: refused", "late"]
        assert device_cell(row).endswith(", not staged)")
        assert _restore(1.0, 0.9)["device_staged"] is None  # no stage asked for: the plain interposer mode


class TestTables:
    def _result(self) -> dict[str, Any]:
        capture = {"timings_s": {"device_release": 0.41, "cuda_checkpoint": 0.52, "criu_dump": 1.1},
                   "device_memory": [{"pid": 513, "state": "released", "bytes": 17_000_000_000, "gbps": 40.0}]}
        return {"mode": "interposer", "cold": {"first_token_s": 30.0, "request_to_first_token_s": 0.1, "stages": []},
                "restores": [_restore(1.5, 1.4), _restore(2.5, 2.3, identical_first_logits=False)],
                "capture_phases": e2e_modes.capture_row(capture), "images_bytes": 19_000_000_000,
                "device_dump_bytes": 17_000_000_000, "images_unchanged": True, "notes": TUNING.notes("interposer")}

    def test_restore_rows_show_device_hydration_its_rate_and_the_first_token_after_ready(self) -> None:
        lines = restore_table([self._result()])
        assert lines[2] == "| interposer | cold | 30.00 | 1x | - | - | - | - | - | 0.10 | - | - |"
        assert lines[3] == ("| interposer | restore 1 | 1.50 | 20.0x | 0.30 | 0.20 | 0.25 | 0.50 (34.0 GB/s) | - "
                            "| 0.10 | yes | yes |")
        assert lines[4].endswith("| yes | **no** |")
        assert all(line.count("|") == 13 for line in lines)  # 12 columns on every row

    def test_capture_rows_count_the_restores_within_the_goal(self) -> None:
        lines = capture_table([self._result(), {"mode": "full", "error": "skipped", "restores": []}])
        assert lines[2] == "| interposer | 0.41 (17.00) | 0.52 | 1.10 | 19.00 | 17.00 | yes | <= 2 s | 1 of 2 |"
        assert len(lines) == 3  # a mode that captured nothing has no capture row
        assert all(line.count("|") == 10 for line in lines)

    def test_a_failed_mode_still_has_its_row_and_the_notes_say_what_tuning_applied(self) -> None:
        text = table([self._result(), {"mode": "hydrator", "error": "E2EError: a | b", "restores": [],
                                       "notes": TUNING.notes("hydrator")}], {"id": "sha256:ab", "size": 1e8}, 16e9)
        assert "| hydrator | failed: E2EError: a / b |" in text
        assert "interposer: THP always; CRIU_RESTORE_THREADS=16; engine unchanged" in text
        assert "hydrator: THP always; CRIU_RESTORE_THREADS=16; CUDA stack limit 256 B" in text
        assert "weights 16.00 GB" in text


@pytest.mark.usefixtures("no_leftovers")
async def test_the_interposer_mode_on_a_capsule_without_the_library_fails_first_and_leaves_nothing(
        busybox_image: str, tmp_path: Path) -> None:
    """The busybox test image as a capsule: the throwaway unit checking the interposer library is refused
    before any engine starts, the mode's row names the library, and no unit or images are left."""
    (tmp_path / "weights").mkdir()
    args = argparse.Namespace(work=str(tmp_path / "work"), weights=str(tmp_path / "weights"),
                              images_root=str(tmp_path / "shm"), restores=3, keep_images=False)
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        result = await run_mode(d, args, "interposer", busybox_image, TUNING)
        for name in ("e2e-interposer-serving", "e2einterposer_node_0", "e2e-interposer-hydrator"):
            assert await d.gone(name), name
    assert result["ok"] is False and result["restores"] == [] and "cold" not in result
    assert f"carries no loadable CUDA interposer at {INTERPOSER_LIBRARY}" in result["error"]
    assert result["environment"]["LD_PRELOAD"] == INTERPOSER_LIBRARY and result["engine_options"] == []
    assert not (tmp_path / "shm" / "interposer").exists()


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the GPU host has it)")
async def test_a_capsule_built_with_the_worker_passes_the_interposer_and_worker_checks_through_the_daemon(
        tmp_path: Path, worker_capsule: WorkerCapsule) -> None:
    """scripts/_capsule_rootfs.py --worker (CRIU stood in by a dynamically linked program), built by the
    daemon's image-build as scripts/device e2e does: the interposer mode's throwaway unit loads the library
    the units preload, and the worker's check passes, in the capsule's own interpreter (no host mounts)."""
    context = worker_capsule.context
    python = next(line for line in worker_capsule.stdout.splitlines() if line.startswith("capsule rootfs:")).split(
        "python ")[1].split(",")[0]  # the capsule carries its interpreter at the host's real path
    (tmp_path / "weights").mkdir()
    layout = mode_layout(tmp_path / "work", tmp_path / "weights", "interposer", TUNING)
    layout.python, layout.host_mounts, layout.gpus = python, (), ()
    layout.prepare()
    tag = f"coldsnap-test/e2e-capsule:{os.getpid()}"
    async with running_daemon(CONFIG) as daemon:
        d = Driver(daemon.state_dir)
        await d.open()
        try:
            await d.expect("image-build", "image-build", build={
                "dockerfile": base64.b64encode((context / "Dockerfile").read_bytes()).decode(),
                "context": str(context), "tag": tag, "pull": False})
            image = str((await inspect_capsule(d, tag))["id"])
            await check_interposer(d, image, layout)
            await check_worker(d, image, layout)
            layout.python = "/no/python3"  # the same checks fail, naming the library, when it cannot load
            with pytest.raises(E2EError, match=f"carries no loadable CUDA interposer at {INTERPOSER_LIBRARY}"):
                await check_interposer(d, image, layout)
        finally:
            docker("rmi", "-f", tag, check=False)

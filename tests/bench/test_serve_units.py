"""bench/e2e_serve.py's CPU-checkable parts: the paths a run plans and the unit environment each adds (the
interposer's only through LD_PRELOAD and its socket; the staged path's node hydrator and what its unit and the
restore unit get), the capture and restore phases read from the workers' reports, the fault cases' choice of
images and verdicts, the tables, and the capsule carrying the interposer."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.e2e_restore import IMAGES, RUN, WORKER_PATH, restore_command, unit_labels
from bench.e2e_serve import _parser, capture_line, images_bytes, path_notes, restore_lines, table, unit_names
from bench.interposer_units import (
    INTERPOSER_LIBRARY,
    INTERPOSER_RUN,
    INTERPOSER_SOCKET,
    NO_IO_URING_LIBRARY,
    STAGING_SOCKET,
    device_hydration,
    device_staging,
    staging_unit,
)
from bench.serve_faults import forked_verdict
from bench.serve_units import (
    ADAPTERS,
    SERVER_SITE,
    capture_row,
    cluster,
    fault_mode,
    keep_images,
    node_hydrator,
    plan_modes,
    serve_layout,
)
from tests.conftest import WorkerCapsule
from tests.helpers import ROOT

# A capture report's fields as docs/worker-reports.md gives them (the interposer's release, two processes).
CAPTURE = {"timings_s": {"device_release": 0.41, "cuda_lock": 0.01, "cuda_checkpoint": 0.52, "criu_dump": 1.1},
           "image_bytes": 2_400_000_000, "exec_seconds": 2.3, "hydration": None,
           "device_memory": [
               {"pid": 513, "state": "released", "bytes": 16_000_000_000, "gbps": 40.0,
                "uncovered": {"below_threshold": {"count": 12, "bytes": 3_000_000}, "managed": {"count": 0,
                                                                                                 "bytes": 0}}},
               {"pid": 514, "state": "released", "bytes": 1_000_000_000, "gbps": 38.0,
                "uncovered": {"below_threshold": {"count": 1, "bytes": 1_000_000}}}]}
RESTORE = {"device_hydration_seconds": 0.5,
           "device_memory": [{"pid": 513, "bytes": 16_000_000_000, "seconds": 0.4, "gbps": 41.0,
                              "interposer": {"verify": "sampled", "fill_s": 0.3}},
                             {"pid": 514, "bytes": 1_000_000_000, "seconds": 0.1, "gbps": 10.0,
                              "interposer": {"verify": "sampled"}}]}


class TestModes:
    def test_a_comma_list_plans_the_paths_in_its_order(self) -> None:
        assert plan_modes("full-interposer, full,adapter-hydrator") == ["full-interposer", "full",
                                                                         "adapter-hydrator"]

    @pytest.mark.parametrize(("text", "message"), [
        pytest.param("full,interposer", "unknown mode interposer: the modes are full-interposer-hydrator, "
                                        "full-interposer, full, adapter, adapter-hydrator", id="unknown"),
        pytest.param("full-interposer-hydrator,full-interposer-hydrator", "mode full-interposer-hydrator named twice",
                     id="staged-twice"),
        pytest.param("full,adapter,full", "mode full named twice", id="twice"),
        pytest.param(" , ", "no mode named", id="empty")])
    def test_a_bad_list_is_refused_naming_the_entry(self, text: str, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            plan_modes(text)

    def test_the_driver_refuses_a_bad_list_before_anything_else(self, tmp_path: Path) -> None:
        done = subprocess.run([sys.executable, str(ROOT / "bench/e2e_serve.py"), "--state-dir", str(tmp_path),
                               "--capsule", "x", "--model", str(tmp_path), "--work", str(tmp_path), "--out",
                               str(tmp_path), "--modes", "full,bogus"], capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == 2 and "--modes: unknown mode bogus" in done.stderr

    def test_the_default_runs_the_staged_path_first_then_the_interposer_the_adapter_and_full(self) -> None:
        args = _parser().parse_args(["--state-dir", "s", "--capsule", "c", "--model", "m", "--work", "w", "--out", "o"])
        assert plan_modes(args.modes) == ["full-interposer-hydrator", "full-interposer", "adapter-hydrator", "full"]
        device_serve = (ROOT / "scripts/_device_serve.sh").read_text()
        assert "MODES=${3:-full-interposer-hydrator,full-interposer,adapter-hydrator,full}" in device_serve

    def test_a_path_names_the_node_hydrator_it_runs_and_its_units(self) -> None:
        assert [node_hydrator(m) for m in ("full-interposer-hydrator", "adapter-hydrator", "full-interposer", "full",
                                           "adapter")] == ["staging", "weights", None, None, None]
        assert unit_names("full-interposer-hydrator") == ("serve-full-interposer-hydrator-cold",
                                                          "servefullinterposerhydrator_node_0",
                                                          "serve-full-interposer-hydrator-hydrator")
        assert cluster("full-interposer-hydrator").isalpha()  # a ColdSnap workload label: letters only

    def test_the_faults_use_the_fastest_path_that_restored(self) -> None:
        results = [{"mode": "full", "ok": True}, {"mode": "full-interposer", "ok": False},
                   {"mode": "adapter", "ok": True}, {"mode": "adapter-hydrator", "ok": True}]
        assert fault_mode(results) == results[2]
        assert fault_mode([{"mode": "adapter-hydrator", "ok": True}]) is None  # its hydrator is gone by then
        staged_first = [{"mode": "full-interposer-hydrator", "ok": True}, {"mode": "full-interposer", "ok": True},
                        {"mode": "adapter-hydrator", "ok": True}, {"mode": "full", "ok": True}]
        assert fault_mode(staged_first) == staged_first[1]  # the default order: on full-interposer

    def test_one_set_of_images_is_kept_the_best_for_the_faults(self) -> None:
        full, interposer = {"mode": "full", "ok": True}, {"mode": "full-interposer", "ok": True}
        hydrator, failed = {"mode": "adapter-hydrator", "ok": True}, {"mode": "adapter", "ok": False}
        assert keep_images(None, full) == (full, None)
        assert keep_images(full, interposer) == (interposer, full)  # better: the previous set goes
        assert keep_images(interposer, full) == (interposer, full)
        assert keep_images(interposer, hydrator) == (interposer, hydrator)  # its hydrator is gone by the faults
        assert keep_images(None, failed) == (None, failed)
        staged = {"mode": "full-interposer-hydrator", "ok": True}
        assert keep_images(None, staged) == (None, staged)  # its images go at once: two sets on tmpfs at most


class TestEnvironment:
    def test_the_interposer_path_adds_only_the_preload_and_its_socket(self, tmp_path: Path) -> None:
        full = serve_layout(tmp_path / "a", tmp_path / "model", "full")
        interposer = serve_layout(tmp_path / "b", tmp_path / "model", "full-interposer")
        added = {k: v for k, v in interposer.environment().items() if full.environment().get(k) != v}
        assert added == {"LD_PRELOAD": f"{INTERPOSER_LIBRARY}:{NO_IO_URING_LIBRARY}",
                         "COLDSNAP_CUDA_INTERPOSER_SOCKET": INTERPOSER_SOCKET}
        assert full.environment()["LD_PRELOAD"] == NO_IO_URING_LIBRARY  # every server keeps uvloop, on epoll
        assert INTERPOSER_SOCKET == "/run/coldsnap/cuda-%p.sock"  # the interposer's contract (docs/interposer.md)
        assert full.environment()["PYTHONPATH"] == f"{WORKER_PATH}:{SERVER_SITE}"  # no adapter
        extra = [m for m in interposer.mounts() if m not in full.mounts()]
        assert [(m["target"], m.get("read_only", False)) for m in extra if "/images" not in m["target"]
                and m["target"] != RUN] == [("/run/coldsnap", False)]

    def test_the_staged_path_adds_only_its_node_hydrators_socket_in_the_same_directory(self, tmp_path: Path) -> None:
        plain = serve_layout(tmp_path / "a", tmp_path / "model", "full-interposer")
        staged = serve_layout(tmp_path / "b", tmp_path / "model", "full-interposer-hydrator")
        added = {k: v for k, v in staged.environment().items() if plain.environment().get(k) != v}
        assert added == {"COLDSNAP_CUDA_INTERPOSER_HYDRATOR": "/run/coldsnap/hydrator.sock"}
        assert STAGING_SOCKET.rpartition("/")[0] == INTERPOSER_RUN  # inside the directory every unit mounts
        assert {m["target"]: m for m in staged.mounts()}[INTERPOSER_RUN] == {
            "source": str(tmp_path / "b/coldsnap"), "target": INTERPOSER_RUN}  # writable: sockets are bound there

    def test_the_staged_paths_serving_and_restore_units_name_the_hydrator_under_the_interposer(
            self, tmp_path: Path) -> None:
        """What the server and every restore unit get: the preload, its socket and the hydrator's, the worker
        on the path, the mounts (the socket directory among them), the GPU and the host network; the restore
        unit's command is the worker restoring the capture, which finds the hydrator in the recorded environment."""
        staged = serve_layout(tmp_path, tmp_path / "model", "full-interposer-hydrator")
        name = unit_names("full-interposer-hydrator")[1]
        labels = unit_labels("cap-1", cluster("full-interposer-hydrator"))
        restore = staged.unit(name, "img", entrypoint="sh", command=restore_command(staged, "cap-1"), labels=labels)
        env = restore["environment"]
        assert [env[k] for k in ("LD_PRELOAD", "COLDSNAP_CUDA_INTERPOSER_SOCKET", "COLDSNAP_CUDA_INTERPOSER_HYDRATOR")
                ] == [f"{INTERPOSER_LIBRARY}:{NO_IO_URING_LIBRARY}", INTERPOSER_SOCKET, STAGING_SOCKET]
        assert env["PYTHONPATH"] == f"{WORKER_PATH}:{SERVER_SITE}" and "COLDSNAP_HYDRATION_SOCKET" not in env
        assert restore["mounts"] == staged.mounts() and INTERPOSER_RUN in {m["target"] for m in restore["mounts"]}
        assert (restore["gpus"], restore["network"], restore["labels"]) == (["0"], "host", labels)
        assert f"-m coldsnap_probe restore --images {IMAGES}/cap-1 " in restore["command"][1]
        assert "hydrator" not in restore["command"][1]  # no option: the worker reads the capture's environment

    def test_the_staged_paths_hydrator_keeps_dumps_on_its_gpu_when_the_bench_asks(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        staged = serve_layout(tmp_path, tmp_path / "model", "full-interposer-hydrator", criu_threads=8)
        monkeypatch.setenv("DEVICE_TIER", "20G")
        hydrator = staging_unit(staged, "img", unit_names("full-interposer-hydrator")[2])
        assert hydrator["command"][-4:] == ["--socket", STAGING_SOCKET, "--device-tier-bytes", "20G"]

    def test_the_staged_paths_hydrator_unit_stages_only_and_is_not_under_the_interposer(self, tmp_path: Path) -> None:
        staged = serve_layout(tmp_path, tmp_path / "model", "full-interposer-hydrator", criu_threads=8)
        hydrator = staging_unit(staged, "img", unit_names("full-interposer-hydrator")[2])
        assert hydrator["name"] == "serve-full-interposer-hydrator-hydrator" and hydrator["detached"] is True
        assert [hydrator["entrypoint"], *hydrator["command"]] == [
            staged.python, "-m", "coldsnap_probe.hydration", "serve", "--staging", "--ram-tier-bytes", "auto",
            "--socket", STAGING_SOCKET]
        env = hydrator["environment"]
        assert not {k for k in env if k == "LD_PRELOAD" or k.startswith("COLDSNAP_CUDA_INTERPOSER")}
        assert {k: v for k, v in staged.environment().items() if k not in env} == {
            "LD_PRELOAD": f"{INTERPOSER_LIBRARY}:{NO_IO_URING_LIBRARY}",
            "COLDSNAP_CUDA_INTERPOSER_SOCKET": INTERPOSER_SOCKET,
            "COLDSNAP_CUDA_INTERPOSER_HYDRATOR": STAGING_SOCKET}  # everything else as the server's unit
        assert env["PYTHONPATH"].split(":")[0] == WORKER_PATH  # it imports coldsnap_probe from the capsule
        # The same mounts (the images it reads the dumps from, the socket directory), the GPU it stages on.
        assert hydrator["mounts"] == staged.mounts() and (hydrator["gpus"], hydrator["network"]) == (["0"], "host")

    def test_the_adapter_paths_add_theirs_and_only_the_io_uring_preload(self, tmp_path: Path) -> None:
        env = serve_layout(tmp_path, tmp_path / "model", "adapter-hydrator").environment()
        assert env["PYTHONPATH"].split(":")[0] == ADAPTERS
        assert env["COLDSNAP_HYDRATION_SOCKET"] == f"{RUN}/hydration.sock"
        assert env["COLDSNAP_HYDRATOR_SOCKET"] == f"{RUN}/hydrator.sock"
        assert env["LD_PRELOAD"] == NO_IO_URING_LIBRARY and "COLDSNAP_CUDA_INTERPOSER_SOCKET" not in env

    def test_criu_threads_reach_the_unit_only_when_asked(self, tmp_path: Path) -> None:
        assert "CRIU_RESTORE_THREADS" not in serve_layout(tmp_path, tmp_path, "full").environment()
        assert serve_layout(tmp_path, tmp_path, "full", criu_threads=16).environment()["CRIU_RESTORE_THREADS"] == "16"

    def test_prepare_makes_the_socket_directory_private_and_drops_stale_sockets(self, tmp_path: Path) -> None:
        layout = serve_layout(tmp_path, tmp_path / "model", "full-interposer")
        assert layout.interposer_dir is not None
        layout.interposer_dir.mkdir(parents=True)
        (layout.interposer_dir / "cuda-513.sock").write_text("")
        (layout.interposer_dir / "keep.txt").write_text("")
        layout.prepare()
        assert sorted(p.name for p in layout.interposer_dir.iterdir()) == ["keep.txt"]
        fresh = serve_layout(tmp_path / "fresh", tmp_path / "model", "full-interposer")
        fresh.prepare()
        assert fresh.interposer_dir is not None and stat.S_IMODE(fresh.interposer_dir.stat().st_mode) == 0o700


class TestReports:
    def test_capture_phases_and_what_stayed_on_the_checkpoint_path(self) -> None:
        row = capture_row(CAPTURE)
        assert row["device_release_s"] == 0.41 and row["cuda_checkpoint_s"] == 0.52 and row["criu_dump_s"] == 1.1
        assert row["device_bytes"] == 17_000_000_000 and row["device_states"] == ["released", "released"]
        assert row["uncovered_bytes"] == {"below_threshold": 4_000_000}  # summed; empty kinds left out
        assert row["weights_release_s"] is None and row["device_warm"] is None
        first, second = CAPTURE["device_memory"]
        warmed = {**CAPTURE, "device_memory": [{**first, "warm": {"queued": True, "seconds": 0.004}}, second]}
        assert capture_row(warmed)["device_warm"] == [{"queued": True, "seconds": 0.004}]  # offered to the RAM tier

    def test_the_capture_s_detail_sums_the_release_threads_and_reads_criu_s_account(self) -> None:
        report = {**CAPTURE, "timings_s": {**CAPTURE["timings_s"], "worker_start": 0.12, "find_cuda": 0.2,
                                           "finish": 0.01, "interpreter_start": 0.05, "memory_scan": 0.04},
                  "criu_dump_stats": {"frozen_s": 0.9, "memdump_s": 0.6, "memwrite_s": 0.5, "pages_written": 9,
                                      "threads": 16},
                  "memory_before_checkpoint": {"513": {"anonymous_bytes": 900}, "514": {}},
                  "images_filesystem": {"type": "tmpfs", "huge": "always"},
                  "memory_after_checkpoint": {"513": {"anonymous_bytes": 1500}, "514": {"anonymous_bytes": 70}},
                  "device_memory": [{**d, "timings_s": {"dump": 0.7, "dump_write_thread_s": 8.0 + i,
                                                        "dump_digest_thread_s": 2.5}}
                                    for i, d in enumerate(CAPTURE["device_memory"])]}
        row = capture_row(report)
        assert row["release_thread_s"] == {"write": 17.0, "digest": 5.0}  # per process, summed; `dump` is wall
        assert (row["worker_start_s"], row["find_cuda_s"], row["finish_s"]) == (0.12, 0.2, 0.01)
        assert (row["interpreter_start_s"], row["memory_scan_s"]) == (0.05, 0.04)
        assert (row["criu_frozen_s"], row["criu_memdump_s"], row["criu_memwrite_s"]) == (0.9, 0.6, 0.5)
        assert row["criu_pages_written"] == 9 and row["checkpoint_added_bytes"] == 600 + 70
        assert row["criu_threads"] == 16 and capture_row(CAPTURE)["criu_threads"] is None
        assert capture_row(CAPTURE)["release_thread_s"] is None and capture_row(CAPTURE)["criu_frozen_s"] is None
        assert capture_row(CAPTURE)["checkpoint_added_bytes"] is None and capture_row(CAPTURE)["images_on"] is None
        assert row["images_on"] == "tmpfs huge=always"
        assert row["stack_limit"] is None  # an interposer that reported no stack limit
        lowered = {**report, "device_memory": [
            {**report["device_memory"][0], "stack_limit": {"engine_bytes": 1024, "set_bytes": 256}},
            {**report["device_memory"][1], "stack_limit": {"engine_bytes": 1024, "set_bytes": 1024, "error": "E"}}]}
        assert capture_row(lowered)["stack_limit"] == ["1024 -> 256", "1024 -> 1024 (error)"]

    def test_a_capture_without_the_interposer_has_no_device_phase(self) -> None:
        row = capture_row({"timings_s": {"criu_dump": 10.7, "cuda_checkpoint": 8.1}, "device_memory": None,
                           "hydration": {"release_seconds": 1.44, "released_bytes": 16_060_000_000}})
        assert row["device_release_s"] is None and row["device_bytes"] is None and row["device_states"] == []
        assert row["weights_release_s"] == 1.44

    def test_device_hydration_rate_is_the_whole_phase_s(self) -> None:
        assert device_hydration(RESTORE) == {"device_hydration_s": 0.5, "device_bytes": 17_000_000_000,
                                             "device_stack_restore_s": None, "device_gbps": 34.0,
                                             "device_verify": ["sampled"]}
        assert device_hydration({"criu_restore_seconds": 9.5}) == {
            "device_hydration_s": None, "device_bytes": None, "device_stack_restore_s": None, "device_gbps": None,
            "device_verify": []}
        set_back = {**RESTORE, "device_memory": [{**p, "stack_restore_s": 0.002 * (i + 1)}
                                                 for i, p in enumerate(RESTORE["device_memory"])]}
        assert device_hydration(set_back)["device_stack_restore_s"] == 0.002 * len(RESTORE["device_memory"])

    def test_images_count_the_device_dumps_apart(self, tmp_path: Path) -> None:
        (tmp_path / "device-513").mkdir()
        (tmp_path / "device-513/seg-0.bin").write_bytes(b"x" * 100)
        (tmp_path / "pages-1.img").write_bytes(b"y" * 30)
        assert images_bytes(tmp_path) == {"images_bytes": 130, "device_dump_bytes": 100}


def _answers(sums: tuple[float, float], served: int) -> dict[int, dict[str, Any]]:
    return {i: {"worker": i, "pid": 600 + i, "parent": 599, "served": served, "device_sum": s}
            for i, s in enumerate(sums)}


class TestForkedVerdict:
    def test_same_workers_with_their_device_state_pass(self) -> None:
        verdict = forked_verdict(_answers((1.0, 2.0), 1), _answers((1.0, 2.0), 2),
                                 {"device_states": ["released", "released"]}, interposer=True)
        assert verdict == {"same_workers": True, "state_went_on": True, "interposer_released": 2, "ok": True}

    @pytest.mark.parametrize(("after", "phases", "interposer"), [
        pytest.param(_answers((1.0, 0.0), 2), {}, False, id="device-memory-lost"),
        pytest.param(_answers((1.0, 2.0), 1), {}, False, id="state-reset"),
        pytest.param(_answers((1.0, 2.0), 2), {"device_states": ["released", "not-started"]}, True,
                     id="a-worker-bypassed-the-interposer")])
    def test_a_worker_that_did_not_come_back_as_itself_fails(self, after: dict[int, dict[str, Any]],
                                                             phases: dict[str, Any], interposer: bool) -> None:
        assert not forked_verdict(_answers((1.0, 2.0), 1), after, phases, interposer=interposer)["ok"]


class TestTables:
    def test_restore_rows_show_the_device_hydration_and_its_rate(self) -> None:
        restore = {"first_token_s": 1.5, "create_start_s": 0.1, "worker_started_s": 0.3, "criu_s": 0.4,
                   "cuda_s": 0.2, "hydration_s": None, "connected_s": 0.5, "request_to_first_token_s": 1.0,
                   "completion_s": 2.0, "identical": True, "after_ready_first_token_s": 0.07,
                   "second_request_to_first_token_s": 0.03, **device_hydration(RESTORE)}
        cold = {"first_token_s": 21.0, "create_start_s": 0.2, "connected_s": 19.0, "request_to_first_token_s": 2.0,
                "completion_s": 24.0, "chunks": 33, "finish_reason": "length", "text": "once upon",
                "warm_request_to_first_token_s": [0.031, 0.029, 0.03]}
        result = {"mode": "full-interposer", "cold": cold, "restores": [restore],
                  "capture_phases": capture_row(CAPTURE), "images_bytes": 19_000_000_000,
                  "device_dump_bytes": 17_000_000_000}
        lines = restore_lines(result)
        assert lines[1] == ("| full-interposer | restore 1 | 1.50 | 14.0x | 0.10 | 0.30 | 0.40 | 0.20 "
                            "| 0.50 (34.0 GB/s) | - | 0.50 | 1.00 | 0.07 | 0.03 | 2.00 | True |")
        assert lines[0].endswith("| 19.00 | 2.00 | - | 0.03 / 0.03 / 0.03 | 24.00 | - |")  # the warm requests
        assert capture_line(result) == (
            "| full-interposer | 0.41 (17.00 GB at 40.0 GB/s, released/released) | - | 0.01 | 0.52 | 1.10 "
            "| 19.00 (17.00) | below_threshold 4 MB |")
        text = table([result, {"mode": "full", "error": "E2EError: boom", "restores": []}], {"id": "sha256:ab"}, 0)
        assert all(line.count("|") == 17 for line in text.splitlines()[:4])  # 16 columns on every row
        assert "| full | failed: E2EError: boom |" in text

    def test_a_staged_row_says_staged_and_a_stage_that_failed_says_why_below_the_table(self) -> None:
        staged = {**RESTORE, "device_hydration_seconds": 0.05, "device_memory": [
            {**p, "interposer": {**p["interposer"], "stage": {"staged": True, "stage_s": 0.3}}}
            for p in RESTORE["device_memory"]]}
        late = {**staged, "device_hydration_seconds": 0.5, "device_memory": [
            {**staged["device_memory"][0], "interposer": {"stage": {"staged": True, "adopt_error": "stage expired"}}},
            staged["device_memory"][1]]}
        rows = [{"first_token_s": first, "create_start_s": 0.1, "worker_started_s": 0.3, "criu_s": 0.4, "cuda_s": 0.2,
                 "hydration_s": None, "connected_s": 0.5, "request_to_first_token_s": 0.6, "completion_s": 2.0,
                 "identical": True, **device_hydration(report), **device_staging(report)}
                for first, report in ((1.05, staged), (1.5, late), (1.6, RESTORE))]
        result = {"mode": "full-interposer-hydrator", "cold": {
            "first_token_s": 21.0, "create_start_s": 0.2, "connected_s": 19.0, "request_to_first_token_s": 2.0,
            "completion_s": 24.0, "chunks": 33, "finish_reason": "length", "text": "once"}, "restores": rows}
        lines = restore_lines(result)
        assert lines[1] == ("| full-interposer-hydrator | restore 1 | 1.05 | 20.0x | 0.10 | 0.30 | 0.40 | 0.20 "
                            "| 0.05 (340.0 GB/s, staged) | - | 0.50 | 0.60 | - | - | 2.00 | True |")
        assert "| 0.50 (34.0 GB/s, not staged) |" in lines[2]
        assert "| 0.50 (34.0 GB/s) |" in lines[3]  # no stage asked for: said as the plain interposer path
        assert all(line.count("|") == 17 for line in lines)
        notes = path_notes({**result, "units_left": ["serve-full-interposer-hydrator-hydrator"]})
        assert notes[1:] == [
            "full-interposer-hydrator restore 2: the device dump was not staged, the interposer filled it: "
            "stage expired",
            "full-interposer-hydrator: units left after the path: serve-full-interposer-hydrator-hydrator"]
        assert path_notes({"mode": "full", "restores": []}) == []


INTERPOSER_SOURCES = ROOT / "coldsnap_probe/hydration/interposer"


@pytest.mark.skipif(not INTERPOSER_SOURCES.is_dir(), reason="the CUDA interposer (branch interposer) is not merged")
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the GPU host has it)")
def test_the_capsule_carries_the_interposer_where_the_unit_preloads_it(tmp_path: Path,
                                                                       worker_capsule: WorkerCapsule) -> None:
    library = worker_capsule.context / "rootfs" / INTERPOSER_LIBRARY.lstrip("/")
    assert library.read_bytes()[:4] == b"\x7fELF"
    # Preloaded with its socket set, a program that never touches CUDA runs as without it (no socket appears).
    sockets = tmp_path / "run"
    sockets.mkdir()
    ran = subprocess.run([sys.executable, "-c", "print('served')"], capture_output=True, text=True, check=False,
                         env={"LD_PRELOAD": str(library), "COLDSNAP_CUDA_INTERPOSER_SOCKET": f"{sockets}/cuda-%p.sock"})
    assert ran.returncode == 0 and ran.stdout == "served\n", ran.stderr
    assert not list(sockets.iterdir())

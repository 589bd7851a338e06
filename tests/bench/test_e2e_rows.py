"""bench/e2e_rows.py without a GPU (the GPU rows run on the H200 through scripts/device daemon-rows): the rows a run
plans and what it refuses before starting anything, the table's cells from what the capture and the restores said,
and a whole row through the real daemon and dockerd: the two-process server's toy model as a detached unit, the
worker's capture inside it with real CRIU, two restore units, each to its first token with the same tokens; and a
row whose engine cannot start, reported with the engine's own words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import e2e_rows
from bench.e2e_restore import Driver
from bench.engine_rows import ROWS
from tests.criu import CRIU, criu_wrapper
from tests.helpers import ROOT, running_daemon

CONFIG = '[runtime]\nprivileged = "host-capabilities"\n'


@pytest.mark.parametrize(("text", "cpu", "model", "message"), [
    ("torch,nope", False, "", "nope: not one of torch, torch-expandable, torch-async, jax, jax-platform, split"),
    ("split,torch", True, "", "torch need a GPU: --cpu runs split"),
    ("torch,uvloop", False, "", "the uvloop row serves a model folder: give --model"),
    (",", False, "", "no row named"),
], ids=["unknown", "gpu-row-on-cpu", "uvloop-without-model", "empty"])
def test_a_row_that_cannot_run_is_refused_naming_it(text: str, cpu: bool, model: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        e2e_rows.plan_rows(text, cpu=cpu, model=model)
    assert e2e_rows.plan_rows("uvloop,split,torch", cpu=False, model="/m") == ["uvloop", "split", "torch"]


def test_the_command_line_refuses_before_any_daemon_is_asked(tmp_path: Path) -> None:
    """The state dir does not exist: any call to a daemon would fail otherwise than with exit 2."""
    done = subprocess.run([sys.executable, str(ROOT / "bench/e2e_rows.py"), "--state-dir", str(tmp_path / "none"),
                           "--capsule", "c", "--work", str(tmp_path), "--out", str(tmp_path), "--rows", "uvloop",
                           "--model", str(tmp_path / "no-model")], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2 and "--model: model folder" in done.stderr and "does not exist" in done.stderr, \
        done.stderr[-800:]
    assert list(tmp_path.iterdir()) == []


def test_every_row_of_the_shared_table_is_a_daemon_row_and_its_engine_is_mounted_in_the_units() -> None:
    layout = e2e_rows.row_layout(Path("/w"), "torch-async", cpu=False)
    command = e2e_rows.engine_command(layout, "split", 16, cpu=False)
    assert set(ROWS) < set(e2e_rows.E2E_ROWS) == set(e2e_rows.DEFAULT_ROWS)  # a new row runs by default
    assert command[:2] == ["/opt/engine/engine_llama.py", "launch"]
    assert command[-9:] == [layout.python, "/opt/engine/split_server.py", "--cuda", "--gib", "16", "--weights",
                            "device", "--socket", "/run/engine/engine.sock"]
    assert layout.extra_environment["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert layout.extra_environment["LD_PRELOAD"].endswith("libcoldsnap_cuda.so") and layout.gpus == ("0",)
    assert "COLDSNAP_CUDA_INTERPOSER_HYDRATOR" in layout.extra_environment  # the node hydrator stages the dumps
    cpu = e2e_rows.row_layout(Path("/w"), "split", cpu=True)
    assert cpu.gpus == () and "LD_PRELOAD" not in cpu.extra_environment and cpu.interposer_dir is None
    assert "--cuda" not in e2e_rows.engine_command(cpu, "split", 16, cpu=True)


def restored(seconds: float, *, identical: bool = True) -> dict[str, Any]:
    return {"first_token_s": seconds, "worker_started_s": 0.05, "criu_s": 0.3, "cuda_s": 0.4,
            "device_hydration_s": 0.1, "device_gbps": 160.0, "device_staged": True, "identical": identical}


def test_a_restore_says_which_tier_served_its_stages_and_how_long_they_took() -> None:
    def process(stage: dict[str, Any] | None) -> dict[str, Any]:
        return {"pid": 7, "interposer": {"bytes": 1, **({"stage": stage} if stage is not None else {})}}
    ram = {"staged": True, "tier": "ram", "stage_s": 0.41, "copy_s": 0.33, "wait_s": 0.02}
    disk = {"staged": True, "tier": "disk", "stage_s": 0.9, "copy_s": 0.7, "wait_s": 0.3}
    assert e2e_rows.stage_tiers({"device_memory": [process(ram), process(disk), process(None)]}) == {
        "stage_tiers": ["disk", "ram"], "stage_s": 0.9, "stage_copy_s": 0.7, "stage_wait_s": 0.3}
    refused = {"staged": False, "error": "staging is off"}
    assert e2e_rows.stage_tiers({"device_memory": [process(refused)]}) == {
        "stage_tiers": [], "stage_s": None, "stage_copy_s": None, "stage_wait_s": None}
    assert e2e_rows.stage_tiers({})["stage_tiers"] == []


def test_the_table_says_per_row_what_moved_what_stayed_the_event_loop_and_the_goal() -> None:
    moved = {"moved_bytes": 17_364_418_560, "moved_kinds": {"alloc": 17_000_000_000, "stream_ordered": 364_418_560},
             "left_bytes": {"stream_ordered": 33_683_488}, "moved_share": 0.998}
    rows = [{"row": "torch-async", "label": ROWS["torch-async"].label, "cold": {"first_token_s": 12.5},
             "restores": [restored(1.31), restored(1.16), restored(1.2)], "coverage": moved, "event_loops": None},
            {"row": "uvloop", "label": "transformers serve", "cold": {"first_token_s": 20.8},
             "restores": [restored(1.4), restored(1.6)], "coverage": moved, "event_loops": {"613": "uvloop"}},
            {"row": "split", "label": "two", "restores": [restored(1.0, identical=False)], "coverage": moved},
            {"row": "jax", "label": "JAX", "restores": [], "error": "E2EError: restore unit exited (code 1)",
             "units_left": ["rowsjax_node_0"]}]
    cells = [e2e_rows.row_cells(r) for r in rows]
    assert cells[0][2:] == ["12.50", "1.31 / 1.16 / 1.20", "0.05 / 0.30 / 0.40 / 0.10 (160.0 GB/s, staged)",
                            "17.36 GB (99.8%): alloc 17.00 GB, stream_ordered 364.4 MB", "stream_ordered 33.7 MB", "-",
                            "yes", "yes"]
    assert cells[1][7:] == ["uvloop", "yes", "no"]  # one restore over 1.5 s misses the goal
    assert cells[2][8:] == ["NO", "no"]
    assert cells[3][0].startswith("jax (FAILED: E2EError: restore unit exited") and "units left: rowsjax_node_0" in \
        cells[3][0] and cells[3][2:5] == ["-", "-", "-"] and cells[3][5] == "0.00 GB (0.0%)"
    text = e2e_rows.rows_table(rows, 16, {"id": "sha256:" + "a" * 64, "size": 168_000_000})
    assert text.splitlines()[0].startswith("| row ") and "16 GiB of weights a row" in text and "168 MB" in text


def test_the_capture_table_says_where_each_phase_went() -> None:
    capture = {"exec_s": 2.38, "device_release_s": 0.74, "device_gbps": 22.16, "cuda_lock_s": 0.01,
               "cuda_checkpoint_s": 0.33, "criu_dump_s": 0.91, "criu_frozen_s": 0.85, "criu_memdump_s": 0.6,
               "criu_memwrite_s": 0.45, "criu_pages_written": 190_000, "worker_start_s": 0.1, "find_cuda_s": 0.2,
               "finish_s": 0.01, "interpreter_start_s": 0.05, "memory_scan_s": 0.04,
               "checkpoint_added_bytes": 1_230_000_000, "images_on": "tmpfs huge=never",
               "release_thread_s": {"write": 9.72, "digest": 2.93, "device": 0.68, "zero": 0.01}}
    assert e2e_rows.capture_cells({"row": "uvloop", "capture": {**capture, "stack_limit": ["1024 -> 256"]}}) == [
        "uvloop", "tmpfs huge=never", "2.38", "0.74 (22.16)", "9.72 / 2.93 / 0.68 / 0.01", "0.34 (1.23)",
        "0.91: 0.85 / 0.60 / 0.45", "0.78", "0.05 / 0.10 / 0.20 / 0.04 / 0.01", "1024 -> 256"]
    assert e2e_rows.capture_cells({"row": "jax", "error": "E2EError"})[1:] == [
        "-", "-", "- (-)", "- / - / - / -", "-", "-: - / - / -", "-", "- / - / - / - / -", "-"]


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
async def test_a_row_runs_through_the_daemon_from_its_cold_start_to_its_restores_with_nothing_left(
        busybox_image: str, tmp_path: Path) -> None:
    """The busybox image as the capsule, this host's python3 and the built CRIU mounted in: the daemon path of a
    GPU row with its engine on the CPU. The restores come back in fresh containers (their own PID namespaces) at
    the captured PIDs, and answer with the cold start's tokens and first digest."""
    with criu_wrapper(tmp_path) as wrapper:
        layout = e2e_rows.row_layout(tmp_path / "work", "split", cpu=True)
        layout.python, layout.criu, layout.extra_environment["PYTHONPATH"] = "/usr/bin/python3", wrapper, str(ROOT)
        layout.host_mounts = ("/usr", "/lib", "/lib64", str(ROOT), str(tmp_path), str(CRIU.parent.parent.parent))
        async with running_daemon(CONFIG) as daemon:
            d = Driver(daemon.state_dir)
            await d.open()
            result = await e2e_rows.run_row(d, busybox_image, layout, "split", gib=1, restores=2, cpu=True)
            layout.extra_environment["PYTHONPATH"] = "/nonexistent"  # the engine cannot import the probe's jsonline
            failed = await e2e_rows.run_row(d, busybox_image, layout, "split", gib=1, restores=1, cpu=True)
    assert result["ok"], result.get("error")
    # A row that fails is a row of the table, with the engine's own last words and no unit left behind.
    assert not failed["ok"] and "units_left" not in failed and "the server exited before its first token" in \
        failed["error"] and "ModuleNotFoundError: No module named 'coldsnap_probe'" in failed["error"], failed
    # The table's cell leads with the engine's own error line (a JAX row's is kilobytes long: issue 36).
    assert "(FAILED: E2EError: ModuleNotFoundError: No module named 'coldsnap_probe' (the engine run alone)" in \
        e2e_rows.row_cells(failed)[0], e2e_rows.row_cells(failed)[0]
    cold, restores = result["cold"], result["restores"]
    assert len(cold["tokens"]) == e2e_rows.TOKENS and cold["server_pid"] >= 512  # above the capsule init's floor
    assert len(result["tree"]) == 3 and result["tree"][0] == cold["server_pid"]  # front end, core, tracker
    assert [r["identical"] for r in restores] == [True, True] and all(r["criu_s"] > 0 for r in restores)
    assert result["coverage"]["moved_share"] == 0.0 and "units_left" not in result
    assert not (tmp_path / "work" / "split" / "images").exists()  # the row's images go with it
    assert e2e_rows.row_cells(result)[8] == "yes"
    capture = e2e_rows.capture_cells(result)  # CRIU's own account of the real dump, the worker's own steps
    assert capture[6].split(": ")[1].count("/") == 2 and "-" not in capture[6] and capture[7] != "-", capture
    assert capture[1] not in ("", "-"), capture  # the filesystem the images went to, as the worker read it

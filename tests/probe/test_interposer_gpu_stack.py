"""The interposer's smaller CUDA checkpoint on a GPU (issue 35): a release lowers the context's stack limit (the
driver reserves it for every resident thread, and the checkpoint copies that reservation), the hydration sets it
back to the engine's own value before any engine call runs. An unchanged CuPy process that set its own limit
(4 KiB) is released, CUDA-checkpointed and restored in place with the knob on and off, side by side: the
checkpoint's added host bytes shrink by most of the reservation, and after the restore the engine reads its own
limit and a recursive kernel that needs more than the lowered stack still runs. The same through the workers and
CRIU (the reports' fields); a set-back the driver cannot do refuses the hydration naming the phase, nothing
created, and a later one succeeds; the engine's own cuCtxGetLimit waits at the gate while released. Skipped
without an NVIDIA driver."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe._reports import StackLimit
from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration import build_library
from coldsnap_probe.hydration._interposer import interposer_request
from tests.helpers import ROOT
from tests.probe.test_interposer_gpu import wait_for
from tests.probe.test_main import has_nvidia_driver

pytestmark = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
ENGINE_STACK = 4096  # the engine's own limit: four times the driver's default
DEPTH = 6  # the recursive kernel's depth: 2-3 KiB of stack, more than the lowered 16 bytes and the 1 KiB default
MIB = 1 << 20


class StackTarget:
    """The CuPy process (`tests/probe/_stack_target.py`) and its interposer socket."""

    def __init__(self, root: Path, library: Path, env: dict[str, str] | None = None,
                 socket: str = "cuda.sock") -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.directory = root / "target"
        self.directory.mkdir()
        self.socket = str(root / socket)
        environment = {**os.environ, "LD_PRELOAD": str(library), "COLDSNAP_CUDA_INTERPOSER_SOCKET": self.socket,
                       **(env or {})}
        self.log = root / "target.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.probe._stack_target", str(self.directory),
                                          str(ENGINE_STACK), str(DEPTH)], cwd=ROOT, env=environment,
                                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.ready = wait_for(self.directory / "ready", self.proc)
        assert "error" not in self.ready, self.ready
        self.count = 0

    def ask(self, kind: str, timeout: float = 60.0) -> dict[str, Any]:
        self.count += 1
        (self.directory / f"{kind}-{self.count}").touch()
        return wait_for(self.directory / f"answer-{kind}-{self.count}", self.proc, timeout)

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            return interposer_request(self.socket.replace("%p", str(self.proc.pid)), message,
                                      f"interposer {message.get('op')}", timeout=30.0)
        except HydrationError as exc:
            raise HydrationError(f"{exc}\n--- target log ---\n{self.log.read_text(errors='replace')[-2000:]}") from exc

    def release(self, dump: Path) -> StackLimit:
        dump.mkdir(mode=0o700)
        return StackLimit.from_json(self.request({"op": "release", "dir": str(dump)})["stack_limit"])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.proc.wait()


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, diagnostics = build_library(tmp_path_factory.mktemp("stack-lib"))
    assert diagnostics == ""
    return path


def checkpoint_in_place(pid: int) -> int:
    """Lock, checkpoint, restore and unlock `pid` from this process; the host bytes the checkpoint added."""
    from coldsnap_probe._cuda import Driver
    from coldsnap_probe._process import anonymous_memory, require_state

    driver = Driver()
    driver.call("cuInit", 0)
    args = driver.cuda.CUcheckpointLockArgs()
    args.timeoutMs = 30_000
    before = anonymous_memory(pid)["anonymous_bytes"]
    driver.call("cuCheckpointProcessLock", pid, args)
    driver.call("cuCheckpointProcessCheckpoint", pid, None)
    require_state(driver, [pid], "checkpointed", "after checkpoint")
    added = int(anonymous_memory(pid)["anonymous_bytes"]) - int(before)
    driver.call("cuCheckpointProcessRestore", pid, None)
    driver.call("cuCheckpointProcessUnlock", pid, None)
    require_state(driver, [pid], "running", "after unlock")
    return added


def test_the_checkpoint_copies_less_and_the_engine_gets_its_own_limit_back(library: Path, tmp_path: Path) -> None:
    """Knob on (the default) and off, one after the other on the same GPU: the added host bytes and the limits."""
    rows: dict[str, dict[str, Any]] = {}
    for knob in ("1", "0"):
        target = StackTarget(tmp_path / f"shrink-{knob}", library, {"COLDSNAP_CUDA_INTERPOSER_SHRINK_STACK": knob})
        try:
            assert target.ready["limit"] == ENGINE_STACK, target.ready
            stack = target.release(tmp_path / f"dump-{knob}")
            added = checkpoint_in_place(target.proc.pid)
            report = target.request({"op": "hydrate", "policy": "same-gpu"})["report"]
            after = target.ask("check")
            rows[knob] = {"stack": stack, "added": added, "restore_s": report.get("stack_restore_s"),
                          "after": after, "resident": target.ready["resident_threads"]}
            assert after == {**{k: target.ready[k] for k in ("limit", "kernel", "data")}, "pid": target.proc.pid}
        finally:
            target.kill()
    on, off = rows["1"], rows["0"]
    print(f"\nstack limit   engine B   set B   checkpoint added MB   set-back s\n"
          f"lowered       {on['stack'].engine_bytes:8} {on['stack'].set_bytes:7} {on['added'] / 1e6:21.1f}"
          f"   {on['restore_s']}\n"
          f"off           {off['stack'].engine_bytes:8} {off['stack'].set_bytes:7} {off['added'] / 1e6:21.1f}"
          f"   {off['restore_s']}\nresident threads {on['resident']}, lowering took {on['stack'].seconds:.6f} s")
    assert on["stack"] == StackLimit(enabled=True, engine_bytes=ENGINE_STACK, set_bytes=on["stack"].set_bytes,
                                     contexts=1, seconds=on["stack"].seconds)
    assert on["stack"].set_bytes < ENGINE_STACK and on["restore_s"] is not None and on["restore_s"] >= 0
    assert off["stack"].enabled is False and off["stack"].set_bytes == ENGINE_STACK and off["stack"].error is None
    # The reservation is (limit x resident threads): lowering 4 KiB to 16 B takes most of it off the checkpoint.
    expected = (ENGINE_STACK - on["stack"].set_bytes) * on["resident"]
    assert off["added"] - on["added"] >= expected // 2, (on["added"], off["added"], expected)


def test_a_set_back_the_driver_cannot_do_refuses_the_hydration_and_a_later_one_succeeds(library: Path,
                                                                                        tmp_path: Path) -> None:
    """No room for the engine's stack on the device: the hydration is refused naming its phase before anything is
    created (the engine must not run on a smaller stack than it set), the gate stays closed; the engine's own
    cuCtxGetLimit, asked meanwhile, reads only its own value."""
    from coldsnap_probe._cuda import Driver

    target = StackTarget(tmp_path, library)
    try:
        assert target.release(tmp_path / "dump").set_bytes < ENGINE_STACK
        asked: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: asked.update(target.ask("limit")))
        reader.start()
        driver = Driver()
        driver.context()
        free, _total = driver.call("cuMemGetInfo")
        hog = driver.call("cuMemAlloc_v2", int(free) - 32 * MIB)  # less than the engine's 4 KiB stack needs
        try:
            with pytest.raises(HydrationError, match=r"hydrate: stack limit: context 0x[0-9a-f]+: "
                                                     r"cuCtxSetLimit\(CU_LIMIT_STACK_SIZE, 4096\), the engine's: "
                                                     r"CUDA_ERROR_\w+"):
                target.request({"op": "hydrate"})
            status = target.request({"op": "status"})
            assert status["mapped_bytes"] == 0 and status["gate"] == "closed" and status["released"] is True
            assert status["stack_lowered"] == 1, status  # still lowered: the next hydration sets it back
        finally:
            driver.call("cuMemFree_v2", hog)
        hydrated = time.time()
        target.request({"op": "hydrate"})
        assert target.request({"op": "status"})["stack_lowered"] == 0
        reader.join(30)
        # Asked while the limit was lowered: the engine's cudaDeviceGetLimit reaches cuCtxGetLimit, which waits at
        # the gate (without it, it would read 16 at once); only its own value ever comes back.
        assert asked["limit"] == ENGINE_STACK, asked
        print(f"\nthe engine's cudaDeviceGetLimit returned {asked['returned_unix'] - hydrated:+.3f} s after hydrate")
        assert target.ask("check") == {**{k: target.ready[k] for k in ("limit", "kernel", "data")},
                                       "pid": target.proc.pid}
    finally:
        target.kill()


@pytest.mark.skipif(not has_nvidia_driver() or shutil.which("criu") is None,
                    reason="needs an NVIDIA driver and CRIU (run on the GPU host)")
def test_the_workers_report_the_stack_limit_and_its_set_back(library: Path, tmp_path: Path) -> None:
    from tests.probe.test_worker import kill_and_reap, worker

    ctypes.CDLL(None).prctl(36, 1)  # a subreaper: the restored tree is reparented here
    target = StackTarget(tmp_path, library, socket="cuda-%p.sock")
    try:
        images = tmp_path / "images"
        done = worker("capture", "--pid", str(target.proc.pid), "--images", str(images), "--criu",
                      shutil.which("criu") or "")
        assert done.returncode == 0, done.stderr
        target.proc.wait()  # CRIU killed it: its pid is free for the restore
        [released] = json.loads(done.stdout)["device_memory"]
        stack = StackLimit.from_json(released["stack_limit"])
        assert stack.enabled and stack.engine_bytes == ENGINE_STACK and stack.set_bytes < ENGINE_STACK, stack
        done = worker("restore", "--images", str(images), "--work-dir", str(tmp_path / "work"))
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        [hydrated] = report["device_memory"]
        assert 0 <= hydrated["stack_restore_s"] == hydrated["interposer"]["stack_restore_s"] < 5, hydrated
        print(f"\nstack set-back {hydrated['stack_restore_s']:.6f} s, CUDA restore "
              f"{report.get('cuda_restore_seconds')} s, hydration {report.get('device_hydration_seconds')} s")
        assert target.ask("check") == {**{k: target.ready[k] for k in ("limit", "kernel", "data")},
                                       "pid": target.proc.pid}
        kill_and_reap(report["restored_pid"])
    finally:
        target.kill()

"""The CUDA canaries (spec 2.3-2.6): each runs for real and returns typed FeatureResults.

Child processes (`_target`, `_ipc_target`) are this package run again with the same
interpreter; they print one JSON line on stdout and their diagnostics on stderr. A canary's
own checks raise CanaryFailed; every error inside a canary becomes its negative result.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._cuda import CHECKPOINT_SYMBOLS, Driver, pattern, pattern_sha256
from ._model import FeatureResult
from .errors import CanaryFailed, CudaLibraryMissing, CudaUnavailable, DriverError

__all__ = (
    "checkpoint_report",
    "checkpoint_results",
    "fresh_state",
    "ipc_canary",
    "ipc_target",
    "known_negatives",
    "roundtrip_target",
    "vmm_canary",
)

_PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


def _child_command(*args: str) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    return [sys.executable, "-m", "coldsnap_probe", *args], env


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# --- checkpoint state transition + allocation round trip (parent side) -------------------


class _Target:
    """The disposable CUDA child: line protocol over its stdin/stdout."""

    def __init__(self, memory_bytes: int, timeout: float) -> None:
        command, env = _child_command("_target", "--memory-bytes", str(memory_bytes))
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                        text=True, bufsize=1, env=env)
        self.timeout = timeout

    def read_line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(self.timeout):
                raise CanaryFailed(f"CUDA target did not answer within {self.timeout:g} s")
        line = self.process.stdout.readline()
        if not line:
            raise CanaryFailed(f"CUDA target exited with status {self.process.wait()}")
        value = json.loads(line)
        if not isinstance(value, dict):
            raise CanaryFailed("CUDA target printed a non-object line")
        return value

    def command(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def finish(self) -> None:
        """Ask it to exit; terminate, then kill, so it is always gone."""
        if self.process.poll() is None:
            try:
                self.command("exit")
            except (BrokenPipeError, OSError):
                pass
            for stop in (None, self.process.terminate, self.process.kill):
                if stop is not None:
                    stop()
                try:
                    self.process.wait(5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def _round_trip(driver: Driver, target: _Target, report: dict[str, Any]) -> None:
    """Lock, checkpoint, restore and unlock the ready target, each state checked, then verify its bytes."""
    ready = target.read_line()
    report["target"] = ready
    if ready.get("status") != "ready" or ready.get("pid") != target.process.pid:
        raise CanaryFailed(f"CUDA target did not become ready: {ready}")
    states = [driver.state(target.process.pid)]
    for step in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore",
                 "cuCheckpointProcessUnlock"):
        driver.call(step, target.process.pid, None)
        states.append(driver.state(target.process.pid))
    report["states"] = states
    if states != ["running", "locked", "checkpointed", "locked", "running"]:
        raise CanaryFailed(f"unexpected checkpoint state sequence: {', '.join(states)}")
    target.command("verify")
    verification = target.read_line()
    report["verification"] = verification
    report["roundtrip_supported"] = verification.get("matches") is True
    if not report["roundtrip_supported"]:
        report["error"] = f"allocation contents changed across checkpoint/restore: {verification}"


def checkpoint_report(memory_bytes: int, timeout: float) -> dict[str, Any]:
    """The `cuda-process-checkpoint-capability` report with the round trip (spec 2.3)."""
    report: dict[str, Any] = {"format": 1, "kind": "cuda-process-checkpoint-capability",
                              "started_unix": time.time(), "roundtrip_requested": True,
                              "memory_bytes": memory_bytes, "library_loaded": False, "api_available": False,
                              "operations": [], "cleanup": [], "roundtrip_supported": None, "error": None}
    try:
        driver = Driver()
    except CudaLibraryMissing as exc:
        report["error"] = _error_text(exc)
        report["completed_unix"] = time.time()
        return report
    report["library_loaded"] = True
    report["symbols"] = driver.symbols(CHECKPOINT_SYMBOLS)
    try:
        driver.call("cuInit", 0)
        initialized = True
    except DriverError as exc:
        initialized = False
        report["error"] = _error_text(exc)
    report["initialization"] = driver.records[-1] if driver.records else None
    try:
        version = driver.call("cuDriverGetVersion")
        report["driver_api"] = {**driver.last(), "driver_api_version": int(version)}
    except DriverError:
        report["driver_api"] = driver.records[-1] if driver.records else None
    report["api_available"] = all(report["symbols"].values()) and initialized
    if not report["api_available"]:
        report["completed_unix"] = time.time()
        return report
    start = len(driver.records)
    target = _Target(memory_bytes, timeout)
    report["target_pid"] = target.process.pid
    try:
        _round_trip(driver, target, report)
    except Exception as exc:
        report["roundtrip_supported"] = False
        report["error"] = _error_text(exc)
    finally:
        report["operations"] = driver.records[start:]
        cleanup_start = len(driver.records)
        _unlock_and_stop(driver, target)
        report["cleanup"] = driver.records[cleanup_start:]
    report["completed_unix"] = time.time()
    return report


def _unlock_and_stop(driver: Driver, target: _Target) -> None:
    """Leave the child running (restore, unlock) and then gone, whatever state it was left in."""
    pid = target.process.pid
    if target.process.poll() is None:
        try:
            state = driver.state(pid)
            if state == "checkpointed":
                driver.call("cuCheckpointProcessRestore", pid, None, required=False)
                state = driver.state(pid)
            if state == "locked":
                driver.call("cuCheckpointProcessUnlock", pid, None, required=False)
        except DriverError:
            pass  # best effort: the child is terminated next in any case
    target.finish()


def checkpoint_results(report: dict[str, Any], started: float) -> list[FeatureResult]:
    """Map the report to cuda-checkpoint-api, cuda-checkpoint-roundtrip and cuda-initialized-state."""
    seconds = max(0.0, report.get("completed_unix", started) - started)
    probe = "cuda-process-checkpoint-v1"
    if report["api_available"]:
        api = FeatureResult(id="cuda-checkpoint-api", status="passed", probe=probe, seconds=seconds)
    else:
        symbols = report.get("symbols")
        status = "unsupported" if symbols is not None and not all(symbols.values()) else "failed"
        reason = report.get("error") or "CUDA process checkpoint symbols are unavailable"
        if status == "unsupported" and not report.get("error"):
            missing = sorted(k for k, v in symbols.items() if not v)  # type: ignore[union-attr]
            reason = f"CUDA process checkpoint symbols are unavailable: {', '.join(missing)}"
        api = FeatureResult(id="cuda-checkpoint-api", status=status, probe=probe, failure_phase="symbols",
                            reason=reason, seconds=seconds)
    if report.get("roundtrip_supported") is True:
        roundtrip = FeatureResult(id="cuda-checkpoint-roundtrip", status="passed", probe=probe, seconds=seconds)
    elif report["api_available"]:
        roundtrip = FeatureResult(id="cuda-checkpoint-roundtrip", status="failed", probe=probe,
                                  failure_phase="roundtrip", seconds=seconds,
                                  reason=report.get("error") or "checkpoint state transition or byte canary failed")
    else:
        roundtrip = FeatureResult(id="cuda-checkpoint-roundtrip", status=api.status, probe=probe,
                                  failure_phase="roundtrip", seconds=seconds,
                                  reason="CUDA process checkpoint API is unavailable")
    initialized = FeatureResult(id="cuda-initialized-state", status=roundtrip.status, probe=probe, seconds=seconds,
                                reason=roundtrip.reason)
    return [api, roundtrip, initialized]


# --- children --------------------------------------------------------------------------


def roundtrip_target(memory_bytes: int) -> int:
    """`_target`: hold `memory_bytes` of the pattern on the device and answer verify/exit."""
    driver = Driver()
    driver.context()
    data = pattern(memory_bytes)
    dptr = driver.call("cuMemAlloc_v2", memory_bytes)
    driver.copy_to_device(dptr, data)
    _emit({"expected_sha256": hashlib.sha256(data).hexdigest(), "memory_bytes": memory_bytes,
           "pid": os.getpid(), "status": "ready"})
    for line in sys.stdin:
        command = line.strip()
        if command == "verify":
            try:
                actual = hashlib.sha256(driver.copy_from_device(dptr, memory_bytes)).hexdigest()
                _emit({"actual_sha256": actual, "matches": actual == hashlib.sha256(data).hexdigest(),
                       "status": "verified"})
            except Exception as exc:
                _emit({"error": _error_text(exc), "status": "verify-failed"})
        elif command == "exit":
            return 0
        else:
            _emit({"status": "invalid-command"})
    return 0


def ipc_target(handle_b64: str, memory_bytes: int, expected_sha256: str) -> int:
    """`_ipc_target`: open the exported handle in this second process and compare the bytes."""
    driver = Driver()
    driver.context()
    handle = driver.ipc_handle_from_bytes(base64.b64decode(handle_b64, validate=True))
    dptr = driver.call("cuIpcOpenMemHandle_v2", handle, 1)
    try:
        actual = hashlib.sha256(driver.copy_from_device(dptr, memory_bytes)).hexdigest()
    finally:
        driver.call("cuIpcCloseMemHandle", dptr, required=False)
    matches = actual == expected_sha256
    _emit({"actual_sha256": actual, "matches": matches})
    return 0 if matches else 1


def _emit(value: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(value, sort_keys=True) + "\n")
    sys.stdout.flush()


# --- IPC and VMM canaries ----------------------------------------------------------------

_IPC_SYMBOLS = ("cuIpcGetMemHandle", "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle")
_VMM_SYMBOLS = ("cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
                "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess")


def _negative(feature: str, probe: str, phase: str, exc: BaseException, started: float) -> FeatureResult:
    unsupported = isinstance(exc, CudaUnavailable)
    return FeatureResult(id=feature, status="unsupported" if unsupported else "failed", probe=probe,
                         failure_phase="symbols" if unsupported and phase == "load" else phase,
                         reason=_error_text(exc), seconds=time.perf_counter() - started)


def ipc_canary(memory_bytes: int, timeout: float) -> FeatureResult:
    started, phase = time.perf_counter(), "load"
    probe = "cuda-classic-ipc-v1"
    driver: Driver | None = None
    dptr = None
    try:
        driver = Driver()
        driver.require_symbols(_IPC_SYMBOLS)
        phase = "context"
        driver.context()
        phase = "allocate"
        dptr = driver.call("cuMemAlloc_v2", memory_bytes)
        driver.copy_to_device(dptr, pattern(memory_bytes))
        phase = "export"
        handle = driver.ipc_handle_bytes(driver.call("cuIpcGetMemHandle", dptr))
        phase = "consumer"
        command, env = _child_command("_ipc_target", "--handle", base64.b64encode(handle).decode(),
                                      "--memory-bytes", str(memory_bytes),
                                      "--expected-sha256", pattern_sha256(memory_bytes))
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        if done.returncode != 0:
            raise CanaryFailed(f"IPC consumer exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
        answer = json.loads(done.stdout)
        if answer.get("matches") is not True:
            raise CanaryFailed(f"IPC consumer saw different bytes: {answer}")
        return FeatureResult(id="cuda-classic-ipc", status="passed", probe=probe,
                             seconds=time.perf_counter() - started,
                             evidence={"memory_bytes": memory_bytes, "matches": True,
                                       "actual_sha256": answer["actual_sha256"]})
    except Exception as exc:
        return _negative("cuda-classic-ipc", probe, phase, exc, started)
    finally:
        if driver is not None and dptr is not None:
            driver.call("cuMemFree_v2", dptr, required=False)


def _pinned_read_write(cuda: Any, device: int) -> tuple[Any, Any]:
    """A pinned allocation's properties on `device`, and read-write access to it from there."""
    prop = cuda.CUmemAllocationProp()
    prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    access = cuda.CUmemAccessDesc()
    access.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return prop, access


def vmm_canary() -> FeatureResult:
    started, phase = time.perf_counter(), "load"
    probe = "cuda-vmm-exact-v1"
    driver: Driver | None = None
    handle = va = initial = size = None
    try:
        driver = Driver()
        driver.require_symbols(_VMM_SYMBOLS)
        cuda = driver.cuda
        phase = "context"
        device = driver.context()
        prop, access = _pinned_read_write(cuda, device)
        phase = "granularity"
        size = int(driver.call("cuMemGetAllocationGranularity", prop,
                               cuda.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        phase = "reserve-initial"
        initial = int(driver.call("cuMemAddressReserve", size, 0, 0, 0))
        va = initial
        phase = "create"
        handle = driver.call("cuMemCreate", size, prop, 0)
        phase = "map-initial"
        driver.call("cuMemMap", initial, size, 0, handle, 0)
        driver.call("cuMemSetAccess", initial, size, [access], 1)
        phase = "write-initial"
        data = pattern(size)
        driver.copy_to_device(initial, data)
        driver.call("cuMemUnmap", initial, size)
        phase = "free-initial-va"
        driver.call("cuMemAddressFree", initial, size)
        va = None
        phase = "reserve-exact"
        va = int(driver.call("cuMemAddressReserve", size, 0, initial, 0))
        if va != initial:
            raise CanaryFailed(f"exact CUDA VA request returned {va:#x}, expected {initial:#x}")
        phase = "map-exact"
        driver.call("cuMemMap", va, size, 0, handle, 0)
        driver.call("cuMemSetAccess", va, size, [access], 1)
        phase = "verify-exact"
        if driver.copy_from_device(va, size) != data:
            raise CanaryFailed("private CUDA VMM contents changed across exact-address remap")
        driver.call("cuMemUnmap", va, size)
        return FeatureResult(id="cuda-vmm-exact-address", status="passed", probe=probe,
                             seconds=time.perf_counter() - started,
                             evidence={"address": initial, "bytes": size, "device": device,
                                       "sha256": hashlib.sha256(data).hexdigest()})
    except Exception as exc:
        return _negative("cuda-vmm-exact-address", probe, phase, exc, started)
    finally:
        if driver is not None:
            if va is not None and size is not None:
                driver.call("cuMemAddressFree", va, size, required=False)
            if handle is not None:
                driver.call("cuMemRelease", handle, required=False)


def fresh_state(report: dict[str, Any]) -> FeatureResult:
    """The disposable process is a fresh CUDA boundary, but only where CUDA can be loaded at all."""
    probe = "disposable-process-boundary-v1"
    if report["library_loaded"]:
        return FeatureResult(id="cuda-fresh-state", status="passed", probe=probe, seconds=0.0)
    return FeatureResult(id="cuda-fresh-state", status="failed", probe=probe, failure_phase="load", seconds=0.0,
                         reason=report.get("error") or "the CUDA driver library could not be loaded")


def known_negatives() -> list[FeatureResult]:
    probe = "known-negative-v1"
    return [
        FeatureResult(id="cuda-uvm-checkpoint", status="unsupported", probe=probe, seconds=0.0,
                      reason="CUDA process checkpoint does not support UVM (managed-memory) allocations"),
        FeatureResult(id="cuda-vmm-exported-handle-checkpoint", status="unsupported", probe=probe, seconds=0.0,
                      reason="CUDA process checkpoint does not support exported VMM allocation handles"),
    ]

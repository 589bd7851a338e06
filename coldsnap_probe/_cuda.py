"""Every CUDA driver call goes through :class:`Driver.call` (cuda-python's ``cuda.bindings.driver``).

Each call leaves an operation record ``{operation, code, error_name, error_string, seconds,
success}``; a required call that fails raises :class:`CudaError` with the text
``<fn> failed: <ERROR_NAME>: <error string>``. Symbol presence is read from
``libcuda.so.1`` itself (ctypes), never assumed from the binding.

This is the one place where cuda-python's and libcuda's failures become this package's
errors (`errors.DriverError` and below), always chained to the original.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from typing import Any

from .errors import CanaryFailed, CudaError, CudaLibraryMissing, CudaUnavailable

__all__ = ("CHECKPOINT_SYMBOLS", "IPC_HANDLE_BYTES", "STATE_NAMES", "Driver", "pattern", "pattern_sha256")

CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
STATE_NAMES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
# The binding's names for the versioned driver entry points the spec lists.
_BINDING_NAMES = {"cuMemAlloc_v2": "cuMemAlloc", "cuMemcpyHtoD_v2": "cuMemcpyHtoD",
                  "cuMemcpyDtoH_v2": "cuMemcpyDtoH", "cuMemFree_v2": "cuMemFree",
                  "cuIpcOpenMemHandle_v2": "cuIpcOpenMemHandle"}
IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle)


def pattern(size: int) -> bytes:
    """The canary bytes: byte i of each 4096-byte block is (i*31 + 7) & 0xFF, truncated to `size`."""
    block = bytes((i * 31 + 7) & 0xFF for i in range(4096))
    return (block * (size // 4096 + 1))[:size]


def pattern_sha256(size: int) -> str:
    return hashlib.sha256(pattern(size)).hexdigest()


class Driver:
    """libcuda through cuda-python, with per-call records. Construction fails with CudaLibraryMissing."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_LOCAL)
        except OSError as exc:
            raise CudaLibraryMissing(f"libcuda.so.1 could not be loaded: {exc}") from exc
        try:
            from cuda.bindings import driver
        except ImportError as exc:
            raise CudaLibraryMissing(f"cuda-python (cuda.bindings.driver) is not importable: {exc}") from exc
        self._driver: Any = driver
        self.records: list[dict[str, Any]] = []

    def has(self, symbol: str) -> bool:
        return hasattr(self._lib, symbol)

    def symbols(self, names: tuple[str, ...]) -> dict[str, bool]:
        return {name: self.has(name) for name in names}

    def require_symbols(self, names: tuple[str, ...]) -> None:
        missing = [n for n in names if not self.has(n)]
        if missing:
            raise CudaUnavailable(f"CUDA driver symbols are unavailable: {', '.join(missing)}")

    def _error_text(self, err: Any) -> tuple[str, str]:
        try:
            _, name = self._driver.cuGetErrorName(err)
            _, text = self._driver.cuGetErrorString(err)
            return (name.decode() if isinstance(name, bytes) else str(name),
                    text.decode() if isinstance(text, bytes) else str(text))
        except Exception:
            return "unknown", "unknown"

    def call(self, name: str, *args: Any, required: bool = True) -> Any:
        """Call `name`; returns the outputs (one value unwrapped, several as a tuple, none as None)."""
        if not self.has(name):
            raise CudaUnavailable(f"CUDA driver symbol {name} is unavailable")
        fn = getattr(self._driver, _BINDING_NAMES.get(name, name))
        started = time.monotonic()
        try:
            result = fn(*args)
        except (RuntimeError, OSError) as exc:  # the binding could not resolve or load the entry point
            raise CudaUnavailable(f"{name} could not be called: {exc}") from exc
        err, outputs = result[0], result[1:]
        code = int(err)
        record: dict[str, Any] = {"operation": name, "code": code, "seconds": round(time.monotonic() - started, 6),
                                  "success": code == 0}
        record["error_name"], record["error_string"] = self._error_text(err)
        if name == "cuCheckpointProcessGetState" and code == 0:
            state_code = int(outputs[0])
            record.update(state=STATE_NAMES.get(state_code, f"unknown-{state_code}"), state_code=state_code)
        self.records.append(record)
        if code != 0 and required:
            raise CudaError(name, record["error_name"], record["error_string"])
        if not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else outputs

    def last(self) -> dict[str, Any]:
        return self.records[-1]

    @property
    def cuda(self) -> Any:
        """The binding module (types and enums)."""
        return self._driver

    def context(self, ordinal: int = 0) -> int:
        """cuInit, the device's primary context made current (ordinal 0: a container sees only its GPU)."""
        self.call("cuInit", 0)
        device = self.call("cuDeviceGet", ordinal)
        ctx = self.call("cuDevicePrimaryCtxRetain", device)
        self.call("cuCtxSetCurrent", ctx)
        return int(device)

    def state(self, pid: int) -> str:
        state_code = int(self.call("cuCheckpointProcessGetState", pid))
        return STATE_NAMES.get(state_code, f"unknown-{state_code}")

    def copy_to_device(self, dptr: Any, data: bytes) -> None:
        buffer = ctypes.create_string_buffer(data, len(data))
        self.call("cuMemcpyHtoD_v2", dptr, ctypes.addressof(buffer), len(data))
        self.call("cuCtxSynchronize")

    def copy_from_device(self, dptr: Any, size: int) -> bytes:
        buffer = ctypes.create_string_buffer(size)
        self.call("cuMemcpyDtoH_v2", ctypes.addressof(buffer), dptr, size)
        self.call("cuCtxSynchronize")
        return buffer.raw[:size]

    def ipc_handle_bytes(self, handle: Any) -> bytes:
        return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)

    def ipc_handle_from_bytes(self, data: bytes) -> Any:
        if len(data) != IPC_HANDLE_BYTES:
            raise CanaryFailed(f"CUDA IPC handle must be {IPC_HANDLE_BYTES} bytes, got {len(data)}")
        handle = self._driver.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), data, IPC_HANDLE_BYTES)
        return handle

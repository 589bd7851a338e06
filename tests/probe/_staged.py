"""A stage-dump on a real node hydrator, adopted as the interposer adopts it: the staged allocation imported from
its descriptor, mapped, read back and given back. Every step that took something gives it back, also when a later
one fails (the descriptor, the imported handle, the reserved range)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any

from coldsnap_probe.jsonline import request, request_with_fds


def stage_and_read(driver: Any, control: str, key: str, parts: list[dict[str, Any]],
                   uuid: str, *, scribble: bool = False) -> tuple[dict[str, Any], bytes]:
    """Stage `parts` (one region) on the hydrator at `control` for the device `uuid`, adopt the allocation: the
    stage's answer and the bytes the allocation holds. `driver` has a context current on device 0 (None: one is
    made, for a caller outside tests/probe). `scribble`: then write over the allocation, as an engine does."""
    from coldsnap_probe.hydration._vmm import cucall, device_uuid, fd_handle, map_read_write

    if driver is None:
        from coldsnap_probe._cuda import Driver

        driver = Driver()
        driver.context(0)

    staged = request(control, {"op": "stage-dump", "key": key, "parts": parts, "device_uuid": uuid}, timeout=120.0)
    assert staged["ok"] and staged["bytes"] == sum(p["bytes"] for p in parts), staged
    size = staged["bytes"]
    answer, fds = request_with_fds(control, {"op": "adopt", "key": key, "ticket": staged["ticket"], "parts": parts},
                                   timeout=60.0)
    with contextlib.ExitStack() as undo:
        for fd in fds:
            undo.callback(os.close, fd)
        assert answer["ok"] and len(fds) == 1 and answer["count"] == 1 and answer["sizes"] == [size], answer
        assert device_uuid(driver, 0) == uuid
        handle = cucall(driver, "cuMemImportFromShareableHandle", fds[0], fd_handle(driver))
        undo.callback(cucall, driver, "cuMemRelease", handle)
        va = int(cucall(driver, "cuMemAddressReserve", size, 0, 0, 0))
        undo.callback(cucall, driver, "cuMemAddressFree", va, size)
        cucall(driver, "cuMemMap", va, size, 0, handle, 0)
        undo.callback(cucall, driver, "cuMemUnmap", va, size)
        map_read_write(driver, va, size, 0)
        buffer = ctypes.create_string_buffer(size)
        cucall(driver, "cuMemcpyDtoH", ctypes.addressof(buffer), va, size)
        if scribble:
            cucall(driver, "cuMemsetD8", va, 0xA5, size)
            cucall(driver, "cuCtxSynchronize")
    return staged, buffer.raw

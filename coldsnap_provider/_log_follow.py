"""`workload-logs` followed: one long-poll per answer, in the control socket's one-request-one-reply framing.

A follower asks with `follow`, the `offset` of the output it already has and a `wait_s` (a request
without `follow` is answered as before: the runtime's own `tail`, no offset); the answer comes as soon
as the workload's log is longer than `offset`, the workload is no longer running, or `wait_s` has
passed, and carries the new bytes, the new `offset` and `running`. Offsets count the bytes of the
whole log as the runtime answers it (stdout and stderr in the engine's order), so nothing is sent
twice and nothing is skipped while the engine keeps the log whole (a rotated json-file log restarts
the count: the follower then gets the log again from the start). Each look reads the whole log from the
runtime, bounded as every logs answer is (OUTPUT_LIMIT): following is for logs of that size.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from coldsnap_runtime import Backend

__all__ = ("POLL_S", "followed_logs")

POLL_S = 0.25  # how often a waiting answer looks at the log again


async def followed_logs(backend: Backend, name: str, *, tail: int, offset: int, wait_s: float) -> dict[str, Any]:
    """The log past `offset` (the last `tail` lines of it when `offset` is 0), waiting up to `wait_s` for some."""
    deadline = time.monotonic() + wait_s
    while True:
        log = await backend.workload_logs(name, tail=0)
        running = (await backend.workload_inspect(name, include_start_time=False)).running
        if len(log) < offset:
            offset = 0  # the engine restarted the log (rotation): send it again rather than nothing
        if len(log) > offset or not running or time.monotonic() >= deadline:
            break
        await anyio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    output = log[offset:]
    if offset == 0 and tail:
        output = b"".join(output.splitlines(keepends=True)[-tail:])
    return {"output": output, "offset": len(log), "running": running}

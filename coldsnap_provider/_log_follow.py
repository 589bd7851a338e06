"""`workload-logs` followed: one long-poll per answer, in the control socket's one-request-one-reply framing.

A follower asks with `follow`, the `offset` of the output it already has and a `wait_s` (a request
without `follow` is answered as before: the runtime's own `tail`, no offset); the answer comes as soon
as the workload's log is longer than `offset`, the workload is no longer running, or `wait_s` has
passed, and carries the new bytes, the new `offset` and `running`. Offsets count the bytes of the
whole log as the runtime answers it (stdout and stderr in the engine's order), so nothing is sent
twice and nothing is skipped while the engine keeps the log whole (a rotated json-file log restarts
the count: the follower then gets the log again from the start).

Each look asks whether the workload still runs before it reads the log, so a workload found stopped is
answered with its whole log (its last lines, a crash's traceback, are never lost). Each look reads the
whole log from the runtime, bounded as every logs answer is (OUTPUT_LIMIT): looks back off from POLL_S to
POLL_MAX_S while nothing new comes, and one uid follows at most FOLLOWERS_PER_UID logs at a time, so a
manager cannot keep the daemon reading logs in a loop. The workload is pinned by the ID its ownership was
checked on: another workload that takes the name (names are node-wide) ends the follow, it is never shown.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from coldsnap_runtime import Backend
from coldsnap_runtime.errors import RequestRejected

__all__ = ("FOLLOWERS_PER_UID", "POLL_MAX_S", "POLL_S", "Followers", "followed_logs")

POLL_S = 0.25  # the first look again after an empty one
POLL_MAX_S = 2.0  # looks back off to this while nothing new comes
FOLLOWERS_PER_UID = 4


class Followers:
    """How many logs each uid follows now: a fifth concurrent follow is refused, naming the limit."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}

    @asynccontextmanager
    async def hold(self, uid: int) -> AsyncIterator[None]:
        if self._held.get(uid, 0) >= FOLLOWERS_PER_UID:
            raise RequestRejected(f"workload-logs: follow: uid {uid} already follows {FOLLOWERS_PER_UID} logs "
                                  "(the limit per uid); end one first")
        self._held[uid] = self._held.get(uid, 0) + 1
        try:
            yield
        finally:
            self._held[uid] -= 1
            if not self._held[uid]:
                del self._held[uid]


async def followed_logs(backend: Backend, name: str, *, workload_id: str, tail: int, offset: int,
                        wait_s: float) -> dict[str, Any]:
    """The log past `offset` (the last `tail` lines of it when `offset` is 0), waiting up to `wait_s` for some;
    `workload_id`: the workload whose ownership was checked (another one under its name ends the follow)."""
    deadline = time.monotonic() + wait_s
    pause = POLL_S
    while True:
        info = await backend.workload_inspect(name, include_start_time=False)
        if info.id != workload_id:
            return {"output": b"", "offset": offset, "running": False}
        running = info.running
        log = await backend.workload_logs(name, tail=0)  # after the inspect: a stopped workload's log is whole
        if len(log) < offset:
            offset = 0  # the engine restarted the log (rotation): send it again rather than nothing
        if len(log) > offset or not running or time.monotonic() >= deadline:
            break
        await anyio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, POLL_MAX_S)
    output = log[offset:]
    if offset == 0 and tail:
        output = b"".join(output.splitlines(keepends=True)[-tail:])
    return {"output": output, "offset": len(log), "running": running}

"""The node hydrators' own stage counts: ``coldsnap_provider_hydrator_stage_{bytes,stages}_total{tier}``.

Only what a hydrator itself staged counts. A capsule's restore report carries the stage answers its worker got, but
a capsule writes whatever it likes there: counted from reports, one capsule could make the RAM tier look hot (or
cold) to the operator. So every ``metrics.backend_probe_interval_s`` the daemon asks each hydrator the operator named
(``metrics.hydrator_sockets``) for its ``status`` (a hydrator answers its RAM tier's counters only to root, its own
uid and its ``--status-uid`` uids: the daemon's account, when it is not root), and adds what each of its counters
grew by since the last answer: the stages it filled from each tier and the bytes it read for them (chunks of zeros
are set on the device, not read, and count nowhere). A counter that went down is a hydrator that restarted: its
whole count is new. A hydrator that does not answer (not started yet, restarting), or answers ``ok: false`` (its
error logged as it said it: a socket that refuses the daemon's uid, say), is logged once and asked again at each
interval; its counts so far stay.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated

import anyio
import msgspec
import structlog
from msgspec import Meta, Struct

from coldsnap_probe.errors import ChannelError
from coldsnap_probe.jsonline import request

__all__ = ("ASK_TIMEOUT_S", "STAGE_TIERS", "HydratorStages")

log = structlog.get_logger(__name__)

ASK_TIMEOUT_S = 5.0  # one hydrator's whole answer (its status is a few hundred bytes, answered on a thread of its own)
_ERROR_CHARS = 500  # of a refusal's error, in the log: a hydrator gone wrong may say a lot
# Where a node hydrator's stage read its bytes (coldsnap_probe/hydration/_ram_tier.py TIERS).
STAGE_TIERS = ("ram", "disk", "device")

_Count = Annotated[int, Meta(ge=0, le=1 << 62)]
_PerTier = Annotated[dict[Annotated[str, Meta(max_length=16)], _Count], Meta(max_length=8)]


class _Tier(Struct, frozen=True):
    """The part of the hydrator's `ram_tier` status the metrics use (the rest is ignored)."""

    stages: _PerTier
    read_bytes: _PerTier


class _Status(Struct, frozen=True):
    ok: bool
    error: str = ""  # why, with ok false
    ram_tier: _Tier | None = None  # absent: not asked as root or the hydrator's uid


class HydratorStages:
    """The stage counts of the hydrators at `sockets`, summed per tier since the daemon started."""

    def __init__(self, sockets: Sequence[str]) -> None:
        self._sockets = tuple(sockets)
        # Invariant: one entry per hydrator that answered, its counters as it last said them.
        self._last: dict[str, dict[str, tuple[int, int]]] = {}
        self._totals = {tier: (0, 0) for tier in STAGE_TIERS}  # tier -> (bytes, stages): only ever grows
        self._failing: dict[str, str] = {}  # hydrator -> why its last ask gave no counts (logged once)

    def totals(self) -> list[tuple[str, int, int]]:
        """(tier, bytes, stages) for each tier (at 0 from the start, so that rate() sees the first stage)."""
        return [(tier, read, stages) for tier, (read, stages) in self._totals.items()]

    async def run(self, *, interval_s: float) -> None:
        """Ask every hydrator every `interval_s` (the daemon's task group cancels it)."""
        while True:
            await self.poll()
            await anyio.sleep(interval_s)

    async def poll(self) -> None:
        """Ask each hydrator once (one at a time, each within ASK_TIMEOUT_S) and add what its counters grew by."""
        for path in self._sockets:
            try:
                answer = await anyio.to_thread.run_sync(_ask, path, abandon_on_cancel=True)  # ends within 5 s
            except (ChannelError, msgspec.ValidationError) as exc:
                self._failed(path, f"did not answer its status: {exc}")
                continue
            if not answer.ok:
                self._failed(path, f"refused its status: {answer.error[:_ERROR_CHARS] or '(no error given)'}")
                continue
            if answer.ram_tier is None:
                self._failed(path, f"keeps its RAM tier's counters from this daemon's uid {os.geteuid()} (serve "
                             "--status-uid)")
                continue
            if self._failing.pop(path, None) is not None:
                log.info("node hydrator answers its status again", socket=path)
            self._add(path, answer.ram_tier)

    def _failed(self, path: str, why: str) -> None:
        """Logged once when it begins (or changes), not at every interval of a hydrator that is down for hours."""
        if self._failing.get(path) != why:
            log.warning("node hydrator gives no stage counts", socket=path, error=why)
        self._failing[path] = why

    def _add(self, path: str, tier: _Tier) -> None:
        now = {name: (tier.read_bytes.get(name, 0), tier.stages.get(name, 0)) for name in STAGE_TIERS}
        before = self._last.get(path, {})
        for name, (read, stages) in now.items():
            old_read, old_stages = before.get(name, (0, 0))
            if read < old_read or stages < old_stages:  # the hydrator restarted: all of its count is new
                old_read, old_stages = 0, 0
            total_read, total_stages = self._totals[name]
            self._totals[name] = (total_read + read - old_read, total_stages + stages - old_stages)
        self._last[path] = now


def _ask(path: str) -> _Status:
    return msgspec.convert(request(path, {"op": "status"}, timeout=ASK_TIMEOUT_S), type=_Status)

"""What one tenant may hold in a node hydrator's stages: a cap per peer uid, on bytes and on count.

A stage is device memory the hydrator keeps for an engine until it adopts it (or the stage TTL ends), so
without a cap one uid could hold most of a GPU's free memory, and every stage slot, for that long, and the
other tenants' restores would then fill their regions themselves, slowly. `check_stage_quota` is the whole
rule, a pure function of the stage table and the request: a stage beyond the uid's cap is refused, naming the
uid, the cap and what the uid holds, and nothing of anyone's is freed to make room. Tenants are told apart by
the peer's uid (SO_PEERCRED), so restore workers that all run as root share root's cap: run them under
distinct uids, or size the cap for all of them.

The default depends on who may ask. A hydrator shared with other uids or gids (`--allow-uid`, `--allow-gid`)
caps each uid at STAGE_UID_COUNT stages and 1/STAGE_UID_SHARE of the GPU; one that only root and its own uid
may ask serves one tenant, whose single engine may need most of the GPU staged (an engine that keeps 90% of
it, KV cache included): there the cap is the hydrator's own limits (every slot, the whole GPU).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..errors import HydrationError

__all__ = ("STAGE_UID_COUNT", "STAGE_UID_SHARE", "Held", "StageQuota", "check_stage_quota")

STAGE_UID_COUNT = 2  # stages one uid may hold at once (of the hydrator's STAGE_MAX): two tenants always fit
STAGE_UID_SHARE = 2  # by default one uid may hold 1/STAGE_UID_SHARE of the GPU's memory in stages
Slot = TypeVar("Slot", bound=Hashable)  # how the stage table names a stage (the hydrator: its uid and key)


class Held(Protocol):
    """A stage as the rule sees it: who staged it and how many device bytes it holds."""

    @property
    def owner(self) -> int: ...

    @property
    def size(self) -> int: ...


@dataclass(frozen=True)
class StageQuota:
    """The cap of every peer uid: at most `count` stages and `bytes` device bytes held at once."""

    count: int
    bytes: int

    def __post_init__(self) -> None:
        if self.count < 1 or self.bytes < 1:
            raise HydrationError(f"a stage quota needs at least one stage and one byte, not {self.count} stages "
                                 f"and {self.bytes} bytes")

    @classmethod
    def default(cls, total_bytes: int, *, shared: bool, stages: int, count: int | None = None,
                size: int | None = None) -> StageQuota:
        """The quota on a GPU of `total_bytes` for a hydrator holding at most `stages`: `count` and `size` where
        given; otherwise, when `shared` with other uids, STAGE_UID_COUNT stages and 1/STAGE_UID_SHARE of the
        GPU, else every stage and the whole GPU."""
        return cls(count=count if count is not None else STAGE_UID_COUNT if shared else stages,
                   bytes=size if size is not None else total_bytes // STAGE_UID_SHARE if shared else total_bytes)


def check_stage_quota(staged: Mapping[Slot, Held], *, key: Slot, uid: int, size: int, quota: StageQuota) -> None:
    """Refuse (HydrationError) a stage of `size` bytes under `key` for `uid` that would take it beyond `quota`.

    The uid's own stage under `key`, if any, does not count: the request replaces it (a retry). The others'
    stages are never counted against it, nor touched."""
    mine = [held for k, held in staged.items() if held.owner == uid and k != key]
    holds = sum(held.size for held in mine)
    if len(mine) + 1 > quota.count:
        raise HydrationError(f"uid {uid} holds {len(mine)} stage(s) of {holds} bytes already: at most "
                             f"{quota.count} per uid (serve --stage-uid-count)")
    if holds + size > quota.bytes:
        raise HydrationError(f"uid {uid} holds {len(mine)} stage(s) of {holds} bytes: {size} more would exceed "
                             f"its cap of {quota.bytes} bytes (serve --stage-uid-bytes)")

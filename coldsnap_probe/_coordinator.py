"""Barriers among the ranks of one activation, through a directory every rank's worker can reach.

Each rank's worker runs in its own process (one per rank container, spec 7.1) and meets the others at named
phases. A rank arrives by writing ``<root>/<namespace>/<phase>/<rank>.json`` (written whole, then hard-linked
into place, so a second writer loses), and waits until every rank of the world has arrived. A rank that gives
up waiting claims the missing ranks' files first, so a late rank cannot pass a barrier its peer abandoned. Any
rank can abort the activation: the first ``<root>/<namespace>/abort.json`` wins, and every rank waiting at (or
later reaching) a barrier raises with its text, so a failure on one rank rolls back all. A directory is used
rather than a server so that there is nothing to start, nothing that can die on its own, and the evidence
stays on disk for the report.

A namespace is one activation (one capture or one restore): arriving twice at a phase of a namespace is refused,
so a reused namespace cannot let a rank pass a barrier on a previous activation's files.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import RankAborted, WorkerError

__all__ = ("Coordinator",)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _write_new(path: Path, value: dict[str, Any]) -> bool:
    """Write `path` whole if it does not exist yet; False when it already did."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # ranks' pids may be equal
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(value, sort_keys=True))
        os.link(tmp, path)  # atomic and exclusive: a reader never sees half a file, a second writer loses
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


class Coordinator:
    """One rank's view of an activation: `barrier(phase)`, `abort(reason)`, the waits it spent."""

    def __init__(self, root: Path | None, namespace: str, rank: int, world_size: int, *,
                 timeout: float = 120.0) -> None:
        if not _NAME.fullmatch(namespace):
            raise WorkerError(f"namespace must match {_NAME.pattern}, got {namespace!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise WorkerError(f"rank must be within [0, world_size), got rank {rank} of {world_size}")
        if not timeout > 0:
            raise WorkerError(f"barrier timeout must be positive, got {timeout}")
        if root is None and world_size > 1:
            raise WorkerError("several ranks need a coordinator directory they all reach")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.directory = root / namespace if root is not None else None
        if self.directory is not None:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.waits: dict[str, float] = {}

    @classmethod
    def single(cls) -> Coordinator:
        """A world of one rank: every barrier passes at once and there is no one to abort."""
        return cls(None, "single", 0, 1)

    @property
    def multi(self) -> bool:
        return self.world_size > 1

    def aborted(self) -> str | None:
        if self.directory is None:
            return None
        try:
            return str(json.loads((self.directory / "abort.json").read_text())["reason"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return "the abort record is unreadable"

    def abort(self, reason: str) -> None:
        """Abort the activation for every rank (the first reason is kept)."""
        if self.directory is None:
            return
        try:  # called on failure paths: it must never raise in place of the failure it reports
            _write_new(self.directory / "abort.json", {"rank": self.rank, "reason": reason,
                                                       "unix_ns": time.time_ns()})
        except OSError:
            pass

    def barrier(self, phase: str, value: dict[str, Any] | None = None, *,
                timeout: float | None = None) -> list[dict[str, Any]]:
        """Arrive at `phase` with `value`; return every rank's value (by rank) once all have arrived."""
        if not _NAME.fullmatch(phase):
            raise WorkerError(f"phase must match {_NAME.pattern}, got {phase!r}")
        if self.directory is None:
            return [value or {}]
        where = self.directory / phase
        where.mkdir(mode=0o700, exist_ok=True)
        if not _write_new(where / f"{self.rank}.json", {"rank": self.rank, "value": value or {},
                                                        "unix_ns": time.time_ns()}):
            claimed = self._slot(where, self.rank)
            if "aborted" in claimed:  # a peer gave up on this rank before it arrived
                raise RankAborted(f"activation aborted at {phase}: {claimed['aborted']}")
            raise WorkerError(f"rank {self.rank} already arrived at {phase} in {self.directory.name}: "
                              "a namespace serves one activation")
        started = time.monotonic()
        deadline = started + (timeout if timeout is not None else self.timeout)
        pause = 0.0005
        while True:
            missing = [r for r in range(self.world_size) if not (where / f"{r}.json").exists()]
            if not missing:
                break
            if (reason := self.aborted()) is not None:
                raise RankAborted(f"activation aborted at {phase}: {reason}")
            if time.monotonic() > deadline:
                reason = (f"rank {self.rank}: rank(s) {', '.join(map(str, missing))} never reached {phase} "
                          f"within {deadline - started:g} s")
                # Claim the missing ranks' slots, so that a rank arriving now cannot pass this barrier while
                # this one gives up: whichever writes a slot first decides.
                if any([_write_new(where / f"{r}.json", {"rank": r, "aborted": reason}) for r in missing]):
                    self.abort(reason)
                    raise RankAborted(reason)
                continue  # every missing rank arrived in the meantime
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        slots = [self._slot(where, r) for r in range(self.world_size)]
        if gave_up := [s["aborted"] for s in slots if "aborted" in s]:
            raise RankAborted(f"activation aborted at {phase}: {gave_up[0]}")
        self.waits[phase] = time.monotonic() - started
        return [dict(s.get("value") or {}) for s in slots]

    def _slot(self, where: Path, rank: int) -> dict[str, Any]:
        try:
            value = json.loads((where / f"{rank}.json").read_text())
        except (OSError, ValueError) as exc:
            raise WorkerError(f"rank {rank}'s arrival at {where.name} is unreadable: {exc}") from exc
        if not isinstance(value, dict):
            raise WorkerError(f"rank {rank}'s arrival at {where.name} is not an object")
        return value

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

Only ranks write there: every rank runs as the same uid, so the namespace, its phase directories and every
arrival or abort record must be owned by that uid and writable by no one else, and each is reached through
the namespace's directory descriptor without following a link (O_NOFOLLOW). A namespace another user made
in the root (with forged arrivals or an abort planted in it) is refused, never used (#24 finding 7).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

from .errors import RankAborted, WorkerError

__all__ = ("Coordinator",)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _trusted(fd: int, what: str) -> None:
    """Only this worker's uid (every rank's) may have made or be able to change `fd`: a file or directory
    another user planted, or one others may write, is refused (#24 finding 7)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise WorkerError(f"{what} is owned by uid {st.st_uid}, not this worker's uid {os.geteuid()}: "
                          "it was not made by a rank")
    if st.st_mode & 0o022:
        raise WorkerError(f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): not trusting it")


def _open_dir(parent: int | None, name: str, what: str) -> int:
    """`name` in `parent`, created 0700 or found; opened without following a link, then owner-checked."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        pass  # another rank of the activation made it: checked below like our own
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:  # ELOOP: a symbolic link planted in its place
        raise WorkerError(f"{what} cannot be opened as a directory: {exc.strerror}") from exc
    try:
        _trusted(fd, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_new(directory: int, name: str, value: dict[str, Any]) -> bool:
    """Write `name` in `directory` whole if it does not exist yet; False when it already did."""
    tmp = f".{name}.{os.urandom(8).hex()}"  # ranks' pids may be equal
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(value, sort_keys=True))
        # atomic and exclusive: a reader never sees half a file, a second writer loses
        os.link(tmp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp, dir_fd=directory)
    return True


def _exists(directory: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _read(directory: int, name: str, what: str) -> Any:
    """The JSON in `name`, a regular file a rank wrote (no link followed, owner checked)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=directory)
    with os.fdopen(fd, "rb") as f:
        _trusted(fd, what)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WorkerError(f"{what} is not a regular file")
        return json.loads(f.read(1 << 20))


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
        self.rank, self.world_size, self.timeout, self.namespace = rank, world_size, timeout, namespace
        self.directory = root / namespace if root is not None else None
        # Invariant: every file and directory below is reached through this descriptor, never by a path.
        self._fd: int | None = None
        if root is not None:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)  # the operator's directory: its path is trusted
            parent = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._fd = _open_dir(parent, namespace, f"coordinator namespace {root / namespace}")
            finally:
                os.close(parent)
        self.waits: dict[str, float] = {}

    def close(self) -> None:
        """Release the namespace's descriptor (the files stay, as the activation's evidence)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def single(cls) -> Coordinator:
        """A world of one rank: every barrier passes at once and there is no one to abort."""
        return cls(None, "single", 0, 1)

    @property
    def multi(self) -> bool:
        return self.world_size > 1

    def aborted(self) -> str | None:
        if self._fd is None:
            return None
        try:
            return str(_read(self._fd, "abort.json", "the abort record")["reason"])
        except FileNotFoundError:
            return None
        except WorkerError as exc:
            return str(exc)
        except (OSError, ValueError, KeyError, TypeError):
            return "the abort record is unreadable"

    def abort(self, reason: str) -> None:
        """Abort the activation for every rank (the first reason is kept)."""
        if self._fd is None:
            return
        try:  # called on failure paths: it must never raise in place of the failure it reports
            _write_new(self._fd, "abort.json", {"rank": self.rank, "reason": reason,
                                                       "unix_ns": time.time_ns()})
        except OSError:
            pass

    def barrier(self, phase: str, value: dict[str, Any] | None = None, *,
                timeout: float | None = None) -> list[dict[str, Any]]:
        """Arrive at `phase` with `value`; return every rank's value (by rank) once all have arrived."""
        if not _NAME.fullmatch(phase):
            raise WorkerError(f"phase must match {_NAME.pattern}, got {phase!r}")
        if self._fd is None:
            return [value or {}]
        where = _open_dir(self._fd, phase, f"the {phase} barrier of {self.directory}")
        try:
            self._arrive(where, phase, value or {})
            started = time.monotonic()
            self._wait(where, phase, started, started + (timeout if timeout is not None else self.timeout))
            slots = [self._slot(where, phase, r) for r in range(self.world_size)]
        finally:
            os.close(where)
        if gave_up := [s["aborted"] for s in slots if "aborted" in s]:
            raise RankAborted(f"activation aborted at {phase}: {gave_up[0]}")
        self.waits[phase] = time.monotonic() - started
        return [dict(s.get("value") or {}) for s in slots]

    def _arrive(self, where: int, phase: str, value: dict[str, Any]) -> None:
        if _write_new(where, f"{self.rank}.json", {"rank": self.rank, "value": value, "unix_ns": time.time_ns()}):
            return
        claimed = self._slot(where, phase, self.rank)
        if "aborted" in claimed:  # a peer gave up on this rank before it arrived
            raise RankAborted(f"activation aborted at {phase}: {claimed['aborted']}")
        raise WorkerError(f"rank {self.rank} already arrived at {phase} in {self.namespace}: "
                          "a namespace serves one activation")

    def _wait(self, where: int, phase: str, started: float, deadline: float) -> None:
        """Until every rank's slot exists; on the deadline, claim the missing ones and abort."""
        pause = 0.0005
        while missing := [r for r in range(self.world_size) if not _exists(where, f"{r}.json")]:
            if (reason := self.aborted()) is not None:
                raise RankAborted(f"activation aborted at {phase}: {reason}")
            if time.monotonic() > deadline:
                reason = (f"rank {self.rank}: rank(s) {', '.join(map(str, missing))} never reached {phase} "
                          f"within {deadline - started:g} s")
                # Claim the missing ranks' slots, so that a rank arriving now cannot pass this barrier while
                # this one gives up: whichever writes a slot first decides.
                if any([_write_new(where, f"{r}.json", {"rank": r, "aborted": reason}) for r in missing]):
                    self.abort(reason)
                    raise RankAborted(reason)
                continue  # every missing rank arrived in the meantime
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _slot(self, where: int, phase: str, rank: int) -> dict[str, Any]:
        what = f"rank {rank}'s arrival at {phase}"
        try:
            value = _read(where, f"{rank}.json", what)
        except (OSError, ValueError) as exc:
            raise WorkerError(f"{what} is unreadable: {exc}") from exc
        if not isinstance(value, dict):
            raise WorkerError(f"{what} is not an object")
        return value

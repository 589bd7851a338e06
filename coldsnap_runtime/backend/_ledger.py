"""The image ledger: the references this provider pulled, built or tagged, and whose they are.

`image-remove` removes only recorded references; `image-push`, `image-remove` and the targets of
`image-pull`, `image-tag` and `image-build` are limited to the manager that recorded them
(``dispatch``; issue 24, finding 4). An owner is the manager uid whose session first recorded the
reference; references recorded before owners were (ledger format 1) have none, so only root and
the daemon's uid reach them. The file is replaced atomically on every change
(:func:`~coldsnap_runtime.files.write_atomically`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec
import structlog

from ..errors import RuntimeFailed
from ..files import write_atomically
from ._translate import parse_reference

__all__ = ("ImageLedger", "LedgerEntry", "ledger_key")

log = structlog.get_logger(__name__)


class LedgerEntry(msgspec.Struct, frozen=True):
    """One recorded reference; `owner` None: recorded before owners were (root and the daemon only)."""

    owner: int | None


class _File(msgspec.Struct, forbid_unknown_fields=True):
    """The ledger file; format 1 had only `references` (no owners)."""

    format: int = 2
    references: list[str] = []  # recorded without an owner
    owners: dict[str, int] = {}


_DECODER = msgspec.json.Decoder(_File)
_ENCODER = msgspec.json.Encoder()


def ledger_key(image: str) -> str:
    """The ledger's spelling of a reference (Docker's normal form; an image id as itself)."""
    ref = parse_reference(image)
    return image if ref is None else ref.normalized()


class ImageLedger:
    """The ledger of one engine, kept in memory and written through on every change (None path: no ledger)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, LedgerEntry] = {}
        self._lock = anyio.Lock()
        # reference -> pulls and builds into it in flight: it may name an image not yet checked (a capture label the
        # pull's registry has not yet shown to come with it, a build's forged or unreached one), so it confers no
        # reach until they end (`owned_by`).
        self._writing: collections.Counter[str] = collections.Counter()

    async def load(self) -> None:
        if self.path is not None:
            self._entries = await anyio.to_thread.run_sync(_read, self.path)

    def entry(self, image: str) -> LedgerEntry | None:
        """The record of `image`, or None when this provider never recorded it."""
        return self._entries.get(ledger_key(image))

    def owned_by(self, uid: int) -> list[str]:
        """The references manager `uid` recorded and no pull or build is writing (the captures it reaches)."""
        return sorted(ref for ref, entry in self._entries.items() if entry.owner == uid and not self._writing[ref])

    @contextlib.contextmanager
    def writing(self, image: str) -> Iterator[None]:
        """While a pull or build writes `image`: its reference counts for no manager's reach (`owned_by`)."""
        key = ledger_key(image)
        self._writing[key] += 1
        try:
            yield
        finally:
            self._writing[key] -= 1
            if not self._writing[key]:
                del self._writing[key]

    def not_owned_by(self, uid: int) -> list[str]:
        """The references anyone but manager `uid` recorded (a capture they carry is not that manager's to remove)."""
        return sorted(ref for ref, entry in self._entries.items() if entry.owner != uid)

    async def update(self, action: str, *, add: str = "", drop: str = "", owner: int | None = None) -> None:
        """Record `add` (owned by `owner` when it is new or has no owner yet) and forget `drop`."""
        if self.path is None:
            return
        async with self._lock:
            updated = dict(self._entries)
            if add:
                key = ledger_key(add)
                if key not in updated or (updated[key].owner is None and owner is not None):
                    updated[key] = LedgerEntry(owner=owner)
            if drop:
                updated.pop(ledger_key(drop), None)
            if updated == self._entries:
                return
            try:
                await anyio.to_thread.run_sync(_write, self.path, updated)
            except OSError as exc:
                raise RuntimeFailed(action=action, detail=f"cannot record the image ledger: {exc}") from exc
            self._entries = updated


def _read(path: Path) -> dict[str, LedgerEntry]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.error("image ledger unreadable; image-remove refuses until it is fixed", error=str(exc))
        return {}
    try:
        file = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        log.error("image ledger damaged; image-remove refuses until it is fixed", error=str(exc))
        return {}
    entries = {ref: LedgerEntry(owner=None) for ref in file.references}
    entries.update({ref: LedgerEntry(owner=uid) for ref, uid in file.owners.items()})
    return entries


def _write(path: Path, entries: dict[str, LedgerEntry]) -> None:
    owners = {ref: e.owner for ref, e in sorted(entries.items()) if e.owner is not None}
    legacy = sorted(ref for ref, e in entries.items() if e.owner is None)
    write_atomically(path, _ENCODER.encode(_File(references=legacy, owners=owners)) + b"\n")

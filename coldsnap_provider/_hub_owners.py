"""Who owns each Hugging Face repository this provider published to (issue 37, finding 2).

The daemon publishes with one token, the node's (``[huggingface] token_file``), so the Hub cannot
tell one manager from another: this ledger does. A repository belongs to the manager whose session
**first** published to it (root's first publish makes it root's); the admission policy then refuses
any other manager's publish there (rule ``huggingface-owner``; root and the daemon's uid reach every
repository), as the image ledger does for image references.

A publish reserves the repository when it is admitted, with no await between the check and the
reservation, so two managers' concurrent first publishes cannot both pass; the reservation is on
disk before a byte is uploaded and is given back if every publish that relied on it failed (a
manager does not keep a repository it never published to). Repository ids are compared as the
Hub compares them, without regard to case. The file (``<state>/huggingface-owners.json``, 0600) is
replaced atomically on every change and read once at start-up, so ownership survives restarts.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import anyio.to_thread
import msgspec
import structlog

from coldsnap_runtime.errors import RuntimeFailed
from coldsnap_runtime.files import write_atomically

from ._errors import ConfigError

__all__ = ("HubOwners",)

log = structlog.get_logger(__name__)


class _File(msgspec.Struct, forbid_unknown_fields=True):
    format: int = 1
    owners: dict[str, int] = {}  # lower-cased repository id -> manager uid


_DECODER = msgspec.json.Decoder(_File)
_ENCODER = msgspec.json.Encoder()


def _key(repository: str) -> str:
    return repository.lower()  # the Hub resolves repository ids without regard to case


class HubOwners:
    """The ledger, in memory and written through to `path`; one per daemon."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._owners: dict[str, int] = _read(path)
        # Invariant: a key here is in _owners too, reserved by that many publishes in flight and on no
        # successful publish yet; it is dropped from both when the last of them failed.
        self._pending: dict[str, int] = {}
        self._dirty = False  # _owners differs from the file
        self._lock = anyio.Lock()

    def owner(self, repository: str) -> int | None:
        """The manager uid that owns `repository` (or reserved it), None if no session published there."""
        return self._owners.get(_key(repository))

    def reserve(self, repository: str, uid: int) -> None:
        """Take `repository` for `uid` unless it has an owner (call right after admission, with no await between)."""
        key = _key(repository)
        if key not in self._owners:
            self._owners[key] = uid
            self._pending[key] = 0
            self._dirty = True
        if key in self._pending:
            self._pending[key] += 1

    async def persist(self, action: str) -> None:
        """Put the ledger, reservations included, on disk (before a publish uploads anything); a no-op
        when nothing changed since the last write."""
        async with self._lock:
            if self._dirty:
                self._dirty = False
                try:
                    await self._write(action)
                except BaseException:
                    self._dirty = True
                    raise

    async def settle(self, repository: str, *, published: bool, action: str) -> None:
        """After a publish: a reservation it succeeded on is the owner's for good; one that only failed
        publishes relied on is given back (a stale one left on disk only refuses more, so a failed write
        is logged, not raised over the publish's own outcome)."""
        key = _key(repository)
        if key not in self._pending:
            return  # owned before this publish, or confirmed by another
        self._pending[key] -= 1
        if published:
            del self._pending[key]
            return
        if self._pending[key] == 0:
            del self._pending[key], self._owners[key]
            self._dirty = True
            try:
                await self.persist(action)
            except RuntimeFailed as exc:
                log.error("Hugging Face reservation not given back on disk", error=str(exc))

    async def _write(self, action: str) -> None:
        data = _ENCODER.encode(_File(owners=dict(sorted(self._owners.items())))) + b"\n"
        try:
            await anyio.to_thread.run_sync(write_atomically, self.path, data)
        except OSError as exc:
            raise RuntimeFailed(action=action, detail=f"cannot record the Hugging Face owners: {exc}") from exc


def _read(path: Path) -> dict[str, int]:
    """The ledger on disk; a damaged one stops the daemon (an empty ledger would hand every repository out)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the Hugging Face owners: {exc.strerror}") from exc
    try:
        return dict(_DECODER.decode(data).owners)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: the Hugging Face owners are damaged ({exc}); fix or remove the file") from exc

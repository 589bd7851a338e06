"""Which blobs a registry's repository holds, as this node's pushes and pulls last saw them (issue 34): a push skips
the HEAD of a blob it remembers there. Page images are cut into ~190 KiB chunks, so a capture is thousands of blobs,
and a second capture of the same model shares ~96 % of them: without this, its push still costs a round trip each.

What a skipped HEAD may cost, and why it stays correct:

* The registry may have lost a remembered blob since (collected, wiped, replaced at the same address). The manifest
  PUT then fails naming it (``MANIFEST_BLOB_UNKNOWN``: the registry checks every blob a manifest names, before it
  takes the manifest); the push forgets everything it remembered of the repository and asks again for each blob it
  skipped, once (``_capture_registry.py``). A registry that took a manifest naming blobs it lacks (the OCI spec lets
  it) is not caught here: its captures' pulls fail naming the blob.
* Who may skip: a blob is remembered per (manager, registry, repository, credentials). A HEAD is a read of that
  repository with those credentials; another manager, another repository (a cross-repository blob is not implied:
  nothing was mounted there) or credentials the admin rotated since ask again. A skipped HEAD never grants a push:
  the manifest PUT still needs push rights on the repository, checked by the registry at every push.

Bounded, and not persisted: at most `KEPT` digests (about 150 bytes each: ~20 MB), the repositories least recently
used forgotten first. A restart forgets all of it, and the first push after it asks for every blob, as before; a file
would be one more record of a registry's contents to go stale, in a format of its own, for one pass of HEADs saved.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Mapping

__all__ = ("BlobMemory", "KnownBlobs")

_HEX = frozenset("0123456789abcdef")


def _key(digest: str) -> bytes | None:
    """The 32 bytes of a ``sha256:<hex>`` digest (half the memory of the text); None for any other form (not
    remembered: asked every time)."""
    algorithm, _, hexa = digest.partition(":")
    if algorithm != "sha256" or len(hexa) != 64 or not _HEX.issuperset(hexa):
        return None
    return bytes.fromhex(hexa)


class BlobMemory:
    """The node's memory of which blobs each (manager, registry, repository, credentials) holds; one per capture
    store, on the event loop only (no lock)."""

    KEPT = 1 << 17  # digests at most: a 24 GiB page image's ~190 KiB chunks, or 8 TiB of 64 MiB ones

    def __init__(self) -> None:
        # Invariant: `_count` is the number of digests over every scope; a scope is never empty; both orders are
        # least recently used first.
        self._scopes: collections.OrderedDict[tuple[object, ...], collections.OrderedDict[bytes, None]] = \
            collections.OrderedDict()
        self._count = 0

    def scope(self, *, manager: int | None, registry: str, repository: str,
              auth: Mapping[str, str] | None) -> KnownBlobs:
        """What `manager` may skip in `repository` of `registry` with `auth` (its digest kept, never the secret)."""
        credentials = hashlib.sha256(json.dumps(dict(auth or {}), sort_keys=True).encode()).digest()
        return KnownBlobs(self, (manager, registry, repository, credentials))

    def _has(self, scope: tuple[object, ...], digest: str) -> bool:
        kept = self._scopes.get(scope)
        return kept is not None and (key := _key(digest)) is not None and key in kept

    def _add(self, scope: tuple[object, ...], digest: str) -> None:
        if (key := _key(digest)) is None:
            return
        kept = self._scopes.setdefault(scope, collections.OrderedDict())
        self._scopes.move_to_end(scope)
        if key not in kept:
            self._count += 1
        kept[key] = None
        kept.move_to_end(key)
        while self._count > self.KEPT:
            oldest_scope, oldest = next(iter(self._scopes.items()))
            oldest.popitem(last=False)
            self._count -= 1
            if not oldest:
                del self._scopes[oldest_scope]

    def _forget(self, scope: tuple[object, ...]) -> None:
        self._count -= len(self._scopes.pop(scope, ()))


class KnownBlobs:
    """One scope of a :class:`BlobMemory`: the blobs one manager's pushes and pulls saw in one repository."""

    def __init__(self, memory: BlobMemory, scope: tuple[object, ...]) -> None:
        self._memory, self._scope = memory, scope

    def has(self, digest: str) -> bool:
        """Seen in the repository: a push may skip its HEAD."""
        return self._memory._has(self._scope, digest)

    def add(self, digest: str) -> None:
        """The registry answered that it holds the blob (a HEAD's 200, an upload's 201, a fetch's bytes)."""
        self._memory._add(self._scope, digest)

    def forget(self) -> None:
        """The registry lost some blob this scope remembered: nothing of the repository is trusted any more."""
        self._memory._forget(self._scope)

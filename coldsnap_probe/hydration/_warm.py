"""A node hydrator's `warm`: a capture's device dump offered to the RAM tier as soon as the dump is done, so that
the first restore's stage is a hit (issue 34), not only the restores after it.

The capture worker asks (`memory/_device_dump.py`, `DeviceWarm`) with the parts a restore's `stage-dump` will name
(the same `parts`, `key` and `device_uuid`), and the request gets a stage's checks: staging on and the engine's GPU
this hydrator's (`HydratorServer._stage_slot`), the parts checked (`dump_layout`), each file opened in the peer's
own view with its credentials, never a link, never a FIFO (`open_dump_parts`): a peer gets held only files it
could read itself. Then the dump is queued for the tier's loader (`RamTier.load_later`) and the answer comes at
once: the loader pins it in the background at the lowest CPU priority, within the tier's budget and counted to the
asker's uid (its fair share, as a miss's load), evicting as for a miss's load; nothing is staged on the GPU.

A restore that comes while the load runs never waits for it: its stage joins the load (`RamTier.lease`), copying
what is pinned so far from the pinned mappings and reading only the rest from the files, both at once
(`_stage_copy.at_once`), and the load pins no further piece while the stage (or any restore's copy) runs, so the
driver's registrations and the loader's page walks never sit in front of the stage's allocations and reads; the
load goes on after it, for the restores that follow. A warm is cancelled as any held dump is let go: its files
removed (a capture rolled back or collected: `prune`), or the tier's LRU.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from .. import jsonline
from ._peer_files import dump_layout, dump_reads, open_dump_parts
from ._peer_view import PeerView
from ._ram_tier import RamTier

__all__ = ("Warms",)


class Warms:
    """The warm requests of one hydrator into its RAM tier `tier`, opening files with `openers` (its bound on
    threads opening in peers' views); counted for the operator's `status` (`queued`: handed to the loader;
    `not_queued`: the tier off, the dump held or queued already, or the load queue full)."""

    def __init__(self, tier: RamTier, openers: threading.BoundedSemaphore) -> None:
        self.tier, self._openers = tier, openers
        self._lock = threading.Lock()
        self.counts = {"queued": 0, "not_queued": 0}

    def warm(self, key: str, message: dict[str, Any], peer: jsonline.Peer, conn: socket.socket) -> dict[str, Any]:
        """Queue the dump of `key` whose `parts` the message names (checked) for the tier; whether it was."""
        layout, _sizes = dump_layout(message.get("parts"))
        with PeerView.of(conn, peer, openers=self._openers) as view:
            _parts, fds = open_dump_parts(layout, view)
        try:
            queued = self.tier.load_later(key, fds, dump_reads(layout), owner=peer.uid)  # the asker's share
        finally:
            for fd in fds.values():
                os.close(fd)
        with self._lock:
            self.counts["queued" if queued else "not_queued"] += 1
        return {"ok": True, "queued": queued}

    def status(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

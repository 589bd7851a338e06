"""The image ledger's owners (``backend/_ledger.py``): which references reach a manager's captures."""

from __future__ import annotations

from pathlib import Path

from coldsnap_runtime.backend._ledger import ImageLedger, ledger_key


async def test_a_reference_being_pulled_or_built_reaches_nothing_until_the_write_ends(tmp_path: Path) -> None:
    """A pull or build re-points a manager's own reference before its image is checked (a capture label its registry
    has not shown, a forged or unreached one): meanwhile the reference confers no reach (review of issue 34)."""
    ledger = ImageLedger(tmp_path / "images.json")
    mine, other = "localhost/capsule:1", "localhost/other:1"
    await ledger.update("image-pull", add=mine, owner=7)
    await ledger.update("image-pull", add=other, owner=7)
    with ledger.writing(mine):
        with ledger.writing("localhost/capsule:1"):  # two writes of it at once: until both end
            assert ledger.owned_by(7) == [ledger_key(other)]
        assert ledger.owned_by(7) == [ledger_key(other)]
    assert ledger.owned_by(7) == sorted([ledger_key(mine), ledger_key(other)])

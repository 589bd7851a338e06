"""A stage's copy (`_stage_copy`): a weights stage writes every byte of its allocation, the gaps between the held
sources' pieces set on the device, so no byte of an earlier allocation of the hydrator's (another tenant's dump)
reaches its engine or the device tier's copy of it."""

from __future__ import annotations

import itertools

from coldsnap_probe.hydration._copy import ZEROS, Piece
from coldsnap_probe.hydration._stage_copy import weights_pieces

MIB = 1 << 20


def test_a_weights_stage_sets_every_byte_its_pieces_leave_to_zero() -> None:
    pieces = [Piece(6 * MIB, "/w/b", 0, 2 * MIB), Piece(2 * MIB, "/w/a", 4 * MIB, 2 * MIB)]
    assert weights_pieces(12 * MIB, pieces) == [
        Piece(0, ZEROS, 0, 2 * MIB), Piece(2 * MIB, "/w/a", 4 * MIB, 2 * MIB), Piece(4 * MIB, ZEROS, 0, 2 * MIB),
        Piece(6 * MIB, "/w/b", 0, 2 * MIB),
        Piece(8 * MIB, ZEROS, 0, 4 * MIB)]
    written = sorted((p.dst, p.dst + p.size) for p in weights_pieces(12 * MIB, pieces))
    assert written[0][0] == 0 and written[-1][1] == 12 * MIB
    assert all(a[1] == b[0] for a, b in itertools.pairwise(written))  # no byte left out, none written twice


def test_a_stage_of_discarded_regions_only_is_all_zeros_and_a_full_one_adds_none() -> None:
    assert weights_pieces(4 * MIB, []) == [Piece(0, ZEROS, 0, 4 * MIB)]
    whole = [Piece(0, "/w/a", 0, 4 * MIB)]
    assert weights_pieces(4 * MIB, whole) == whole

"""The ctypes mirrors and ABI constants (`_abi.py`) held against the layout compiled into the shim."""

from __future__ import annotations

import ctypes

from nccl_shim._abi import EVIDENCE_MAX, TABLES, InPlaceV1, ProviderV1, ResourcesV1
from nccl_shim._lib import Shim


def test_layout_compiled_into_the_shim_matches_the_python_mirrors() -> None:
    shim = Shim(None)
    for table, mirror, size in ((0, ProviderV1, 96), (1, InPlaceV1, 56), (2, ResourcesV1, 32)):
        compiled_size, offsets = shim.layout(table)
        assert compiled_size == ctypes.sizeof(mirror) == size
        assert offsets == [getattr(mirror, name).offset for name, _ in mirror._fields_]


def test_tables_are_indexed_by_the_shims_table_selectors() -> None:
    assert (ProviderV1, InPlaceV1, ResourcesV1) == TABLES  # CSNS_TABLE_PROVIDER, _IN_PLACE, _RESOURCES
    assert EVIDENCE_MAX == 65536  # CSNS_EVIDENCE_MAX

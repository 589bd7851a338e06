"""Admission of what the shim found (`_admission.py`): capabilities by name."""

from __future__ import annotations

import pytest

from nccl_shim import ProviderNotAdmitted, capability_names, missing_capabilities


def test_capabilities_by_name() -> None:
    assert capability_names(0x1FF)[:2] == ["communicator-unwrap", "coordinator-protocol-v1"]
    assert missing_capabilities(0x1FF, ["cuda-graph", "full-network-reset", "graph-resource-retention"]) == [
        "cuda-graph", "graph-resource-retention"]
    with pytest.raises(ProviderNotAdmitted, match="unknown required NCCL provider capabilities: nope"):
        missing_capabilities(0x1FF, ["nope"])

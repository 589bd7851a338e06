"""Admission of what the shim found (`_admission.py`): capabilities, evidence (4b), inventories (4c)."""

from __future__ import annotations

import json

import pytest

from nccl_shim import ProviderNotAdmitted, admit_evidence, admit_resources, capability_names, missing_capabilities


def test_capabilities_by_name() -> None:
    assert capability_names(0x1FF)[:2] == ["communicator-unwrap", "coordinator-protocol-v1"]
    assert missing_capabilities(0x1FF, ["cuda-graph", "full-network-reset", "graph-resource-retention"]) == [
        "cuda-graph", "graph-resource-retention"]
    with pytest.raises(ProviderNotAdmitted, match="unknown required NCCL provider capabilities: nope"):
        missing_capabilities(0x1FF, ["nope"])


def test_evidence_that_is_not_json_is_refused_with_the_decoder_error_chained() -> None:
    with pytest.raises(ProviderNotAdmitted, match="in-place evidence is not UTF-8 JSON") as info:
        admit_evidence(b"\xff{", "active")
    assert info.value.rule == "4b" and isinstance(info.value.__cause__, ValueError)


def test_evidence_over_the_limit_is_refused_before_decoding() -> None:
    with pytest.raises(ProviderNotAdmitted, match="exceeds 65536 bytes"):
        admit_evidence(b" " * 65537, "active")


def test_an_incomplete_inventory_names_its_blockers() -> None:
    inventory = {"format": 1, "kind": "coldsnap-nccl-resource-inventory", "mode": "recreate", "complete": False,
                 "admitted": False, "communicators": [{"blockers": ["nvls"]}, {"blockers": ["device-api"]}]}
    with pytest.raises(ProviderNotAdmitted, match="blockers: device-api, nvls") as info:
        admit_resources(0, json.dumps(inventory).encode(), "recreate")
    assert info.value.rule == "4c"

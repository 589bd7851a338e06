"""The n580 and n610 base contracts (`_contracts.py`, spec 3)."""

from __future__ import annotations

import pytest

from coldsnap_probe import CONTRACTS, contract, requirements
from coldsnap_probe.errors import ProfileError, UnknownDriver


def test_contracts_are_exact() -> None:
    assert CONTRACTS["n580"].capture_boundary == "pre-cuda-process-template"
    assert requirements("n580").features == ("criu-process-template", "cuda-fresh-state", "cuda-vmm-exact-address")
    assert requirements("n610").features == (
        "criu-process-tree", "cuda-checkpoint-api", "cuda-checkpoint-roundtrip", "cuda-classic-ipc",
        "cuda-initialized-state", "cuda-vmm-exact-address")
    assert CONTRACTS["n610"].minimum_nvidia_driver_major == 610


def test_contract_json_is_the_spec_shape() -> None:
    assert contract("n580").to_json() == {
        "id": "n580", "abi": 1, "capture_boundary": "pre-cuda-process-template", "minimum_nvidia_driver_major": 580,
        "base_requirements": {"format": 1, "features": [
            {"id": "criu-process-template"}, {"id": "cuda-fresh-state"}, {"id": "cuda-vmm-exact-address"}]}}


@pytest.mark.parametrize("driver", ["auto", "", "N610"])
def test_unknown_driver_is_refused_by_name(driver: str) -> None:
    with pytest.raises(UnknownDriver, match="n580 or n610") as info:
        requirements(driver)
    assert info.value.driver == driver
    assert isinstance(info.value, ProfileError) and isinstance(info.value, ValueError)  # the daemon's usage error


def test_the_contract_table_cannot_be_changed() -> None:
    with pytest.raises(TypeError):
        CONTRACTS["n999"] = CONTRACTS["n580"]  # type: ignore[index]

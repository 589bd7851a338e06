"""The n580 and n610 snapshot-driver base contracts (spec 3)."""

from __future__ import annotations

from types import MappingProxyType

from ._model import Contract, Requirements
from .errors import UnknownDriver

__all__ = ("CONTRACTS", "contract", "requirements")

CONTRACTS: MappingProxyType[str, Contract] = MappingProxyType({
    "n580": Contract(
        id="n580", abi=1, capture_boundary="pre-cuda-process-template", minimum_nvidia_driver_major=580,
        base_requirements=Requirements(("criu-process-template", "cuda-fresh-state", "cuda-vmm-exact-address"))),
    "n610": Contract(
        id="n610", abi=1, capture_boundary="initialized-cuda-process-state", minimum_nvidia_driver_major=610,
        base_requirements=Requirements((
            "criu-process-tree", "cuda-checkpoint-api", "cuda-checkpoint-roundtrip", "cuda-classic-ipc",
            "cuda-initialized-state", "cuda-vmm-exact-address"))),
})


def contract(driver: str) -> Contract:
    """The registered contract; the selection must be exactly n580 or n610 (no `auto`)."""
    if driver not in CONTRACTS:
        raise UnknownDriver(driver)
    return CONTRACTS[driver]


def requirements(driver: str) -> Requirements:
    return contract(driver).base_requirements

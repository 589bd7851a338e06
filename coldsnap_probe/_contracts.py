"""The n580 and n610 snapshot-driver base contracts (spec 3)."""

from __future__ import annotations

from typing import Any

__all__ = ("CONTRACTS", "contract", "requirements")

CONTRACTS: dict[str, dict[str, Any]] = {
    "n580": {
        "id": "n580",
        "abi": 1,
        "capture_boundary": "pre-cuda-process-template",
        "minimum_nvidia_driver_major": 580,
        "base_requirements": {"format": 1, "features": [
            {"id": "criu-process-template"}, {"id": "cuda-fresh-state"}, {"id": "cuda-vmm-exact-address"}]},
    },
    "n610": {
        "id": "n610",
        "abi": 1,
        "capture_boundary": "initialized-cuda-process-state",
        "minimum_nvidia_driver_major": 610,
        "base_requirements": {"format": 1, "features": [
            {"id": "criu-process-tree"}, {"id": "cuda-checkpoint-api"}, {"id": "cuda-checkpoint-roundtrip"},
            {"id": "cuda-classic-ipc"}, {"id": "cuda-initialized-state"}, {"id": "cuda-vmm-exact-address"}]},
    },
}


def contract(driver: str) -> dict[str, Any]:
    """The registered contract; the selection must be exactly n580 or n610 (no `auto`)."""
    try:
        return CONTRACTS[driver]
    except KeyError:
        raise ValueError(f"snapshot driver must be n580 or n610, got {driver!r}") from None


def requirements(driver: str) -> dict[str, Any]:
    return contract(driver)["base_requirements"]  # type: ignore[no-any-return]

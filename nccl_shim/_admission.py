"""Admission of what the shim found: identity and the optional tables (spec 4a, in its order).

Each rejection raises :class:`ProviderNotAdmitted` whose `rule` names the rule.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping

import msgspec

from ._abi import CAPABILITY_BITS, IN_PLACE_SLOTS, KNOWN_CAPABILITY_MASK, InPlaceV1, ProviderV1
from ._lib import ShimIdentity, TableStatus
from .errors import ProviderNotAdmitted

__all__ = ("Expectations", "admit_identity", "capability_names", "missing_capabilities", "unknown_capability_mask")

IN_PLACE_MODE = "net-reconnect-v1"
PROVIDER_ID = re.compile(r"^nccl-[0-9]+\.[0-9]+\.[0-9]+-[0-9]+\+coldsnap\.[0-9]+$")
_REQUIRED_SLOTS = ("prepare", "restore", "network_reset", "network_init")
_PROVIDER_V1_SIZE = ctypes.sizeof(ProviderV1)  # 96
_IN_PLACE_V1_SIZE = ctypes.sizeof(InPlaceV1)  # 56


def _truthy(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


class Expectations(msgspec.Struct, frozen=True, kw_only=True):
    """What the rank controller expects (copied from active.json into the environment)."""

    provider_id: str = ""
    provider_revision: str = ""
    dlsym_bridge_abi: str = ""
    required_capabilities: list[str] = []
    require_ib_reset: bool = True
    require_network_reset: bool = True
    in_place_mode: str = ""
    in_place_experiment: bool = False

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ, *, extra_capabilities: list[str] = (),  # type: ignore[assignment]
                         in_place: bool | None = None) -> Expectations:
        caps = [c.strip() for c in env.get("COLDSNAP_NCCL_REQUIRED_CAPABILITIES", "").split(",") if c.strip()]
        mode = env.get("COLDSNAP_NCCL_IN_PLACE_MODE", "").strip()
        if in_place is True and not mode:
            mode = IN_PLACE_MODE
        return cls(provider_id=env.get("COLDSNAP_NCCL_PROVIDER_ID", ""),
                   provider_revision=env.get("COLDSNAP_NCCL_PROVIDER_REVISION", ""),
                   dlsym_bridge_abi=env.get("COLDSNAP_NCCL_DLSYM_BRIDGE_ABI", ""),
                   required_capabilities=[*caps, *extra_capabilities],
                   require_ib_reset=_truthy(env.get("COLDSNAP_NCCL_REQUIRE_IB_RESET"), True),
                   require_network_reset=_truthy(env.get("COLDSNAP_NCCL_REQUIRE_NETWORK_RESET"), True),
                   in_place_mode=mode,
                   in_place_experiment=_truthy(env.get("COLDSNAP_NCCL_IN_PLACE_EXPERIMENT"), in_place is True))


def capability_names(mask: int) -> list[str]:
    return sorted(name for name, bit in CAPABILITY_BITS.items() if mask & (1 << bit))


def missing_capabilities(mask: int, required: list[str]) -> list[str]:
    """Sorted missing names; an unknown name is refused outright."""
    unknown = sorted({name for name in required if name not in CAPABILITY_BITS})
    if unknown:
        raise ProviderNotAdmitted("4a.9", f"unknown required NCCL provider capabilities: {', '.join(unknown)}")
    return sorted({name for name in required if not mask & (1 << CAPABILITY_BITS[name])})


def _positive_decimal(value: str) -> int | None:
    return int(value) if value.strip().isdigit() and int(value) > 0 else None


def admit_identity(identity: ShimIdentity, in_place: TableStatus, expect: Expectations) -> None:
    """Spec 4a, rules 1-13 in order; the first failure raises."""
    _admit_table(identity, expect)
    _admit_provider(identity, expect)
    _admit_runtime(identity, expect)
    if expect.in_place_mode:
        _admit_in_place(in_place, expect)
    _admit_bridge(identity, expect)


def _admit_table(identity: ShimIdentity, expect: Expectations) -> None:
    """4a.1-4a.4: a supported mode, and a provider table of ABI 1 that is not truncated."""
    if expect.in_place_mode not in ("", IN_PLACE_MODE):
        raise ProviderNotAdmitted("4a.1", f"unsupported NCCL in-place mode {expect.in_place_mode!r}")
    if "coldsnapNcclProviderQuery" not in identity.exports:
        raise ProviderNotAdmitted("4a.2", "NCCL provider lacks coldsnapNcclProviderQuery")
    if identity.query_result == -5:
        raise ProviderNotAdmitted("4a.2", "coldsnapNcclProviderQuery returned null")
    if identity.query_result != 0:
        raise ProviderNotAdmitted("4a.2", f"coldsnapNcclProviderQuery failed with ncclResult_t={identity.query_result}")
    if identity.struct_size < _PROVIDER_V1_SIZE:
        raise ProviderNotAdmitted("4a.3", f"NCCL provider ABI is truncated: struct_size {identity.struct_size} < "
                                          f"{_PROVIDER_V1_SIZE}")
    if identity.abi_major != 1:
        raise ProviderNotAdmitted("4a.4", f"NCCL provider ABI major mismatch: {identity.abi_major} != 1")


def _admit_provider(identity: ShimIdentity, expect: Expectations) -> None:
    """4a.5-4a.8: exactly the expected provider id and revision, compiled against the NCCL it loaded."""
    pid = identity.provider_id
    if pid is None or identity.provider_id_truncated or not pid.isascii() or not PROVIDER_ID.match(pid):
        raise ProviderNotAdmitted("4a.5", f"NCCL provider id {pid!r} does not match {PROVIDER_ID.pattern}")
    if not expect.provider_id:
        raise ProviderNotAdmitted("4a.6", "COLDSNAP_NCCL_PROVIDER_ID is not set: the expected provider is unknown")
    if pid != expect.provider_id:
        raise ProviderNotAdmitted("4a.6", f"NCCL provider id {pid!r} != expected {expect.provider_id!r}")
    revision = _positive_decimal(expect.provider_revision)
    if revision is None:
        raise ProviderNotAdmitted("4a.7", "COLDSNAP_NCCL_PROVIDER_REVISION must be a decimal greater than 0")
    if identity.provider_revision != revision:
        raise ProviderNotAdmitted("4a.7", f"NCCL provider revision {identity.provider_revision} != expected {revision}")
    if identity.compiled_nccl_version != identity.loaded_nccl_version:
        raise ProviderNotAdmitted("4a.8", f"NCCL provider compiled/loaded version mismatch: "
                                          f"{identity.compiled_nccl_version} != {identity.loaded_nccl_version}")


def _admit_runtime(identity: ShimIdentity, expect: Expectations) -> None:
    """4a.9-4a.11: the required capabilities and slots, and version reports that agree."""
    required = [*expect.required_capabilities,
                *(["ib-roce-device-release"] if expect.require_ib_reset else []),
                *(["full-network-reset"] if expect.require_network_reset else [])]
    if missing := missing_capabilities(identity.capability_mask, required):
        raise ProviderNotAdmitted("4a.9", f"NCCL provider lacks required capabilities: {', '.join(missing)}")
    if absent := [s for s in _REQUIRED_SLOTS if s not in identity.slots]:
        raise ProviderNotAdmitted("4a.10", f"NCCL provider table has NULL slots: {', '.join(absent)}")
    if not {"ncclCheckpointGetVersion", "ncclGetVersion"} <= set(identity.exports):
        raise ProviderNotAdmitted("4a.11", "NCCL provider lacks a required version export "
                                           "(ncclCheckpointGetVersion and ncclGetVersion)")
    if identity.checkpoint_version_result != 0 or identity.checkpoint_version != identity.checkpoint_abi_version:
        raise ProviderNotAdmitted("4a.11", f"NCCL checkpoint ABI report disagrees: {identity.checkpoint_version} != "
                                           f"{identity.checkpoint_abi_version}")
    if (identity.nccl_get_version_result != 0 or identity.checkpoint_nccl_version != identity.loaded_nccl_version
            or identity.nccl_version != identity.loaded_nccl_version):
        raise ProviderNotAdmitted("4a.11", f"loaded NCCL runtime identity disagrees: shim "
                                           f"{identity.checkpoint_nccl_version}, ncclGetVersion "
                                           f"{identity.nccl_version}, provider {identity.loaded_nccl_version}")


def _admit_in_place(in_place: TableStatus, expect: Expectations) -> None:
    """4a.12 (in-place mode only): admitted by the controller, and a complete in-place table of ABI 1."""
    if not expect.in_place_experiment:
        raise ProviderNotAdmitted("4a.12", "NCCL in-place mode requires controller admission "
                                           "(COLDSNAP_NCCL_IN_PLACE_EXPERIMENT)")
    if in_place.status == "absent":
        raise ProviderNotAdmitted("4a.12", "NCCL provider lacks coldsnapNcclInPlaceQuery")
    if in_place.status != "present":
        raise ProviderNotAdmitted("4a.12", f"coldsnapNcclInPlaceQuery failed with ncclResult_t={in_place.result} "
                                           f"({in_place.meaning})")
    if in_place.struct_size < _IN_PLACE_V1_SIZE:
        raise ProviderNotAdmitted("4a.12", f"NCCL in-place provider ABI is truncated: struct_size "
                                           f"{in_place.struct_size} < {_IN_PLACE_V1_SIZE}")
    if in_place.abi_major != 1:
        raise ProviderNotAdmitted("4a.12", f"NCCL in-place provider ABI major mismatch: {in_place.abi_major} != 1")
    if absent := [s for s in IN_PLACE_SLOTS if s not in in_place.slots]:
        raise ProviderNotAdmitted("4a.12", f"NCCL in-place provider table has NULL slots: {', '.join(absent)}")


def _admit_bridge(identity: ShimIdentity, expect: Expectations) -> None:
    """4a.13: the dlsym bridge ABI the controller expects."""
    bridge = _positive_decimal(expect.dlsym_bridge_abi)
    if bridge is None or "coldsnapNcclDlsymBridgeAbi" not in identity.exports:
        raise ProviderNotAdmitted("4a.13", "expected NCCL dlsym bridge ABI is invalid (COLDSNAP_NCCL_DLSYM_BRIDGE_ABI "
                                           "must be a decimal > 0 and coldsnapNcclDlsymBridgeAbi exported)")
    if identity.dlsym_bridge_abi != bridge:
        raise ProviderNotAdmitted("4a.13", f"NCCL dlsym bridge ABI mismatch: {identity.dlsym_bridge_abi} != {bridge}")


def unknown_capability_mask(mask: int) -> int:
    return mask & ~KNOWN_CAPABILITY_MASK

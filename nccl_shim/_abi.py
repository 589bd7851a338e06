"""ctypes mirrors of the provider tables and of the shim's own structs, plus the ABI constants.

The provider-table mirrors are never filled from a provider (the shim keeps tables to
itself); they exist so a test can hold the Python view against the layout compiled into
the shim (`csns_layout`) and the two cannot drift.
"""

from __future__ import annotations

import ctypes

__all__ = (
    "CAPABILITY_BITS",
    "EVIDENCE_MAX",
    "IN_PLACE_SLOTS",
    "KNOWN_CAPABILITY_MASK",
    "NCCL_RESULTS",
    "PROVIDER_SLOTS",
    "RESOURCES_SLOTS",
    "SHIM_ERRORS",
    "TABLES",
    "Identity",
    "InPlaceV1",
    "ProviderV1",
    "ResourcesV1",
    "TableInfo",
)

_fn = ctypes.c_void_p  # function pointers: only their presence matters on this side


class ProviderV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("abi_major", ctypes.c_uint32), ("abi_minor", ctypes.c_uint32),
        ("provider_revision", ctypes.c_uint32), ("compiled_nccl_version", ctypes.c_int32),
        ("loaded_nccl_version", ctypes.c_int32), ("checkpoint_abi_version", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32), ("capability_mask", ctypes.c_uint64), ("provider_id", ctypes.c_char_p),
        ("prepare", _fn), ("restore", _fn), ("network_reset", _fn), ("network_init", _fn), ("ib_status", _fn),
        ("comm_get_real", _fn),
    ]


class InPlaceV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("abi_major", ctypes.c_uint32), ("abi_minor", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32), ("communicator_suspend", _fn), ("transport_detach", _fn),
        ("transport_reattach", _fn), ("communicator_resume", _fn), ("evidence_json", _fn),
    ]


class ResourcesV1(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("abi_major", ctypes.c_uint32), ("abi_minor", ctypes.c_uint32),
        ("reserved0", ctypes.c_uint32), ("inspect", _fn), ("evidence_json", _fn),
    ]


# csns_layout's table selectors (CSNS_TABLE_PROVIDER, _IN_PLACE, _RESOURCES) index this.
TABLES: tuple[type[ctypes.Structure], ...] = (ProviderV1, InPlaceV1, ResourcesV1)
# The function slots the shim reports, in its bit order (csns_identity.slots, csns_table_info.slots).
PROVIDER_SLOTS = ("prepare", "restore", "network_reset", "network_init", "ib_status", "comm_get_real")
IN_PLACE_SLOTS = ("communicator_suspend", "transport_detach", "transport_reattach", "communicator_resume",
                  "evidence_json")
RESOURCES_SLOTS = ("inspect", "evidence_json")
EVIDENCE_MAX = 64 * 1024  # CSNS_EVIDENCE_MAX: the most evidence or inventory bytes a provider may return


class Identity(ctypes.Structure):
    """struct csns_identity (coldsnap_nccl_shim.h)."""

    _fields_ = [
        ("size", ctypes.c_uint32), ("exports", ctypes.c_uint32), ("query_result", ctypes.c_int32),
        ("struct_size", ctypes.c_uint32), ("abi_major", ctypes.c_uint32), ("abi_minor", ctypes.c_uint32),
        ("provider_revision", ctypes.c_uint32), ("compiled_nccl_version", ctypes.c_int32),
        ("loaded_nccl_version", ctypes.c_int32), ("checkpoint_abi_version", ctypes.c_uint32),
        ("capability_mask", ctypes.c_uint64), ("slots", ctypes.c_uint32), ("provider_id_state", ctypes.c_int32),
        ("provider_id", ctypes.c_char * 128), ("checkpoint_version_result", ctypes.c_int32),
        ("checkpoint_version", ctypes.c_int32), ("checkpoint_nccl_version", ctypes.c_int32),
        ("nccl_get_version_result", ctypes.c_int32), ("nccl_version", ctypes.c_int32),
        ("dlsym_bridge_abi", ctypes.c_uint32),
    ]


class TableInfo(ctypes.Structure):
    """struct csns_table_info (coldsnap_nccl_shim.h)."""

    _fields_ = [
        ("size", ctypes.c_uint32), ("query_result", ctypes.c_int32), ("struct_size", ctypes.c_uint32),
        ("abi_major", ctypes.c_uint32), ("abi_minor", ctypes.c_uint32), ("slots", ctypes.c_uint32),
    ]


CAPABILITY_BITS: dict[str, int] = {
    "full-network-reset": 0, "ib-roce-device-release": 1, "ras-reset": 2, "synchronous-termination": 3,
    "coordinator-protocol-v1": 4, "private-dlopen-routing": 5, "communicator-unwrap": 6,
    "registration-window-replay": 7, "split-shrink-grow-replay": 8, "cuda-graph": 9, "nccl-device-api": 10,
    "communicator-suspend-in-place": 11, "transport-detach-in-place": 12, "graph-resource-retention": 13,
    "registration-window-in-place-replay": 14, "nvls-in-place-replay": 15, "device-api-state-retention": 16,
}
KNOWN_CAPABILITY_MASK = 0x1FFFF

NCCL_RESULTS = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
                4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress"}
SHIM_ERRORS = {-1: "invalid argument", -2: "library could not be loaded", -3: "export absent",
               -4: "wrong lifecycle state (nothing was called)", -5: "query returned no table",
               -6: "table truncated", -7: "ABI major mismatch", -8: "evidence exceeds 65536 bytes",
               -9: "table slot is NULL", -10: "provider returned no evidence", -11: "buffer too small"}

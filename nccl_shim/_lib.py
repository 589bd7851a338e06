"""The ctypes binding of the shim (the only module that calls into C). Results are msgspec Structs.

This is the one place where ctypes results become `errors.ShimCallFailed` (see `_check`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os

import msgspec

from ._abi import IN_PLACE_SLOTS, PROVIDER_SLOTS, RESOURCES_SLOTS, TABLES, Identity, TableInfo
from .errors import AbiMismatch, ShimCallFailed, describe

__all__ = ("Shim", "ShimIdentity", "TableStatus", "shim_library")

EXPORT_NAMES = ("coldsnapNcclProviderQuery", "coldsnapNcclInPlaceQuery", "coldsnapNcclResourcesQuery",
                "ncclCheckpointGetVersion", "ncclGetVersion", "coldsnapNcclDlsymBridgeAbi")
_ABI_ERRORS = frozenset({-6, -7})  # CSNS_E_TRUNCATED, CSNS_E_ABI


def _check(call: str, rc: int, detail: str = "") -> None:
    """Raise for a failed result: the table ABI errors as AbiMismatch, every other one as ShimCallFailed."""
    if rc != 0:
        raise (AbiMismatch if rc in _ABI_ERRORS else ShimCallFailed)(call, rc, detail)


class ShimIdentity(msgspec.Struct, frozen=True, kw_only=True):
    exports: list[str]
    query_result: int
    struct_size: int
    abi_major: int
    abi_minor: int
    provider_revision: int
    compiled_nccl_version: int
    loaded_nccl_version: int
    checkpoint_abi_version: int
    capability_mask: int
    slots: list[str]
    provider_id: str | None
    provider_id_truncated: bool
    checkpoint_version_result: int
    checkpoint_version: int
    checkpoint_nccl_version: int
    nccl_get_version_result: int
    nccl_version: int
    dlsym_bridge_abi: int


class TableStatus(msgspec.Struct, frozen=True, kw_only=True):
    """An optional table: `absent` (no export), `query-error` (with the result and its meaning), `present`."""

    status: str
    result: int = 0
    meaning: str = ""
    struct_size: int = 0
    abi_major: int = 0
    abi_minor: int = 0
    slots: list[str] = []


def shim_library() -> str:
    """Path of the compiled shim: $COLDSNAP_NCCL_SHIM_LIBRARY, else the one `pip install` built."""
    if path := os.environ.get("COLDSNAP_NCCL_SHIM_LIBRARY"):
        return path
    spec = importlib.util.find_spec("nccl_shim._csns")
    if spec is None or not spec.origin:
        raise ShimCallFailed("load", -2, "the shim is not built (pip install . builds it)")
    return spec.origin


def _bits(mask: int, names: tuple[str, ...]) -> list[str]:
    return [name for i, name in enumerate(names) if mask & (1 << i)]


class Shim:
    """One opened provider namespace (a library path, or None for the process-global one)."""

    def __init__(self, library: str | None = None, *, shim_path: str | None = None) -> None:
        path = shim_path or shim_library()
        try:
            self._c = ctypes.CDLL(path)
        except OSError as exc:
            raise ShimCallFailed("load", -2, f"the shim {path} could not be loaded: {exc}") from exc
        c = self._c
        c.csns_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
        c.csns_open.restype = ctypes.c_int32
        c.csns_close.argtypes = [ctypes.c_void_p]
        c.csns_close.restype = None
        c.csns_last_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        c.csns_last_error.restype = None
        c.csns_layout.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
        c.csns_layout.restype = ctypes.c_uint32
        c.csns_identity.argtypes = [ctypes.c_void_p, ctypes.POINTER(Identity)]
        c.csns_identity.restype = ctypes.c_int32
        for name in ("csns_in_place_info", "csns_resources_info"):
            getattr(c, name).argtypes = [ctypes.c_void_p, ctypes.POINTER(TableInfo)]
            getattr(c, name).restype = ctypes.c_int32
        handle = ctypes.c_void_p()
        rc = c.csns_open(library.encode() if library else None, ctypes.byref(handle))
        if rc != 0:
            buffer = ctypes.create_string_buffer(512)
            c.csns_last_error(buffer, len(buffer))
            _check("open", rc, buffer.value.decode(errors="replace"))
        self._handle = handle
        self.library = library

    def close(self) -> None:
        if self._handle:
            self._c.csns_close(self._handle)
            self._handle = ctypes.c_void_p()

    def layout(self, table: int) -> tuple[int, list[int]]:
        """The compiled sizeof and field offsets of provider table `table` (an index into TABLES)."""
        size = int(self._c.csns_layout(table, 0xFFFFFFFF))  # CSNS_LAYOUT_SIZE
        return size, [int(self._c.csns_layout(table, i)) for i in range(len(TABLES[table]._fields_))]

    def identity(self) -> ShimIdentity:
        raw = Identity(size=ctypes.sizeof(Identity))
        rc = self._c.csns_identity(self._handle, ctypes.byref(raw))
        if rc != -5:  # a NULL table is reported by the admission rules, not raised here
            _check("csns_identity", rc)
        provider_id = None
        if raw.provider_id_state:
            provider_id = bytes(raw.provider_id).split(b"\0", 1)[0].decode("latin-1")
        return ShimIdentity(
            exports=_bits(raw.exports, EXPORT_NAMES), query_result=rc if rc == -5 else raw.query_result,
            struct_size=raw.struct_size, abi_major=raw.abi_major, abi_minor=raw.abi_minor,
            provider_revision=raw.provider_revision, compiled_nccl_version=raw.compiled_nccl_version,
            loaded_nccl_version=raw.loaded_nccl_version, checkpoint_abi_version=raw.checkpoint_abi_version,
            capability_mask=raw.capability_mask, slots=_bits(raw.slots, PROVIDER_SLOTS), provider_id=provider_id,
            provider_id_truncated=raw.provider_id_state == 2,
            checkpoint_version_result=raw.checkpoint_version_result, checkpoint_version=raw.checkpoint_version,
            checkpoint_nccl_version=raw.checkpoint_nccl_version,
            nccl_get_version_result=raw.nccl_get_version_result, nccl_version=raw.nccl_version,
            dlsym_bridge_abi=raw.dlsym_bridge_abi)

    def _table(self, call: str, slots: tuple[str, ...]) -> TableStatus:
        info = TableInfo(size=ctypes.sizeof(TableInfo))
        rc = getattr(self._c, call)(self._handle, ctypes.byref(info))
        if rc == -3:
            return TableStatus(status="absent")
        if rc == -5:
            return TableStatus(status="query-error", result=rc, meaning=describe(rc))
        _check(call, rc)
        if info.query_result != 0:
            return TableStatus(status="query-error", result=info.query_result, meaning=describe(info.query_result))
        return TableStatus(status="present", struct_size=info.struct_size, abi_major=info.abi_major,
                           abi_minor=info.abi_minor, slots=_bits(info.slots, slots))

    def in_place(self) -> TableStatus:
        return self._table("csns_in_place_info", IN_PLACE_SLOTS)

    def resources(self) -> TableStatus:
        return self._table("csns_resources_info", RESOURCES_SLOTS)


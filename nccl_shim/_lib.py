"""The ctypes binding of the shim (the only module that calls into C). Results are msgspec Structs."""

from __future__ import annotations

import ctypes
import importlib.util
import os

import msgspec

from ._abi import NCCL_RESULTS, SHIM_ERRORS, Identity, TableInfo

__all__ = ("IN_PLACE_OPERATIONS", "RECREATE_OPERATIONS", "Shim", "ShimError", "ShimIdentity", "TableStatus",
           "shim_library")

IN_PLACE_OPERATIONS = ("suspend", "detach", "reattach", "resume")
RECREATE_OPERATIONS = ("prepare", "restore", "network_reset", "network_init")
IN_PLACE_STATES = ("active", "suspended", "transport-detached", "transport-reattached", "failed")
RECREATE_STATES = ("idle", "prepared", "restored")
EXPORT_NAMES = ("coldsnapNcclProviderQuery", "coldsnapNcclInPlaceQuery", "coldsnapNcclResourcesQuery",
                "ncclCheckpointGetVersion", "ncclGetVersion", "coldsnapNcclDlsymBridgeAbi")
PROVIDER_SLOTS = ("prepare", "restore", "network_reset", "network_init", "ib_status", "comm_get_real")
IN_PLACE_SLOTS = ("communicator_suspend", "transport_detach", "transport_reattach", "communicator_resume",
                  "evidence_json")
_EVIDENCE_MAX = 64 * 1024


def describe(code: int) -> str:
    if code < 0:
        return SHIM_ERRORS.get(code, f"shim error {code}")
    return NCCL_RESULTS.get(code, f"ncclResult_t={code}")


class ShimError(Exception):
    """A shim call failed; `code` is the shim's (negative) or the provider's ncclResult_t."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        what = f"ncclResult_t={code}" if code >= 0 else f"shim error {code}"
        super().__init__(f"{call} failed with {what} ({describe(code)})" + (f": {detail}" if detail else ""))
        self.call, self.code = call, code


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
        raise ShimError("load", -2, "the shim is not built (pip install . builds it)")
    return spec.origin


def _bits(mask: int, names: tuple[str, ...]) -> list[str]:
    return [name for i, name in enumerate(names) if mask & (1 << i)]


class Shim:
    """One opened provider namespace (a library path, or None for the process-global one)."""

    def __init__(self, library: str | None = None, *, shim_path: str | None = None) -> None:
        self._c = ctypes.CDLL(shim_path or shim_library())
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
        for name in ("csns_in_place_call", "csns_recreate_call"):
            getattr(c, name).argtypes = [ctypes.c_void_p, ctypes.c_uint32]
            getattr(c, name).restype = ctypes.c_int32
        c.csns_state.argtypes = [ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]
        c.csns_state.restype = None
        c.csns_in_place_evidence.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                             ctypes.POINTER(ctypes.c_size_t)]
        c.csns_in_place_evidence.restype = ctypes.c_int32
        c.csns_resources_inspect.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int32),
                                             ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
        c.csns_resources_inspect.restype = ctypes.c_int32
        c.csns_ib_status.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32 * 4)]
        c.csns_ib_status.restype = ctypes.c_int32
        handle = ctypes.c_void_p()
        rc = c.csns_open(library.encode() if library else None, ctypes.byref(handle))
        if rc != 0:
            buffer = ctypes.create_string_buffer(512)
            c.csns_last_error(buffer, len(buffer))
            raise ShimError("open", rc, buffer.value.decode(errors="replace"))
        self._handle = handle
        self.library = library

    def close(self) -> None:
        if self._handle:
            self._c.csns_close(self._handle)
            self._handle = ctypes.c_void_p()

    def layout(self, table: int) -> tuple[int, list[int]]:
        size = int(self._c.csns_layout(table, 0xFFFFFFFF))
        count = {0: 16, 1: 9, 2: 6}[table]
        return size, [int(self._c.csns_layout(table, i)) for i in range(count)]

    def identity(self) -> ShimIdentity:
        raw = Identity(size=ctypes.sizeof(Identity))
        rc = self._c.csns_identity(self._handle, ctypes.byref(raw))
        if rc not in (0, -5):  # a NULL table is reported by the admission rules, not raised here
            raise ShimError("csns_identity", rc)
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
        if rc != 0:
            raise ShimError(call, rc)
        if info.query_result != 0:
            return TableStatus(status="query-error", result=info.query_result, meaning=describe(info.query_result))
        return TableStatus(status="present", struct_size=info.struct_size, abi_major=info.abi_major,
                           abi_minor=info.abi_minor, slots=_bits(info.slots, slots))

    def in_place(self) -> TableStatus:
        return self._table("csns_in_place_info", IN_PLACE_SLOTS)

    def resources(self) -> TableStatus:
        return self._table("csns_resources_info", ("inspect", "evidence_json"))

    def in_place_call(self, operation: str) -> int:
        """Run suspend|detach|reattach|resume; returns the provider's ncclResult_t, raises on shim errors."""
        rc = int(self._c.csns_in_place_call(self._handle, IN_PLACE_OPERATIONS.index(operation)))
        if rc < 0:
            raise ShimError(f"in-place {operation}", rc)
        return rc

    def recreate_call(self, operation: str) -> int:
        rc = int(self._c.csns_recreate_call(self._handle, RECREATE_OPERATIONS.index(operation)))
        if rc < 0:
            raise ShimError(f"recreate {operation}", rc)
        return rc

    def state(self) -> tuple[str, str]:
        in_place, recreate = ctypes.c_uint32(), ctypes.c_uint32()
        self._c.csns_state(ctypes.byref(in_place), ctypes.byref(recreate))
        return IN_PLACE_STATES[in_place.value], RECREATE_STATES[recreate.value]

    def in_place_evidence(self) -> bytes:
        buffer = ctypes.create_string_buffer(_EVIDENCE_MAX + 1)
        length = ctypes.c_size_t()
        rc = self._c.csns_in_place_evidence(self._handle, buffer, len(buffer), ctypes.byref(length))
        if rc != 0:
            raise ShimError("in-place evidence_json", rc)
        return buffer.raw[: length.value]

    def resources_inspect(self, mode: int) -> tuple[int, bytes]:
        buffer = ctypes.create_string_buffer(_EVIDENCE_MAX + 1)
        length, result = ctypes.c_size_t(), ctypes.c_int32()
        rc = self._c.csns_resources_inspect(self._handle, mode, ctypes.byref(result), buffer, len(buffer),
                                            ctypes.byref(length))
        if rc != 0:
            raise ShimError("resources inspect", rc)
        return result.value, buffer.raw[: length.value]

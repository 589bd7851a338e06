"""Every exception nccl_shim raises, in one tree.

    ShimError                       anything this package raises on purpose
    ├── ShimCallFailed              a shim call returned a shim error (< 0) or the provider's ncclResult_t
    │   └── AbiMismatch             a provider table is truncated or has another ABI major
    └── ProviderNotAdmitted         what the shim found breaks an admission rule (`rule`: 4a.N)

`_lib.py` is the one place where ctypes results become these errors. `ProviderNotAdmitted`
is the NCCL provider's admission; a host feature profile's admission is the different
`coldsnap_probe.errors.AdmissionError`.
"""

from __future__ import annotations

from ._abi import NCCL_RESULTS, SHIM_ERRORS

__all__ = ("AbiMismatch", "ProviderNotAdmitted", "ShimCallFailed", "ShimError", "describe")


def describe(code: int) -> str:
    """A shim error's or an ncclResult_t's meaning."""
    if code < 0:
        return SHIM_ERRORS.get(code, f"shim error {code}")
    return NCCL_RESULTS.get(code, f"ncclResult_t={code}")


class ShimError(Exception):
    """The root: anything nccl_shim raises on purpose."""


class ShimCallFailed(ShimError):
    """A shim call failed; `code` is the shim's (negative) or the provider's ncclResult_t."""

    def __init__(self, call: str, code: int, detail: str = "") -> None:
        what = f"ncclResult_t={code}" if code >= 0 else f"shim error {code}"
        super().__init__(f"{call} failed with {what} ({describe(code)})" + (f": {detail}" if detail else ""))
        self.call, self.code = call, code


class AbiMismatch(ShimCallFailed):
    """A provider table's struct_size is smaller than the shim needs, or its ABI major is not 1."""


class ProviderNotAdmitted(ShimError):
    """The provider is not admitted; `rule` is the spec rule number (4a.N) or name (4b, 4c)."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule

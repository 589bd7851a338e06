"""nccl_shim: a C shim over the ColdSnap NCCL provider ABIs and its ctypes binding.

The C shim (built by `pip install .`, NCCL found only at run time) copies identity and
evidence out of the provider and guards the lifecycle; this package admits what it finds.
Errors: `nccl_shim.errors` (root `ShimError`).
"""

from ._admission import Expectations as Expectations
from ._admission import admit_identity as admit_identity
from ._admission import capability_names as capability_names
from ._admission import missing_capabilities as missing_capabilities
from ._lib import Shim as Shim
from ._lib import ShimIdentity as ShimIdentity
from ._lib import TableStatus as TableStatus
from .errors import AbiMismatch as AbiMismatch
from .errors import ProviderNotAdmitted as ProviderNotAdmitted
from .errors import ShimCallFailed as ShimCallFailed
from .errors import ShimError as ShimError

__all__ = (
    "AbiMismatch",
    "Expectations",
    "ProviderNotAdmitted",
    "Shim",
    "ShimCallFailed",
    "ShimError",
    "ShimIdentity",
    "TableStatus",
    "admit_identity",
    "capability_names",
    "missing_capabilities",
)

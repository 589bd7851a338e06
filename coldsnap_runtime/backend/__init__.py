"""The backend seam (one async method per runtime action), the Docker Engine and the Kubernetes backends.

``DockerBackend`` and ``KubernetesBackend`` are imported on first use (PEP 562): aiodocker, aiohttp and
kubernetes_asyncio cost tenths of a second to import, which the control-socket client commands should not pay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._archive import ArchiveRefused as ArchiveRefused
from ._archive import check_members as check_members
from ._base import MANAGER_UID_LABEL as MANAGER_UID_LABEL
from ._base import REPORT_DIR_LABEL as REPORT_DIR_LABEL
from ._base import Backend as Backend
from ._base import Owner as Owner
from ._base import RuntimeContext as RuntimeContext
from ._base import dispatch as dispatch
from ._base import running_for as running_for
from ._base import with_manager_labels as with_manager_labels
from ._base import with_report_dir as with_report_dir
from ._blob_memory import BlobMemory as BlobMemory
from ._blob_memory import KnownBlobs as KnownBlobs
from ._confine import CAPSULE_DENIED_IOCTL_TYPES as CAPSULE_DENIED_IOCTL_TYPES
from ._confine import CAPSULE_DENIED_SYSCALLS as CAPSULE_DENIED_SYSCALLS
from ._confine import seccomp_profile as seccomp_profile
from ._gpus import GpuPolicy as GpuPolicy
from ._gpus import HostPolicy as HostPolicy
from ._ledger import LedgerEntry as LedgerEntry
from ._privileges import read_capabilities as read_capabilities
from ._translate import PrivilegeGrant as PrivilegeGrant
from ._translate import container_config as container_config

if TYPE_CHECKING:
    from ._buildctx import write_context_tar as write_context_tar
    from ._capture_build import store_context as store_context
    from ._capture_registry import CaptureRegistry as CaptureRegistry
    from ._capture_registry import Transferred as Transferred
    from ._captures import Captures as Captures
    from ._copy import extract_archive as extract_archive
    from ._docker import DockerBackend as DockerBackend
    from ._kubernetes import KubernetesBackend as KubernetesBackend

__all__ = ("CAPSULE_DENIED_IOCTL_TYPES", "CAPSULE_DENIED_SYSCALLS", "MANAGER_UID_LABEL", "REPORT_DIR_LABEL",
           "ArchiveRefused", "Backend", "BlobMemory", "CaptureRegistry", "Captures", "DockerBackend", "GpuPolicy",
           "HostPolicy", "KnownBlobs", "KubernetesBackend", "LedgerEntry", "Owner", "PrivilegeGrant", "RuntimeContext",
           "Transferred", "check_members", "container_config", "dispatch", "extract_archive", "read_capabilities",
           "running_for", "seccomp_profile", "store_context", "with_manager_labels", "with_report_dir",
           "write_context_tar")


def __getattr__(name: str) -> Any:
    # aiodocker is loaded only by those who need it
    if name == "DockerBackend":
        from ._docker import DockerBackend

        return DockerBackend
    if name == "Captures":
        from ._captures import Captures

        return Captures
    if name in ("CaptureRegistry", "Transferred"):  # bench/store_push.py measures a push through it
        from . import _capture_registry

        return getattr(_capture_registry, name)
    if name in ("store_context", "write_context_tar"):  # bench/store_build.py times an image-build's phases
        from . import _buildctx, _capture_build

        return getattr(_capture_build if name == "store_context" else _buildctx, name)
    if name == "extract_archive":
        from ._copy import extract_archive

        return extract_archive
    if name == "KubernetesBackend":
        from ._kubernetes import KubernetesBackend

        return KubernetesBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The backend seam (one async method per runtime action) and the Docker Engine backend.

``DockerBackend`` is imported on first use (PEP 562): aiodocker and aiohttp cost about
0.2 s to import, which the control-socket client commands should not pay.
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
from ._base import with_manager_labels as with_manager_labels
from ._base import with_report_dir as with_report_dir
from ._gpus import GpuPolicy as GpuPolicy
from ._gpus import HostPolicy as HostPolicy
from ._translate import container_config as container_config

if TYPE_CHECKING:
    from ._docker import DockerBackend as DockerBackend

__all__ = ("MANAGER_UID_LABEL", "REPORT_DIR_LABEL", "ArchiveRefused", "Backend", "DockerBackend", "GpuPolicy",
           "HostPolicy", "Owner",
           "RuntimeContext", "check_members", "container_config", "dispatch", "with_manager_labels",
           "with_report_dir")


def __getattr__(name: str) -> Any:
    if name == "DockerBackend":
        from ._docker import DockerBackend

        return DockerBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

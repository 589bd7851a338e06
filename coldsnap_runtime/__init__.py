"""runtime-v1: the typed image/workload operations and the backends that realise them.

This package knows nothing about envelopes or sessions: it takes a decoded
:data:`~coldsnap_runtime.schema.RuntimeRequest` and a :class:`RuntimeContext` and
returns a :class:`~coldsnap_runtime.schema.RuntimeResponse` or raises a
:class:`~coldsnap_runtime.errors.BackendError`. ``DockerBackend`` is imported on first
use (see :mod:`coldsnap_runtime.backend`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backend import MANAGER_UID_LABEL as MANAGER_UID_LABEL
from .backend import REPORT_DIR_LABEL as REPORT_DIR_LABEL
from .backend import Backend as Backend
from .backend import Owner as Owner
from .backend import RuntimeContext as RuntimeContext
from .backend import dispatch as dispatch
from .errors import BackendError as BackendError
from .errors import ColdsnapError as ColdsnapError
from .errors import NotFound as NotFound
from .errors import OutputTooLarge as OutputTooLarge
from .errors import PathNotFound as PathNotFound
from .errors import RequestRejected as RequestRejected
from .errors import RuntimeFailed as RuntimeFailed
from .limits import CLEANUP_BUDGET_S as CLEANUP_BUDGET_S
from .limits import OUTPUT_LIMIT as OUTPUT_LIMIT

if TYPE_CHECKING:
    from .backend import DockerBackend as DockerBackend

__all__ = (
    "CLEANUP_BUDGET_S",
    "MANAGER_UID_LABEL",
    "OUTPUT_LIMIT",
    "REPORT_DIR_LABEL",
    "Backend",
    "BackendError",
    "ColdsnapError",
    "DockerBackend",
    "NotFound",
    "OutputTooLarge",
    "Owner",
    "PathNotFound",
    "RequestRejected",
    "RuntimeContext",
    "RuntimeFailed",
    "dispatch",
)


def __getattr__(name: str) -> Any:
    if name == "DockerBackend":
        from .backend import DockerBackend

        return DockerBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""runtime-v1: the typed image/workload operations and the backends that realise them.

This package knows nothing about envelopes or sessions: it takes a decoded
:data:`~coldsnap_runtime.schema.RuntimeRequest` and a :class:`RuntimeContext` and
returns a :class:`~coldsnap_runtime.schema.RuntimeResponse` or raises a
:class:`~coldsnap_runtime.errors.BackendError`.
"""

from .backend import Backend as Backend
from .backend import RuntimeContext as RuntimeContext
from .backend import dispatch as dispatch
from .errors import BackendError as BackendError
from .errors import ColdsnapError as ColdsnapError
from .errors import NotFound as NotFound
from .errors import PathNotFound as PathNotFound
from .errors import RequestRejected as RequestRejected
from .errors import RuntimeFailed as RuntimeFailed

__all__ = (
    "Backend",
    "BackendError",
    "ColdsnapError",
    "NotFound",
    "PathNotFound",
    "RequestRejected",
    "RuntimeContext",
    "RuntimeFailed",
    "dispatch",
)

"""The backend seam (one async method per runtime action) and the Docker Engine backend."""

from ._base import Backend as Backend
from ._base import RuntimeContext as RuntimeContext
from ._base import dispatch as dispatch
from ._base import with_manager_labels as with_manager_labels

__all__ = ("Backend", "RuntimeContext", "dispatch", "with_manager_labels")

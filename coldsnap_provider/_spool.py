"""The spool: where copies and transfers are staged on disk (``[docker] spool_dir``, never the state directory,
which is tmpfs under the unit), and the most bytes one of them may hold (``[docker] copy_max_bytes``).

Apart from the SSH transfers that use it (:mod:`._remote_transfer`), so that a daemon without a ``[[remote]]``
entry never loads the SSH stack.
"""

from __future__ import annotations

import tempfile

from coldsnap_runtime.errors import RuntimeFailed

__all__ = ("Spool",)


class Spool:
    """Where transfers are spooled, and the most bytes one of them may hold."""

    def __init__(self, *, directory: str | None, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes

    def staging(self, prefix: str) -> tempfile.TemporaryDirectory[str]:
        """A private (0700) directory for one transfer, removed with its contents."""
        return tempfile.TemporaryDirectory(dir=self.directory, prefix=f"coldsnap-{prefix}-")

    def too_large(self, action: str) -> RuntimeFailed:
        return RuntimeFailed(action=action, detail=(
            f"the copy exceeds {self.max_bytes} bytes (docker.copy_max_bytes); nothing was placed"))

"""The runtime's one error tree.

::

    ColdsnapError                      any failure we report on the wire
    ├── RequestRejected                bad framing, envelope, auth or validation (plain ok:false)
    ├── StoreError                     the node's capture store lacks or refuses a capture, chunk or blob
    │                                  (never on the wire: the backend translates it into RuntimeFailed)
    └── BackendError                   the runtime failed                        (runtime_failed)
        ├── NotFound                   the image or workload itself is absent   (not_found)
        ├── PathNotFound               a path inside an existing workload       (path_not_found)
        ├── RuntimeFailed              a non-zero exit, an engine error, a refused operation
        │   ├── CommandFailed          a program ran and failed; the message ends with its output
        │   ├── OutputTooLarge         collected output would pass the reply limit
        │   ├── BuildContextError      a build the classic builder cannot express
        │   └── EngineRejected         the engine answered with an HTTP error status (its `status`)
        ├── BackendTimeout             the engine did not answer within the action's deadline
        └── BackendUnavailable         the engine socket is missing, refused or reset

``error_code`` is a class attribute so subclasses inherit their wire class; context
travels as keyword-only attributes and the constructor builds the message.
Dependency errors (aiodocker, aiohttp, sockets) become these classes in one place,
``coldsnap_runtime.backend._engine.docker_errors`` (and its sibling ``registry_errors`` for
the registry reads of ``image.id`` on the containerd store), always chained with ``from exc``.
Misusing our own API raises ``RuntimeError``/``TypeError`` and never reaches the wire.

The reply carries ``str(error)``; logs and the audit trail carry ``error.loggable()`` (issue 37, finding 7):
the same text, except that a :class:`CommandFailed` keeps its output out (a length and a digest instead).
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

__all__ = (
    "BackendError",
    "BackendTimeout",
    "BackendUnavailable",
    "BuildContextError",
    "ColdsnapError",
    "CommandFailed",
    "EngineRejected",
    "NotFound",
    "OutputTooLarge",
    "PathNotFound",
    "RequestRejected",
    "RuntimeFailed",
    "StoreError",
)


class ColdsnapError(Exception):
    """Root of every failure that becomes an ``ok:false`` reply."""

    error_code: ClassVar[str | None] = None

    def loggable(self) -> str:
        """The message as a log line or the audit trail may carry it (the reply carries ``str(self)``)."""
        return str(self) or type(self).__name__


class RequestRejected(ColdsnapError):
    """The request was refused before anything ran: framing, envelope, auth or schema."""


class BackendError(ColdsnapError):
    """The runtime was asked and failed."""

    error_code: ClassVar[str | None] = "runtime_failed"

    def __init__(self, message: str, *, action: str = "") -> None:
        super().__init__(message)
        self.action = action


class NotFound(BackendError):
    """The image or workload named by the request does not exist."""

    error_code = "not_found"

    def __init__(self, *, kind: str, ref: str, action: str) -> None:
        super().__init__(f"{action}: no such {kind}: {ref}", action=action)
        self.kind, self.ref = kind, ref


class PathNotFound(BackendError):
    """A path inside an existing workload does not exist (raised only after the workload was found)."""

    error_code = "path_not_found"

    def __init__(self, *, workload: str, path: str, action: str) -> None:
        super().__init__(f"{action}: could not find the file {path} in workload {workload}", action=action)
        self.workload, self.path = workload, path


class RuntimeFailed(BackendError):
    """Any other runtime failure: a non-zero exit, an engine error, a refused operation."""

    def __init__(self, *, action: str, detail: str) -> None:
        super().__init__(f"{action} failed: {detail}", action=action)
        self.detail = detail


class CommandFailed(RuntimeFailed):
    """A program ran and failed (a workload, an exec in one, a build step); the message ends with its output."""

    # The message (the reply's `error`) ends with the program's diagnostics, the only channel the protocol
    # has for them (spec: the Go client discards `output` on failure). Whatever secrets the program printed
    # are in there, so logs and the audit trail get `loggable()`: `status` (e.g. "exited 3"), the output's
    # length and a digest to match it with what the client saw (issue 37, finding 7).
    def __init__(self, *, action: str, status: str, output: str) -> None:
        super().__init__(action=action, detail=": ".join(part for part in (status, output) if part))
        self.status, self.output = status, output

    def loggable(self) -> str:
        data = self.output.encode("utf-8", "surrogateescape")
        digest = hashlib.sha256(data).hexdigest()[:16]
        status = f": {self.status}" if self.status else ""
        return f"{self.action} failed{status} (output withheld: {len(data)} bytes, sha256 {digest})"


class OutputTooLarge(RuntimeFailed):
    """Collected output would not fit in one reply (``coldsnap_runtime.limits.OUTPUT_LIMIT``)."""

    def __init__(self, *, action: str, limit: int) -> None:
        super().__init__(action=action, detail=f"output exceeds {limit} bytes")
        self.limit = limit


class BuildContextError(RuntimeFailed):
    """An image-build the classic builder cannot express (a BuildKit-only feature, a bad context)."""

    def __init__(self, detail: str) -> None:
        super().__init__(action="image-build", detail=detail)


class EngineRejected(RuntimeFailed):
    """The engine answered with an HTTP error status: an API call, or a hijacked request (attach, exec start)."""

    def __init__(self, *, action: str, status: int, detail: str) -> None:
        super().__init__(action=action, detail=detail)
        self.status = status


class BackendTimeout(BackendError):
    """The engine did not answer within the deadline of the action."""

    def __init__(self, *, action: str) -> None:
        super().__init__(f"{action} failed: the container engine did not answer in time", action=action)


class BackendUnavailable(BackendError):
    """The engine could not be reached (socket missing, refused, reset)."""

    def __init__(self, *, action: str, detail: str) -> None:
        super().__init__(f"{action} failed: container engine unavailable: {detail}", action=action)
        self.detail = detail


class StoreError(ColdsnapError):
    """The node's capture store lacks or refuses a capture, chunk or blob (named); translated into RuntimeFailed."""

"""The daemon package's own errors: what never travels as an envelope reply.

Failures of a request are ``coldsnap_runtime.errors`` (the wire tree, translated into replies
by the handlers); these are the rest::

    ProviderError                  root of this package's own failures
    ├── ConfigError                the configuration or state directory cannot be used (exit 2)
    ├── ControllerRefused          `run`: the controller does not speak what the manager needs
    ├── PlacementError             a copy cannot be placed on a remote node (becomes runtime_failed)
    └── ClientError                the strict client's view of a failed exchange
        ├── ProtocolError          the reply broke the protocol (size, shape, identity)
        └── ReplyError             the provider answered ok:false (carries its error_code)
            ├── NotFoundError      error_code not_found (another manager's workload reads the same)
            ├── PathNotFoundError  error_code path_not_found
            └── RuntimeFailedError error_code runtime_failed: the runtime was asked and failed
"""

from __future__ import annotations

__all__ = (
    "ClientError",
    "ConfigError",
    "ControllerRefused",
    "NotFoundError",
    "PathNotFoundError",
    "PlacementError",
    "ProtocolError",
    "ProviderError",
    "ReplyError",
    "RuntimeFailedError",
    "reply_error",
)


class ProviderError(Exception):
    """Root of the daemon package's own failures."""


class ConfigError(ProviderError):
    """The configuration file is unreadable or invalid, or the state directory is served already."""


class ControllerRefused(ProviderError):
    """The controller's `capabilities` does not offer what this manager needs (spec section 8)."""


class PlacementError(ProviderError):
    """The copy cannot be placed at the destination (the message says why)."""


class ClientError(ProviderError):
    """An exchange with the provider failed, as the Go client would see it."""


class ProtocolError(ClientError):
    """The reply broke the protocol (size, shape, identity); the Go client would fail the call."""


class ReplyError(ClientError):
    """The provider answered ok:false."""

    def __init__(self, message: str, *, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class NotFoundError(ReplyError):
    """The image or workload named does not exist (or is another manager's)."""


class PathNotFoundError(ReplyError):
    """A path inside an existing workload does not exist."""


class RuntimeFailedError(ReplyError):
    """The runtime was asked and failed (an engine error, a non-zero exit, a refused operation)."""


_BY_CODE: dict[str, type[ReplyError]] = {
    "not_found": NotFoundError, "path_not_found": PathNotFoundError, "runtime_failed": RuntimeFailedError}


def reply_error(message: str, code: str) -> ReplyError:
    """The ReplyError subclass an ok:false reply's `error_code` names (ReplyError itself for a refusal)."""
    return _BY_CODE.get(code, ReplyError)(message or "provider returned an unspecified failure", code=code)

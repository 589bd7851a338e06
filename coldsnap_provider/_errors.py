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
"""

from __future__ import annotations

__all__ = (
    "ClientError",
    "ConfigError",
    "ControllerRefused",
    "PlacementError",
    "ProtocolError",
    "ProviderError",
    "ReplyError",
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

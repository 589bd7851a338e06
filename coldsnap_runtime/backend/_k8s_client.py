"""The Kubernetes client edge: errors translated in one place, the exec WebSocket, its status channel (no state).

kubernetes_asyncio, aiohttp and socket errors become ours only in :func:`kube_errors` (and
:func:`status_error` for a status read from a raw response), always chained with ``from exc``. Messages are
built from the HTTP status and the apiserver's own ``Status.message``: nothing of a credential (headers,
tokens) ever reaches an error or a log.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.stream import WsApiClient

from ..errors import BackendError, BackendTimeout, BackendUnavailable, NotFound, RuntimeFailed

__all__ = (
    "CHANNEL_CLOSE",
    "CHANNEL_ERROR",
    "CHANNEL_STDERR",
    "CHANNEL_STDIN",
    "CHANNEL_STDOUT",
    "V4",
    "V5",
    "ChannelClient",
    "diagnostic_text",
    "exec_exit_code",
    "exec_status",
    "kube_errors",
    "status_error",
)

# The channel protocol: every frame is one channel byte and its payload.
CHANNEL_STDIN, CHANNEL_STDOUT, CHANNEL_STDERR, CHANNEL_ERROR = 0, 1, 2, 3
CHANNEL_CLOSE = 255  # v5.channel.k8s.io: [255, channel] closes that channel (stdin's end of input)
V5, V4 = "v5.channel.k8s.io", "v4.channel.k8s.io"
_DIAGNOSTIC_BYTES = 16 << 10


@contextmanager
def kube_errors(action: str, *, kind: str = "", ref: str = "") -> Iterator[None]:
    """The one place client, HTTP and socket errors become ours (`kind`/`ref`: what a 404 means)."""
    try:
        yield
    except ApiException as exc:
        raise status_error(action, int(exc.status or 0), exc.body, kind=kind, ref=ref) from exc
    except ConfigException as exc:
        raise RuntimeFailed(action=action, detail=f"kubeconfig unusable: {exc}") from exc
    except TimeoutError as exc:  # before the connection errors: aiohttp's timeouts subclass both
        raise BackendTimeout(action=action) from exc
    except aiohttp.WSServerHandshakeError as exc:
        raise status_error(action, exc.status, None, kind=kind, ref=ref) from exc
    except aiohttp.ClientConnectionError as exc:
        raise BackendUnavailable(action=action, detail=f"apiserver: {exc or type(exc).__name__}") from exc
    except aiohttp.ClientError as exc:
        raise RuntimeFailed(action=action, detail=f"apiserver: {type(exc).__name__}: {exc}") from exc
    except OSError as exc:
        raise BackendUnavailable(action=action, detail=f"apiserver: {exc.strerror or exc}") from exc


def status_error(action: str, status: int, body: Any, *, kind: str, ref: str) -> BackendError:
    """An apiserver error status as our error; the text is the apiserver's Status.message, never headers."""
    if status == 404 and kind:
        return NotFound(kind=kind, ref=ref, action=action)
    message = ""
    try:
        message = str(json.loads(body or b"{}").get("message") or "")
    except (ValueError, AttributeError):
        message = ""
    if status == 401:
        return RuntimeFailed(action=action, detail="the apiserver refused the kubeconfig's credential "
                                                   "(401 Unauthorized: expired, revoked or wrong)")
    if status == 403:
        return RuntimeFailed(action=action, detail=f"the kubeconfig's identity may not do this (403 Forbidden): "
                                                   f"{message}")
    return RuntimeFailed(action=action, detail=f"apiserver answered {status}: {message or 'no message'}")


def diagnostic_text(data: bytes) -> str:
    text = data.decode("utf-8", "replace").strip()
    return text if len(text) <= _DIAGNOSTIC_BYTES else "…" + text[-_DIAGNOSTIC_BYTES:]


class ChannelClient(WsApiClient):
    """kubernetes_asyncio's WebSocket client, offering v5 and v4 so the one the apiserver chose is known.

    Its own client sends the protocol as a plain header, after which aiohttp does not report which
    one the server accepted; offering them through ``protocols`` does.
    """

    async def request(self, method: str, url: str, query_params: Any = None, headers: Any = None,
                      post_params: Any = None, body: Any = None, _preload_content: bool = True,
                      _request_timeout: Any = None) -> Any:
        if _preload_content:
            raise RuntimeError("the exec WebSocket is always streamed")
        pairs: list[tuple[str, str]] = []
        for key, value in query_params or []:  # `command` is a list: one parameter per argument
            pairs += [(key, str(v)) for v in value] if isinstance(value, list) else [(key, str(value))]
        headers = {k: v for k, v in (headers or {}).items() if k.lower() != "sec-websocket-protocol"}
        target = url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return self.rest_client.pool_manager.ws_connect(target, params=pairs, headers=headers, protocols=(V5, V4))




def exec_status(payload: bytes) -> dict[str, Any]:
    try:
        value = json.loads(payload or b"{}")
    except ValueError:
        return {"status": "Failure", "message": diagnostic_text(payload)}
    return value if isinstance(value, dict) else {}


def exec_exit_code(status: dict[str, Any] | None, action: str) -> int:
    """The exit code the error channel reports (Success, NonZeroExitCode); anything else is a failure."""
    if status is None:
        raise RuntimeFailed(action=action, detail="the exec stream ended without a status (container gone?)")
    if status.get("status") == "Success":
        return 0
    if status.get("reason") == "NonZeroExitCode":
        for cause in (status.get("details") or {}).get("causes") or []:
            if cause.get("reason") == "ExitCode":
                try:
                    return int(cause.get("message"))
                except (TypeError, ValueError):
                    break
    raise RuntimeFailed(action=action, detail=str(status.get("message") or status.get("reason") or status))

"""The connection to one Docker Engine, and the one edge where its errors become ours.

aiodocker, aiohttp and socket errors are translated in exactly one place, :func:`docker_errors`
(and :func:`registry_errors` for the one place we speak to a registry ourselves); nothing untyped
leaves the backend. aiodocker's public API is used wherever it has one; the streaming endpoints it
has no raw-bytes API for (pull, push, build progress, logs, archives) go through one documented
wrapper, :meth:`Engine.stream`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import aiodocker
import aiohttp
import anyio

from ..errors import BackendTimeout, BackendUnavailable, CommandFailed, EngineRejected, NotFound, RuntimeFailed

__all__ = ("SHORT", "Engine", "docker_errors", "registry_errors")

# One engine request that is not a stream; streams (pull, build, logs, archives) are unbounded.
SHORT = aiohttp.ClientTimeout(total=120)
_UNBOUNDED = aiohttp.ClientTimeout()


@contextmanager
def docker_errors(action: str, *, kind: str = "", ref: str = "") -> Iterator[None]:
    """The one place engine, HTTP and socket errors become ours (`kind`/`ref`: what a 404 means)."""
    try:
        yield
    except aiodocker.DockerError as exc:
        message = str(getattr(exc, "message", exc))
        if exc.status == 404 and kind:
            raise NotFound(kind=kind, ref=ref, action=action) from exc
        if exc.status == 900:  # aiodocker's "cannot connect"
            raise BackendUnavailable(action=action, detail=message) from exc
        raise EngineRejected(action=action, status=exc.status, detail=message) from exc
    except EngineRejected as exc:
        if exc.status == 404 and kind:
            raise NotFound(kind=kind, ref=ref, action=action) from exc
        raise
    except TimeoutError as exc:  # before the connection errors: aiohttp's timeouts subclass both
        raise BackendTimeout(action=action) from exc
    except aiohttp.ClientConnectionError as exc:
        raise BackendUnavailable(action=action, detail=str(exc) or type(exc).__name__) from exc
    except aiohttp.ClientError as exc:  # payload, redirect, URL and response errors
        raise RuntimeFailed(action=action, detail=f"{type(exc).__name__}: {exc}") from exc
    except (anyio.BrokenResourceError, anyio.EndOfStream) as exc:
        raise BackendUnavailable(action=action, detail="the connection to the engine was lost") from exc
    except OSError as exc:
        raise BackendUnavailable(action=action, detail=exc.strerror or str(exc)) from exc


@contextmanager
def registry_errors(action: str, registry: str) -> Iterator[None]:
    """The same edge for the one place we speak to a registry ourselves (image.id, _digests.py)."""
    try:
        yield
    except TimeoutError as exc:
        raise RuntimeFailed(action=action, detail=f"registry {registry} did not answer in time") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise RuntimeFailed(action=action, detail=f"registry {registry}: {type(exc).__name__}: {exc}") from exc


class Engine:
    """One engine socket: aiodocker's client (opened by :meth:`open`, closed by :meth:`aclose`) and the
    raw streams it has no public API for."""

    def __init__(self, url: str) -> None:
        if not url.startswith("unix://"):
            raise ValueError(f"docker.url must be a unix:// socket, got {url!r}")
        self.url = url
        self.socket_path = url[len("unix://"):]
        self._docker: aiodocker.Docker | None = None

    def open(self) -> None:
        self._docker = aiodocker.Docker(url=self.url, api_version="v1.41", timeout=SHORT)

    async def aclose(self) -> None:
        docker, self._docker = self._docker, None
        if docker is not None:
            with anyio.CancelScope(shield=True):
                await docker.close()

    @property
    def docker(self) -> aiodocker.Docker:
        if self._docker is None:
            raise anyio.ClosedResourceError
        return self._docker

    async def info(self, action: str) -> dict[str, Any]:
        """The engine's ``/info`` (image store, CDI spec directories, runtimes, insecure registries)."""
        with docker_errors(action):
            return dict(await self.docker.system.info())

    @asynccontextmanager
    async def stream(self, path: str, *, method: str = "GET", params: dict[str, str] | None = None,
                     headers: dict[str, str] | None = None, data: Any = None
                     ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A raw, unbounded engine response whose connection is always closed on exit.

        aiodocker has no public API that streams raw bytes (its logs API decodes text, its
        archive API buffers the whole tar, its pull/push/build APIs hide errors sent inside
        a 200 stream), so these endpoints use its request method ``_query`` here, and only
        here. aiodocker leaves finalisation to the caller; closing is what tells the engine a
        cancelled client is gone (it then cancels the pull or build it was running).
        `path` must already be quoted (engine ids and validated names only).
        """
        async with self.docker._query(path, method=method, params=params, headers=headers, data=data,
                                      timeout=_UNBOUNDED) as response:
            try:
                yield response
            finally:
                response.close()

    # --- streaming JSON progress (pull, push, build) --------------------------------

    async def progress(self, action: str, path: str, *, params: dict[str, str],
                       headers: dict[str, str], data: Any = None, kind: str = "", ref: str = "") -> None:
        """Consume a progress stream; an error inside a 200 stream is a failure."""
        with docker_errors(action, kind=kind, ref=ref):
            async with self.stream(path, method="POST", params=params, headers=headers, data=data) as response:
                async for event in _json_lines(response.content):
                    if error := event.get("error") or (event.get("errorDetail") or {}).get("message"):
                        if action == "image-build":  # its message can echo the build's steps and their output
                            raise CommandFailed(action=action, status="", output=str(error))
                        raise RuntimeFailed(action=action, detail=str(error))


async def _json_lines(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    decoder = json.JSONDecoder()
    buffer = ""
    async for chunk in content.iter_any():
        buffer += chunk.decode("utf-8", "replace")
        while True:
            buffer = buffer.lstrip()
            if not buffer:
                break
            try:
                event, end = decoder.raw_decode(buffer)
            except ValueError:
                break
            buffer = buffer[end:]
            if isinstance(event, dict):
                yield event

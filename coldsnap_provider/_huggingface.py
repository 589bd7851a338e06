"""`huggingface-publish` and `huggingface-resolve` with the official `huggingface_hub` client.

Credentials stay with the manager: the token is read from ``[huggingface] token_file`` on every
call (so it can be rotated), handed only to the client object of that call, and never logged,
put in an environment or given to a child. The blocking client runs in a worker thread under a
bound; on cancellation the thread is abandoned: a publish's payload file is closed under it (its
next read fails), and any call ends at the next network timeout (:func:`configure_client_timeouts`).

The payload ``source`` is a host-local path named by the manager while the daemon runs as root,
so it is opened with ``exec.user``'s identity: a child started through ``setpriv --reuid --regid
--clear-groups`` with no capability (``_exec.as_identity``) opens it (``O_NOFOLLOW``, regular files
only) and passes the open descriptor back over ``SCM_RIGHTS``. The kernel checks the path with that
identity; the daemon only reads the descriptor it was given.

``image`` (the capsule image the reference runs its helper in) is validated as an image reference
by the envelope and otherwise unused: this daemon runs the client itself, so no container is made.

Errors: every failure is a :class:`~coldsnap_runtime.errors.RuntimeFailed` (``runtime_failed``)
whose text names the repository, the revision and the cause, translated in :func:`_hub_errors`.
"""

from __future__ import annotations

import errno
import io
import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import anyio
import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from coldsnap_runtime.errors import RuntimeFailed

from ._envelope import HuggingfacePublish, HuggingfaceResolve
from ._exec import ExecIdentity, as_identity

__all__ = ("HuggingfaceClient", "configure_client_timeouts")

_T = TypeVar("_T")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TOKEN_LIMIT = 4096
_OPEN_TIMEOUT_S = 30.0
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

# Runs as exec.user (stdlib only, isolated): open argv[1] without following a final symlink,
# refuse anything but a regular file, and send the descriptor over the socket on fd 0.
_OPENER = """
import os, socket, stat, sys
s = socket.socket(fileno=0)
try:
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
except OSError as e:
    sys.stderr.write(str(e.errno))
    sys.exit(3)
if not stat.S_ISREG(os.fstat(fd).st_mode):
    sys.stderr.write("not-regular")
    sys.exit(4)
socket.send_fds(s, [b"fd"], [fd])
"""


def configure_client_timeouts(seconds: float) -> None:
    """Give `huggingface_hub`'s shared HTTP client a network timeout (connect, each read and write) for
    the calls that take no `timeout=` (the commit, preupload, LFS transfers); the library's default is
    none, which would let a silent peer hold a worker thread forever.

    This sets the library's process-wide client factory (its documented hook); call it once at start-up.
    """
    from huggingface_hub import set_client_factory

    def factory() -> httpx2.Client:  # as the library's default (redirects followed), plus the timeout
        return httpx2.Client(follow_redirects=True, timeout=httpx2.Timeout(seconds))

    set_client_factory(factory)


class HuggingfaceClient:
    """Publishes and resolves with the manager's Hub credentials; one per daemon."""

    def __init__(
        self,
        *,
        endpoint: str,
        token_file: str,
        identity: ExecIdentity,
        request_timeout_s: float,
        operation_timeout_s: float,
        max_concurrent: int = 4,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.token_file = token_file
        self.identity = identity
        self.request_timeout_s = request_timeout_s
        self.operation_timeout_s = operation_timeout_s
        self._limiter = anyio.CapacityLimiter(max_concurrent)

    async def publish(self, request: HuggingfacePublish) -> None:
        """Upload `source` (opened as exec.user) to `repository`@`revision` at `destination`;
        a missing branch is created from the default branch first, like `hf upload --revision`."""
        action = "huggingface-publish"
        where = f"{request.repository}@{request.revision}"
        fd = await open_as(request.source, self.identity, action=action)
        fileobj = io.BufferedReader(io.FileIO(fd, "rb", closefd=True))

        def work(token: str) -> None:
            api = HfApi(endpoint=self.endpoint, token=token, library_name="coldsnap-provider")
            with fileobj:
                try:
                    api.repo_info(request.repository, revision=request.revision, repo_type="model",
                                  timeout=self.request_timeout_s)
                except RevisionNotFoundError:
                    api.create_branch(request.repository, branch=request.revision, repo_type="model",
                                      exist_ok=True)
                api.upload_file(path_or_fileobj=fileobj, path_in_repo=request.destination,
                                repo_id=request.repository, repo_type="model", revision=request.revision,
                                commit_message=f"coldsnap: publish {request.destination}")

        try:
            await self._in_thread(work, action=action, where=where)
        except BaseException:
            # Cancelled or failed: closing is safe from either thread (the buffer's lock waits out a
            # read in progress, and a closed FileIO never touches its old descriptor number again),
            # and an abandoned upload then fails at its next read instead of running on.
            fileobj.close()
            raise

    async def resolve(self, request: HuggingfaceResolve) -> str:
        """The 40-hex commit `revision` names now (validated: the Hub's answer is not trusted blindly)."""
        action = "huggingface-resolve"
        where = f"{request.repository}@{request.revision}"

        def work(token: str) -> str:
            api = HfApi(endpoint=self.endpoint, token=token, library_name="coldsnap-provider")
            sha = api.model_info(request.repository, revision=request.revision,
                                 timeout=self.request_timeout_s).sha
            return sha if isinstance(sha, str) else ""

        sha = await self._in_thread(work, action=action, where=where)
        if not _COMMIT.fullmatch(sha):
            raise RuntimeFailed(action=action, detail=(
                f"{where}: the Hub at {self.endpoint} answered no commit id "
                f"(expected 40 lowercase hex digits, got {sha[:80]!r})"))
        return sha

    async def _in_thread(self, work: Callable[[str], _T], *, action: str, where: str) -> _T:
        def run() -> _T:
            token = _read_token(self.token_file, action=action)
            with _hub_errors(action, where=where, endpoint=self.endpoint, token=token):
                return work(token)

        with anyio.fail_after(self.operation_timeout_s) as scope:
            try:
                return await anyio.to_thread.run_sync(run, abandon_on_cancel=True, limiter=self._limiter)
            except TimeoutError:
                if scope.cancelled_caught:
                    raise RuntimeFailed(action=action, detail=(
                        f"{where}: no answer from the Hub at {self.endpoint} within "
                        f"{self.operation_timeout_s:g} s")) from None
                raise
        raise AssertionError("unreachable")  # pragma: no cover - fail_after raises on expiry


def _read_token(path: str, *, action: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(_TOKEN_LIMIT + 1)
    except OSError as exc:
        raise RuntimeFailed(action=action, detail=(
            f"cannot read the Hugging Face token file {path}: {exc.strerror or exc}")) from exc
    token = data.decode("utf-8", "replace").strip()
    if not token or len(data) > _TOKEN_LIMIT or any(c.isspace() for c in token):
        raise RuntimeFailed(action=action, detail=(
            f"the Hugging Face token file {path} must hold one token (non-empty, one line)"))
    return token


@contextmanager
def _hub_errors(action: str, *, where: str, endpoint: str, token: str) -> Iterator[None]:
    """The one place `huggingface_hub`/`httpx2` errors become ours; the token never reaches the text."""

    def failed(detail: str) -> RuntimeFailed:
        return RuntimeFailed(action=action, detail=f"{where}: {detail}".replace(token, "<token>"))

    try:
        yield
    except RevisionNotFoundError as exc:
        raise failed(f"revision not found on the Hub at {endpoint} (HTTP {_status(exc)})") from exc
    except RepositoryNotFoundError as exc:
        raise failed(f"repository not found on the Hub at {endpoint}, or not visible with the configured "
                     f"token (HTTP {_status(exc)})") from exc
    except HfHubHTTPError as exc:  # before OSError: it subclasses it
        status = _status(exc)
        server = f": {exc.server_message.strip()}" if exc.server_message else ""
        if status == 401:
            raise failed(f"authentication refused by the Hub at {endpoint} (HTTP 401{server}); "
                         "check [huggingface] token_file") from exc
        if status == 403:
            raise failed(f"permission denied by the Hub at {endpoint} (HTTP 403{server}); "
                         "the configured token may not write there") from exc
        raise failed(f"the Hub at {endpoint} answered HTTP {status}{server}") from exc
    except httpx2.TimeoutException as exc:
        raise failed(f"network timeout talking to the Hub at {endpoint} ({type(exc).__name__})") from exc
    except (httpx2.TransportError, OSError) as exc:
        raise failed(f"network failure talking to the Hub at {endpoint} ({type(exc).__name__}: {exc})") from exc
    except RuntimeError as exc:  # the client wraps LFS transfer failures in RuntimeError
        cause = exc.__cause__ or exc
        raise failed(f"upload to the Hub at {endpoint} failed ({type(cause).__name__}: {cause})") from exc
    except ValueError as exc:  # malformed answers from the server
        raise failed(f"unexpected answer from the Hub at {endpoint}: {exc}") from exc


def _status(exc: HfHubHTTPError) -> int:
    return int(exc.response.status_code)


async def open_as(path: str, identity: ExecIdentity, *, action: str) -> int:
    """A read-only descriptor for the regular file `path`, opened with `identity`'s permissions
    (directly when that is the daemon's own identity) and never through a final symlink."""
    if identity.uid is None or identity.uid == os.geteuid():
        fd = await anyio.to_thread.run_sync(_open_here, path, action)
    else:
        fd = await _open_in_child(path, identity, action=action)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # the child checked; check what we were actually given
            raise RuntimeFailed(action=action, detail=f"source {path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_here(path: str, action: str) -> int:
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _open_failed(path, exc.errno, action) from exc
    return fd


def _open_failed(path: str, code: int | None, action: str) -> RuntimeFailed:
    if code == errno.ELOOP:
        reason = "is a symbolic link (refused)"
    elif code is not None:
        reason = f"cannot be opened: {os.strerror(code)}"
    else:
        reason = "cannot be opened"
    return RuntimeFailed(action=action, detail=f"source {path} {reason}")


async def _open_in_child(path: str, identity: ExecIdentity, *, action: str) -> int:
    argv = as_identity([sys.executable, "-I", "-S", "-c", _OPENER, path], identity)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    with ours:
        with theirs:
            process = await anyio.open_process(argv, stdin=theirs.fileno(), stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, env={"PATH": os.defpath})
        async with process:
            ours.setblocking(False)
            try:
                with anyio.fail_after(_OPEN_TIMEOUT_S):
                    await anyio.wait_readable(ours)
                    _, fds, _, _ = socket.recv_fds(ours, 16, 1)
                    assert process.stderr is not None
                    err = b"".join([chunk async for chunk in process.stderr])
                    code = await process.wait()
            except BaseException as exc:
                for fd in fds:
                    os.close(fd)
                with anyio.CancelScope(shield=True):
                    try:
                        process.kill()
                    except ProcessLookupError:
                        pass  # already gone
                    await process.wait()
                if isinstance(exc, TimeoutError):
                    raise RuntimeFailed(action=action, detail=(
                        f"opening source {path} took over {_OPEN_TIMEOUT_S:g} s")) from exc
                raise
    if code == 0 and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    text = err.decode("ascii", "replace").strip()
    if code == 3 and text.isdigit():
        raise _open_failed(path, int(text), action)
    if code == 4:
        raise RuntimeFailed(action=action, detail=f"source {path} is not a regular file")
    raise RuntimeFailed(action=action, detail=f"opening source {path} as uid {identity.uid} failed "
                                              f"(exit {code}: {text[:200]})")

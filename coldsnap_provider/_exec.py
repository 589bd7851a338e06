"""`exec` and `upload`: exact argv on this node, no shell, as the configured account."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog

from coldsnap_runtime.errors import OutputTooLarge, RequestRejected

__all__ = ("ExecIdentity", "ExecResult", "resolve_identity", "run_argv")

log = structlog.get_logger(__name__)

# Base64 grows 4/3 and the reply is capped at 64 MiB: keep raw output well below.
OUTPUT_LIMIT = 46 << 20
_KILL_GRACE_S = 5.0
SETPRIV = "setpriv"  # util-linux


@dataclass(frozen=True, slots=True)
class ExecIdentity:
    """Whom to run as; None fields mean 'the daemon's own'."""

    uid: int | None = None
    gid: int | None = None
    home: str | None = None


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes


def resolve_identity(spec: str) -> ExecIdentity:
    """'' | 'name' | 'uid' | 'uid:gid' | 'name:gid' -> ExecIdentity (config-time, fail fast)."""
    if not spec:
        return ExecIdentity()
    user, _, group = spec.partition(":")
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        uid, gid, home = entry.pw_uid, entry.pw_gid, entry.pw_dir
    except KeyError:
        if not user.isdigit():
            raise ValueError(f"exec.user: no such user {user!r}") from None
        uid, gid, home = int(user), int(user), None
    if group:
        if not group.isdigit():
            raise ValueError(f"exec.user: group must be numeric in 'uid:gid', got {group!r}")
        gid = int(group)
    if uid != os.geteuid() and shutil.which(SETPRIV) is None:
        raise ValueError("exec.user needs setpriv (util-linux) on PATH to run commands as another user")
    return ExecIdentity(uid=uid, gid=gid, home=home)


async def run_argv(
    argv: list[str],
    *,
    stdin: bytes = b"",
    combined: bool = False,
    identity: ExecIdentity = ExecIdentity(),
) -> ExecResult:
    """Run exactly `argv`; a missing or unrunnable program is exit 127/126 like a shell would report."""
    if any("\x00" in a for a in argv):
        raise RequestRejected("exec arguments must not contain NUL")
    kwargs: dict[str, object] = {}
    if identity.uid is not None and identity.uid != os.geteuid():
        # setpriv keeps the argv exact; uvloop's subprocess_exec has no user=/group= and anyio no preexec_fn.
        gid = identity.gid if identity.gid is not None else identity.uid
        argv = [SETPRIV, f"--reuid={identity.uid}", f"--regid={gid}", "--clear-groups", "--", *argv]
        if identity.home:
            kwargs["env"] = dict(os.environ, HOME=identity.home)
    try:
        process = await anyio.open_process(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if combined else subprocess.PIPE,
            start_new_session=True,  # so cancellation can take the whole process group
            **kwargs,  # type: ignore[arg-type]
        )
    except FileNotFoundError:
        return ExecResult(127, b"", f"coldsnap-provider: {argv[0]}: No such file or directory\n".encode())
    except PermissionError:
        return ExecResult(126, b"", f"coldsnap-provider: {argv[0]}: Permission denied\n".encode())
    async with process:
        try:
            return await _collect(process, stdin)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _kill_group(process)
            raise


async def _collect(process: anyio.abc.Process, stdin: bytes) -> ExecResult:
    outputs: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}

    async def drain(name: str, stream: anyio.abc.ByteReceiveStream) -> None:
        buf = outputs[name]
        async for chunk in stream:
            buf += chunk
            if len(outputs["stdout"]) + len(outputs["stderr"]) > OUTPUT_LIMIT:
                raise OutputTooLarge(action="exec", limit=OUTPUT_LIMIT)

    async def feed(stream: anyio.abc.ByteSendStream) -> None:
        try:
            await stream.send(stdin)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the program stopped reading; that is its business
        finally:
            await stream.aclose()

    async with anyio.create_task_group() as tg:
        if process.stdin is not None:
            tg.start_soon(feed, process.stdin)
        if process.stdout is not None:
            tg.start_soon(drain, "stdout", process.stdout)
        if process.stderr is not None:
            tg.start_soon(drain, "stderr", process.stderr)
    code = await process.wait()
    return ExecResult(code if code >= 0 else 128 - code, bytes(outputs["stdout"]), bytes(outputs["stderr"]))


async def _kill_group(process: anyio.abc.Process) -> None:
    """SIGTERM the group, wait briefly, then SIGKILL; always reap."""
    _signal_group(process.pid, signal.SIGTERM)
    with anyio.move_on_after(_KILL_GRACE_S):
        await process.wait()
        return
    log.warning("exec process ignored SIGTERM; killing it", pid=process.pid)
    _signal_group(process.pid, signal.SIGKILL)
    await process.wait()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass

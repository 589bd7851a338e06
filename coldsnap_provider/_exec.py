"""`exec` and `upload`: exact argv on this node, no shell, as the configured account."""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import structlog

from coldsnap_runtime.backend import read_capabilities
from coldsnap_runtime.errors import RequestRejected, RuntimeFailed

from ._output import check_argv, collect_output, exit_code

__all__ = (
    "ExecIdentity",
    "ExecResult",
    "GroupLedger",
    "as_identity",
    "child_environment",
    "resolve_identity",
    "run_argv",
)

log = structlog.get_logger(__name__)

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
    """'' | 'name' | 'uid' | 'uid:gid' | 'name:gid' -> ExecIdentity (config-time, fail fast).

    Also checks that this process can drop to it with nothing of its own privilege (:func:`as_identity`)."""
    identity = _parse_identity(spec)
    target = identity.uid if identity.uid is not None else os.geteuid()
    if not (target == 0 and os.geteuid() == 0) and shutil.which(SETPRIV) is None:
        raise ValueError("exec.user: programs run for managers need setpriv (util-linux) on PATH "
                         "to give up the daemon's identity and capabilities")
    caps = read_capabilities()
    if not caps.can_clear_bounding:
        raise ValueError(f"exec.user: the daemon holds capabilities (permitted {caps.permitted:#x}) but not "
                         "CAP_SETPCAP, so it cannot clear the bounding set of the programs it runs for managers; "
                         "grant CAP_SETPCAP (the shipped systemd unit does) or run it as root")
    return identity


def _parse_identity(spec: str) -> ExecIdentity:
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
    return ExecIdentity(uid=uid, gid=gid, home=home)


def as_identity(argv: list[str], identity: ExecIdentity) -> list[str]:
    """`argv` run as `identity` (real, effective and saved uid/gid, no supplementary groups), or as
    the daemon's own uid for an empty one, holding no capability either way: the one privilege drop
    of this package (exec, upload, copies, host probes, the Hub opener, the remote upload's tar).

    The kernel clears capabilities on setresuid only when leaving uid 0, so a daemon that holds
    them as a non-root account (the systemd unit's AmbientCapabilities) must clear them itself:
    setpriv empties the inheritable, ambient and bounding sets (the last needs CAP_SETPCAP:
    :func:`resolve_identity` checks it) and sets no_new_privs; the execve that follows then leaves
    permitted and effective empty. Only root running as root (exec.user root or empty under a root
    daemon) is left as it is. setpriv keeps the argv exact; uvloop's subprocess_exec has no
    user=/group= and anyio no preexec_fn. The runtime side keeps the same rules in
    ``coldsnap_runtime/backend/_privileges.py``."""
    uid = identity.uid if identity.uid is not None else os.geteuid()
    if uid == 0 and os.geteuid() == 0:
        return argv
    drop = [SETPRIV]
    if uid != os.geteuid():
        gid = identity.gid if identity.gid is not None else uid
        drop += [f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    return [*drop, "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", *argv]


# What a program run for a manager inherits: never the daemon's own environment (credentials).
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


def child_environment(identity: ExecIdentity) -> dict[str, str]:
    env = {key: os.environ[key] for key in _KEPT_ENV if key in os.environ}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    home = identity.home if identity.uid is not None else os.environ.get("HOME")
    if home:
        env["HOME"] = home
    return env


async def run_argv(
    argv: list[str],
    *,
    stdin: bytes = b"",
    combined: bool = False,
    identity: ExecIdentity = ExecIdentity(),
    groups: GroupLedger | None = None,
) -> ExecResult:
    """Run exactly `argv`; a missing or unrunnable program is exit 127/126 like a shell would report.

    The program runs in its own process group, recorded in `groups` while it runs, so that a
    daemon that was killed can finish it off at its next start."""
    check_argv(argv)
    argv = as_identity(argv, identity)
    try:
        process = await anyio.open_process(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if combined else subprocess.PIPE,
            start_new_session=True,  # so cancellation can take the whole process group
            env=child_environment(identity),
        )
    except FileNotFoundError:
        return ExecResult(127, b"", f"coldsnap-provider: {argv[0]}: No such file or directory\n".encode())
    except PermissionError:
        return ExecResult(126, b"", f"coldsnap-provider: {argv[0]}: Permission denied\n".encode())
    except OSError as exc:
        if exc.errno == errno.E2BIG:
            raise RequestRejected("exec arguments exceed the kernel's limit on argument size (E2BIG)") from exc
        raise RuntimeFailed(action="exec", detail=f"cannot start {argv[0]}: {exc.strerror}") from exc
    async with process:
        uid = identity.uid if identity.uid is not None else os.geteuid()
        record = groups.add(process.pid, uid=uid) if groups is not None else None
        try:
            return await _collect(process, stdin)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _kill_group(process)
            raise
        finally:
            if record is not None:
                record.unlink(missing_ok=True)


async def _collect(process: anyio.abc.Process, stdin: bytes) -> ExecResult:
    async def feed() -> None:
        assert process.stdin is not None
        try:
            await process.stdin.send(stdin)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the program stopped reading; that is its business
        finally:
            await process.stdin.aclose()

    streams = [stream for stream in (process.stdout, process.stderr) if stream is not None]
    outputs = await collect_output(streams, feed if process.stdin is not None else None)
    code = await process.wait()
    stdout, stderr = outputs[0], outputs[1] if len(outputs) > 1 else b""
    return ExecResult(exit_code(code), stdout, stderr)


async def _kill_group(process: anyio.abc.Process) -> None:
    """SIGTERM the group; SIGKILL whatever of it is left after the grace (children included); reap."""
    pgid = process.pid
    _signal_group(pgid, signal.SIGTERM)
    with anyio.move_on_after(_KILL_GRACE_S):
        await process.wait()
        while _group_alive(pgid):
            await anyio.sleep(0.05)
        return
    log.warning("exec process group ignored SIGTERM; killing it", pid=pgid)
    _signal_group(pgid, signal.SIGKILL)
    await process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class GroupLedger:
    """Process groups started for managers, one file each, so a restarted daemon can end them.

    A record holds the boot, the group leader's start time (clock ticks since boot) and uid:
    pids are reused, so only processes of that group *and* session (we start each in a new
    session), started no earlier than its leader and running as the same uid, are ours."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def prepare(self) -> None:
        self.directory.mkdir(mode=0o700, exist_ok=True)

    def add(self, pgid: int, *, uid: int) -> Path:
        path = self.directory / str(pgid)
        path.write_text(f"{_boot_id()} {_start_time(pgid)} {uid}\n")
        return path

    def sweep(self) -> int:
        """SIGKILL what is left of every recorded group; returns how many processes were killed."""
        killed = 0
        boot = _boot_id()
        for path in self.directory.iterdir():
            try:
                recorded_boot, started, uid = path.read_text().split()
                pgid = int(path.name)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)
                continue
            if recorded_boot == boot:
                for pid in _members(pgid, since=int(started), uid=int(uid)):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
            path.unlink(missing_ok=True)
        if killed:
            log.warning("killed processes left by a previous daemon", killed=killed)
        return killed


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def _stat(pid: int) -> list[str] | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()  # fields from the 3rd on; comm may hold spaces


def _start_time(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[19]) if fields else 0


def _owner(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _members(pgid: int, *, since: int, uid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if (fields is not None and int(fields[2]) == pgid and int(fields[3]) == pgid
                and int(fields[19]) >= since and _owner(int(entry)) == uid):
            members.append(int(entry))
    return members

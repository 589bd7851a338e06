"""`exec` on a remote node: the exact argv through the remote login shell, killable from a second channel.

Each argument is ``shlex``-quoted; a small prelude reports the process's pid and start time on stderr
first, so a cancelled or failed exec can kill the remote process group from a second channel, or, when
the link is down, once it is back (:meth:`RemoteExec.run_pending_kills`, called on every reconnect).
"""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator

import anyio
import asyncssh
import structlog

from ._exec import ExecResult
from ._output import check_argv, collect_output, exit_code, signal_number
from ._remote_link import RemoteLink, RemoteUnavailable

__all__ = ("RemoteExec", "remote_command")

log = structlog.get_logger(__name__)

_KILL_BUDGET_S = 20.0
_MARKER = b"coldsnap-exec "
_MAX_MARKER = 256
# Prints "coldsnap-exec <pid> <start time in ticks>" on stderr, then becomes the program. sshd made the shell
# a session (and process group) leader, so the program and its children share that group.
_PRELUDE = (
    "printf 'coldsnap-exec %s %s\\n' \"$$\" \"$(sed 's/.*) //' /proc/$$/stat 2>/dev/null | cut -d' ' -f20)\" >&2;"
)
# Kills process group PID if its leader is still the process that started at START (pid reuse is not us).
_KILL = (
    "p={pid}; s={start}; t=$(sed 's/.*) //' /proc/$p/stat 2>/dev/null | cut -d' ' -f20);"
    " [ -n \"$t\" ] && [ \"$t\" = \"$s\" ] || exit 3;"
    " kill -TERM -- -$p 2>/dev/null; i=0;"
    " while [ $i -lt 50 ] && kill -0 -- -$p 2>/dev/null; do sleep 0.1; i=$((i+1)); done;"
    " kill -KILL -- -$p 2>/dev/null; exit 0"
)


def remote_command(argv: list[str], *, combined: bool) -> str:
    """The shell command line that makes the remote login shell exec exactly `argv`."""
    check_argv(argv)
    # bash's `exec` takes options (so `--` ends them); dash's takes none (and would run a program named `--`).
    words = " ".join(shlex.quote(a) for a in argv)
    return f"{_PRELUDE} exec ${{BASH_VERSION:+--}} {words}" + (" 2>&1" if combined else "")


def _parse_marker(line: bytes) -> list[tuple[int, str]]:
    if not line.startswith(_MARKER):
        return []
    fields = line[len(_MARKER):].decode("ascii", "replace").split(" ")
    if not fields or not fields[0].isdigit():
        return []
    return [(int(fields[0]), fields[1] if len(fields) > 1 and fields[1].isdigit() else "")]


async def _chunks(reader: asyncssh.SSHReader[bytes]) -> AsyncIterator[bytes]:
    while chunk := await reader.read(1 << 16):
        yield chunk


async def _without_marker(chunks: AsyncIterator[bytes], marker: list[tuple[int, str]]) -> AsyncIterator[bytes]:
    """stderr without the prelude's first line, whose (pid, start) goes to `marker`."""
    head = bytearray()
    async for chunk in chunks:
        head.extend(chunk)
        if b"\n" in head or len(head) >= _MAX_MARKER:
            line, sep, rest = bytes(head).partition(b"\n")
            found = _parse_marker(line) if sep else []
            marker.extend(found)
            yield rest if found else bytes(head)
            break
    else:
        if head:  # stderr ended inside its first line: not ours
            yield bytes(head)
        return
    async for chunk in chunks:  # the rest, as it comes
        yield chunk


class RemoteExec:
    """Manager execs on one node, as its SSH user; and the kills of those that were abandoned."""

    def __init__(self, link: RemoteLink) -> None:
        self._link = link
        # (pid, start) of remote exec process groups to kill once the link is back.
        self._pending_kills: set[tuple[int, str]] = set()

    @property
    def pending_kills(self) -> int:
        return len(self._pending_kills)

    async def exec(self, conn: asyncssh.SSHClientConnection, argv: list[str], *, stdin: bytes = b"",
                   combined: bool = False) -> ExecResult:
        """Run exactly `argv` on the node; 127/126 as locally; cancellation kills it there."""
        command = remote_command(argv, combined=combined)
        link = self._link
        marker: list[tuple[int, str]] = []
        try:
            async with link.sessions:  # the channel is released before any kill below needs one
                with link.link_errors("exec"):
                    process = await conn.create_process(command, encoding=None)
                try:
                    with link.link_errors("exec"):
                        stdout, stderr = await self._collect(process, stdin, marker)
                        await process.wait_closed()
                finally:
                    process.close()
            status, signal_name = process.exit_status, process.exit_signal
            if status is None or (status < 0 and signal_name is None):
                raise RemoteUnavailable(host=link.name, action="exec", detail=(
                    "the SSH link dropped before the program finished; it is killed once the link is back"))
        except BaseException:
            if marker:
                with anyio.CancelScope(shield=True):
                    await self._kill(*marker[0])
            raise
        return ExecResult(exit_code(status, signal=signal_number(signal_name[0]) if signal_name else 0),
                          stdout, stderr)

    @staticmethod
    async def _collect(process: asyncssh.SSHClientProcess[bytes], stdin: bytes,
                       marker: list[tuple[int, str]]) -> tuple[bytes, bytes]:
        async def feed() -> None:
            try:
                if stdin:
                    process.stdin.write(stdin)
                    await process.stdin.drain()
                process.stdin.write_eof()
            except (asyncssh.Error, OSError):
                pass  # the program stopped reading (or the link broke, which the readers report)

        out, err = await collect_output(
            [_chunks(process.stdout), _without_marker(_chunks(process.stderr), marker)], feed)
        return out, err

    async def _kill(self, pid: int, start: str) -> None:
        """Kill a remote exec's process group now, or once the link is back."""
        self._pending_kills.add((pid, start))
        with anyio.move_on_after(_KILL_BUDGET_S) as scope:
            try:
                if self._link.connected:
                    await self.run_pending_kills()
            except RemoteUnavailable as exc:
                log.warning("remote exec not killed yet; will retry when the link is back", host=self._link.name,
                            error=str(exc))
        if scope.cancelled_caught:
            log.error("killing a remote exec timed out; will retry", host=self._link.name)

    async def run_pending_kills(self) -> None:
        """End what was abandoned while the link was down (the link must be up)."""
        for pid, start in sorted(self._pending_kills):
            code = await self._link.run_quiet(_KILL.format(pid=pid, start=shlex.quote(start or "")))
            self._pending_kills.discard((pid, start))
            log.info("remote exec killed" if code == 0 else "remote exec already gone", host=self._link.name,
                     pid=pid)

"""What every host kind's `exec` shares, one piece each: the argv rule, the output collector, the exit code.

The collector reads a program's output streams and feeds its stdin at once (a program that fills one pipe
while we wait on another would otherwise stall); every chunk counts against :data:`OUTPUT_LIMIT` for the
call and is charged to the daemon's byte budget (:func:`._framing.charge`), so that many large outputs at
once are refused rather than held.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterable, Callable, Coroutine, Sequence
from typing import Any

import anyio

from coldsnap_runtime import OUTPUT_LIMIT
from coldsnap_runtime.errors import OutputTooLarge, RequestRejected

from ._framing import charge

__all__ = ("check_argv", "collect_output", "exit_code", "signal_number")


def check_argv(argv: Sequence[str]) -> None:
    """Refuse what no host can pass on exactly: a NUL ends a C string (execve and a shell alike)."""
    if any("\x00" in a for a in argv):
        raise RequestRejected("exec arguments must not contain NUL")


def signal_number(name: str) -> int:
    """A signal's number from its name without the SIG prefix (SSH reports names); 0 when unknown."""
    try:
        return int(signal.Signals[f"SIG{name.removeprefix('SIG')}"])
    except KeyError:
        return 0


def exit_code(status: int, *, signal: int = 0) -> int:
    """A shell's `$?`: the status, or 128 + N for a program ended by signal N.

    `status` may also be a negative return code (Python's way of saying "signal -status").
    """
    if signal:
        return 128 + signal
    return status if status >= 0 else 128 - status


async def collect_output(streams: Sequence[AsyncIterable[bytes]],
                         feed: Callable[[], Coroutine[Any, Any, None]] | None = None) -> list[bytes]:
    """Everything each stream yields (in order), while `feed` writes the program's stdin.

    Past the limit or the byte budget the call fails (OutputTooLarge, OverBudget); so does a failing
    stream. The first failure is raised here, in the caller's task, not as a group from the children.
    """
    outputs: list[list[bytes]] = [[] for _ in streams]
    total = 0
    failure: list[Exception] = []

    async def drain(index: int, stream: AsyncIterable[bytes]) -> None:
        nonlocal total
        try:
            async for chunk in stream:
                total += len(chunk)
                if total > OUTPUT_LIMIT:
                    raise OutputTooLarge(action="exec", limit=OUTPUT_LIMIT)
                charge(len(chunk))
                outputs[index].append(chunk)
        except Exception as exc:  # kept, not raised here: it would arrive in an ExceptionGroup
            failure.append(exc)
            tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        if feed is not None:
            tg.start_soon(feed)
        for index, stream in enumerate(streams):
            tg.start_soon(drain, index, stream)
    if failure:
        raise failure[0]
    return [b"".join(chunks) for chunks in outputs]

"""The pieces every host kind's exec shares (#29): one argv rule, one output collector, one exit code."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import pytest

from coldsnap_provider._output import check_argv, collect_output, exit_code, signal_number
from coldsnap_runtime import OUTPUT_LIMIT
from coldsnap_runtime.errors import OutputTooLarge, RequestRejected


@pytest.mark.parametrize(("status", "sig", "code"), [
    pytest.param(0, 0, 0, id="success"),
    pytest.param(3, 0, 3, id="exit-status"),
    pytest.param(-9, 0, 137, id="python-negative-return-code"),
    pytest.param(-1, 15, 143, id="ssh-exit-signal"),
])
def test_exit_code_is_what_a_shell_reports(status: int, sig: int, code: int) -> None:
    assert exit_code(status, signal=sig) == code


def test_signal_number_from_ssh_names() -> None:
    assert signal_number("KILL") == signal.SIGKILL and signal_number("SIGTERM") == signal.SIGTERM
    assert signal_number("NOT-A-SIGNAL") == 0


def test_check_argv_refuses_nul_in_any_argument() -> None:
    check_argv(["echo", ""])
    with pytest.raises(RequestRejected, match="exec arguments must not contain NUL"):
        check_argv(["echo", "a\x00b"])


async def _chunks(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def test_collect_output_keeps_each_stream_and_feeds_stdin() -> None:
    fed: list[bool] = []

    async def feed() -> None:
        fed.append(True)

    assert await collect_output([_chunks(b"a", b"b"), _chunks(b"err")], feed) == [b"ab", b"err"]
    assert fed == [True]


async def test_collect_output_past_the_limit_across_streams_fails_here_not_as_a_group() -> None:
    half = b"x" * (OUTPUT_LIMIT // 2 + 1)
    with pytest.raises(OutputTooLarge):
        await collect_output([_chunks(half), _chunks(half)])

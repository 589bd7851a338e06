"""`coldsnap-provider run`: a ColdSnap controller run inside a session of the local daemon.

The controller is negotiated first (`<program> capabilities` must offer manager-runtime-v1 and
host-provider format 1), then a session is opened over the control socket, the controller runs
with the session's environment and the request on stdin, and the session is closed when it exits.

Task ownership::

    run_controller ─┬─ the controller process (its own process group)
                    └─ signal forwarder: SIGTERM/SIGINT → the group; SIGKILL after 300 s or a second signal
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio

from ._client import call_control
from ._errors import ControllerRefused
from ._output import exit_code

__all__ = ("run_controller",)

# What a controller inherits from `run`'s environment (plus `--keep-env` names and the two provider
# variables): locale, paths, terminal and time zone. Nothing else: credentials (HF_TOKEN, cloud keys,
# DOCKER_*, SSH_AUTH_SOCK, ...) are the manager's, not the controller's (issue 24, finding 9).
_CONTROLLER_ENV = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM",
                             "TMPDIR", "XDG_RUNTIME_DIR", "NO_COLOR"})
_CONTROLLER_CLEANUP_S = 300.0
_SESSION_CLOSE_S = 30.0
_REQUIRED_FEATURE = "manager-runtime-v1"
_CAPABILITIES_OUTPUT_LIMIT = 1 << 20


async def run_controller(command: list[str], *, controller_words: int, request: bytes, labels: dict[str, str],
                         cluster_id: str, state_dir: Path, capabilities_timeout_s: float,
                         keep_env: Sequence[str] = ()) -> int:
    """Run `command` (its first `controller_words` words name the controller) in a fresh session; its exit
    status, or 128 + the signal that ended it. ControllerRefused if the negotiation fails."""
    env = controller_environment(os.environ, keep_env)
    await _negotiate(command[:controller_words], env, capabilities_timeout_s)
    opening: dict[str, Any] = {"operation": "session-open", "request": json.loads(request), "labels": labels}
    if cluster_id:
        opening["cluster_id"] = cluster_id
    opened = await call_control(state_dir, opening)
    session = opened["session"]
    env.update(opened["environment"])
    try:
        async with await anyio.open_process(
            command, stdin=subprocess.PIPE, stdout=None, stderr=None, env=env, start_new_session=True
        ) as process, anyio.create_task_group() as tg:
            tg.start_soon(_forward_signals, process.pid)
            assert process.stdin is not None
            try:
                await process.stdin.send(request)
            except anyio.BrokenResourceError:
                pass  # a controller that does not read its request still runs; its exit status tells
            await process.stdin.aclose()
            code = await process.wait()
            tg.cancel_scope.cancel()
    finally:
        with anyio.move_on_after(_SESSION_CLOSE_S, shield=True):
            await call_control(state_dir, {"operation": "session-close", "session": session})
    return exit_code(code)


def controller_environment(environ: Mapping[str, str], keep: Sequence[str] = ()) -> dict[str, str]:
    """The allow-listed part of `environ` (LC_* included), and the `keep` names the manager asked for."""
    return {k: v for k, v in environ.items() if k in _CONTROLLER_ENV or k.startswith("LC_") or k in keep}


async def _negotiate(program: list[str], env: dict[str, str], bound_s: float) -> None:
    """Run `<program> capabilities` and require `features` to contain manager-runtime-v1 and
    `protocols.host_provider_format == 1`; raise ControllerRefused naming what is missing."""
    argv = [*program, "capabilities"]
    shown = " ".join(argv)
    try:
        with anyio.fail_after(bound_s):
            result = await anyio.run_process(argv, stdin=subprocess.DEVNULL, env=env, check=False,
                                              start_new_session=True)
    except TimeoutError:
        raise ControllerRefused(f"`{shown}` did not answer within {bound_s:g} s") from None
    except OSError as exc:
        raise ControllerRefused(f"cannot run `{shown}`: {exc.strerror or exc}") from exc
    if result.returncode != 0:
        detail = result.stderr.decode("utf-8", "replace").strip()[-500:]
        raise ControllerRefused(f"`{shown}` exited {result.returncode}: {detail}")
    _check_capabilities(shown, result.stdout)


def _check_capabilities(shown: str, stdout: bytes) -> None:
    try:
        if len(stdout) > _CAPABILITIES_OUTPUT_LIMIT:
            raise ValueError(f"more than {_CAPABILITIES_OUTPUT_LIMIT} bytes")
        document = json.loads(stdout)
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ControllerRefused(f"`{shown}` did not print a capabilities object ({exc})") from exc
    missing = []
    features = document.get("features")
    if not isinstance(features, list) or _REQUIRED_FEATURE not in features:
        missing.append(f"features lacks {_REQUIRED_FEATURE!r}")
    protocols = document.get("protocols")
    version = protocols.get("host_provider_format") if isinstance(protocols, dict) else None
    if type(version) is not int or version != 1:
        missing.append(f"protocols.host_provider_format is {json.dumps(version)}, not 1")
    if missing:
        raise ControllerRefused(f"`{shown}`: {'; '.join(missing)}")


async def _forward_signals(pgid: int) -> None:
    """Forward SIGINT/SIGTERM to the controller's group; SIGKILL after 300 s or a second signal."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            _killpg(pgid, sig)
            break
        else:
            return
        with anyio.move_on_after(_CONTROLLER_CLEANUP_S):
            async for _ in signals:
                break
        _killpg(pgid, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is already gone: nothing left to signal

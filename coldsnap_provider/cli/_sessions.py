"""Sessions: open, close (one, several or all of the caller's), list; and `run` a controller inside one."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import click

from .._errors import ClientError, ControllerRefused
from ..client import ControlClient, Session
from ._common import EXIT_FAILED, EXIT_USAGE, AliasGroup, ask, fail, resolve_state_dir, state_dir_option, warn
from ._render import ago, emit, fields_text, output_option, table

__all__ = ("RUN", "SESSION")


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--label {pair!r}: expected KEY=VALUE", EXIT_USAGE)
        labels[key] = value
    return labels


def _request_file(path: str) -> tuple[bytes, Any]:
    try:
        data = Path(path).read_bytes()
        return data, json.loads(data)
    except (OSError, ValueError) as exc:
        fail(f"--request {path}: {exc}", EXIT_USAGE)


@click.group("session", cls=AliasGroup, epilog="""\b
Examples:
  coldsnap-provider session open --session op-1 --host node-a
  coldsnap-provider session ls
  coldsnap-provider session close --all""")
def SESSION() -> None:
    """Open, list and close sessions (one per ColdSnap operation)."""


@SESSION.command("open", epilog="""\b
Examples:
  coldsnap-provider session open --session op-1 --host node-a --label sparkrun.cluster_id=c --cluster-id c
  coldsnap-provider session open --request request.json -o json > session.json""")
@state_dir_option
@click.option("--session", default="", help="session id (the ColdSnap request id)")
@click.option("--host", "hosts", multiple=True, help="authorized host (repeatable)")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="manager label (repeatable)")
@click.option("--cluster-id", default="", help="workload cluster id the manager labels apply to")
@click.option("--request", "request_path", help="ColdSnap request JSON: session = .id, hosts = "
              ".launch.units[*].host")
@output_option
def _open(state_dir: Path | None, session: str, hosts: tuple[str, ...], labels: tuple[str, ...], cluster_id: str,
          request_path: str | None, output: str) -> None:
    """Open a session; print its socket and token (the controller's two environment variables)."""
    request = _request_file(request_path)[1] if request_path else None
    opened = ask(state_dir, lambda client: client.open_session(
        session, hosts=hosts, labels=_labels(labels), cluster_id=cluster_id, request=request))
    emit(output, opened, lambda: fields_text({"session": opened.session, "socket": opened.socket,
                                              "token": opened.token}))


async def _close(client: ControlClient, sessions: Sequence[str], every: bool) -> tuple[list[str], list[str]]:
    """Close each of `sessions` (with `every`: each one the caller may see); (closed, one error line each)."""
    names = [s.session for s in await client.sessions()] if every else list(sessions)
    closed, failed = [], []
    for name in names:
        try:
            await client.close_session(name)
            closed.append(name)
        except ClientError as exc:
            failed.append(f"{name}: {exc}")
    return closed, failed


@SESSION.command("close", epilog="""\b
Examples:
  coldsnap-provider session close op-1
  coldsnap-provider session close op-1 op-2
  coldsnap-provider session close --all        # every session you may see (root: all of them)""")
@state_dir_option
@click.argument("sessions", nargs=-1, metavar="[ID]...")
@click.option("--all", "every", is_flag=True, help="close every session the caller may see")
@output_option
def _close_command(state_dir: Path | None, sessions: tuple[str, ...], every: bool, output: str) -> None:
    """Close sessions: their sockets go and their work is cancelled; exit 1 if one could not be closed."""
    if every == bool(sessions):
        fail("session close: give session IDs or --all, not both or neither", EXIT_USAGE)
    closed, failed = ask(state_dir, lambda client: _close(client, sessions, every))
    emit(output, {"closed": closed, "failed": failed},
         lambda: "\n".join(f"closed {name}" for name in closed) or "no session to close")
    for line in failed:
        warn(f"session close: {line}")
    if failed:
        sys.exit(EXIT_FAILED)


def _sessions_table(sessions: list[Session]) -> str:
    return table(["session", "hosts", "uid", "cluster", "labels", "opened"],
                 [[s.session, ",".join(s.hosts), s.uid, s.cluster_id or "-",
                   ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) or "-", ago(s.created_unix)]
                  for s in sessions])


@SESSION.command("list", epilog="""\b
Examples:
  coldsnap-provider session ls
  coldsnap-provider session list -o json | jq -r '.[].session'""")
@state_dir_option
@output_option
def _list(state_dir: Path | None, output: str) -> None:
    """List the open sessions you may see (alias: ls)."""
    sessions = ask(state_dir, lambda client: client.sessions())
    emit(output, sessions, lambda: _sessions_table(sessions))


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
               epilog="""\b
Examples:
  coldsnap-provider run --request request.json -- coldsnap restore --request-json -
  coldsnap-provider run --request r.json --label sparkrun.cluster_id=c --cluster-id c \\
      --controller-words 2 -- python3 -m coldsnap restore --request-json -""")
@state_dir_option
@click.option("--request", "request_path", required=True, help="ColdSnap request JSON (also fed on stdin)")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="manager label (repeatable)")
@click.option("--cluster-id", default="", help="workload cluster id the manager labels apply to")
@click.option("--controller-words", default=1, metavar="N", show_default=True,
              help="how many leading words of COMMAND name the controller program; `<those words> capabilities` "
                   "is checked first")
@click.option("--capabilities-timeout", default=30.0, metavar="SECONDS", show_default=True,
              help="bound on the controller's `capabilities` answer")
@click.option("--keep-env", multiple=True, metavar="NAME",
              help="also pass environment variable NAME to the controller (repeatable); by default it gets only "
                   "PATH, HOME, USER, LOGNAME, SHELL, LANG, LANGUAGE, LC_*, TZ, TERM, TMPDIR, XDG_RUNTIME_DIR, "
                   "NO_COLOR and the two provider variables")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND...")
def RUN(state_dir: Path | None, request_path: str, labels: tuple[str, ...], cluster_id: str,
        controller_words: int, capabilities_timeout: float, keep_env: tuple[str, ...],
        command: tuple[str, ...]) -> None:
    """Run a controller command inside a session opened for its request, closed when it exits; exit with its
    status."""
    words = list(command[1:] if command[:1] == ("--",) else command)
    if not words:
        fail("run: give the controller command after --", EXIT_USAGE)
    request, _ = _request_file(request_path)
    parsed = _labels(labels)
    if not 1 <= controller_words <= len(words):
        fail(f"run: --controller-words must be between 1 and {len(words)}", EXIT_USAGE)
    from .._runner import run_controller

    try:
        code = anyio.run(lambda: run_controller(
            words, controller_words=controller_words, request=request, labels=parsed, cluster_id=cluster_id,
            state_dir=resolve_state_dir(state_dir), capabilities_timeout_s=capabilities_timeout,
            keep_env=keep_env))
    except ControllerRefused as exc:
        fail(f"run: refusing the controller: {exc}", EXIT_USAGE)
    except (ClientError, OSError) as exc:
        fail(str(exc))
    sys.exit(code)

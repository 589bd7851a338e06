"""The workloads the caller's sessions ran, after the operation: ls, inspect, logs [--follow], stop, rm."""

from __future__ import annotations

import base64
import json
import signal
import sys
from pathlib import Path

import click

from ..client import ControlClient, Workload
from ._common import AliasGroup, ask, state_dir_option
from ._render import emit, fields_text, output_option, table, when

__all__ = ("WORKLOAD",)

_HOST_HELP = "a Kubernetes host this daemon serves ([[kubernetes]]); default: this node's engine"


def _host(function: click.decorators.FC) -> click.decorators.FC:
    return click.option("--host", default="", help=_HOST_HELP)(function)


@click.group("workload", cls=AliasGroup, epilog="""\b
Examples:
  coldsnap-provider workload ls
  coldsnap-provider workload logs --follow hello
  coldsnap-provider workload rm hello""")
def WORKLOAD() -> None:
    """The managed workloads your sessions ran (root and the daemon's account: all of them)."""


def _state(w: Workload) -> str:
    if w.running or w.state != "exited":
        return w.state + (" (paused)" if w.paused else "")
    return f"exited ({w.exit_code})"


@WORKLOAD.command("list", epilog="""\b
Examples:
  coldsnap-provider workload ls
  coldsnap-provider workload ls --host gpu-node-3 -o json | jq -r '.[] | select(.running) | .name'""")
@state_dir_option
@_host
@output_option
def _list(state_dir: Path | None, host: str, output: str) -> None:
    """List them: name, state, image, when started (alias: ls)."""
    listed = ask(state_dir, lambda client: client.workloads(host=host))
    emit(output, listed, lambda: table(
        ["name", "state", "image", "started", "id"],
        [[w.name, _state(w), w.image, when(w.started_at if isinstance(w.started_at, str) else ""), w.id[:12]]
         for w in listed]))


@WORKLOAD.command("inspect", epilog="""\b
Examples:
  coldsnap-provider workload inspect hello
  coldsnap-provider workload inspect hello -o json | jq .exit_code""")
@state_dir_option
@_host
@click.argument("name")
@output_option
def _inspect(state_dir: Path | None, host: str, name: str, output: str) -> None:
    """Its state, exit code, image and labels."""
    info = ask(state_dir, lambda client: client.inspect_workload(name, host=host))
    started = info.started_at if isinstance(info.started_at, str) else ""
    emit(output, info, lambda: fields_text({
        "name": name, "state": _state(info), "running": info.running, "exit_code": info.exit_code,
        "image": info.image, "id": info.id, "started": f"{when(started)} ({started})" if started else "-",
        "labels": ", ".join(f"{k}={v}" for k, v in sorted(info.labels.items()))}))


def _write(data: bytes, raw: bool) -> None:
    if raw:
        sys.stdout.buffer.write(data)
    else:  # text for a terminal: bytes that are not UTF-8 show as U+FFFD instead of reaching it
        sys.stdout.write(data.decode("utf-8", errors="replace"))
    sys.stdout.flush()


async def _follow(client: ControlClient, name: str, host: str, tail: int, output: str, raw: bool) -> None:
    async for chunk in client.follow_logs(name, host=host, tail=tail):
        if output == "json":
            sys.stdout.write(json.dumps({"output": base64.b64encode(chunk).decode()}) + "\n")
            sys.stdout.flush()
        else:
            _write(chunk, raw)


@WORKLOAD.command("logs", epilog="""\b
Examples:
  coldsnap-provider workload logs hello
  coldsnap-provider workload logs --tail 20 --follow hello     # until it ends, or Ctrl-C
  coldsnap-provider workload logs --raw hello > hello.log      # the exact bytes""")
@state_dir_option
@_host
@click.argument("name")
@click.option("--tail", default=0, metavar="N", type=click.IntRange(min=0), help="last N lines (0 = all)")
@click.option("-f", "--follow", is_flag=True, help="keep printing new output until the workload ends (Ctrl-C stops)")
@click.option("--raw", is_flag=True, help="write the exact bytes (default: text, invalid UTF-8 replaced)")
@output_option
def _logs(state_dir: Path | None, host: str, name: str, tail: int, follow: bool, raw: bool, output: str) -> None:
    """Print its output (stdout and stderr, in the engine's order). With -o json: base64 `output`, one object
    per chunk when following."""
    if follow:
        # Ctrl-C is how a follow ends, also when this process was started with SIGINT ignored (a background job
        # of a shell without job control): Python then never raises KeyboardInterrupt.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            ask(state_dir, lambda client: _follow(client, name, host, tail, output, raw))
        except KeyboardInterrupt:
            sys.exit(130)
        return
    data = ask(state_dir, lambda client: client.workload_logs(name, host=host, tail=tail))
    if output == "json":
        emit(output, {"output": data}, str)
    else:
        _write(data, raw)


@WORKLOAD.command("stop", epilog="""\b
Examples:
  coldsnap-provider workload stop hello
  coldsnap-provider workload stop --timeout 60 hello""")
@state_dir_option
@_host
@click.argument("name")
@click.option("--timeout", default=10.0, show_default=True, type=click.FloatRange(0, 3600),
              help="seconds between SIGTERM and SIGKILL")
@output_option
def _stop(state_dir: Path | None, host: str, name: str, timeout: float, output: str) -> None:
    """SIGTERM, then SIGKILL after --timeout; the workload is kept (its logs too)."""
    ask(state_dir, lambda client: client.stop_workload(name, host=host, timeout_s=timeout))
    emit(output, {"name": name, "stopped": True}, lambda: f"stopped {name}")


@WORKLOAD.command("remove", epilog="""\b
Examples:
  coldsnap-provider workload rm hello
  coldsnap-provider workload rm hello other""")
@state_dir_option
@_host
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@output_option
def _remove(state_dir: Path | None, host: str, names: tuple[str, ...], output: str) -> None:
    """Remove your workloads (running ones are killed first); another manager's is "no such workload"
    (alias: rm)."""

    async def remove(client: ControlClient) -> None:
        for name in names:
            await client.remove_workload(name, host=host)

    ask(state_dir, remove)
    emit(output, {"removed": list(names)}, lambda: "\n".join(f"removed {name}" for name in names))

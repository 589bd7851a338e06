"""`call`: one envelope on a session's socket, its reply shown decoded (exec output as text, `--raw` bytes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import click
import msgspec

from .._envelope import Reply
from .._errors import ConfigError, ProtocolError
from ..client import SessionClient
from ._common import EXIT_FAILED, EXIT_USAGE, fail, secret
from ._render import fields_text, output_option

__all__ = ("CALL",)

SOCKET_ENV = "COLDSNAP_HOST_PROVIDER_SOCKET"
TOKEN_ENV = "COLDSNAP_HOST_PROVIDER_TOKEN"  # the two variables a session gives its controller


def _fields(text: str | None) -> dict[str, Any]:
    try:
        fields = json.loads(text) if text else {}
    except ValueError as exc:
        fail(f"JSON-FIELDS: not JSON: {exc}", EXIT_USAGE)
    if not isinstance(fields, dict):
        fail("JSON-FIELDS: must be a JSON object", EXIT_USAGE)
    return fields


def _show(reply: Reply, raw: bool) -> None:
    """The reply for a person: program output as it was written, everything else as `key: value` lines."""
    runtime = reply.runtime if not isinstance(reply.runtime, msgspec.UnsetType) else None
    output = reply.output if isinstance(reply.output, bytes) else None
    if runtime is not None and isinstance(runtime.output, bytes):
        output = runtime.output
    if output is not None:
        if raw:
            sys.stdout.buffer.write(output)
        else:
            sys.stdout.write(output.decode("utf-8", errors="replace"))
    if isinstance(reply.error_output, bytes) and reply.error_output:
        sys.stderr.write(reply.error_output.decode("utf-8", errors="replace"))
    rest = {k: v for k, v in msgspec.to_builtins(reply).items()
            if k not in {"format", "id", "output", "error_output"}}
    if runtime is not None:
        rest["runtime"] = {k: v for k, v in rest["runtime"].items() if k != "output"}
    if not reply.ok:
        sys.stderr.write(f"coldsnap-provider: {reply.error_code or 'refused'}: {reply.error}\n")
    elif output is None or set(rest) - {"ok", "runtime", "exit_code"} or rest.get("runtime"):
        sys.stdout.write(fields_text({k: v for k, v in rest.items() if k != "ok"}) + "\n")
    sys.stdout.flush()


@click.command("call", epilog="""\b
Examples:
  export COLDSNAP_HOST_PROVIDER_SOCKET=... COLDSNAP_HOST_PROVIDER_TOKEN=...   # from `session open`
  coldsnap-provider call --session op-1 capabilities
  coldsnap-provider call --session op-1 exec '{"host":"node-a","arguments":["uname","-sr"]}'
  coldsnap-provider call --session op-1 --token-file ~/.op-1.token -o json exec '{"host":"node-a",...}'
  coldsnap-provider call --session op-1 runtime \\
      '{"host":"node-a","runtime":{"action":"workload-inspect","name":"hello"}}'

\b
The token comes from --token-file (not readable by others), else --token, else $COLDSNAP_HOST_PROVIDER_TOKEN;
prefer the file or the variable: argv is visible to every local user. Exit 1 when the reply is ok:false.""")
@click.option("--socket", envvar=SOCKET_ENV, show_envvar=True, required=True, help="the session's socket")
@click.option("--token", help="the session's token (visible in ps: prefer --token-file or the variable)")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="a file holding the token (mode 0600 or 0640)")
@click.option("--session", required=True, help="the session id")
@click.option("--raw", is_flag=True, help="write program output as its exact bytes (default: UTF-8 text)")
@output_option
@click.argument("operation")
@click.argument("fields", required=False, metavar="[JSON-FIELDS]")
def CALL(socket: str, token: str | None, token_file: Path | None, session: str, raw: bool, output: str,
         operation: str, fields: str | None) -> None:
    """Send one envelope (OPERATION, with JSON-FIELDS merged in) on a session's socket and show the reply."""
    try:
        resolved = secret(token, token_file, TOKEN_ENV, what="token")
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    if not resolved:
        fail(f"call: no token: give --token-file FILE, or set {TOKEN_ENV}", EXIT_USAGE)
    client = SessionClient(socket, resolved, session)
    extra = _fields(fields)
    try:
        reply = anyio.run(lambda: client.call(operation, check=False, **extra))
    except (ProtocolError, OSError) as exc:
        fail(str(exc))
    if output == "json":
        sys.stdout.buffer.write(msgspec.json.encode(reply) + b"\n")
        sys.stdout.flush()
    else:
        _show(reply, raw)
    sys.exit(0 if reply.ok else EXIT_FAILED)

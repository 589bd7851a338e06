"""`coldsnap-provider`: serve, sessions, run a controller, call, status, version, check-config, install-units."""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec

from ._client import call, call_control
from ._config import Config, checked_config, default_state_dir, load_config
from ._config_files import NamedFiles, account_named, file_problems
from ._errors import ConfigError, ControllerRefused, ProtocolError, ReplyError

__all__ = ("main",)

EXIT_USAGE = 2


def _out(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=None, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _err(message: str) -> None:
    sys.stderr.write(f"coldsnap-provider: {message}\n")


def _state_dir(args: argparse.Namespace, config: Config | None = None) -> Path:
    if getattr(args, "state_dir", None):
        return Path(args.state_dir).absolute()
    if env := os.environ.get("COLDSNAP_PROVIDER_STATE_DIR"):
        return Path(env).absolute()
    if config is not None and config.server.state_dir:
        return Path(config.server.state_dir).absolute()
    return default_state_dir()


# --- serve -------------------------------------------------------------------------------


def _checked_config(path: str | None) -> Config | None:
    """The configuration, with what can only be checked at run time (exec.user, the spool) checked too."""
    try:
        return checked_config(path)
    except ConfigError as exc:
        _err(str(exc))
        return None


def cmd_serve(args: argparse.Namespace) -> int:
    from ._logging import configure_logging, set_log_level
    from ._serve import serve, uvloop_available  # the backend's imports: only for serve

    configure_logging(args.log_level)
    if (config := _checked_config(args.config)) is None:
        return EXIT_USAGE
    set_log_level(config.server.log_level or args.log_level)
    refused = False
    try:
        anyio.run(partial(serve, config, _state_dir(args, config), config_path=args.config, log_level=args.log_level),
                  backend="asyncio", backend_options={"use_uvloop": uvloop_available()})
    except* ConfigError as group:  # e.g. the state directory is already served
        for exc in group.exceptions:
            _err(str(exc))
        refused = True
    return EXIT_USAGE if refused else 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """The configuration, and every file it names as the daemon will read it, as the account it runs as."""
    if (config := _checked_config(args.file)) is None:
        return EXIT_USAGE
    try:
        account = account_named(args.as_user)
        problems = file_problems(NamedFiles(
            kubeconfigs=[cluster.kubeconfig for cluster in config.kubernetes],
            ssh=[(remote.identity_file, remote.known_hosts) for remote in config.remote],
            credentials_file=config.registry.credentials_file, token_file=config.huggingface.token_file), account)
    except ConfigError as exc:
        problems = [str(exc)]
    for problem in dict.fromkeys(problems):  # a kubeconfig's problem is found by both checks
        _err(problem)
    if problems:
        return EXIT_USAGE
    _out({"ok": True, "config": msgspec.to_builtins(config)})
    return 0


# --- control-socket clients -------------------------------------------------------------


def _ask(args: argparse.Namespace, request: dict[str, Any]) -> tuple[bool, Any]:
    """(answered, the control socket's result, printed); False with the reason on stderr when it refused or was
    not reached (a result may itself be null)."""
    try:
        result = anyio.run(call_control, _state_dir(args), request)
    except (ReplyError, ProtocolError) as exc:
        _err(str(exc))
        return False, None
    except OSError as exc:
        _err(f"cannot reach the daemon at {_state_dir(args) / 'control.sock'}: {exc.strerror or exc}")
        return False, None
    _out(result)
    return True, result


def _control(args: argparse.Namespace, request: dict[str, Any]) -> int:
    return 0 if _ask(args, request)[0] else 1


def _parse_labels(pairs: Sequence[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {pair!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def _session_open_request(args: argparse.Namespace) -> dict[str, Any]:
    request: dict[str, Any] = {"operation": "session-open", "labels": _parse_labels(args.label)}
    if args.session:
        request["session"] = args.session
    if args.host:
        request["hosts"] = args.host
    if args.cluster_id:
        request["cluster_id"] = args.cluster_id
    if args.request:
        request["request"] = json.loads(Path(args.request).read_bytes())
    return request


def cmd_session_open(args: argparse.Namespace) -> int:
    try:
        request = _session_open_request(args)
    except (ValueError, OSError) as exc:
        _err(str(exc))
        return EXIT_USAGE
    return _control(args, request)


def cmd_session_close(args: argparse.Namespace) -> int:
    return _control(args, {"operation": "session-close", "session": args.id})


def cmd_session_list(args: argparse.Namespace) -> int:
    return _control(args, {"operation": "session-list"})


def cmd_workload(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"operation": f"workload-{args.workload_command}"}
    if args.host:
        request["host"] = args.host
    if args.workload_command != "list":
        request["name"] = args.name
    if args.workload_command == "logs":
        request["tail"] = args.tail
        try:
            result = anyio.run(call_control, _state_dir(args), request)
        except (ReplyError, ProtocolError, OSError) as exc:
            _err(str(exc))
            return 1
        sys.stdout.buffer.write(base64.b64decode(result["output"]))
        sys.stdout.flush()
        return 0
    if args.workload_command == "stop":
        request["timeout_s"] = args.timeout
    return _control(args, request)


def cmd_reload(args: argparse.Namespace) -> int:
    """{"changed": [...], "needs_restart": [...]}; exit 1 with the key and the rule when nothing changed."""
    return _control(args, {"operation": "reload"})


EXIT_UNHEALTHY = 3


def cmd_status(args: argparse.Namespace) -> int:
    """The daemon's status; 0 when every configured backend answers, 3 (each one named on stderr) when one does not,
    1 when the daemon itself cannot be reached."""
    answered, result = _ask(args, {"operation": "status"})
    if not answered:
        return 1
    down = [b for b in result.get("backends", []) if not b.get("up")] if isinstance(result, dict) else []
    for backend in down:
        _err(f"status: the {backend['backend']} backend of host {backend['host']!r} is unreachable: {backend['error']}")
    return EXIT_UNHEALTHY if down else 0


def cmd_call(args: argparse.Namespace) -> int:
    try:
        fields = json.loads(args.fields) if args.fields else {}
        if not isinstance(fields, dict):
            raise ValueError("JSON-FIELDS must be a JSON object")
    except ValueError as exc:
        _err(f"JSON-FIELDS: {exc}")
        return EXIT_USAGE
    request = {"format": 1, "id": str(time.time_ns()), "token": args.token, "session": args.session,
               "operation": args.operation, **fields}
    try:
        reply = anyio.run(lambda: call(args.socket, request, check=False))
    except (ProtocolError, OSError) as exc:
        _err(str(exc))
        return 1
    sys.stdout.buffer.write(msgspec.json.encode(reply) + b"\n")
    return 0 if reply.ok else 1


EXIT_NOT_ADMITTED = 3


async def _probe(args: argparse.Namespace) -> dict[str, Any]:
    from ._probe import ProbeOptions, run_probe

    options = ProbeOptions(driver=args.driver, device=args.device, image=args.image or "",
                           host_process=args.host_process, criu=args.criu or "")
    state_dir = _state_dir(args)
    if args.host_process:
        return await run_probe(options, state_dir=state_dir, backend=None)
    from coldsnap_runtime import DockerBackend

    from ._serve import host_policy

    config = load_config(args.config)
    async with DockerBackend(url=config.docker.url, host_policy=host_policy(config)) as backend:
        return await run_probe(options, state_dir=state_dir, backend=backend)


def cmd_probe(args: argparse.Namespace) -> int:
    """Probe, attach CRIU, admit and cache; 0 admitted, 3 not admitted, 2 usage errors."""
    from coldsnap_probe import ProfileError
    from coldsnap_runtime.errors import ColdsnapError

    if bool(args.image) == bool(args.host_process):
        _err("probe: give exactly one of --image IMAGE or --host-process")
        return EXIT_USAGE
    try:
        outcome = anyio.run(_probe, args, backend="asyncio")
    except (ValueError, ConfigError) as exc:
        _err(f"probe: {exc}")
        return EXIT_USAGE
    except (ProfileError, ColdsnapError, OSError) as exc:
        _err(f"probe failed: {exc}")
        return 1
    if args.json:
        _out(outcome)
    else:
        sys.stdout.write(json.dumps(outcome, indent=2, sort_keys=True) + "\n")
    return 0 if outcome["admitted"] else EXIT_NOT_ADMITTED


def cmd_version(args: argparse.Namespace) -> int:
    from ._packaging import package_version

    _out({"version": package_version()})
    return 0


def cmd_install_units(args: argparse.Namespace) -> int:
    from ._packaging import default_entry_point, install_units

    entry_point = Path(args.exec) if args.exec else default_entry_point()
    try:
        done = install_units(Path(args.prefix).absolute(), entry_point=entry_point, dry_run=args.dry_run)
    except ConfigError as exc:
        _err(f"install-units: {exc}")
        return EXIT_USAGE
    except OSError as exc:
        _err(f"install-units: {exc}")
        return 1
    _out(msgspec.to_builtins(done))
    return 0


# --- run a controller under a session ----------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    if not args.command:
        _err("run: give the controller command after --")
        return EXIT_USAGE
    try:
        request_bytes = Path(args.request).read_bytes()
        json.loads(request_bytes)
    except (OSError, ValueError) as exc:
        _err(f"--request: {exc}")
        return EXIT_USAGE
    try:
        labels = _parse_labels(args.label)
    except ValueError as exc:
        _err(f"run: {exc}")
        return EXIT_USAGE
    if not 1 <= args.controller_words <= len(args.command):
        _err(f"run: --controller-words must be between 1 and {len(args.command)}")
        return EXIT_USAGE
    from ._runner import run_controller

    try:
        return anyio.run(lambda: run_controller(
            args.command, controller_words=args.controller_words, request=request_bytes, labels=labels,
            cluster_id=args.cluster_id, state_dir=_state_dir(args), capabilities_timeout_s=args.capabilities_timeout,
            keep_env=args.keep_env))
    except ControllerRefused as exc:
        _err(f"run: refusing the controller: {exc}")
        return EXIT_USAGE
    except (ReplyError, ProtocolError) as exc:
        _err(str(exc))
        return 1
    except OSError as exc:
        _err(str(exc))
        return 1


# --- argument parsing --------------------------------------------------------------------


def _with_state_dir(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--state-dir", help="daemon state directory (default depends on the user)")
    return parser


def _parser() -> argparse.ArgumentParser:
    from ._packaging import package_version

    parser = argparse.ArgumentParser(prog="coldsnap-provider", description=__doc__)
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command_name", required=True)
    serve = _with_state_dir(sub.add_parser("serve", help="run the daemon"))
    serve.add_argument("--config", help="TOML configuration (default: the embedded one)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)
    _add_session(sub)
    _add_workload(sub)
    _with_state_dir(sub.add_parser(
        "status", help="daemon status; exit 3 when a configured backend does not answer")).set_defaults(func=cmd_status)
    _with_state_dir(sub.add_parser(
        "reload", help="apply the daemon's configuration file again, as SIGHUP does, and print what changed",
    )).set_defaults(func=cmd_reload)
    _add_run(sub)
    _add_call(sub)
    _add_probe(sub)
    sub.add_parser("version", help="print the version").set_defaults(func=cmd_version)
    check = sub.add_parser("check-config", help="validate a configuration file and the files it names")
    check.add_argument("file")
    check.add_argument("--as-user", metavar="USER", default=None,
                       help="check that USER (the account the unit runs as, e.g. coldsnap-provider) can read every "
                            "file the configuration names (default: the current user; another user needs root)")
    check.set_defaults(func=cmd_check_config)
    _add_install_units(sub)
    return parser


def _add_install_units(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    units = sub.add_parser("install-units", help="install the systemd units, sysusers/tmpfiles snippets and docs",
                           description="Copy the packaged units to PREFIX/etc/systemd/system, the sysusers.d and "
                                       "tmpfiles.d snippets to PREFIX/usr/lib, the docs to PREFIX/usr/share/doc/"
                                       "coldsnap-provider and, if absent, the default configuration to PREFIX/etc/"
                                       "coldsnap-provider/config.toml; the unit runs --exec (docs/upgrade.md).")
    units.add_argument("--prefix", default="/", help="root to install under (default /)")
    units.add_argument("--exec", help="the coldsnap-provider program the unit runs "
                                      "(default: this Python environment's script)")
    units.add_argument("--dry-run", action="store_true", help="print what would be written; write nothing")
    units.set_defaults(func=cmd_install_units)


def _add_session(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    session = sub.add_parser("session", help="open, close or list sessions").add_subparsers(
        dest="session_command", required=True)
    opener = _with_state_dir(session.add_parser("open", help="open a session"))
    opener.add_argument("--session", help="session id (the ColdSnap request id)")
    opener.add_argument("--host", action="append", default=[], help="authorized host (repeatable)")
    opener.add_argument("--label", action="append", default=[], help="manager label KEY=VALUE (repeatable)")
    opener.add_argument("--cluster-id", default="", help="workload cluster id the manager labels apply to")
    opener.add_argument("--request", help="ColdSnap request JSON: session = id, hosts = launch.units[*].host")
    opener.set_defaults(func=cmd_session_open)
    closer = _with_state_dir(session.add_parser("close", help="close a session"))
    closer.add_argument("id")
    closer.set_defaults(func=cmd_session_close)
    _with_state_dir(session.add_parser("list", help="list sessions")).set_defaults(func=cmd_session_list)


def _add_workload(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    workload = sub.add_parser("workload", help="the managed workloads your sessions ran: list, inspect, logs, stop")
    verbs = workload.add_subparsers(dest="workload_command", required=True)
    lister = _with_state_dir(verbs.add_parser("list", help="list them"))
    lister.set_defaults(func=cmd_workload)
    host_help = "a Kubernetes host this daemon serves ([[kubernetes]]); default: this node's engine"
    lister.add_argument("--host", default="", help=host_help)
    for verb, text in (("inspect", "state, exit code, labels"), ("logs", "print its logs"),
                       ("stop", "SIGTERM, then SIGKILL after --timeout; the workload is kept")):
        named = _with_state_dir(verbs.add_parser(verb, help=text))
        named.add_argument("name")
        named.add_argument("--host", default="", help=host_help)
        if verb == "logs":
            named.add_argument("--tail", type=int, default=0, help="last N lines (0 = all)")
        if verb == "stop":
            named.add_argument("--timeout", type=float, default=10.0, help="seconds before SIGKILL")
        named.set_defaults(func=cmd_workload)


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = _with_state_dir(sub.add_parser("run", help="run a controller command inside a session"))
    run.add_argument("--request", required=True, help="ColdSnap request JSON (also fed on stdin)")
    run.add_argument("--label", action="append", default=[], help="manager label KEY=VALUE (repeatable)")
    run.add_argument("--cluster-id", default="", help="workload cluster id the manager labels apply to")
    run.add_argument("--controller-words", type=int, default=1, metavar="N",
                     help="how many leading words of COMMAND name the controller program; "
                          "`<those words> capabilities` is checked first (default 1)")
    run.add_argument("--capabilities-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="bound on the controller's `capabilities` answer (default 30)")
    run.add_argument("--keep-env", action="append", default=[], metavar="NAME",
                     help="also pass environment variable NAME to the controller (repeatable); by default it "
                          "gets only PATH, HOME, USER, LOGNAME, SHELL, LANG, LANGUAGE, LC_*, TZ, TERM, TMPDIR, "
                          "XDG_RUNTIME_DIR, NO_COLOR and the two provider variables")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    run.set_defaults(func=cmd_run)


def _add_call(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    caller = sub.add_parser("call", help="send one envelope and print the reply")
    caller.add_argument("--socket", required=True)
    caller.add_argument("--token", required=True)
    caller.add_argument("--session", required=True)
    caller.add_argument("operation")
    caller.add_argument("fields", nargs="?", help="JSON object merged into the envelope")
    caller.set_defaults(func=cmd_call)


def _add_probe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    probe = _with_state_dir(sub.add_parser("probe", help="probe, admit and cache the host feature profile"))
    probe.add_argument("--driver", required=True, choices=["n580", "n610"])
    probe.add_argument("--device", default="0", help="GPU selector (ordinal or UUID)")
    probe.add_argument("--image", help="capsule image to probe in (disposable containers)")
    probe.add_argument("--host-process", action="store_true", help="probe with plain processes on this host")
    probe.add_argument("--criu", help="criu binary (default: the capsule's, or criu on PATH)")
    probe.add_argument("--config", help="TOML configuration (for the Docker endpoint)")
    probe.add_argument("--json", action="store_true", help="one compact JSON line")
    probe.set_defaults(func=cmd_probe)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "command", None) and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    result: int = args.func(args)
    return result

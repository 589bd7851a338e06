"""The daemon's own commands: serve, check-config, status, reload, version, install-units, probe."""

from __future__ import annotations

import gc
import sys
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import click

from .._config import Config, checked_config, load_config
from .._config_files import NamedFiles, account_named, file_problems
from .._errors import ConfigError
from ._common import EXIT_NOT_ADMITTED, EXIT_UNHEALTHY, EXIT_USAGE, ask, fail, resolve_state_dir, state_dir_option, warn
from ._render import emit, fields_text, output_option, table

__all__ = ("DAEMON_COMMANDS",)


def _checked(path: str | None) -> Config:
    """The configuration, with what can only be checked at run time (exec.user, the spool) checked too."""
    try:
        return checked_config(path)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)


@click.command("serve", epilog="""\b
Examples:
  coldsnap-provider serve                                   # embedded defaults, as root
  coldsnap-provider serve --config /etc/coldsnap-provider/config.toml --log-level debug""")
@state_dir_option
@click.option("--config", "config_path", type=click.Path(dir_okay=False, readable=False), help="TOML configuration "
              "(default: the embedded one)")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def _serve(state_dir: Path | None, config_path: str | None, log_level: str) -> None:
    """Run the daemon until SIGTERM (SIGHUP reloads the configuration)."""
    from .._logging import configure_logging, set_log_level
    from .._serve import serve, uvloop_available  # the backend's imports: only for serve

    configure_logging(log_level)
    config = _checked(config_path)
    set_log_level(config.server.log_level or log_level)
    # What is loaded by now (modules, classes, the schema's types) lives as long as the daemon: the collector need
    # not walk it again, and the interpreter's exit skips a full collection of it (0.15 s of a core at each stop).
    gc.freeze()
    refused = False
    try:
        anyio.run(partial(serve, config, resolve_state_dir(state_dir, config), config_path=config_path,
                          log_level=log_level), backend="asyncio", backend_options={"use_uvloop": uvloop_available()})
    except* ConfigError as group:  # e.g. the state directory is already served
        for exc in group.exceptions:
            warn(str(exc))
        refused = True
    sys.exit(EXIT_USAGE if refused else 0)


@click.command("check-config", epilog="""\b
Examples:
  coldsnap-provider check-config /etc/coldsnap-provider/config.toml
  coldsnap-provider check-config config.toml --as-user coldsnap-provider   # as root
  coldsnap-provider check-config config.toml -o json | jq .config.server""")
@click.argument("file", type=click.Path(dir_okay=False, readable=False))
@click.option("--as-user", metavar="USER", help="check that USER (the account the unit runs as) can read every "
              "file the configuration names (default: the current user; another user needs root)")
@output_option
def _check_config(file: str, as_user: str | None, output: str) -> None:
    """Validate a configuration file and every file it names, as the daemon's account will read them."""
    config = _checked(file)
    try:
        account = account_named(as_user)
        problems = file_problems(NamedFiles(
            kubeconfigs=[cluster.kubeconfig for cluster in config.kubernetes],
            ssh=[(remote.identity_file, remote.known_hosts) for remote in config.remote],
            credentials_file=config.registry.credentials_file, token_file=config.huggingface.token_file), account)
    except ConfigError as exc:
        problems = [str(exc)]
    for problem in dict.fromkeys(problems):  # a kubeconfig's problem is found by both checks
        warn(problem)
    if problems:
        sys.exit(EXIT_USAGE)
    emit(output, {"ok": True, "config": config}, lambda: f"{file}: valid; every file it names is readable")


def _status_text(result: dict[str, Any]) -> str:
    head = {key: result.get(key) for key in ("version", "healthy", "state_dir", "sessions", "connections",
                                             "in_flight", "uptime_s")}
    backends = table(["backend", "host", "up", "error"],
                     [[b.get("backend", ""), b.get("host", ""), "yes" if b.get("up") else "NO", b.get("error") or "-"]
                      for b in result.get("backends", [])])
    parts = [fields_text(head), backends]
    for key in ("remotes", "kubernetes"):  # one row per host: every key the daemon reports, as a column
        rows = [r for r in result.get(key) or [] if isinstance(r, dict)]
        if rows:
            columns = list(dict.fromkeys(k for r in rows for k in r))
            parts.append(f"{key}:\n" + table(columns, [[_cell(r.get(c)) for c in columns] for r in rows]))
    return "\n\n".join(parts)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "-" if value in (None, "", [], {}) else str(value)


@click.command("status", epilog="""\b
Examples:
  coldsnap-provider status                       # exit 3 when a backend is unreachable
  coldsnap-provider status -o json | jq .budgets""")
@state_dir_option
@output_option
def _status(state_dir: Path | None, output: str) -> None:
    """The daemon's state and each configured backend's; exit 3 (each one named on stderr) when one is down."""
    result = ask(state_dir, lambda client: client.status())
    emit(output, result, lambda: _status_text(result))
    for backend in (b for b in result.get("backends", []) if not b.get("up")):
        warn(f"status: the {backend['backend']} backend of host {backend['host']!r} is unreachable: "
             f"{backend['error']}")
        sys.exit(EXIT_UNHEALTHY)


@click.command("reload", epilog="""\b
Examples:
  coldsnap-provider reload          # as root or the daemon's account; same as systemctl reload""")
@state_dir_option
@output_option
def _reload(state_dir: Path | None, output: str) -> None:
    """Apply the daemon's configuration file again, as SIGHUP does, and print what changed."""
    result = ask(state_dir, lambda client: client.reload())
    emit(output, result, lambda: "\n".join(
        [f"changed: {', '.join(result.get('changed', [])) or 'nothing'}",
         f"needs a restart: {', '.join(result.get('needs_restart', [])) or 'nothing'}"]))


@click.command("version", epilog="Example:\n\n  coldsnap-provider version -o json")
@output_option
def _version(output: str) -> None:
    """Print the version."""
    from .._packaging import package_version

    version = package_version()
    emit(output, {"version": version}, lambda: f"coldsnap-provider {version}")


@click.command("install-units", epilog="""\b
Examples:
  coldsnap-provider install-units --dry-run
  coldsnap-provider install-units --prefix /tmp/root --exec /opt/coldsnap-provider/bin/coldsnap-provider""")
@click.option("--prefix", default="/", show_default=True, help="root to install under")
@click.option("--exec", "program", help="the coldsnap-provider program the unit runs (default: this Python "
              "environment's script)")
@click.option("--dry-run", is_flag=True, help="print what would be written; write nothing")
@output_option
def _install_units(prefix: str, program: str | None, dry_run: bool, output: str) -> None:
    """Install the systemd units, sysusers/tmpfiles snippets and docs.

    Copies the packaged units to PREFIX/etc/systemd/system, the sysusers.d and tmpfiles.d snippets to
    PREFIX/usr/lib, the docs to PREFIX/usr/share/doc/coldsnap-provider and, if absent, the default
    configuration to PREFIX/etc/coldsnap-provider/config.toml; the unit runs --exec (docs/upgrade.md).
    """
    from .._packaging import default_entry_point, install_units

    try:
        done = install_units(Path(prefix).absolute(), entry_point=Path(program) if program else default_entry_point(),
                             dry_run=dry_run)
    except ConfigError as exc:
        fail(f"install-units: {exc}", EXIT_USAGE)
    except OSError as exc:
        fail(f"install-units: {exc}")
    verb = "would install" if done.dry_run else "installed"
    emit(output, done, lambda: "\n".join([*(f"{verb} {path}" for path in done.installed),
                                          *(f"kept     {path}" for path in done.kept)]))


async def _probe_outcome(options: Any, state_dir: Path, config: str | None) -> dict[str, Any]:
    from .._probe import run_probe

    if options.host_process:
        return await run_probe(options, state_dir=state_dir, backend=None)
    from coldsnap_runtime import DockerBackend

    from .._serve import host_policy

    loaded = load_config(config)
    async with DockerBackend(url=loaded.docker.url, host_policy=host_policy(loaded)) as backend:
        return await run_probe(options, state_dir=state_dir, backend=backend)


@click.command("probe", epilog="""\b
Examples:
  coldsnap-provider probe --driver n610 --host-process
  coldsnap-provider probe --driver n580 --image coldsnap/capsule-probe:h200 --device 1 -o json""")
@state_dir_option
@click.option("--driver", required=True, type=click.Choice(["n580", "n610"]))
@click.option("--device", default="0", show_default=True, help="GPU selector (ordinal or UUID)")
@click.option("--image", default="", help="capsule image to probe in (disposable containers)")
@click.option("--host-process", is_flag=True, help="probe with plain processes on this host")
@click.option("--criu", default="", help="criu binary (default: the capsule's, or criu on PATH)")
@click.option("--config", help="TOML configuration (for the Docker endpoint)")
@click.option("--json", "as_json", is_flag=True, help="the same as -o json")
@output_option
def _probe(state_dir: Path | None, driver: str, device: str, image: str, host_process: bool, criu: str,
           config: str | None, as_json: bool, output: str) -> None:
    """Probe the GPU and CRIU, admit the host and cache its feature profile; exit 3 when not admitted."""
    from coldsnap_probe import ProfileError
    from coldsnap_runtime.errors import ColdsnapError

    from .._probe import ProbeOptions

    if bool(image) == host_process:
        fail("probe: give exactly one of --image IMAGE or --host-process", EXIT_USAGE)
    options = ProbeOptions(driver=driver, device=device, image=image, host_process=host_process, criu=criu)
    try:
        outcome = anyio.run(_probe_outcome, options, resolve_state_dir(state_dir), config, backend="asyncio")
    except (ValueError, ConfigError) as exc:
        fail(f"probe: {exc}", EXIT_USAGE)
    except (ProfileError, ColdsnapError, OSError) as exc:
        fail(f"probe failed: {exc}")
    emit("json" if as_json else output, outcome, lambda: fields_text(outcome))
    sys.exit(0 if outcome["admitted"] else EXIT_NOT_ADMITTED)


DAEMON_COMMANDS = (_serve, _check_config, _status, _reload, _version, _install_units, _probe)

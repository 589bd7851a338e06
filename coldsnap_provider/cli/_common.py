"""What every command shares: the state directory, the exit codes, errors as one line, secrets off argv."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import anyio
import click

from .._config import Config, default_state_dir
from .._errors import ClientError, ConfigError
from ..client import ControlClient

__all__ = (
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_NOT_ADMITTED",
    "EXIT_UNHEALTHY",
    "EXIT_USAGE",
    "AliasGroup",
    "ask",
    "fail",
    "resolve_state_dir",
    "secret",
    "state_dir_option",
    "warn",
)

EXIT_FAILED = 1  # the daemon refused, failed or could not be reached
EXIT_USAGE = 2  # bad arguments or configuration: nothing was changed
EXIT_UNHEALTHY = 3  # `status`: a configured backend does not answer
EXIT_NOT_ADMITTED = 3  # `probe`: the host was probed but not admitted

EXIT_CODES = """\b
Exit status:
  0  done
  1  the daemon refused or failed the request, or could not be reached (one line on stderr says why)
  2  usage or configuration error: a field and the rule it breaks are named; nothing changed
  3  status: a configured backend is unreachable; probe: the host was not admitted"""

STATE_DIR_ENV = "COLDSNAP_PROVIDER_STATE_DIR"

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def state_dir_option(function: _F) -> _F:
    # readable=False: a manager may search the state directory (0711) without listing it
    return click.option("--state-dir", type=click.Path(file_okay=False, readable=False, path_type=Path),
                        envvar=STATE_DIR_ENV,
                        show_envvar=True,
                        help="the daemon's state directory (default: /run/coldsnap-provider for root, "
                             "$XDG_RUNTIME_DIR/coldsnap-provider otherwise)")(function)


def resolve_state_dir(option: Path | None, config: Config | None = None) -> Path:
    """--state-dir (or its variable), else the configuration's server.state_dir, else the user's default."""
    if option is not None:
        return option.absolute()
    if config is not None and config.server.state_dir:
        return Path(config.server.state_dir).absolute()
    return default_state_dir()


def warn(message: str) -> None:
    sys.stderr.write(f"coldsnap-provider: {message}\n")


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """One line on stderr, then exit with `code`."""
    warn(message)
    sys.exit(code)


def ask(state_dir: Path | None, work: Callable[[ControlClient], Awaitable[_T]]) -> _T:
    """Run `work` against the control socket; a refusal or an unreachable daemon is one line and exit 1."""
    client = ControlClient(resolve_state_dir(state_dir))
    try:
        return anyio.run(work, client)
    except ClientError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot reach the daemon at {client.socket}: {exc.strerror or exc}")


def secret(value: str | None, file: Path | None, env: str, *, what: str) -> str | None:
    """A secret from --WHAT-file (not readable by others), else the --WHAT value, else the variable `env`.

    A file is the way to keep it out of argv (which every local user can read in /proc); a file that
    others can read is refused, as ssh refuses such a key.
    """
    if file is not None:
        try:
            mode = file.stat().st_mode
            if mode & stat.S_IROTH:
                raise ConfigError(f"--{what}-file {file}: readable by every user (mode {stat.S_IMODE(mode):04o}); "
                                  f"chmod o-r it (the rule: a {what} file is not world-readable)")
            text = file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--{what}-file {file}: {exc.strerror or exc}") from exc
        if not text:
            raise ConfigError(f"--{what}-file {file}: is empty (the rule: it holds the {what})")
        return text
    return value if value is not None else os.environ.get(env)


class AliasGroup(click.Group):
    """A group whose verbs also answer to their short names (`ls` for `list`, `rm` for `remove`)."""

    aliases: dict[str, str] = {"ls": "list", "rm": "remove"}

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, self.aliases.get(cmd_name, cmd_name))

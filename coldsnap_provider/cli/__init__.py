"""`coldsnap-provider`: the daemon, its sessions and workloads, from the command line (click).

One module per command group (`_daemon`, `_sessions`, `_workloads`, `_call`), one for what is printed
(`_render`), one for what every command shares (`_common`), one for man pages (`_man`). The same
definitions give the help, the shell completion and the man pages.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path

import click
from click.shell_completion import get_completion_class

from .. import __version__
from ._call import CALL
from ._captures import CAPTURE
from ._common import EXIT_CODES, EXIT_USAGE
from ._daemon import DAEMON_COMMANDS
from ._man import write_man_pages
from ._sessions import RUN, SESSION
from ._workloads import WORKLOAD

__all__ = ("main",)

PROG = "coldsnap-provider"


def _version() -> str:
    from .._packaging import package_version

    return package_version()


@click.group(PROG, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             epilog=f"""\b
Examples:
  {PROG} status
  {PROG} session open --session op-1 --host node-a
  {PROG} workload ls
  {PROG} workload logs --follow hello
  {PROG} session close --all
  eval "$({PROG} completion bash)"

{EXIT_CODES}

\b
Environment:
  COLDSNAP_PROVIDER_STATE_DIR    the state directory (--state-dir)
  COLDSNAP_OUTPUT                json: every command's -o json by default
  COLDSNAP_HOST_PROVIDER_SOCKET  call --socket
  COLDSNAP_HOST_PROVIDER_TOKEN   call's token (or --token-file)""")
@click.version_option(__version__, "-V", "--version", prog_name=PROG,
                      message="%(prog)s %(version)s")
def ROOT() -> None:
    """The ColdSnap host provider: run the daemon, open sessions for placement managers, look after the
    workloads they ran."""


@ROOT.command("completion", epilog=f"""\b
Examples:
  eval "$({PROG} completion bash)"                              # this shell
  {PROG} completion bash > /etc/bash_completion.d/{PROG}
  {PROG} completion zsh > "${{fpath[1]}}/_{PROG}"
  {PROG} completion fish > ~/.config/fish/completions/{PROG}.fish""")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def _completion(shell: str) -> None:
    """Print the shell completion script for SHELL (click's own, from these very definitions)."""
    completion = get_completion_class(shell)
    assert completion is not None  # the three choices are click's built-in shells
    click.echo(completion(ROOT, {}, PROG, "_COLDSNAP_PROVIDER_COMPLETE").source())


@ROOT.command("man", epilog=f"""\b
Examples:
  {PROG} man --output /usr/local/share/man/man1 && mandb -q
  {PROG} man --output /tmp/man && man -l /tmp/man/{PROG}-workload-logs.1""")
@click.option("--output", "directory", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="directory to write the section-1 pages into (created if absent)")
def _man(directory: Path) -> None:
    """Write a man page for every command (coldsnap-provider-session-open.1, ...), from its help."""
    for path in write_man_pages(ROOT, _version(), directory):
        click.echo(str(path))


for _command in (*DAEMON_COMMANDS, SESSION, WORKLOAD, CAPTURE, CALL, RUN):
    ROOT.add_command(_command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; its exit status (2 for a usage error, as click reports it)."""
    # What the command line loaded lives until the process exits: freed at exit by the operating system rather
    # than by a full collection of it (a tenth of a second of each short command; `serve` freezes its own too).
    gc.freeze()
    try:
        ROOT.main(args=list(argv) if argv is not None else None, prog_name=PROG, standalone_mode=True)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else EXIT_USAGE)
    return 0

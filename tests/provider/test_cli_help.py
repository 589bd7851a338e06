"""The CLI's own documentation, from the same click definitions as the commands: examples and exit codes in every
`--help`, shell completion and man pages; and text output that shows what a terminal would act on. No daemon: these
run in the engine-free process (tests/engine-free.txt)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from coldsnap_provider.cli import ROOT
from tests.helpers import ROOT as REPO

CLI = [sys.executable, "-m", "coldsnap_provider"]


def cli(*args: str, env: dict[str, str] | None = None, text: bool = True, **kwargs: Any) -> Any:
    return subprocess.run([*CLI, *args], capture_output=True, text=text, check=False, cwd=REPO, timeout=120,
                          env={**os.environ, **(env or {})}, **kwargs)


def _commands(command: click.Command, path: tuple[str, ...] = ("coldsnap-provider",)) -> list[tuple[str, ...]]:
    found = [path]
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            found += _commands(sub, (*path, name))
    return found


def test_every_command_has_examples_and_the_exit_codes_are_documented() -> None:
    paths = _commands(ROOT)
    assert len(paths) >= 22
    for path in paths[1:]:
        result = cli(*path[1:], "--help")
        assert result.returncode == 0 and "Example" in result.stdout, path
    root = cli("--help").stdout
    assert "Exit status:" in root and "3  status: a configured backend is unreachable" in root


def test_shell_completion_comes_from_the_command_definitions(tmp_path: Path) -> None:
    for shell in ("bash", "zsh", "fish"):
        script = cli("completion", shell)
        assert script.returncode == 0 and "_COLDSNAP_PROVIDER_COMPLETE" in script.stdout, shell
    (tmp_path / "coldsnap-provider").write_text(f"#!/bin/sh\ncd {REPO} && exec {sys.executable} -m "
                                                 "coldsnap_provider \"$@\"\n")
    (tmp_path / "coldsnap-provider").chmod(0o755)
    (tmp_path / "completion.bash").write_text(cli("completion", "bash").stdout)
    probe = ('source completion.bash; complete() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); '
             '_coldsnap_provider_completion coldsnap-provider; echo "${COMPREPLY[*]}"; }; '
             'complete coldsnap-provider workload l; complete coldsnap-provider session close --a; '
             'complete coldsnap-provider workload logs --')
    done = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=False,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}, timeout=60)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0] == "list logs" and lines[1] == "--all", done
    assert {"--follow", "--tail", "--raw", "--output"} <= set(lines[2].split())


def test_man_pages_are_generated_for_every_command_and_render_cleanly(tmp_path: Path) -> None:
    result = cli("man", "--output", str(tmp_path))
    assert result.returncode == 0, result.stderr
    pages = sorted(p.name for p in tmp_path.iterdir())
    assert pages == sorted("-".join(path) + ".1" for path in _commands(ROOT))
    for page in pages:
        checked = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", page], cwd=tmp_path, capture_output=True,
                                 text=True, check=False)
        assert checked.returncode == 0 and checked.stderr == "", (page, checked.stderr)
    shown = subprocess.run(["man", "-l", "-P", "cat", str(tmp_path / "coldsnap-provider-workload-logs.1")],
                           capture_output=True, text=True, check=False, env={**os.environ, "MANWIDTH": "100"})
    text = re.sub(r".\x08", "", shown.stdout)
    assert shown.returncode == 0 and "coldsnap-provider workload logs [OPTIONS] NAME" in text
    assert "EXAMPLES" in text and "coldsnap-provider workload logs --tail 20 --follow hello" in text
    assert "-f, --follow" in text
    root = re.sub(r".\x08", "", subprocess.run(["man", "-l", "-P", "cat", str(tmp_path / "coldsnap-provider.1")],
                                              capture_output=True, text=True, check=False).stdout)
    assert "EXIT STATUS" in root and "coldsnap-provider-workload(1)" in root


def test_text_output_escapes_what_a_terminal_would_act_on() -> None:
    """Review finding: root's `session ls` and `workload ls` show other managers' labels and names; an escape
    sequence there (OSC 52 clipboard write, clear screen, a right-to-left override) is shown, never obeyed."""
    from coldsnap_provider.cli._render import fields_text, table

    shown = table(["name", "label"], [["w\x1b]52;c;AAAA\x07", "ok\u202eevil"]])
    assert "\x1b" not in shown and "\u202e" not in shown and "w\\x1b]52;c;AAAA\\x07" in shown
    assert fields_text({"labels": {"k\x1b[2J": "v\r\n"}}) == "labels.k\\x1b[2J: v\\r\\n"

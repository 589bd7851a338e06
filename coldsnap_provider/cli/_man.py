"""Man pages and shell completion, generated from the same click definitions as the commands and their help.

One page per command, named as git names its pages: coldsnap-provider(1), coldsnap-provider-session-open(1)...
Written in plain man(7) macros (TH, SH, TP, B, I, RS/RE, nf/fi), which `man -l` and `groff -man` read.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import click

__all__ = ("man_pages", "write_man_pages")


def _escape(text: str) -> str:
    """Text as troff reads it literally: backslashes doubled, a leading `.` or `'` kept from becoming a request."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line.startswith((".", "'")) else line for line in text.splitlines())


def _paragraphs(text: str) -> str:
    """click's help text (\\b marks a block not to rewrap) as man paragraphs; such blocks kept as written."""
    out = []
    for block in re.split(r"\n\s*\n", text.strip()):
        if block.startswith("\b"):
            out.append(".PP\n.nf\n" + _escape(block.lstrip("\b").strip("\n")) + "\n.fi")
        else:
            out.append(".PP\n" + _escape(" ".join(block.split())))
    return "\n".join(out)


def _sections(epilog: str) -> str:
    """An epilog's blocks: one that opens with a `Heading:` line becomes that section (EXAMPLES, EXIT STATUS)."""
    out = []
    for block in re.split(r"\n\s*\n", epilog.strip()):
        head, _, body = block.lstrip("\b").strip("\n").partition("\n")
        if head.endswith(":") and body:
            out += [f".SH {_escape(head[:-1].upper())}", ".nf", _escape(textwrap.dedent(body)), ".fi"]
        else:
            out += [".SH NOTES" if not out else ".PP", _paragraphs(block)]
    return "\n".join(out)


def _walk(command: click.Command, path: list[str]) -> Iterator[tuple[list[str], click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        context = click.Context(command, info_name=path[-1])
        for name in command.list_commands(context):  # click's own listing and lookup, aliases included
            if (sub := command.get_command(context, name)) is not None:
                yield from _walk(sub, [*path, name])


def _page(path: list[str], command: click.Command, version: str, date: str) -> str:
    name = "-".join(path)
    context = click.Context(command, info_name=" ".join(path))
    lines = [f'.TH "{name.upper()}" "1" "{date}" "coldsnap-provider {version}" "coldsnap-provider manual"',
             ".SH NAME", f"{_escape(name)} \\- {_escape(command.get_short_help_str(limit=200))}",
             ".SH SYNOPSIS", f".B {_escape(' '.join(path))}",
             _escape(" ".join(command.collect_usage_pieces(context))),
             ".SH DESCRIPTION", _paragraphs(command.help or command.short_help or "")]
    options = [record for p in command.get_params(context)
               if isinstance(p, click.Option) and (record := p.get_help_record(context))]
    if options:
        lines.append(".SH OPTIONS")
        for names, text in options:
            lines += [".TP", f".B {_escape(names)}", _escape(text)]
    if isinstance(command, click.Group) and command.commands:
        lines.append(".SH COMMANDS")
        for sub in sorted(command.commands):
            lines += [".TP", f".B {_escape(sub)}", _escape(command.commands[sub].get_short_help_str(limit=200)),
                      f"See \\fB{_escape('-'.join([*path, sub]))}\\fR(1)."]
    if command.epilog:
        lines.append(_sections(command.epilog))
    if len(path) > 1:
        lines += [".SH SEE ALSO", f"\\fB{_escape(path[0])}\\fR(1)"]
    return "\n".join(lines) + "\n"


def man_pages(root: click.Command, version: str, *, date: str = "") -> dict[str, str]:
    """{file name: page} for `root` and every command under it."""
    date = date or datetime.now(UTC).strftime("%Y-%m-%d")
    return {f"{'-'.join(path)}.1": _page(path, command, version, date)
            for path, command in _walk(root, [root.name or "coldsnap-provider"])}


def write_man_pages(root: click.Command, version: str, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in man_pages(root, version).items():
        (path := directory / name).write_text(text)
        written.append(path)
    return written

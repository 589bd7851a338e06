"""What the CLI prints: aligned tables and `key: value` blocks for people, one JSON document for scripts.

`-o json` is the daemon's answer as JSON with stable keys (times stay epoch seconds or ISO 8601,
bytes stay base64, as on the wire); the default text output decodes them: times as "3 min ago",
program output as UTF-8 text.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
import msgspec

__all__ = ("OUTPUT_ENV", "ago", "emit", "fields_text", "output_option", "table", "when")

OUTPUT_ENV = "COLDSNAP_OUTPUT"  # `json` makes -o json every command's default (scripts that set it once)

_F = TypeVar("_F", bound=Callable[..., Any])


def output_option(function: _F) -> _F:
    """-o/--output table|json on a command that prints an answer."""
    return click.option(
        "-o", "--output", "output", type=click.Choice(["table", "json"]), default="table", envvar=OUTPUT_ENV,
        show_default=True, show_envvar=True,
        help="table: aligned text for people; json: one JSON document with stable keys, for scripts")(function)


def emit(output: str, value: Any, text: Callable[[], str]) -> None:
    """Print `value` as one JSON document with -o json, else the text `text` makes of it."""
    if output == "json":
        sys.stdout.write(json.dumps(msgspec.to_builtins(value), sort_keys=True) + "\n")
    else:
        rendered = text()
        sys.stdout.write(rendered + ("\n" if rendered and not rendered.endswith("\n") else ""))
    sys.stdout.flush()


def _printable(text: str) -> str:
    """`text` with every character a terminal would act on escaped (`\\x1b`, `\\u202e`, ...): tables and fields show
    what other managers chose (labels, names, hosts), which must never move an admin's cursor or clipboard."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns padded to their widest cell (the last one left ragged); "(none)" for no rows."""
    cells = [[_printable(str(cell)) for cell in row] for row in rows]
    if not cells:
        return "(none)"
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = [[h.upper() for h in headers], *cells]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def _flat(value: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            yield from _flat(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for index, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{index}]")
    elif isinstance(value, list):
        yield prefix, ", ".join(str(v) for v in value) or "-"
    elif isinstance(value, Mapping):
        yield prefix, "-"
    else:
        yield prefix, "-" if value is None or value == "" else str(value).lower() if isinstance(value, bool) \
            else str(value)


def fields_text(value: Any) -> str:
    """A mapping as aligned `key: value` lines; nested keys dotted (`budgets.used`), lists comma-joined."""
    pairs = [(_printable(key), _printable(text)) for key, text in _flat(msgspec.to_builtins(value))]
    width = max((len(key) for key, _ in pairs), default=0)
    return "\n".join(f"{key + ':':<{width + 1}} {text}" for key, text in pairs)


def ago(unix: float, now: float | None = None) -> str:
    """Seconds since the epoch as people read an age: "just now", "42 s ago", "3 min ago", "5 h ago", "2 d ago"."""
    seconds = (time.time() if now is None else now) - unix
    if seconds < 0:
        return "in the future"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return "just now" if seconds < 1 else f"{int(seconds)} s ago"


def when(iso: str, now: float | None = None) -> str:
    """An engine's RFC 3339 time (nanoseconds and all) as an age; "-" when absent or unreadable."""
    if not iso:
        return "-"
    text = iso.replace("Z", "+00:00")
    head, dot, rest = text.partition(".")
    if dot:  # Python reads at most microseconds
        digits = rest[:len(rest) - len(rest.lstrip("0123456789"))]
        text = f"{head}.{digits[:6]}{rest[len(digits):]}"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return iso
    return ago((parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp(), now)

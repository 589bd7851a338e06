"""The node's capture store, for an admin: ls, inspect, rm, gc (docs/capture-store.md)."""

from __future__ import annotations

import datetime
from pathlib import Path

import click

from ..client import Capture, ControlClient
from ._common import AliasGroup, ask, state_dir_option
from ._render import emit, fields_text, output_option, table, when

__all__ = ("CAPTURE",)

_SIZE = click.IntRange(min=0)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@click.group("capture", cls=AliasGroup, epilog="""\b
Examples:
  coldsnap-provider capture ls
  coldsnap-provider capture gc --max-bytes 500000000000 --older-than 7d""")
def CAPTURE() -> None:
    """The node's capture store ([docker] capture_store): the captures of your images (root and the daemon's
    account: all of them)."""


@CAPTURE.command("list", epilog="""\b
Examples:
  coldsnap-provider capture ls
  coldsnap-provider capture ls -o json | jq -r '.[] | select(.shared > 0) | .capture'""")
@state_dir_option
@output_option
def _list(state_dir: Path | None, output: str) -> None:
    """List them: capture, size, on disk, shared with other captures, zeros, tiers, last use (alias: ls)."""
    listed = ask(state_dir, lambda client: client.captures())
    emit(output, listed, lambda: table(
        ["capture", "size", "on disk", "shared", "zero", "tiers", "used"],
        [[c.capture[:19], _bytes(c.size), _bytes(c.stored + c.tree), _bytes(c.shared), _bytes(c.zero),
          ",".join(c.tiers), when(_iso(c.used))] for c in listed]))


def _fields(c: Capture) -> str:
    return fields_text({
        "capture": c.capture, "files": c.files, "size": _bytes(c.size), "stored": _bytes(c.stored),
        "shared": f"{_bytes(c.shared)} (held by other captures too)", "zero": f"{_bytes(c.zero)} (never stored)",
        "tree": _bytes(c.tree), "tiers": ", ".join(c.tiers), "created": _iso(c.created), "used": _iso(c.used)})


@CAPTURE.command("inspect", epilog="""\b
Examples:
  coldsnap-provider capture inspect sha256:4f1c...""")
@state_dir_option
@click.argument("capture")
@output_option
def _inspect(state_dir: Path | None, capture: str, output: str) -> None:
    """Its files and bytes: stored, shared with other captures, zero; tiers; created and last used."""
    info = ask(state_dir, lambda client: client.inspect_capture(capture))
    emit(output, info, lambda: _fields(info))


@CAPTURE.command("remove", epilog="""\b
Examples:
  coldsnap-provider capture rm sha256:4f1c...""")
@state_dir_option
@click.argument("captures", nargs=-1, required=True, metavar="CAPTURE...")
@output_option
def _remove(state_dir: Path | None, captures: tuple[str, ...], output: str) -> None:
    """Remove captures (refused while a container uses one; chunks other captures hold stay) (alias: rm)."""

    async def remove(client: ControlClient) -> None:
        for capture in captures:
            await client.remove_capture(capture)

    ask(state_dir, remove)
    emit(output, {"removed": list(captures)}, lambda: "\n".join(f"removed {c}" for c in captures))


def _duration(text: str | None) -> float | None:
    if text is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)
    except (ValueError, IndexError):
        raise click.BadParameter(f"{text!r}: a number of seconds, or with s, m, h or d") from None


@CAPTURE.command("gc", epilog="""\b
Examples:
  coldsnap-provider capture gc --older-than 7d
  coldsnap-provider capture gc --max-bytes 500000000000""")
@state_dir_option
@click.option("--max-bytes", type=_SIZE, help="then remove the least recently used until the store holds this")
@click.option("--older-than", metavar="AGE", help="remove captures unused for AGE (seconds, or 30m, 12h, 7d)")
@output_option
def _gc(state_dir: Path | None, max_bytes: int | None, older_than: str | None, output: str) -> None:
    """Collect captures no container uses: by age, then by capacity (root and the daemon's account)."""
    if max_bytes is None and older_than is None:
        raise click.UsageError("give --max-bytes, --older-than or both")
    age = _duration(older_than)
    done = ask(state_dir, lambda client: client.collect_captures(max_bytes=max_bytes, older_than_s=age))
    emit(output, done, lambda: "\n".join([*(f"removed {c}" for c in done.removed),
                                          f"freed {done.bytes} bytes: {done.blobs} blobs, {done.orphans} of them "
                                          "named by no capture"]))

"""What a Dockerfile would make the engine fetch from the network itself: ``ADD`` of a URL.

The engine (dockerd) fetches an ``ADD`` source that is a URL **in its own network namespace**,
the host's: ``ADD http://127.0.0.1:port/...`` reads services bound to the host's loopback
(measured on this project's dockerd 20.10; docs/threat-model.md). A ``RUN`` runs in a build
container on the default bridge and reaches no host loopback, so only ``ADD`` matters here.
:func:`remote_sources` finds such sources without running anything, for the admission policy.

It reads a Dockerfile the way the classic builder does, and errs towards finding too much:

* physical lines are split on ``\\n`` only (a trailing ``\\r`` dropped, a leading BOM ignored);
* a line ending in the escape character (then optional blanks) continues on the next; comment
  lines and blank lines inside a continuation are skipped, and the pieces are joined without a
  space (so ``ht\\`` + ``tp://`` is ``http://``). The ``# escape=`` directive picks ``\\`` or a
  backtick, and engines differ on when they honour it (a BOM, a ``# syntax`` line before it), so
  the text is read under **both** escape characters and what either reading finds counts;
* instructions are case-insensitive; ``ONBUILD ADD ...`` is an ``ADD`` (it runs in every build
  ``FROM`` the image); the JSON-array form ``ADD ["src", "dest"]`` is decoded like the builder does;
  leading ``--flag`` words are skipped;
* a source counts as remote when, with quotes and escape characters removed (the builder's word
  lexer removes them), it contains ``://`` or starts with ``git@``; a source holding ``$`` counts
  too, because a build argument or an ``ENV`` (the base image's included) could make it a URL.

Heredocs (``ADD <<EOF``) are BuildKit-only: the classic builder of Docker 20.10 refuses them as
a parse error (measured), and they create files from inline text, not from the network.
"""

from __future__ import annotations

import json
import re

import msgspec

__all__ = ("RemoteSource", "instructions", "remote_sources")

_ESCAPES = ("\\", "`")
# The builder splits non-JSON arguments on these (ASCII only, as its Go regexp does).
_WORDS = re.compile(r"[\t\v\f\r ]+")
# Leading --flag words (--chown, --chmod, --checksum, --link, --keep-git-dir, and a bare --).
_FLAGS = re.compile(r"\A(?:--[^\t\v\f\r ]*(?:[\t\v\f\r ]+|\Z))*")
_UNICODE_ESCAPE = re.compile(r"\\u([0-9a-fA-F]{4})")
_DIRECTIVE = re.compile(r"#[ \t]*([a-zA-Z][a-zA-Z0-9]*)[ \t]*=[ \t]*(.+?)[ \t]*")
_USERINFO = re.compile(r"(://)[^/@\s]*@")
_MAX_ONBUILD = 4  # ONBUILD ONBUILD is an error for the builder; a few levels are plenty to look through


class RemoteSource(msgspec.Struct, frozen=True, kw_only=True):
    """One ``ADD`` source the engine would fetch itself (or might: `why` says which)."""

    line: int  # the physical line (1-based) its instruction starts on
    instruction: str  # "ADD" or "ONBUILD ADD"
    source: str  # as written, with any user:password@ of a URL masked
    why: str  # "url", "git" or "variable"


def remote_sources(text: str) -> list[RemoteSource]:
    """Every ``ADD`` source of `text` that is, or may expand to, something fetched over the network.

    Never raises on any text; an empty list means no ``ADD`` reaches the network."""
    lines = text.removeprefix("\ufeff").split("\n")
    directive = _directive_escape(lines)
    found: dict[int, list[RemoteSource]] = {}
    # The directive's reading first; the other escape's only adds lines the first found nothing on.
    for escape in sorted(_ESCAPES, key=lambda e: e != directive):
        seen = set(found)
        for number, line in _logical_lines(lines, escape):
            sources = [] if number in seen else _instruction_sources(line, "", 0)
            if sources:
                found.setdefault(number, []).extend(msgspec.structs.replace(s, line=number) for s in sources)
    return [source for number in sorted(found) for source in found[number]]


def instructions(text: str) -> list[str]:
    """Every instruction of `text` as the builder joins it; where an ``# escape=`` directive is written, under
    it and under the other escape too (engines differ on when they honour it): what a FROM check must read."""
    lines = text.removeprefix("\ufeff").split("\n")
    directive = _directive_escape(lines)
    seen: dict[str, None] = {}
    for escape in sorted(_ESCAPES, key=lambda e: e != directive) if directive else ("\\",):
        seen.update((line, None) for _, line in _logical_lines(lines, escape))
    return list(seen)


def _directive_escape(lines: list[str]) -> str:
    """The escape character the ``# escape=`` directive names ("" when there is none: ``\\``)."""
    for line in lines:
        match = _DIRECTIVE.fullmatch(line.removesuffix("\r"))
        if match is None:
            break
        if match.group(1).lower() == "escape" and match.group(2) in _ESCAPES:
            return match.group(2)
    return ""


def _is_comment(line: str) -> bool:
    # Python's whitespace is a superset of Go's unicode.IsSpace: every line the builder skips, we skip.
    return line.lstrip().startswith("#")


def _continues(line: str, escape: str) -> tuple[str, bool]:
    """(the line without its continuation mark, whether it continues)."""
    stripped = line.rstrip(" \t")
    if stripped.endswith(escape):
        return stripped[: -len(escape)], True
    return line, False


def _logical_lines(lines: list[str], escape: str) -> list[tuple[int, str]]:
    """(first physical line number, joined text) of every instruction, as the builder joins them."""
    out: list[tuple[int, str]] = []
    index = 0
    while index < len(lines):
        raw = lines[index].removesuffix("\r")
        index += 1
        if _is_comment(raw) or not raw.strip():
            continue
        start = index
        line, more = _continues(raw, escape)
        while more and index < len(lines):
            piece = lines[index].removesuffix("\r")
            index += 1
            if _is_comment(piece) or not piece.strip():
                continue
            piece, more = _continues(piece, escape)
            line += piece
        out.append((start, line))
    return out


def _instruction_sources(line: str, prefix: str, depth: int) -> list[RemoteSource]:
    """The remote sources of one logical line (an ONBUILD's trigger is read as an instruction too)."""
    parts = _WORDS.split(line.strip(), maxsplit=1)
    word, rest = parts[0].lower(), parts[1] if len(parts) > 1 else ""
    if word == "onbuild" and depth < _MAX_ONBUILD:
        return _instruction_sources(rest, f"{prefix}ONBUILD ", depth + 1)
    if word != "add":
        return []
    return [RemoteSource(line=0, instruction=f"{prefix}ADD", source=_masked(source), why=why)
            for source, why in _add_sources(rest)]


def _add_sources(arguments: str) -> list[tuple[str, str]]:
    """(source, why) of the remote ones among an ADD's sources (every word but the destination)."""
    rest = _FLAGS.sub("", arguments.strip(), count=1).strip()
    items: list[str] = [w for w in _WORDS.split(rest) if w]
    if rest.startswith("["):
        try:
            decoded = json.loads(rest)
        except ValueError:
            decoded = None  # the builder falls back to the plain form, as we do
        if isinstance(decoded, list) and all(isinstance(item, str) for item in decoded):
            items = decoded
    found: list[tuple[str, str]] = []
    for source in items[:-1] if len(items) > 1 else items:
        if why := _why_remote(source):
            found.append((source, why))
    return found


def _why_remote(source: str) -> str:
    # What the word lexer leaves (quotes and escape characters removed), and the same with JSON's
    # \uXXXX escapes decoded, in case the JSON form was read as plain words.
    bare = "".join(ch for ch in source if ch not in "\\`\"'")
    decoded = "".join(ch for ch in _UNICODE_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), source)
                      if ch not in "\\`\"'")
    if "://" in bare or "://" in decoded:
        return "url"
    if bare.lower().startswith("git@") or decoded.lower().startswith("git@"):
        return "git"
    if "$" in bare or "$" in decoded:
        return "variable"
    return ""


def _masked(source: str) -> str:
    """A URL's user:password@ never travels into a refusal, a log line or the audit trail."""
    return _USERINFO.sub(r"\1***@", source)

"""Issue 39 item 3: the house rules extended to the C in the repository (every tracked `*.c`).

* A C file has at most 600 lines and a function fewer than 60 (tests/test_house_rules.py's limits).
* The C graph between files, read here: a file that calls (or takes the address of) a non-static function
  defined in another file is an arrow to it (`call_graph`), and so is an include (`include_graph`);
  tests/test_boundaries.py checks neither has a circle, beside the Python import graph.

The function finder is a brace matcher over the text with comments, strings, character literals and
preprocessor lines blanked: a `{` at file level right after a `)` opens a function whose name is the identifier
before that parameter list. It reads this repository's C (no K&R definitions, no macros that open bodies).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT
from tests.test_house_rules import MAX_FUNCTION_LINES, MAX_MODULE_LINES

_BLANKED = re.compile(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'|^[ \t]*#(?:\\\n|[^\n])*",
                      re.S | re.M)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    line: int
    lines: int
    static: bool
    body: str


def blank(text: str) -> str:
    """`text` with comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    return _BLANKED.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def _closing(code: str, at: int) -> int:
    """The index of the brace closing the one at `at`."""
    depth = 0
    for i in range(at, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced braces")


def _opening_paren(code: str, at: int) -> int:
    """The index of the `(` matching the `)` at `at`."""
    depth = 0
    for i in range(at, -1, -1):
        depth += {")": 1, "(": -1}.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError("unbalanced parentheses")


def functions(text: str) -> list[Function]:
    """Every function defined in C source `text`, in order."""
    code, found, start, i = blank(text), [], 0, 0
    while (i := code.find("{", i)) >= 0:
        end = _closing(code, i)
        head = code[start:i].rstrip()
        if head.endswith(")"):
            before = code[:_opening_paren(code, len(head) + start - 1)].rstrip()
            name = _IDENTIFIER.findall(before[-80:])
            line = code.count("\n", 0, len(before)) + 1
            found.append(Function(name=name[-1], line=line, lines=code.count("\n", 0, end) + 2 - line,
                                  static="static" in before[start:].rsplit(";", 1)[-1].split(),
                                  body=code[i:end + 1]))
        start = i = end + 1
        while start < len(code) and code[start] in " \t\n;":  # `};` of a struct or an initialiser
            start += 1
    return found


def c_files(root: Path) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.c", "*.h"], cwd=root, capture_output=True, text=True, check=True)
    return [root / line for line in listed.stdout.split()]


def oversized(paths: Iterable[Path], root: Path) -> list[str]:
    found = []
    for path in paths:
        text = path.read_text()
        if (count := text.count("\n")) > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {count} lines (at most {MAX_MODULE_LINES})")
        found += [f"{path.relative_to(root)}:{f.line} {f.name}: {f.lines} lines (under 60)"
                  for f in functions(text) if f.lines > MAX_FUNCTION_LINES]
    return found


def call_graph(paths: Iterable[Path], root: Path) -> dict[str, set[str]]:
    """file → the files defining a non-static function it names (`main` is no one's callee)."""
    defined = {p: functions(p.read_text()) for p in paths if p.suffix == ".c"}
    owners: dict[str, set[str]] = {}
    for path, found in defined.items():
        for f in found:
            if not f.static and f.name != "main":
                owners.setdefault(f.name, set()).add(str(path.relative_to(root)))
    graph = {}
    for path, found in defined.items():
        here = str(path.relative_to(root))
        named = {n for f in found for n in _IDENTIFIER.findall(f.body)} - {f.name for f in found}  # its own first
        graph[here] = {o for n in named for o in owners.get(n, ()) if o != here}
    return graph


def include_graph(paths: Iterable[Path], root: Path) -> dict[str, set[str]]:
    """file → the repository files it includes with `#include "..."` (resolved beside it)."""
    graph = {}
    for path in paths:
        graph[str(path.relative_to(root))] = {str((path.parent / name).resolve().relative_to(root.resolve()))
                                              for name in _INCLUDE.findall(path.read_text())
                                              if (path.parent / name).is_file()}
    return graph


def test_c_files_stay_within_600_lines_and_functions_under_60() -> None:
    found = oversized(c_files(ROOT), ROOT)
    assert not found, "over the size limits (issue 39 item 3):\n" + "\n".join(found)


def test_the_function_finder_reads_the_interposer() -> None:
    """The finder is no vacuous pass: it sees the interposer's known functions, statics as static, and the
    call arrows between its files (tests/test_boundaries.py checks that graph has no circle)."""
    sources = ROOT / "coldsnap_probe/hydration/interposer"
    names = {f.name: f for f in functions((sources / "request.c").read_text())}
    assert not names["cscu_request_parse"].static and names["cscu_request_parse"].lines > 5
    assert all(f.static for n, f in names.items() if not n.startswith("cscu_"))
    graph = call_graph(c_files(ROOT), ROOT)
    interposer = "coldsnap_probe/hydration/interposer/"
    assert f"{interposer}request.c" in graph[f"{interposer}connection.c"]
    assert f"{interposer}control.c" not in graph[f"{interposer}regions.c"]  # the start hook, registered


def test_the_c_rules_can_fail(tmp_path: Path) -> None:
    """A function of 60 lines and a file of 601 are found, a function of 59 lines passes; comments and strings that
    look like code are not read as code, and calls both ways are arrows both ways."""
    lines = [f"    x += {i};\n" for i in range(56)]
    body = "".join(lines)
    (tmp_path / "a.c").write_text(
        '/* f() { */\nstatic const char *s = "{";\nstruct t { int a; };\n'
        "int short_one(int x)\n{\n" + "".join(lines[:-2]) + "    x += 1;\n    return b() + x;\n}\n"
        "static int long_one(int x)\n{\n" + body + "    return x;\n}\n")
    (tmp_path / "b.c").write_text("int b(void) { return short_one(1); }\n" + "\n" * 600)
    paths = sorted(tmp_path.glob("*.c"))
    found = functions((tmp_path / "a.c").read_text())
    assert [(f.name, f.lines, f.static) for f in found] == [("short_one", 59, False), ("long_one", 60, True)]
    assert oversized(paths, tmp_path) == ["a.c:63 long_one: 60 lines (under 60)", "b.c: 601 lines (at most 600)"]
    assert call_graph(paths, tmp_path) == {"a.c": {"b.c"}, "b.c": {"a.c"}}


"""The documentation's links and the benchmark headline's result files point at things that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT

DOCS = ("README.md", "docs/architecture.md", "docs/conformance.md", "docs/threat-model.md", "docs/install.md",
        "bench/README.md", "bench/HISTORY.md")
_LINK = re.compile(r"\]\((?!https?://)(?P<path>[^)#\s]*)(?:#(?P<anchor>[^)\s]+))?\)")
_HEADING = re.compile(r"^#+ (.*)$", re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(path.read_text())}


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_reach_a_file_and_heading(doc: str) -> None:
    source = ROOT / doc
    broken = []
    for match in _LINK.finditer(source.read_text()):
        target = (source.parent / match["path"]).resolve() if match["path"] else source
        if not target.exists():
            broken.append(f"{match['path']}: no such file")
        elif match["anchor"] and target.suffix == ".md" and match["anchor"] not in _anchors(target):
            broken.append(f"{match['path']}#{match['anchor']}: no such heading")
    assert not broken, f"{doc}:\n" + "\n".join(broken)


def test_bench_headline_names_result_files_that_exist() -> None:
    text = (ROOT / "bench/README.md").read_text()
    headline = text.split("\n## Headline\n", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`([\w.-]+?)(?:\.\{([\w,]+)\}|\.(json|txt))`", headline)
    files = [f"{stem}.{ext}" for stem, group, single in named for ext in (group.split(",") if group else [single])]
    assert len(files) >= 10
    missing = [name for name in files if not (ROOT / "bench/results" / name).exists()]
    assert not missing, f"bench/README.md's headline names result files that are not in bench/results: {missing}"


def device_steps() -> dict[str, str]:
    """The steps `scripts/device --help` lists, each with its line (a real bash runs the real script)."""
    done = subprocess.run(["bash", str(ROOT / "scripts/device"), "--help"], capture_output=True, text=True,
                          timeout=30, check=True)
    return {m[1]: m[2] for m in re.finditer(r"^  ([a-z][a-z0-9-]*) +(.+)$", done.stdout, re.M) if m[1] != "step"}


def test_bench_readme_is_a_results_page_of_at_most_400_lines() -> None:
    """Regression (issue 39): it had grown to 1,580 lines of lab notebook; the history is bench/HISTORY.md."""
    lines = (ROOT / "bench/README.md").read_text().splitlines()
    assert len(lines) <= 400, f"bench/README.md has {len(lines)} lines: move superseded runs to bench/HISTORY.md"
    assert {"## Headline", "## Reproduce each row", "## What bounds each figure"} <= set(lines)


# docs/architecture.md is the map (another change rewrites it); every other document is checked.
@pytest.mark.parametrize("doc", ["bench/README.md", "README.md", *(f"docs/{p.name}" for p in sorted(
    (ROOT / "docs").glob("*.md")) if p.name != "architecture.md")])
def test_every_device_step_a_document_names_exists(doc: str) -> None:
    """`scripts/device <step>` in a document names a step the script has; no document names one of the 16
    `scripts/device-*` files the steps replaced as a command to run (HISTORY.md keeps them as they were run)."""
    text = (ROOT / doc).read_text()
    steps = device_steps()
    unknown = sorted({m for m in re.findall(r"scripts/device ([a-z][\w-]*)", text) if m not in steps})
    assert not unknown, f"{doc} names steps scripts/device does not have: {unknown}"
    assert re.findall(r"scripts/device-[\w-]+", text) == [], f"{doc} names a script scripts/device replaced"


def test_the_device_step_check_can_fail() -> None:
    assert "gpu-tests" in device_steps() and "device-e2e" not in device_steps()

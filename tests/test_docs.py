"""The documentation's links and the benchmark headline's result files point at things that exist."""

from __future__ import annotations

import re
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

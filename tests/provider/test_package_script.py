"""scripts/package's checks and its release tag, in a throwaway clone (tags are shared by every worktree)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from coldsnap_provider import __version__
from tests.helpers import ROOT

# What the tag command reads, copied from the tree under test into the clone.
_READ = ("scripts/package", "CHANGELOG.md", "coldsnap_provider/__init__.py", "debian/changelog")


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
                          capture_output=True, text=True, check=False)


def _package(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(repo / "scripts" / "package"), *args], capture_output=True, text=True,
                          check=False, cwd=repo)


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    repo = tmp_path / "clone"
    assert _git(ROOT, "worktree", "list").returncode == 0
    cloned = subprocess.run(["git", "clone", "-q", "--no-tags", "--depth", "1", f"file://{ROOT}", str(repo)],
                            capture_output=True, text=True, check=False)
    assert cloned.returncode == 0, cloned.stderr
    for name in _READ:
        shutil.copy2(ROOT / name, repo / name)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "the tree under test")
    return repo


def test_tag_makes_an_annotated_tag_from_the_changelog_and_refuses_twice(clone: Path) -> None:
    made = _package(clone, "tag")
    assert made.returncode == 0, made.stderr
    assert made.stdout == f"v{__version__}\n"
    assert _git(clone, "cat-file", "-t", f"v{__version__}").stdout == "tag\n"  # annotated, not lightweight
    message = _git(clone, "tag", "-l", "--format=%(contents)", f"v{__version__}").stdout
    assert message.startswith(f"coldsnap-provider {__version__}\n\n## [{__version__}]"), message
    assert "\n### Added\n" in message and "## [Unreleased]" not in message
    assert _git(clone, "ls-remote", "--tags", "origin").stdout == ""  # nothing pushed

    again = _package(clone, "tag")
    assert again.returncode == 2 and f"v{__version__} exists already" in again.stderr


def test_tag_refuses_a_dirty_tree_and_a_version_without_a_changelog_section(clone: Path) -> None:
    (clone / "README.md").write_text("changed\n")
    dirty = _package(clone, "tag")
    assert dirty.returncode == 2 and "uncommitted changes" in dirty.stderr
    _git(clone, "checkout", "README.md")
    init = clone / "coldsnap_provider" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{__version__}"', '__version__ = "9.9.9"'))
    _git(clone, "commit", "-qam", "9.9.9")
    missing = _package(clone, "tag")
    assert missing.returncode == 2 and "CHANGELOG.md has no '## [9.9.9]' section" in missing.stderr
    assert _git(clone, "tag").stdout == ""


def test_deb_refuses_bad_arguments_and_a_changelog_behind_the_version(clone: Path) -> None:
    for args, rule in ((["--revision", "x1"], "--revision 'x1' must be a number"),
                       (["--bogus"], "unknown argument '--bogus'")):
        refused = _package(clone, "deb", *args, "--out", str(clone / "out"))
        assert refused.returncode == 2 and rule in refused.stderr, refused.stderr
    init = clone / "coldsnap_provider" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{__version__}"', '__version__ = "9.9.9"'))
    behind = _package(clone, "deb", "--out", str(clone / "out"))
    assert behind.returncode == 2 and "add a debian/changelog entry 9.9.9-1" in behind.stderr, behind.stderr
    assert not (clone / "out").exists()

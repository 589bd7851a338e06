"""`_images_fs.images_filesystem`: the filesystem of a capture's images as the capture report gives it, read from
real mounts (a tmpfs mounted here per `huge=` option: root)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe._images_fs import images_filesystem


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "mnt"
    point.mkdir()
    yield point
    subprocess.run(["umount", str(point)], check=False, capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
@pytest.mark.parametrize(("options", "huge"), [("size=8m", "never"), ("size=8m,huge=within_size", "within_size"),
                                               ("size=8m,huge=always", "always")])
def test_a_tmpfs_says_its_huge_page_option_also_in_a_directory_below_it(mounted: Path, options: str,
                                                                       huge: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "cs-images-test", str(mounted)], check=True)
    (mounted / "capture/images").mkdir(parents=True)
    assert images_filesystem(mounted / "capture/images") == {"type": "tmpfs", "huge": huge}


def test_another_filesystem_says_its_type_only() -> None:
    assert images_filesystem(Path("/proc/self")) == {"type": "proc"}


def test_a_missing_directory_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="gone"):
        images_filesystem(tmp_path / "gone")

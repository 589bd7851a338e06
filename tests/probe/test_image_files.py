"""The capture worker's image size and digest (root) never read through a link or a FIFO: since the CUDA
interposer, an engine writes its own device dump into the images (`device-<pid>/`, owned by its uid)."""

from __future__ import annotations

import os
from pathlib import Path

from coldsnap_probe._process import image_digest, images_size


def test_a_link_an_engine_leaves_in_its_dump_directory_is_neither_read_nor_counted(tmp_path: Path) -> None:
    images, outside = tmp_path / "images", tmp_path / "root-only.key"
    (images / "device-42").mkdir(parents=True)
    (images / "pages-1.img").write_bytes(b"p" * 4096)
    (images / "device-42" / "seg-0.bin").write_bytes(b"d" * 8192)
    outside.write_bytes(b"secret-1")
    (images / "device-42" / "seg-1.bin").symlink_to(outside)
    os.mkfifo(images / "device-42" / "seg-2.bin")
    assert images_size(images) == (4096 + 8192, 2)
    before = image_digest(images, contents=True)  # returns: the FIFO is not opened
    outside.write_bytes(b"secret-2")  # the link's target is no part of the images' digest
    assert image_digest(images, contents=True) == before
    (images / "device-42" / "seg-0.bin").write_bytes(b"e" * 8192)  # the images' own files still are
    assert image_digest(images, contents=True) != before

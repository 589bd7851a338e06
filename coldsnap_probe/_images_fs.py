"""The filesystem a capture's images are written to, for the capture report (issue 35 item 3).

The release writes the device memory (16 GiB and more) and CRIU the process's pages into the images; on a tmpfs
each page written is first allocated and cleared, 4 KiB at a time unless the tmpfs was mounted with `huge=`
(`always` or `within_size`), which makes those writes the bound of the release. Whoever names the images
directory chooses that mount; the report says which it got, read from this process's mount table (the super
block's options, the same through a bind mount into a container).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ("images_filesystem",)


def images_filesystem(path: Path) -> dict[str, str]:
    """`{"type": ...}` of the filesystem holding `path`, with `"huge"` for a tmpfs (`never` when its mount does
    not say); {} when the mount table has no entry for it."""
    st = os.stat(path)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if len(fields) < 3 or fields[2] != device or "-" not in fields:
            continue
        rest = fields[fields.index("-") + 1:]  # filesystem type, source, the super block's options
        found = {"type": rest[0]} if rest else {}
        if found.get("type") == "tmpfs":
            options = rest[2].split(",") if len(rest) > 2 else []
            found["huge"] = next((o.split("=", 1)[1] for o in options if o.startswith("huge=")), "never")
        return found
    return {}

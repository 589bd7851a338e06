"""`docker cp CONTAINER:PATH DEST` semantics for a tar streamed from the engine.

The copy lands atomically where it can: the archive is extracted into a private
directory beside the destination and renamed into place, so a failed or cancelled copy
leaves nothing half-written at the destination. Entries that would escape the copy
(absolute names, '..', paths through a symlink) are refused. Numeric ownership is kept
when running as root (ColdSnap repairs ownership afterwards).
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import IO

__all__ = ("CopyError", "extract_copy")


class CopyError(Exception):
    """The copy cannot be placed at the destination (the message says why)."""


def _check_members(tar: tarfile.TarFile, root: str) -> list[tarfile.TarInfo]:
    members: list[tarfile.TarInfo] = []
    links: set[str] = set()
    for member in tar:
        name = posixpath.normpath(member.name)
        if name.startswith(("/", "../")) or name == ".." or not (name == root or name.startswith(root + "/")):
            raise CopyError(f"archive entry {member.name!r} is outside the copied path")
        parts = name.split("/")
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise CopyError(f"archive entry {member.name!r} passes through a symbolic link")
        if member.islnk():
            target = posixpath.normpath(member.linkname)
            if not (target == root or target.startswith(root + "/")):
                raise CopyError(f"hard link {member.name!r} points outside the copied path")
        if member.issym():
            links.add(name)
        member.name = name
        members.append(member)
    return members


def extract_copy(archive: IO[bytes], root: str, destination: str) -> None:
    """Place the archive's `root` entry (the copied path's basename) at `destination`.

    `archive` must be seekable (the backend spools the engine's stream to a file first).
    """
    dest = Path(destination)
    if not dest.parent.is_dir():
        raise CopyError(f"destination directory {dest.parent} does not exist")
    final = dest / root if dest.is_dir() and not dest.is_symlink() else dest
    staging = Path(tempfile.mkdtemp(prefix=".coldsnap-copy-", dir=final.parent))
    try:
        with tarfile.open(fileobj=archive, mode="r:*") as tar:
            members = _check_members(tar, root)
            # Members were checked above; keep absolute symlinks as docker cp does.
            if hasattr(tarfile, "fully_trusted_filter"):
                tar.extractall(staging, members=members, numeric_owner=True, filter="fully_trusted")
            else:  # pragma: no cover - Pythons without extraction filters
                tar.extractall(staging, members=members, numeric_owner=True)
        copied = staging / root
        if not copied.exists() and not copied.is_symlink():
            raise CopyError("the archive did not contain the copied path")
        if final.is_dir() and not final.is_symlink():
            if not copied.is_dir() or copied.is_symlink():
                raise CopyError(f"cannot overwrite directory {final} with a non-directory")
            _merge(copied, final)
            return
        if (final.exists() or final.is_symlink()) and copied.is_dir():
            raise CopyError(f"cannot copy a directory onto the file {final}")
        os.replace(copied, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _merge(source: Path, target: Path) -> None:
    """Move `source`'s entries into the existing directory `target` (files overwrite)."""
    for entry in source.iterdir():
        destination = target / entry.name
        if entry.is_dir() and not entry.is_symlink() and destination.is_dir() and not destination.is_symlink():
            _merge(entry, destination)
        else:
            if destination.is_dir() and not destination.is_symlink():
                shutil.rmtree(destination)
            os.replace(entry, destination)

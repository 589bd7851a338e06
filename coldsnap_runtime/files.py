"""One atomic file write for the state both packages keep on disk (image ledgers, session records).

A reader sees the old file or the whole new one, never a torn one, and a crash leaves at most a
hidden temporary beside it: the bytes go to a fresh ``O_EXCL|O_NOFOLLOW`` file in the same
directory, are fsynced, then take the name (``rename`` to replace, ``link`` to create only when
the name is free), and the directory is fsynced so the name survives a power cut.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

__all__ = ("write_atomically",)


def write_atomically(path: Path, data: bytes, *, mode: int = 0o600, exclusive: bool = False) -> None:
    """Write `data` as `path` (created with `mode`); `exclusive`: FileExistsError if `path` exists."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if exclusive:
            os.link(temporary, path, follow_symlinks=False)  # fails if the name is taken, never replaces
        else:
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)

"""The images' small JSON records, read one way: a module of its own (json and a path only) so that a restore
worker reads the records it checks before CRIU starts (the tree's /dev/shm files) without importing the memory
sources (issue 35 item 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import RecordInvalid

__all__ = ("read_record",)


def read_record(images: Path, name: str, kind: str | None) -> dict[str, Any] | None:
    """The images' record `name` as JSON, a format-1 `kind` document (None: the document checks its own kind);
    None when the images hold no such record. A ValueError (RecordInvalid, or the JSON decoder's) says what is
    wrong with it, an OSError why it could not be read: the caller names the record and refuses the restore."""
    path = images / name
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    if not isinstance(stored, dict):
        raise RecordInvalid(f"not a format-1 {kind or 'record'}")
    if kind is not None and (stored.get("kind") != kind or stored.get("format") != 1):
        raise RecordInvalid(f"not a format-1 {kind}")
    return stored

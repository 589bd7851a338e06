"""The host feature profile cache (spec 4): key (its boot id is `_host.boot_id`), atomic write of admitted profiles,
tolerant read."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ._features import attach_criu, decode_profile
from .errors import ProfileError

__all__ = ("cache_key", "cache_path", "read_cached", "write_cached")


def cache_key(boot_id: str, device_identity: str, capsule_digest: str, probe_digest: str, driver: str,
              device: str) -> str:
    """SHA-256 hex of the six inputs, in the controller's order, NUL-joined."""
    parts = (boot_id, device_identity, capsule_digest, probe_digest, driver, device)
    return hashlib.sha256("\x00".join(p.strip() for p in parts).encode("utf-8")).hexdigest()


def cache_path(state: Path, key: str) -> Path:
    return state / "host-feature-profiles" / f"{key}.json"


def write_cached(state: Path, key: str, profile: dict[str, Any]) -> Path:
    """Write atomically (directory 0700, file 0600). Call only after admission succeeded."""
    directory = state / "host-feature-profiles"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    final = cache_path(state, key)
    fd, tmp = tempfile.mkstemp(prefix=f"{key}.json.tmp.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(json.dumps(profile, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def read_cached(state: Path, key: str, driver: str) -> dict[str, Any] | None:
    """The cached profile, or None when absent, truncated or tampered (then probe afresh)."""
    try:
        data = cache_path(state, key).read_bytes()
        return attach_criu(decode_profile(data), driver)
    except (OSError, ProfileError):
        return None

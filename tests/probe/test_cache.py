"""The profile cache: key derivation, private atomic files, tolerance of damaged entries."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from coldsnap_probe import attach_criu, boot_id, cache_key, read_cached, write_cached
from tests.probe.test_features import N610_PASSING


def test_cache_key_is_sha256_of_the_six_inputs_nul_joined_in_order() -> None:
    inputs = ("boot", "610.43.02, GPU-1, NVIDIA GB10, 12.1", "sha256:c", "sha256:p", "n610", "0")
    assert cache_key(*inputs) == hashlib.sha256("\x00".join(inputs).encode()).hexdigest()
    assert cache_key(*inputs) != cache_key(*inputs[:-1], "1")


def test_written_profiles_are_private_and_read_back(tmp_path: Path) -> None:
    path = write_cached(tmp_path, "k" * 64, N610_PASSING)
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # Decoding re-applies the CRIU attachment, idempotently, as the controller does.
    assert read_cached(tmp_path, "k" * 64, "n610") == attach_criu(N610_PASSING, "n610")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left behind


def test_truncated_or_tampered_entries_fall_through_to_a_fresh_probe(tmp_path: Path) -> None:
    path = write_cached(tmp_path, "k" * 64, N610_PASSING)
    path.write_text(path.read_text()[:40])
    assert read_cached(tmp_path, "k" * 64, "n610") is None
    tampered = dict(N610_PASSING, features=[dict(f, status="bogus") for f in N610_PASSING["features"]])
    path.write_text(json.dumps(tampered))
    assert read_cached(tmp_path, "k" * 64, "n610") is None
    assert read_cached(tmp_path, "absent", "n610") is None


def test_boot_id_is_this_boots_trimmed_id() -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert boot_id() == f.read().strip() != ""

"""Canonical JSON and digests shared with the Go controller (spec 5.5).

``canonical_json`` equals Python's ``json.dumps(v, sort_keys=True, separators=(",", ":"),
ensure_ascii=True)`` with NaN/Infinity refused. Values that come from Go structs first
pass through :func:`go_floats`: Go marshals an integral float64 as an integer token.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import NotCanonical

__all__ = ("canonical_json", "digest", "go_floats")


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, ASCII with \\uXXXX escapes, Python-repr floats."""
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except ValueError as exc:
        raise NotCanonical(f"canonical JSON refuses {exc}") from exc
    return text.encode("ascii")


def digest(value: Any) -> str:
    """``sha256:<hex>`` of the canonical JSON of `value`."""
    import hashlib  # here: OpenSSL's load (3-4 ms) is off a restore's path to CRIU (issue 35 item 2)

    return "sha256:" + hashlib.sha256(canonical_json(value)).hexdigest()


def go_floats(value: Any) -> Any:
    """Integral floats below 1e21 become ints (and -0.0 becomes 0), as Go's encoder writes them."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return value
        if value == int(value) and abs(value) < 1e21:
            return int(value)
        return value
    if isinstance(value, dict):
        return {k: go_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [go_floats(v) for v in value]
    return value

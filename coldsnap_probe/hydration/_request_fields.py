"""A node hydrator's request fields checked without touching a file: a weights request's reservation and regions
(`request_regions`), a stage's key (`stage_key`), an adopt's first page (`first_page`); each refusal names the
field and the rule (HydrationError)."""

from __future__ import annotations

from typing import Any

from ..errors import HydrationError
from ._staging import ADOPT_PAGE
from ._weights import WeightRegion, validate_regions

__all__ = ("first_page", "request_regions", "stage_key")


def request_regions(message: dict[str, Any]) -> tuple[int, int, tuple[WeightRegion, ...]]:
    """A `hydrate`, `stage` or weights `adopt` request's reservation and regions, checked without touching a file:
    `base` and `size` non-negative integers (not booleans, nor a float such as JSON's Infinity), `regions` a list
    of weight regions inside that reservation (`validate_regions`); HydrationError naming the field otherwise."""
    base, size, regions = _whole_field(message, "base"), _whole_field(message, "size"), message.get("regions")
    if not isinstance(regions, list):
        raise HydrationError(f"malformed request: regions must be a list of weight regions, not {regions!r:.40}")
    return base, size, validate_regions([WeightRegion.from_json(r) for r in regions], base, size)


def _whole_field(message: dict[str, Any], name: str) -> int:
    value = message.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HydrationError(f"malformed request: {name} must be a non-negative integer, not {value!r:.40}")
    return value


def first_page(value: Any, count: int, taken: int) -> int:
    """An `adopt` request's `first`: a multiple of ADOPT_PAGE below `count`, at most `taken` (the next page)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value % ADOPT_PAGE or value >= count \
            or value > taken:
        raise HydrationError(f"first must be a multiple of {ADOPT_PAGE} below the stage's {count} allocation(s) and "
                             f"at most the next page ({taken}), not {value!r:.40}")
    return value



def stage_key(message: dict[str, Any]) -> str:
    """A stage's key: the manifest digest it was filled for (`sha256:` and 64 hex digits)."""
    key = message.get("key")
    if not isinstance(key, str) or not key.startswith("sha256:") or len(key) != 71 or \
            any(c not in "0123456789abcdef" for c in key[7:]):
        raise HydrationError(f"key must be a manifest digest (sha256: and 64 lowercase hex digits), not {key!r:.80}")
    return key



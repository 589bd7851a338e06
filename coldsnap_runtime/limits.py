"""Limits shared by every package that collects output for one reply."""

from __future__ import annotations

__all__ = ("OUTPUT_LIMIT",)

# Raw output kept for one reply: base64 grows it by 4/3 and the wire caps a reply at 64 MiB.
OUTPUT_LIMIT = 46 << 20

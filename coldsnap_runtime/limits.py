"""Limits shared by every package that collects output for one reply."""

from __future__ import annotations

__all__ = ("CLEANUP_BUDGET_S", "OUTPUT_LIMIT")

# Raw output kept for one reply: base64 grows it by 4/3 and the wire caps a reply at 64 MiB.
OUTPUT_LIMIT = 46 << 20

# The longest a backend's shielded cleanup (removing a cancelled RPC's container, killing an
# exec) may take; a daemon shutting down waits this long, plus a margin, for cancelled requests.
CLEANUP_BUDGET_S = 30.0

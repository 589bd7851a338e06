"""The rows of the allocation-kind benches, in one place: each way an engine holds device memory is an engine
command and the environment it runs with (issue 36 item 5), and what a capture's report says it moved.

Three benches run these rows: bench/restore_ttft.py (`--rows`: one row beside its other dimensions),
bench/restore_rows.py (side by side, outside the daemon) and bench/e2e_rows.py (side by side, through the daemon in
capsules). Another engine or allocator is one more entry in `ROWS`. Every engine takes ttft_server.py's
`--gib/--weights/--socket`, speaks its protocol (one JSON request line on a Unix socket, a `token` line per token,
then `done` with the first logits' digest) and writes its stage lines.

`coverage` reads a capture report's `device_memory[]`: `moved` is what the interposer released and moved at line
rate, per kind; `uncovered` is what stayed on the CUDA checkpoint path, per kind (docs/interposer.md). Host memory
(CRIU moves it) and a count of unwrapped entry points are not device bytes left behind.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coldsnap_probe.hydration import ENGINE_DEFAULTS

HOST_KINDS = frozenset({"host_pinned", "host_registered", "unwrapped_entry_points"})
PROMPT = [1, 15043, 29892, 920, 526, 366, 29973, 13]  # every row's request (ids inside the engines' 32000 vocabulary)


@dataclass(frozen=True)
class Row:
    """An engine (its script under engines/ and its own options) and the environment it runs with."""

    label: str
    script: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()  # the engine's own options, before --gib/--weights/--socket

    def command(self, python: str = sys.executable, engines: str = str(ROOT / "engines")) -> list[str]:
        """The engine's command line: with this interpreter here, or (a capsule) the unit's and its mount."""
        return [python, f"{engines}/{Path(self.script).name}", *self.args]


ROWS = {
    "torch": Row("PyTorch, default caching allocator", "engines/ttft_server.py"),
    "torch-expandable": Row("PyTorch, expandable_segments:True", "engines/ttft_server.py",
                            {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    "torch-async": Row("PyTorch, backend:cudaMallocAsync", "engines/ttft_server.py",
                       {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    # The capsule's environment for a JAX engine (docs/interposer.md, "JAX and XLA"): a pool that grows.
    "jax": Row("JAX (XLA BFC, XLA_PYTHON_CLIENT_PREALLOCATE=false)", "engines/jax_server.py", dict(ENGINE_DEFAULTS)),
    # No pool: each buffer its own allocation (cuMemCreate in the CUDA 13 plugin), so only what is live is moved.
    "jax-platform": Row("JAX (XLA_PYTHON_CLIENT_ALLOCATOR=platform)", "engines/jax_server.py",
                        {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}),
    # Two processes, vLLM V1's shape: a front end and its engine core (the only one holding the GPU), one tree.
    "split": Row("two processes: front end + engine core (ttft_server's model)", "engines/split_server.py",
                 args=("--cuda",)),
    # The `torch` row with the stack limit kept through the checkpoint (the interposer lowers it by default): the
    # side by side of what the smaller checkpoint saves (docs/interposer.md, "A smaller CUDA checkpoint").
    "torch-stack-kept": Row("PyTorch, default allocator, stack limit kept (SHRINK_STACK=0)", "engines/ttft_server.py",
                            {"COLDSNAP_CUDA_INTERPOSER_SHRINK_STACK": "0"}),
}


def row_list(text: str, known: Sequence[str] = tuple(ROWS)) -> list[str]:
    """A comma list of row names, each one of `known`, in order (an argparse type: a bad one is refused naming
    the rows there are)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(known)}")
    if not names:
        raise argparse.ArgumentTypeError(f"no row named: give a comma list of {', '.join(known)}")
    return names


def _moved(device: dict[str, Any]) -> dict[str, int]:
    """A process's bytes moved at line rate, per allocation kind."""
    moved = device.get("moved")
    if moved is None:  # a report from before the per-kind counts: a released process moved all it dumped
        return {"released": int(device.get("bytes") or 0)} if device.get("state") == "released" else {}
    return {kind: int((seen or {}).get("bytes") or 0) for kind, seen in moved.items()}


def coverage(device_memory: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What a capture moved at line rate (in all and per allocation kind), what stayed on the checkpoint path per
    device kind, and the moved share of both (0.0 when the interposer saw nothing)."""
    kinds: dict[str, int] = {}
    left: dict[str, int] = {}
    for device in device_memory or []:
        for kind, size in _moved(device).items():
            kinds[kind] = kinds.get(kind, 0) + size
        for kind, value in (device.get("uncovered") or {}).items():
            if kind not in HOST_KINDS and (value or {}).get("bytes"):
                left[kind] = left.get(kind, 0) + int(value["bytes"])
    moved = sum(kinds.values())
    total = moved + sum(left.values())
    return {"moved_bytes": moved, "moved_kinds": {k: v for k, v in sorted(kinds.items()) if v}, "left_bytes": left,
            "moved_share": moved / total if total else 0.0}


def left_text(left: dict[str, int]) -> str:
    """What stayed on the checkpoint path, per kind, largest unit first ("-" for nothing)."""
    return ", ".join(f"{kind} {size / 1e9:.2f} GB" if size >= 1e9 else f"{kind} {size / 1e6:.1f} MB"
                     for kind, size in sorted(left.items())) or "-"

"""Restore to first token for each way engines hold device memory, side by side (run on the GPU machine).

    python bench/restore_rows.py --criu /path/to/criu [--sizes 2,16] [--restores 3] [--rows torch,jax,...]

A row is an engine command and its environment (`ROWS`; another engine or allocator is one more entry): each is
run, unchanged, under the CUDA interposer by bench/restore_ttft.py's `run_size` (weights made on the GPU, the
node hydrator staging the dumps while CRIU restores unless `--no-hydrator`): a cold start to its first token, a
capture by the worker, `--restores` restores from the same images, each to its first token, with the same
tokens and bitwise the same first-step logits as the cold start. Per row the table says what the capture saw:
the engine's device bytes, the share the interposer moved at line rate (released regions against everything the
process allocated from the device), and what stayed on the CUDA checkpoint path, per kind
(`device_memory[].uncovered`: docs/interposer.md).

The uvicorn-on-uvloop row is not run here: it needs the daemon and a capsule (bench/e2e_serve.py, `scripts/device
serve`), and would not fit this call beside the others. Its recorded run (`--serve-result`, a `restores-*.json`
of bench/e2e_serve.py) is printed beside the rows, named as recorded, with its date.
Results: a table on stdout, JSON in --out (restore_rows.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import restore_ttft
from bench._common import become_subreaper, table
from coldsnap_probe.hydration import ENGINE_DEFAULTS

# Allocations that are not the engine's device memory (host memory CRIU moves, a count of entry points).
HOST_KINDS = frozenset({"host_pinned", "host_registered", "unwrapped_entry_points"})
SERVE_RESULT = ROOT / "bench" / "results" / "h200-serve-100-restores-uvloop-2026-12-01" / \
    "restores-full-interposer-hydrator.json"


@dataclass(frozen=True)
class Row:
    """An engine (its command, taking ttft_server.py's --gib/--weights/--socket and speaking its protocol and
    stages) and the environment it runs with."""

    label: str
    script: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()  # the engine's own options, before run_size's --gib/--weights/--socket

    def command(self) -> list[str]:
        return [sys.executable, str(ROOT / self.script), *self.args]


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
}


def coverage(device_memory: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What a capture's interposer moved (released regions' bytes), what stayed on the checkpoint path per kind
    (device memory only) and the moved share of both."""
    moved, left = 0, {}
    for device in device_memory or []:
        if device.get("state") == "released":
            moved += int(device.get("bytes", 0))
        for kind, value in (device.get("uncovered") or {}).items():
            if kind not in HOST_KINDS and value.get("bytes"):
                left[kind] = left.get(kind, 0) + int(value["bytes"])
    total = moved + sum(left.values())
    return {"moved_bytes": moved, "left_bytes": left, "moved_share": moved / total if total else 0.0}


def left_text(left: dict[str, int]) -> str:
    return ", ".join(f"{kind} {size / 1e9:.2f} GB" if size >= 1e9 else f"{kind} {size / 1e6:.1f} MB"
                     for kind, size in sorted(left.items())) or "-"


def row_cells(name: str, result: dict[str, Any]) -> list[str]:
    restores = result["restores"]
    best = min(restores, key=lambda r: r["ttft_s"])
    others = " / ".join(f"{r['ttft_s']:.2f}" for r in restores if r is not best)
    moved = coverage(result.get("capture_device_memory"))
    capture = sum(result["capture"].get(k, 0.0) for k in restore_ttft.CAPTURE_PARTS)
    return [f"{result['gib']:g} GiB", name, f"{result['cold']['ttft_s']:.2f}", f"{best['ttft_s']:.2f} / {others}",
            f"{best['criu_restore_s']:.2f} / {best['cuda_restore_s']:.2f} / {best['wake_s']:.2f}",
            f"{capture:.2f}", f"{result['device_bytes'] / 1e9:.2f}",
            f"{moved['moved_bytes'] / 1e9:.2f} ({moved['moved_share']:.0%})", left_text(moved["left_bytes"]),
            "yes" if all(r["tokens_identical"] and r["logits_identical"] for r in restores) else "NO"]


def serve_cells(path: Path) -> list[str]:
    """The recorded uvicorn-on-uvloop row (bench/e2e_serve.py through the daemon), in the table's columns."""
    recorded = json.loads(path.read_text())
    restores = recorded["restores"]
    ttfts = sorted(r["first_token_s"] for r in restores)
    phases = recorded["capture_phases"]
    left = {k: v for k, v in (phases.get("uncovered_bytes") or {}).items() if k not in HOST_KINDS and v}
    moved = phases.get("device_bytes") or 0
    loops = sorted(set((recorded.get("event_loops") or {}).values()))
    best = min(restores, key=lambda r: r["first_token_s"])
    return [f"{moved / 1e9:.1f} GB", f"uvicorn on {'/'.join(loops) or '?'} (transformers serve, daemon; recorded "
            f"{path.parent.name or path.name})", f"{recorded['cold']['first_token_s']:.2f}",
            f"{ttfts[0]:.2f} / p50 {ttfts[len(ttfts) // 2]:.2f} of {len(ttfts)}",
            f"{best['criu_s']:.2f} / {best['cuda_s']:.2f} / {best.get('device_hydration_s') or 0:.2f}",
            f"{sum(v or 0 for k, v in phases.items() if k.endswith('_s') and k != 'exec_s'):.2f}",
            f"{moved / 1e9:.2f}", f"{moved / 1e9:.2f} ({moved / max(1, moved + sum(left.values())):.0%})",
            left_text(left), "yes" if all(r.get("identical") for r in restores) else "NO"]


def run_rows(args: argparse.Namespace, root: Path, library: Path, strategy: str) -> tuple[list[Any], list[Any]]:
    results, failed = [], []
    for size in [float(s) for s in args.sizes.split(",")]:
        for name in args.rows.split(","):
            row = ROWS[name]
            restore_ttft.progress(f"row {name}: {row.label}, {size:g} GiB")
            try:
                result = restore_ttft.run_size(size, root, args.criu, args.tokens, False, Path("device"), [],
                                               strategy, Path(args.images_root), interposer=library,
                                               device_weights=True,
                                               count=args.restores, command=row.command(), engine_env=row.env)
            except Exception as exc:  # one failed row is a result; the other rows still run
                restore_ttft.stop_started()
                print(f"{size:g} GiB {name}: FAILED: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)
                failed.append({"gib": size, "row": name, "error": f"{type(exc).__name__}: {str(exc)[-6000:]}"})
                continue
            results.append({**result, "row": name, "label": row.label, "env": row.env,
                            "coverage": coverage(result.get("capture_device_memory"))})
            Path(args.out, "restore_rows.partial.json").write_text(json.dumps(results, indent=2))
    return results, failed


def known_rows(text: str) -> str:
    if unknown := [r for r in text.split(",") if r not in ROWS]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(ROWS)}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,16")
    parser.add_argument("--rows", default=",".join(ROWS), type=known_rows, help=f"comma-separated: {', '.join(ROWS)}")
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--criu", default="criu")
    parser.add_argument("--root", default="/tmp/coldsnap-rows")
    parser.add_argument("--images-root", default="/dev/shm/coldsnap-rows", help="where the images go (tmpfs: one "
                        "row's at a time, removed after it)")
    parser.add_argument("--no-hydrator", action="store_true", help="the interposer fills its regions itself")
    parser.add_argument("--serve-result", default=str(SERVE_RESULT), help="a recorded bench/e2e_serve.py "
                        "restores-*.json for the uvicorn-on-uvloop row (\"\" for none)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.restores < 1:
        parser.error(f"--restores must be at least 1, not {args.restores}")
    if args.serve_result and not Path(args.serve_result).is_file():
        parser.error(f"--serve-result: {args.serve_result} is not a file")
    become_subreaper()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    Path(args.images_root).mkdir(parents=True, exist_ok=True)
    from coldsnap_probe.hydration import library_path

    library = library_path(root / "interposer-lib")
    hydrator, strategy = None, "register"
    if not args.no_hydrator:
        hydrator, _ = restore_ttft.start_hydrator(root / "hydrator.sock", None, root / "hydrator.log")
        strategy = f"hydrator:{root / 'hydrator.sock'}"
    restore_ttft.BASELINE_MIB = restore_ttft.gpu_used_mib()  # the hydrator's context: what stays used between rows
    started = time.time()
    try:
        results, failed = run_rows(args, root, library, strategy)
    finally:
        if hydrator is not None:
            hydrator.kill()
            hydrator.wait()
    cells = [row_cells(r["label"], r) for r in results]
    if args.serve_result:
        cells.append(serve_cells(Path(args.serve_result)))
    print(table(["model", "engine, allocator", "cold TTFT s", "restore TTFT s (best / others)",
                 "restore CRIU / CUDA / device hydration s", "capture s", "device GB",
                 "moved at line rate GB (% of device)", "left on the checkpoint path", "identical tokens+logits"],
                cells))
    for fail in failed:
        print(f"FAILED {fail['gib']:g} GiB {fail['row']}: {fail['error'][-400:]}")
    Path(args.out, "restore_rows.json").write_text(json.dumps(
        {"rows": {name: {"label": row.label, "script": row.script, "env": row.env, "args": row.args}
                  for name, row in ROWS.items()},
         "seconds": time.time() - started, "results": results, "failed": failed, "serve_result": args.serve_result},
        indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

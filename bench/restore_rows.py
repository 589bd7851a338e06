"""Restore to first token for each way engines hold device memory, side by side (run on the GPU machine).

    python bench/restore_rows.py --criu /path/to/criu [--sizes 2,16] [--restores 3] [--rows torch,jax,...]

A row is an engine command and its environment (bench/engine_rows.py's `ROWS`, which bench/e2e_rows.py runs
through the daemon and bench/restore_ttft.py's `--rows` beside its other dimensions): each is run, unchanged,
under the CUDA interposer by bench/restore_ttft.py's `run_size` (weights made on the GPU, the node hydrator
staging the dumps while CRIU restores unless `--no-hydrator`): a cold start to its first token, a capture by the
worker, `--restores` restores from the same images, each to its first token, with the same tokens and bitwise the
same first-step logits as the cold start. Per row the table says what the capture saw: the engine's device bytes,
the share the interposer moved at line rate, and what stayed on the CUDA checkpoint path, per kind
(`device_memory[].moved` / `uncovered`: docs/interposer.md).

The uvicorn-on-uvloop row is not run here: bench/e2e_rows.py runs it through the daemon beside the other rows
(`scripts/device daemon-rows`). Its recorded run (`--serve-result`, a `restores-*.json` of bench/e2e_serve.py) is
printed beside the rows, named as recorded, with its date.
Results: a table on stdout, JSON in --out (restore_rows.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import restore_ttft
from bench._common import become_subreaper, table
from bench.engine_rows import HOST_KINDS, ROWS, coverage, left_text, row_list

SERVE_RESULT = ROOT / "bench" / "results" / "h200-serve-100-restores-uvloop-2026-12-01" / \
    "restores-full-interposer-hydrator.json"


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
        for name in args.rows:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,16")
    parser.add_argument("--rows", default=list(ROWS), type=row_list, help=f"comma-separated: {', '.join(ROWS)}")
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

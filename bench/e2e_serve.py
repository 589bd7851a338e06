"""A server people run, unchanged (issue 23): `transformers serve` captured and restored through the daemon.

    python bench/e2e_serve.py --state-dir DIR --capsule TAG --model DIR --work DIR --out DIR
                              [--modes full-interposer-hydrator,full-interposer,adapter-hydrator,full]
                              [--restores 3] [--port 18471]
                              [--images-root DIR] [--criu-threads N] [--build CONTEXT=TAG] [--faults]

Against a running `coldsnap-provider serve` (`[gpus] mode = "native"`), through the public client only
(bench/e2e_restore.py's `Driver`, runtime-v1 envelopes), for each path of `--modes` in one run
(bench/serve_units.py says what each path's unit environment adds; the server's command line never changes):

1. the model folder is checked (weights, config, tokenizer with a chat template) before any unit exists, and
   for `full-interposer*` a disposable run checks that the capsule's interposer library loads; a path with a
   node hydrator starts it once, beside the cold server (not part of any Docker-to-first-token): the weights'
   (`adapter-hydrator`) or the staging one (`full-interposer-hydrator`), removed with the path's units;
2. the capsule is pinned by image ID; the server runs as a detached unit on the host network with GPU 0:
   `transformers serve /weights --device cuda:0 --host 127.0.0.1 --port P` (its own command line, uvicorn
   and all) under the capsule's init (`engine_llama.py launch`: PID floor, session leader, stdio on
   /dev/null); cold Docker-to-first-token runs from `workload-run` to the first content chunk of a
   streaming `/v1/chat/completions` request (greedy, fixed seed), retried while the port is closed;
3. capture with the worker in the capsule (`workload-exec python3 -m coldsnap_probe capture`), the server
   idle: `full-interposer*` has the CUDA interposer dump and release every device allocation before the CUDA
   lock (the worker finds its socket in the server's environment), `adapter*` release the weights, `full`
   checkpoints everything; the capture's phases go into the capture table;
4. `--restores` times: a new restore unit (the worker restoring as its command), and the client's
   request sent as soon as the restored port accepts a connection; restored Docker-to-first-token runs
   from that unit's `workload-run` to the first content chunk, with the worker's phases (CRIU, CUDA, the
   interposer's device hydration, "staged" where the node hydrator filled it while CRIU ran, the weights'
   hydration). Every completion must equal the cold one, and no unit of the path is left at its end.

With `--faults` (bench/serve_faults.py), on the images of the fastest path that restored: capture while a
request streams, restore whose port is taken, a client that disconnects during restore, a model folder
without its tokenizer, and a server that forks workers (each on the GPU, under that path's environment).
`--images-root` puts the images elsewhere (tmpfs: `/dev/shm/...`); at most one path's images are kept once
its run ends (with `--faults`, the best path for them so far), so two sets at most are on disk at a time.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.e2e_restore import (
    Driver,
    E2EError,
    capture,
    engine_stages,
    inspect_capsule,
    start_cell,
    start_hydrator,
    wait_hydrator,
)
from bench.interposer_units import InterposerLayout, check_interposer, device_cell, start_staging_hydrator
from bench.serve_client import ClientError
from bench.serve_faults import faults
from bench.serve_units import (
    MODES,
    capture_row,
    cluster,
    descriptors,
    keep_images,
    node_hydrator,
    plan_modes,
    restore_once,
    serve_layout,
    start_cold,
)
from engines.serve_model import ModelFolderError, check_folder


def images_bytes(images: Path) -> dict[str, int]:
    """The capture's size on disk: everything, and the interposer's device dumps (`device-<pid>/`) among it."""
    files = [p for p in images.rglob("*") if p.is_file()]
    dumps = [p for p in files if p.relative_to(images).parts[0].startswith("device-")]
    return {"images_bytes": sum(p.stat().st_size for p in files),
            "device_dump_bytes": sum(p.stat().st_size for p in dumps)}


async def capture_server(d: Driver, mode: str, layout: InterposerLayout, serving: str, pid: int,
                         result: dict[str, Any]) -> str:
    """The worker captures the idle server; its phases go into `result`; returns the capture's ID."""
    capture_id = f"serve-{mode}-{time.strftime('%Y%m%dT%H%M%S')}"
    try:
        result["capture"] = await capture(d, serving, pid, layout, capture_id, hydrate=mode.startswith("adapter"))
    except E2EError:
        result["server_descriptors"] = await descriptors(d, serving, pid)
        print(f"[{mode}] the server's descriptors:\n{result['server_descriptors']}", flush=True)
        raise
    result["capture_phases"] = capture_row(result["capture"])
    result.update(images_bytes(layout.images_dir / capture_id))
    print(f"[{mode}] captured: {json.dumps(result['capture_phases'])}", flush=True)
    return capture_id


def unit_names(mode: str) -> tuple[str, str, str]:
    """A path's units: its cold server, its restore unit, its node hydrator (if the path runs one)."""
    return f"serve-{mode}-cold", f"{cluster(mode)}_node_0", f"serve-{mode}-hydrator"


async def start_node_hydrator(d: Driver, mode: str, image: str, layout: InterposerLayout) -> dict[str, Any] | None:
    """The path's node hydrator, started once before its cold server (None: the path runs none): the weights'
    (the shards page-locked once) or the staging one (the interposer's dumps staged while CRIU restores). A
    node service serving every restore on the node, so not part of any Docker-to-first-token."""
    kind, name = node_hydrator(mode), unit_names(mode)[2]
    if kind == "weights":
        return await start_hydrator(d, image, layout, name)
    if kind == "staging":
        return await start_staging_hydrator(d, image, layout, name)
    return None


async def serve_and_capture(d: Driver, args: argparse.Namespace, mode: str, image: str, layout: InterposerLayout,
                            result: dict[str, Any]) -> str:
    """The checks, the node hydrator, the cold server and its first token, the capture; the capture's ID."""
    serving, _, sidecar = unit_names(mode)
    if mode.startswith("full-interposer"):
        await check_interposer(d, image, layout)
    service = await start_node_hydrator(d, mode, image, layout)
    cold = result["cold"] = await start_cold(d, image, layout, serving, args.port)
    if service:
        result["hydrator"] = await wait_hydrator(d, sidecar, service["created_unix"])
    print(f"[{mode}] cold Docker-to-first-token {cold['first_token_s']:.2f} s: {cold['text'][:80]!r}", flush=True)
    capture_id = await capture_server(d, mode, layout, serving, int(cold["server_pid"]), result)
    await d.expect(f"removing {serving}", "workload-remove", name=serving)
    return capture_id


def restore_summary(restored: dict[str, Any]) -> str:
    """A restore's phases in one line (the run's log)."""
    staged = {None: "", True: ", staged", False: f", not staged: {restored.get('device_stage_errors')}"}
    return (f"Docker-to-first-token {restored['first_token_s']:.2f} s (CRIU {restored['criu_s']}, CUDA "
            f"{restored['cuda_s']}, device {restored['device_hydration_s']}{staged[restored.get('device_staged')]}, "
            f"weights {restored['hydration_s']}; ready->first token {_f(restored.get('after_ready_first_token_s'))}, "
            f"a 2nd request {_f(restored.get('second_request_to_first_token_s'))}), identical {restored['identical']}; "
            f"from the request: {start_cell(restored)}")


async def remove_units(d: Driver, mode: str, result: dict[str, Any]) -> None:
    """Remove every unit of the path, then check with the daemon that none is left (a failed path too)."""
    names = unit_names(mode)
    for name in names:
        await d.runtime("workload-remove", name=name)
    left = [name for name in names if not await d.gone(name)]
    if left:
        result.update(ok=False, units_left=left)
        print(f"[{mode}] units left after the path: {', '.join(left)}", flush=True)


def progress(out: str, mode: str, result: dict[str, Any]) -> None:
    """The path's restores so far (`restores-<mode>.json`, for bench/restore_tail.py): a long run cut short by its
    time limit keeps every restore it finished."""
    capture = result.get("capture") or {}
    Path(out, f"restores-{mode}.json").write_text(json.dumps({
        "mode": mode, "cold": result.get("cold"), "capture_phases": result.get("capture_phases"),
        "event_loops": capture.get("event_loops") if isinstance(capture, dict) else None,
        "restores": result["restores"]}, indent=1, default=str))


async def run_mode(d: Driver, args: argparse.Namespace, mode: str, image: str) -> dict[str, Any]:
    work = Path(args.work) / mode
    shutil.rmtree(work, ignore_errors=True)
    layout = serve_layout(work, Path(args.model), mode, criu_threads=args.criu_threads)
    if args.images_root:
        layout.images_dir = Path(args.images_root) / mode
        shutil.rmtree(layout.images_dir, ignore_errors=True)
    layout.prepare()
    unit = unit_names(mode)[1]
    result: dict[str, Any] = {"mode": mode, "ok": False, "restores": [], "environment": layout.extra_environment}
    try:
        capture_id = await serve_and_capture(d, args, mode, image, layout, result)
        for attempt in range(args.restores):
            restored = await restore_once(d, image, layout, unit, capture_id, cluster(mode), args.port)
            restored["identical"] = restored["text"] == result["cold"]["text"]
            result["restores"].append(restored)
            print(f"[{mode}] restore {attempt + 1}: {restore_summary(restored)}", flush=True)
            progress(args.out, mode, result)
        result["capture_id"] = capture_id
        result["ok"] = bool(result["restores"]) and all(r["identical"] for r in result["restores"])
    except (E2EError, ClientError, OSError, ValueError, KeyError, TimeoutError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{mode}] FAILED: {result['error'][:3000]}", flush=True)
        result["server_log_tail"] = engine_stages(layout)[-6:]
    finally:
        await remove_units(d, mode, result)
    result["layout"] = layout
    return result


# ---------------------------------------------------------------------------------------------------------------
# The tables


def _f(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


RESTORE_HEAD = ("| mode | run | Docker-to-first-token s | speed-up | create/start s | worker start s | CRIU s | CUDA s "
                "| device hydration s | weights hydration s | port accepted s | request->first token s "
                "| ready->first token s | warm / 2nd request->first token s | completion s | = cold |")


def restore_lines(r: dict[str, Any]) -> list[str]:
    """A path's rows of the restore table: its cold start, each restore, or why it failed."""
    lines, cold = [], r.get("cold")
    if cold:
        lines.append(f"| {r['mode']} | cold | {_f(cold['first_token_s'])} | 1x | {_f(cold['create_start_s'])} "
                     f"| - | - | - | - | - | {_f(cold['connected_s'])} | {_f(cold['request_to_first_token_s'])} "
                     f"| - | {' / '.join(map(_f, cold.get('warm_request_to_first_token_s') or [])) or '-'} "
                     f"| {_f(cold['completion_s'])} | - |")
    for i, x in enumerate(r.get("restores", []), 1):
        speed = f"{cold['first_token_s'] / x['first_token_s']:.1f}x" if cold and x["first_token_s"] else "-"
        device = device_cell(x)
        lines.append(
            f"| {r['mode']} | restore {i} | {_f(x['first_token_s'])} | {speed} | {_f(x['create_start_s'])} "
            f"| {_f(x['worker_started_s'])} | {_f(x['criu_s'])} | {_f(x['cuda_s'])} | {device} "
            f"| {_f(x['hydration_s'])} | {_f(x['connected_s'])} | {_f(x['request_to_first_token_s'])} "
            f"| {_f(x.get('after_ready_first_token_s'))} | {_f(x.get('second_request_to_first_token_s'))} "
            f"| {_f(x['completion_s'])} | {x['identical']} |")
    if r.get("error"):
        lines.append(f"| {r['mode']} | failed: {r['error'][:300]} |" + " |" * 14)
    return lines


CAPTURE_HEAD = ("| mode | device release s | weights release s | CUDA lock s | CUDA checkpoint s | CRIU dump s "
                "| images GB (device dumps GB) | left on the checkpoint path |")


def capture_line(r: dict[str, Any]) -> str | None:
    """A path's row of the capture table (None when it never captured)."""
    c = r.get("capture_phases")
    if not c:
        return None
    device = _f(c["device_release_s"])
    if c["device_bytes"] is not None:
        states = "/".join(c["device_states"])
        device += f" ({c['device_bytes'] / 1e9:.2f} GB at {c['device_gbps'] or 0:.1f} GB/s, {states})"
    weights = _f(c["weights_release_s"])
    if c["weights_bytes"]:
        weights += f" ({c['weights_bytes'] / 1e9:.2f} GB)"
    left = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in c["uncovered_bytes"].items()) or "-"
    return (f"| {r['mode']} | {device} | {weights} | {_f(c['cuda_lock_s'])} | {_f(c['cuda_checkpoint_s'])} "
            f"| {_f(c['criu_dump_s'])} | {r.get('images_bytes', 0) / 1e9:.2f} "
            f"({r.get('device_dump_bytes', 0) / 1e9:.2f}) "
            f"| {left} |")


def table(results: list[dict[str, Any]], capsule: dict[str, Any], model_bytes: int) -> str:
    lines = [RESTORE_HEAD, "|" + " --- |" * 16]
    for r in results:
        lines += restore_lines(r)
    lines += ["", CAPTURE_HEAD, "|" + " --- |" * 8]
    lines += [line for r in results if (line := capture_line(r))]
    lines += ["", f"Capsule {capsule.get('id', '')[:19]}: {capsule.get('size', 0) / 1e6:.0f} MB; model "
              f"{model_bytes / 1e9:.2f} GB."]
    for r in results:
        lines += path_notes(r)
    return "\n".join(lines)


def path_notes(r: dict[str, Any]) -> list[str]:
    """What a path's rows cannot say: its cold completion, each restore whose device dump the node hydrator
    was asked to stage but did not (and why), and any unit the path left behind."""
    lines = []
    if r.get("cold"):
        lines.append(f"{r['mode']} cold completion ({r['cold']['chunks']} chunks, "
                     f"{r['cold']['finish_reason']}): {r['cold']['text'][:120]!r}")
    for i, x in enumerate(r.get("restores", []), 1):
        if x.get("device_staged") is False:
            why = "; ".join(x.get("device_stage_errors") or []) or "no reason reported"
            lines.append(f"{r['mode']} restore {i}: the device dump was not staged, the interposer filled it: {why}")
    if r.get("units_left"):
        lines.append(f"{r['mode']}: units left after the path: {', '.join(r['units_left'])}")
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--capsule", required=True)
    parser.add_argument("--model", required=True, help="the model folder (weights, config, tokenizer)")
    parser.add_argument("--work", required=True, help="host directory for run directories (and the images)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default="full-interposer-hydrator,full-interposer,adapter-hydrator,full",
                        help=f"comma list, run in this order: {', '.join(MODES)}")
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--port", type=int, default=18471)
    parser.add_argument("--images-root", help="where the CRIU images and device dumps go (default: under --work)")
    parser.add_argument("--criu-threads", type=int, default=0,
                        help="the restore's CRIU_RESTORE_THREADS (default unset: CRIU's own, the CPUs it may use)")
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--build", action="append", default=[], metavar="CONTEXT=TAG")
    return parser


async def build_capsules(d: Driver, items: list[str]) -> list[dict[str, Any]]:
    builds = []
    for item in items:
        context, _, tag = item.partition("=")
        started = time.time()
        await d.expect(f"image-build of {tag}", "image-build", build={
            "dockerfile": base64.b64encode(Path(context, "Dockerfile").read_bytes()).decode(), "context": context,
            "tag": tag, "pull": False})
        builds.append({"tag": tag, "seconds": time.time() - started})
    return builds


async def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    try:
        modes = plan_modes(args.modes)
    except ValueError as exc:
        parser.error(f"--modes: {exc}")
    try:
        shards = check_folder(args.model)
    except ModelFolderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    d = Driver(Path(args.state_dir))
    await d.open()
    out: dict[str, Any] = {"prepare": {"builds": await build_capsules(d, args.build), "shards": shards,
                                       "modes": modes}}
    capsule = out["prepare"]["capsule"] = await inspect_capsule(d, args.capsule)
    model_bytes = sum(p.stat().st_size for p in Path(args.model).iterdir() if p.is_file())
    results: list[dict[str, Any]] = []
    kept: dict[str, Any] | None = None  # Invariant: the only path whose images are still on disk
    for mode in modes:
        results.append(await run_mode(d, args, mode, str(capsule["id"])))
        kept, discard = keep_images(kept, results[-1]) if args.faults else (None, results[-1])
        if discard is not None:
            shutil.rmtree(discard["layout"].images_dir, ignore_errors=True)
        # After each path, so that a run cut short by its time limit still leaves the paths it finished.
        Path(args.out, "serve.json").write_text(json.dumps({**out, "results": results}, indent=1, default=str))
        Path(args.out, "serve-table.md").write_text(table(results, capsule, model_bytes) + "\n")
    if args.faults:
        out["faults"] = await faults(d, args, str(capsule["id"]), results)
        for row in out["faults"]:
            print(json.dumps(row)[:1200], flush=True)
    for r in results:
        shutil.rmtree(r.pop("layout").images_dir, ignore_errors=True)
    text = table(results, capsule, model_bytes)
    print(text, flush=True)
    out["results"] = results
    Path(args.out, "serve.json").write_text(json.dumps(out, indent=1, default=str))
    Path(args.out, "serve-table.md").write_text(text + "\n")
    ok = all(r["ok"] for r in results) and all(r["ok"] for r in out.get("faults", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

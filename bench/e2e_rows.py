"""Each way engines hold device memory, restored to its first token through the daemon (issue 36 item 5).

    python bench/e2e_rows.py --state-dir DIR --capsule TAG --work DIR --out DIR
                             [--rows torch,torch-stack-kept,torch-expandable,torch-async,split,uvloop,jax,jax-platform]
                             [--gib 16] [--restores 3] [--build CONTEXT=TAG] [--images-root DIR] [--model DIR] [--cpu]

Against a running `coldsnap-provider serve`, as the controller drives it: runtime-v1 envelopes through the public
client only (bench/e2e_restore.py's `Driver`): the capsule's image-build (`--build`) and pinning by image ID, then
for each row, unchanged (bench/engine_rows.py: the engine from the capsule's /opt/engine and the row's environment;
the CUDA interposer and the staging node hydrator enabled by two more lines of the unit's environment,
bench/interposer_units.py):

1. the engine as a detached unit under the capsule's init (`engine_llama.py launch`: PID floor, session leader),
   its weights made on the GPU (`--gib`); cold Docker-to-first-token from `workload-run` to the first token of a
   request on its socket, the request retried while the socket is not there;
2. the worker's capture inside that unit (`workload-exec python3 -m coldsnap_probe capture`), the engine idle;
   the unit removed;
3. `--restores` times a restore unit (`workload-run`, the worker restoring as its command, the readiness check by
   `workload-exec`, `workload-inspect`), the client's request sent as soon as the restored socket accepts;
   Docker-to-first-token from that `workload-run` to the first token, with the worker's phases. Every restore
   must give the cold start's tokens and first logits bit for bit; no unit of the row is left at its end.

The `uvloop` row is bench/e2e_serve.py's `full-interposer-hydrator` path: `transformers serve` (uvicorn on uvloop)
from `--model`, over HTTP, identical completions. One staging node hydrator serves every other row, started
before the first (a node service: part of no Docker-to-first-token) and removed at the end.

The table: per row the restores' Docker-to-first-token, the fastest one's worker start / CRIU / CUDA / device
hydration, what the capture moved at line rate and what stayed on the checkpoint path (the report's
`device_memory[].moved` / `uncovered`), the event loop the capture saw, identical outputs, and the goal (every
restore ≤ 1.5 s with ≥ 95 % moved). `--cpu` runs the rows whose engine runs without a GPU (the two-process
server's toy model) with no GPU, interposer or node hydrator: the daemon path alone, on any Docker host.
Results: the table on stdout and in rows-table.md, JSON in rows.json (rows.partial.json until the run ends).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import e2e_serve
from bench._common import table
from bench.e2e_restore import (
    ENGINE,
    HOST_MOUNTS,
    RUN,
    WORKER_PATH,
    Driver,
    E2EError,
    Layout,
    Stream,
    await_unit,
    capture,
    inspect_capsule,
    launch_unit,
    output,
    start_cell,
    stream_tokens,
    unit_labels,
    wait_hydrator,
)
from bench.engine_rows import PROMPT, ROWS, coverage, left_text, row_list
from bench.interposer_units import (
    InterposerLayout,
    check_interposer,
    device_cell,
    device_hydration,
    device_staging,
    interposer_environment,
    start_staging_hydrator,
)
from bench.serve_client import ClientError
from bench.serve_units import STAGED, capture_row, launcher, server_pid, together, watch_server
from engines.serve_model import ModelFolderError, check_folder

UVLOOP = "uvloop"  # transformers serve on uvicorn with uvloop: bench/e2e_serve.py's staged interposer path
E2E_ROWS = (*ROWS, UVLOOP)
# A run's default order: the rows that restore today first, JAX's last (its CUDA restore is being diagnosed), so a
# run cut by its call's time limit loses the least (rows.partial.json keeps each row as it ends).
DEFAULT_ROWS = ("torch", "torch-stack-kept", "torch-expandable", "torch-async", "split", UVLOOP, "jax", "jax-platform")
CPU_ROWS = ("split",)  # engines that serve without a GPU when the row's own options are left out (a toy model)
HYDRATOR_UNIT = "rows-node-hydrator"
TOKENS = 16
GOAL_S, GOAL_SHARE = 1.5, 0.95  # issue 36: each restore to its first token, the device bytes moved at line rate


def plan_rows(text: str, *, cpu: bool, model: str) -> list[str]:
    """A run's rows, in order; ValueError names what cannot run (a GPU row with --cpu, `uvloop` without a model)."""
    try:
        rows = row_list(text, E2E_ROWS)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    if cpu and (need := [r for r in rows if r not in CPU_ROWS]):
        raise ValueError(f"{', '.join(need)} need a GPU: --cpu runs {', '.join(CPU_ROWS)}")
    if UVLOOP in rows and not model:
        raise ValueError(f"the {UVLOOP} row serves a model folder: give --model")
    return rows


def row_layout(work: Path, name: str, *, cpu: bool, images_root: Path | None = None) -> InterposerLayout:
    """A row's units: its run directory, its images, the row's environment; with a GPU, the interposer's lines
    and the node hydrator's socket directory shared by every row (`work/coldsnap`, /run/coldsnap in the units)."""
    environment = {"PYTHONPATH": WORKER_PATH, **ROWS[name].env} if name in ROWS else {"PYTHONPATH": WORKER_PATH}
    if not cpu:
        environment.update(interposer_environment(staged=True))
    return InterposerLayout(run_dir=work / name / "run", images_dir=(images_root or work) / name / "images",
                            weights=work / "weights", network="none", extra_environment=environment,
                            gpus=() if cpu else ("0",), interposer_dir=None if cpu else work / "coldsnap")


def engine_argv(layout: Layout, name: str, gib: float, *, cpu: bool) -> list[str]:
    """The row's engine: its weights made on the GPU, its socket in the run directory."""
    engine = ROWS[name].command(layout.python, ENGINE)
    engine = engine[:2] if cpu else engine  # the toy model: no GPU options
    return [*engine, "--gib", f"{gib:g}", "--weights", "device", "--socket", f"{RUN}/engine.sock"]


def engine_command(layout: Layout, name: str, gib: float, *, cpu: bool) -> list[str]:
    """The row's engine under the capsule's init (PID floor, session leader, stdio on /dev/null)."""
    return launcher(engine_argv(layout, name, gib, cpu=cpu))


async def engine_output(d: Driver, image: str, layout: Layout, name: str, gib: float, *, cpu: bool) -> str:
    """The engine's own last words: its command once more in a disposable unit of the row's (output combined, at
    most 120 s), for a cold start that failed without them."""
    engine = shlex.join(engine_argv(layout, name, gib, cpu=cpu))
    spec = layout.unit("", image, entrypoint="sh", command=["-c", f"timeout 120 {engine} 2>&1 | tail -40"])
    spec.update(detached=False, remove_after_exit=True, combined=True)
    reply = await d.runtime("workload-run", workload=spec)
    return output(reply.get("runtime") or {}) if reply.get("ok") else str(reply.get("error"))


def last_error(said: str) -> str:
    """The engine's own verdict, first in a failed row's error (its table cell shows the start): a traceback's
    exception line (its last unindented line), else the output's last line."""
    lines = [line for line in said.splitlines() if line.strip()]
    return next((line for line in reversed(lines) if not line[0].isspace() and ": " in line),
                lines[-1] if lines else "(no output)")


async def request(layout: Layout, *, limit: float) -> Stream:
    return await stream_tokens(layout.run_dir / "engine.sock", limit=limit, prompt=PROMPT, max_tokens=TOKENS)


async def start_cold(d: Driver, image: str, layout: Layout, name: str, gib: float, *, cpu: bool) -> dict[str, Any]:
    """The row's engine as a detached unit, timed from workload-run to its first token (raced against its exit)."""
    unit = f"rows-{name}-cold"
    await d.expect(f"evicting {unit}", "workload-remove", name=unit)
    spec = layout.unit(unit, image, entrypoint=layout.python, command=engine_command(layout, name, gib, cpu=cpu))
    created = time.time()
    await d.expect(f"starting the {name} engine", "workload-run", workload=spec)
    started = time.time()
    got: list[Stream] = []

    async def client(scope: anyio.CancelScope) -> None:
        got.append(await request(layout, limit=600))
        scope.cancel()

    async def watch(_scope: anyio.CancelScope) -> None:
        await watch_server(d, layout, unit)

    try:
        await together(client, watch)
    except E2EError as exc:  # the unit's init keeps the engine's stdio off the container: ask the engine itself
        said = await engine_output(d, image, layout, name, gib, cpu=cpu)
        raise E2EError(f"{last_error(said)[:400]} (the engine run alone); {exc}; the engine run alone says:\n{said}",
                       code=exc.code) from exc
    return {"unit": unit, "create_start_s": started - created, "first_token_s": got[0].first - created,
            "tokens": got[0].tokens, "first_logits_sha256": got[0].done.get("first_logits_sha256"),
            "server_pid": server_pid(layout)}


def cluster(name: str) -> str:
    """The workload label of a row's restore unit (named `<cluster>_node_0`)."""
    return "rows" + name.replace("-", "")


def stage_tiers(report: dict[str, Any]) -> dict[str, Any]:
    """What the node hydrator's stages of a restore say (issue 34 item 3): the tiers that served them (`ram`: the
    hydrator's RAM tier, `disk`: the dump files), the slowest stage's seconds and copy seconds, and the longest
    wait for a stage after CUDA's restore."""
    stages = [s for s in ((p.get("interposer") or {}).get("stage") for p in report.get("device_memory") or [])
              if isinstance(s, dict) and s.get("staged")]

    def most(key: str) -> float | None:
        return max((float(s[key]) for s in stages if isinstance(s.get(key), int | float)), default=None)
    return {"stage_tiers": sorted({str(s.get("tier", "-")) for s in stages}), "stage_s": most("stage_s"),
            "stage_copy_s": most("copy_s"), "stage_wait_s": most("wait_s")}


async def restore_row(d: Driver, image: str, layout: Layout, name: str, capture_id: str,
                      cold: dict[str, Any]) -> dict[str, Any]:
    """A restore unit and the client's request, sent as soon as the restored socket accepts; timed from the unit's
    workload-run to the first token."""
    unit, labels = f"{cluster(name)}_node_0", unit_labels(capture_id, cluster(name))
    created, started = await launch_unit(d, image, layout, unit, capture_id, labels=labels)
    out: dict[str, Any] = {}

    async def client(_scope: anyio.CancelScope) -> None:
        out["stream"] = await request(layout, limit=120)

    async def ready(_scope: anyio.CancelScope) -> None:
        out["unit"] = await await_unit(d, unit, created, labels=labels, readiness_timeout=120)

    await together(client, ready)
    stream, report = out["stream"], out["unit"].pop("worker_report")
    digest = stream.done.get("first_logits_sha256")
    tiers = stage_tiers(report)
    print(f"[{name}] stage: tier {'/'.join(tiers['stage_tiers']) or '-'}, stage {_f(tiers['stage_s'])} s, copy "
          f"{_f(tiers['stage_copy_s'])} s, waited after CUDA {_f(tiers['stage_wait_s'])} s", flush=True)
    return {**out["unit"], **device_hydration(report), **device_staging(report), **tiers,
            "create_start_s": started - created,
            "first_token_s": stream.first - created, "tokens": stream.tokens, "first_logits_sha256": digest,
            "identical": stream.tokens == cold["tokens"] and digest == cold["first_logits_sha256"],
            "timeline": report.get("timeline"), "device_memory": report.get("device_memory")}


async def capture_cold(d: Driver, layout: Layout, name: str, cold: dict[str, Any], result: dict[str, Any], *,
                       cpu: bool) -> str:
    """The worker captures the idle engine in its unit (`result` gets what the report says); the capture's ID."""
    capture_id = f"rows-{name}-{time.strftime('%Y%m%dT%H%M%S')}"
    report = await capture(d, cold["unit"], int(cold["server_pid"]), layout, capture_id, hydrate=False,
                           boundary="n580" if cpu else "n610")
    result.update(capture=capture_row(report), coverage=coverage(report.get("device_memory")),
                  event_loops=report.get("event_loops"), tree=report.get("tree"),
                  device_memory=report.get("device_memory"), timings_s=report.get("timings_s"))
    print(f"[{name}] captured: {json.dumps(result['capture'])}", flush=True)
    return capture_id


async def run_row(d: Driver, image: str, layout: Layout, name: str, *, gib: float, restores: int,
                  cpu: bool) -> dict[str, Any]:
    """A row from its cold start to its last restore; a failure is the row's result, and no unit is left."""
    layout.prepare()
    result: dict[str, Any] = {"row": name, "label": ROWS[name].label, "ok": False, "restores": [],
                              "environment": layout.extra_environment}
    try:
        cold = result["cold"] = await start_cold(d, image, layout, name, gib, cpu=cpu)
        print(f"[{name}] cold Docker-to-first-token {cold['first_token_s']:.2f} s", flush=True)
        capture_id = await capture_cold(d, layout, name, cold, result, cpu=cpu)
        await d.expect(f"removing {cold['unit']}", "workload-remove", name=cold["unit"])
        for attempt in range(restores):
            restored = await restore_row(d, image, layout, name, capture_id, cold)
            result["restores"].append(restored)
            print(f"[{name}] restore {attempt + 1}: Docker-to-first-token {restored['first_token_s']:.2f} s (CRIU "
                  f"{restored['criu_s']}, CUDA {restored['cuda_s']}, device {device_cell(restored)}), identical "
                  f"{restored['identical']}; from the request: {start_cell(restored)}", flush=True)
        result["ok"] = bool(result["restores"]) and all(r["identical"] for r in result["restores"])
    except (E2EError, OSError, ValueError, KeyError, TimeoutError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] FAILED: {result['error'][:3000]}", flush=True)
    finally:
        await remove_units(d, [f"rows-{name}-cold", f"{cluster(name)}_node_0"], result)
        shutil.rmtree(layout.images_dir, ignore_errors=True)
    return result


async def remove_units(d: Driver, names: list[str], result: dict[str, Any]) -> None:
    """Remove the units, then ask the daemon that none is left (a unit left makes the row fail)."""
    for unit in names:
        await d.runtime("workload-remove", name=unit)
    if left := [unit for unit in names if not await d.gone(unit)]:
        result.update(ok=False, units_left=left)


async def run_uvloop(d: Driver, args: argparse.Namespace, image: str) -> dict[str, Any]:
    """bench/e2e_serve.py's staged interposer path, in this table's terms."""
    served = await e2e_serve.run_mode(d, args, STAGED, image)
    shutil.rmtree(served.pop("layout").images_dir, ignore_errors=True)
    report = served.get("capture") if isinstance(served.get("capture"), dict) else {}
    return {"row": UVLOOP, "label": "transformers serve: uvicorn on uvloop, HTTP", "ok": served["ok"],
            "cold": served.get("cold"), "restores": served["restores"], "capture": served.get("capture_phases"),
            "coverage": coverage(report.get("device_memory")), "event_loops": report.get("event_loops"),
            **{k: served[k] for k in ("error", "units_left") if k in served}}


# ---------------------------------------------------------------------------------------------------------------
# The table


HEAD = ("row", "engine, allocator", "cold s", "restores: Docker-to-first-token s",
        "fastest: worker start / CRIU / CUDA / device hydration s", "moved at line rate (of device bytes): kinds",
        "left on the checkpoint path", "event loop", "identical", f"<= {GOAL_S:g} s, >= {GOAL_SHARE:.0%}")


def _f(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def row_cells(r: dict[str, Any]) -> list[str]:
    """A row's cells; a failed row says why in its first cell."""
    restores = r.get("restores") or []
    best = min(restores, key=lambda x: x["first_token_s"]) if restores else None
    seen = r.get("coverage") or coverage(None)
    identical = bool(restores) and all(x["identical"] for x in restores)
    goal = identical and all(x["first_token_s"] <= GOAL_S for x in restores) and seen["moved_share"] >= GOAL_SHARE
    name = r["row"] + (f" (FAILED: {r['error'][:240]})" if r.get("error") else "")
    name += f" (units left: {', '.join(r['units_left'])})" if r.get("units_left") else ""
    return [name, r["label"], _f((r.get("cold") or {}).get("first_token_s")),
            " / ".join(f"{x['first_token_s']:.2f}" for x in restores) or "-",
            f"{_f(best.get('worker_started_s'))} / {_f(best['criu_s'])} / {_f(best['cuda_s'])} / {device_cell(best)}"
            if best else "-",
            f"{seen['moved_bytes'] / 1e9:.2f} GB ({seen['moved_share']:.1%})"
            + (f": {left_text(seen['moved_kinds'])}" if seen.get("moved_kinds") else ""), left_text(seen["left_bytes"]),
            "/".join(sorted(set((r.get("event_loops") or {}).values()))) or "-", "yes" if identical else "NO",
            "yes" if goal else "no"]


def rows_table(results: list[dict[str, Any]], gib: float, capsule: dict[str, Any]) -> str:
    return "\n".join([table(HEAD, [row_cells(r) for r in results]), "",
                      f"{gib:g} GiB of weights a row (the uvloop row: its model folder); capsule "
                      f"{str(capsule.get('id', ''))[:19]}, {capsule.get('size', 0) / 1e6:.0f} MB."])


CAPTURE_HEAD = ("row", "images on", "capture: exec s", "release s (GB/s)",
                "release thread-s: write / digest / device / zero",
                "CUDA lock + checkpoint s (host GB added)", "CRIU dump s: frozen / pages / their writes",
                "CRIU pages written GB", "worker: interpreter / start / find CUDA / memory scans / finish s",
                "stack limit B: engine -> checkpoint")


def capture_cells(r: dict[str, Any]) -> list[str]:
    """Where a row's capture went (issue 35 item 3): each phase and, inside it, what the report says."""
    c = r.get("capture") or {}
    threads = c.get("release_thread_s") or {}
    pages = c.get("criu_pages_written")
    return [r["row"], c.get("images_on") or "-", _f(c.get("exec_s")),
            f"{_f(c.get('device_release_s'))} ({_f(c.get('device_gbps'))})",
            " / ".join(_f(threads.get(k)) for k in ("write", "digest", "device", "zero")),
            (_f((c.get("cuda_lock_s") or 0) + (c.get("cuda_checkpoint_s") or 0))
             + f" ({_f(None if c.get('checkpoint_added_bytes') is None else c['checkpoint_added_bytes'] / 1e9)})")
            if c else "-",
            f"{_f(c.get('criu_dump_s'))}: {_f(c.get('criu_frozen_s'))} / {_f(c.get('criu_memdump_s'))} / "
            f"{_f(c.get('criu_memwrite_s'))}", "-" if pages is None else f"{pages * 4096 / 1e9:.2f}",
            " / ".join(_f(c.get(k)) for k in ("interpreter_start_s", "worker_start_s", "find_cuda_s", "memory_scan_s",
                                              "finish_s")), ", ".join(c.get("stack_limit") or []) or "-"]


# ---------------------------------------------------------------------------------------------------------------
# The run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--capsule", required=True)
    parser.add_argument("--work", required=True, help="host directory for the rows' run directories")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"comma list, run in this order: {', '.join(E2E_ROWS)}")
    parser.add_argument("--gib", type=float, default=16.0, help="each engine's weights (made on the GPU)")
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--images-root", default="", help="where the images go (tmpfs: one row's at a time)")
    parser.add_argument("--model", default="", help="the uvloop row's model folder (engines/serve_model.py)")
    parser.add_argument("--port", type=int, default=18471, help="the uvloop row's port")
    parser.add_argument("--criu-threads", type=int, default=0, help="the uvloop row's CRIU_RESTORE_THREADS")
    parser.add_argument("--python", default=Layout.python,
                        help="the interpreter in the units (the uvloop row's: bench/e2e_serve.py's)")
    parser.add_argument("--host-mounts", default=",".join(HOST_MOUNTS),
                        help="host paths every unit mounts read-only at the same path (\"\": the capsule's own; the "
                        "uvloop row's: bench/e2e_serve.py's)")
    parser.add_argument("--cpu", action="store_true", help=f"no GPU: the rows {', '.join(CPU_ROWS)} (toy model)")
    parser.add_argument("--build", action="append", default=[], metavar="CONTEXT=TAG")
    return parser


async def run_rows(d: Driver, args: argparse.Namespace, rows: list[str], image: str) -> list[dict[str, Any]]:
    """Every row in order, the node hydrator beside them (with a GPU); each row's result written as it ends."""
    work, results = Path(args.work), list[dict[str, Any]]()
    node = row_layout(work, "node", cpu=args.cpu)
    node.python, node.host_mounts = args.python, tuple(filter(None, args.host_mounts.split(",")))
    hydrating = not args.cpu and any(r != UVLOOP for r in rows)
    try:
        if hydrating:
            node.prepare()
            await check_interposer(d, image, node)
            started = await start_staging_hydrator(d, image, node, HYDRATOR_UNIT)
            await wait_hydrator(d, HYDRATOR_UNIT, started["created_unix"])
        for name in rows:
            if name == UVLOOP:
                results.append(await run_uvloop(d, args, image))
            else:
                layout = row_layout(work, name, cpu=args.cpu, images_root=Path(args.images_root or work))
                layout.python, layout.host_mounts = node.python, node.host_mounts
                results.append(await run_row(d, image, layout, name, gib=args.gib, restores=args.restores,
                                             cpu=args.cpu))
            Path(args.out, "rows.partial.json").write_text(json.dumps(results, indent=1, default=str))
    finally:
        if hydrating:
            await d.runtime("workload-remove", name=HYDRATOR_UNIT)
    return results


async def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    try:
        rows = plan_rows(args.rows, cpu=args.cpu, model=args.model)
        if UVLOOP in rows:
            check_folder(args.model)
    except (ValueError, ModelFolderError) as exc:
        parser.error(f"--rows: {exc}" if isinstance(exc, ValueError) else f"--model: {exc}")
    if args.restores < 1:
        parser.error(f"--restores must be at least 1, not {args.restores}")
    d = Driver(Path(args.state_dir))
    await d.open()
    try:
        builds = await e2e_serve.build_capsules(d, args.build)
        capsule = await inspect_capsule(d, args.capsule)
        results = await run_rows(d, args, rows, str(capsule["id"]))
    except (E2EError, ClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = rows_table(results, args.gib, capsule) + "\n\n" + table(CAPTURE_HEAD, [capture_cells(r) for r in results])
    print(text, flush=True)
    Path(args.out, "rows-table.md").write_text(text + "\n")
    Path(args.out, "rows.json").write_text(json.dumps({"builds": builds, "capsule": capsule, "rows": rows,
                                                       "gib": args.gib, "results": results}, indent=1, default=str))
    Path(args.out, "rows.partial.json").unlink(missing_ok=True)  # rows.json holds it all now
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

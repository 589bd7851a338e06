"""Tensor-parallel restore through the daemon at any world size (issues 16, 27, 28): every rank in its own capsule.

    python bench/e2e_tp.py --state-dir DIR --capsule TAG --work DIR --out DIR [--world-size N] [--shape 70b]
                           [--layers L] [--memory-limit 256G] [--phase all|weights|run|failures] [--restores 3]
                           [--gpus own|all] [--no-hydrator] [--build CONTEXT=TAG]
    python bench/e2e_tp.py --plan --world-size N --shape 70b [--memory-limit 256G] [--work DIR]

Against a running `coldsnap-provider serve` (`[gpus] mode = "native"`, `[runtime] privileged =
"host-capabilities"`), through the public client only, as a ColdSnap controller drives a TP activation
(spec 7.1: one container per launch unit, host network, the unit's GPUs, the coordinator shared):

0. the plan (bench/tp_plan.py): each rank's bytes, host memory against the cgroup's limit (or --memory-limit;
   never MemTotal), GPU memory; without --layers the largest layer count that fits. `--plan` stops here.
1. `weights`: each rank's weights written once per machine, all ranks at once (engines/engine_tp.py weights),
   under --work (kept: a warm machine reuses them);
2. `run`: one node hydrator per GPU (a unit of that GPU; its rank's weights page-locked once, staging on);
   cold: one serving unit per rank, `engine_llama.py launch` of `engine_tp.py serve`, NCCL between the units
   over the host network, timed from the first `workload-run` to rank 0's first streamed token, then the
   decode rate and an all-reduce's bus bandwidth; capture: one `workload-exec ... coldsnap_probe capture` per
   rank, at once, meeting at the coordinator (communicators destroyed first); then `--restores` restores: one
   unit per rank, launched together, under one activation deadline; each rank's worker stages its weights on
   its own GPU through its hydrator while CRIU restores the process; each unit's readiness, report and inspect,
   then the first token, the decode rate and the bus bandwidth again; tokens and first-step logits equal to the
   cold run's on every rank, nothing downgraded by more than 2%. The capture and the cold reference are kept in
   --work for the next step;
3. `failures` (on the kept capture): a tampered graph record on the last rank, a peer unit that never arrives,
   the last rank's process killed after CRIU, a GPU that differs from the captured one, the last rank's
   hydration source missing, then corrupt (as its unit sees them: another directory is mounted at /weights
   in that unit; the real files are never touched): each must stop every rank, name the
   rank, and leave no unit; then one more restore.
`all` runs 1-3 in one call. Prints the tables and writes e2e-tp-<phase>.json under --out.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import tp_plan
from bench._common import table
from bench.e2e_restore import (
    IMAGES,
    RUN,
    Driver,
    E2EError,
    await_unit,
    inspect_capsule,
    json_in,
    launch_unit,
    output,
    restore_command,
    unit_labels,
)
from bench.tp2_restore import generate
from bench.tp_units import Activation, downgrade, hydration_rates, measure, start_hydrators, write_weights
from coldsnap_probe import image_digest

# What a step of the sequence can fail with besides E2EError: a garbled report, a missing log line, the engine's
# socket. Each is recorded as that step's failure, so that the units are still removed.
FAILURES = (E2EError, OSError, ValueError, KeyError, RuntimeError, TimeoutError)
STATE = "e2e-tp-state.json"  # in --work: the capture and the cold reference, for the `failures` step


def _call(fn: Any, *args: Any) -> Any:
    return anyio.to_thread.run_sync(lambda: fn(*args))


async def cold_start(d: Driver, tp: Activation, limit: float = 480.0) -> dict[str, Any]:
    """Every rank's serving unit at once; Docker-to-first-token, the reference tokens, the decode rate and bus
    bandwidth the restores are compared with."""
    for stale in [*(f"rank-{r}.{s}" for r in range(tp.world) for s in ("log", "sock", "weights.sock")),
                  *(f"launch-{r}.log" for r in range(tp.world)), "init.store"]:
        (tp.run_dir / stale).unlink(missing_ok=True)
    names = [f"tp-serving-{r}" for r in range(tp.world)]
    for name in names:
        await d.expect(f"evicting {name}", "workload-remove", name=name)
    errors: list[str] = []

    async def launch(rank: int) -> None:
        spec = tp.layouts[rank].unit(names[rank], tp.image, entrypoint=tp.layouts[rank].python,
                                     command=tp.serve_command(rank))
        try:
            await d.expect(f"starting rank {rank}'s serving unit {names[rank]}", "workload-run", workload=spec)
        except FAILURES as exc:
            errors.append(str(exc))

    created = time.time()
    async with anyio.create_task_group() as tg:
        for rank in range(tp.world):
            tg.start_soon(launch, rank)
    if errors:
        raise E2EError(" | ".join(errors))
    started = time.time()
    await _until_ready(d, tp, names, limit)
    first = await _call(generate, tp.run_dir, tp.args.tokens)
    again = await _call(generate, tp.run_dir, tp.args.tokens)
    measured = await _call(measure, tp)
    logs = [tp.log(f"rank-{r}.log") for r in range(tp.world)]
    return {"measured": measured, "names": names, "first_token_s": first["first_unix"] - created,
            "create_start_s": started - created,
            "tokens": first["tokens"], "first_logits_sha256": first["first_logits_sha256"],
            "peers_agree": first["peers_agree"], "repeatable": again["tokens"] == first["tokens"],
            "engine_pids": [int(tp.log(f"launch-{r}.log")["engine_forked"]["engine_pid"]) for r in range(tp.world)],
            "stages_s": [{k: round(v["unix"] - created, 3) for k, v in log.items() if "unix" in v} for log in logs]}


async def _until_ready(d: Driver, tp: Activation, names: list[str], limit: float) -> None:
    """Until every rank logged `ready`; a rank that failed, or whose unit exited (even before it could log
    anything), ends the wait at once, naming the rank, with every unit's last lines."""
    polls = 0
    with anyio.move_on_after(limit) as waited:
        while True:
            logs = [tp.log(f"rank-{r}.log") for r in range(tp.world)]
            launches = [tp.log(f"launch-{r}.log") for r in range(tp.world)]
            bad = [(r, log.get("failed") or launch.get("engine_exited")) for r, (log, launch)
                   in enumerate(zip(logs, launches, strict=True)) if "failed" in log or "engine_exited" in launch]
            polls += 1
            if not bad and polls % 20 == 0:  # about once a second: a unit that exited without a word
                for rank, name in enumerate(names):
                    state = await d.runtime("workload-inspect", name=name)
                    workload = (state.get("runtime") or {}).get("workload") or {}
                    if not workload.get("running"):
                        bad.append((rank, {"unit_exited": workload.get("exit_code")}))
            if bad:
                tails = [output(await d.expect("logs", "workload-logs", name=n, tail=20))[-1500:] for n in names]
                raise E2EError(f"rank(s) {[r for r, _ in bad]} failed before they were ready: {bad} {tails}")
            if all("ready" in log for log in logs):
                return
            await anyio.sleep(0.05)
    if waited.cancelled_caught:
        raise E2EError(f"the ranks were not ready within {limit:.0f} s")


async def capture(d: Driver, tp: Activation, cold: dict[str, Any], capture_id: str) -> list[dict[str, Any]]:
    """Every rank's worker inside its serving container, all at once, meeting at the coordinator."""
    (tp.images / capture_id).mkdir(parents=True)
    reports: list[dict[str, Any]] = [{} for _ in range(tp.world)]
    errors: list[str] = []

    async def one(rank: int) -> None:
        command = [tp.layouts[rank].python, "-m", "coldsnap_probe", "capture", "--pid", str(cold["engine_pids"][rank]),
                   "--images", f"{IMAGES}/{capture_id}/rank-{rank}", "--criu", tp.layouts[rank].criu,
                   "--engine", f"{RUN}/rank-{rank}.sock", "--hydration", f"{RUN}/rank-{rank}.weights.sock",
                   *tp.ranks(capture_id, rank, 120)]
        try:
            runtime = await d.expect(f"rank {rank}'s capture", "workload-exec", name=cold["names"][rank],
                                     execution={"command": command})
            reports[rank] = json_in(output(runtime))
        except FAILURES as exc:
            errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

    async with anyio.create_task_group() as tg:
        for rank in range(tp.world):
            tg.start_soon(one, rank)
    if errors:
        raise E2EError("capture failed: " + " | ".join(errors))
    return reports


async def restore(d: Driver, tp: Activation, capture_id: str, namespace: str, reference: dict[str, Any], *,
                  images: list[str] | None = None, ranks: list[int] | None = None, barrier_timeout: float = 60,
                  victim: int | None = None, deadline: float = 180,
                  weights: dict[int, Path] | None = None) -> dict[str, Any]:
    """One restore unit per rank, launched together, every rank ready within one activation `deadline`; each
    one's readiness, report and inspect; the first token, compared with `reference` (the cold run's), and the
    decode rate and bus bandwidth. Any failure removes every unit (the controller's rollback) and raises,
    naming each rank's cause. `weights` mounts another host directory at /weights in a rank's unit (the
    failure cases' missing or corrupt source, leaving the real files alone)."""
    chosen = list(range(tp.world)) if ranks is None else ranks
    layouts = [dataclasses.replace(layout, weights=(weights or {}).get(r, layout.weights))
               for r, layout in enumerate(tp.layouts)]
    images = images or [f"{capture_id}/rank-{r}" for r in range(tp.world)]
    names = {r: f"tp_node_{r}" for r in chosen}
    units: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    killed: list[int] = []
    began = time.time()

    async def one(rank: int) -> None:
        labels = unit_labels(capture_id, "tp", rank)
        try:
            command = restore_command(layouts[rank], images[rank], *tp.ranks(namespace, rank, barrier_timeout))
            created, started = await launch_unit(d, tp.image, layouts[rank], names[rank], capture_id,
                                                 labels=labels, command=command)
            units[rank] = {"created": created, "create_start_s": started - created}
            units[rank].update(await await_unit(d, names[rank], created, labels=labels,
                                                readiness_timeout=max(1.0, began + deadline - time.time())))
        except FAILURES as exc:
            errors.append(f"rank {rank}: {exc}")
            units.pop(rank, None)

    async with anyio.create_task_group() as tg:
        if victim is not None:
            tg.start_soon(_kill_after_criu, d, tp, namespace, names[victim], victim, deadline, killed)
        with anyio.move_on_after(deadline + 5) as activation:  # the units' own checks end first, naming the rank
            async with anyio.create_task_group() as ranks_group:
                for rank in chosen:
                    ranks_group.start_soon(one, rank)
        tg.cancel_scope.cancel()  # the fault injector has nothing left to wait for
    if activation.cancelled_caught:
        errors.append(f"the activation was not ready within its {deadline:g} s deadline")
    if errors or len(units) != tp.world:
        await _remove_all(d, list(names.values()))
        missing = sorted(set(range(tp.world)) - set(units))
        raise E2EError((" | ".join(errors) or f"no restore unit was launched for rank(s) {missing}")
                       + (f" (rank {victim}'s restored process {killed[0]} was killed)" if killed else ""))
    try:
        answer = await _call(generate, tp.run_dir, tp.args.tokens)
        measured = await _call(measure, tp)
    except FAILURES as exc:
        await _remove_all(d, list(names.values()))
        raise E2EError(f"the restored ranks did not answer: {type(exc).__name__}: {exc}") from exc
    return _restored(tp, units, began, answer, measured, reference, list(names.values()))


async def _kill_after_criu(d: Driver, tp: Activation, namespace: str, name: str, rank: int, deadline: float,
                           killed: list[int]) -> None:
    """The fault case: the rank's restored process dies between its CRIU restore and its CUDA restore."""
    published = tp.coord / namespace / "criu-restored" / f"{rank}.json"
    with anyio.move_on_after(deadline):
        while not published.exists():
            await anyio.sleep(0.005)
        pid = int(json.loads(published.read_text())["value"]["pid"])
        reply = await d.runtime("workload-exec", name=name, execution={"command": ["kill", "-KILL", str(pid)]})
        if reply.get("ok"):
            killed.append(pid)


def _restored(tp: Activation, units: dict[int, dict[str, Any]], began: float, answer: dict[str, Any],
              measured: dict[str, Any], reference: dict[str, Any], names: list[str]) -> dict[str, Any]:
    reports = [units[r]["worker_report"] for r in range(tp.world)]
    return {"first_token_s": answer["first_unix"] - began, "tokens": answer["tokens"],
            "first_logits_sha256": answer["first_logits_sha256"], "peers_agree": answer["peers_agree"],
            "identical": answer["tokens"] == reference["tokens"] and answer["peers_agree"]
            and answer["first_logits_sha256"] == reference["first_logits_sha256"],
            "measured": measured, "vs_cold": downgrade(reference["measured"], measured),
            "hydration": hydration_rates(reports), "names": names, "ranks": [{
                "create_start_s": units[r]["create_start_s"], "worker_started_s": units[r]["created"] - began
                + (units[r]["worker_started_s"] or 0), "readiness_s": units[r]["created"] - began
                + units[r]["readiness_s"], "criu_s": rep.get("criu_restore_seconds"),
                "cuda_s": rep.get("cuda_restore_seconds"),
                "hydration_s": (rep.get("hydration") or {}).get("phase_seconds"),
                "recreate_s": rep.get("communicator_recreate_seconds"), "barrier_wait_s": rep.get("barrier_wait_s"),
                "started_at": units[r]["started_at"]} for r, rep in enumerate(reports)]}


async def _remove_all(d: Driver, names: list[str]) -> None:
    """The rollback of an activation: every unit removed, whatever else fails (shielded)."""
    with anyio.CancelScope(shield=True):
        for name in names:
            await d.runtime("workload-remove", name=name)


async def remove(d: Driver, names: list[str]) -> None:
    for name in names:
        await d.expect(f"removing {name}", "workload-remove", name=name)


async def capture_and_restore(d: Driver, tp: Activation, out: dict[str, Any], outfile: Path) -> None:
    """The `run` step: cold, capture, then `--restores` restores of that one capture."""
    out["removed"] = tp.forget_other_runs(weights=False)  # earlier captures: this run's replaces them
    cold = out["cold"] = await cold_start(d, tp)
    print(f"cold: {cold['first_token_s']:.2f} s to the first token, tokens {cold['tokens'][:6]}..., "
          f"{json.dumps(cold['measured'])[:300]}", flush=True)
    capture_id = out["capture_id"] = f"tp{tp.world}-{time.strftime('%Y%m%dT%H%M%S')}"
    out["capture"] = await capture(d, tp, cold, capture_id)
    print(f"captured: {[c.get('timings_s') for c in out['capture']]}", flush=True)
    await remove(d, cold["names"])
    before = await _call(_digests, tp, capture_id)
    (tp.work / STATE).write_text(json.dumps({"capture_id": capture_id, "cold": cold, "plan": out["plan"]}))
    out["restores"] = []
    for i in range(tp.args.restores):
        result = await restore(d, tp, capture_id, f"restore-{i + 1}", cold, deadline=tp.args.deadline)
        await remove(d, result["names"])
        out["restores"].append(result)
        print(f"restore {i + 1}: {result['first_token_s']:.2f} s, identical {result['identical']}, "
              f"vs cold {result['vs_cold']}, hydration {result['hydration']['aggregate_gbps']}", flush=True)
        outfile.write_text(json.dumps(out, indent=1, default=str))
    out["images_unchanged"] = before == await _call(_digests, tp, capture_id)


def _digests(tp: Activation, capture_id: str) -> list[str]:
    """Every rank's image digest, the ranks hashed at once."""
    with ThreadPoolExecutor(tp.world) as pool:
        return list(pool.map(lambda r: image_digest(tp.images / capture_id / f"rank-{r}"), range(tp.world)))


def _failure_cases(tp: Activation, capture_id: str) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(case, restore options, what the error must name)."""
    last = tp.world - 1
    source = f"weights-rank-{last}.bin"
    every = [f"rank {r}:" for r in range(tp.world)]
    return [
        ("tampered graph record on the last rank", {"images": _tampered(tp, capture_id, "graph")},
         [*every, "graph.json"]),
        ("peer unit never arrives (rank 0 alone, 5 s barrier)", {"ranks": [0], "barrier_timeout": 5},
         ["rank 0:", "never reached validated"]),
        (f"rank {last}'s restored process killed after CRIU", {"victim": last, "barrier_timeout": 30},
         [*every, "was killed"]),
        (f"a GPU that differs from the captured one (rank {last})", {"images": _tampered(tp, capture_id, "gpu")},
         [*every, "this GPU is"]),
        (f"rank {last}'s hydration source missing", {"weights": {last: fault_weights(tp, "missing")}},
         [*every, f"rank {last} restore", source, "cannot be read"]),
        (f"rank {last}'s hydration source corrupt (same size, other bytes)",
         {"weights": {last: fault_weights(tp, "corrupt")}, "barrier_timeout": 120},
         [*every, f"rank {last} restore", source, "does not match the digest"])]


def fault_weights(tp: Activation, fault: str) -> Path:
    """A weights directory for the last rank's unit where its source is missing, or is a file of the same size
    and other bytes (sparse: it costs no memory). The real weight files are never touched."""
    directory = tp.work / f"fault-{fault}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    if fault == "corrupt":
        name = f"weights-rank-{tp.world - 1}.bin"
        with open(directory / name, "wb") as f:
            f.truncate((tp.weights / name).stat().st_size)
    return directory


def _tampered(tp: Activation, capture_id: str, what: str) -> list[str]:
    """The capture's image names with the last rank's replaced by a copy whose graph record, or the GPU its
    identity names, was changed."""
    last = tp.world - 1
    name = f"{capture_id}-{what}/rank-{last}"
    if not (tp.images / name).exists():
        shutil.copytree(tp.images / capture_id / f"rank-{last}", tp.images / name)
        if what == "graph":
            record = json.loads((tp.images / name / "graph.json").read_text())
            record["record"]["decision"] = "qualified_exact_nccl_in_place"
            (tp.images / name / "graph.json").write_text(json.dumps(record))
        else:
            captured = json.loads((tp.images / name / "capture.json").read_text())
            captured["identity"]["gpu_name"] = "NVIDIA A100-SXM4-80GB"
            (tp.images / name / "capture.json").write_text(json.dumps(captured))
    return [*(f"{capture_id}/rank-{r}" for r in range(last)), name]


async def failures(d: Driver, tp: Activation, capture_id: str, reference: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for i, (case, options, named) in enumerate(_failure_cases(tp, capture_id)):
        started = time.time()
        try:
            result = await restore(d, tp, capture_id, f"fail-{i}-{int(started)}", reference, deadline=90, **options)
            await remove(d, result["names"])
            rows.append({"case": case, "ok": False, "error": "the restore succeeded"})
        except E2EError as exc:
            left = [f"tp_node_{r}" for r in range(tp.world) if not await d.gone(f"tp_node_{r}")]
            unnamed = [n for n in named if n not in str(exc)]
            rows.append({"case": case, "ok": not left and not unnamed and exc.code == "runtime_failed",
                         "units_left": left, "not_named": unnamed, "seconds": round(time.time() - started, 2),
                         "error_code": exc.code, "error": str(exc)[-3000:]})
        print(f"failure case: {case}: {json.dumps(rows[-1])[:1500]}", flush=True)
    for what in ("graph", "gpu"):
        shutil.rmtree(tp.images / f"{capture_id}-{what}", ignore_errors=True)
    for fault in ("missing", "corrupt"):
        shutil.rmtree(tp.work / f"fault-{fault}", ignore_errors=True)
    return rows


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/e2e_tp.py")
    tp_plan.add_arguments(parser)
    parser.add_argument("--plan", action="store_true", help="print the plan and check the memory budget; run nothing")
    parser.add_argument("--phase", choices=["all", "weights", "run", "failures"], default="all")
    parser.add_argument("--state-dir", default="")
    parser.add_argument("--capsule", default="")
    parser.add_argument("--build", default="", metavar="CONTEXT=TAG")
    parser.add_argument("--work", required=True, help="host directory for weights, run, coordinator and images")
    parser.add_argument("--weights-dir", default="", help="default: --work/weights-SHAPE-LLAYERS-tpN")
    parser.add_argument("--out", default=".")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens per decode-rate generation")
    parser.add_argument("--allreduce-bytes", type=int, default=1 << 30)
    parser.add_argument("--allreduce-iters", type=int, default=20)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds for every rank of a restore")
    parser.add_argument("--gpus", choices=["own", "all"], default="own",
                        help="each rank's unit gets its own GPU (spec 7.1) or every GPU of the host")
    parser.add_argument("--no-hydrator", dest="hydrator", action="store_false",
                        help="hydrate through each engine's pinned ring instead of a node hydrator per GPU")
    return parser.parse_args()


async def open_driver(args: argparse.Namespace) -> tuple[Driver, str]:
    """The daemon's session, the capsule built if asked, and its image ID."""
    if not (args.state_dir and args.capsule):
        raise E2EError("--state-dir and --capsule are needed to run (only --plan and --phase weights run without)")
    d = Driver(Path(args.state_dir))
    await d.open()
    if args.build:
        context, _, tag = args.build.partition("=")
        await d.expect(f"image-build of {tag}", "image-build", build={
            "dockerfile": base64.b64encode(Path(context, "Dockerfile").read_bytes()).decode(), "context": context,
            "tag": tag, "pull": False})
    capsule = await inspect_capsule(d, args.capsule)
    return d, str(capsule["id"])


async def steps(d: Driver, tp: Activation, out: dict[str, Any], outfile: Path) -> None:
    """The hydrators, then the `run` and/or `failures` steps; every unit removed whatever happens."""
    phase = tp.args.phase
    try:
        if tp.hydrators:
            out["hydrators"] = await start_hydrators(d, tp)
            print(f"hydrators ready: {[h.get('ready_after_s') for h in out['hydrators']]} s", flush=True)
        if phase in ("all", "run"):
            await capture_and_restore(d, tp, out, outfile)
        if phase in ("all", "failures"):
            kept = json.loads((tp.work / STATE).read_text())
            capture_id, cold = out["capture_id"], out["cold"] = kept["capture_id"], kept["cold"]
            before = await _call(_digests, tp, capture_id)
            out["failures"] = await failures(d, tp, capture_id, cold)
            result = await restore(d, tp, capture_id, f"after-failures-{int(time.time())}", cold,
                                   deadline=tp.args.deadline)
            await remove(d, result["names"])
            out.setdefault("restores", []).append(result)
            out["images_unchanged"] = before == await _call(_digests, tp, capture_id) and out.get(
                "images_unchanged", True)
    except FAILURES as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"FAILED: {out['error'][-4000:]}", flush=True)
    finally:  # whatever happened, no unit of this activation is left running
        await _remove_all(d, [*(f"tp-serving-{r}" for r in range(tp.world)),
                              *(f"tp_node_{r}" for r in range(tp.world)), *tp.hydrators])


def _per(restored: dict[str, Any], key: str) -> str:
    return " / ".join(f"{x[key] or 0:.2f}" for x in restored["ranks"])


def report(out: dict[str, Any]) -> bool:
    """Print the tables; True when every goal of the run that can be checked here was met."""
    cold, rows = out.get("cold"), []
    if cold:
        m = cold["measured"]
        rows.append(["cold start", f"{cold['first_token_s']:.2f}", "-", "-", "-", "-", "-", "-",
                     f"{m['decode_tokens_per_s']:.1f}", f"{m.get('busbw_gbps') or 0:.1f}", "-", "reference"])
    for i, r in enumerate(out.get("restores", [])):
        m, hyd = r["measured"], r["hydration"]
        rows.append([f"restore {i + 1}", f"{r['first_token_s']:.2f}", _per(r, "criu_s"), _per(r, "cuda_s"),
                     " / ".join(f"{x['gbps'] or 0:.1f}" for x in hyd["ranks"]), f"{hyd['aggregate_gbps'] or 0:.1f}",
                     _per(r, "recreate_s"), f"{cold['first_token_s'] / r['first_token_s']:.1f}x" if cold else "-",
                     f"{m['decode_tokens_per_s']:.1f}", f"{m.get('busbw_gbps') or 0:.1f}",
                     "ok" if r["vs_cold"]["ok"] else f"DOWNGRADED {r['vs_cold']}",
                     "identical" if r["identical"] else "DIFFERENT"])
    if rows:
        print(table(["run", "Docker-to-first-token (s)", "CRIU per rank", "CUDA per rank", "hydration GB/s per rank",
                     "aggregate GB/s", "NCCL + graph per rank", "vs cold", "decode tok/s", "all-reduce busbw GB/s",
                     "within 2%", "tokens + first logits"], rows))
    if out.get("failures"):
        print(table(["failure", "every rank stopped, named", "units left", "seconds"],
                    [[f["case"], f["ok"], f.get("units_left"), f.get("seconds")] for f in out["failures"]]))
    print(f"images unchanged: {out.get('images_unchanged')}")
    restores = out.get("restores", [])
    return ("error" not in out and all(r["identical"] and r["vs_cold"]["ok"] for r in restores)
            and all(f["ok"] for f in out.get("failures", [])) and out.get("images_unchanged", True))


async def main() -> int:
    args = arguments()
    try:
        plan = tp_plan.from_arguments(args, args.work)
    except tp_plan.PlanError as exc:
        print(f"plan: {exc}", flush=True)
        return 2
    print(tp_plan.describe(plan), flush=True)
    if args.plan or not plan.fits:
        return 0 if plan.fits else 2
    args.layers = plan.layers
    out: dict[str, Any] = {"plan": plan.to_json(), "phase": args.phase, "world_size": args.world_size,
                           "shape": args.shape, "layers": args.layers, "gpus": args.gpus, "hydrator": args.hydrator}
    outfile = Path(args.out, f"e2e-tp-{args.phase}.json")
    if args.phase in ("all", "weights"):
        tp = Activation(args, "", Path(args.work))
        tp.prepare()
        out["removed"] = tp.forget_other_runs(weights=True)  # another size's weights: /dev/shm is memory
        out["weights"] = await _call(write_weights, tp)
        print(f"weights: {json.dumps(out['weights'])[:600]}", flush=True)
        if args.phase == "weights":
            outfile.write_text(json.dumps(out, indent=1, default=str))
            return 0
    d, image = await open_driver(args)
    tp = Activation(args, image, Path(args.work))
    tp.prepare()
    if not tp.weights_written():
        print(f"no weights under {tp.weights}: run --phase weights first", flush=True)
        return 2
    await steps(d, tp, out, outfile)
    outfile.write_text(json.dumps(out, indent=1, default=str))
    return 0 if report(out) else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

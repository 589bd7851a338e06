"""Tensor-parallel restore through the daemon (issue 16): every rank in its own capsule container.

    python bench/e2e_tp2.py --state-dir DIR --capsule TAG --work DIR --out DIR [--world-size 2] [--layers 16]
                            [--gpus own|all] [--restores 2] [--build CONTEXT=TAG]

Against a running `coldsnap-provider serve` (`[gpus] mode = "native"`, `[runtime] privileged =
"host-capabilities"`), through the public client only, as a ColdSnap controller drives a TP activation
(spec 7.1: one container per launch unit, host network, the unit's GPUs, the coordinator shared):

1. the capsule pinned by its image ID; each rank's weights written once on the host (engines/engine_tp2.py);
2. cold: one detached serving workload per rank (`gpus` = that rank's GPU, or every GPU with `--gpus all`),
   each `engine_llama.py launch` (PID floor, session leader) of `engine_tp2.py serve`, NCCL between the
   containers over the host network; timed from the first `workload-run` to rank 0's first streamed token;
3. capture: one `workload-exec python -m coldsnap_probe capture --rank R ...` per rank container, all at once,
   meeting through the coordinator directory (communicators destroyed first: `recreate-from-plan` on 580);
4. `--restores` times: one restore unit per rank, launched together; each unit's worker restores its rank
   (CRIU paused, CUDA after every rank exists, released together, hydration, communicators recreated, graph
   re-captured); each unit's readiness check, report and `workload-inspect` (the ColdSnap labels), then the
   first token; tokens and first-step logits must equal the cold run's on every rank;
5. what must fail with every unit stopped and removed: a tampered graph policy record on the last rank, a peer
   unit that never arrives, the last rank's restored process killed mid-restore; then one more restore.
Prints the tables and writes e2e-tp2.json under --out.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import stages, table
from bench.e2e_restore import (
    COORD,
    CRIU,
    ENGINE,
    IMAGES,
    PID_FLOOR,
    RUN,
    Driver,
    E2EError,
    Layout,
    await_unit,
    inspect_capsule,
    json_in,
    launch_unit,
    output,
    restore_command,
    unit_labels,
)
from bench.tp2_restore import generate, start_ranks
from coldsnap_probe import image_digest

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_RAS_ENABLE": "0"}  # see engines/engine_tp2.py
# What a step of the sequence can fail with besides E2EError: a garbled report, a missing log line, the engine's
# socket. Each is recorded as that step's failure, so that the units are still removed.
FAILURES = (E2EError, OSError, ValueError, KeyError, RuntimeError, TimeoutError)


@dataclasses.dataclass
class Activation:
    """The ranks of one TP engine: host directories, one Layout per rank (its GPUs), unit names."""

    args: argparse.Namespace
    image: str
    work: Path

    def __post_init__(self) -> None:
        self.world = self.args.world_size
        self.run_dir, self.images, self.coord = self.work / "run", self.work / "images", self.work / "coord"
        base = Layout(run_dir=self.run_dir, images_dir=self.images, weights=self.run_dir, network="host",
                      coordinator=self.coord, extra_environment=NCCL_ENV)
        every = tuple(str(g) for g in range(self.world))
        self.layouts = [dataclasses.replace(base, gpus=(str(r),) if self.args.gpus == "own" else every)
                        for r in range(self.world)]

    def prepare(self) -> None:
        self.layouts[0].prepare()
        self.coord.mkdir(exist_ok=True)
        written = (self.run_dir / f"weights-rank-{self.world - 1}.json").exists()
        if not written and any(p.wait() != 0 for p in start_ranks("weights", self.world, self.run_dir,
                                                                   self.args.layers)):
            raise E2EError("writing the ranks' weights failed")

    def serve_command(self, rank: int) -> list[str]:
        layout = self.layouts[rank]
        return [f"{ENGINE}/engine_llama.py", "launch", "--pid-floor", str(PID_FLOOR), "--log",
                f"{RUN}/launch-{rank}.log", "--", layout.python, f"{ENGINE}/engine_tp2.py", "serve", "--rank",
                str(rank), "--world-size", str(self.world), "--dir", RUN, "--layers", str(self.args.layers),
                "--log", f"{RUN}/rank-{rank}.log"]

    def ranks(self, namespace: str, rank: int, barrier_timeout: float) -> list[str]:
        return ["--rank", str(rank), "--world-size", str(self.world), "--coordinator", COORD, "--namespace",
                namespace, "--barrier-timeout", f"{barrier_timeout:g}"]

    def log(self, name: str) -> dict[str, dict[str, Any]]:
        return stages(self.run_dir / name)


def _call(fn: Any, *args: Any) -> Any:
    return anyio.to_thread.run_sync(lambda: fn(*args))


async def cold_start(d: Driver, tp: Activation, limit: float = 180.0) -> dict[str, Any]:
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
    with anyio.move_on_after(limit) as waited:
        while True:
            logs = [tp.log(f"rank-{r}.log") for r in range(tp.world)]
            launches = [tp.log(f"launch-{r}.log") for r in range(tp.world)]
            bad = [(r, log.get("failed") or launch.get("engine_exited")) for r, (log, launch)
                   in enumerate(zip(logs, launches, strict=True)) if "failed" in log or "engine_exited" in launch]
            if bad:
                tails = [output(await d.expect("logs", "workload-logs", name=n, tail=20))[-1500:] for n in names]
                raise E2EError(f"a rank failed before it was ready: {bad} {tails}")
            if all("ready" in log for log in logs):
                break
            await anyio.sleep(0.05)
    if waited.cancelled_caught:
        raise E2EError(f"the ranks were not ready within {limit:.0f} s")
    first = await _call(generate, tp.run_dir, tp.args.tokens)
    again = await _call(generate, tp.run_dir, tp.args.tokens)
    logs = [tp.log(f"rank-{r}.log") for r in range(tp.world)]
    return {"names": names, "first_token_s": first["first_unix"] - created, "create_start_s": started - created,
            "tokens": first["tokens"], "first_logits_sha256": first["first_logits_sha256"],
            "peers_agree": first["peers_agree"], "repeatable": again["tokens"] == first["tokens"],
            "engine_pids": [int(tp.log(f"launch-{r}.log")["engine_forked"]["engine_pid"]) for r in range(tp.world)],
            "stages_s": [{k: round(v["unix"] - created, 3) for k, v in log.items() if "unix" in v} for log in logs]}


async def capture(d: Driver, tp: Activation, cold: dict[str, Any], capture_id: str) -> list[dict[str, Any]]:
    """Every rank's worker inside its serving container, all at once, meeting at the coordinator."""
    (tp.images / capture_id).mkdir(parents=True)
    reports: list[dict[str, Any]] = [{} for _ in range(tp.world)]
    errors: list[str] = []

    async def one(rank: int) -> None:
        command = [tp.layouts[rank].python, "-m", "coldsnap_probe", "capture", "--pid", str(cold["engine_pids"][rank]),
                   "--images", f"{IMAGES}/{capture_id}/rank-{rank}", "--criu", CRIU,
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
                  victim: int | None = None, readiness_timeout: float = 120) -> dict[str, Any]:
    """One restore unit per rank, launched together; each one's readiness, report and inspect; the first token,
    compared with `reference` (the cold run's). Any failure removes every unit (the controller's rollback) and
    raises, naming each rank's cause."""
    chosen = list(range(tp.world)) if ranks is None else ranks
    images = images or [f"{capture_id}/rank-{r}" for r in range(tp.world)]
    names = {r: f"tp_node_{r}" for r in chosen}
    labels = {r: unit_labels(capture_id, "tp", r) for r in chosen}
    units: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    killed: list[int] = []

    async def one(rank: int) -> None:
        try:
            command = restore_command(tp.layouts[rank], images[rank], *tp.ranks(namespace, rank, barrier_timeout))
            created, started = await launch_unit(d, tp.image, tp.layouts[rank], names[rank], capture_id,
                                                 labels=labels[rank], command=command)
            units[rank] = {"created": created, "create_start_s": started - created}
            units[rank].update(await await_unit(d, names[rank], created, labels=labels[rank],
                                                readiness_timeout=readiness_timeout))
        except FAILURES as exc:
            errors.append(f"rank {rank}: {exc}")
            units.pop(rank, None)

    async def kill_after_criu(rank: int) -> None:
        """The fault case: the rank's restored process dies between its CRIU restore and its CUDA restore."""
        published = tp.coord / namespace / "criu-restored" / f"{rank}.json"
        with anyio.move_on_after(readiness_timeout):
            while not published.exists():
                await anyio.sleep(0.005)
            pid = int(json.loads(published.read_text())["value"]["pid"])
            reply = await d.runtime("workload-exec", name=names[rank],
                                    execution={"command": ["kill", "-KILL", str(pid)]})
            if reply.get("ok"):
                killed.append(pid)

    began = time.time()
    async with anyio.create_task_group() as tg:
        if victim is not None:
            tg.start_soon(kill_after_criu, victim)
        async with anyio.create_task_group() as ranks_group:
            for rank in chosen:
                ranks_group.start_soon(one, rank)
        tg.cancel_scope.cancel()  # the fault injector has nothing left to wait for
    if errors or len(units) != tp.world:
        for name in names.values():
            await d.runtime("workload-remove", name=name)
        missing = sorted(set(range(tp.world)) - set(units))
        raise E2EError((" | ".join(errors) or f"no restore unit was launched for rank(s) {missing}")
                       + (f" (rank {victim}'s restored process {killed[0]} was killed)" if killed else ""))
    try:
        answer = await _call(generate, tp.run_dir, tp.args.tokens)
    except FAILURES as exc:
        for name in names.values():
            await d.runtime("workload-remove", name=name)
        raise E2EError(f"the restored ranks did not answer: {type(exc).__name__}: {exc}") from exc
    reports = [units[r]["worker_report"] for r in range(tp.world)]
    return {"first_token_s": answer["first_unix"] - began, "tokens": answer["tokens"],
            "first_logits_sha256": answer["first_logits_sha256"], "peers_agree": answer["peers_agree"],
            "identical": answer["tokens"] == reference["tokens"] and answer["peers_agree"]
            and answer["first_logits_sha256"] == reference["first_logits_sha256"],
            "names": list(names.values()), "ranks": [{
                "create_start_s": units[r]["create_start_s"], "worker_started_s": units[r]["created"] - began
                + (units[r]["worker_started_s"] or 0), "readiness_s": units[r]["created"] - began
                + units[r]["readiness_s"], "criu_s": rep.get("criu_restore_seconds"),
                "cuda_s": rep.get("cuda_restore_seconds"),
                "hydration_s": (rep.get("hydration") or {}).get("phase_seconds"),
                "hydration_gbps": (rep.get("hydration") or {}).get("gbps"),
                "recreate_s": rep.get("communicator_recreate_seconds"), "barrier_wait_s": rep.get("barrier_wait_s"),
                "started_at": units[r]["started_at"]} for r, rep in enumerate(reports)]}


async def remove(d: Driver, names: list[str]) -> None:
    for name in names:
        await d.expect(f"removing {name}", "workload-remove", name=name)


async def failures(d: Driver, tp: Activation, capture_id: str, reference: dict[str, Any]) -> list[dict[str, Any]]:
    last = tp.world - 1
    tampered = f"{capture_id}-tampered/rank-{last}"
    shutil.copytree(tp.images / capture_id / f"rank-{last}", tp.images / tampered)
    record = json.loads((tp.images / tampered / "graph.json").read_text())
    record["record"]["decision"] = "qualified_exact_nccl_in_place"
    (tp.images / tampered / "graph.json").write_text(json.dumps(record))
    cases: list[tuple[str, dict[str, Any]]] = [
        ("tampered graph record on the last rank",
         {"images": [*(f"{capture_id}/rank-{r}" for r in range(last)), tampered]}),
        ("peer unit never arrives (rank 0 alone, 5 s barrier)", {"ranks": [0], "barrier_timeout": 5}),
        (f"rank {last}'s restored process killed after CRIU", {"victim": last, "barrier_timeout": 30})]
    rows = []
    for i, (case, options) in enumerate(cases):
        started = time.time()
        try:
            result = await restore(d, tp, capture_id, f"fail-{i}", reference, readiness_timeout=60, **options)
            await remove(d, result["names"])
            rows.append({"case": case, "ok": False, "error": "the restore succeeded"})
        except E2EError as exc:
            left = [f"tp_node_{r}" for r in range(tp.world) if not await d.gone(f"tp_node_{r}")]
            rows.append({"case": case, "ok": not left and exc.code == "runtime_failed", "units_left": left,
                         "seconds": round(time.time() - started, 2), "error_code": exc.code,
                         "error": str(exc)[-2500:]})
        print(f"failure case: {case}: {json.dumps(rows[-1])[:1200]}", flush=True)
    return rows


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--capsule", required=True)
    parser.add_argument("--build", default="", metavar="CONTEXT=TAG")
    parser.add_argument("--work", required=True, help="host directory for weights, run, coordinator and images")
    parser.add_argument("--out", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--restores", type=int, default=2)
    parser.add_argument("--gpus", choices=["own", "all"], default="own",
                        help="each rank's unit gets its own GPU (spec 7.1) or every GPU of the host")
    parser.add_argument("--skip-failures", action="store_true")
    args = parser.parse_args()
    d = Driver(Path(args.state_dir))
    await d.open()
    out: dict[str, Any] = {"world_size": args.world_size, "layers": args.layers, "gpus": args.gpus}
    if args.build:
        context, _, tag = args.build.partition("=")
        await d.expect(f"image-build of {tag}", "image-build", build={
            "dockerfile": base64.b64encode(Path(context, "Dockerfile").read_bytes()).decode(), "context": context,
            "tag": tag, "pull": False})
    capsule = await inspect_capsule(d, args.capsule)
    tp = Activation(args, str(capsule["id"]), Path(args.work))
    tp.prepare()
    outfile = Path(args.out, "e2e-tp2.json")
    cold: dict[str, Any] = {}
    try:
        cold = await cold_start(d, tp)
        out["cold"] = cold
        print(f"cold: {cold['first_token_s']:.2f} s to the first token, tokens {cold['tokens'][:6]}...", flush=True)
        capture_id = f"tp-{time.strftime('%Y%m%dT%H%M%S')}"
        out["capture"] = await capture(d, tp, cold, capture_id)
        print(f"captured: {[c.get('timings_s') for c in out['capture']]}", flush=True)
        await remove(d, cold["names"])
        before = [image_digest(tp.images / capture_id / f"rank-{r}") for r in range(tp.world)]
        out["restores"] = []
        for i in range(args.restores):
            result = await restore(d, tp, capture_id, f"restore-{i + 1}", cold)
            await remove(d, result["names"])
            out["restores"].append(result)
            print(f"restore {i + 1}: {result['first_token_s']:.2f} s, identical {result['identical']}", flush=True)
            outfile.write_text(json.dumps(out, indent=1, default=str))
        if not args.skip_failures:
            out["failures"] = await failures(d, tp, capture_id, cold)
            result = await restore(d, tp, capture_id, "restore-after-failures", cold)
            await remove(d, result["names"])
            out["restores"].append(result)
        out["images_unchanged"] = before == [image_digest(tp.images / capture_id / f"rank-{r}")
                                             for r in range(tp.world)]
        out["image_bytes"] = [sum(p.stat().st_size for p in (tp.images / capture_id / f"rank-{r}").rglob("*")
                                  if p.is_file()) for r in range(tp.world)]
    except FAILURES as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(f"FAILED: {out['error'][-4000:]}", flush=True)
    finally:  # whatever happened, no unit of this activation is left running
        for name in [*(f"tp-serving-{r}" for r in range(tp.world)), *(f"tp_node_{r}" for r in range(tp.world))]:
            with anyio.CancelScope(shield=True):
                await d.runtime("workload-remove", name=name)
    outfile.write_text(json.dumps(out, indent=1, default=str))
    rows = []
    if cold:
        rows.append(["cold start", f"{cold['first_token_s']:.2f}", "-", "-", "-", "-", "-", "-", "reference"])
    for i, r in enumerate(out.get("restores", [])):
        ranks = r["ranks"]
        rows.append([f"restore {i + 1}", f"{r['first_token_s']:.2f}",
                     " / ".join(f"{x['worker_started_s']:.2f}" for x in ranks),
                     " / ".join(f"{x['criu_s']:.2f}" for x in ranks), " / ".join(f"{x['cuda_s']:.2f}" for x in ranks),
                     " / ".join(f"{x['hydration_s'] or 0:.2f}" for x in ranks),
                     " / ".join(f"{x['recreate_s'] or 0:.2f}" for x in ranks),
                     f"{cold['first_token_s'] / r['first_token_s']:.1f}x",
                     "identical" if r["identical"] else "DIFFERENT"])
    if rows:
        print(table(["run", "Docker-to-first-token (s)", "worker start per rank", "CRIU per rank", "CUDA per rank",
                     "hydration per rank", "NCCL + graph per rank", "vs cold", "tokens + first logits"], rows))
    if out.get("failures"):
        print(table(["failure", "refused", "units left", "seconds"],
                    [[f["case"], f["ok"], f.get("units_left"), f.get("seconds")] for f in out["failures"]]))
    print(f"images unchanged: {out.get('images_unchanged')}; image bytes per rank: {out.get('image_bytes')}")
    ok = ("error" not in out and all(r["identical"] for r in out.get("restores", []))
          and all(f["ok"] for f in out.get("failures", [])) and out.get("images_unchanged", False))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

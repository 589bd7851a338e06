"""The ranks of one tensor-parallel activation as capsule units (issues 16, 27, 28), for bench/e2e_tp.py.

`Activation`: host directories, one `Layout` per rank (its own GPU, host network, the coordinator and the
weights mounted), unit names and commands. `write_weights` writes every rank's weight file at once (once per
machine: a complete set is reused). `start_hydrators` runs one node hydrator per GPU (its rank's weights
page-locked once, `--staging`), each a unit of its own GPU, so that every rank's restore stages its weights on
its own GPU concurrently. `measure` asks the serving ranks for a decode rate and an all-reduce's bus bandwidth:
what "nothing downgraded" compares between the cold engine and every restore.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import stages
from bench.e2e_restore import COORD, ENGINE, PID_FLOOR, RUN, WEIGHTS, Driver, E2EError, Layout, wait_hydrator
from bench.tp2_restore import generate
from coldsnap_probe import jsonline

ROOT = Path(__file__).resolve().parent.parent
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "NCCL_RAS_ENABLE": "0"}  # see engines/engine_tp.py; P2P stays on
DOWNGRADE_TOLERANCE = 0.02  # decode tokens/s and all-reduce bus bandwidth after restore vs cold (issue 27)


@dataclasses.dataclass
class Activation:
    """The ranks of one TP engine: host directories, one Layout per rank (its GPUs), unit names."""

    args: argparse.Namespace
    image: str
    work: Path

    def __post_init__(self) -> None:
        args = self.args
        self.world = args.world_size
        self.run_dir, self.images, self.coord = self.work / "run", self.work / "images", self.work / "coord"
        # One weight set per shape, layer count and world size, kept across calls (a warm machine keeps /dev/shm).
        self.weights = (Path(args.weights_dir) if getattr(args, "weights_dir", "")
                        else self.work / f"weights-{args.shape}-L{args.layers}-tp{self.world}")
        base = Layout(run_dir=self.run_dir, images_dir=self.images, weights=self.weights, network="host",
                      coordinator=self.coord, extra_environment=NCCL_ENV)
        every = tuple(str(g) for g in range(self.world))
        self.layouts = [dataclasses.replace(base, gpus=(str(r),) if args.gpus == "own" else every)
                        for r in range(self.world)]
        self.hydrators = [f"tp-hydrator-{r}" for r in range(self.world)] if args.hydrator else []

    def prepare(self) -> None:
        self.layouts[0].prepare()
        self.coord.mkdir(exist_ok=True)
        self.weights.mkdir(parents=True, exist_ok=True)

    def forget_other_runs(self, *, weights: bool) -> list[str]:
        """Free /dev/shm of what earlier runs left under --work: other weight sets (`weights`), and every
        capture's images and coordinator namespaces (before a new capture). Returns what was removed."""
        stale = [p for p in self.work.glob("weights-*") if weights and p != self.weights]
        stale += [*self.images.iterdir(), *self.coord.iterdir()] if not weights else []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return [p.name for p in stale]

    def weights_written(self) -> bool:
        return all((self.weights / f"weights-rank-{r}.json").exists() for r in range(self.world))

    def engine_options(self, rank: int, *, weights: str, run: str) -> list[str]:
        args = self.args
        return ["--rank", str(rank), "--world-size", str(self.world), "--dir", run, "--weights", weights,
                "--shape", args.shape, "--layers", str(args.layers)]

    def serve_command(self, rank: int) -> list[str]:
        hydrator = ["--hydrator", f"{RUN}/hydrator-{rank}.sock"] if self.hydrators else []
        return [f"{ENGINE}/engine_llama.py", "launch", "--pid-floor", str(PID_FLOOR), "--log",
                f"{RUN}/launch-{rank}.log", "--", self.layouts[rank].python, f"{ENGINE}/engine_tp.py", "serve",
                *self.engine_options(rank, weights=WEIGHTS, run=RUN), *hydrator, "--log", f"{RUN}/rank-{rank}.log"]

    def ranks(self, namespace: str, rank: int, barrier_timeout: float) -> list[str]:
        return ["--rank", str(rank), "--world-size", str(self.world), "--coordinator", COORD, "--namespace",
                namespace, "--barrier-timeout", f"{barrier_timeout:g}"]

    def log(self, name: str) -> dict[str, dict[str, Any]]:
        return stages(self.run_dir / name)


def write_weights(tp: Activation) -> dict[str, Any]:
    """Every rank's weight file at once, each generated on its own GPU (host processes). A rank whose file is
    complete (its index exists: written last) is kept, so a call cut short is finished by the next one."""
    missing = [r for r in range(tp.world) if not (tp.weights / f"weights-rank-{r}.json").exists()]
    if not missing:
        return {"reused": True}
    started = time.time()
    procs = {r: subprocess.Popen([sys.executable, str(ROOT / "engines" / "engine_tp.py"), "weights",
                                  *tp.engine_options(r, weights=str(tp.weights), run=str(tp.run_dir)),
                                  "--log", str(tp.weights / f"write-{r}.log")],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=ROOT)
             for r in missing}  # in the bench's process group: a step cut short by its timeout ends them too
    if failed := [r for r, p in procs.items() if p.wait() != 0]:
        raise E2EError(f"writing the weights of rank(s) {failed} failed (see {tp.weights}/write-*.log)")
    written = [stages(tp.weights / f"write-{r}.log").get("weights_written", {}) for r in missing]
    total = sum(int(w.get("bytes", 0)) for w in written)
    seconds = time.time() - started
    return {"reused": False, "ranks_written": missing, "seconds": seconds, "bytes": total,
            "gbps": total / seconds / 1e9, "ranks": written}


async def start_hydrators(d: Driver, tp: Activation, limit: float = 300.0) -> list[dict[str, Any]]:
    """One node hydrator per GPU, as a unit of that GPU only, all at once: its rank's weights page-locked (paid
    once per node, not part of any Docker-to-first-token), staging on. Returns each one's ready line."""
    results: list[dict[str, Any]] = [{} for _ in tp.hydrators]
    errors: list[str] = []

    async def one(rank: int) -> None:
        name = tp.hydrators[rank]
        (tp.run_dir / f"hydrator-{rank}.sock").unlink(missing_ok=True)
        layout = dataclasses.replace(tp.layouts[rank], gpus=(str(rank),))
        spec = layout.unit(name, tp.image, entrypoint=layout.python, command=[
            "-m", "coldsnap_probe.hydration", "serve", "--staging", "--socket", f"{RUN}/hydrator-{rank}.sock",
            f"{WEIGHTS}/weights-rank-{rank}.bin"])
        try:
            await d.expect(f"evicting {name}", "workload-remove", name=name)
            created = time.time()
            await d.expect(f"starting the hydrator {name}", "workload-run", workload=spec)
            results[rank] = await wait_hydrator(d, name, created, limit)
        except E2EError as exc:
            errors.append(f"rank {rank}'s hydrator: {exc}")

    async with anyio.create_task_group() as tg:
        for rank in range(len(tp.hydrators)):
            tg.start_soon(one, rank)
    if errors:
        raise E2EError(" | ".join(errors))
    return results


def measure(tp: Activation) -> dict[str, Any]:
    """Decode tokens/s (median of three generations of `--decode-tokens`) and the bus bandwidth of an all-reduce of
    `--allreduce-bytes` on every rank's process group (the slowest rank's), on the serving ranks."""
    args = tp.args
    rates = []
    for _ in range(3):
        answer = generate(tp.run_dir, args.decode_tokens)
        rates.append(answer.get("decode_tokens_per_s") or 0.0)
    result: dict[str, Any] = {"decode_tokens_per_s": statistics.median(rates), "decode_runs": rates}
    if tp.world > 1:
        reduced = jsonline.request(tp.run_dir / "rank-0.sock", {"op": "allreduce", "bytes": args.allreduce_bytes,
                                                                 "iters": args.allreduce_iters}, timeout=300.0)
        if not reduced.get("ok"):
            raise E2EError(f"the all-reduce measurement failed: {reduced.get('error')}")
        result.update(busbw_gbps=reduced["busbw_gbps"], allreduce=reduced["ranks"])
    return result


def downgrade(cold: dict[str, Any], restored: dict[str, Any]) -> dict[str, Any]:
    """Restored vs cold, as ratios; `ok` when neither fell by more than DOWNGRADE_TOLERANCE."""
    ratios = {key: restored[key] / cold[key] for key in ("decode_tokens_per_s", "busbw_gbps")
              if cold.get(key) and restored.get(key) is not None}
    return {**ratios, "ok": bool(ratios) and all(r >= 1 - DOWNGRADE_TOLERANCE for r in ratios.values())}


def hydration_rates(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank and aggregate weight copy rates of one restore: every rank stages concurrently on its own GPU,
    so the aggregate is all the bytes over the slowest rank's copy."""
    per_rank: list[dict[str, Any]] = []
    sizes: list[int] = []
    copies: list[float] = []
    for report in reports:
        hydration = report.get("hydration") or {}
        staged = hydration.get("staged") or {}
        sizes.append(int(staged.get("bytes") or hydration.get("bytes") or 0))
        copies.append(float(staged.get("copy_s") or hydration.get("seconds") or 0.0))
        per_rank.append({"bytes": sizes[-1], "copy_s": copies[-1],
                         "gbps": sizes[-1] / copies[-1] / 1e9 if copies[-1] else None, "staged": bool(staged),
                         "phase_s": hydration.get("phase_seconds")})
    slowest, total = max(copies, default=0.0), sum(sizes)
    return {"ranks": per_rank, "aggregate_gbps": total / slowest / 1e9 if slowest else None, "bytes": total}


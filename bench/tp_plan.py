"""What a tensor-parallel run at size needs, checked before anything starts (issues 27, 28): `--plan`.

    python bench/tp_plan.py --world-size N --shape 70b|405b|small [--layers L] [--memory-limit 560G]
                            [--gpu-memory 143771M] [--work /dev/shm/cs-e2e-tp]

Sizes every rank's weight file exactly as `engines/engine_tp.py weights` lays it out (same shapes, same 4 KiB
alignment), then checks the host's memory and each GPU's:
* **host**: the weights live in /dev/shm (tmpfs pages are charged to the memory cgroup that writes them), the
  node hydrators page-lock those same pages (no second copy), and each rank adds its engine process, its CRIU
  images and, while restoring, the restored process (`HOST_PER_RANK`), plus the daemon, dockerd and the bench
  (`HOST_FIXED`). The limit is the memory cgroup's `memory.max` (this process's and its ancestors', the
  smallest) or `--memory-limit`, whichever is smaller, never MemTotal: on the lent GPU machines MemTotal reads
  low at first and grows as memory is touched.
* **GPU**: the weights, the KV cache and `GPU_WORKSPACE` (context, graph pool, NCCL buffers, the 1 GiB all-reduce
  buffer). While a rank restores, the hydrator stages its weights on the GPU while the restored engine holds
  everything but them: the same total.
* **/dev/shm**: its size (statvfs of `--work`) must hold the weights and the images; `scripts/device tp`
  enlarges it when the plan says so.
Without `--layers` the shape's own layer count is used when it fits, else the largest count that fits ("the
largest that fits", e.g. the 405B shape at TP8 on 560 GiB). Exit 0 when the run fits, 2 when it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engines.engine_tp import ALIGN, SHAPES, weight_specs

GIB = 1 << 30
HOST_PER_RANK = 12 * GIB  # engine process (torch, CUDA context, pinned ring) + its CRIU images + a restored copy
HOST_FIXED = 16 * GIB  # dockerd, the daemon, the bench, page cache of the capsule image
HOST_HEADROOM = 0.95  # of the limit: the kernel's own use, and what the VM's balloon has not given yet
GPU_WORKSPACE = 6 * GIB  # CUDA context, graph pool, NCCL buffers, the all-reduce measurement, the hydrator's context
H2D_GBPS = 55.0  # pinned host-to-device ceiling per H200, measured (shared/device/README.md)
H200_MEMORY = 143771 << 20
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


class PlanError(ValueError):
    """The run cannot be planned: a bad argument, or no memory limit is known."""


def parse_size(text: str) -> int:
    """`560G`, `143771M`, `256GiB`, `1073741824` (binary units: the cgroup's and nvidia-smi's)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise PlanError(f"not a size: {text!r} (e.g. 560G, 143771M)")
    return int(float(match.group(1)) * (1 << (10 * " KMGT".index(match.group(2).upper() or " "))))


def cgroup_limit(proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The smallest `memory.max` from this process's cgroup (v2) up to the root; None when none is set."""
    try:
        line = next(x for x in proc.read_text().splitlines() if x.startswith("0::"))
    except (OSError, StopIteration):
        return None
    limits = []
    here = root / line[3:].strip().lstrip("/")
    while True:
        try:
            value = (here / "memory.max").read_text().strip()
        except OSError:
            value = "max"
        if value.isdigit():
            limits.append(int(value))
        if here == root or root not in here.parents:
            break
        here = here.parent
    return min(limits) if limits else None


def tensor_bytes(shape: str, world: int, layers: int) -> int:
    """One rank's weight file, byte for byte as `engine_tp.py weights` writes it (every rank's is the same size)."""
    specs = weight_specs(shape, world, layers, 0)
    return sum(-(-(2 * rows * cols) // ALIGN) * ALIGN for _, (rows, cols), _, _ in specs)


@dataclass(frozen=True)
class Plan:
    """A TP run's sizes and whether they fit (bytes unless named otherwise)."""

    world_size: int
    shape: str
    layers: int
    shape_layers: int
    largest_that_fits: bool
    weights_per_rank: int
    weights_total: int
    kv_cache_per_rank: int
    memory_limit: int
    memory_limit_source: str
    host_needed: int
    gpu_memory: int
    gpu_needed_per_rank: int
    shm_size: int | None
    shm_needed: int
    hydration_s_at_h2d_ceiling: float
    problems: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "fits": self.fits}


def _kv_bytes(shape: str, world: int, layers: int) -> int:
    s = SHAPES[shape]
    return int(layers * 2 * s["max_seq"] * (s["kv_heads"] // world) * s["head_dim"] * 2)


def _needs(shape: str, world: int, layers: int) -> tuple[int, int, int]:
    """(host bytes, GPU bytes per rank, /dev/shm bytes) of `layers` layers."""
    weights = tensor_bytes(shape, world, layers)
    host = world * weights + world * HOST_PER_RANK + HOST_FIXED
    gpu = weights + _kv_bytes(shape, world, layers) + GPU_WORKSPACE
    return host, gpu, world * weights + world * (HOST_PER_RANK // 3)  # the images live in /dev/shm too


def _split_problems(shape: str, world: int) -> list[str]:
    s = SHAPES[shape]
    return [f"{key} {s[key]} does not split over {world} ranks" for key in ("heads", "kv_heads", "ffn")
            if s[key] % world]


def plan(world: int, shape: str, layers: int = 0, *, memory_limit: int | None = None, memory_source: str = "",
         gpu_memory: int = H200_MEMORY, shm_size: int | None = None) -> Plan:
    """The run's plan; `layers` 0: the shape's own count if it fits, else the largest count that fits."""
    if shape not in SHAPES:
        raise PlanError(f"shape must be one of {', '.join(sorted(SHAPES))}, got {shape!r}")
    if world < 1:
        raise PlanError(f"world size must be at least 1, got {world}")
    full = SHAPES[shape]["layers"]
    if not 0 <= layers <= full:
        raise PlanError(f"layers must be within [1, {full}] for the {shape} shape, got {layers}")
    if memory_limit is None:
        raise PlanError("no memory limit: the cgroup sets none, so pass --memory-limit (MemTotal is not used: it "
                        "reads low on the GPU machines until memory is touched)")
    problems = _split_problems(shape, world)

    def fits(n: int) -> bool:  # /dev/shm is not a bound: the device script enlarges it up to the memory limit
        host, gpu, _ = _needs(shape, world, n)
        return host <= memory_limit * HOST_HEADROOM and gpu <= gpu_memory

    chosen = layers or next((n for n in range(full, 0, -1) if fits(n)), 1)
    host, gpu, shm = _needs(shape, world, chosen)
    if host > memory_limit * HOST_HEADROOM:
        usable = memory_limit * HOST_HEADROOM / GIB
        problems.append(f"host memory: {host / GIB:.1f} GiB needed, {HOST_HEADROOM:.0%} of the "
                        f"{memory_limit / GIB:.1f} GiB limit ({memory_source}) is {usable:.1f}")
    if gpu > gpu_memory:
        problems.append(f"GPU memory: {gpu / GIB:.1f} GiB needed per rank, {gpu_memory / GIB:.1f} GiB per GPU")
    weights = tensor_bytes(shape, world, chosen)
    return Plan(world_size=world, shape=shape, layers=chosen, shape_layers=full,
                largest_that_fits=not layers and chosen < full, weights_per_rank=weights,
                weights_total=world * weights, kv_cache_per_rank=_kv_bytes(shape, world, chosen),
                memory_limit=memory_limit, memory_limit_source=memory_source, host_needed=host, gpu_memory=gpu_memory,
                gpu_needed_per_rank=gpu, shm_size=shm_size, shm_needed=shm,
                hydration_s_at_h2d_ceiling=weights / (H2D_GBPS * 1e9), problems=tuple(problems))


def limit_from(flag: str) -> tuple[int | None, str]:
    """The memory limit: the cgroup's and the flag's, the smaller; and where it came from."""
    found = [(v, src) for v, src in ((cgroup_limit(), "cgroup memory.max"),
                                     (parse_size(flag) if flag else None, "--memory-limit")) if v is not None]
    return min(found) if found else (None, "")


def shm_size_of(work: str) -> int | None:
    """The size of the filesystem that holds `work` (its nearest existing directory)."""
    path = Path(work)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan's options (bench/e2e_tp.py takes the same)."""
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--layers", type=int, default=0,
                        help="default: the shape's own layer count, or the largest that fits")
    parser.add_argument("--memory-limit", default="", help="host memory for the run (default: cgroup memory.max)")
    parser.add_argument("--gpu-memory", default=f"{H200_MEMORY >> 20}M", help="memory of each GPU")


def from_arguments(args: argparse.Namespace, work: str) -> Plan:
    """The plan of a parsed command line (`add_arguments`); PlanError when it cannot be made."""
    limit, source = limit_from(args.memory_limit)
    return plan(args.world_size, args.shape, args.layers, memory_limit=limit, memory_source=source,
                gpu_memory=parse_size(args.gpu_memory), shm_size=shm_size_of(work))


def describe(p: Plan) -> str:
    """The plan as a few lines a person reads before a run."""
    gb = 1e9
    lines = [f"TP{p.world_size} {p.shape}-shaped, {p.layers} of {p.shape_layers} layers"
             + (" (the largest that fits)" if p.largest_that_fits else ""),
             f"weights: {p.weights_per_rank / gb:.1f} GB a rank, {p.weights_total / gb:.1f} GB in all",
             f"host: {p.host_needed / GIB:.1f} GiB needed of {p.memory_limit / GIB:.1f} GiB ({p.memory_limit_source})",
             f"GPU: {p.gpu_needed_per_rank / GIB:.1f} GiB a rank of {p.gpu_memory / GIB:.1f} GiB",
             f"/dev/shm: {p.shm_needed / GIB:.1f} GiB needed, "
             + (f"{p.shm_size / GIB:.1f} GiB there" if p.shm_size is not None else "size unknown")
             + (" (enlarge it first)" if p.shm_size is not None and p.shm_needed > p.shm_size else ""),
             f"hydration bound: {p.hydration_s_at_h2d_ceiling:.2f} s a rank at {H2D_GBPS:.0f} GB/s, all ranks at once",
             "fits" if p.fits else "DOES NOT FIT: " + "; ".join(p.problems)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench/tp_plan.py")
    add_arguments(parser)
    parser.add_argument("--work", default="/dev/shm/cs-e2e-tp")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args()
    try:
        p = from_arguments(args, args.work)
    except PlanError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write((json.dumps(p.to_json(), indent=1) if args.json else describe(p)) + "\n")
    return 0 if p.fits else 2


if __name__ == "__main__":
    sys.exit(main())

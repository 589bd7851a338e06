"""A torch process, unchanged, for the interposer's GPU tests (run it under LD_PRELOAD=libcoldsnap_cuda.so).

    python -m tests.probe._torch_target DIR MIB [ZERO_MIB]

It holds MIB of random tensors, ZERO_MIB (default 160) of zeros (the dump's zero chunks), a cuBLAS matmul's output and a
captured CUDA graph, writes `ready` with their digests, then answers requests left as files in DIR (so it keeps
no descriptor CRIU would carry):
`check-<n>` -> `answer-check-<n>` (the digests recomputed: tensors read back, the matmul redone, the graph
replayed onto a zeroed output), `launch-<n>` -> `answer-launch-<n>` (a matmul launched and synchronised
by a thread; `finished_unix` says when it could run) and `churn-<n>` -> `answer-churn-<n>` (tensors of several
sizes made, half freed, the allocator's cache emptied, more made: `ok` when every value reads back as written).
`ready` and each check also name the allocator backend (PYTORCH_CUDA_ALLOC_CONF's `backend`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def answer(directory: Path, name: str, value: dict[str, Any]) -> None:
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps({**value, "pid": os.getpid()}))
    tmp.rename(directory / name)


def main() -> None:
    import torch

    directory, mib = Path(sys.argv[1]), int(sys.argv[2])
    zero_mib = int(sys.argv[3]) if len(sys.argv) > 3 else 160
    torch.manual_seed(0)
    data = torch.randn(mib << 18, device="cuda")  # MIB of float32
    zeros = torch.zeros(zero_mib << 18, device="cuda")  # a region of its own, 64 MiB chunks of zeros (never written)
    x, w = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    static_in = torch.randn(1024, 1024, device="cuda")
    # The graph's output is made before the capture and written in place (H200, review of issue 36): under
    # `backend:cudaMallocAsync` a tensor the capture allocates is the graph's own memory, which the driver backs for
    # the graph's runs (zeroing it before the first replay was an illegal access), and rebinding a name made outside
    # the capture frees that tensor inside it ("freeAsync() was called on an uncaptured allocation").
    static_out = torch.empty(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, on the stream the capture uses, as torch asks
        torch.add(static_in @ w, 1, out=static_out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        torch.add(static_in @ w, 1, out=static_out)

    def digest(t: Any) -> str:
        return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()

    def digests() -> dict[str, str]:
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return {"tensor": digest(data), "matmul": digest(x @ w), "graph": digest(static_out), "zeros": digest(zeros),
                "backend": torch.cuda.get_allocator_backend()}

    def churn() -> dict[str, Any]:
        """Frees and allocations after a restore: the allocator's own (torch's cache, expandable pages, the
        stream-ordered pool) must still hand out memory that holds what is written."""
        made = [torch.full((n << 18,), float(n), device="cuda") for n in (1, 3, 8, 40, 130)]
        del made[1::2]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # expandable segments unmap and release pages; the async pool trims
        made += [torch.full((n << 18,), float(n), device="cuda") for n in (64, 2, 96)]
        ok = all(bool(torch.all(t == float(t.numel() >> 18)).item()) for t in made)
        return {"ok": ok, "matmul": digest(x @ w)}

    answer(directory, "ready", digests())
    served: set[str] = set()
    while True:
        for request in sorted(directory.glob("check-*")) + sorted(directory.glob("launch-*")) + sorted(
                directory.glob("churn-*")):
            if request.name in served:
                continue
            served.add(request.name)
            if request.name.startswith("check-"):
                answer(directory, "answer-" + request.name, digests())
            elif request.name.startswith("churn-"):
                answer(directory, "answer-" + request.name, churn())
            else:
                started = time.time()
                (x @ w).sum().item()  # a launch and a synchronisation: both wait while the memory is released
                answer(directory, "answer-" + request.name, {"started_unix": started, "finished_unix": time.time()})
        time.sleep(0.02)


if __name__ == "__main__":
    main()

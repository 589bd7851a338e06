"""A torch process, unchanged, for the interposer's GPU tests (run it under LD_PRELOAD=libcoldsnap_cuda.so).

    python -m tests.probe._torch_target DIR MIB

It holds MIB of random tensors, 160 MiB of zeros (the dump's zero chunks), a cuBLAS matmul's output and a
captured CUDA graph, writes `ready` with their digests, then answers requests left as files in DIR (so it keeps
no descriptor CRIU would carry):
`check-<n>` -> `answer-check-<n>` (the digests recomputed: tensors read back, the matmul redone, the graph
replayed onto a zeroed output) and `launch-<n>` -> `answer-launch-<n>` (a matmul launched and synchronised
by a thread; `finished_unix` says when it could run).
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
    torch.manual_seed(0)
    data = torch.randn(mib << 18, device="cuda")  # MIB of float32
    zeros = torch.zeros(160 << 18, device="cuda")  # a region of its own with 64 MiB chunks of zeros (never written)
    x, w = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    static_in = torch.randn(1024, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
        static_out = static_in @ w + 1
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = static_in @ w + 1

    def digest(t: Any) -> str:
        return hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()

    def digests() -> dict[str, str]:
        static_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return {"tensor": digest(data), "matmul": digest(x @ w), "graph": digest(static_out), "zeros": digest(zeros)}

    answer(directory, "ready", digests())
    served: set[str] = set()
    while True:
        for request in sorted(directory.glob("check-*")) + sorted(directory.glob("launch-*")):
            if request.name in served:
                continue
            served.add(request.name)
            if request.name.startswith("check-"):
                answer(directory, "answer-" + request.name, digests())
            else:
                started = time.time()
                (x @ w).sum().item()  # a launch and a synchronisation: both wait while the memory is released
                answer(directory, "answer-" + request.name, {"started_unix": started, "finished_unix": time.time()})
        time.sleep(0.02)


if __name__ == "__main__":
    main()

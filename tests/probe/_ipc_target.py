"""Two torch processes sharing device memory through CUDA IPC, unchanged (the CUDA IPC refusal's GPU test).

    python -m tests.probe._ipc_target DIR

The parent holds a 64 MiB CUDA tensor and sends it to its child over a torch.multiprocessing queue (spawn), which
exports it with cuIpcGetMemHandle; the child opens it (cuIpcOpenMemHandle) and keeps it. Each writes
`ready-<role>` (its pid and the tensor's sum, read on the device) and then, for every file `ask-<n>` in DIR, the
child answers `answer-<n>` with the sum read again through its mapping (so a test sees the tree still works).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ELEMENTS = 16 << 20  # float32: 64 MiB


def answer(directory: Path, name: str, value: dict[str, Any]) -> None:
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps({**value, "pid": os.getpid()}))
    tmp.rename(directory / name)


def child(queue: Any, directory: str) -> None:
    folder = Path(directory)
    shared = queue.get()  # opened here: cuIpcOpenMemHandle
    answer(folder, "ready-child", {"sum": float(shared.sum().item())})
    asked = 0
    while True:
        if (folder / f"ask-{asked + 1}").exists():
            asked += 1
            answer(folder, f"answer-{asked}", {"sum": float(shared.sum().item())})
        time.sleep(0.02)


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    folder = Path(sys.argv[1])
    tensor = torch.full((ELEMENTS,), 2.0, device="cuda")
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue, str(folder)), daemon=True)
    process.start()
    queue.put(tensor)  # exported here: cuIpcGetMemHandle
    answer(folder, "ready-parent", {"sum": float(tensor.sum().item()), "child": process.pid})
    process.join()  # the tensor lives as long as the child uses it


if __name__ == "__main__":
    main()

"""CUDA IPC in a tree is refused before the capture locks or releases anything (issue 36 item 3).

Legacy CUDA IPC maps one process's device memory into another (`cuIpcGetMemHandle` in the exporter,
`cuIpcOpenMemHandle` in the importer: torch's CUDA tensors sent over torch.multiprocessing, custom all-reduce
buffers). The CUDA checkpoint of driver 580 restores neither side (NVIDIA's cuda-checkpoint: it "does not support UVM
or IPC memory" and "does not attempt to keep the process in a good state if an error ... is encountered during
checkpoint or restore"), so such a tree is refused while it still runs untouched. The CUDA interposer counts both
sides in each process (`ipc_exported`, `ipc_imported`: live allocations and their bytes, each counted once, whole);
the capture asks every CUDA process of the tree that runs it. A process without the interposer, or whose
interposer does not listen, is not seen (docs/interposer.md#cuda-ipc says what is and is not detected).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CaptureRefused, ProbeError, WorkerError
from .hydration import interposer_request, interposer_socket
from .memory import MemoryOptions

__all__ = ("refuse_cuda_ipc",)

KINDS = ("ipc_exported", "ipc_imported")


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _holding(pid: int, socket: str) -> dict[str, object] | None:
    """The process's CUDA IPC allocations, as its interposer counts them; None when it holds none (or the socket
    is another process's: one path without %p)."""
    try:
        status = interposer_request(socket, {"op": "status"}, f"the interposer of process {pid}", timeout=30.0)
    except ProbeError as exc:
        raise WorkerError(f"CUDA IPC check: {exc}") from exc
    uncovered = status.get("uncovered") or {}
    counts = {kind.removeprefix("ipc_"): {"count": int((uncovered.get(kind) or {}).get("count", 0)),
                                          "bytes": int((uncovered.get(kind) or {}).get("bytes", 0))} for kind in KINDS}
    if status.get("pid") != pid or not any(c["count"] for c in counts.values()):
        return None
    # The CUDA checkpoint restores neither side: the reason says so, the counts say how much.
    return {"code": "cuda-ipc", "pid": pid, "command": _command(pid), **counts,
            "why": "the CUDA checkpoint does not restore CUDA IPC memory"}


def refuse_cuda_ipc(cuda: list[int], options: MemoryOptions) -> dict[str, list[int]]:
    """CaptureRefused naming every CUDA process of the tree that exported or imported device memory through CUDA
    IPC (pid, command, count and bytes of each side); otherwise which processes were `checked` and which could not
    be (`unchecked`: no interposer socket). `options.interposer`: the one CUDA process's socket the capture was
    given (`--interposer`)."""
    holders, explicit = [], options.interposer
    seen: dict[str, list[int]] = {"checked": [], "unchecked": []}
    for pid in cuda:
        socket = explicit if explicit and len(cuda) == 1 else interposer_socket(pid)
        if not socket or not os.path.exists(socket):
            seen["unchecked"].append(pid)
            continue
        seen["checked"].append(pid)
        if held := _holding(pid, socket):
            holders.append(held)
    if holders:
        raise CaptureRefused(holders)
    return seen

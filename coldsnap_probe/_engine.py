"""The worker's conversations with the engine (its control socket: quiesce, resume, release, hydrate) and the
graph policy record it writes into the images (`_graph.validated_graph_record` checks it before a restore)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from ._coordinator import Coordinator
from ._graph import GraphPlan, default_graph_policy, graph_record, plan_graph_policy
from ._host import gpu_identity
from ._process import inet_sockets
from .errors import ContractError, ProbeError, RankAborted, WorkerError
from .jsonline import request

__all__ = ("ABORT_POLL", "check_quiesced", "engine_request", "graph_plan", "resume_engine", "tp_execution",
           "write_graph_record")

ABORT_POLL = 0.05  # seconds between looks at the activation's abort while the engine works


def engine_request(control: str, message: dict[str, Any], what: str, *, timeout: float = 300.0,
            ranks: Coordinator | None = None) -> dict[str, Any]:
    """One request to the engine's control socket; a refusal is a WorkerError naming `what`.

    With `ranks` (a restore of several ranks), a peer's abort ends the wait: the engine may be blocked on that
    peer (a communicator's rendezvous), and this rank's restored tree is killed anyway."""
    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            outcome["answer"] = request(control, message, timeout=timeout)
        except ProbeError as exc:
            outcome["error"] = exc

    if ranks is None or not ranks.multi:
        ask()
    else:
        asking = threading.Thread(target=ask, name="coldsnap-engine-request", daemon=True)
        asking.start()
        while asking.is_alive():
            asking.join(ABORT_POLL)
            if asking.is_alive() and (reason := ranks.aborted()):
                raise RankAborted(f"{what}: the activation was aborted while the engine worked: {reason}")
    if "error" in outcome:
        raise WorkerError(f"{what}: {outcome['error']}") from outcome["error"]
    answer: dict[str, Any] = outcome["answer"]
    if not answer.get("ok"):
        raise WorkerError(f"{what}: {answer.get('error')}")
    return answer


def tp_execution(world_size: int, engine: str) -> dict[str, Any]:
    """The execution graph of one tensor-parallel service (spec 5.5's `execution`), one worker per rank."""
    workers = [f"rank-{r}" for r in range(world_size)]
    return {"workers": [{"id": w, "unit": f"unit-{r}", "service": "engine", "process_slot": 0, "device_slots": [r]}
                        for r, w in enumerate(workers)],
            "groups": [{"id": "tp", "kind": "tensor-parallel", "service": "engine", "members": workers}],
            "services": [{"id": "engine", "role": "serving", "workers": workers}],
            "adapter": {"schema": "coldsnap-engine-control-v1", "digest": "", "payload": {"engine": engine,
                                                                                          "tensor": world_size}}}


def graph_plan(requested: str, world_size: int) -> GraphPlan:
    if requested == "auto":
        requested = default_graph_policy(str(gpu_identity().get("driver_version", "")))
    # Retaining NCCL graph executables needs an admitted in-place provider driven inside the engine, and a
    # restore path for it; this worker has neither, so such a request is recorded as the valid downgrade.
    mode = os.environ.get("COLDSNAP_NCCL_IN_PLACE_MODE", "").strip()
    reason = ("COLDSNAP_NCCL_IN_PLACE_MODE is not net-reconnect-v1" if mode != "net-reconnect-v1"
              else "this worker has no in-place NCCL restore path")
    try:
        return plan_graph_policy(requested, world_size, in_place_admitted=False, in_place_reason=reason)
    except ContractError as exc:
        raise WorkerError(str(exc)) from exc


def check_quiesced(answer: dict[str, Any], plan: GraphPlan, tree: list[int]) -> None:
    """After the engine's quiesce: refuse a rank that still holds a communicator or a network socket."""
    live = answer.get("communicators")
    if plan.effective != "preserve-nccl-exec" and live != 0:
        raise WorkerError(f"the engine still holds {live!r} live NCCL communicator(s) after quiesce: restoring such "
                          "a rank fails (CUDA_ERROR_NOT_SUPPORTED) and loses it, so it is not checkpointed")
    if sockets := inet_sockets(tree):  # e.g. NCCL's RAS service outlives every communicator (NCCL_RAS_ENABLE=0)
        raise WorkerError("after quiesce the rank still holds network sockets a checkpoint cannot carry: "
                          + "; ".join(sockets[:8]))


def resume_engine(control: str, coordinator: Coordinator, plan: str, label: str, scratch: Path) -> dict[str, Any]:
    """Recreate the communicators on a store of this activation and re-capture the graphs (every rank at once)."""
    store = str((coordinator.directory or scratch) / f"{label}.store")  # every rank's, or this worker's own
    return engine_request(control, {"op": "resume", "policy": plan, "store": store, "rank": coordinator.rank,
                             "world_size": coordinator.world_size}, f"engine {label}",
                   ranks=coordinator if label == "restore" else None)


def write_graph_record(images: Path, plan: GraphPlan, world_size: int) -> None:
    execution = tp_execution(world_size, "coldsnap-engine")
    record = graph_record(async_graphs=plan.recorded != "disabled", graph_policy=plan.recorded,
                          engine="coldsnap-engine", execution=execution)
    (images / "graph.json").write_text(json.dumps({"record": record, "execution": execution}, indent=2) + "\n")

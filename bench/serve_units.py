"""The pieces of bench/e2e_serve.py that its paths and fault cases share: the paths (modes) and the unit
environment each adds, the server's cold unit and a restore unit with the client racing it, and the rows read
from the worker's reports.

The paths, each enabling something only through the unit's environment (the server's command line is the same):

* `full-interposer`: `LD_PRELOAD` of the CUDA interposer and its socket (`/run/coldsnap/cuda-%p.sock`); the
  device memory is dumped beside the images and refilled by the interposer at line rate;
* `full-interposer-hydrator`: the same, and `COLDSNAP_CUDA_INTERPOSER_HYDRATOR` naming the staging node
  hydrator (`python -m coldsnap_probe.hydration serve --staging`, a unit of its own, started once per path and
  removed at its end), which fills the device dump on the GPU while CRIU restores the server; the interposer
  then only maps the staged allocations (it fills them itself when a stage fails);
* `full`: nothing; the CUDA checkpoint copies the device memory into the process, CRIU into the images;
* `adapter`: the adapter on `PYTHONPATH` and `COLDSNAP_HYDRATION_SOCKET`; the weights are refilled from the
  model's files, the rest travels in the images;
* `adapter-hydrator`: the same and `COLDSNAP_HYDRATOR_SOCKET`; the weights come from the node's hydrator.

The first three need no cooperation at all. The interposer's sockets (bench/interposer_units.py) live in a
run directory of their own, mounted at `/run/coldsnap` in the serving unit, every restore unit and the staging
hydrator, so that CRIU finds the directory where it rebinds each restored process's control socket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio

from bench._common import mode_list
from bench.e2e_restore import (
    ENGINE,
    PID_FLOOR,
    RUN,
    WEIGHTS,
    WORKER_PATH,
    Driver,
    E2EError,
    Layout,
    await_unit,
    engine_stages,
    launch_unit,
    output,
    unit_labels,
)
from bench.interposer_units import (
    NO_IO_URING_LIBRARY,
    InterposerLayout,
    device_hydration,
    device_staging,
    interposer_environment,
)
from bench.serve_client import Completion, chat_request, stream_chat

HOST = "127.0.0.1"
PROMPT = "Tell me a story about GPUs and checkpoints."
MAX_TOKENS = 32
WARM_REQUESTS = 3  # the warm server answers the first request again this many times (`warm_requests`)
SERVER_SITE = "/opt/server/site"  # the server's own dependencies, baked into the capsule
ADAPTERS = f"{WORKER_PATH}/coldsnap_probe/adapters"
SERVER = "/opt/torch/.venv/bin/transformers"
MODES = ("full-interposer-hydrator", "full-interposer", "full", "adapter", "adapter-hydrator")
# The fault cases' images: the fastest path that ran whose restores need no node hydrator (it is gone by then).
FAULT_PREFERENCE = ("full-interposer", "adapter", "full")
STAGED = "full-interposer-hydrator"  # the path whose node hydrator stages the interposer's device dumps


def plan_modes(text: str) -> list[str]:
    """The paths of a run, in order, from a comma list (`full-interposer-hydrator,full-interposer,full`)."""
    return mode_list(text, MODES)


def fault_rank(result: dict[str, Any]) -> int | None:
    """How much the fault cases want a path's images (lower is better; None: not usable, because the path
    did not restore, or its node hydrator is gone by then: `adapter-hydrator`, `full-interposer-hydrator`)."""
    if not result.get("ok") or result.get("mode") not in FAULT_PREFERENCE:
        return None
    return FAULT_PREFERENCE.index(result["mode"])


def fault_mode(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The path whose images the fault cases restore: the best-ranked one that captured and restored."""
    ranked = [(rank, i) for i, r in enumerate(results) if (rank := fault_rank(r)) is not None]
    return results[min(ranked)[1]] if ranked else None


def keep_images(kept: dict[str, Any] | None,
                done: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """After a path's run: (the path whose images the fault cases will restore, the path whose images can go
    now). At most one set is kept, so tmpfs holds two sets at most (the kept one and the running path's)."""
    rank = fault_rank(done)
    if rank is None:
        return kept, done
    if kept is None or rank < (fault_rank(kept) or 0):
        return done, kept
    return kept, done


def cluster(mode: str) -> str:
    """The workload label of a path's units (their names are `<cluster>_node_0`)."""
    return "serve" + mode.replace("-", "")


def node_hydrator(mode: str) -> str | None:
    """The kind of node hydrator a path runs beside its server (None: none): `weights` (the shards
    page-locked, for the adapter) or `staging` (the interposer's device dumps staged on the GPU)."""
    return {"adapter-hydrator": "weights", STAGED: "staging"}.get(mode)


def serve_layout(work: Path, model: Path, mode: str, *, criu_threads: int = 0) -> InterposerLayout:
    """The unit environment of `mode` (the table in the module docstring); `criu_threads`, when set, is the
    restore's CRIU_RESTORE_THREADS (CRIU 4.2 with the parallel page restore; unset: the CPUs it may use)."""
    adapter = mode.startswith("adapter")
    environment = {"PYTHONPATH": ":".join([*([ADAPTERS] if adapter else []), WORKER_PATH, SERVER_SITE]),
                   "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    if adapter:
        environment["COLDSNAP_HYDRATION_SOCKET"] = f"{RUN}/hydration.sock"
    if mode == "adapter-hydrator":
        environment["COLDSNAP_HYDRATOR_SOCKET"] = f"{RUN}/hydrator.sock"
    interposer = mode.startswith("full-interposer")
    if interposer:
        environment.update(interposer_environment(staged=mode == STAGED))
    # uvicorn runs on uvloop, whose libuv then keeps to epoll (no io_uring ring for CRIU to refuse)
    environment["LD_PRELOAD"] = ":".join(filter(None, [environment.get("LD_PRELOAD"), NO_IO_URING_LIBRARY]))
    if criu_threads:
        environment["CRIU_RESTORE_THREADS"] = str(criu_threads)
    return InterposerLayout(run_dir=work / "run", images_dir=work / "images", weights=model, network="host",
                            extra_environment=environment, interposer_dir=work / "coldsnap" if interposer else None)


def server_command(port: int) -> list[str]:
    return [SERVER, "serve", WEIGHTS, "--device", "cuda:0", "--host", HOST, "--port", str(port)]


def body() -> dict[str, Any]:
    return chat_request(WEIGHTS, PROMPT, max_tokens=MAX_TOKENS)


def completion_row(done: Completion, created: float) -> dict[str, Any]:
    return {"first_token_s": done.first - created, "connected_s": done.connected - created,
            "request_to_first_token_s": done.first - done.requested, "completion_s": done.last - created,
            "text": done.text, "chunks": done.chunks, "finish_reason": done.finish_reason,
            "connect_attempts": done.connect_attempts}


async def watch_server(d: Driver, layout: Layout, name: str) -> None:
    """Fails as soon as the server process exits (the client would otherwise wait for the port)."""
    while True:
        stages = {s.get("stage"): s for s in engine_stages(layout)}
        if "engine_exited" in stages:
            raise E2EError(f"the server exited before its first token: {stages['engine_exited']} (its stdio is "
                           "/dev/null; run the command outside the capsule to see why)")
        state = await d.runtime("workload-inspect", name=name)
        if not ((state.get("runtime") or {}).get("workload") or {}).get("running"):
            raise E2EError(f"unit {name} is no longer running")
        await anyio.sleep(0.5)


async def together(*jobs: Callable[[anyio.CancelScope], Coroutine[Any, Any, None]]) -> None:
    """Run `jobs` side by side (each may cancel the others through the scope it is given); the first failure
    is raised as itself, not as an exception group."""
    try:
        async with anyio.create_task_group() as tg:
            for job in jobs:
                tg.start_soon(job, tg.cancel_scope)
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None


async def first_completion(d: Driver, layout: Layout, name: str, port: int, *, limit: float) -> Completion:
    """The client's request (retried until the port accepts) raced against the server's exit."""
    result: list[Completion] = []

    async def client(scope: anyio.CancelScope) -> None:
        result.append(await stream_chat(HOST, port, body(), connect_limit=limit))
        scope.cancel()

    async def watch(_scope: anyio.CancelScope) -> None:
        await watch_server(d, layout, name)

    await together(client, watch)
    return result[0]


def launcher(command: list[str]) -> list[str]:
    """The unit's init around a server command (PID floor, session leader, stdio on /dev/null, reaper)."""
    return [f"{ENGINE}/engine_llama.py", "launch", "--pid-floor", str(PID_FLOOR), "--log", f"{RUN}/engine.log",
            "--", *command]


def server_pid(layout: Layout) -> int:
    """The server's PID in its unit, as the init logged it."""
    forked = next((s for s in engine_stages(layout) if s.get("stage") == "engine_forked"), None)
    if forked is None:
        raise E2EError(f"the unit's init logged no engine_forked stage in {layout.run_dir / 'engine.log'}")
    return int(forked["engine_pid"])


async def start_cold(d: Driver, image: str, layout: Layout, name: str, port: int) -> dict[str, Any]:
    await d.expect(f"evicting {name}", "workload-remove", name=name)
    spec = layout.unit(name, image, entrypoint=layout.python, command=launcher(server_command(port)))
    created = time.time()
    await d.expect(f"starting the server {name}", "workload-run", workload=spec)
    started = time.time()
    done = await first_completion(d, layout, name, port, limit=600)
    return {"name": name, "create_start_s": started - created, "server_pid": server_pid(layout),
            **completion_row(done, created), "warm_request_to_first_token_s": await warm_requests(port)}


async def warm_requests(port: int) -> list[float]:
    """The same request again, WARM_REQUESTS times, to the warm server: the request-to-first-token a restored
    server's first request is compared with (issue 35: within 0.05 s of a warm server's, same request, same run)."""
    return [(done.first - done.requested) for done in
            [await stream_chat(HOST, port, body(), connect_limit=10) for _ in range(WARM_REQUESTS)]]


def after_ready(report: dict[str, Any], done: Completion) -> float | None:
    """Seconds from the worker's `ready` mark (every byte back on the device, the tree running) to the restored
    server's first token: what the restored server adds that a ready warm one would not."""
    ready = next((m for m in report.get("timeline") or [] if m.get("name") == "ready"), None)
    return done.first - ready["unix_ns"] / 1e9 if ready and ready.get("unix_ns") else None


async def restore_once(d: Driver, image: str, layout: Layout, unit: str, capture_id: str, cluster: str,
                       port: int) -> dict[str, Any]:
    """A restore unit and the client's request, sent as soon as the restored port accepts."""
    labels = unit_labels(capture_id, cluster)
    created, started = await launch_unit(d, image, layout, unit, capture_id, labels=labels)
    out: dict[str, Any] = {}

    async def client(_scope: anyio.CancelScope) -> None:
        out["client"] = await stream_chat(HOST, port, body(), connect_limit=120)

    async def unit_ready(scope: anyio.CancelScope) -> None:
        out["unit"] = await await_unit(d, unit, created, labels=labels, readiness_timeout=120)

    await together(client, unit_ready)
    report = out["unit"].get("worker_report") or {}
    second = await stream_chat(HOST, port, body(), connect_limit=10)
    return {**out["unit"], **device_hydration(report), **device_staging(report), "create_start_s": started - created,
            **completion_row(out["client"], created), "after_ready_first_token_s": after_ready(report, out["client"]),
            "second_request_to_first_token_s": second.first - second.requested}


def capture_row(report: dict[str, Any]) -> dict[str, Any]:
    """A capture report's phases, in order, with what each moved: the interposer's device release, the weights'
    release (adapter), the CUDA lock and checkpoint, CRIU's dump; and what stayed on the checkpoint path."""
    timings = report.get("timings_s") or {}
    weights = report.get("hydration") or {}
    devices = report.get("device_memory") or []
    uncovered: dict[str, int] = {}
    for process in devices:
        for kind, seen in (process.get("uncovered") or {}).items():
            uncovered[kind] = uncovered.get(kind, 0) + int((seen or {}).get("bytes") or 0)
    released = sum(int(p.get("bytes") or 0) for p in devices)
    return {"device_release_s": timings.get("device_release"), "device_bytes": released if devices else None,
            "device_states": [str(p.get("state")) for p in devices],
            "device_gbps": max((float(p.get("gbps") or 0) for p in devices), default=None),
            "weights_release_s": weights.get("release_seconds"), "weights_bytes": weights.get("released_bytes"),
            "cuda_lock_s": timings.get("cuda_lock"), "cuda_checkpoint_s": timings.get("cuda_checkpoint"),
            "criu_dump_s": timings.get("criu_dump"), "image_bytes": report.get("image_bytes"),
            "uncovered_bytes": {k: v for k, v in sorted(uncovered.items()) if v}, "exec_s": report.get("exec_seconds"),
            # each dump offered to the node hydrator's RAM tier once the tree was dumped (its first restore a hit)
            "device_warm": [p["warm"] for p in devices if p.get("warm")] or None,
            **capture_detail(report)}


def capture_detail(report: dict[str, Any]) -> dict[str, Any]:
    """Where a capture's time went inside its phases (issue 35 item 3): the worker's own steps, the release's
    copy-thread seconds (summed over the processes: device waits, digest, writes, zero checks) and CRIU's account
    of its dump (frozen, pages collected, pages written, and how many); and the host memory the CUDA checkpoint
    added to the tree (the device state it copied out: what CRIU then dumps)."""
    timings = report.get("timings_s") or {}
    stats = report.get("criu_dump_stats") or {}
    threads: dict[str, float] = {}
    for process in report.get("device_memory") or []:
        for key, value in (process.get("timings_s") or {}).items():
            if key.endswith("_thread_s"):
                name = key.removeprefix("dump_").removesuffix("_thread_s")
                threads[name] = threads.get(name, 0.0) + float(value)
    before, after = report.get("memory_before_checkpoint"), report.get("memory_after_checkpoint")
    added = sum(int((after[pid] or {}).get("anonymous_bytes") or 0) - int((before.get(pid) or {}).get(
        "anonymous_bytes") or 0) for pid in after) if before is not None and after is not None else None
    fs = report.get("images_filesystem") or {}
    return {"images_on": " huge=".join(filter(None, (fs.get("type"), fs.get("huge")))) or None,
            "interpreter_start_s": timings.get("interpreter_start"), "memory_scan_s": timings.get("memory_scan"),
            "worker_start_s": timings.get("worker_start"), "find_cuda_s": timings.get("find_cuda"),
            "checkpoint_added_bytes": added,
            "finish_s": timings.get("finish"), "release_thread_s": threads or None,
            "criu_frozen_s": stats.get("frozen_s"), "criu_memdump_s": stats.get("memdump_s"),
            "criu_memwrite_s": stats.get("memwrite_s"), "criu_pages_written": stats.get("pages_written"),
            # What each release did to its engine's stack limit (the reservation the checkpoint copies): bytes
            # before -> bytes the checkpoint saw, per process that was released.
            "stack_limit": [f"{s.get('engine_bytes')} -> {s.get('set_bytes')}" + (" (error)" if s.get("error") else "")
                            for s in (p.get("stack_limit") for p in report.get("device_memory") or []) if s] or None,
            "criu_threads": stats.get("threads")}  # dump-threads.patch: None where stock CRIU's path dumped


async def descriptors(d: Driver, name: str, pid: int) -> str:
    """What the server holds open (a failed capture's first question), read inside its unit."""
    reply = await d.runtime("workload-exec", name=name, execution={"command": [
        "sh", "-c", f"ls -l /proc/{pid}/fd | sed 's/.* [0-9][0-9]:[0-9][0-9] //'; grep -v ' 0A ' "
                    f"/proc/{pid}/net/tcp | head -20"]})
    return output(reply.get("runtime") or {}) if reply.get("ok") else str(reply.get("error"))

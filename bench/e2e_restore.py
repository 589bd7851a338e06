"""The restore users run (issue 12 item 4): ColdSnap's restore sequence over the format-1 envelope, timed.

    python bench/e2e_modes.py --state-dir DIR --capsule TAG --weights DIR --work DIR --out DIR
                              [--modes interposer,hydrator,full] [--restores 3] [--plain-capsule TAG] ...

(the run, its modes, their tuning and the tables: bench/e2e_modes.py, the runner; this module is the sequence's
steps, below the units (bench/interposer_units.py, bench/serve_units.py) that build on it)

Against a running `coldsnap-provider serve` (state dir DIR; `[gpus] mode = "native"` and
`[runtime] privileged = "host-capabilities"` on a host whose bounding set lacks a capability), using only
the public client (`call_control` for the session and the probe, `call` for runtime-v1 envelopes):

1. `image-inspect` the capsule and pin it by its image ID (every later workload runs `sha256:<id>`);
2. the disposable probe container (control-socket `probe`, n610, GPU 0) and a disposable check that the
   capsule carries the restore worker (`coldsnap_probe` and CRIU);
3. the serving engine (`engines/engine_llama.py`, 8B-shaped, ~16 GB bf16) as a detached workload, timed
   from `workload-run` to its first streamed token (cold Docker-to-first-token);
4. capture with the worker inside that container (`workload-exec python3 -m coldsnap_probe capture`);
   in `hydrate` mode the worker first has the engine release its weights (`--hydration`), so the
   images hold everything but the weights, which the engine's WeightArena copies back from the shards
   through a ring of pinned buffers; `hydrator` is the same with the copy done by a long-lived
   hydrator workload keeping the shards page-locked; in `full` mode the whole device state goes into
   the images; `interposer` is `full`'s engine with the CUDA interposer preloaded by the unit's environment;
5. then, `--restores` times: evict the unit's name, launch the restore unit (`workload-run` detached,
   same image, mounts and options, the worker restoring as its command, then holding the container),
   the readiness check (`workload-exec` of `test -s <ready file>`, waiting inside the unit for up to 2 s
   per exec), read the worker's report,
   `workload-inspect` the unit (running, start time, the six ColdSnap labels), stream the first token.
   Restored Docker-to-first-token runs from the restore unit's `workload-run` to that token.

Every restore must give the cold start's tokens and first-step logits bit for bit. Bad input fails as the
adapter would see it: an `E2EError` with `runtime_failed` naming the cause, and the unit removed.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._daemon import Session, open_session
from coldsnap_provider import call_control

PROMPT = [128000, 3923, 374, 279, 6864, 315, 9822, 30]
MAX_TOKENS = 16
RUN = "/run/engine"  # the run directory inside every container (engine socket, log, compiler caches)
IMAGES = "/images"
WEIGHTS = "/weights"
ENGINE = "/opt/engine"
WORKER_PATH = "/opt/coldsnap/worker"
CRIU = "/opt/coldsnap/criu/bin/criu-env"
READY = "/tmp/coldsnap-restore-ready.json"
COORD = "/coord"
PID_FLOOR = 512  # the captured PIDs must be free in the restore unit (spec 7.3: advance the allocator)
HOST_MOUNTS = ("/usr", "/lib", "/lib64", "/sbin", "/opt/torch")


class E2EError(Exception):
    """A step of the sequence failed the way the adapter would see it (`code` is the envelope's error_code)."""

    def __init__(self, message: str, *, code: str = "runtime_failed") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Layout:
    """Host paths and the interpreter the containers use; the same for the serving and the restore units."""

    run_dir: Path
    images_dir: Path
    weights: Path
    engines_dir: Path = Path(__file__).resolve().parent.parent / "engines"
    python: str = "/opt/torch/.venv/bin/python3"
    host_mounts: tuple[str, ...] = HOST_MOUNTS
    gpus: tuple[str, ...] = ("0",)
    network: str = "none"
    coordinator: Path | None = None  # the ranks' shared coordinator directory, mounted at COORD
    extra_environment: dict[str, str] = field(default_factory=dict)
    criu: str = CRIU  # where the capsule carries CRIU (the worker's --criu)

    def mounts(self) -> list[dict[str, Any]]:
        return ([{"source": p, "target": p, "read_only": True} for p in self.host_mounts]
                + [{"source": str(self.weights), "target": WEIGHTS, "read_only": True},
                   {"source": str(self.engines_dir), "target": ENGINE, "read_only": True},
                   {"source": str(self.run_dir), "target": RUN},
                   {"source": str(self.images_dir), "target": IMAGES}]
                + ([{"source": str(self.coordinator), "target": COORD}] if self.coordinator else []))

    def environment(self) -> dict[str, str]:
        # Everything the engine writes and may keep mapped (Triton's launcher .so, inductor's cache, temp files)
        # lives on the shared run directory, present at the same path in the restore unit.
        return {"HOME": f"{RUN}/home", "TMPDIR": f"{RUN}/tmp", "TRITON_CACHE_DIR": f"{RUN}/cache/triton",
                "TORCHINDUCTOR_CACHE_DIR": f"{RUN}/cache/inductor", "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "PYTHONPATH": WORKER_PATH,
                # Triton finds libcuda with /sbin/ldconfig -p, which knows nothing of the driver's binds.
                "TRITON_LIBCUDA_PATH": "/usr/local/nvidia/lib64", **self.extra_environment}

    def worker_environment(self) -> str:
        """The restore worker's PYTHONPATH, for `python -S` (a shell assignment): the worker needs only the standard
        library, cuda-python and itself, so the interpreter skips `site` and the server's .pth files (the GPU
        image's numba-cuda redirector alone cost 41 ms of a 57 ms `site`), with the interpreter's own
        site-packages added to the unit's (where cuda-python is)."""
        venv = Path(self.python).parent.parent
        return f'PYTHONPATH="$PYTHONPATH:$(echo {venv}/lib/python3*/site-packages)"'

    def unit(self, name: str, image: str, *, entrypoint: str, command: list[str],
             labels: dict[str, str] | None = None) -> dict[str, Any]:
        """A rank-unit-shaped detached workload: the GPU, every capability the host has, no seccomp."""
        spec: dict[str, Any] = {
            "name": name, "image": image, "detached": True, "pull_policy": "never", "network": self.network,
            "privileged": True, "seccomp_unconfined": True, "shared_memory_bytes": 1 << 30,
            "mounts": self.mounts(), "environment": self.environment(), "entrypoint": entrypoint,
            "command": command}
        if self.gpus:
            spec["gpus"] = list(self.gpus)
        if labels:
            spec["labels"] = labels
        return spec

    def prepare(self) -> None:
        for sub in ("home", "tmp", "cache/triton", "cache/inductor"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self.images_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("engine.sock", "hydration.sock", "engine.log"):
            (self.run_dir / stale).unlink(missing_ok=True)


class Driver:
    """A controller's view of the daemon: one session, runtime-v1 envelopes through the public client."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.session: Session | None = None

    async def open(self) -> None:
        self.session = await open_session(self.state_dir, f"op-e2e-{os.getpid()}")

    async def runtime(self, action: str, **fields: Any) -> dict[str, Any]:
        if self.session is None:
            raise E2EError("no session: open() first")
        reply = await self.session.runtime(action, **fields)
        out: dict[str, Any] = msgspec.to_builtins(reply)
        return out

    async def expect(self, what: str, action: str, **fields: Any) -> dict[str, Any]:
        reply = await self.runtime(action, **fields)
        if not reply.get("ok"):
            raise E2EError(f"{what}: {reply.get('error')}", code=reply.get("error_code") or "runtime_failed")
        runtime: dict[str, Any] = reply.get("runtime") or {}
        return runtime

    async def gone(self, name: str) -> bool:
        """True when no workload answers to `name` (what "no container left" means to a controller)."""
        reply = await self.runtime("workload-inspect", name=name)
        return not reply.get("ok") and reply.get("error_code") == "not_found"


def output(runtime: dict[str, Any]) -> str:
    raw = runtime.get("output") or ""
    return base64.b64decode(raw).decode(errors="replace") if isinstance(raw, str) else str(raw)


def json_in(text: str) -> dict[str, Any]:
    start = text.find("{")
    value = json.loads(text[start:]) if start >= 0 else None
    if not isinstance(value, dict):
        raise ValueError(f"no JSON object in {text[-500:]!r}")
    return value


# ---------------------------------------------------------------------------------------------------------------
# Preparation: the pinned capsule, the disposable probe, the worker inside the capsule


async def inspect_capsule(d: Driver, reference: str) -> dict[str, Any]:
    runtime = await d.expect(f"capsule {reference} is not resident", "image-inspect", image=reference)
    image: dict[str, Any] = runtime.get("image") or {}
    if not str(image.get("id", "")).startswith("sha256:") or not image.get("size"):
        raise E2EError(f"capsule {reference}: the manager returned no image identity ({image})")
    return image


async def probe_capsule(d: Driver, reference: str, driver: str = "n610") -> dict[str, Any]:
    """The disposable probe container (the daemon runs it in the capsule, GPU 0, no network)."""
    result: dict[str, Any] = await call_control(d.state_dir, {"operation": "probe", "driver": driver, "device": "0",
                                                              "image": reference})
    if not result.get("admitted"):
        raise E2EError(f"capsule {reference} is not admitted for {driver}: {result.get('error') or result}")
    return result


async def check_worker(d: Driver, image: str, layout: Layout) -> None:
    """A disposable run of the capsule: the restore worker imports and CRIU is where the worker runs it."""
    program = (f"import os, coldsnap_probe._worker\n"
               f"assert os.access({CRIU!r}, os.X_OK), 'no CRIU at {CRIU}'\n")
    reply = await d.runtime("workload-run", workload={
        "name": "", "image": image, "remove_after_exit": True, "pull_policy": "never", "network": "none",
        "combined": True, "mounts": [m for m in layout.mounts() if m.get("read_only")],
        "environment": {"PYTHONPATH": WORKER_PATH}, "entrypoint": layout.python, "command": ["-c", program]})
    if not reply.get("ok"):
        raise E2EError(f"capsule {image} carries no usable restore worker: {reply.get('error')}",
                       code=reply.get("error_code") or "runtime_failed")


# ---------------------------------------------------------------------------------------------------------------
# The engine: cold start, streaming


@dataclass
class Stream:
    requested: float = 0.0
    first: float = 0.0
    last: float = 0.0
    tokens: list[int] = field(default_factory=list)
    done: dict[str, Any] = field(default_factory=dict)


async def stream_tokens(socket_path: Path, *, limit: float = 120.0, prompt: list[int] | None = None,
                        max_tokens: int = MAX_TOKENS) -> Stream:
    """One request on the engine's socket (engine_llama's prompt unless another engine's vocabulary needs its
    own); each token's arrival time (host clock)."""
    result = Stream(requested=time.time())
    with anyio.fail_after(limit):
        while True:
            try:
                connection = await anyio.connect_unix(str(socket_path))
                break
            except OSError:  # not yet listening
                await anyio.sleep(0.01)
        async with connection:
            await connection.send(json.dumps({"prompt": prompt or PROMPT, "max_tokens": max_tokens}).encode() + b"\n")
            buffer = bytearray()
            while not result.done:
                try:
                    buffer += await connection.receive()
                except anyio.EndOfStream:
                    break
                while b"\n" in buffer:
                    end = buffer.index(b"\n")
                    event = json.loads(bytes(buffer[:end]))
                    del buffer[:end + 1]
                    if "token" in event:
                        result.first = result.first or time.time()
                        result.last = time.time()
                        result.tokens.append(int(event["token"]))
                    elif event.get("done"):
                        result.done = event
    # engine_llama repeats its tokens in the `done` line; ttft_server's protocol ends with the digest alone
    if not result.done or result.done.get("tokens", result.tokens) != result.tokens or len(result.tokens) != max_tokens:
        raise E2EError(f"the engine's answer is incomplete: {len(result.tokens)} tokens, end {result.done}")
    return result


def engine_stages(layout: Layout) -> list[dict[str, Any]]:
    try:
        lines = (layout.run_dir / "engine.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    stages = []
    for line in lines:
        try:
            stages.append(json.loads(line))
        except ValueError:
            continue
    return stages


async def start_serving(d: Driver, image: str, layout: Layout, name: str, *, hydrate: bool, hydrator: bool = False,
                        limit: float = 480.0, engine_options: tuple[str, ...] = ()) -> dict[str, Any]:
    """The serving engine as a detached workload; timed from workload-run to the first streamed token.
    `engine_options` go on the engine's `serve` command line (the cooperative modes' tuning)."""
    await d.expect(f"evicting {name}", "workload-remove", name=name)
    serve = [layout.python, f"{ENGINE}/engine_llama.py", "serve", WEIGHTS, "--socket", f"{RUN}/engine.sock",
             "--log", f"{RUN}/engine.log", *(["--hydration", f"{RUN}/hydration.sock"] if hydrate else []),
             *(["--hydrator", f"{RUN}/hydrator.sock"] if hydrator else []), *engine_options]
    spec = layout.unit(name, image, entrypoint=layout.python, command=[
        f"{ENGINE}/engine_llama.py", "launch", "--pid-floor", str(PID_FLOOR), "--log", f"{RUN}/engine.log", "--",
        *serve])
    created = time.time()
    await d.expect(f"starting the serving engine {name}", "workload-run", workload=spec)
    started = time.time()
    with anyio.move_on_after(limit) as waited:
        while True:
            names = {s.get("stage"): s for s in engine_stages(layout)}
            if "ready" in names:
                break
            failed = names.get("failed") or names.get("engine_exited")
            if failed:
                logs = output(await d.expect(f"logs of {name}", "workload-logs", name=name, tail=50))
                raise E2EError(f"the serving engine failed before it was ready: {failed} {logs[-2000:]}")
            await anyio.sleep(0.05)
    if waited.cancelled_caught:
        raise E2EError(f"the serving engine was not ready within {limit:.0f} s")
    tokens = await stream_tokens(layout.run_dir / "engine.sock")
    stages = engine_stages(layout)
    forked = next(s for s in stages if s.get("stage") == "engine_forked")
    return {"name": name, "created_unix": created, "create_start_s": started - created,
            "first_token_s": tokens.first - created, "request_to_first_token_s": tokens.first - tokens.requested,
            "tokens": tokens.tokens, "first_logits_sha256": tokens.done.get("first_logits_sha256"),
            "engine_pid": forked["engine_pid"],
            "stages": [{"stage": s["stage"], "since_create_s": round(s["unix"] - created, 3),
                        **{k: v for k, v in s.items() if k not in ("stage", "unix", "pid", "traceback")}}
                       for s in stages]}


async def start_hydrator(d: Driver, image: str, layout: Layout, name: str) -> dict[str, Any]:
    """The node's long-lived hydrator (coldsnap_probe.hydration serve --staging): the shards page-locked once;
    while CRIU restores an engine it fills an allocation that the engine then adopts (else it copies them into
    the restored engine's exported weight allocation). Started before the cold engine; its start is not part of
    any Docker-to-first-token (it serves every restore on the node)."""
    await d.expect(f"evicting {name}", "workload-remove", name=name)
    shards = sorted(p.name for p in layout.weights.glob("*.safetensors"))
    spec = layout.unit(name, image, entrypoint=layout.python, command=[
        "-m", "coldsnap_probe.hydration", "serve", "--staging", "--ram-tier-bytes", "auto", "--socket",
        f"{RUN}/hydrator.sock",
        # DEVICE_TIER=SIZE: each stage of the weights kept on the GPU (`serve --device-tier-bytes`)
        *(["--device-tier-bytes", os.environ["DEVICE_TIER"]] if os.environ.get("DEVICE_TIER") else []),
        *(f"{WEIGHTS}/{s}" for s in shards)])
    created = time.time()
    await d.expect(f"starting the hydrator {name}", "workload-run", workload=spec)
    return {"name": name, "created_unix": created}


async def wait_hydrator(d: Driver, name: str, created: float, limit: float = 120.0) -> dict[str, Any]:
    with anyio.move_on_after(limit):
        while True:
            logs = output(await d.expect(f"logs of {name}", "workload-logs", name=name, tail=20))
            for line in logs.splitlines():
                if line.startswith("{") and '"ready"' in line:
                    ready: dict[str, Any] = json.loads(line)
                    ready["ready_after_s"] = time.time() - created
                    return ready
            state = await d.expect(f"inspecting {name}", "workload-inspect", name=name)
            if not (state.get("workload") or {}).get("running"):
                raise E2EError(f"the hydrator exited: {logs[-2000:]}")
            await anyio.sleep(0.2)
    raise E2EError(f"the hydrator was not ready within {limit:.0f} s")


# ---------------------------------------------------------------------------------------------------------------
# Capture and restore with the worker in the capsule


async def capture(d: Driver, name: str, pid: int, layout: Layout, capture_id: str, *, hydrate: bool,
                  boundary: str = "n610") -> dict[str, Any]:
    """The worker captures `pid` inside the unit `name` (`boundary` n580: a tree without CUDA); its report. The
    worker runs as a restore's does, `python -S` with cuda-python's directory on PYTHONPATH: the server's `site`
    (its .pth files, 57 ms on the H200) is no part of a capture either."""
    worker = shlex.join([layout.python, "-S", "-m", "coldsnap_probe", "capture", "--pid", str(pid), "--images",
                         f"{IMAGES}/{capture_id}", "--criu", layout.criu, "--boundary", boundary,
                         *(["--hydration", f"{RUN}/hydration.sock"] if hydrate else [])])
    command = ["sh", "-c", f"{layout.worker_environment()} {worker}"]
    started = time.time()
    runtime = await d.expect(f"capture of {name} by the in-capsule worker", "workload-exec", name=name,
                             execution={"command": command})
    report = json_in(output(runtime))
    report["exec_seconds"] = time.time() - started
    return report


def restore_command(layout: Layout, capture_id: str, *ranks: str) -> list[str]:
    """The restore unit's command: the worker restores, its report becomes the ready file, the unit holds.
    `ranks` are the worker's multi-rank options (--rank, --coordinator, ...), when there are several."""
    worker = " ".join([layout.worker_environment(), layout.python, "-S", "-m", "coldsnap_probe", "restore",
                       "--images", f"{IMAGES}/{capture_id}", "--criu", layout.criu, "--work-dir",
                       "/tmp/coldsnap-restore", *ranks])
    return ["-c", f"{worker} > {READY}.tmp || exit 1; mv {READY}.tmp {READY}; exec sleep 2147483647"]


def unit_labels(capture_id: str, cluster: str, rank: int = 0) -> dict[str, str]:
    return {"io.sparksq.coldsnap.capture": capture_id, "io.sparksq.coldsnap.driver": "n610",
            "io.sparksq.coldsnap.managed": "true", "io.sparksq.coldsnap.workload": cluster,
            "io.sparksq.coldsnap.rank": str(rank), "io.sparksq.coldsnap.unit": f"unit-{rank}"}


async def _fail_unit(d: Driver, name: str, why: str) -> E2EError:
    """Collect the unit's last words, remove it, and say why (the controller's view of a failed restore)."""
    logs = await d.runtime("workload-logs", name=name, tail=40)
    tail = output(logs.get("runtime") or {}).strip()[-3000:]
    await d.runtime("workload-remove", name=name)
    return E2EError(f"{why}; restore unit {name} removed" + (f"; its log ends:\n{tail}" if tail else ""))


async def launch_unit(d: Driver, image: str, layout: Layout, name: str, capture_id: str, *,
                      labels: dict[str, str], command: list[str] | None = None) -> tuple[float, float]:
    """Evict the unit's name and launch the restore unit; returns when the request was sent and when it was
    answered (host clock)."""
    await d.expect(f"evicting {name}", "workload-remove", name=name)
    spec = layout.unit(name, image, entrypoint="sh", command=command or restore_command(layout, capture_id),
                       labels=labels)
    created = time.time()
    reply = await d.runtime("workload-run", workload=spec)
    if not reply.get("ok"):
        await d.runtime("workload-remove", name=name)
        raise E2EError(f"launching restore unit {name}: {reply.get('error')}",
                       code=reply.get("error_code") or "runtime_failed")
    return created, time.time()


def _readiness(window_s: float) -> dict[str, Any]:
    """The readiness check, waiting inside the unit for up to `window_s` (10 ms steps): readiness is seen
    when it happens rather than at the next poll, and the unit's state is still checked between windows. Ready, it
    prints the worker's report: reading it in an exec of its own cost a second exec, ~40 ms after readiness."""
    steps = max(1, int(window_s / 0.01))
    return {"command": ["sh", "-c", f"n=0; until test -s {READY}; do n=$((n+1)); [ $n -gt {steps} ] && exit 1; "
                                    f"sleep 0.01; done; cat {READY}"]}


async def await_unit(d: Driver, name: str, created: float, *, labels: dict[str, str],
                     readiness_timeout: float = 120.0, window: float = 2.0) -> dict[str, Any]:
    """Wait for a launched unit's readiness check, read the worker's report, inspect the unit; timed."""
    polls = 0
    deadline = time.time() + readiness_timeout
    while True:
        polls += 1
        ready = await d.runtime("workload-exec", name=name,
                                execution=_readiness(min(window, max(0.0, deadline - time.time()))))
        if ready.get("ok"):
            break
        state = await d.runtime("workload-inspect", name=name)
        workload = (state.get("runtime") or {}).get("workload") or {}
        if not state.get("ok") or not workload.get("running"):
            raise await _fail_unit(d, name, f"restore unit exited (code {workload.get('exit_code')}) before its "
                                            f"readiness check `test -s {READY}` passed")
        if time.time() > deadline:
            raise await _fail_unit(d, name, f"readiness check `test -s {READY}` never passed within "
                                            f"{readiness_timeout:g} s")
    readied = time.time()
    report = json_in(output(ready.get("runtime") or {}))
    inspected = await d.expect(f"inspecting {name}", "workload-inspect", name=name, include_start_time=True)
    workload = inspected.get("workload") or {}
    inspected_at = time.time()
    if not workload.get("running") or workload.get("paused"):
        raise await _fail_unit(d, name, f"restore unit is not serving: {workload}")
    wrong = {k: v for k, v in labels.items() if (workload.get("labels") or {}).get(k) != v}
    if wrong:
        raise await _fail_unit(d, name, f"inspect returned other values for the ColdSnap labels {sorted(wrong)}")
    marks = {m["name"]: m["unix_ns"] / 1e9 for m in report.get("timeline", [])}
    hydration = report.get("hydration") or {}
    return {"name": name, "worker_started_s": (marks["restore_begin"] - created) if "restore_begin" in marks else None,
            "criu_s": report.get("criu_restore_seconds"), "cuda_s": report.get("cuda_restore_seconds"),
            "hydration_s": hydration.get("phase_seconds"), "hydration": hydration,
            "readiness_s": readied - created, "readiness_checks": polls, "inspect_s": inspected_at - readied,
            **start_phases(report, created, workload.get("started_at")),
            "started_at": workload.get("started_at"), "worker_report": report}


def unix(stamp: str) -> float:
    """Docker's RFC 3339 time with nanoseconds, as unix seconds."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{fraction or '0'}")


def start_phases(report: dict[str, Any], created: float, started_at: str | None) -> dict[str, float | None]:
    """What a restore unit's start is made of, each from the `workload-run` request (host clock): the container
    started (Docker's `StartedAt`), the worker's interpreter up (`worker_main`), its imports done, CRIU started, the
    CUDA driver initialised meanwhile (`cuda_driver_ready`) and CRIU's restore returned to the worker (the later of
    CRIU's exit and the driver's readiness: `criu_s` is CRIU's own run)."""
    marks = {m["name"]: m["unix_ns"] / 1e9 for m in [*report.get("worker_start", []), *report.get("timeline", [])]}
    if "criu_restore_end" in marks and "criu_restore_begin" not in marks and report.get("criu_restore_seconds"):
        marks["criu_restore_begin"] = marks["criu_restore_end"] - report["criu_restore_seconds"]  # a worker before
    since = {k: marks[m] - created if m in marks else None for k, m in (
        ("worker_main_s", "worker_main"), ("worker_imported_s", "imports_done"),
        ("criu_started_s", "criu_restore_begin"), ("cuda_driver_ready_s", "cuda_driver_ready"),
        ("criu_returned_s", "criu_restore_end"))}
    return {"container_started_s": unix(started_at) - created if started_at else None, **since}


START_CELLS = (("container started", "container_started_s"), ("worker main", "worker_main_s"),
               ("imported", "worker_imported_s"), ("CRIU started", "criu_started_s"),
               ("driver ready", "cuda_driver_ready_s"), ("CRIU returned", "criu_returned_s"))


def start_cell(restored: dict[str, Any]) -> str:
    """`start_phases`'s instants in one line of a run's log (seconds from the request; "-" for a missing mark)."""
    return ", ".join(f"{label} {restored[key]:.3f}" if restored.get(key) is not None else f"{label} -"
                     for label, key in START_CELLS)


async def restore_unit(d: Driver, image: str, layout: Layout, name: str, capture_id: str, *,
                       labels: dict[str, str], readiness_timeout: float = 120.0,
                       command: list[str] | None = None) -> dict[str, Any]:
    """Launch the restore unit, wait for readiness, inspect it, stream the first token; every phase timed."""
    created, started = await launch_unit(d, image, layout, name, capture_id, labels=labels, command=command)
    result = await await_unit(d, name, created, labels=labels, readiness_timeout=readiness_timeout)
    tokens = await stream_tokens(layout.run_dir / "engine.sock")
    return {**result, "create_start_s": started - created, "first_token_s": tokens.first - created,
            "request_to_first_token_s": tokens.first - tokens.requested, "tokens": tokens.tokens,
            "first_logits_sha256": tokens.done.get("first_logits_sha256")}


"""A server people run, unchanged (issue 23): `transformers serve` captured and restored through the daemon.

    python bench/e2e_serve.py --state-dir DIR --capsule TAG --model DIR --work DIR --out DIR
                              [--mode adapter|adapter-hydrator|full ...] [--restores 3] [--port 18471]
                              [--build CONTEXT=TAG]
                              [--faults]

Against a running `coldsnap-provider serve` (`[gpus] mode = "native"`), through the public client only
(bench/e2e_restore.py's `Driver`, runtime-v1 envelopes), for each mode:

1. the model folder is checked (weights, config, tokenizer with a chat template) before any unit exists;
2. the capsule is pinned by image ID; the server runs as a detached unit on the host network with GPU 0:
   `transformers serve /weights --device cuda:0 --host 127.0.0.1 --port P` (its own command line, uvicorn
   and all) under the capsule's init (`engine_llama.py launch`: PID floor, session leader, stdio on
   /dev/null); cold Docker-to-first-token runs from `workload-run` to the first content chunk of a
   streaming `/v1/chat/completions` request (greedy, fixed seed), retried while the port is closed;
3. capture with the worker in the capsule (`workload-exec python3 -m coldsnap_probe capture`), the server
   idle; mode `adapter` sets `COLDSNAP_HYDRATION_SOCKET` and puts `coldsnap_probe/adapters` on the unit's
   PYTHONPATH, so the model's weights are released before the checkpoint and hydrated after restore
   (coldsnap_probe/_adopt.py); `adapter-hydrator` is the same with the hydration done by the node's
   long-lived hydrator workload (shards page-locked once, `COLDSNAP_HYDRATOR_SOCKET`); mode `full` enables
   nothing: CUDA checkpoint plus CRIU of the whole server;
4. `--restores` times: a new restore unit (the worker restoring as its command), and the client's
   request sent as soon as the restored port accepts a connection; restored Docker-to-first-token runs
   from that unit's `workload-run` to the first content chunk. Every completion must equal the cold one.

With `--faults` (on the images of the first mode that needs no hydrator workload): capture while a request
streams (refused naming the open connection, the server keeps streaming), restore whose port is taken (fails
naming it, no unit left), a client that disconnects during restore (the next client gets the cold
completion), a model folder without its tokenizer (refused before any unit).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
    capture,
    engine_stages,
    inspect_capsule,
    launch_unit,
    output,
    start_hydrator,
    unit_labels,
    wait_hydrator,
)
from bench.serve_client import ClientError, Completion, chat_request, connect, http_post, stream_chat
from engines.serve_model import ModelFolderError, check_folder

HOST = "127.0.0.1"
PROMPT = "Tell me a story about GPUs and checkpoints."
MAX_TOKENS = 32
SERVER_SITE = "/opt/server/site"  # the server's own dependencies, baked into the capsule
ADAPTERS = f"{WORKER_PATH}/coldsnap_probe/adapters"
SERVER = "/opt/torch/.venv/bin/transformers"


def cluster(mode: str) -> str:
    """The workload label of a path's units (their names are `<cluster>_node_0`)."""
    return "serve" + mode.replace("-", "")


def serve_layout(work: Path, model: Path, *, adapter: bool, hydrator: bool = False) -> Layout:
    environment = {"PYTHONPATH": ":".join([*([ADAPTERS] if adapter else []), WORKER_PATH, SERVER_SITE]),
                   "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
    if adapter:
        environment["COLDSNAP_HYDRATION_SOCKET"] = f"{RUN}/hydration.sock"
    if hydrator:
        environment["COLDSNAP_HYDRATOR_SOCKET"] = f"{RUN}/hydrator.sock"
    return Layout(run_dir=work / "run", images_dir=work / "images", weights=model, network="host",
                  extra_environment=environment)


def server_command(port: int) -> list[str]:
    return [SERVER, "serve", WEIGHTS, "--device", "cuda:0", "--host", HOST, "--port", str(port)]


def body() -> dict[str, Any]:
    return chat_request(WEIGHTS, PROMPT, max_tokens=MAX_TOKENS)


def completion_row(done: Completion, created: float) -> dict[str, Any]:
    return {"first_token_s": done.first - created, "connected_s": done.connected - created,
            "request_to_first_token_s": done.first - done.requested, "completion_s": done.last - created,
            "text": done.text, "chunks": done.chunks, "finish_reason": done.finish_reason,
            "connect_attempts": done.connect_attempts}


async def _watch_server(d: Driver, layout: Layout, name: str) -> None:
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


async def together(*jobs: Callable[[anyio.CancelScope], Awaitable[None]]) -> None:
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
        await _watch_server(d, layout, name)

    await together(client, watch)
    return result[0]


async def start_cold(d: Driver, image: str, layout: Layout, name: str, port: int) -> dict[str, Any]:
    await d.expect(f"evicting {name}", "workload-remove", name=name)
    spec = layout.unit(name, image, entrypoint=layout.python, command=[
        f"{ENGINE}/engine_llama.py", "launch", "--pid-floor", str(PID_FLOOR), "--log", f"{RUN}/engine.log", "--",
        *server_command(port)])
    created = time.time()
    await d.expect(f"starting the server {name}", "workload-run", workload=spec)
    started = time.time()
    done = await first_completion(d, layout, name, port, limit=600)
    forked = next(s for s in engine_stages(layout) if s.get("stage") == "engine_forked")
    return {"name": name, "create_start_s": started - created, "server_pid": forked["engine_pid"],
            **completion_row(done, created)}


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
    return {**out["unit"], "create_start_s": started - created, **completion_row(out["client"], created)}


async def descriptors(d: Driver, name: str, pid: int) -> str:
    """What the server holds open (a failed capture's first question), read inside its unit."""
    reply = await d.runtime("workload-exec", name=name, execution={"command": [
        "sh", "-c", f"ls -l /proc/{pid}/fd | sed 's/.* [0-9][0-9]:[0-9][0-9] //'; grep -v ' 0A ' "
                    f"/proc/{pid}/net/tcp | head -20"]})
    return output(reply.get("runtime") or {}) if reply.get("ok") else str(reply.get("error"))


async def run_mode(d: Driver, args: argparse.Namespace, mode: str, image: str) -> dict[str, Any]:
    work = Path(args.work) / mode
    shutil.rmtree(work, ignore_errors=True)
    adapter = mode.startswith("adapter")
    layout = serve_layout(work, Path(args.model), adapter=adapter, hydrator=mode == "adapter-hydrator")
    layout.prepare()
    serving, unit, sidecar = f"serve-{mode}-cold", f"{cluster(mode)}_node_0", f"serve-{mode}-hydrator"
    result: dict[str, Any] = {"mode": mode, "ok": False, "restores": []}
    try:
        # The node's hydrator (the shards page-locked once, for every restore on the node) is not part of any
        # Docker-to-first-token; it starts beside the cold server.
        service = await start_hydrator(d, image, layout, sidecar) if mode == "adapter-hydrator" else None
        cold = result["cold"] = await start_cold(d, image, layout, serving, args.port)
        if service:
            result["hydrator"] = await wait_hydrator(d, sidecar, service["created_unix"])
        print(f"[{mode}] cold Docker-to-first-token {cold['first_token_s']:.2f} s: {cold['text'][:80]!r}",
              flush=True)
        capture_id = f"serve-{mode}-{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            result["capture"] = await capture(d, serving, int(cold["server_pid"]), layout, capture_id,
                                              hydrate=adapter)
        except E2EError as exc:
            result["server_descriptors"] = await descriptors(d, serving, int(cold["server_pid"]))
            print(f"[{mode}] the server's descriptors:\n{result['server_descriptors']}", flush=True)
            raise exc
        print(f"[{mode}] captured: {json.dumps(result['capture'].get('timings_s'))}", flush=True)
        await d.expect(f"removing {serving}", "workload-remove", name=serving)
        for attempt in range(args.restores):
            restored = await restore_once(d, image, layout, unit, capture_id, cluster(mode), args.port)
            restored["identical"] = restored["text"] == cold["text"]
            result["restores"].append(restored)
            print(f"[{mode}] restore {attempt + 1}: Docker-to-first-token {restored['first_token_s']:.2f} s "
                  f"(CRIU {restored['criu_s']}, CUDA {restored['cuda_s']}, hydration {restored['hydration_s']}), "
                  f"identical {restored['identical']}", flush=True)
        result["capture_id"] = capture_id
        result["images_bytes"] = sum(p.stat().st_size for p in (layout.images_dir / capture_id).rglob("*")
                                     if p.is_file())
        result["ok"] = bool(result["restores"]) and all(r["identical"] for r in result["restores"])
    except (E2EError, ClientError, OSError, ValueError, KeyError, TimeoutError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{mode}] FAILED: {result['error'][:3000]}", flush=True)
        result["server_log_tail"] = engine_stages(layout)[-6:]
    finally:
        for name in (serving, unit, sidecar):
            await d.runtime("workload-remove", name=name)
    result["layout"] = layout
    return result


# ---------------------------------------------------------------------------------------------------------------
# Faults (issue 23, "Bad input and faults")


async def fault_streaming_capture(d: Driver, image: str, layout: Layout, unit: str, capture_id: str,
                                  mode: str, port: int, pid: int) -> dict[str, Any]:
    """A capture requested while a request streams is refused naming the connection; the stream goes on."""
    row: dict[str, Any] = {"case": "capture while a request is streaming"}
    await restore_once(d, image, layout, unit, capture_id, cluster(mode), port)  # CRIU keeps the PID
    long = chat_request(WEIGHTS, PROMPT, max_tokens=400)
    streamed: dict[str, Any] = {}

    async def client(_scope: anyio.CancelScope) -> None:
        try:
            streamed["done"] = await stream_chat(HOST, port, long, connect_limit=30)
        except ClientError as exc:
            streamed["error"] = str(exc)

    async def busy_capture(_scope: anyio.CancelScope) -> None:
        await anyio.sleep(1.0)  # the stream has begun
        started = time.time()
        try:
            await capture(d, unit, pid, layout, f"{capture_id}-busy", hydrate=mode.startswith("adapter"))
            row.update(ok=False, error="the capture was accepted while a request streamed")
        except (E2EError, ValueError) as exc:
            message = str(exc)
            row.update(refused=True, error=message[-1500:], seconds=round(time.time() - started, 2),
                       names_connection="open connection" in message and f":{port}" in message)

    await together(client, busy_capture)
    done = streamed.get("done")
    row["stream_completed"] = bool(done and done.finish_reason)
    row["ok"] = bool(row.get("refused") and row.get("names_connection") and row["stream_completed"])
    await d.runtime("workload-remove", name=unit)
    return row


async def fault_port_taken(d: Driver, image: str, layout: Layout, unit: str, capture_id: str, mode: str,
                           port: int, pid: int) -> dict[str, Any]:
    """Something else listens on the server's port: the restore fails naming it, no unit is left."""
    row: dict[str, Any] = {"case": "restore whose port is taken"}
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Earlier requests leave the port in TIME_WAIT; two listeners still conflict with SO_REUSEADDR set.
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        squatter.bind((HOST, port))
        squatter.listen(1)
        started = time.time()
        try:
            created, _ = await launch_unit(d, image, layout, unit, capture_id, labels=unit_labels(capture_id,
                                                                                                 cluster(mode)))
            await await_unit(d, unit, created, labels=unit_labels(capture_id, cluster(mode)), readiness_timeout=60)
            row.update(ok=False, error="the restore succeeded on a taken port")
        except E2EError as exc:
            message = str(exc)
            row.update(error=message[-1500:], seconds=round(time.time() - started, 2),
                       names_cause="Address already in use" in message or "EADDRINUSE" in message or
                       "in use" in message)
    finally:
        squatter.close()
    row["no_unit_left"] = await d.gone(unit)
    row["ok"] = row.get("ok", True) and bool(row.get("names_cause")) and row["no_unit_left"]
    return row


async def fault_client_disconnect(d: Driver, image: str, layout: Layout, unit: str, capture_id: str, mode: str,
                                  port: int, cold_text: str) -> dict[str, Any]:
    """A client sends its request during the restore and goes away: the next client is served as cold."""
    row: dict[str, Any] = {"case": "client disconnect during restore"}
    labels = unit_labels(capture_id, cluster(mode))
    created, _ = await launch_unit(d, image, layout, unit, capture_id, labels=labels)
    stream, _ = await connect(HOST, port, limit=120)
    async with stream:
        await stream.send(http_post(HOST, port, "/v1/chat/completions", body()))
    row["left_after_s"] = round(time.time() - created, 3)
    try:
        await await_unit(d, unit, created, labels=labels, readiness_timeout=120)
        done = await stream_chat(HOST, port, body(), connect_limit=30)
        row.update(identical=done.text == cold_text, ok=done.text == cold_text)
    except (E2EError, ClientError) as exc:
        row.update(ok=False, error=str(exc)[-1500:])
    await d.runtime("workload-remove", name=unit)
    return row


async def fault_missing_tokenizer(d: Driver, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"case": "model folder missing its tokenizer"}
    bare = Path(args.work) / "no-tokenizer"
    shutil.rmtree(bare, ignore_errors=True)
    bare.mkdir(parents=True)
    for item in Path(args.model).iterdir():
        if not item.name.startswith(("tokenizer", "special_tokens")):
            (bare / item.name).symlink_to(item)
    try:
        check_folder(bare)
        row.update(ok=False, error="accepted")
    except ModelFolderError as exc:
        row.update(error=str(exc), ok="tokenizer" in str(exc), no_unit_left=await d.gone("servebad_node_0"))
    return row


async def faults(d: Driver, args: argparse.Namespace, image: str, first: dict[str, Any]) -> list[dict[str, Any]]:
    """On `first`'s images (a path that needs no hydrator workload, which its run has removed)."""
    layout, mode = first["layout"], first["mode"]
    unit = f"{cluster(mode)}_node_0"
    rows = [await fault_missing_tokenizer(d, args)]
    if not first.get("ok"):
        return rows
    for fault in (fault_port_taken, fault_streaming_capture):
        try:
            rows.append(await fault(d, image, layout, unit, first["capture_id"], mode, args.port,
                                    int(first["cold"]["server_pid"])))
        except (E2EError, ClientError, OSError, ValueError, KeyError) as exc:
            rows.append({"case": fault.__name__, "ok": False, "error": f"{type(exc).__name__}: {exc}"[-1500:]})
            await d.runtime("workload-remove", name=unit)
    try:
        rows.append(await fault_client_disconnect(d, image, layout, unit, first["capture_id"], mode, args.port,
                                                  first["cold"]["text"]))
    except (E2EError, ClientError, OSError) as exc:
        rows.append({"case": "client disconnect during restore", "ok": False, "error": str(exc)[-1500:]})
        await d.runtime("workload-remove", name=unit)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The table


def _f(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(results: list[dict[str, Any]], capsule: dict[str, Any], model_bytes: int) -> str:
    lines = ["| mode | run | Docker-to-first-token s | speed-up | create/start s | worker start s | CRIU s "
             "| CUDA s | hydration s | port accepted s | request->first token s | completion s | = cold |",
             "|" + " --- |" * 13]
    for r in results:
        cold = r.get("cold")
        if cold:
            lines.append(f"| {r['mode']} | cold | {_f(cold['first_token_s'])} | 1x | {_f(cold['create_start_s'])} "
                         f"| - | - | - | - | {_f(cold['connected_s'])} | {_f(cold['request_to_first_token_s'])} "
                         f"| {_f(cold['completion_s'])} | - |")
        for i, x in enumerate(r.get("restores", []), 1):
            lines.append(
                f"| {r['mode']} | restore {i} | {_f(x['first_token_s'])} "
                f"| {cold['first_token_s'] / x['first_token_s']:.1f}x | {_f(x['create_start_s'])} "
                f"| {_f(x['worker_started_s'])} | {_f(x['criu_s'])} | {_f(x['cuda_s'])} | {_f(x['hydration_s'])} "
                f"| {_f(x['connected_s'])} | {_f(x['request_to_first_token_s'])} | {_f(x['completion_s'])} "
                f"| {x['identical']} |")
        if r.get("error"):
            lines.append(f"| {r['mode']} | failed: {r['error'][:300]} |" + " |" * 11)
    lines += ["", f"Capsule {capsule.get('id', '')[:19]}: {capsule.get('size', 0) / 1e6:.0f} MB; model "
              f"{model_bytes / 1e9:.2f} GB; " + "; ".join(f"{r['mode']} CRIU images {r['images_bytes'] / 1e9:.2f} GB"
                                                          for r in results if r.get("images_bytes"))]
    for r in results:
        if r.get("capture"):
            lines.append(f"{r['mode']} capture: {json.dumps(r['capture'].get('timings_s'))}, hydration "
                         f"{json.dumps(r['capture'].get('hydration'))}")
        if r.get("cold"):
            lines.append(f"{r['mode']} cold completion ({r['cold']['chunks']} chunks, "
                         f"{r['cold']['finish_reason']}): {r['cold']['text'][:120]!r}")
    return "\n".join(lines)


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--capsule", required=True)
    parser.add_argument("--model", required=True, help="the model folder (weights, config, tokenizer)")
    parser.add_argument("--work", required=True, help="host directory for run directories and CRIU images")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", action="append", choices=["adapter", "adapter-hydrator", "full"])
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--port", type=int, default=18471)
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--build", action="append", default=[], metavar="CONTEXT=TAG")
    args = parser.parse_args()
    try:
        shards = check_folder(args.model)
    except ModelFolderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    d = Driver(Path(args.state_dir))
    await d.open()
    out: dict[str, Any] = {"prepare": {"builds": [], "shards": shards}}
    for item in args.build:
        context, _, tag = item.partition("=")
        started = time.time()
        await d.expect(f"image-build of {tag}", "image-build", build={
            "dockerfile": base64.b64encode(Path(context, "Dockerfile").read_bytes()).decode(), "context": context,
            "tag": tag, "pull": False})
        out["prepare"]["builds"].append({"tag": tag, "seconds": time.time() - started})
    capsule = await inspect_capsule(d, args.capsule)
    out["prepare"]["capsule"] = capsule
    results = []
    for mode in args.mode or ["adapter", "full"]:
        results.append(await run_mode(d, args, mode, str(capsule["id"])))
        Path(args.out, "serve.json").write_text(json.dumps({**out, "results": results}, indent=1, default=str))
    standalone = [r for r in results if r["mode"] != "adapter-hydrator"]
    if args.faults and standalone:
        out["faults"] = await faults(d, args, str(capsule["id"]), standalone[0])
        for row in out["faults"]:
            print(json.dumps(row)[:1200], flush=True)
    for r in results:
        shutil.rmtree(r.pop("layout").images_dir, ignore_errors=True)
    model_bytes = sum(p.stat().st_size for p in Path(args.model).iterdir() if p.is_file())
    text = table(results, capsule, model_bytes)
    print(text, flush=True)
    out["results"] = results
    Path(args.out, "serve.json").write_text(json.dumps(out, indent=1, default=str))
    Path(args.out, "serve-table.md").write_text(text + "\n")
    ok = all(r["ok"] for r in results) and all(r["ok"] for r in out.get("faults", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

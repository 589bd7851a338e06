"""bench/e2e_serve.py's fault cases (issue 23, "Bad input and faults"), each a row `{case, ok, ...}`:

* capture while a request streams: refused naming the open connection, the stream completes;
* restore whose port is taken: fails naming the cause, no unit left;
* a client that disconnects during restore: the next client gets the cold completion;
* a model folder missing its tokenizer: refused before any unit;
* a server that forks workers (engines/forking_server.py --cuda, each worker with its own CUDA context and a
  tensor on the GPU, all accepting on one listening socket), under the environment of the path the faults
  use: the whole tree is captured and restored, and every worker answers again with the same PID and the same
  device-computed sum; under the interposer, every worker's device memory went through it.

The first three restore the images of the fastest path that restored (`serve_units.fault_mode`).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import anyio

from bench.e2e_restore import (
    ENGINE,
    WEIGHTS,
    Driver,
    E2EError,
    Layout,
    await_unit,
    capture,
    launch_unit,
    unit_labels,
)
from bench.interposer_units import InterposerLayout, device_hydration
from bench.serve_client import ClientError, chat_request, connect, http_post, stream_chat
from bench.serve_units import (
    FAULT_PREFERENCE,
    HOST,
    PROMPT,
    body,
    capture_row,
    cluster,
    fault_mode,
    launcher,
    restore_once,
    server_pid,
    together,
    watch_server,
)
from engines.forking_server import ForkingServerError, ask_worker
from engines.serve_model import ModelFolderError, check_folder

FORKED_WORKERS = 2
FORKED_CLUSTER = "serveforked"


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


async def forked_answers(d: Driver, layout: Layout, name: str, port: int, limit: float, *,
                         cold: bool) -> dict[int, dict[str, Any]]:
    """Every worker's answer (one request at a time, each in a thread); for the `cold` server raced against its
    exit (after a capture the init has logged the captured server's exit, so a restored one is not watched)."""
    answers: dict[int, dict[str, Any]] = {}

    async def client(scope: anyio.CancelScope) -> None:
        deadline, last = time.monotonic() + limit, "no request was answered"
        while len(answers) < FORKED_WORKERS:
            if time.monotonic() > deadline:
                raise ForkingServerError(f"workers {sorted(set(range(FORKED_WORKERS)) - set(answers))} never "
                                         f"answered on {HOST}:{port} within {limit:g} s (last: {last})")
            try:
                answer = await anyio.to_thread.run_sync(ask_worker, HOST, port, 5.0)
            except OSError as exc:  # nothing listens yet (a worker starting, a restore in progress)
                last = f"{type(exc).__name__}: {exc}"
                await anyio.sleep(0.05)
                continue
            if answer["worker"] in answers:
                await anyio.sleep(0.05)  # another worker is still starting
            answers.setdefault(answer["worker"], answer)
        scope.cancel()

    async def watch(_scope: anyio.CancelScope) -> None:
        await watch_server(d, layout, name)

    await (together(client, watch) if cold else together(client))
    return answers


def forked_verdict(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]],
                   phases: dict[str, Any], *, interposer: bool) -> dict[str, Any]:
    """Whether every worker came back as itself: same PID and parent, the same device-computed sum, its request
    count gone on; under the interposer, every worker's device memory released through it at capture."""
    same = {k: (a["pid"], a["parent"], a.get("device_sum")) for k, a in after.items()} == {
        k: (a["pid"], a["parent"], a.get("device_sum")) for k, a in before.items()}
    went_on = all(after[k]["served"] > before[k]["served"] for k in after if k in before)
    released = phases.get("device_states", []).count("released")
    verdict = {"same_workers": same, "state_went_on": went_on, "interposer_released": released,
               "ok": same and went_on and (released == len(before) if interposer else True)}
    return verdict


async def fault_forked_workers(d: Driver, image: str, layout: InterposerLayout, mode: str, port: int, *,
                               cuda: bool = True) -> dict[str, Any]:
    """A server that forks workers sharing its listening socket: captured whole, restored, every worker answers.
    (`cuda=False`: workers without device memory, for a capsule without a GPU; its n610 capture then fails.)"""
    row: dict[str, Any] = {"case": "a server that forks workers", "workers": FORKED_WORKERS, "path": mode}
    work = layout.run_dir.parent / "forked"
    shutil.rmtree(work, ignore_errors=True)
    interposer = layout.interposer_dir is not None
    forked = dataclasses.replace(layout, run_dir=work / "run", images_dir=work / "images",
                                 interposer_dir=work / "coldsnap" if interposer else None)
    forked.prepare()
    cold, unit, capture_id = "serve-forked-cold", f"{FORKED_CLUSTER}_node_0", f"serve-forked-{int(time.time())}"
    labels = unit_labels(capture_id, FORKED_CLUSTER)
    try:
        await d.expect(f"evicting {cold}", "workload-remove", name=cold)
        await d.expect(f"starting {cold}", "workload-run", workload=forked.unit(
            cold, image, entrypoint=forked.python, command=launcher([
                forked.python, f"{ENGINE}/forking_server.py", "serve", "--host", HOST, "--port", str(port),
                "--workers", str(FORKED_WORKERS), *(["--cuda"] if cuda else [])])))
        before = await forked_answers(d, forked, cold, port, 300, cold=True)
        row["answered_cold"] = sorted(before)
        report = await capture(d, cold, server_pid(forked), forked, capture_id, hydrate=False)
        row["capture"] = phases = capture_row(report)
        await d.expect(f"removing {cold}", "workload-remove", name=cold)
        created, _ = await launch_unit(d, image, forked, unit, capture_id, labels=labels)
        restored = await await_unit(d, unit, created, labels=labels, readiness_timeout=180)
        after = await forked_answers(d, forked, unit, port, 120, cold=False)
        row.update(restore={k: restored.get(k) for k in ("criu_s", "cuda_s", "readiness_s")},
                   answered_s=round(time.time() - created, 3),
                   **device_hydration(restored.get("worker_report") or {}),
                   **forked_verdict(before, after, phases, interposer=interposer))
        row["answers"] = {"before": before, "after": after}
    except (E2EError, ForkingServerError, OSError, KeyError, ValueError) as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[-1500:])
    finally:
        for name in (cold, unit):
            await d.runtime("workload-remove", name=name)
        shutil.rmtree(forked.images_dir, ignore_errors=True)
    row["no_unit_left"] = await d.gone(cold) and await d.gone(unit)
    row["ok"] = bool(row.get("ok")) and row["no_unit_left"]
    return row


async def faults(d: Driver, args: argparse.Namespace, image: str,
                 results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every fault case; the restore cases on the images of `fault_mode(results)` (none when no path restored)."""
    rows = [await fault_missing_tokenizer(d, args)]
    first = fault_mode(results)
    if first is None:
        rows.append({"case": "restore cases", "ok": False, "error": "no path captured and restored that the fault "
                     f"cases can restore ({', '.join(FAULT_PREFERENCE)}; a path with a node hydrator has removed it "
                     "by then): nothing to restore the fault cases from"})
    else:
        rows += await _restore_faults(d, args, image, first)
    layout, mode = (first or results[0])["layout"], (first or results[0])["mode"]
    rows.append(await fault_forked_workers(d, image, layout, mode, args.port + 1))
    return rows


async def _restore_faults(d: Driver, args: argparse.Namespace, image: str,
                          first: dict[str, Any]) -> list[dict[str, Any]]:
    layout, mode = first["layout"], first["mode"]
    unit = f"{cluster(mode)}_node_0"
    rows: list[dict[str, Any]] = []
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

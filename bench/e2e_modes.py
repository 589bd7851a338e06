"""The restore through the daemon, run (issue 22 item 3): the modes side by side in one run, each with the
bench's tuning where it applies, and the two tables; the sequence's steps are bench/e2e_restore.py's.

    python bench/e2e_modes.py --state-dir DIR --capsule TAG --weights DIR --work DIR --out DIR
                              [--modes interposer,interposer-hydrator,hydrator,full] [--restores 3]
                              [--images-root /dev/shm/cs-e2e-img] [--criu-threads N] [--stack-bytes 256]
                              [--plain-capsule TAG] [--budget S]

The modes (the engine is bench/e2e_restore.py's `engines/engine_llama.py`, the same model and tokens in each):

* `hydrate`, `hydrator` (cooperation): the weights in the engine's WeightArena, released before capture and
  hydrated after restore by the engine's ring or the node's hydrator; the engine also sets the CUDA stack limit
  (`--stack-bytes`);
* `interposer` (no cooperation): the engine holds plain torch tensors and its command line is `full`'s; only the
  unit's environment adds the CUDA interposer (`LD_PRELOAD` and `COLDSNAP_CUDA_INTERPOSER_SOCKET`), whose
  sockets live in a host directory mounted at `/run/coldsnap` in the serving and every restore unit (CRIU
  rebinds each restored process's socket there); every device allocation is dumped beside the images and
  released before the CUDA checkpoint, and refilled at line rate after restore;
* `interposer-hydrator` (no cooperation): the same, and `COLDSNAP_CUDA_INTERPOSER_HYDRATOR` names a node
  hydrator (`python -m coldsnap_probe.hydration serve --staging`, no weight files, its socket in the same
  /run/coldsnap directory, itself not under the interposer) that stages the device dump on the GPU while CRIU
  restores the process; its start is not part of any figure (a node service, like `hydrator`'s);
* `full` (no cooperation): nothing added; the CUDA checkpoint copies device memory into the CRIU images.

Every mode: `CRIU_RESTORE_THREADS` in the units (default: the CPUs this host gives the unit, CRIU 4.2's parallel
page restore), the images where `--images-root` says (tmpfs: `/dev/shm/...`), transparent huge pages as the
node has them (scripts/device e2e sets `always` for the run and puts the old mode back). The CUDA stack limit
and a discarded KV cache need a call inside the engine: the no-cooperation rows never get them, and
engine_llama's KV cache (transformers' static cache, torch tensors) is kept in every mode. Every restore must
give the cold start's tokens and first-step logits, and the images' digest must be the same after the restores
as before them.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import mode_list
from bench.e2e_restore import (
    Driver,
    E2EError,
    Layout,
    capture,
    check_worker,
    engine_stages,
    inspect_capsule,
    probe_capsule,
    restore_unit,
    start_hydrator,
    start_serving,
    unit_labels,
    wait_hydrator,
)
from bench.interposer_units import (
    InterposerLayout,
    check_interposer,
    device_cell,
    device_hydration,
    device_staging,
    interposer_environment,
    start_staging_hydrator,
)
from bench.serve_units import capture_row

MODES = ("hydrate", "hydrator", "interposer", "interposer-hydrator", "full")
COOPERATIVE = ("hydrate", "hydrator")
GOAL_S = {"hydrate": 1.2, "hydrator": 1.2, "interposer": 2.0, "interposer-hydrator": 2.0, "full": 2.0}  # at 16 GiB
THP_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
DIGEST_CHUNK = 256 << 20  # the images' digest hashes chunks of this size in parallel (one file can be 19 GB)


def plan_modes(text: str) -> list[str]:
    """The modes of a run, in order, from a comma list (`interposer,hydrator,full`)."""
    return mode_list(text, MODES)


def cluster(mode: str) -> str:
    """The workload label of a mode's restore units (their names are `<cluster>_node_0`): letters only."""
    return "e2e" + mode.replace("-", "")


@dataclass(frozen=True)
class Tuning:
    """The bench's tuning for a run: what the units' environment and the cooperative engine get."""

    criu_threads: int  # CRIU_RESTORE_THREADS in every unit
    stack_bytes: int = 0  # the cooperative engine's CUDA stack limit (0: the driver's)
    thp: str = "unknown"  # the node's transparent huge page mode during the run (as read, not set here)

    def engine_options(self, mode: str) -> tuple[str, ...]:
        """The engine's extra `serve` options: only a cooperative engine is asked to change anything."""
        return ("--stack-bytes", str(self.stack_bytes)) if mode in COOPERATIVE and self.stack_bytes else ()

    def notes(self, mode: str) -> str:
        applied = [f"THP {self.thp}", f"CRIU_RESTORE_THREADS={self.criu_threads}"]
        if mode in COOPERATIVE:
            applied.append(f"CUDA stack limit {self.stack_bytes} B" if self.stack_bytes else "driver's CUDA stack")
            applied.append("KV kept (engine_llama's static cache is torch tensors, not an arena region)")
        else:
            applied.append("engine unchanged: no CUDA stack limit, KV kept (both need a call inside the engine)")
        return "; ".join(applied)


def node_thp() -> str:
    """The node's transparent huge page mode (the bracketed word of the kernel's file)."""
    try:
        text = THP_FILE.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip()


def mode_layout(work: Path, weights: Path, mode: str, tuning: Tuning,
                images_root: Path | None = None) -> InterposerLayout:
    """A mode's units: the run directory and images under `work/mode` (or `images_root/mode`), and the
    environment the mode adds; only the interposer modes mount the interposer's run directory at /run/coldsnap."""
    environment = {"CRIU_RESTORE_THREADS": str(tuning.criu_threads)} if tuning.criu_threads else {}
    interposer = mode.startswith("interposer")
    if interposer:
        environment.update(interposer_environment(staged=mode == "interposer-hydrator"))
    base = work / mode
    return InterposerLayout(run_dir=base / "run", images_dir=images_root / mode if images_root else base / "images",
                            weights=weights, extra_environment=environment,
                            interposer_dir=base / "coldsnap" if interposer else None)


def _chunk_digest(path: Path, offset: int, size: int) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left > 0:
            block = f.read(min(left, 8 << 20))
            if not block:
                raise OSError(f"{path} ended at {offset + size - left}, its size said {offset + size}")
            digest.update(block)
            left -= len(block)
    return digest.digest()


def images_digest(images: Path, threads: int) -> str:
    """One SHA-256 over every file under `images`: its relative path, size, mtime and ctime (as
    coldsnap_probe.image_digest: any write changes them, even one that puts the same bytes back) and its
    chunks' digests in order (a changed byte, whatever the times say), the chunks hashed on `threads` threads
    (hashlib releases the GIL): a 19 GB image in seconds, not minutes."""
    files = sorted(p for p in images.rglob("*") if p.is_file())
    stats = {p: p.stat() for p in files}
    jobs = [(p, offset, min(DIGEST_CHUNK, stats[p].st_size - offset))
            for p in files for offset in range(0, max(stats[p].st_size, 1), DIGEST_CHUNK)]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        chunks = list(pool.map(lambda job: _chunk_digest(*job), jobs))
    total = hashlib.sha256()
    for (path, offset, size), chunk in zip(jobs, chunks, strict=True):
        if offset == 0:
            st = stats[path]
            total.update(f"{path.relative_to(images)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0".encode())
        total.update(f"{offset}\0{size}\0".encode())
        total.update(chunk)
    return total.hexdigest()


def restore_columns(restored: dict[str, Any]) -> dict[str, Any]:
    """A restore's row beyond bench/e2e_restore.py's: the interposer's device hydration (bytes, GB/s, whether
    the node hydrator staged it) and the first token after the ready file was seen."""
    report = restored.get("worker_report") or {}
    # interposer-hydrator: was the dump staged by the node hydrator, or did the interposer fill it?
    return {**device_hydration(report), **device_staging(report),
            "after_ready_s": restored["first_token_s"] - restored["readiness_s"]}


# ---------------------------------------------------------------------------------------------------------------
# One mode end to end, bad input


async def _cold_and_capture(d: Driver, mode: str, pinned: str, layout: Layout, tuning: Tuning,
                            result: dict[str, Any]) -> str:
    """The serving engine cold (and the node's hydrator in `hydrator` mode), then the capture; the capture's ID."""
    hydrator, sidecar = mode == "hydrator", f"e2e-{mode}-hydrator"
    if mode.startswith("interposer"):
        await check_interposer(d, pinned, layout)
    service = (await start_hydrator(d, pinned, layout, sidecar) if hydrator
               else await start_staging_hydrator(d, pinned, layout, sidecar) if mode == "interposer-hydrator"
               else None)
    cold = result["cold"] = await start_serving(d, pinned, layout, f"e2e-{mode}-serving",
                                                hydrate=mode in COOPERATIVE, hydrator=hydrator,
                                                engine_options=tuning.engine_options(mode))
    if service:
        result["hydrator"] = await wait_hydrator(d, sidecar, service["created_unix"])
    print(f"[{mode}] cold Docker-to-first-token {cold['first_token_s']:.2f} s", flush=True)
    capture_id = f"e2e-{mode}-{time.strftime('%Y%m%dT%H%M%S')}"
    result["capture"] = await capture(d, f"e2e-{mode}-serving", int(cold["engine_pid"]), layout, capture_id,
                                      hydrate=mode in COOPERATIVE)
    result["capture_phases"] = capture_row(result["capture"])
    print(f"[{mode}] captured: {json.dumps(result['capture_phases'])}", flush=True)
    await d.expect(f"removing e2e-{mode}-serving", "workload-remove", name=f"e2e-{mode}-serving")
    images = layout.images_dir / capture_id
    files = [p for p in images.rglob("*") if p.is_file()]
    result["images_bytes"] = sum(p.stat().st_size for p in files)
    result["device_dump_bytes"] = sum(p.stat().st_size for p in files
                                      if p.relative_to(images).parts[0].startswith("device-"))
    result["images_digest_before"] = images_digest(images, tuning.criu_threads)
    return capture_id


async def _restores(d: Driver, args: argparse.Namespace, mode: str, pinned: str, layout: Layout, capture_id: str,
                    result: dict[str, Any]) -> None:
    cold = result["cold"]
    unit = f"{cluster(mode)}_node_0"
    for attempt in range(args.restores):
        restored = await restore_unit(d, pinned, layout, unit, capture_id,
                                      labels=unit_labels(capture_id, cluster(mode)))
        restored.update(restore_columns(restored))
        restored["identical_tokens"] = restored["tokens"] == cold["tokens"]
        restored["identical_first_logits"] = restored["first_logits_sha256"] == cold["first_logits_sha256"]
        result["restores"].append(restored)
        print(f"[{mode}] restore {attempt + 1}: Docker-to-first-token {restored['first_token_s']:.2f} s (CRIU "
              f"{restored['criu_s']}, CUDA {restored['cuda_s']}, device {restored['device_hydration_s']}, weights "
              f"{restored['hydration_s']}), identical tokens {restored['identical_tokens']}, logits "
              f"{restored['identical_first_logits']}", flush=True)
    await d.expect(f"removing {unit}", "workload-remove", name=unit)


async def run_mode(d: Driver, args: argparse.Namespace, mode: str, pinned: str, tuning: Tuning) -> dict[str, Any]:
    shutil.rmtree(Path(args.work) / mode, ignore_errors=True)
    layout = mode_layout(Path(args.work), Path(args.weights), mode, tuning,
                         Path(args.images_root) if args.images_root else None)
    shutil.rmtree(layout.images_dir, ignore_errors=True)
    layout.prepare()
    result: dict[str, Any] = {"mode": mode, "ok": False, "restores": [], "notes": tuning.notes(mode),
                              "environment": layout.extra_environment,
                              "engine_options": list(tuning.engine_options(mode))}
    try:
        capture_id = await _cold_and_capture(d, mode, pinned, layout, tuning, result)
        await _restores(d, args, mode, pinned, layout, capture_id, result)
        after = images_digest(layout.images_dir / capture_id, tuning.criu_threads)
        result["images_unchanged"] = after == result["images_digest_before"]
        result["ok"] = bool(result["restores"]) and result["images_unchanged"] and all(
            r["identical_tokens"] and r["identical_first_logits"] for r in result["restores"])
    except (E2EError, OSError, ValueError, KeyError, TimeoutError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["error_code"] = getattr(exc, "code", "")
        print(f"[{mode}] FAILED: {result['error'][:3000]}", flush=True)
        result["engine_log_tail"] = engine_stages(layout)[-6:]
    finally:
        for name in (f"e2e-{mode}-serving", f"{cluster(mode)}_node_0", f"e2e-{mode}-hydrator"):
            await d.runtime("workload-remove", name=name)
        if not args.keep_images:
            shutil.rmtree(layout.images_dir, ignore_errors=True)
    return result


async def bad_input(d: Driver, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A capsule without the worker: refused by the check and by the restore unit, nothing left behind."""
    rows = []
    plain = (await inspect_capsule(d, args.plain_capsule))["id"]
    layout = Layout(run_dir=Path(args.work) / "bad" / "run", images_dir=Path(args.work) / "bad" / "images",
                    weights=Path(args.weights))
    layout.prepare()
    for what in ("check", "restore unit"):
        started = time.time()
        try:
            if what == "check":
                await check_worker(d, plain, layout)
            else:
                await restore_unit(d, plain, layout, "e2ebad_node_0", "none", labels=unit_labels("none", "e2ebad"),
                                   readiness_timeout=60)
            rows.append({"case": f"capsule without the worker ({what})", "ok": False, "error": "accepted"})
        except E2EError as exc:
            left = await d.gone("e2ebad_node_0")
            rows.append({"case": f"capsule without the worker ({what})", "ok": exc.code == "runtime_failed" and left,
                         "error_code": exc.code, "error": str(exc)[:1500], "no_container_left": left,
                         "seconds": round(time.time() - started, 3)})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The tables


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _yes(value: Any) -> str:
    return "-" if value is None else ("yes" if value else "**no**")


def restore_table(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| mode | run | Docker-to-first-token s | vs cold | worker start s | CRIU s | CUDA s "
             "| device hydration s (GB/s) | weights hydration s | first token after ready s | tokens = cold "
             "| 1st-step logits = cold |", "| --- | --- |" + " ---: |" * 8 + " --- | --- |"]
    for result in results:
        mode, cold = result["mode"], result.get("cold")
        if cold:
            lines.append(f"| {mode} | cold | {_f(cold['first_token_s'])} | 1x | - | - | - | - | - "
                         f"| {_f(cold['request_to_first_token_s'])} | - | - |")
        for i, r in enumerate(result.get("restores", []), 1):
            speed = f"{cold['first_token_s'] / r['first_token_s']:.1f}x" if cold and r["first_token_s"] else "-"
            lines.append(f"| {mode} | restore {i} | {_f(r['first_token_s'])} | {speed} | {_f(r['worker_started_s'])} "
                         f"| {_f(r['criu_s'])} | {_f(r['cuda_s'])} | {device_cell(r)} | {_f(r['hydration_s'])} "
                         f"| {_f(r.get('after_ready_s'))} | {_yes(r['identical_tokens'])} "
                         f"| {_yes(r['identical_first_logits'])} |")
        if result.get("error"):
            lines.append(f"| {mode} | failed: {result['error'][:300].replace('|', '/')} |" + " |" * 10)
    return lines


def capture_table(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| mode | device release s (GB) | CUDA checkpoint s | CRIU dump s | images GB | device dumps GB "
             "| images unchanged by restores | goal | restores within it |", "| --- |" + " ---: |" * 5 + " --- |" * 3]
    for result in results:
        phases = result.get("capture_phases")
        if not phases:
            continue
        released = phases.get("device_bytes")
        release = f"{_f(phases['device_release_s'])} ({released / 1e9:.2f})" if released else "-"
        goal = GOAL_S[result["mode"]]
        within = sum(1 for r in result["restores"] if r["first_token_s"] <= goal)
        lines.append(f"| {result['mode']} | {release} | {_f(phases['cuda_checkpoint_s'])} "
                     f"| {_f(phases['criu_dump_s'])} | {_f(result['images_bytes'] / 1e9)} "
                     f"| {_f(result.get('device_dump_bytes', 0) / 1e9)} | {_yes(result.get('images_unchanged'))} "
                     f"| <= {goal:g} s | {within} of {len(result['restores'])} |")
    return lines


def table(results: list[dict[str, Any]], capsule: dict[str, Any], weights_bytes: int) -> str:
    lines = [*restore_table(results), "", *capture_table(results), ""]
    lines.append(f"Capsule {capsule.get('id', '')[:19]}: {capsule.get('size', 0) / 1e6:.0f} MB; weights "
                 f"{weights_bytes / 1e9:.2f} GB.")
    for result in results:
        lines.append(f"{result['mode']}: {result.get('notes', '')}")
        uncovered = (result.get("capture_phases") or {}).get("uncovered_bytes")
        if uncovered:
            lines.append(f"{result['mode']}: left on the CUDA checkpoint path: {json.dumps(uncovered)}")
        if result.get("cold"):
            marks = ", ".join(f"{s['stage']} {s['since_create_s']:.2f}" for s in result["cold"]["stages"]
                              if s["stage"] not in ("served",))
            lines.append(f"{result['mode']} cold stages (s after workload-run): {marks}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The run


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/e2e_modes.py")
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--capsule", required=True, help="the capsule tag (with the worker and the interposer)")
    parser.add_argument("--plain-capsule", default="", help="a capsule without the worker: the bad-input case")
    parser.add_argument("--weights", required=True)
    parser.add_argument("--work", required=True, help="host directory for run directories (and images)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default="hydrator", help=f"comma list of {', '.join(MODES)}, run in that order")
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--images-root", default="", help="the images here (e.g. /dev/shm/cs-e2e-img), one "
                        "folder per mode; default: under --work")
    parser.add_argument("--criu-threads", type=int, default=0,
                        help="CRIU_RESTORE_THREADS in the units (default: the CPUs this host gives them)")
    parser.add_argument("--stack-bytes", type=int, default=0,
                        help="the cooperative engine's CUDA stack limit (default 0: the driver's)")
    parser.add_argument("--keep-images", action="store_true")
    parser.add_argument("--budget", type=float, default=0.0, help="skip later modes past this many seconds")
    parser.add_argument("--build", action="append", default=[], metavar="CONTEXT=TAG",
                        help="first build this capsule through the daemon's image-build (CONTEXT/Dockerfile)")
    args = parser.parse_args(argv)
    try:
        args.modes = plan_modes(args.modes)
    except ValueError as exc:
        parser.error(f"--modes: {exc}")
    for name in ("restores", "criu_threads", "stack_bytes"):
        if getattr(args, name) < (1 if name == "restores" else 0):
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: "
                         + ("at least 1" if name == "restores" else "0 or more"))
    return args


async def prepare(d: Driver, args: argparse.Namespace) -> dict[str, Any]:
    """The capsules built through the daemon, the capsule pinned, probed, and its worker checked."""
    out: dict[str, Any] = {"builds": []}
    for item in args.build:
        context, _, tag = item.partition("=")
        started = time.time()
        await d.expect(f"image-build of {tag}", "image-build", build={
            "dockerfile": base64.b64encode(Path(context, "Dockerfile").read_bytes()).decode(), "context": context,
            "tag": tag, "pull": False})
        out["builds"].append({"tag": tag, "seconds": time.time() - started})
    out["capsule"] = await inspect_capsule(d, args.capsule)
    started = time.time()
    probe = await probe_capsule(d, args.capsule)
    out["probe"] = {"admitted": probe.get("admitted"), "cached": probe.get("cached"), "seconds": time.time() - started}
    started = time.time()
    await check_worker(d, str(out["capsule"]["id"]), Layout(run_dir=Path(args.work), images_dir=Path(args.work),
                                                            weights=Path(args.weights)))
    out["worker_check_s"] = time.time() - started
    return out


async def main() -> int:
    args = parse()
    began = time.monotonic()
    tuning = Tuning(criu_threads=args.criu_threads or len(os.sched_getaffinity(0)), stack_bytes=args.stack_bytes,
                    thp=node_thp())
    d = Driver(Path(args.state_dir))
    await d.open()
    out: dict[str, Any] = {"prepare": await prepare(d, args), "tuning": tuning.__dict__}
    print(f"prepared: {json.dumps(out['prepare'])[:600]}; tuning {json.dumps(out['tuning'])}", flush=True)
    results: list[dict[str, Any]] = []
    for mode in args.modes:
        if results and args.budget and time.monotonic() - began > args.budget:
            results.append({"mode": mode, "ok": False, "restores": [],
                            "error": f"skipped: past the {args.budget:.0f} s budget"})
            continue
        results.append(await run_mode(d, args, mode, str(out["prepare"]["capsule"]["id"]), tuning))
        Path(args.out, "e2e.json").write_text(json.dumps({**out, "results": results}, indent=1, default=str))
    out["results"] = results
    if args.plain_capsule:
        out["bad_input"] = await bad_input(d, args)
        for row in out["bad_input"]:
            print(json.dumps(row)[:800], flush=True)
    weights_bytes = sum(p.stat().st_size for p in Path(args.weights).iterdir() if p.is_file())
    text = table(results, out["prepare"]["capsule"], weights_bytes)
    print(text, flush=True)
    Path(args.out, "e2e.json").write_text(json.dumps(out, indent=1, default=str))
    Path(args.out, "e2e-table.md").write_text(text + "\n")
    ok = all(r["ok"] for r in results) and all(r["ok"] for r in out.get("bad_input", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

"""Restore to first token vs cold start to first token, side by side (run on the GPU machine).

    python bench/restore_ttft.py --sizes 2,16 --criu /path/to/criu [--root /tmp/coldsnap-ttft]

For each size: a cold start of engines/ttft_server.py timed from process start to the first
streamed token (with its stages: imports, CUDA init, weight load, graph capture); a capture by
the worker (`python -m coldsnap_probe capture`); two (--restores) restores from the same unchanged images,
each timed from the restore command to the first token. The restored process must produce the
same tokens and the same first-step logits (bitwise) as the original. Pinned host-to-device
bandwidth is measured in the same run. Results: a table on stdout and JSON in --out.

Mode `hydrate` uses coldsnap_probe's hydration API end to end: the server keeps its weights in a
`WeightArena` (one region: a 64 MiB-aligned prefix of one weights file generated for the largest
size, so every size shares it), the worker's capture releases them (`--hydration`), the worker's
restore hydrates and verifies them before the engine serves. `--strategy hydrator` starts one
long-lived hydrator (`python -m coldsnap_probe.hydration serve`) that page-locks the weights file
once. `--hydrate-bench GIB` first measures the copy strategies (register, ring, O_DIRECT ring,
hydrator) with the source in /dev/shm, in the page cache and cold on disk.

Mode `interposer` is the no-cooperation path: the same server, unchanged (no --vmm-weights), run under
`LD_PRELOAD=libcoldsnap_cuda.so` with `COLDSNAP_CUDA_INTERPOSER_SOCKET`; the worker finds the socket in the
server's environment, has the interposer dump and release every device allocation before the CUDA lock (into
the images), and hydrate it after the CUDA restore (docs/interposer.md). Its capture row adds the release.

`--rows` runs other engines or allocators (bench/engine_rows.py's rows: `torch-expandable`, `torch-async`, `jax`,
`split`, ...) in every other dimension; bench/restore_rows.py puts them side by side, bench/e2e_rows.py through the
daemon.
"""

from __future__ import annotations

import argparse
import itertools
import json
import lzma
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "engines" / "ttft_server.py"
BASELINE_MIB = 0  # GPU memory used with no server running (set in main)
sys.path.insert(0, str(ROOT))

from bench import _common, engine_rows, page_fill
from bench._common import become_subreaper, criu_zero_pages, disk_read_rate, drop_caches, kill_and_reap, stages, table
from bench.engine_rows import PROMPT, ROWS
from coldsnap_probe import ProbeError, hydration_request, image_digest


def release_split(device: dict[str, Any]) -> str:
    """A release's phases in one line: wall seconds, then the copy threads' thread-seconds waiting for the
    device-to-host copies, digesting, looking for zeros and writing, and the raw timings."""
    t = device.get("timings_s") or {}
    return (f"{t.get('dump', 0.0):.2f} s ({device.get('gbps', 0.0):.1f} GB/s); thread-s D2H "
            f"{t.get('dump_device_thread_s', 0.0):.2f} / digest {t.get('dump_digest_thread_s', 0.0):.2f} / zero "
            f"{t.get('dump_zero_thread_s', 0.0):.2f} / write {t.get('dump_write_thread_s', 0.0):.2f}; "
            f"{json.dumps(t)}")


def connect(path: Path, deadline_s: float = 120.0) -> socket.socket:
    """Connect, retrying until the (restored) server listens again."""
    give_up = time.time() + deadline_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
            if time.time() > give_up:
                raise
            time.sleep(0.002)


def request(path: Path, max_tokens: int) -> tuple[float, list[int], str]:
    """(first-token unix time, tokens, first-logits digest)."""
    with connect(path) as sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps({"prompt": PROMPT, "max_tokens": max_tokens}).encode() + b"\n")
        stream.flush()
        first, tokens = 0.0, []
        for line in stream:
            message = json.loads(line)
            if "token" in message:
                first = first or time.time()
                tokens.append(message["token"])
            elif message.get("done"):
                return first, tokens, message["first_logits_sha256"]
    raise RuntimeError("server closed the stream early")


def pinned_h2d_gbps() -> float:
    code = "\n".join([
        "import torch, time",
        "x = torch.empty(4 << 30, dtype=torch.uint8).pin_memory(); y = torch.empty_like(x, device='cuda')",
        "best = 1e9",
        "for _ in range(5):",
        "    torch.cuda.synchronize(); t = time.perf_counter(); y.copy_(x, non_blocking=True)",
        "    torch.cuda.synchronize(); best = min(best, time.perf_counter() - t)",
        "print((4 << 30) / best / 1e9)"])
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


CAPTURE_PARTS = ("device_release", "cuda_checkpoint", "criu_dump")  # the capture's timed parts, in order


def host_ceilings(images_root: Path) -> dict[str, float]:
    """The host's own rates where the images live, measured in this run (bench/page_fill.py): writing files, what
    bounds the interposer's release, and filling fresh memory from a file, what bounds CRIU's page restore."""
    return page_fill.ceilings(str(images_root), 4 << 30, min(16, os.cpu_count() or 1))


def worker(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker {args[0]} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def criu_gaps(log: Path, top: int = 12) -> dict[str, Any]:
    """Where CRIU's restore spent its time: the largest gaps between its timestamped log lines."""
    stamps: list[tuple[float, str]] = []
    try:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("(") and ")" in line[:16]:
                try:
                    stamps.append((float(line[1:line.index(")")]), line[:200]))
                except ValueError:
                    continue
    except OSError:
        return {}
    gaps = sorted(((b[0] - a[0], a[1], b[1]) for a, b in itertools.pairwise(stamps)), reverse=True)
    return {"lines": len(stamps), "last_s": stamps[-1][0] if stamps else 0.0,
            "gaps": [{"seconds": round(g, 4), "after": a, "before": b} for g, a, b in gaps[:top]]}


# The server's model shape (engines/ttft_server.py; not imported here: it imports torch).
VOCAB, HIDDEN = 32000, 4096
PER_LAYER = 12 * HIDDEN * HIDDEN + 2 * HIDDEN
CHUNK = 64 << 20


def region_bytes(gib: float) -> int:
    layers = max(1, int((gib * (1 << 30) / 2 - VOCAB * HIDDEN - HIDDEN) // PER_LAYER))
    return -(-(VOCAB * HIDDEN + HIDDEN + layers * PER_LAYER) * 2 // CHUNK) * CHUNK


def start_hydrator(socket_path: Path, weights: Path | None,
                   log: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """The long-lived, staging hydrator: page-locks the weights file once (its start-up time is the pinning cost);
    without one it only stages the interposer's dumps."""
    socket_path.unlink(missing_ok=True)
    started = time.time()
    out = open(log, "wb")  # noqa: SIM115 - the hydrator writes here for its whole life
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(socket_path),
                             "--staging", *([str(weights)] if weights else []),
                             # DEVICE_TIER=SIZE: each dump staged is kept on the GPU (`serve --device-tier-bytes`)
                             *(["--device-tier-bytes", os.environ["DEVICE_TIER"]] if os.environ.get("DEVICE_TIER")
                               else [])],
                            stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=ROOT,
                            start_new_session=True)
    while True:
        text = log.read_text() if log.exists() else ""
        line = next((x for x in text.splitlines() if x.startswith('{"ready"')), None)
        if line is not None:
            ready: dict[str, Any] = json.loads(line)
            ready["start_s"] = time.time() - started
            return proc, ready
        if proc.poll() is not None:
            raise RuntimeError(f"hydrator exited {proc.returncode}: {text[-2000:]}")
        time.sleep(0.02)


def gpu_used_mib() -> int:
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                          capture_output=True, text=True, check=False)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.strip() else -1


def settle_gpu(limit_mib: int, timeout: float = 3.0) -> dict[str, Any]:
    """Wait until the GPU's used memory is back under `limit_mib` (a killed process's memory is freed
    asynchronously); how long it took and what was used."""
    started = time.time()
    used = gpu_used_mib()
    while used > limit_mib and time.time() - started < timeout:
        time.sleep(0.2)
        used = gpu_used_mib()
    return {"used_mib": used, "waited_s": round(time.time() - started, 2)}


def reap_tree(pids: list[int], timeout: float = 10.0) -> None:
    """Until every PID of a captured or killed tree is free: a server of several processes leaves orphans, this
    subreaper's zombies meanwhile, and CRIU cannot restore a process whose PID is taken."""
    left, give_up = set(pids), time.time() + timeout
    while left and time.time() < give_up:
        for pid in list(left):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass  # not (yet) ours: its parent is still ending
            if not os.path.exists(f"/proc/{pid}"):
                left.discard(pid)
        time.sleep(0.01)


STARTED: list[int] = []  # process groups a size's run started (a server, a restored tree): killed if it fails


def stop_started(timeout: float = 10.0) -> None:
    """After a failed run: kill what it started and reap it (only those: the hydrator, a child too, lives on)."""
    for pid in STARTED:
        try:
            os.killpg(pid, 9)
        except (ProcessLookupError, PermissionError):
            continue
        give_up = time.time() + timeout
        while time.time() < give_up:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                break
            time.sleep(0.05)
    STARTED.clear()


BEGAN = time.time()


def progress(message: str) -> None:
    """One line as it happens (a device run that ends early still says where it was)."""
    print(f"[{time.time() - BEGAN:6.1f} s] {message}", flush=True)


def show_stages(log: Path, shown: set[str], t0: float) -> dict[str, dict[str, Any]]:
    """The server's stages so far (printing those not shown yet, seconds since its start)."""
    entries = stages(log)
    for name, entry in entries.items():
        if name not in shown:
            shown.add(name)
            progress(f"  server stage {name} at {entry['unix'] - t0:.2f} s")
    return entries


def server_env(root: Path, interposer: Path | None, strategy: str,
               engine_env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The server's environment: under the interposer (its socket per pid in `root`; the node hydrator, when one
    runs, stages its dump while CRIU restores), or inherited; `engine_env` (a row's allocator settings) on top."""
    if interposer is None:
        return {**os.environ, **engine_env} if engine_env else None
    hydrator = {"COLDSNAP_CUDA_INTERPOSER_HYDRATOR": strategy.split(":", 1)[1]} if strategy.startswith(
        "hydrator:") else {}
    return {**os.environ, "LD_PRELOAD": str(interposer),
            "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(root / "cuda-%p.sock"), **hydrator, **(engine_env or {})}


def run_size(gib: float, root: Path, criu: str, max_tokens: int, hydrate: bool, weights: Path,
             digests: list[bytes], strategy: str, images_root: Path, stack_bytes: int = 0,
             lazy_pages: bool = False, kv_discard: bool = False, interposer: Path | None = None,
             cold_cache: bool = False, device_weights: bool = False, count: int = 2, command: Sequence[str] = (),
             engine_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One size in one mode: the whole device state in the images, weights hydrated after restore, or (with
    `interposer`, the library) every device allocation dumped and hydrated by the interposer. `cold_cache`: the
    page cache is dropped before each restore (the images read from the disk under `images_root`).
    `device_weights`: a full or interposer row's server generates its weights on the GPU (no file read).
    `command` (the interpreter and script of another engine speaking ttft_server.py's arguments, stages and
    protocol) and `engine_env` (added to its environment) make other rows (bench/restore_rows.py)."""
    from coldsnap_probe import combine_digests

    suffix = "-hydrate" if hydrate else "-interposer" if interposer else ""
    images = images_root / f"images-{gib:g}g{suffix}"
    control = root / f"control-{gib:g}g.sock"
    extra = (["--vmm-weights", "--control", str(control), "--strategy", strategy,
              "--region-digest", combine_digests(digests[:region_bytes(gib) // CHUNK])] if hydrate else [])
    extra += ["--stack-bytes", str(stack_bytes)] if stack_bytes else []
    extra += ["--kv-discard"] if kv_discard and hydrate else []
    subprocess.run(["rm", "-rf", str(images)], check=True)
    settled = settle_gpu(BASELINE_MIB + 2048)
    log = root / f"server-{gib:g}g.log"
    path = root / f"server-{gib:g}g.sock"
    path.unlink(missing_ok=True)
    # Cold start: from process start to the first token.
    t0 = time.time()
    progress(f"{gib:g} GiB {'hydrate' if hydrate else 'interposer' if interposer else 'full'}: cold start")
    with open(log, "wb") as out:
        server = subprocess.Popen([*(command or (sys.executable, str(SERVER))), "--gib", str(gib),
                                   "--weights", str(weights) if hydrate or not device_weights else "device",
                                   "--socket", str(path), *extra],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                  start_new_session=True, env=server_env(root, interposer, strategy, engine_env))
    STARTED[:] = [server.pid]
    shown: set[str] = set()
    while "ready" not in show_stages(log, shown, t0):
        if server.poll() is not None:
            raise RuntimeError(f"server exited {server.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.01)
    cold_first, cold_tokens, cold_hash = request(path, max_tokens)
    progress(f"  cold first token at {cold_first - t0:.2f} s; capture")
    entries = stages(log)
    device_bytes = entries["graph_captured"]["device_bytes"]
    marks = {name: entry["unix"] for name, entry in entries.items()}
    cold = {"ttft_s": cold_first - t0,
            "interpreter_s": marks["process_start"] - t0,  # python itself, before `import torch`
            "cuda_init_s": marks["cuda_init"] - t0,  # process start, imports and CUDA context
            "weight_load_s": marks["weights_loaded"] - marks["cuda_init"],
            "graph_capture_s": marks["graph_captured"] - marks["weights_loaded"],
            "first_token_s": cold_first - marks["ready"]}
    # Capture (the worker kills the dumped tree; reap the original so its PID is free for restore).
    capture = worker("capture", "--pid", str(server.pid), "--images", str(images), "--criu", criu,
                     *(["--hydration", str(control)] if hydrate else []))
    server.wait()
    reap_tree(capture["tree"])  # a server's other processes too (engines/split_server.py's engine core)
    # CRIU restores the server's log descriptor only if the file has the size it dumped; a restored server (and
    # the interposer in it) writes more, so each restore starts from the captured log, as a fresh unit would.
    captured_log = log.stat().st_size
    progress(f"  captured: {json.dumps(capture.get('timings_s'))[:200]}")
    for device in capture.get("device_memory") or []:  # where the release's copy threads spent their time
        progress(f"  release of {device.get('bytes', 0) / 1e9:.1f} GB: {release_split(device)}")
    criu_pages, criu_zeros = criu_zero_pages(images)  # pages of zeros CRIU still wrote (docs/criu-zero-pages.md)
    progress(f"  CRIU pages: {criu_pages / 1e9:.2f} GB, of it 4 KiB pages of zeros {criu_zeros / 1e9:.2f} GB")
    digest_before = image_digest(images)
    image_files = sorted(((p.stat().st_size, p.name) for p in images.iterdir() if p.is_file()), reverse=True)
    restores = []
    for attempt in range(1, count + 1):
        path.unlink(missing_ok=True)  # the dead process's socket file; the restored one binds it again
        os.truncate(log, captured_log)
        if cold_cache and not drop_caches():
            raise RuntimeError("--cache cold: dropping the page cache needs root")
        t0 = time.time()
        work = images.with_name(f"{images.name}-work-{attempt}")
        progress(f"  restore {attempt}")
        report = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(work),
                        *(["--lazy-pages"] if lazy_pages else []))
        marks = {m["name"]: m["since_restore_begin_s"] for m in report["timeline"]}
        STARTED[:] = [report["restored_pid"]]
        first, tokens, first_hash = request(path, max_tokens)
        hydration = report.get("hydration", {})
        wake = hydration.get("phase_seconds", 0.0) + report.get("device_hydration_seconds", 0.0)
        restores.append({"ttft_s": first - t0, "criu_restore_s": report["criu_restore_seconds"],
                         "cuda_restore_s": report["cuda_restore_seconds"],
                         "worker_s": report.get("ready_seconds", report["restore_seconds"]),
                         "wake_s": wake, "hydration": hydration, "device_memory": report.get("device_memory"),
                         "worker_start_s": report["timeline"][0]["unix_ns"] / 1e9 - t0,
                         "after_ready_s": first - report["timeline"][-1]["unix_ns"] / 1e9,
                         "criu_log": criu_gaps(work / "restore.log"),
                         "lazy_pages_log": criu_gaps(work / "lazy-pages.log") if lazy_pages else None,
                         "tokens_identical": tokens == cold_tokens, "logits_identical": first_hash == cold_hash,
                         "all_pages_in_s": marks.get("all_pages_in"), "timeline": report["timeline"]})
        kill_and_reap([report["restored_pid"]])
        reap_tree(capture["tree"])
        if lazy_pages:  # kept for reading: where the daemon spent its time (its last 8 MB)
            with open(work / "lazy-pages.log", "rb") as lazy_log:
                lazy_log.seek(max(0, lazy_log.seek(0, os.SEEK_END) - (8 << 20)))
                Path(os.environ.get("OUT", "."), f"lazy-pages-{gib:g}g-{attempt}.log.xz").write_bytes(
                    lzma.compress(lazy_log.read()))
        if strategy.startswith("hydrator:"):  # recorded, and printed below: nothing should stay staged
            try:
                restores[-1]["hydrator_status"] = hydration_request(strategy.split(":", 1)[1], {"op": "status"})
            except ProbeError as exc:
                restores[-1]["hydrator_status"] = {"error": str(exc)}
        # What the hydrator's device tier keeps (DEVICE_TIER) stays used between restores, as its context does.
        kept = ((restores[-1].get("hydrator_status") or {}).get("device_tier") or {}).get("bytes", 0)
        restores[-1]["gpu_after_kill"] = settle_gpu(BASELINE_MIB + kept // (1 << 20) + 2048)
        for device in report.get("device_memory") or []:  # a staged dump: where the hydrator's ring spent its time
            if (stage := (device.get("interposer") or {}).get("stage")) and stage.get("copy"):
                progress(f"  staged {stage.get('bytes', 0) / 1e9:.1f} GB in {stage.get('copy_s', 0):.2f} s: "
                         f"{json.dumps(stage['copy'])}")
        print(f"{gib:g} GiB restore {attempt}: {restores[-1]['ttft_s']:.2f} s; GPU used after the kill "
              f"{restores[-1]['gpu_after_kill']}; hydrator {restores[-1].get('hydrator_status')}", flush=True)
    unchanged = image_digest(images) == digest_before
    disk_gbps = None
    if cold_cache:  # what bounds a cold row: the disk's own sequential read rate, measured here, caches dropped
        drop_caches()
        disk_gbps = disk_read_rate(images / image_files[0][1]) / 1e9
    for done in (images, *images.parent.glob(f"{images.name}-work-*")):  # the disk holds one size at a time
        subprocess.run(["rm", "-rf", str(done)], check=True)
    mode = "weights hydrated" if hydrate else "interposer (no cooperation)" if interposer else "full image"
    mode += ", weights made on the GPU" if device_weights and not hydrate else ""
    alloc_conf = (engine_env or {}).get("PYTORCH_CUDA_ALLOC_CONF", "")
    mode += f", {alloc_conf}" if alloc_conf else ""
    return {"gib": gib, "mode": mode, "device_bytes": device_bytes, "alloc_conf": alloc_conf,
            "strategy": strategy if hydrate else "", "cold": cold, "capture": capture["timings_s"],
            "capture_hydration": capture.get("hydration"), "capture_device_memory": capture.get("device_memory"),
            "cold_stages": entries,
            "image_bytes": capture["image_bytes"], "image_files": image_files[:12],
            "memory_before_checkpoint": capture.get("memory_before_checkpoint"),
            "memory_after_checkpoint": capture.get("memory_after_checkpoint"),
            "restores": restores, "images_unchanged": unchanged, "gpu_before_cold": settled,
            "cache": "cold" if cold_cache else "warm", "disk_read_gbps": disk_gbps,
            "tokens": cold_tokens}


def hydrate_bench(gib: float, weights: Path, disk_dir: Path, hydrator: str) -> dict[str, Any]:
    """GB/s of each copy strategy into a WeightArena, source in /dev/shm, in the page cache, cold on disk."""
    from coldsnap_probe import WeightArena, WeightRegion, region_digest

    size = min(int(gib * (1 << 30)), weights.stat().st_size) // CHUNK * CHUNK
    disk = disk_dir / "hydrate-bench.bin"
    subprocess.run(["dd", f"if={weights}", f"of={disk}", "bs=64M", f"count={size // CHUNK}", "conv=fsync",
                    "status=none"], check=True)
    results: dict[str, Any] = {"gib": gib, "shm_source": str(weights), "disk_source": str(disk)}

    def drop(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    digests = {str(weights): region_digest(weights, 0, size), str(disk): region_digest(disk, 0, size)}
    plain = WeightArena(size)
    exported = WeightArena(size, exportable=True)
    runs = [("shm", "register", plain, weights, False), ("shm", "ring", plain, weights, False),
            ("shm", "hydrator", exported, weights, False), ("shm", "register", plain, weights, False),
            ("page-cache", "register", plain, disk, False), ("page-cache", "ring", plain, disk, False),
            ("cold-disk", "direct", plain, disk, True), ("cold-disk", "ring", plain, disk, True),
            ("cold-disk", "register", plain, disk, True)]
    rows = []
    for where, strategy, arena, source, cold in runs:
        arena.declare([WeightRegion("weights", arena.address, size, str(source), 0, digests[str(source)])])
        if cold:
            drop(source)
        chosen = f"hydrator:{hydrator}" if strategy == "hydrator" else strategy
        try:
            report = arena._fill(chosen)
        except Exception as exc:  # a strategy this machine refuses is a result, not the end of the run
            rows.append({"source": where, "strategy": strategy, "error": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append({"source": where, "strategy": strategy, **report})
    results["runs"] = rows
    disk.unlink()
    return results


def device_stage(restore: dict[str, Any]) -> dict[str, Any]:
    """The node hydrator's stage of the interposer's dump in a restore ({} when there was none), as the weights'
    stage reports it: `staged` (and adopted) and its `copy_s`."""
    for device in restore.get("device_memory") or []:
        interposer = device.get("interposer") or {}
        if interposer.get("staged"):
            return {"staged": True, "copy_s": (interposer.get("stage") or {}).get("copy_s", 0.0)}
    return {}


def device_gbps(restore: dict[str, Any]) -> float:
    """The interposer's fill rate in a restore (0 when it hydrated nothing)."""
    return max((d.get("gbps", 0.0) for d in restore.get("device_memory") or []), default=0.0)


def choices(*allowed: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of `allowed` values."""
    def parse(text: str) -> list[str]:
        values = text.split(",")
        if unknown := [v for v in values if v not in allowed]:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not one of {', '.join(allowed)}")
        return values
    return parse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="2,16")
    parser.add_argument("--criu", default="criu")
    parser.add_argument("--root", default="/tmp/coldsnap-ttft")
    parser.add_argument("--weights-dir", default="/dev/shm", help="where the weights file lives")
    parser.add_argument("--images-root", default="", help="where the images go (default: --root)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--modes", default="hydrate", type=choices("full", "hydrate", "interposer"),
                        help="comma-separated: full (whole state in the images), hydrate (weights re-hydrated "
                        "after restore), interposer (the unchanged server under the CUDA interposer)")
    parser.add_argument("--strategy", default="hydrator", choices=["register", "ring", "direct", "hydrator"])
    parser.add_argument("--hydrate-bench", type=float, default=0.0, help="GiB for the copy-strategy benchmark")
    parser.add_argument("--stack-bytes", default="0", help="comma-separated CUDA per-thread stack limits to run "
                        "each size with (0: the driver's default)")
    parser.add_argument("--kv", default="kept", type=choices("kept", "discarded"),
                        help="comma-separated: kept (the KV cache in the images), discarded "
                        "(in a discarded arena region: zeroed at restore; hydrate rows only, the other modes run "
                        "once with it kept)")
    parser.add_argument("--cache", default="warm", type=choices("warm", "cold"),
                        help="comma list: warm restores read the images from where they were written (tmpfs, or "
                             "the page cache for a disk --images-root); cold drops the page cache before each "
                             "restore (root; put --images-root on a disk) and measures the disk's read rate")
    parser.add_argument("--memory", default="eager", type=choices("eager", "lazy"),
                        help="comma-separated: eager (CRIU fills the memory), lazy "
                        "(criu lazy-pages fills it while the CUDA state comes back); each size runs with each")
    parser.add_argument("--rows", default=["torch"], type=engine_rows.row_list,
                        help="comma-separated rows of bench/engine_rows.py, each run in every other dimension "
                        f"(default torch: ttft_server.py with PyTorch's default allocator): {', '.join(ROWS)}")
    parser.add_argument("--restores", type=int, default=2, help="restores of each capture (each from the same images)")
    parser.add_argument("--device-weights", action="store_true",
                        help="full and interposer rows generate their weights on the GPU: no weights file unless a "
                             "hydrate row needs one (host memory for a 64 GiB dump beside no 64 GiB file)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--bench-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.restores < 1:  # the table is made of the restores: without one the run would end on an empty list
        parser.error(f"--restores must be at least 1, not {args.restores}")
    if "hydrate" in args.modes and (other := [r for r in args.rows if ROWS[r].script != "engines/ttft_server.py"]):
        parser.error(f"--rows {','.join(other)}: --modes hydrate needs ttft_server.py's weight arena (its rows only)")
    if "discarded" in args.kv and "hydrate" not in args.modes:
        parser.error("--kv discarded needs --modes hydrate (the KV cache is discarded from the weight arena)")
    if args.bench_child:
        gib, weights, disk_dir, hydrator = json.loads(args.bench_child)
        print(json.dumps(hydrate_bench(gib, Path(weights), Path(disk_dir), hydrator)))
        return
    become_subreaper()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    images_root = Path(args.images_root or root)
    images_root.mkdir(parents=True, exist_ok=True)
    sizes = [float(size) for size in args.sizes.split(",")]
    largest = max([*sizes, args.hydrate_bench])
    weights = Path(args.weights_dir) / f"coldsnap-weights-{largest:g}g.bin"
    # The file is needed by hydrate rows (and, without --device-weights, read by every server's cold start).
    needs_file = "hydrate" in args.modes or not args.device_weights or bool(args.hydrate_bench)
    started = time.time()
    if needs_file and (not weights.exists() or weights.stat().st_size < region_bytes(largest)):
        progress(f"generating the {largest:g} GiB weights file {weights}")
        subprocess.run([sys.executable, str(SERVER), "--gib", str(largest), "--weights", str(weights),
                        "--generate"], check=True)
    from coldsnap_probe import chunk_digests

    generate_s = time.time() - started
    started = time.time()
    digests: list[bytes] = []
    if "hydrate" in args.modes:  # only the hydrated rows name their region's digest
        progress("digesting the weights")
        digests = chunk_digests(weights, 0, region_bytes(largest))
    digest_s = time.time() - started
    h2d = pinned_h2d_gbps()
    ceilings = host_ceilings(images_root)
    progress(f"ceilings: pinned H2D {h2d:.1f} GB/s; {json.dumps(ceilings)}")
    library = None
    if "interposer" in args.modes:
        from coldsnap_probe.hydration import library_path

        library = library_path(root / "interposer-lib")
    hydrator_proc, hydrator_ready = None, None
    strategy = args.strategy
    if strategy == "hydrator" or args.hydrate_bench:
        hydrator_proc, hydrator_ready = start_hydrator(root / "hydrator.sock", weights if needs_file else None,
                                                       root / "hydrator.log")
    if strategy == "hydrator":
        strategy = f"hydrator:{root / 'hydrator.sock'}"
    global BASELINE_MIB
    BASELINE_MIB = gpu_used_mib()  # the hydrator's context, if any: what stays used between runs
    bench = None
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    try:
        if args.hydrate_bench:
            done = subprocess.run([sys.executable, __file__, "--bench-child",
                                   json.dumps([args.hydrate_bench, str(weights), str(root),
                                               str(root / "hydrator.sock")])],
                                  capture_output=True, text=True, check=False)
            bench = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-4000:]}
            Path(args.out, "hydrate_bench.json").write_text(json.dumps(bench, indent=2))
            if done.returncode == 0:
                print(table(["source", "strategy", "GB/s (incl. pinning)", "pin s", "copy s", "verify s"],
                            [[r["source"], r["strategy"], f"{r.get('gbps', 0):.1f}", f"{r.get('pin_s', 0):.2f}",
                              f"{r.get('copy_s', r.get('seconds', 0)):.2f}", f"{r.get('verify_s', 0):.3f}"]
                             if "error" not in r else [r["source"], r["strategy"], r["error"][:60], "", "", ""]
                             for r in bench["runs"]]))
        for size, mode, stack, memory, kv, cache, name in itertools.product(
                sizes, args.modes, args.stack_bytes.split(","), args.memory, args.kv, args.cache, args.rows):
            if mode != "hydrate":  # only the weight arena can discard the KV cache: other modes run once, kept
                if kv != args.kv[0]:
                    continue
                kv = "kept"
            try:
                row = run_size(size, root, args.criu, args.tokens, mode == "hydrate", weights, digests, strategy,
                               images_root, int(stack), memory == "lazy", kv == "discarded",
                               library if mode == "interposer" else None, cache == "cold", args.device_weights,
                               args.restores, command=ROWS[name].command(), engine_env=ROWS[name].env)
            except Exception as exc:  # one failed row is a result; the other rows still run
                stop_started()
                print(f"{size:g} GiB {mode} {name}: FAILED: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)
                failed.append({"gib": size, "mode": mode, "row": name,
                               "error": f"{type(exc).__name__}: {str(exc)[-6000:]}"})
                Path(args.out, "restore_ttft.failed.json").write_text(json.dumps(failed, indent=2))
                continue
            results.append({**row, "stack_bytes": int(stack), "memory": memory, "kv": kv})
            Path(args.out, "restore_ttft.partial.json").write_text(json.dumps(results, indent=2))
    finally:
        if hydrator_proc is not None:
            hydrator_proc.kill()
            hydrator_proc.wait()
    rows = []
    for r in results:
        c, best = r["cold"], min(r["restores"], key=lambda x: x["ttft_s"])
        others = " / ".join(f"{x['ttft_s']:.2f}" for x in r["restores"] if x is not best)
        # Device bytes back per second: through the CUDA restore, or (hydrated) through restore + hydration.
        gbps = r["device_bytes"] / (best["cuda_restore_s"] + best["wake_s"]) / 1e9
        hydrated = best.get("hydration", {})
        staged = (hydrated.get("staged") or {}) if isinstance(hydrated, dict) else {}
        staged = staged or device_stage(best)
        pages_in = " / ".join(f"{x['all_pages_in_s']:.2f}" for x in r["restores"] if x.get("all_pages_in_s"))
        rows.append([f"{r['gib']:g} GiB", r["mode"] + (f", stack {r['stack_bytes']} B" if r["stack_bytes"] else "")
                     + (", lazy pages" if r.get("memory") == "lazy" else "")
                     + (", KV discarded" if r.get("kv") == "discarded" else "")
                     + (f", cold disk ({r['disk_read_gbps']:.2f} GB/s)" if r.get("cache") == "cold" else ""),
                     f"{c['ttft_s']:.2f}", f"{best['ttft_s']:.2f} / {others}", f"{c['ttft_s'] / best['ttft_s']:.2f}x",
                     f"{best['worker_start_s']:.2f} / {best['criu_restore_s']:.2f} / {best['cuda_restore_s']:.2f} / "
                     f"{best['wake_s']:.2f} / {best['after_ready_s']:.2f}",
                     pages_in or "-", f"{staged.get('copy_s', 0):.2f}" if staged.get("staged") else "-",
                     f"{(hydrated.get('gbps') or device_gbps(best)):.1f}", f"{r['image_bytes'] / 1e9:.2f}",
                     " / ".join(f"{r['capture'].get(k, 0.0):.2f}" for k in CAPTURE_PARTS)
                     + f" = {sum(r['capture'].get(k, 0.0) for k in CAPTURE_PARTS):.2f}",
                     f"{gbps:.1f} ({gbps / h2d:.0%} of {h2d:.1f})",
                     "yes" if all(x["tokens_identical"] and x["logits_identical"] for x in r["restores"]) else "NO",
                     "yes" if r["images_unchanged"] else "NO", _common.line_rate(r.get("capture_device_memory"))])
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp_mode = thp.read_text().strip() if thp.exists() else "unknown"
    print(f"transparent huge pages: {thp_mode}")
    print(f"ceilings, measured in this run: pinned host-to-device {h2d:.1f} GB/s; "
          + "; ".join(f"{name} {gbps:.1f} GB/s" for name, gbps in ceilings.items()))
    print(table(["model", "mode", "cold TTFT s", "restore TTFT s (best / other)", "speed-up",
                 "restore: worker start / CRIU / CUDA / hydrate / first token after ready s",
                 "every page in s (since restore)", "staged copy s (overlapped)", "hydration GB/s", "images GB",
                 "capture: device release / CUDA checkpoint / CRIU dump = s",
                 "device GB/s back (of pinned H2D)",
                 "identical tokens+logits", "images unchanged", "device bytes at line rate"], rows))
    Path(args.out, "restore_ttft.json").write_text(json.dumps(
        {"pinned_h2d_gbps": h2d, "ceilings": ceilings, "strategy": args.strategy, "hydrator": hydrator_ready,
         "generate_s": generate_s,
         "transparent_hugepage": thp_mode,
         "digest_s": digest_s, "hydrate_bench": bench, "results": results, "failed": failed}, indent=2))


if __name__ == "__main__":
    main()

"""What a CUDA checkpoint puts into a process's host memory, and so into its CRIU images (run on the GPU machine).

    python bench/checkpoint_anatomy.py [--out DIR] [--set anatomy|limits]

Each variant starts a small CUDA process (bare cuda-python context, or torch with cuBLAS and a captured
graph; with or without a smaller per-thread stack, fewer hardware queues, eager module loading, the
heap trimmed), then checkpoints it from this process with `cuCheckpointProcessLock/Checkpoint` and reads
`/proc/<pid>/smaps` before and after: the anonymous memory the checkpoint adds is the device state
that every CRIU dump and restore of that process copies. The process's own anonymous memory (Python,
torch, driver host state) is listed by mapping. Restore and unlock are timed too. A table on stdout,
JSON in --out.

`--set limits` puts the context's limits side by side instead (issue 35: which reservations the checkpoint copies
that a release could lower and the hydration grow back): the stack at 1 KiB, 256 and 16 bytes, the device runtime's
pending launches, a torch process whose stack is lowered after its kernels ran (as the interposer's release does),
each with the values the driver reads back.

With --criu, the torch variant with cuBLAS and a graph is then checkpointed, dumped by CRIU and restored
twice each way: CRIU filling its memory at restore (as the worker does), and lazily (`criu lazy-pages` serving
page faults through userfaultfd and copying the rest in the background). Timed: CRIU, the CUDA restore,
the first GPU work after it (the process replays its graph on SIGUSR1), and until every page is in.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import become_subreaper, kill_and_reap, table
from coldsnap_probe import anonymous_memory

LAZY_FLAGS = ["--torch", "--stack", "256", "--matmul", "--graph"]

VARIANTS: list[tuple[str, list[str], dict[str, str]]] = [
    ("context (cuda-python)", [], {}),
    ("context, 256 B stack", ["--stack", "256"], {}),
    ("context, 256 B stack, small heap + printf", ["--stack", "256", "--small-limits"], {}),
    ("torch", ["--torch"], {}),
    ("torch, 256 B stack", ["--torch", "--stack", "256"], {}),
    ("torch, 256 B stack, matmul", ["--torch", "--stack", "256", "--matmul"], {}),
    ("torch, 256 B stack, matmul + graph", ["--torch", "--stack", "256", "--matmul", "--graph"], {}),
    ("  + malloc_trim", ["--torch", "--stack", "256", "--matmul", "--graph", "--trim"], {}),
    ("  + 1 hardware queue", ["--torch", "--stack", "256", "--matmul", "--graph"],
     {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    ("  eager module loading", ["--torch", "--stack", "256", "--matmul", "--graph"],
     {"CUDA_MODULE_LOADING": "EAGER"}),
]

LIMIT_VARIANTS: list[tuple[str, list[str], dict[str, str]]] = [
    ("context, stack 1 KiB (default)", [], {}),
    ("context, stack 256 B", ["--stack", "256"], {}),
    ("context, stack 16 B", ["--stack", "16"], {}),
    ("context, stack 256 B, 32 pending launches", ["--stack", "256", "--pending", "32"], {}),
    ("torch matmul + graph, stack 1 KiB", ["--torch", "--matmul", "--graph"], {}),
    ("  stack 256 B after the work", ["--torch", "--matmul", "--graph", "--stack", "256", "--late"], {}),
    ("  stack 16 B after the work", ["--torch", "--matmul", "--graph", "--stack", "16", "--late"], {}),
]


def set_limits(driver: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The limits the flags ask for, set on the current context: those the driver refused and what it reads back."""
    limits = {"stack": (driver.CUlimit.CU_LIMIT_STACK_SIZE, args.stack)} if args.stack else {}
    if args.small_limits:
        limits |= {"malloc_heap": (driver.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE, 1 << 20),
                   "printf_fifo": (driver.CUlimit.CU_LIMIT_PRINTF_FIFO_SIZE, 1 << 16)}
    if args.pending:
        limits["pending_launches"] = (driver.CUlimit.CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT, args.pending)
    refused = {name: str(err) for name, (limit, value) in limits.items()
               if int(err := driver.cuCtxSetLimit(limit, value)[0])}
    read = {name: int(driver.cuCtxGetLimit(getattr(driver.CUlimit, f"CU_LIMIT_{name.upper()}"))[1])
            for name in ("stack_size", "malloc_heap_size", "printf_fifo_size", "dev_runtime_pending_launch_count")}
    return {"limit_refused": refused, "limits_read": read}


def child(args: argparse.Namespace) -> None:
    stages: dict[str, Any] = {"start": anonymous_memory(os.getpid())}
    if args.torch:
        import torch

        stages["imported"] = anonymous_memory(os.getpid())
        torch.zeros(1, device="cuda").sum().item()
        from cuda.bindings import driver
    else:
        from cuda.bindings import driver

        driver.cuInit(0)
        _err, device = driver.cuDeviceGet(0)
        _err, ctx = driver.cuDevicePrimaryCtxRetain(device)
        driver.cuCtxSetCurrent(ctx)
    stages["context"] = anonymous_memory(os.getpid())
    limits = {} if args.late else set_limits(driver, args)
    if args.matmul or args.graph:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        b = (a @ a).sum().item()
        if args.graph:
            graph, out = torch.cuda.CUDAGraph(), torch.empty_like(a)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out.copy_(a @ a)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                out.copy_(a @ a)
            graph.replay()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        stages["work"] = anonymous_memory(os.getpid())
        del b
    if args.late:  # after the kernels ran (grown by the driver for them), as the interposer's release lowers it
        limits = set_limits(driver, args)
    if args.trim:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
        stages["trimmed"] = anonymous_memory(os.getpid())
    if args.wait_signal:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # taken by sigwait below, never delivered
    free, total = driver.cuMemGetInfo()[1:]
    reserved = torch.cuda.memory_reserved() if args.torch else 0
    sys.stdout.write(json.dumps({"ready": os.getpid(), "stages": stages, **limits,
                                 "device_used": int(total) - int(free), "torch_reserved": reserved}) + "\n")
    sys.stdout.flush()
    if not args.wait_signal:
        sys.stdin.read()
        return
    while True:  # each SIGUSR1: replay the graph and say so (the proof that a restored process works)
        signal.sigwait({signal.SIGUSR1})
        graph.replay()
        sys.stdout.write(json.dumps({"worked": float(out.float().sum().item())}) + "\n")
        sys.stdout.flush()


def _run(*argv: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{argv[1]} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def _lines(path: Path, count: int, deadline_s: float = 120.0) -> list[dict[str, Any]]:
    give_up = time.monotonic() + deadline_s
    while time.monotonic() < give_up:
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
        if len(lines) >= count:
            return lines
        time.sleep(0.001)
    raise RuntimeError(f"{path} has fewer than {count} lines after {deadline_s} s")


def call(name: str, pid: int) -> float:
    """One `cuCheckpointProcess*` call on `pid`, timed; a failure raises, naming the call."""
    from cuda.bindings import driver

    started = time.perf_counter()
    if int(err := getattr(driver, name)(pid, None)[0]):
        raise RuntimeError(f"{name}({pid}): {err}")
    return time.perf_counter() - started


def criu_restores(criu: str, root: Path) -> list[dict[str, Any]]:
    """Checkpoint + dump the torch process once; restore it twice eagerly and twice lazily."""
    images, log = root / "images", root / "child.out"
    images.mkdir()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--child", "--wait-signal", *LAZY_FLAGS],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        pid = _lines(log, 1)[0]["ready"]
        call("cuCheckpointProcessLock", pid)
        call("cuCheckpointProcessCheckpoint", pid)
        dump = _run(criu, "dump", "--tree", str(pid), "--images-dir", str(images), "--work-dir", str(root),
                    "--log-file", "dump.log", "-v4")
        proc.wait()  # CRIU killed it; reaped so that its PID is free for the restores
        captured = {"dumped_size": log.stat().st_size, "dump_s": dump,
                    "image_bytes": sum(f.stat().st_size for f in images.iterdir())}
        return [{**captured, **restore_once(criu, images, root / f"restore-{n}", log, captured["dumped_size"], pid,
                                            mode)}
                for n, mode in enumerate(("eager", "lazy", "eager", "lazy"))]
    finally:  # the original process if the dump failed; nothing otherwise (each restore cleans up after itself)
        kill_and_reap([proc.pid])


def restore_once(criu: str, images: Path, work: Path, log: Path, dumped_size: int, pid: int,
                 mode: str) -> dict[str, Any]:
    """One CRIU restore (eager or lazy) + CUDA restore + the first GPU work; the restored process is killed."""
    work.mkdir()
    os.truncate(log, dumped_size)  # CRIU refuses a restore when an open file's size changed
    started = time.perf_counter()  # the lazy daemon's start counts: the worker pays it too
    daemon = None
    try:
        if mode == "lazy":
            daemon = subprocess.Popen([criu, "lazy-pages", "--images-dir", str(images), "--work-dir", str(work),
                                       "--log-file", "lazy.log", "-v4"], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            give_up = time.monotonic() + 10
            while not (work / "lazy-pages.socket").exists():
                if daemon.poll() is not None or time.monotonic() > give_up:
                    raise RuntimeError(f"criu lazy-pages did not listen (exit {daemon.poll()})")
                time.sleep(0.001)
        criu_s = _run(criu, "restore", "--images-dir", str(images), "--work-dir", str(work), "--restore-detached",
                      "--pidfile", str(work / "pid"), "--leave-stopped", "--log-file", "restore.log", "-v4",
                      *(["--lazy-pages"] if daemon else []))
        os.kill(pid, signal.SIGCONT)
        cuda_s = call("cuCheckpointProcessRestore", pid) + call("cuCheckpointProcessUnlock", pid)
        running = time.perf_counter()
        os.kill(pid, signal.SIGUSR1)
        worked = _lines(log, 2)[-1]
        first_work_s = time.perf_counter() - running
        all_pages_s = None
        if daemon:
            daemon.wait(timeout=120)
            all_pages_s = time.perf_counter() - started
    finally:
        if daemon:
            daemon.kill()
            daemon.wait()
        kill_and_reap([pid])
    return {"mode": mode, "criu_restore_s": criu_s, "cuda_restore_s": cuda_s, "first_work_s": first_work_s,
            "until_running_s": running - started, "all_pages_in_s": all_pages_s, "worked": worked}


def checkpoint(pid: int) -> dict[str, Any]:
    before = anonymous_memory(pid)
    lock = call("cuCheckpointProcessLock", pid)
    seconds = call("cuCheckpointProcessCheckpoint", pid)
    after = anonymous_memory(pid)
    restore = call("cuCheckpointProcessRestore", pid)
    unlock = call("cuCheckpointProcessUnlock", pid)
    return {"anonymous_before": before, "anonymous_after": after,
            "device_state_bytes": after["anonymous_bytes"] - before["anonymous_bytes"],
            "lock_s": lock, "checkpoint_s": seconds, "restore_s": restore, "unlock_s": unlock}


def _row(result: dict[str, Any]) -> list[str]:
    if "error" in result:
        return [result["variant"], result["error"], "", "", "", "", "", "", ""]
    mb = 1e6
    return [result["variant"], f"{result['device_used'] / mb:.0f}", f"{result['torch_reserved'] / mb:.0f}",
            f"{result['device_state_bytes'] / mb:.0f}", f"{result['anonymous_before']['anonymous_bytes'] / mb:.0f}",
            f"{result['checkpoint_s']:.2f}", f"{result['restore_s'] + result['unlock_s']:.2f}",
            ", ".join(str(v) for v in result.get("limits_read", {}).values()),
            ", ".join(result.get("limit_refused", {})) or "-"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch", action="store_true")
    parser.add_argument("--stack", type=int, default=0)
    parser.add_argument("--small-limits", action="store_true")
    parser.add_argument("--matmul", action="store_true")
    parser.add_argument("--graph", action="store_true")
    parser.add_argument("--trim", action="store_true")
    parser.add_argument("--pending", type=int, default=0, help="CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT")
    parser.add_argument("--late", action="store_true", help="set the limits after the work, not before")
    parser.add_argument("--set", choices=("anatomy", "limits"), default="anatomy")
    parser.add_argument("--wait-signal", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--criu", default="", help="also time eager vs lazy CRIU restores with this criu")
    parser.add_argument("--root", default="/dev/shm", help="where the CRIU runs' images and logs go")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from cuda.bindings import driver

    driver.cuInit(0)
    results, rows = [], []
    for name, flags, env in LIMIT_VARIANTS if args.set == "limits" else VARIANTS:
        proc = subprocess.Popen([sys.executable, __file__, "--child", *flags], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        assert proc.stdout is not None and proc.stdin is not None
        try:
            ready = json.loads(proc.stdout.readline())
            result = {"variant": name, "flags": flags, "env": env, **ready, **checkpoint(ready["ready"])}
        except (ValueError, RuntimeError, KeyError) as exc:
            result = {"variant": name, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            proc.stdin.close()
            proc.wait(timeout=60)
        results.append(result)
        if args.out:
            Path(args.out, f"checkpoint-{args.set}.json").write_text(json.dumps(results, indent=1))
        rows.append(_row(result))
    print(table(["variant", "device used MB", "torch reserved MB", "checkpoint adds MB (device state)",
                 "own anonymous MB", "checkpoint s", "restore+unlock s", "limits read (stack, heap, fifo, pending)",
                 "refused"], rows))
    if not args.criu:
        return
    become_subreaper()
    restores = criu_restores(args.criu, Path(tempfile.mkdtemp(prefix="coldsnap-anatomy-", dir=args.root)))
    if args.out:
        Path(args.out, "checkpoint-anatomy-criu.json").write_text(json.dumps(restores, indent=1))
    print(table(["CRIU restore", "images GB", "CRIU s", "CUDA restore s", "until running s", "first work s",
                 "all pages in s"],
                [[r["mode"], f"{r['image_bytes'] / 1e9:.2f}", f"{r['criu_restore_s']:.3f}",
                  f"{r['cuda_restore_s']:.3f}", f"{r['until_running_s']:.3f}", f"{r['first_work_s']:.3f}",
                  f"{r['all_pages_in_s']:.3f}" if r["all_pages_in_s"] else "-"] for r in restores]))


if __name__ == "__main__":
    main()

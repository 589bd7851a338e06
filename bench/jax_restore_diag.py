"""Why the driver's CUDA restore of a JAX process fails (issue 36): a matrix of cases, each captured and restored
with everything around the CUDA restore printed (run on the GPU machine: `scripts/device jaxdiag`).

    python bench/jax_restore_diag.py --criu PATH --out DIR [--cases a,b,...] [--budget 280]

A case is a program (engines/jax_server.py, or a minimal JAX or torch program: `MINIMAL`), its environment
(the interposer or not, XLA's allocator) and a path:
  toggle   the CUDA checkpoint and restore in place (lock, checkpoint, restore, unlock): no CRIU at all;
  worker   `python -m coldsnap_probe capture` and `restore`, as the product runs them;
  manual   the worker's capture, then the restore by hand, as the worker does it (CRIU --leave-stopped, SIGCONT,
           GetState, Restore, Unlock), every driver answer and the restore thread's state recorded, GetState
           retried over 3 s should it fail (does it settle?);
  frozen   manual, but every thread of the restored process held in a ptrace stop but the driver's restore thread
           until the CUDA restore and unlock are done (as CRIU's own CUDA plugin resumes only that thread).
CRIU runs through a hook (this script as `criu`): before the dump (the process is checkpointed) and after the
restore (stopped, before any CUDA restore) it records the tree's /proc maps, threads and descriptors. Per case:
the worker's error lines, dmesg after a marker, the restored process's end (this is a subreaper: a crash is seen
with its signal), the maps diffed (live -> checkpointed -> CRIU-restored) around the NVIDIA/UVM and large
reserved ranges, the thread counts, and whether the program answers as before the capture.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._process_view import (
    Log,
    dmesg_since,
    kill_tree,
    kmsg_mark,
    latest,
    maps_report,
    proc_text,
    reap,
    snapshot,
    threads_report,
    tree,
)
from coldsnap_probe import ThreadHold

# A minimal JAX (or torch) program: MIB of device memory, one jitted reduction answered per line on a Unix socket.
MINIMAL = {
    "jax": """
import json, os, socket, sys
import jax, jax.numpy as jnp
x = jnp.arange(int(sys.argv[2]) << 18, dtype=jnp.float32) * 1e-6
f = jax.jit(lambda a, k: (a * k).sum())
server = socket.socket(socket.AF_UNIX); server.bind(sys.argv[1]); server.listen()
print(json.dumps({"ready": os.getpid(), "devices": str(jax.devices())}), flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(f"{float(f(x, 3.0)):.6f}\\n".encode()); conn.close()
""",
    "torch": """
import json, os, socket, sys
import torch
x = torch.arange(int(sys.argv[2]) << 18, dtype=torch.float32, device="cuda") * 1e-6
server = socket.socket(socket.AF_UNIX); server.bind(sys.argv[1]); server.listen()
print(json.dumps({"ready": os.getpid(), "devices": torch.cuda.get_device_name()}), flush=True)
while True:
    conn, _ = server.accept()
    conn.sendall(f"{float((x * 3.0).sum()):.6f}\\n".encode()); conn.close()
""",
}


@dataclass(frozen=True)
class Case:
    program: str  # server | jax | torch
    path: str  # toggle | worker | manual
    mib: int = 256  # minimal programs: MiB of device memory; the server: GiB * 1024
    interposer: bool = False
    env: dict[str, str] = field(default_factory=dict)
    settle_s: float = 0.0  # wait after the capture's kill before the restore (the old process's teardown)
    delay_s: float = 0.0  # manual, frozen: the process runs (or its restore thread alone) this long before the driver


PREALLOC_OFF = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
CASES = {
    "torch-manual": Case("torch", "manual", 512),
    "jax-toggle": Case("jax", "toggle", 256, env=PREALLOC_OFF),
    "jax-manual": Case("jax", "manual", 256, env=PREALLOC_OFF),
    "jax-worker": Case("jax", "worker", 256, env=PREALLOC_OFF),
    "jax-platform-manual": Case("jax", "manual", 256, env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}),
    "jax-async-manual": Case("jax", "manual", 256, env={"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}),
    "jax-frac-manual": Case("jax", "manual", 256, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": ".02"}),
    "server-toggle": Case("server", "toggle", 1024, env=PREALLOC_OFF),
    "server-manual": Case("server", "manual", 1024, env=PREALLOC_OFF),
    "server-manual-settle": Case("server", "manual", 1024, env=PREALLOC_OFF, settle_s=5.0),
    "server-worker": Case("server", "worker", 1024, env=PREALLOC_OFF),
    "server-interposer-worker": Case("server", "worker", 1024, interposer=True, env=PREALLOC_OFF),
    "server-interposer-manual": Case("server", "manual", 1024, interposer=True, env=PREALLOC_OFF),
    "server16-interposer-manual": Case("server", "manual", 16384, interposer=True, env=PREALLOC_OFF),
    "torch-frozen": Case("torch", "frozen", 512),
    "jax-frozen": Case("jax", "frozen", 256, env=PREALLOC_OFF),
    "server-frozen": Case("server", "frozen", 1024, env=PREALLOC_OFF),
    "server16-interposer-frozen": Case("server", "frozen", 16384, interposer=True, env=PREALLOC_OFF),
    "server16-interposer-worker": Case("server", "worker", 16384, interposer=True, env=PREALLOC_OFF),
    # The race made wide: 2 s between letting the process run and the driver's restore.
    "server-manual-delay": Case("server", "manual", 1024, env=PREALLOC_OFF, delay_s=2.0),
    "server-frozen-delay": Case("server", "frozen", 1024, env=PREALLOC_OFF, delay_s=2.0),
    "jax-manual-delay": Case("jax", "manual", 256, env=PREALLOC_OFF, delay_s=2.0),
    "torch-manual-delay": Case("torch", "manual", 512, delay_s=2.0),
}
# The most telling first: whatever the budget cuts is at the end.
DEFAULT = ("torch-manual,jax-manual,server-manual,server-frozen,server-worker,jax-frozen,torch-frozen,server-toggle,"
           "server16-interposer-frozen,server-interposer-worker,server16-interposer-manual,jax-toggle,"
           "server-manual-settle,jax-platform-manual,jax-async-manual")


# -- the driver, called directly (every answer recorded) ----------------------------------------------------------
class Checkpoint:
    """cuCheckpointProcess* through cuda-python; each call's answer and time kept in `calls`."""

    STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}

    def __init__(self, log: Log) -> None:
        from cuda.bindings import driver

        self.cu, self.log = driver, log
        self.calls: list[str] = []
        self.call("cuInit", 0)

    def call(self, name: str, *args: Any) -> tuple[str, Any]:
        started = time.monotonic()
        result = getattr(self.cu, name)(*args)
        err, outputs = result[0], result[1:]
        code = "CUDA_SUCCESS" if int(err) == 0 else self.cu.cuGetErrorName(err)[1].decode()
        value = outputs[0] if outputs else None
        if name == "cuCheckpointProcessGetState" and int(err) == 0:
            value = self.STATES.get(int(value or 0), f"unknown-{value}")
        text = f"{name}{args[:1]} -> {code} {value if value is not None else ''} ({time.monotonic() - started:.3f} s)"
        self.calls.append(text)
        self.log(f"     driver: {text}")
        return code, value

    def state(self, pid: int) -> str:
        code, value = self.call("cuCheckpointProcessGetState", pid)
        return str(value) if code == "CUDA_SUCCESS" else code

    def lock(self, pid: int) -> str:
        args = self.cu.CUcheckpointLockArgs()
        args.timeoutMs = 30_000
        return self.call("cuCheckpointProcessLock", pid, args)[0]


# -- CRIU through a hook: the tree seen before the dump and after the restore ---------------------------------------
def hook(real: str, where: Path, args: list[str]) -> int:
    """Run as `criu` by the worker: snapshot the checkpointed tree before `dump`, the stopped restored tree after
    `restore`, and otherwise only pass through."""
    if args[:1] == ["dump"] and "--tree" in args:
        for pid in tree(int(args[args.index("--tree") + 1])):
            snapshot(pid, "checkpointed", where)
    done = subprocess.run([real, *args], check=False)
    if args[:1] == ["restore"] and done.returncode == 0 and "--pidfile" in args:
        root = int(Path(args[args.index("--pidfile") + 1]).read_text().split()[0])
        for pid in tree(root):
            snapshot(pid, "criu-restored", where)
    return done.returncode


def write_hook(work: Path, real: str, where: Path) -> Path:
    path = work / "bin" / "criu"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} hook --real {real} "
                    f"--dir {where} -- \"$@\"\n")
    path.chmod(0o755)
    return path


# -- the programs ------------------------------------------------------------------------------------------------------
class Program:
    """A case's program, started in its own session, its output in a file (CRIU restores it with the process)."""

    PROMPT = [1, 15, 29, 92, 52]

    def __init__(self, case: Case, work: Path, library: Path | None) -> None:
        self.case, self.socket, self.log = case, work / "program.sock", work / "program.log"
        if case.program == "server":
            command = [sys.executable, str(ROOT / "engines" / "jax_server.py"), "--gib", f"{case.mib / 1024:g}",
                       "--weights", "device", "--socket", str(self.socket)]
        else:
            source = work / f"minimal_{case.program}.py"
            source.write_text(MINIMAL[case.program])
            command = [sys.executable, str(source), str(self.socket), str(case.mib)]
        env = {**os.environ, **case.env}
        if case.interposer and library is not None:
            env.update(LD_PRELOAD=str(library), COLDSNAP_CUDA_INTERPOSER_SOCKET=str(work / "cuda-%p.sock"))
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=out, start_new_session=True)

    def wait_ready(self, timeout: float = 150.0) -> float:
        started = time.monotonic()
        marker = '"stage": "ready"' if self.case.program == "server" else '{"ready"'
        while marker not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError(f"program not ready (exit {self.proc.poll()}): "
                                   f"{self.log.read_text(errors='replace')[-1500:]}")
            time.sleep(0.05)
        return time.monotonic() - started

    def ask(self, timeout: float = 30.0) -> str:
        give_up = time.monotonic() + timeout
        while True:
            conn = socket.socket(socket.AF_UNIX)
            conn.settimeout(max(1.0, give_up - time.monotonic()))
            try:
                conn.connect(str(self.socket))
                break
            except OSError:
                conn.close()
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.05)
        with conn, conn.makefile("rwb") as stream:
            if self.case.program == "server":
                stream.write(json.dumps({"prompt": self.PROMPT, "max_tokens": 8}).encode() + b"\n")
                stream.flush()
            return stream.read().decode(errors="replace").strip().replace("\n", " ")[-300:]


def worker(*args: str) -> tuple[int, dict[str, Any] | None, str]:
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=240)
    try:
        report = json.loads(done.stdout) if done.stdout.strip() else None
    except ValueError:
        report = None
    return done.returncode, report, done.stderr


def gpu_processes() -> str:
    done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip().replace("\n", "; ") or "none"



# -- one case ------------------------------------------------------------------------------------------------------
def capture_report(report: dict[str, Any] | None, log: Log) -> None:
    if not report:
        return
    for device in report.get("device_memory") or []:
        log(f"   capture device_memory: state {device.get('state')}, {device.get('bytes', 0) / 1e9:.2f} GB moved, "
            f"moved {device.get('moved')}, uncovered {device.get('uncovered')}")
    log(f"   capture timings {report.get('timings_s')}; cuda_pids {report.get('cuda_pids')}")
    for label in ("memory_before_checkpoint", "memory_after_checkpoint"):
        for pid, memory in (report.get(label) or {}).items():
            log(f"   {label} {pid}: {memory.get('anonymous_bytes', 0) / 1e9:.2f} GB anonymous, largest "
                f"{[(size >> 20, name) for size, name in memory.get('largest', [])[:3]]} MiB")


def error_lines(stderr: str) -> str:
    return "\n".join(f"     | {line}" for line in stderr.strip().splitlines()[-14:])


def toggle(program: Program, log: Log) -> str:
    """The CUDA checkpoint and restore in place: no CRIU."""
    pid = program.proc.pid
    driver = Checkpoint(log)
    driver.lock(pid)
    driver.call("cuCheckpointProcessCheckpoint", pid, None)
    driver.state(pid)
    snapshot(pid, "checkpointed", program.log.parent / "snaps")
    code, _ = driver.call("cuCheckpointProcessRestore", pid, None)
    driver.state(pid)
    driver.call("cuCheckpointProcessUnlock", pid, None)
    return "restored" if driver.state(pid) == "running" and code == "CUDA_SUCCESS" else "FAILED"


def criu_restore(images: Path, work: Path, criu: str, log: Log) -> int | None:
    """CRIU's restore as the worker runs it (detached, left stopped): the restored root, or None."""
    pidfile = work / "restored.pid"
    pidfile.unlink(missing_ok=True)
    started = time.monotonic()
    done = subprocess.run([criu, "restore", "--images-dir", str(images), "--work-dir", str(work),
                           "--restore-detached", "--pidfile", str(pidfile), "--leave-stopped",
                           "--log-file", str(work / "restore.log"), "-v4"], capture_output=True, text=True,
                          check=False)
    log(f"   criu restore exit {done.returncode} in {time.monotonic() - started:.2f} s "
        f"{done.stderr.strip()[-300:]}")
    return int(pidfile.read_text().split()[0]) if done.returncode == 0 else None


def driver_restore(driver: Checkpoint, root: int, case: Case, snaps: Path, log: Log) -> str:
    """GetState (retried over 3 s should it fail: does it settle?), the restore thread's state, Restore, Unlock."""
    continued = time.monotonic()
    if case.delay_s:
        time.sleep(case.delay_s)
        log(f"     (+{case.delay_s:g} s before the driver: root {reap(root)})")
    state = driver.state(root)
    retries = 0
    while state not in ("running", "locked", "checkpointed") and time.monotonic() - continued < 3.0:
        log(f"     (+{time.monotonic() - continued:.2f} s after SIGCONT: root {reap(root)})")
        time.sleep(0.25 * 2 ** min(retries, 2))
        retries += 1
        state = driver.state(root)
    code, tid = driver.call("cuCheckpointProcessGetRestoreThreadId", root)
    if code == "CUDA_SUCCESS":
        where = f"/proc/{root}/task/{tid}"
        log(f"     restore thread {tid}: {proc_text(where + '/comm').strip()} "
            f"state {proc_text(where + '/stat').rpartition(')')[2][:2].strip()} wchan {proc_text(where + '/wchan')}"
            f" stack {proc_text(where + '/stack').strip().splitlines()[:5]}")
    if state != "checkpointed":
        log(f"   root {root} {reap(root)}; its threads now: "
            f"{len(os.listdir(f'/proc/{root}/task')) if os.path.isdir(f'/proc/{root}/task') else 0}")
        threads_report(snapshot(root, "after-failed-getstate", snaps) if os.path.isdir(f"/proc/{root}") else None,
                       log)
        return f"FAILED at GetState: {state}"
    code, _ = driver.call("cuCheckpointProcessRestore", root, None)
    after = driver.state(root)
    if code != "CUDA_SUCCESS" or after != "locked":
        log(f"   root {root} {reap(root)}")
        return f"FAILED at Restore: {code}, then {after}"
    driver.call("cuCheckpointProcessUnlock", root, None)
    final = driver.state(root)
    return "restored" if final == "running" else f"FAILED at Unlock: {final}"


def manual_restore(case: Case, images: Path, work: Path, criu: str, log: Log) -> tuple[str, int | None]:
    """The restore by hand: `manual` as the worker did before issue 36's fix (SIGCONT, then the driver), `frozen`
    as it does now (only the driver's restore thread runs until the CUDA restore and unlock are done)."""
    driver = Checkpoint(log)
    root = criu_restore(images, work, criu, log)
    if root is None:
        return "CRIU FAILED", None
    snaps = work / "snaps"
    restored = {pid: snapshot(pid, "criu-restored", snaps) for pid in tree(root)}
    if case.path == "frozen":
        with ThreadHold(root) as hold:
            code, tid = driver.call("cuCheckpointProcessGetRestoreThreadId", root)
            log(f"     {len(hold.threads)} threads held; restore thread {tid} ({code})")
            hold.run_only(int(tid))
            outcome = driver_restore(driver, root, case, snaps, log)
    else:
        os.killpg(root, signal.SIGCONT)
        outcome = driver_restore(driver, root, case, snaps, log)
    if outcome == "restored":
        os.killpg(root, signal.SIGCONT)  # (frozen: the group stop CRIU left ends for every thread at once)
        maps_report(restored.get(root), snapshot(root, "cuda-restored", snaps), log)
    return outcome, root


def capture_and_restore(case: Case, program: Program, images: Path, criu: str, log: Log,
                        result: dict[str, Any]) -> int | None:
    """The worker's capture (CRIU through the hook), then the case's restore; the restored root."""
    pid, work = program.proc.pid, program.log.parent
    snaps, hooked = work / "snaps", write_hook(work, criu, work / "snaps")
    rc, report, stderr = worker("capture", "--pid", str(pid), "--images", str(images), "--criu", str(hooked))
    capture_report(report, log)
    if rc != 0:
        log(f"   capture FAILED (exit {rc}):\n{error_lines(stderr)}")
        result["outcome"] = "capture FAILED"
        return None
    killed = time.monotonic()
    program.proc.wait()
    log(f"   captured; the original ended {program.proc.returncode} after {time.monotonic() - killed:.2f} s;"
        f" GPU processes now: {gpu_processes()}")
    if case.settle_s:
        time.sleep(case.settle_s)
        log(f"   after {case.settle_s:g} s more, GPU processes: {gpu_processes()}")
    program.socket.unlink(missing_ok=True)
    threads_report(latest(snaps, "checkpointed", pid), log)
    maps_report(latest(snaps, "live", pid), latest(snaps, "checkpointed", pid), log)
    root: int | None = None
    if case.path == "worker":
        rc, report, stderr = worker("restore", "--images", str(images), "--criu", str(hooked),
                                    "--work-dir", str(work / "restore"))
        root = (report or {}).get("restored_pid")
        result["outcome"] = "restored" if rc == 0 else "FAILED"
        result["restore_s"] = {k: (report or {}).get(k) for k in ("criu_restore_seconds", "cuda_restore_seconds")}
        log(f"   worker restore: {result['restore_s']}, timeline {(report or {}).get('timeline')}")
        if rc != 0:
            log(f"   worker restore FAILED (exit {rc}):\n{error_lines(stderr)}")
            log(f"   the restored root {pid}: {reap(pid)}")
    else:
        result["outcome"], root = manual_restore(case, images, work, criu, log)
    threads_report(latest(snaps, "criu-restored", pid), log)
    maps_report(latest(snaps, "checkpointed", pid), latest(snaps, "criu-restored", pid), log)
    return root


def close_case(name: str, result: dict[str, Any], work: Path, log: Log) -> None:
    """The kernel's log since the case began, CRIU's errors on a failure, the case's line."""
    kernel = dmesg_since(f"{name} begin")
    log(f"   dmesg since the case began ({len(kernel)} lines):")
    for line in kernel[-40:]:
        log(f"     k| {line}")
    restore_log = work / "restore.log"
    if result.get("outcome") != "restored" and restore_log.exists():
        text = restore_log.read_text(errors="replace").splitlines()
        picked = [line for line in text if "Error" in line or "plugin" in line.lower()]
        log("   criu restore.log: " + " / ".join(picked)[:800])
    log(f"== {name}: {result.get('outcome')} in {result['seconds']} s; same answer: {result.get('same_answer')}"
        f" (cold {str(result.get('cold'))[:80]!r})")


def run_case(name: str, case: Case, base: Path, criu: str, library: Path | None, log: Log) -> dict[str, Any]:
    work = base / name
    work.mkdir(parents=True)
    snaps, images = work / "snaps", Path("/dev/shm") / f"jaxdiag-{name}"
    subprocess.run(["rm", "-rf", str(images)], check=False)
    kmsg_mark(f"{name} begin")
    result: dict[str, Any] = {"case": name, "spec": case.__dict__}
    t0 = time.monotonic()
    program = Program(case, work, library)
    root: int | None = None
    try:
        result["ready_s"] = round(program.wait_ready(), 2)
        result["cold"] = cold = program.ask()
        pid = program.proc.pid
        live = snapshot(pid, "live", snaps)
        log(f"   tree: {[(p, proc_text(f'/proc/{p}/cmdline').replace(chr(0), ' ')[:80]) for p in tree(pid)]}")
        threads_report(live, log)
        if case.path == "toggle":
            result["outcome"], root = toggle(program, log), pid
            maps_report(live, latest(snaps, "checkpointed", pid), log)
        else:
            root = capture_and_restore(case, program, images, criu, log, result)
        # (an interposer's memory is hydrated by the worker only: by hand its gate stays closed)
        if result.get("outcome") == "restored" and not (case.interposer and case.path in ("manual", "frozen")):
            result["after"] = after = program.ask()
            result["same_answer"] = after == cold
    except Exception as exc:  # one case's failure is a finding: the matrix goes on
        result["outcome"] = result.get("outcome", "ERROR") + f" ({type(exc).__name__}: {str(exc)[-400:]})"
    finally:
        kill_tree(root or program.proc.pid)
        kill_tree(program.proc.pid)
        subprocess.run(["rm", "-rf", str(images)], check=False)
        result["seconds"] = round(time.monotonic() - t0, 1)
        close_case(name, result, work, log)
    return result


def host(log: Log) -> None:
    for command in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv,noheader"],
                    [sys.executable, "-c", "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, "
                                           "jax.devices())"],
                    [sys.executable, "-m", "pip", "list", "2>/dev/null"], ["uname", "-r"]):
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
        lines = done.stdout.strip().splitlines()
        if command[1:2] == ["-m"]:
            lines = [line for line in lines if any(w in line.lower() for w in ("jax", "cuda", "nvidia", "torch"))]
        log("host: " + " | ".join(lines[-12:]) + (f" [{done.stderr.strip()[-200:]}]" if done.returncode else ""))
    for where in ("/usr/lib/criu", f"{os.environ.get('CRIU_ROOT', '')}/usr/lib/criu"):
        log(f"host: CRIU plugins in {where}: {os.listdir(where) if os.path.isdir(where) else 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    hooked = sub.add_parser("hook")
    hooked.add_argument("--real", required=True)
    hooked.add_argument("--dir", required=True, type=Path)
    hooked.add_argument("args", nargs=argparse.REMAINDER)
    parser.add_argument("--criu", default="criu")
    parser.add_argument("--out", type=Path, default=Path("jaxdiag-out"))
    parser.add_argument("--cases", default=DEFAULT)
    parser.add_argument("--budget", type=float, default=280.0, help="no case starts after this many seconds")
    parser.add_argument("--repeat", type=int, default=1, help="run each case this many times (does it flip?)")
    args = parser.parse_args()
    if args.command == "hook":
        sys.exit(hook(args.real, args.dir, args.args[1:] if args.args[:1] == ["--"] else args.args))
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "jaxdiag.txt")
    ctypes.CDLL(None).prctl(36, 1)  # a subreaper: restored trees are reparented here (their end is seen)
    host(log)
    library = None
    if any(CASES[n].interposer for n in names):
        from coldsnap_probe.hydration import build_library

        library, _ = build_library(args.out / "work" / "lib")
    results = []
    for name, run in ((n, r) for n in names for r in range(1, args.repeat + 1)):
        label = f"{name}-{run}" if args.repeat > 1 else name
        if time.monotonic() - started > args.budget:
            log(f"== {label}: skipped (past the {args.budget:g} s budget)")
            continue
        log(f"== {label} ({CASES[name]}) at {time.monotonic() - started:.0f} s")
        results.append(run_case(label, CASES[name], args.out / "work", args.criu, library, log))
    log("\n| case | outcome | same answer | s |\n| --- | --- | --- | --- |")
    for result in results:
        log(f"| {result['case']} | {result.get('outcome')} | {result.get('same_answer')} | {result['seconds']} |")
    (args.out / "jaxdiag.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

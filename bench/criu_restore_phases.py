"""Where CRIU's restore of an engine-shaped process spends its time, phase by phase, and what the cuts save.

    python bench/criu_restore_phases.py --criu DIR/usr/sbin/criu [--rounds 5] [--threads 100] [--anon-mib 680]
                                        [--heap-mib 460] [--libs 300] [--before-criu PATH] [--out DIR]

`bench/engine_shape_target.py` (an idle engine's shape on a CPU: threads, shared libraries, private memory, a
listening socket, epoll, an eventfd, a memfd) is dumped to tmpfs with the capture's options (`dump --tree
--leave-stopped`), then restored `--rounds` times per variant, the variants taking turns, each with the restore
worker's options (`restore --restore-detached --pidfile --leave-stopped --log-file -v4`, CRIU_RESTORE_THREADS
unset). Each phase comes from CRIU's own log (its timestamps): kernel probe and set-up (to `Reading image tree`),
images and fork (to `Forking task`), premap (to the page fill's start), the fill (its own line), files, sockets
and the rest of the task's state (to `Switched to the restorer`), the restorer blob (VMA moves, threads, to `Unlock
network`), seizing and stopping every thread (to `Restore finished`), and CRIU's exit (the wall clock's rest).
Variants: `no kdat cache` (a capsule before this change: its /run is not a tmpfs, and a new container's is empty),
`kdat cached` (CRIU_KDAT_CACHE naming the file that a `criu check` wrote first, as the restore worker now does while
it imports: that probe's own seconds are in `probe ms`), the same with `-v2` instead of `-v4`, and with
`--before-criu` another build (e.g. one without thread-stops.patch) restoring the same images, kdat cached. Each
restored tree is let go and must answer on its socket before it is killed. `CRIU CPU`: CRIU's own user and system
time (not the restored tree's, which fills its own pages).
Medians in milliseconds; a table on stdout, JSON in --out. Run as root, with the CRIU of `scripts/criu/build`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table, wait_file
from coldsnap_probe import restore_phases

# CRIU's restore phases as the worker reports them (`coldsnap_probe.restore_phases`), then CRIU's exit.
PHASES = ("probe_setup_s", "images_fork_s", "premap_s", "fill_s", "files_state_s", "restorer_s", "seize_stop_s",
          "exit_s")


def criu_env(criu: Path, extra: dict[str, str]) -> dict[str, str]:
    libs = criu.resolve().parent.parent / "lib/x86_64-linux-gnu"
    env = {k: v for k, v in os.environ.items() if k not in ("CRIU_RESTORE_THREADS", "CRIU_KDAT_CACHE")}
    return {**env, "LD_LIBRARY_PATH": str(libs), **extra}


def dumped(criu: Path, args: argparse.Namespace, work: Path, images: Path) -> dict[str, Any]:
    """The target started, dumped with the capture's options and killed; its shape."""
    control = work / "target"
    control.mkdir(parents=True)
    target = subprocess.Popen([sys.executable, str(Path(__file__).parent / "engine_shape_target.py"),
                               "--dir", str(control), "--threads", str(args.threads), "--anon-mib",
                               str(args.anon_mib), "--heap-mib", str(args.heap_mib), "--libs", str(args.libs)],
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_file(control / "ready", 300)
        shape = json.loads((control / "shape.json").read_text())
        started = time.perf_counter()
        done = subprocess.run([str(criu), "dump", "--tree", str(target.pid), "--images-dir", str(images),
                               "--work-dir", str(work), "--leave-stopped", "--log-file", str(work / "dump.log"),
                               "-v4"], env=criu_env(criu, {}), capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"criu dump exited {done.returncode}: {(work / 'dump.log').read_text()[-2000:]}")
        shape["dump_s"] = time.perf_counter() - started
    finally:
        target.kill()
        target.wait()
    shape["image_bytes"] = sum(p.stat().st_size for p in images.iterdir() if p.is_file())
    return shape


def serves(pid: int, port: int) -> None:
    """The restored tree, let go, answers on its listening socket (it accepts and closes)."""
    os.kill(pid, signal.SIGCONT)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.settimeout(10)
        if conn.recv(1) != b"":
            raise RuntimeError(f"the restored process {pid} answered unexpectedly")


def restore(criu: Path, images: Path, work: Path, env: dict[str, str], verbosity: str, port: int) -> dict[str, float]:
    """One restore with the worker's options; its phases (seconds), the restored tree checked and killed."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    pidfile, log = work / "restored.pid", work / "restore.log"
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([str(criu), "restore", "--images-dir", str(images), "--work-dir", str(work),
                           "--restore-detached", "--pidfile", str(pidfile), "--leave-stopped",
                           "--log-file", str(log), verbosity], env=criu_env(criu, env), capture_output=True,
                          text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # CRIU's own CPU (and its helpers'), not the tree's
    cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
    text = log.read_text()
    if done.returncode:
        raise RuntimeError(f"criu restore exited {done.returncode}: {text[-2000:]}")
    pid = int(pidfile.read_text())
    threads = len(os.listdir(f"/proc/{pid}/task"))
    serves(pid, port)
    os.kill(pid, signal.SIGKILL)
    while True:  # this process is the subreaper: the PIDs are free for the next restore once it is reaped
        try:
            if os.waitpid(pid, 0)[0] == pid:
                break
        except ChildProcessError:
            break
    phases = restore_phases(text.encode()) if verbosity == "-v4" else {}
    if "logged_s" in phases:
        phases["exit_s"] = wall - phases.pop("logged_s")
    return {"wall": wall, "criu_cpu": cpu, "threads": threads, **phases}


def probe(criu: Path, cache: Path) -> float:
    """`criu check` writing the kernel-feature cache, as the restore worker starts it; its seconds."""
    cache.unlink(missing_ok=True)
    started = time.perf_counter()
    subprocess.run([str(criu), "check", "--feature", "pagemap_scan"], capture_output=True, check=False,
                   env=criu_env(criu, {"CRIU_KDAT_CACHE": str(cache)}))
    seconds = time.perf_counter() - started
    if not cache.exists():
        raise RuntimeError(f"criu check wrote no {cache}: is this CRIU built with kdat-cache.patch?")
    return seconds


def report(rows: dict[str, list[dict[str, float]]], probes: list[float], shape: dict[str, Any]) -> str:
    lines = []
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) * 1e3 for k in runs[0] if k != "threads"}
        cells = [f"{med[p]:.1f}" if p in med else "-" for p in PHASES]
        less_fill = f"{med['wall'] - med['fill_s']:.1f}" if "fill_s" in med else "-"
        lines.append([name, f"{med['wall']:.1f}", f"{med['criu_cpu']:.1f}", less_fill,
                      *cells, f"{statistics.median(probes) * 1e3:.1f}" if "cached" in name else "-"])
    head = (f"target: {shape['threads']} threads, {shape['mappings']} mappings ({shape['libraries']} libraries "
            f"loaded), {shape['image_bytes'] / 1e9:.2f} GB of images; {len(next(iter(rows.values())))} restores "
            "a variant, medians in ms")
    return head + "\n" + table(["variant", "wall", "CRIU CPU", "wall - fill", *(p.removesuffix("_s") for p in PHASES),
                                 "probe ms"], lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--criu", required=True, help="scripts/criu/build's usr/sbin/criu (libraries beside it)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=100)
    parser.add_argument("--anon-mib", type=int, default=680)
    parser.add_argument("--heap-mib", type=int, default=460)
    parser.add_argument("--libs", type=int, default=300)
    parser.add_argument("--before-criu", default="", help="another build, restored side by side (kdat cached)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the restored trees are reaped here
    criu = Path(args.criu)
    work = Path("/tmp") / f"coldsnap-criu-phases-{os.getpid()}"
    images = Path("/dev/shm") / f"coldsnap-criu-phases-{os.getpid()}"
    images.mkdir()
    try:
        shape = dumped(criu, args, work, images)
        cache = work / "kdat" / "criu.kdat"
        cache.parent.mkdir()
        absent, cached = {"CRIU_KDAT_CACHE": str(work / "absent" / "criu.kdat")}, {"CRIU_KDAT_CACHE": str(cache)}
        variants = {"no kdat cache": (criu, absent, "-v4"), "kdat cached": (criu, cached, "-v4"),
                    "kdat cached, -v2": (criu, cached, "-v2")}
        before = work / "kdat" / "before.kdat"  # a cache is valid only for the build that wrote it (CRIU's magic)
        if args.before_criu:
            variants["kdat cached, --before-criu"] = (Path(args.before_criu), {"CRIU_KDAT_CACHE": str(before)}, "-v4")
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        probes: list[float] = []
        for _ in range(args.rounds):
            probes.append(probe(criu, cache))
            if args.before_criu:
                probe(Path(args.before_criu), before)
            for name, (build, env, verbosity) in variants.items():
                rows[name].append(restore(build, images, work / "restore", env, verbosity, shape["port"]))
        text = report(rows, probes, shape)
    finally:
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print(text)
    if args.out:
        Path(args.out, "criu_restore_phases.json").write_text(
            json.dumps({"shape": shape, "probe_s": probes, "rows": rows}, indent=1))
        Path(args.out, "criu_restore_phases.md").write_text(text + "\n")


if __name__ == "__main__":
    main()

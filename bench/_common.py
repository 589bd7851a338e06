"""Shared bench helpers: percentiles, a table printer, and the real daemon (bench/_daemon.py)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._daemon import Daemon, Session, running_daemon
from bench.engine_rows import coverage

__all__ = ("Daemon", "Session", "become_subreaper", "free_port", "kill_and_reap", "mode_list", "percentile",
           "process_stats", "running_daemon", "stages", "summary", "table", "wait_file")


def mode_list(text: str, known: Sequence[str]) -> list[str]:
    """A run's modes, in order, from a comma list; each must be one of `known`, named once."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes:
        raise ValueError(f"no mode named: give a comma list of {', '.join(known)}")
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise ValueError(f"unknown mode {', '.join(unknown)}: the modes are {', '.join(known)}")
    twice = sorted({m for m in modes if modes.count(m) > 1})
    if twice:
        raise ValueError(f"mode {', '.join(twice)} named twice: each mode runs once per run")
    return modes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(samples: Sequence[float]) -> dict[str, float]:
    """p50/p99/mean in milliseconds."""
    return {"p50": percentile(samples, 50) * 1000, "p99": percentile(samples, 99) * 1000,
            "mean": statistics.fmean(samples) * 1000}


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table (printed, and pasted into bench/README.md)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(headers), "| " + " | ".join("-" * w for w in widths) + " |", *map(line, cells)])


def process_stats(pid: int) -> tuple[int, int]:
    """(open file descriptors, RSS in KiB) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    return fds, rss


def stages(log: Path) -> dict[str, dict[str, Any]]:
    """An engine's stage lines (JSON, one per line) by name, first occurrence; {} while there is no log."""
    marks: dict[str, dict[str, Any]] = {}
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return marks
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        marks.setdefault(entry["stage"], entry)
    return marks


def wait_file(path: Path, timeout: float = 60.0) -> str:
    """`path`'s text once it exists (a target's control file); TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    return path.read_text()


def become_subreaper() -> None:
    """Restored trees (CRIU --restore-detached) are reparented to this process, which must reap them."""
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER


def kill_and_reap(pids: Sequence[int]) -> None:
    """SIGKILL each process group and reap the leaders, so that their PIDs are free for the next restore."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    pending = set(pids)
    while pending:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        pending.discard(pid)


def drop_caches() -> bool:
    """Write back and drop the page cache (root only): False when it could not."""
    if os.geteuid() != 0:
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def disk_read_rate(path: Path, limit: int = 2 << 30) -> float:
    """Sequential read rate (bytes/s) of `path` after dropping the caches (up to `limit` bytes)."""
    buf = bytearray(16 << 20)
    got = 0
    started = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while got < limit and (n := f.readinto(buf)):
            got += n
    return got / (time.perf_counter() - started)


def criu_environment(criu: str, **extra: str) -> dict[str, str]:
    """This environment for `criu` kept with its own libraries (scripts/criu/build's directory), plus `extra`."""
    return {**os.environ, "LD_LIBRARY_PATH": str(Path(criu).resolve().parent.parent / "lib/x86_64-linux-gnu"),
            **extra}


def run_criu(criu: str, args: Sequence[str], log: Path, env: Mapping[str, str], verbosity: str = "-v4") -> float:
    """`criu ARGS` logging to `log` at `verbosity`, in `env`: its seconds; RuntimeError with the log's tail."""
    started = time.perf_counter()
    done = subprocess.run([criu, *args, "--log-file", str(log), verbosity], capture_output=True, text=True,
                          check=False, env=env)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"criu {args[0]} exited {done.returncode}: {log.read_text()[-800:]}")
    return seconds


def criu_zero_pages(images: Path) -> tuple[int, int]:
    """Bytes of a CRIU image set's pages images (`pages-*.img`) and how many of them are 4 KiB pages of zeros
    (stock CRIU writes pages that were written with zeros; third_party/criu/zero-pages.patch leaves out those of
    private anonymous memory, so what is left here is file-backed private pages and shared memory)."""
    size = zeros = 0
    empty = bytes(4096)
    for path in images.glob("pages-*.img"):
        with path.open("rb", buffering=0) as f:
            while block := f.read(16 << 20):
                size += len(block)
                view = memoryview(block)
                zeros += 4096 * sum(view[at:at + 4096] == empty for at in range(0, len(block) - 4095, 4096))
    return size, zeros


def line_rate(devices: list[dict[str, Any]] | None) -> str:
    """What the capture moved at line rate, as a share of the device bytes the interposer saw, and the largest kind
    left on the CUDA checkpoint path ("-" without the interposer): bench/engine_rows.py's `coverage` in one cell."""
    seen = coverage(devices)
    left: dict[str, int] = seen["left_bytes"]
    if not seen["moved_bytes"] and not left:
        return "-"
    top = max(left, key=lambda k: left[k]) if left else ""
    return f"{seen['moved_share']:.1%}" + (f" ({top} {left[top] / 1e6:.0f} MB left)" if top else "")

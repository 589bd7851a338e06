"""What a process looks like from outside, for the diagnoses (bench/jax_restore_diag.py): its tree, /proc maps,
threads and descriptors as snapshots, the maps of two snapshots compared around the NVIDIA/UVM and large ranges,
the kernel's log after a marker, and the end of a restored process this one is the subreaper of."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

NOTABLE = ("nvidia", "uvm", "nvidiactl", "libcuda", "cuda")
BIG = 1 << 30  # a mapping this large is listed whatever its name (XLA's reserved VA, the checkpoint's copies)


class Log:
    def __init__(self, path: Path) -> None:
        self.file = open(path, "a")  # noqa: SIM115

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()


# -- what a process looks like from outside ------------------------------------------------------------------------
def proc_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError as exc:
        return f"<{exc.strerror}>"


def tree(root: int) -> list[int]:
    order, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        order.append(pid)
        for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            queue += [int(c) for c in proc_text(f"/proc/{pid}/task/{task}/children").split() if c.isdigit()]
    return order


def snapshot(pid: int, label: str, where: Path) -> dict[str, Any]:
    """The process's maps, threads (name, state, wchan, kernel stack) and descriptors, written under `where`."""
    threads = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int) if os.path.isdir(f"/proc/{pid}/task") else []:
        stat = proc_text(f"/proc/{pid}/task/{tid}/stat")
        state = stat[stat.rfind(")") + 2:][:1] if ")" in stat else "?"
        threads.append({"tid": int(tid), "comm": proc_text(f"/proc/{pid}/task/{tid}/comm").strip(), "state": state,
                        "wchan": proc_text(f"/proc/{pid}/task/{tid}/wchan").strip(),
                        "stack": proc_text(f"/proc/{pid}/task/{tid}/stack").strip().splitlines()[:6]})
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd") if os.path.isdir(f"/proc/{pid}/fd") else []:
        try:
            fds[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
    snap: dict[str, Any] = {"label": label, "pid": pid, "unix": time.time(), "maps": proc_text(f"/proc/{pid}/maps"),
            "status": {k: v.strip() for k, _, v in (line.partition(":") for line in
                                                    proc_text(f"/proc/{pid}/status").splitlines())
                       if k in ("State", "Threads", "VmSize", "VmRSS", "VmPin", "VmLck", "SigBlk", "SigPnd",
                                "ShdPnd")},
            "threads": threads, "fds": fds}
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{label}-{pid}.json").write_text(json.dumps(snap, indent=1))
    (where / f"{label}-{pid}.maps").write_text(snap["maps"])
    return snap


def mappings(maps: str) -> set[tuple[int, int, str, str]]:
    """(start, end, perms, name), neighbours of the same perms and name merged (CRIU restores them merged)."""
    found: list[tuple[int, int, str, str]] = []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 5 or "-" not in parts[0]:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        name = parts[5].strip() if len(parts) > 5 else ""
        if found and found[-1][1] == start and found[-1][2:] == (parts[1], name):
            found[-1] = (found[-1][0], end, parts[1], name)
        else:
            found.append((start, end, parts[1], name))
    return set(found)


def notable(key: tuple[int, int, str, str]) -> bool:
    start, end, _perms, name = key
    return end - start >= BIG or any(word in name for word in NOTABLE)


def describe(key: tuple[int, int, str, str]) -> str:
    start, end, perms, name = key
    size = end - start
    human = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB" if size >= 2**20 else \
        f"{size // 1024} KiB"
    return f"{start:x}-{end:x} {perms} {human:>11} {name or '[anon]'}"


def maps_report(before: dict[str, Any] | None, after: dict[str, Any] | None, log: Log) -> None:
    """The notable mappings of each, then what differs (every line that is in one only, notable ones first)."""
    if not before or not after:
        return
    a, b = mappings(before["maps"]), mappings(after["maps"])
    was, now = before["status"], after["status"]
    log(f"   maps {before['label']} -> {after['label']}: {len(a)} -> {len(b)} mappings, threads "
        f"{was.get('Threads')} -> {now.get('Threads')}, VmSize {was.get('VmSize')} -> {now.get('VmSize')}, "
        f"VmPin {was.get('VmPin')} -> {now.get('VmPin')}")
    for label, side in ((before["label"], a), (after["label"], b)):
        shown = sorted(k for k in side if notable(k))
        log(f"     notable in {label} ({len(shown)}):")
        for key in shown[:40]:
            log(f"       {describe(key)}")
    only_a = sorted(set(a) - set(b), key=lambda k: (not notable(k), k))
    only_b = sorted(set(b) - set(a), key=lambda k: (not notable(k), k))
    log(f"     only in {before['label']} ({len(only_a)}), only in {after['label']} ({len(only_b)}):")
    for key in only_a[:30]:
        log(f"       - {describe(key)}")
    for key in only_b[:30]:
        log(f"       + {describe(key)}")
    # The same range with other permissions or another name (a reservation restored as something else).
    overlaps = [(ka, kb) for ka in only_a for kb in only_b if ka[0] < kb[1] and kb[0] < ka[1] and
                (notable(ka) or notable(kb))]
    for ka, kb in overlaps[:20]:
        log(f"       ~ {describe(ka)}  became  {describe(kb)}")


def threads_report(snap: dict[str, Any] | None, log: Log) -> None:
    if not snap:
        return
    names: dict[str, int] = {}
    for thread in snap["threads"]:
        key = f"{thread['comm']}[{thread['state']} {thread['wchan']}]"
        names[key] = names.get(key, 0) + 1
    log(f"   threads at {snap['label']} ({len(snap['threads'])}): " +
        ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(names.items())))
    nvidia_fds = sorted({t for t in snap["fds"].values() if "nvidia" in t})
    log(f"   descriptors at {snap['label']}: {len(snap['fds'])}, NVIDIA ones: {nvidia_fds}")


# -- the kernel's log ------------------------------------------------------------------------------------------------
def kmsg_mark(text: str) -> None:
    try:
        with open("/dev/kmsg", "w") as kmsg:
            kmsg.write(f"coldsnap-jaxdiag: {text}\n")
    except OSError:
        pass


def dmesg_since(marker: str) -> list[str]:
    done = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
    lines = done.stdout.splitlines()
    start = max((i for i, line in enumerate(lines) if f"coldsnap-jaxdiag: {marker}" in line), default=-1)
    return lines[start + 1:] if start >= 0 else [f"<no marker; dmesg exit {done.returncode}: {done.stderr[:200]}>"]



def latest(where: Path, label: str, pid: int) -> dict[str, Any] | None:
    path = where / f"{label}-{pid}.json"
    return json.loads(path.read_text()) if path.exists() else None



def reap(pid: int) -> str:
    """The restored root's end, when it ended (this process is its subreaper)."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return f"not our child ({proc_text(f'/proc/{pid}/stat')[:60]})"
    if got == 0:
        return f"alive, state {proc_text(f'/proc/{pid}/stat').rpartition(')')[2][:2].strip()}"
    if os.WIFSIGNALED(status):
        return f"ended by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited {os.WEXITSTATUS(status)}"


def kill_tree(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            got, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if got == 0:
            time.sleep(0.02)


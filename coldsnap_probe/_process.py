"""The processes a worker captures and restores, seen from outside: their tree, CUDA states, memory, sockets,
and CRIU run as a program (no CUDA driver calls but the state checks through `_cuda.Driver`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import DriverError, WorkerError

if TYPE_CHECKING:
    from ._cuda import Driver

__all__ = (
    "CriuRun",
    "anonymous_memory",
    "audit_pre_cuda",
    "cuda_processes",
    "endpoint",
    "image_digest",
    "images_size",
    "inet_sockets",
    "pids_by_argv",
    "process_state",
    "process_tree",
    "readlink",
    "require_state",
    "run_criu",
    "signal_tree",
    "stop",
    "tail",
    "tree_sockets",
    "undo_cuda",
)

_NVIDIA_MAPS = ("libcuda.so", "libnvidia-ml.so", "/dev/nvidia")


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            kids.extend(int(c) for c in text.split())
    except OSError:
        pass
    return kids


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, parents before children (the inventory order)."""
    order, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        if pid not in order:
            order.append(pid)
            queue.extend(sorted(_children(pid)))
    return order


def cuda_processes(driver: Driver, tree: list[int]) -> list[int]:
    """The processes of the tree the driver knows as CUDA processes (GetState answers for them)."""
    cuda = []
    for pid in tree:
        try:
            driver.state(pid)
        except Exception:
            continue
        cuda.append(pid)
    return cuda


def require_state(driver: Driver, pids: list[int], expected: str, step: str) -> None:
    for pid in pids:
        state = driver.state(pid)
        if state != expected:
            raise WorkerError(f"{step}: process {pid} is {state}, expected {expected}")


def audit_pre_cuda(tree: list[int]) -> None:
    """n580 boundary: no process may map the CUDA driver or hold an NVIDIA device file."""
    for pid in tree:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            fds = [target for fd in os.listdir(f"/proc/{pid}/fd") if (target := readlink(f"/proc/{pid}/fd/{fd}"))]
        except OSError as exc:
            raise WorkerError(f"audit: cannot read process {pid}: {exc}") from exc
        hits = sorted({m for m in _NVIDIA_MAPS if m in maps} | {f for f in fds if f.startswith("/dev/nvidia")})
        if hits:
            raise WorkerError(f"audit: process {pid} is not a pre-CUDA template: it holds {', '.join(hits)}")


def readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except FileNotFoundError:  # the descriptor closed while we looked
        return ""


def criu_environment(criu: str) -> dict[str, str]:
    """The environment CRIU runs in, its version check included (so both load the same libraries): a CRIU kept
    with its own libraries (the capsule's /opt/coldsnap/criu/{bin,lib}, or an unpacked package's
    usr/{sbin,lib/<multiarch>} beside the binary) finds them ahead of the caller's LD_LIBRARY_PATH."""
    prefix = Path(criu).resolve().parent.parent
    multiarch = f"{os.uname().machine}-linux-gnu"
    found = [str(d) for d in (prefix / "lib", prefix / "lib" / multiarch) if any(d.glob("*.so*"))]
    inherited = os.environ.get("LD_LIBRARY_PATH", "")
    return {**os.environ, "LD_LIBRARY_PATH": ":".join([*found, *([inherited] if inherited else [])])}


def run_criu(criu: str, args: list[str], log: Path, *, lifeline: tuple[int, ...] = (),
             env: dict[str, str] | None = None) -> float:
    return CriuRun(criu, args, log, lifeline=lifeline, env=env).wait()


class CriuRun:
    """One CRIU command, started at once; `wait` returns its seconds (start to exit) or raises naming its failure.
    Started before `wait`, so that the worker does meanwhile what does not need CRIU's result. `lifeline`:
    descriptors it holds open until it exits (a worker guard's journal: the guard of a worker that dies meanwhile
    undoes only once this CRIU has ended too). A thread of its own reaps it the moment it exits, so that its seconds
    are CRIU's even when the worker's own work meanwhile (a restore's CUDA driver) ends later. `env`: variables
    added to CRIU's environment (a restore's CRIU_KDAT_CACHE, `_criu_kdat`)."""

    def __init__(self, criu: str, args: list[str], log: Path, *, lifeline: tuple[int, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.args, self.log = args, log
        self.started = time.perf_counter()
        self.process = subprocess.Popen([criu, *args, "--log-file", str(log), "-v4"], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**criu_environment(criu), **(env or {})}, pass_fds=lifeline)
        self._stderr, self._exited = "", self.started
        self._reaper = threading.Thread(target=self._reap, name="coldsnap-criu-reaper", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        self._stderr = self.process.communicate()[1] or ""
        self._exited = time.perf_counter()

    def wait(self) -> float:
        self._reaper.join()
        if self.process.returncode != 0:
            raise WorkerError(f"criu {self.args[0]} exited {self.process.returncode}: {self._stderr.strip()}\n"
                              f"{tail(self.log)}")
        return self._exited - self.started


def _image_files(images: Path) -> list[Path]:
    """The images' regular files, never through a link: an engine writes its own device dump into the images
    (`device-<pid>/`, its uid) and may leave a link there to a file only this root worker can read."""
    return sorted(p for p in images.rglob("*") if stat.S_ISREG(p.lstat().st_mode))


def image_digest(images: Path, *, contents: bool = False) -> str:
    """Every file's name, size, mtime and ctime (any write changes them), optionally its bytes."""
    import hashlib  # here: OpenSSL's load (3-4 ms) is off a restore's path to CRIU (issue 35 item 2)
    h = hashlib.sha256()
    for path in _image_files(images):
        st = path.lstat()
        h.update(f"{path.relative_to(images)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0".encode())
        if contents:  # O_NOFOLLOW: not a link swapped in since the listing; O_NONBLOCK: nor a FIFO
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise WorkerError(f"image file {path} is no longer a regular file")
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return "sha256:" + h.hexdigest()


# A mapping's header line (its name, if any, last) or its `Anonymous:` line: the only smaps lines read. One pass
# of a regular expression over the bytes instead of splitting every line: a capture scans the tree twice on its
# path (before and after the CUDA checkpoint), thousands of mappings each.
_SMAPS = re.compile(rb"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+ *(.*)$|^Anonymous: +(\d+) kB$", re.MULTILINE)


def anonymous_memory(pid: int, top: int = 6) -> dict[str, Any]:
    """The process's resident anonymous bytes and its largest anonymous mappings (what CRIU will dump)."""
    sizes: list[tuple[int, str]] = []
    name, total = b"", 0
    try:
        smaps = Path(f"/proc/{pid}/smaps").read_bytes()
    except OSError:
        return {}
    for found in _SMAPS.finditer(smaps):
        if found.group(2) is None:
            name = found.group(1)
        elif kib := int(found.group(2)):
            total += kib
            sizes.append((kib << 10, " ".join(name.decode(errors="replace").split()) or "[anon]"))
    return {"anonymous_bytes": total << 10, "largest": sorted(sizes, reverse=True)[:top]}


def process_age_s(pid: int) -> float:
    """Seconds since `pid` started (its exec's fork, to the kernel's clock tick: 10 ms where CLK_TCK is 100)."""
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(stat_line.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command's parentheses
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def images_size(images: Path) -> tuple[int, int]:
    files = _image_files(images)
    return sum(p.lstat().st_size for p in files), len(files)


def tree_sockets(tree: list[int], protos: tuple[str, ...]) -> list[tuple[int, str, str, list[str]]]:
    """(pid, fd, proto, its /proc/net/<proto> fields) for every socket of the tree in those tables."""
    found = []
    for pid in tree:
        try:
            links = {fd: readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            inodes = {link[8:-1]: fd for fd, link in links.items() if link.startswith("socket:[")}
            for proto in protos:
                for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
                    fields = line.split()
                    if len(fields) > 9 and fields[9] in inodes:
                        found.append((pid, inodes[fields[9]], proto, fields))
        except OSError:  # the process is gone: it holds nothing
            continue
    return found


def inet_sockets(tree: list[int]) -> list[str]:
    """The tree's TCP/UDP sockets as `pid fd proto local -> remote`: none may be left once communicators are gone."""
    return [f"process {pid} fd {fd} {proto} {endpoint(fields[1])} -> {endpoint(fields[2])}"
            for pid, fd, proto, fields in tree_sockets(tree, ("tcp", "tcp6", "udp", "udp6"))]


def endpoint(hex_address: str) -> str:
    address, port = hex_address.split(":")
    host = ".".join(str(b) for b in reversed(bytes.fromhex(address))) if len(address) == 8 else address.lower()
    return f"{host}:{int(port, 16)}"


def signal_tree(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def undo_cuda(driver: Driver, done: list[tuple[int, str]],
              hold: Callable[[int], AbstractContextManager[Any]] | None = None) -> None:
    """Undo so the workload keeps running, the process done last first: restore what was checkpointed, then
    unlock. `hold` (a stopped tree: `_held_tree.held`) holds each process but its driver's restore thread for it;
    a process that cannot be held is let run and undone so (the restore needs its restore thread scheduled)."""
    for pid in reversed(list(dict.fromkeys(p for p, _ in done))):
        with contextlib.suppress(WorkerError), contextlib.ExitStack() as stack:  # a release that failed: the rest
            try:
                if hold is not None:
                    stack.enter_context(hold(pid))
            except (WorkerError, DriverError):  # DriverError: no restore thread named (the rollback must go on)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            with contextlib.suppress(Exception):  # best effort: the caller's rollback goes on with the rest
                if (pid, "checkpointed") in done:
                    driver.call("cuCheckpointProcessRestore", pid, None, required=False)
                if driver.state(pid) == "locked":
                    driver.call("cuCheckpointProcessUnlock", pid, None, required=False)


def pids_by_argv(words: list[str]) -> list[int]:
    """The processes whose command line has each of `words` as an argument, in any order. For looking at a host
    (a benchmark's watcher, a test), never for acting on: a worker acts on the pids it started or journalled,
    since any process can be named like CRIU."""
    wanted = [word.encode() for word in words]
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:  # it ended while we looked
            continue
        if all(word in argv for word in wanted):
            found.append(int(entry))
    return found


def process_state(pid: int) -> str:
    """The process's state letter (`T` stopped, `Z` zombie...), or "" once it is gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat_line[stat_line.rindex(")") + 2:][:1]


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def tail(log: Path, lines: int = 15) -> str:
    """CRIU's first error lines (the cause; what follows is mostly the unwinding) and the log's last lines."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    # (every run on the GPU machine logs a harmless RLIMIT_NOFILE error first)
    errors = [line for line in text if "Error (" in line and "RLIMIT_NOFILE" not in line][:4]
    return "\n".join([*errors, "...", *text[-lines:]] if errors else text[-lines:])

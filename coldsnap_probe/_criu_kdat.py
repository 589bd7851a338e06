"""CRIU's kernel-feature cache for a restore: carried in the images from the capture, else probed ahead of CRIU.

Every CRIU command first probes the kernel (`kerndat`: netlink, pagemap, ptrace, vDSO, iptables, nftables...) and
keeps the result in /run/criu.kdat, but only on a tmpfs: a capsule's /run is not one, and a restore's container is
new anyway, so each restore would probe again (45-70 ms of CPU; bench/README.md, "CRIU's restore, phase by phase").
`CRIU_KDAT_CACHE` (third_party/criu/kdat-cache.patch) names the file instead, and two things fill it:

* The capture's dump writes its probe there, and the capture carries it in the images (`carry`: `criu-kdat.bin`
  beside its key, `criu-kdat.json`). A restore whose key matches uses it (`KernelProbe`, copied into a scratch
  directory of its own: CRIU unlinks a cache it finds stale and rewrites one it extends, and the images are only
  read), so no probe runs at all (issue 35 item 2).
* Otherwise the restore worker runs `criu check` the moment it starts, into a fresh directory of its own, and the
  restore's CRIU loads what it wrote: same binary, same container, same boot, a moment earlier.

The key is what the probe's answers depend on, read as cheaply at restore as at capture: the boot (stock CRIU's own
rule: its cache lives until reboot; /proc/sys/kernel/random/boot_id), the kernel's release, and the confinement
CRIU runs in (capabilities, seccomp, no_new_privs, the LSM label, the user namespace's map, IPv6 in the network
namespace: what CRIU probes that a container can change). The CRIU build needs no entry: the restore's checks
refuse another CRIU version before any CRIU runs (`_target`, criu-mismatch), and CRIU refuses a cache of another
build itself (its second magic is the build's time: it unlinks it and probes again). The file's size, its first
magic and a CRC-32 catch a damaged copy; a cache that passes them and is still refused by CRIU only costs the probe
CRIU then runs. A stale key (another boot, kernel or confinement) or a damaged file is never used: the probe runs.

Who could forge it: the images belong to the manager whose capsule is restored, and so does this worker's
container; a lying cache misleads only the CRIU that restores that manager's own capture, in that capsule, with
that capsule's privileges. It can break that restore (a wrong answer about the kernel fails it, or leaves it to
CRIU's own checks), never the daemon or another tenant's workload, which the cache never reaches.

A CRIU without the patch ignores the variable: the dump writes nothing to carry, the probe writes no file, and the
restore's CRIU probes for itself, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import time
import zlib
from pathlib import Path

from ._process import criu_environment

__all__ = ("CACHE_VARIABLE", "CARRIED_CACHE", "CARRIED_KEY", "KernelProbe", "carry", "kernel_key")

PROBE_WAIT_S = 10.0  # for the probe to end: it is the work the restore's CRIU would do itself; past that, it is killed
CACHE_VARIABLE = "CRIU_KDAT_CACHE"
CARRIED_CACHE, CARRIED_KEY = "criu-kdat.bin", "criu-kdat.json"  # in the images
KDAT_MAGIC = 0x57023458  # CRIU's `struct kerndat_s` begins with it (criu/include/magic.h), little-endian
MAX_CACHE_BYTES = 1 << 20  # the struct is a few KiB: a larger file is not CRIU's cache
# The lines of /proc/self/status that confine what CRIU's probe may find.
CONFINEMENT = ("CapEff", "CapBnd", "NoNewPrivs", "Seccomp", "Seccomp_filters")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def kernel_key() -> dict[str, str]:
    """What a kernel-feature cache is valid for: this boot, this kernel, this process's confinement."""
    status = dict(line.split(":", 1) for line in _read("/proc/self/status").splitlines() if ":" in line)
    return {"boot_id": _read("/proc/sys/kernel/random/boot_id"), "kernel": os.uname().release,
            **{name: status.get(name, "").strip() for name in CONFINEMENT},
            "lsm": _read("/proc/self/attr/current"), "uid_map": " ".join(_read("/proc/self/uid_map").split()),
            "ipv6": str(os.path.exists("/proc/sys/net/ipv6"))}


def carry(cache: Path, images: Path) -> int | None:
    """The capture: the cache its dump's CRIU wrote (`cache`, named by CACHE_VARIABLE) copied into the images with
    this process's key (the dump's CRIU ran in its confinement); its size, None when the dump wrote none (a CRIU
    without the patch) or one that is not CRIU's."""
    data = _read_regular(cache)
    if data is None or not _plausible(data):
        return None
    record = {"key": kernel_key(), "bytes": len(data), "crc32": zlib.crc32(data)}
    made: list[Path] = []
    try:  # new files only, never through a link (the captured engine may write into the images: `_process`)
        for name, content in ((CARRIED_CACHE, data), (CARRIED_KEY, json.dumps(record, sort_keys=True).encode())):
            fd = os.open(images / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            made.append(images / name)
            with open(fd, "wb") as f:
                f.write(content)
    except OSError:  # nothing carried: a restore probes, as before
        for path in made:
            with contextlib.suppress(OSError):
                path.unlink()
        return None
    return len(data)


def _read_regular(path: Path, limit: int = MAX_CACHE_BYTES) -> bytes | None:
    """Up to `limit` + 1 bytes of the regular file at `path`, never through a link nor from a FIFO or device (the
    images are the manager's: a link or a pipe there must not make this root worker read elsewhere, or wait)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        try:
            return f.read(limit + 1)
        except OSError:  # EIO from a network or FUSE filesystem: not a cache to use, the probe runs
            return None


def _plausible(data: bytes) -> bool:
    return 8 <= len(data) <= MAX_CACHE_BYTES and int.from_bytes(data[:4], "little") == KDAT_MAGIC


def _carried(images: Path) -> bytes | None:
    """The images' cache when its key is this boot's, kernel's and confinement's and the file is whole; else None."""
    key, data = _read_regular(images / CARRIED_KEY, 1 << 16), _read_regular(images / CARRIED_CACHE)
    if key is None or data is None:
        return None
    try:
        record = json.loads(key)
    except (ValueError, RecursionError):  # a forged key nested past the parser's depth, too: the probe runs
        return None
    if not isinstance(record, dict) or record.get("key") != kernel_key():
        return None
    if record.get("bytes") != len(data) or record.get("crc32") != zlib.crc32(data) or not _plausible(data):
        return None
    return data


class KernelProbe:
    """CRIU's kernel-feature cache in `directory` (made and removed by the caller's guard: the worker's scratch),
    from the moment it is made: the one `images` carry when it is valid here (`carried`), else `criu check`
    writing it."""

    def __init__(self, criu: str, directory: Path, images: Path | None = None) -> None:
        self.directory, self.path = directory, directory / "criu.kdat"
        self.started = time.perf_counter()
        self.seconds: float | None = None  # the probe's own, once it ended
        self.carried_seconds: float | None = None  # what checking and copying the carried cache took
        self._process: subprocess.Popen[bytes] | None = None
        data = _carried(images) if images is not None else None
        if data is not None and self._copy(data):
            self.carried_seconds = time.perf_counter() - self.started
            return
        try:
            self._process = subprocess.Popen(
                [criu, "check", "--feature", "pagemap_scan"], cwd=directory, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**criu_environment(criu), CACHE_VARIABLE: str(self.path)})
        except OSError:  # no CRIU there: the restore's checks refuse it (exit 3), naming it, as before
            pass

    def _copy(self, data: bytes) -> bool:
        """The carried cache written where the restore's CRIU is told to look; False (nothing left) if it cannot be."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
        except OSError:  # a full scratch filesystem, say: the probe runs instead
            with contextlib.suppress(OSError):
                self.path.unlink()
            return False
        return True

    def environment(self) -> dict[str, str]:
        """For the restore's CRIU: the cache's name once it is there; {} when there is none (a CRIU without the
        patch, or a probe that failed or had to be killed), and that CRIU probes for itself."""
        if self.carried_seconds is not None:
            return {CACHE_VARIABLE: str(self.path)}
        if self._process is None:
            return {}
        try:
            self._process.wait(timeout=PROBE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.close()
            return {}
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.started
        return {CACHE_VARIABLE: str(self.path)} if self.path.is_file() else {}

    def close(self) -> None:
        """The probe ended (killed if it still runs) and its directory removed."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)

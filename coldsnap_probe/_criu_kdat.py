"""CRIU's kernel-feature probe run ahead of a restore, so that the restore's CRIU loads its result instead.

Every CRIU command first probes the kernel (`kerndat`: netlink, pagemap, ptrace, vDSO, iptables, nftables...) and
keeps the result in /run/criu.kdat, but only on a tmpfs: a capsule's /run is not one, and a restore's container is
new anyway, so each restore probed again, 45-70 ms of its CRIU phase on the CPU bench (bench/README.md, "CRIU's
restore, phase by phase"). The restore worker now starts `criu check` the moment it starts (beside the host's
identity, before its imports) with `CRIU_KDAT_CACHE` (third_party/criu/kdat-cache.patch) naming a file in a fresh
directory of its own; the restore's CRIU is given the same name and loads what that probe wrote. Same binary, same
container, same boot, a moment earlier: the probe's answers are the restore's own. A CRIU without the patch
ignores the variable and writes no file here: the restore then probes for itself, as before.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from ._process import criu_environment

__all__ = ("KernelProbe",)

PROBE_WAIT_S = 10.0  # for the probe to end: it is the work the restore's CRIU would do itself; past that, it is killed
CACHE_VARIABLE = "CRIU_KDAT_CACHE"


class KernelProbe:
    """`criu check` writing CRIU's kernel-feature cache into `directory` (made and removed by the caller's guard:
    the worker's scratch), from the moment it is made."""

    def __init__(self, criu: str, directory: Path) -> None:
        self.directory, self.path = directory, directory / "criu.kdat"
        self.started = time.perf_counter()
        self.seconds: float | None = None  # the probe's own, once it ended
        self._process: subprocess.Popen[bytes] | None = None
        try:
            self._process = subprocess.Popen(
                [criu, "check", "--feature", "pagemap_scan"], cwd=directory, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**criu_environment(criu), CACHE_VARIABLE: str(self.path)})
        except OSError:  # no CRIU there: the restore's checks refuse it (exit 3), naming it, as before
            pass

    def environment(self) -> dict[str, str]:
        """For the restore's CRIU: the cache's name once the probe has written it; {} when it wrote none (a CRIU
        without the patch, or a probe that failed or had to be killed), and that CRIU probes for itself."""
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

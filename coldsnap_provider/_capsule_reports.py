"""Phase timings from the capsules: the report directories of the units this daemon runs.

Each local ``workload-run`` gets a fresh directory ``<state>/capsule-reports/<id>`` (0733 with the
sticky bit: the unit's user can drop files, nobody else on the host can list or replace them),
mounted into the unit at ``/run/coldsnap/reports`` and named by ``COLDSNAP_REPORT_DIR``; the
in-capsule capture and restore workers leave their report there (``coldsnap_probe/_report_dir.py``).

A capsule is untrusted, so each entry is read once and removed, whatever it is::

    scan (every SCAN_INTERVAL_S, in a worker thread) ─► per unit directory (never through a link):
        more than MAX_ENTRIES entries ─► all removed, one `too_many`
        a dot name ─► someone's write in progress: left alone (counted among the entries)
        not a regular file (link, FIFO, socket, device, directory) ─► removed, `not_regular`
        over MAX_REPORT_BYTES ─► removed unread, `too_large`
        not a capture/restore report of the worker's shape ─► removed, `malformed`
        a report ─► its phases into coldsnap_{capture,restore}_phase_seconds{phase,mode}, removed

A directory no live unit carries (label ``io.coldsnap-provider.report-dir``) is removed once it
is older than REAP_AFTER_S. Nothing a capsule writes there can change more than the rejected counter.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import anyio
import msgspec
import structlog
from msgspec import Meta, Struct

from coldsnap_runtime import REPORT_DIR_LABEL, Backend, BackendError

from ._errors import ConfigError

if TYPE_CHECKING:
    from ._metrics import Metrics  # prometheus_client is needed only with [metrics] on

__all__ = ("CapsuleReports",)

log = structlog.get_logger(__name__)

SCAN_INTERVAL_S = 1.0
REAP_INTERVAL_S = 30.0
REAP_AFTER_S = 300.0  # a directory allocated for a workload-run still being created is not reaped
MAX_REPORT_BYTES = 1 << 20  # a real report is a few KiB (memory maps of a few processes at most)
MAX_ENTRIES = 256  # per directory and scan
_DIR_MODE = 0o1733
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_PATH: opening a name a capsule chose must have no effect of its own (a device node, a FIFO); only
# a regular file's inode, checked on that descriptor, is then opened for reading.
_OPEN_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC

# A phase takes at least nothing and at most a day: anything else is not a timing.
Seconds = Annotated[float, Meta(ge=0.0, le=86400.0)]


class _CaptureHydration(Struct, frozen=True):
    released_bytes: Annotated[int, Meta(ge=0)]


class _RestoreHydration(Struct, frozen=True):
    phase_seconds: Seconds


class _CapturedDevice(Struct, frozen=True):
    state: Annotated[str, Meta(max_length=32)]  # released, empty or not-started (the CUDA interposer's)


class CaptureReport(Struct, frozen=True, tag="coldsnap-cuda-criu-capture", tag_field="kind"):
    """The fields of the worker's capture report that the metrics use (the rest is ignored)."""

    format: Literal[1]
    timings_s: Annotated[dict[Annotated[str, Meta(max_length=64)], Seconds], Meta(max_length=32)]
    hydration: _CaptureHydration | None = None
    device_memory: Annotated[list[_CapturedDevice], Meta(max_length=256)] | None = None


class RestoreReport(Struct, frozen=True, tag="coldsnap-cuda-criu-restore", tag_field="kind"):
    """The fields of the worker's restore report that the metrics use (the rest is ignored)."""

    format: Literal[1]
    restore_seconds: Seconds
    ready_seconds: Seconds
    criu_restore_seconds: Seconds | None = None
    cuda_restore_seconds: Seconds | None = None
    all_pages_in_seconds: Seconds | None = None
    communicator_recreate_seconds: Seconds | None = None
    device_hydration_seconds: Seconds | None = None
    hydration: _RestoreHydration | None = None


_decode = msgspec.json.Decoder(CaptureReport | RestoreReport).decode


@dataclass(frozen=True, slots=True)
class Phases:
    kind: str  # "capture" or "restore"
    mode: str  # "full", "hydrate" or "interposer", "-lazy-pages" when the memory came back lazily
    seconds: dict[str, float]


def phases_of(report: CaptureReport | RestoreReport) -> Phases:
    if isinstance(report, CaptureReport):
        released = any(d.state == "released" for d in report.device_memory or [])
        mode = "interposer" if released else "hydrate" if report.hydration else "full"
        return Phases("capture", mode, dict(report.timings_s))
    seconds = {"criu_restore": report.criu_restore_seconds, "cuda_restore": report.cuda_restore_seconds,
               "all_pages_in": report.all_pages_in_seconds, "device_hydration": report.device_hydration_seconds,
               "hydration": report.hydration.phase_seconds if report.hydration else None,
               "communicator_recreate": report.communicator_recreate_seconds,
               "restore_total": report.restore_seconds, "ready_total": report.ready_seconds}
    mode = ("interposer" if report.device_hydration_seconds is not None else "hydrate" if report.hydration
            else "full") + ("-lazy-pages" if report.all_pages_in_seconds else "")
    return Phases("restore", mode, {k: v for k, v in seconds.items() if v is not None})


class CapsuleReports:
    """The report directories: allocated per workload-run, scanned, reaped. The daemon runs :meth:`run`."""

    def __init__(self, root: Path, metrics: Metrics) -> None:
        self.root = root
        self._metrics = metrics
        self._allocated: dict[str, float] = {}  # id -> monotonic time, for the reaper's grace

    def prepare(self) -> None:
        try:
            self.root.mkdir(mode=0o711, exist_ok=True)
            info = self.root.lstat()
        except OSError as exc:
            raise ConfigError(f"{self.root}: {exc.strerror}") from exc
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise ConfigError(f"{self.root} is not a directory of this daemon's")
        os.chmod(self.root, 0o711)

    def allocate(self) -> str:
        """A fresh directory for one unit; its host path."""
        name = secrets.token_hex(8)
        path = self.root / name
        path.mkdir(mode=0o700)
        os.chmod(path, _DIR_MODE)  # after mkdir: the umask would take the bits other users need
        self._allocated[name] = time.monotonic()
        return str(path)

    async def run(self, backend: Backend) -> None:
        """Scan until cancelled; reap every REAP_INTERVAL_S."""
        last_reap = time.monotonic()
        while True:
            await anyio.sleep(SCAN_INTERVAL_S)
            try:
                await self.scan()
                if time.monotonic() - last_reap >= REAP_INTERVAL_S:
                    last_reap = time.monotonic()
                    await self.reap(backend)
            except (OSError, BackendError) as exc:
                log.warning("capsule report scan failed", error=str(exc))
            except Exception:  # a bug here must cost the phase metrics, never the daemon
                log.exception("capsule report scan failed unexpectedly")

    async def scan(self) -> None:
        accepted, rejected = await anyio.to_thread.run_sync(self._scan_all)
        for phases in accepted:
            self._metrics.phases(phases.kind, phases.mode, phases.seconds)
        for reason in rejected:
            self._metrics.rejected(reason)
        if rejected:
            log.warning("capsule reports rejected", reasons=sorted(set(rejected)), count=len(rejected))

    async def reap(self, backend: Backend) -> None:
        """Remove directories no unit holds any more (their unit was removed, or its run failed)."""
        live = {info.labels.get(REPORT_DIR_LABEL, "") for _, info in await backend.workload_list()}
        now = time.monotonic()
        for name in await anyio.to_thread.run_sync(self._names):
            if name in live or now - self._allocated.get(name, -REAP_AFTER_S) < REAP_AFTER_S:
                continue
            self._allocated.pop(name, None)
            await anyio.to_thread.run_sync(self._remove_dir, name)

    def _names(self) -> list[str]:
        return [entry.name for entry in os.scandir(self.root) if not entry.name.startswith(".")]

    def _remove_dir(self, name: str) -> None:
        root = os.open(self.root, _OPEN_DIR)
        try:
            shutil.rmtree(name, dir_fd=root)  # fd-based: a link planted inside is removed, not followed
        except FileNotFoundError:
            pass
        finally:
            os.close(root)

    def _scan_all(self) -> tuple[list[Phases], list[str]]:
        accepted: list[Phases] = []
        rejected: list[str] = []
        root = os.open(self.root, _OPEN_DIR)
        try:
            for name in os.listdir(root):
                try:
                    unit = os.open(name, _OPEN_DIR, dir_fd=root)
                except OSError:
                    continue  # not a directory of ours (or gone): the reaper decides
                try:
                    self._scan_unit(unit, accepted, rejected)
                finally:
                    os.close(unit)
        finally:
            os.close(root)
        return accepted, rejected

    @staticmethod
    def _scan_unit(unit: int, accepted: list[Phases], rejected: list[str]) -> None:
        names: list[str] = []
        with os.scandir(unit) as entries:
            for entry in entries:
                names.append(entry.name)
                if len(names) > MAX_ENTRIES:
                    break
        if len(names) > MAX_ENTRIES:
            rejected.append("too_many")
            for name in os.listdir(unit):
                _remove(unit, name)
            return
        for name in names:
            if name.startswith("."):
                continue
            outcome = _read(unit, name)
            _remove(unit, name)
            if isinstance(outcome, str):
                rejected.append(outcome)
            else:
                accepted.append(outcome)


def _read(unit: int, name: str) -> Phases | str:
    """The phases of one entry, or why it was rejected."""
    try:
        handle = os.open(name, _OPEN_PATH, dir_fd=unit)
    except OSError:
        return "unreadable"  # gone already
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            return "not_regular"  # a symbolic link (O_PATH|O_NOFOLLOW opens the link itself), FIFO, device...
        if info.st_size > MAX_REPORT_BYTES:
            return "too_large"
        fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)  # the same inode, now readable
        try:
            data = os.read(fd, MAX_REPORT_BYTES + 1)  # it may have grown since fstat
        finally:
            os.close(fd)
    except OSError:
        return "unreadable"
    finally:
        os.close(handle)
    if len(data) > MAX_REPORT_BYTES:
        return "too_large"
    try:
        return phases_of(_decode(data))
    except (msgspec.DecodeError, RecursionError):
        return "malformed"


def _remove(unit: int, name: str) -> None:
    try:
        if stat.S_ISDIR(os.lstat(name, dir_fd=unit).st_mode):
            shutil.rmtree(name, dir_fd=unit)
        else:
            os.unlink(name, dir_fd=unit)
    except FileNotFoundError:
        pass

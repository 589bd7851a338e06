"""The CUDA interposer's side of a unit, shared by the daemon benches that run an engine unchanged under it
(bench/e2e_modes.py's `interposer*` modes, bench/e2e_serve.py's `full-interposer*` paths): what the unit's
environment adds, the socket directory every unit of a path mounts, the check that the capsule carries the
library, the staging node hydrator, and what a restore report says of the device hydration.

Two environment lines make an engine's device memory go through the interposer (docs/interposer.md):
`LD_PRELOAD` of the library and `COLDSNAP_CUDA_INTERPOSER_SOCKET` (`/run/coldsnap/cuda-%p.sock`, one socket per
CUDA process). A staged path adds a third, `COLDSNAP_CUDA_INTERPOSER_HYDRATOR`: the node hydrator's socket,
recorded in the dump's manifest at capture, which the restore worker asks to stage the dump on the GPU while CRIU
restores the process. That hydrator (`python -m coldsnap_probe.hydration serve --staging`, no weight files) is a
unit of its own beside the engine's, with the same mounts, not itself under the interposer; its socket lives in
the same /run/coldsnap directory, so every restore unit of the path reaches it. It loads each capture's dump into
its RAM tier as the capture offers it (`serve --warm-captures`, the default), so that the first restore after a
capture stages from RAM (issue 35); `WARM_CAPTURES=0` in the bench's environment turns that off, for a side by side.
`DEVICE_TIER=SIZE` gives it a device tier of that size (`serve --device-tier-bytes`): each dump it staged is kept on
its GPU, so that the next restore's stage is a copy within the GPU and leaves the link to the CUDA restore.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.e2e_restore import Driver, E2EError, Layout

INTERPOSER_LIBRARY = "/opt/coldsnap/lib/libcoldsnap_cuda.so"  # where scripts/_capsule_rootfs.py --worker builds it
NO_IO_URING_LIBRARY = "/opt/coldsnap/lib/libcoldsnap_no_io_uring.so"  # the same: uvloop without an io_uring ring
INTERPOSER_RUN = "/run/coldsnap"
INTERPOSER_SOCKET = f"{INTERPOSER_RUN}/cuda-%p.sock"  # %p: one socket per CUDA process (docs/interposer.md)
STAGING_SOCKET = f"{INTERPOSER_RUN}/hydrator.sock"  # a staged path's node hydrator
INTERPOSER_HYDRATOR = "COLDSNAP_CUDA_INTERPOSER_HYDRATOR"  # the variable that names it to the engine's interposer


def interposer_environment(*, staged: bool) -> dict[str, str]:
    """What a unit's environment adds for the interposer; `staged`: and the node hydrator that stages its dump."""
    environment = {"LD_PRELOAD": INTERPOSER_LIBRARY, "COLDSNAP_CUDA_INTERPOSER_SOCKET": INTERPOSER_SOCKET}
    if staged:
        environment[INTERPOSER_HYDRATOR] = STAGING_SOCKET
    return environment


@dataclass
class InterposerLayout(Layout):
    """A path's layout: with `interposer_dir`, that host directory is every unit's /run/coldsnap (the serving
    unit's, each restore unit's and the staging hydrator's), so that CRIU finds the directory where it rebinds
    each restored process's control socket, and the restore worker finds the hydrator's socket."""

    interposer_dir: Path | None = None

    def mounts(self) -> list[dict[str, Any]]:
        extra = [{"source": str(self.interposer_dir), "target": INTERPOSER_RUN}] if self.interposer_dir else []
        return super().mounts() + extra

    def prepare(self) -> None:
        super().prepare()
        if self.interposer_dir:
            self.interposer_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            for stale in self.interposer_dir.glob("cuda-*.sock"):  # a killed engine's (a restore rebinds its own)
                stale.unlink()


async def check_interposer(d: Driver, image: str, layout: Layout) -> None:
    """A disposable run of the capsule: the interposer library is there and loads (before any engine runs)."""
    program = f"import ctypes; ctypes.CDLL({INTERPOSER_LIBRARY!r})"
    reply = await d.runtime("workload-run", workload={
        "name": "", "image": image, "remove_after_exit": True, "pull_policy": "never", "network": "none",
        "combined": True, "mounts": [m for m in layout.mounts()  # and the one an interpreter of the run lives in
                                     if m.get("read_only") or layout.python.startswith(f"{m['target']}/")],
        "entrypoint": layout.python, "command": ["-c", program]})
    if not reply.get("ok"):
        raise E2EError(f"capsule {image} carries no loadable CUDA interposer at {INTERPOSER_LIBRARY} "
                       f"(scripts/_capsule_rootfs.py --worker builds it): {reply.get('error')}",
                       code=reply.get("error_code") or "runtime_failed")


def staging_unit(layout: Layout, image: str, name: str) -> dict[str, Any]:
    """A staged path's node hydrator: staging only (no weight files), its socket in the path's /run/coldsnap,
    the path's mounts and GPU, not itself under the interposer (it holds the staged allocations the engine
    adopts)."""
    spec = layout.unit(name, image, entrypoint=layout.python, command=[
        "-m", "coldsnap_probe.hydration", "serve", "--staging", "--ram-tier-bytes", "auto", "--socket",
        STAGING_SOCKET, *(["--no-warm-captures"] if os.environ.get("WARM_CAPTURES") == "0" else []),
        # DEVICE_TIER=SIZE: the hydrator keeps each dump it staged in that much of its GPU (_device_tier.py)
        *(["--device-tier-bytes", os.environ["DEVICE_TIER"]] if os.environ.get("DEVICE_TIER") else [])])
    spec["environment"] = {k: v for k, v in spec["environment"].items()
                           if k != "LD_PRELOAD" and not k.startswith("COLDSNAP_CUDA_INTERPOSER")}
    return spec


async def start_staging_hydrator(d: Driver, image: str, layout: Layout, name: str) -> dict[str, Any]:
    """Start a staged path's node hydrator (once per path, before its serving unit: a node service, not part
    of any Docker-to-first-token); bench/e2e_restore.py's `wait_hydrator` waits for its ready line."""
    await d.expect(f"evicting {name}", "workload-remove", name=name)
    spec = staging_unit(layout, image, name)
    created = time.time()
    await d.expect(f"starting the staging hydrator {name}", "workload-run", workload=spec)
    return {"name": name, "created_unix": created}


def device_hydration(report: dict[str, Any]) -> dict[str, Any]:
    """What a restore report says of the interposer's device hydration (None where it hydrated nothing)."""
    processes = report.get("device_memory") or []
    moved = sum(int(p.get("bytes") or 0) for p in processes)
    seconds = report.get("device_hydration_seconds")
    set_back = [float(p["stack_restore_s"]) for p in processes if p.get("stack_restore_s") is not None]
    return {"device_hydration_s": seconds, "device_bytes": moved if processes else None,
            "device_stack_restore_s": max(set_back) if set_back else None,  # the engine's stack limit set back
            "device_gbps": moved / seconds / 1e9 if processes and seconds else None,
            "device_verify": sorted({str((p.get("interposer") or {}).get("verify", "")) for p in processes} - {""})}


def device_staging(report: dict[str, Any]) -> dict[str, Any]:
    """Whether the node hydrator staged every process's dump (None: no stage was asked for, the plain
    interposer path), and why not where it did not (a refusal, a late stage, an adoption that failed)."""
    stages = [(p.get("interposer") or {}).get("stage") for p in report.get("device_memory") or []]
    asked = [s for s in stages if isinstance(s, dict)]
    # Per process, where its device bytes came from: the stage's numbers when it was staged (a copy from the stage
    # sets the zeros again, on the device: the same chunks), else the interposer's own fill's.
    sources = [(f.get("stage") or {}) if (f.get("stage") or {}).get("staged") else
               {"zero_bytes": f.get("zero_set_bytes"), "copied_bytes": f.get("copied_bytes")}
               for f in (p.get("interposer") or {} for p in report.get("device_memory") or [])]
    return {"device_staged": all(s.get("staged") and "adopt_error" not in s for s in asked) if asked else None,
            "device_stage_errors": sorted({str(s.get("error") or s.get("adopt_error")) for s in asked
                                           if s.get("error") or s.get("adopt_error")}),
            # The restore waiting for the stage after CUDA's restore, and where the device bytes came from: chunks
            # of zeros set on the device (by the stage or the interposer) vs bytes read from the dump and copied.
            "device_stage_wait_s": max((float(s["wait_s"]) for s in asked if s.get("wait_s") is not None),
                                       default=None),
            "device_zero_set_bytes": sum(int(s.get("zero_bytes") or 0) for s in sources),
            "device_copied_bytes": sum(int(s.get("copied_bytes", s.get("bytes")) or 0) for s in sources)}


def device_cell(row: dict[str, Any]) -> str:
    """A restore row's device hydration cell: seconds (rate, and whether the node hydrator staged it)."""
    seconds = row.get("device_hydration_s")
    if seconds is None:
        return "-"
    notes = [f"{row['device_gbps']:.1f} GB/s"] if row.get("device_gbps") else []
    notes += {None: [], True: ["staged"], False: ["not staged"]}[row.get("device_staged")]
    if row.get("device_stage_wait_s") is not None:
        notes.append(f"waited {row['device_stage_wait_s']:.2f} s")
    if row.get("device_stack_restore_s") is not None:
        notes.append(f"stack set back in {row['device_stack_restore_s'] * 1e3:.1f} ms")
    if row.get("device_zero_set_bytes"):
        notes.append(f"{row['device_zero_set_bytes'] / 1e9:.2f} GB zeros set, {row['device_copied_bytes'] / 1e9:.2f} "
                     "copied")
    return f"{seconds:.2f}" + (f" ({', '.join(notes)})" if notes else "")

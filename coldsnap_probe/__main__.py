"""`python -m coldsnap_probe profile [--qualification RECORD]|capture|restore|_target|_ipc_target`: JSON on
stdout, diagnostics on stderr.

Exit status: 0 after printing the JSON; 1 with `error: <Type>: <msg>` on stderr (a capture or restore: `error:
<capture|restore> phase <phase>: <Type>: <msg>`, each phase also announced on stderr as it begins, `_phase.py`); 2
for bad arguments; 3 when a restore is refused before any work because this host cannot restore the capture (stdout:
the `restore-refused` JSON, one reason code per mismatched fact with both values).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._coordinator import Coordinator
    from ._phase import PhaseLog
    from .errors import CaptureRefused, TargetRefused

MIN_MEMORY, MAX_MEMORY = 4096, 1 << 30


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coldsnap_probe")
    sub = parser.add_subparsers(dest="command", required=True)
    profile = sub.add_parser("profile", help="print the format-1 host feature profile")
    profile.add_argument("--memory-bytes", type=int, default=1 << 20)
    profile.add_argument("--timeout", type=float, default=30.0)
    profile.add_argument("--qualification", metavar="RECORD",
                         help="a coldsnap-qualification-record (JSON file, spec 5.6) for this exact environment: "
                              "its unqualified or absent features are printed as passed; a negative is an error")
    capture = sub.add_parser("capture", help="checkpoint and dump a process tree (CUDA checkpoint + CRIU)")
    capture.add_argument("--pid", type=int, required=True)
    capture.add_argument("--images", required=True, help="new or empty directory for the images")
    capture.add_argument("--criu", default="criu")
    capture.add_argument("--boundary", choices=["n610", "n580"], default="n610")
    capture.add_argument("--digest", action="store_true", help="record a content digest of the images")
    capture.add_argument("--hydration", help="the engine's hydration control socket: release weights first")
    capture.add_argument("--interposer", help="the CUDA interposer's control socket of the tree's one CUDA process "
                         "(default: each process's COLDSNAP_CUDA_INTERPOSER_SOCKET)")
    capture.add_argument("--engine", help="the engine's control socket: quiesce communicators before capture, "
                                          "recreate them after restore")
    capture.add_argument("--graph-policy", default="auto",
                         choices=["auto", "disabled", "recreate-from-plan", "preserve-exec", "preserve-nccl-exec"],
                         help="auto: the driver's default (580: recreate-from-plan, 610: preserve-nccl-exec "
                              "where an in-place provider is admitted)")
    restore = sub.add_parser("restore", help="restore a captured tree and resume it")
    restore.add_argument("--images", required=True)
    restore.add_argument("--criu", default="criu")
    restore.add_argument("--work-dir", help="where CRIU writes its log and pidfile (never the images)")
    restore.add_argument("--lazy-pages", action="store_true",
                         help="restore memory lazily (criu lazy-pages, userfaultfd) while the CUDA state comes back")
    restore.add_argument("--device-policy", choices=["same-model", "same-gpu"], default="same-model",
                         help="where the interposer's device dumps may be hydrated: the GPU model they were dumped "
                              "on, or that very GPU (UUID)")
    restore.add_argument("--device-digests", action="store_true",
                         help="digest every byte of the interposer's dumps while hydrating (default: only when a "
                              "dump file is not provably the one written at capture; sampled read-back always)")
    for command in (capture, restore):
        ranks = command.add_argument_group("several ranks (one worker per rank)")
        ranks.add_argument("--rank", type=int, default=0)
        ranks.add_argument("--world-size", type=int, default=1)
        ranks.add_argument("--coordinator", help="a directory every rank's worker reaches (barriers, abort)")
        ranks.add_argument("--namespace", help="this activation's name: one capture or one restore")
        ranks.add_argument("--barrier-timeout", type=float, default=120.0, help="seconds to wait for a peer")
    target = sub.add_parser("_target", help=argparse.SUPPRESS)
    target.add_argument("--memory-bytes", type=int, required=True)
    ipc = sub.add_parser("_ipc_target", help=argparse.SUPPRESS)
    ipc.add_argument("--handle", required=True)
    ipc.add_argument("--memory-bytes", type=int, required=True)
    ipc.add_argument("--expected-sha256", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    entered = time.time_ns()  # the interpreter is up (a restore reports what its start cost from here on)
    args = _parser().parse_args(argv)
    if args.command in ("capture", "restore"):
        return _worker(args, entered)
    if not MIN_MEMORY <= args.memory_bytes <= MAX_MEMORY:
        sys.stderr.write(f"error: --memory-bytes must be within [{MIN_MEMORY}, {MAX_MEMORY}], "
                         f"got {args.memory_bytes}\n")
        return 2
    if args.command == "profile" and not 0 < args.timeout <= 300:
        sys.stderr.write(f"error: --timeout must be within (0, 300] seconds, got {args.timeout:g}\n")
        return 2
    try:
        if args.command == "profile":
            from ._profile import build_profile

            profile = build_profile(args.memory_bytes, args.timeout).to_json()
            if args.qualification:
                from pathlib import Path

                from ._features import apply_qualification

                profile = apply_qualification(profile, json.loads(Path(args.qualification).read_text()))
            sys.stdout.write(json.dumps(profile, indent=2, sort_keys=True))
            sys.stdout.write("\n")
            return 0
        if args.command == "_target":
            from ._canaries import roundtrip_target

            return roundtrip_target(args.memory_bytes)
        from ._canaries import ipc_target

        return ipc_target(args.handle, args.memory_bytes, args.expected_sha256)
    except Exception as exc:
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 1


def _worker(args: argparse.Namespace, entered: int) -> int:
    from pathlib import Path

    from ._coordinator import Coordinator
    from ._phase import PhaseLog
    from ._report_dir import leave_report
    from .errors import CaptureRefused, ProbeError, TargetRefused

    if (args.world_size > 1 or args.coordinator) and not (args.coordinator and args.namespace):
        sys.stderr.write("error: several ranks need --coordinator and --namespace\n")
        return 2
    coordinator = None
    phases = PhaseLog(args.command)
    try:
        if args.coordinator:
            coordinator = Coordinator(Path(args.coordinator), args.namespace, args.rank, args.world_size,
                                      timeout=args.barrier_timeout)
        if args.command == "capture":  # each subcommand imports only its own side (issue 22: a restore's start)
            from ._capture import capture
            from ._worker_guard import WorkerGuard
            from .memory import MemoryOptions

            guard = WorkerGuard()
            guard.start("capture")  # before any CUDA call: the guard may need the driver itself
            report = capture(args.pid, Path(args.images), criu=args.criu, boundary=args.boundary,
                             digest=args.digest, coordinator=coordinator, engine=args.engine,
                             graph_policy=args.graph_policy, phases=phases, guard=guard, worker_main_ns=entered,
                             memory=MemoryOptions(weights_control=args.hydration,
                                                  interposer=args.interposer)).to_json()
        else:
            report = _restore(args, entered, coordinator, phases)
    except (CaptureRefused, TargetRefused) as exc:  # before any work: the tree runs on, nothing was restored
        sys.stderr.write(f"error: {_where(phases)}{type(exc).__name__}: {exc}\n")
        sys.stdout.write(json.dumps(_refusal(exc, phases), indent=2, sort_keys=True) + "\n")
        return 3
    except (ProbeError, OSError, ValueError) as exc:
        sys.stderr.write(f"error: {_where(phases)}{type(exc).__name__}: {exc}\n")
        return 1
    finally:
        phases.close()
        if coordinator is not None:
            coordinator.close()
    sys.stdout.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
    leave_report(report)  # for the daemon's phase metrics, when it gave this unit a report directory
    return 0


def _restore(args: argparse.Namespace, entered: int, coordinator: Coordinator | None,
             phases: PhaseLog) -> dict[str, Any]:
    """A restore, started in the order that gets CRIU running soonest (issue 35 item 2): the guard first (before CRIU
    and the CUDA driver: a worker that dies leaves no restored tree; and before this process has a second thread,
    which a fork would not copy), then CRIU's kernel-feature probe run in a process and this host's identity read in a
    thread while the rest is imported. The probe first: with the imports cut to what the checks before CRIU need, it
    is what the restore's CRIU may wait for (`KernelProbe.environment`)."""
    from pathlib import Path

    from ._worker_guard import WorkerGuard

    guard = WorkerGuard()
    guard.start("restore")
    guarded = time.time_ns()
    from ._criu_kdat import KernelProbe

    # CRIU's kernel-feature cache: the one the images carry from the capture when it is valid here, else a probe
    # run while the rest imports.
    kernel = KernelProbe(args.criu, guard.scratch("coldsnap-kdat-"), Path(args.images))
    try:
        from ._host import IdentityReading

        identity = IdentityReading(args.criu)
        from ._restore import restore
        startup = {"worker_main": entered, "guard_started": guarded, "imports_done": time.time_ns()}
        return restore(Path(args.images), criu=args.criu, work=Path(args.work_dir) if args.work_dir else None,
                       coordinator=coordinator, lazy_pages=args.lazy_pages, phases=phases, guard=guard,
                       startup=startup, identity=identity, kernel=kernel,
                       device_policy=args.device_policy, device_digests=args.device_digests).to_json()
    except BaseException:  # restore() ends it once entered; a failure before (its first phase's line, say) too
        kernel.close()  # else its `criu check` outlives this worker (the guard removes only the directory)
        raise


def _refusal(exc: CaptureRefused | TargetRefused, phases: PhaseLog) -> dict[str, object]:
    """A refusal's JSON on stdout: every reason, with the phase it was found in."""
    from .errors import CaptureRefused

    if isinstance(exc, CaptureRefused):
        return {"kind": "capture-refused", "refused": list(exc.reasons), "phase": phases.current}
    return {"kind": "restore-refused", "refused": list(exc.mismatches), "checked_seconds": exc.seconds,
            "phase": phases.current}


def _where(phases: PhaseLog) -> str:
    """The phase a failure happened in, first on its `error:` line (a reply cut to its end still has the phase line
    before it)."""
    return f"{phases.kind} phase {phases.current}: " if phases.current else ""


if __name__ == "__main__":
    code = main()
    if code == 0:
        # Everything is written: leave without the interpreter's teardown of every module it loaded (10-40 ms that
        # a restore unit's readiness waited for, its command publishing the report once this process has exited).
        # No thread of ours is left running by then (every pool is joined where it was opened, the rest are
        # daemons). A failure leaves the usual way.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    raise SystemExit(code)

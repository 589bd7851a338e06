"""The fault matrix: every scenario is a test in the suite; this runs each alone and audits what it left.

    .venv/bin/python bench/faults.py

Per row: the scenario, its result (what the test proves happened), and what was left
behind on this node afterwards: containers, images, provider state directories and
sockets under /tmp. A scenario whose test fails is reported as FAILED.
"""

from __future__ import annotations

import glob
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table

ROOT = Path(__file__).resolve().parent.parent
F = "tests/runtime/test_faults.py::"
R = "tests/provider/test_robustness.py::"
SCENARIOS = [
    (F + "test_disconnect_during_pull_cancels_it", "client disconnects during image-pull",
     "failed cleanly: pull cancelled, daemon healthy"),
    (F + "test_disconnect_during_build_cancels_it", "client disconnects during image-build",
     "failed cleanly: engine cancels the build, no build container, no tag"),
    (F + "test_disconnect_during_sync_run_removes_its_container", "client disconnects during synchronous workload-run",
     "failed cleanly: container removed; cleanup RPC after it succeeds"),
    (F + "test_disconnect_during_copy_from_leaves_nothing_half_written",
     "client disconnects during workload-copy-from", "failed cleanly: nothing written at the destination"),
    (F + "test_docker_restart_with_a_call_in_flight_fails_cleanly_and_leaves_nothing",
     "dockerd restarted with a synchronous run in flight",
     "failed cleanly (runtime_failed); deferred cleanup removes the container"),
    (F + "test_docker_restart_between_calls_recovers_without_restarting_the_provider",
     "dockerd restarted between calls", "recovered: next calls succeed, same provider process"),
    (R + "test_sigterm_drains_in_flight_operations_then_exits", "SIGTERM with calls in flight",
     "succeeded: in-flight call answered, then exit 0"),
    (R + "test_shutdown_grace_expiry_cancels_stragglers", "SIGTERM, straggler past the grace period",
     "failed cleanly: straggler answered ok:false, exit 0"),
    (F + "test_sigkill_and_restart_keep_sessions_and_workload_names", "SIGKILL, then restart",
     "recovered: session token and workload name resolve"),
    (F + "test_abusive_clients_do_not_disturb_legitimate_ones",
     "slow-loris, oversize, malformed, wrong token, wrong host flood", "succeeded: 100/100 legitimate calls ok"),
    (R + "test_client_disconnect_mid_operation_cancels_it_and_daemon_stays_healthy",
     "client disconnects during exec", "failed cleanly: process group killed"),
    (R + "test_connections_past_the_cap_get_a_clear_error", "connections past the cap",
     "failed cleanly: clear ok:false, then served"),
]


def snapshot() -> dict[str, set[str]]:
    def lines(*args: str) -> set[str]:
        return set(subprocess.run(args, capture_output=True, text=True, check=False).stdout.split())

    return {
        "containers": lines("docker", "ps", "-aq", "--no-trunc"),
        "images": lines("docker", "images", "-q", "--no-trunc"),
        "provider state dirs": set(glob.glob("/tmp/cs-*/records")),
        "sockets": set(glob.glob("/tmp/cs-*/**/*.sock", recursive=True)),
        "scratch files": set(glob.glob("/tmp/cs-*")),
    }


def main() -> int:
    rows = []
    failures = 0
    for node, scenario, expected in SCENARIOS:
        before = snapshot()
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=ROOT,
                              capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        time.sleep(0.5)
        after = snapshot()
        left = [f"{len(after[k] - before[k])} {k}" for k in after if after[k] - before[k]]
        ok = done.returncode == 0
        failures += not ok
        rows.append([scenario, expected if ok else "FAILED (see pytest output)", ", ".join(left) or "nothing",
                     f"{seconds:.1f}"])
        if not ok:
            print(done.stdout[-3000:], file=sys.stderr)
    print(table(["scenario", "result", "left behind", "s"], rows))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Envelopes per second through decode and full runtime validation (no I/O).

    .venv/bin/python bench/validation.py [--seconds 2]

A minimal `capabilities` envelope and a large rank `workload-run` (dozens of environment
entries, mounts and labels, like the adapter sends) through `decode_request`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table
from coldsnap_provider import decode_request

BASE = {"format": 1, "id": "1767225600000000007", "token": "t" * 43, "session": "op-1"}
MINIMAL = json.dumps({**BASE, "operation": "capabilities"}).encode()
RANK = json.dumps({**BASE, "operation": "runtime", "host": "node-a", "runtime": {
    "action": "workload-run", "workload": {
        "name": "job-1_node_0", "image": "registry.example/capsules/m@sha256:" + "0" * 64, "detached": True,
        "network": "host", "privileged": True, "seccomp_unconfined": True, "memlock_unlimited": True,
        "shared_memory_bytes": 34359738368, "gpus": ["0", "1", "2", "3"],
        "environment": {f"COLDSNAP_SETTING_{i}": f"value {i} $x;*" for i in range(48)},
        "labels": {f"io.sparksq.coldsnap.label{i}": f"v{i}" for i in range(24)},
        "mounts": [{"source": f"/var/lib/coldsnap/payloads/p{i}", "target": f"/opt/coldsnap/payloads/p{i}",
                    "read_only": i % 2 == 0} for i in range(32)],
        "devices": [{"source": "/dev/infiniband", "target": "/dev/infiniband"}],
        "command": ["/usr/local/bin/coldsnap-engine-rank-n610", "--engine", "vllm", "restore", "--", "vllm",
                    "serve", "m"]}}}).encode()


def rate(payload: bytes, seconds: float) -> tuple[float, float]:
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(200):
            decode_request(payload)
        count += 200
    return count / elapsed, elapsed / count * 1e6


def main(seconds: float) -> None:
    rows = []
    cases = (("capabilities (minimal)", MINIMAL), ("rank workload-run (48 env, 32 mounts, 24 labels)", RANK))
    for name, payload in cases:
        per_second, micros = rate(payload, seconds)
        rows.append([name, len(payload), f"{per_second:,.0f}", f"{micros:.1f}"])
    print(table(["envelope", "bytes", "decoded + validated / s", "µs each"], rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    main(parser.parse_args().seconds)

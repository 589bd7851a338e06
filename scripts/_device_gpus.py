"""Issue 12 items 1, 2 and 5 through a running `coldsnap-provider serve` (driven by `scripts/device daemon-gpus`).

    python3 scripts/_device_gpus.py --state-dir DIR --context DIR --out DIR --docker-host unix://SOCK

Everything goes through the daemon as a ColdSnap controller would: a session from control.sock, then
runtime-v1 envelopes on the session socket (image-build of the capsule, workload-run with `gpus`,
`privileged`), and the control-socket `probe` request for n610 and n580 (twice each: the second must
come from the cache). Each step is one row of OUT/gpus.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._daemon import Session, open_session
from bench.e2e_restore import E2EError, Stream, stream_tokens
from coldsnap_provider import call_control

CAPSULE = "coldsnap/capsule-probe:h200"
VISIBLE = r"""
import json, os
from cuda.bindings import driver as d
assert d.cuInit(0)[0] == 0
err, n = d.cuDeviceGetCount()
uuids = []
for i in range(n):
    dev = d.cuDeviceGet(i)[1]
    raw = bytes(d.cuDeviceGetUuid(dev)[1].bytes)
    h = raw.hex()
    uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}")
ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])[1]
d.cuCtxSetCurrent(ctx)
err, ptr = d.cuMemAlloc(1 << 30)
print(json.dumps({"count": n, "uuids": uuids, "alloc_1g": int(err), "nodes": sorted(os.listdir("/dev")),
                  "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")}))
"""


def _docker(docker_host: str, *args: str) -> str:
    env = {**os.environ, "DOCKER_HOST": docker_host}
    return subprocess.run(["docker", *args], capture_output=True, text=True, env=env, check=False).stdout


def _containers(docker_host: str) -> list[str]:
    return _docker(docker_host, "ps", "-aq", "--filter", "label=io.coldsnap-provider.managed=true").split()


class Driver:
    def __init__(self, state_dir: Path, docker_host: str) -> None:
        self.state_dir, self.docker_host = state_dir, docker_host
        self.rows: list[dict[str, Any]] = []
        self.session: Session | None = None

    async def open(self) -> None:
        self.session = await open_session(self.state_dir, f"op-gpus-{os.getpid()}")

    async def runtime(self, action: str, **fields: Any) -> dict[str, Any]:
        if self.session is None:
            raise RuntimeError("no session: open() first")
        out: dict[str, Any] = msgspec.to_builtins(await self.session.runtime(action, **fields))
        return out

    def row(self, step: str, ok: bool, seconds: float, **detail: Any) -> None:
        row = {"step": step, "ok": ok, "seconds": round(seconds, 3), **detail}
        self.rows.append(row)
        print(json.dumps(row)[:1500], flush=True)  # noqa: T201 - a script's report


def _output(reply: dict[str, Any]) -> str:
    runtime = reply.get("runtime") or {}
    raw = runtime.get("output") or ""
    return base64.b64decode(raw).decode(errors="replace") if isinstance(raw, str) else str(raw)




async def engine_cold_start(d: Driver, args: argparse.Namespace) -> None:
    """Item 3: the 8B-shaped engine as a detached workload of the capsule; container create -> first token."""
    run_dir = Path("/tmp/engine-run")
    run_dir.mkdir(exist_ok=True)
    sock = run_dir / "engine.sock"
    sock.unlink(missing_ok=True)
    bench = str(Path(__file__).resolve().parent.parent / "engines")
    await d.runtime("workload-remove", name="engine-cold")
    workload = {
        "name": "engine-cold", "image": CAPSULE, "detached": True, "pull_policy": "never", "network": "none",
        "gpus": ["0"], "shared_memory_bytes": 1 << 30,
        "mounts": [{"source": p, "target": p, "read_only": True}
                   for p in ("/usr", "/lib", "/lib64", "/sbin", "/opt/torch")]
        + [{"source": args.engine, "target": "/weights", "read_only": True},
           {"source": bench, "target": "/opt/engine", "read_only": True},
           {"source": str(run_dir), "target": "/run/engine"}],
        # Triton finds libcuda with /sbin/ldconfig -p, which knows nothing of the driver's binds.
        "environment": {"HOME": "/tmp", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                        "TRITON_LIBCUDA_PATH": "/usr/local/nvidia/lib64"},
        "entrypoint": "/opt/torch/.venv/bin/python3",
        "command": ["/opt/engine/engine_llama.py", "serve", "/weights", "--socket", "/run/engine/engine.sock"]}
    t_create = time.time()
    reply = await d.runtime("workload-run", workload=workload)
    t_started = time.time()
    answer = Stream()
    error = reply.get("error")
    if reply["ok"]:
        with anyio.move_on_after(300):
            while not sock.exists():
                inspect = await d.runtime("workload-inspect", name="engine-cold")
                if not (inspect.get("runtime") or {}).get("running", True):
                    error = "the engine container exited"
                    break
                await anyio.sleep(0.05)
        if sock.exists():
            try:
                answer = await stream_tokens(sock)
            except E2EError as exc:
                error = str(exc)
    first, last, tokens, done = answer.first, answer.last, answer.tokens, answer.done
    logs = await d.runtime("workload-logs", name="engine-cold", tail=0)
    text = _output(logs)
    stages = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "stage" in event:
            stages.append({"stage": event["stage"], "since_create_s": round(event["unix"] - t_create, 3),
                           **{k: v for k, v in event.items() if k in ("tokens", "first_logits_sha256", "version")}})
    await d.runtime("workload-remove", name="engine-cold")
    weights = sum(f.stat().st_size for f in Path(args.engine).iterdir())
    ok = bool(first and done and done.get("tokens") == tokens and len(tokens) == 16)
    d.row("engine cold Docker-to-first-token (create -> first streamed token)", ok, first - t_create if first else 0.0,
          create_and_start_s=round(t_started - t_create, 3),
          first_token_s=round(first - t_create, 3) if first else None,
          sixteen_tokens_s=round(last - t_create, 3) if last else None, tokens=tokens,
          first_logits_sha256=done.get("first_logits_sha256"), weights_bytes=weights, stages=stages,
          error=error, log_tail=text[-3000:] if not done else "")


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--context", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--docker-host", required=True)
    parser.add_argument("--uuid", required=True, help="nvidia-smi's UUID of GPU 0")
    parser.add_argument("--engine", default="", help="weights directory: also time the engine's cold start")
    args = parser.parse_args()
    d = Driver(Path(args.state_dir), args.docker_host)
    await d.open()

    # 1. The capsule image through the daemon's image-build.
    started = time.monotonic()
    dockerfile = (Path(args.context) / "Dockerfile").read_bytes()
    reply = await d.runtime("image-build", build={"dockerfile": base64.b64encode(dockerfile).decode(),
                                                  "context": args.context, "tag": CAPSULE, "pull": False})
    d.row("image-build capsule", reply["ok"], time.monotonic() - started, error=reply.get("error"))
    reply = await d.runtime("image-inspect", image=CAPSULE)
    d.row("image-inspect capsule", reply["ok"], 0.0, value=(reply.get("runtime") or {}).get("value"),
          error=reply.get("error"))

    # 2. gpus=["0"] and gpus=[uuid]: CUDA sees exactly that one GPU (native mode), 1 GiB allocates.
    for label, gpus in (("index", ["0"]), ("uuid", [args.uuid])):
        before = _containers(d.docker_host)
        started = time.monotonic()
        reply = await d.runtime("workload-run", workload={
            "name": "", "image": CAPSULE, "remove_after_exit": True, "pull_policy": "never", "network": "none",
            "gpus": gpus, "entrypoint": "python3", "command": ["-c", VISIBLE]})
        seconds = time.monotonic() - started
        try:
            seen = json.loads(_output(reply).strip().splitlines()[-1])
        except (ValueError, IndexError):
            seen = {"raw": _output(reply)[-2000:]}
        ok = bool(reply["ok"] and seen.get("count") == 1 and seen.get("uuids") == [args.uuid]
                  and seen.get("alloc_1g") == 0)
        d.row(f"gpus by {label} -> CUDA device count 1, same UUID, 1 GiB alloc", ok, seconds, gpus=gpus, seen=seen,
              error=reply.get("error"), leftover=sorted(set(_containers(d.docker_host)) - set(before)))

    # 3. A GPU id the host does not have: runtime_failed naming it, no container left.
    for bad in (["7"], ["GPU-00000000-0000-0000-0000-000000000000"]):
        before = _containers(d.docker_host)
        started = time.monotonic()
        reply = await d.runtime("workload-run", workload={
            "name": "gpu-missing", "image": CAPSULE, "detached": True, "pull_policy": "never",
            "gpus": bad, "command": ["true"]})
        after = _containers(d.docker_host)
        d.row(f"gpus={bad} refused", (not reply["ok"] and reply.get("error_code") == "runtime_failed"
                                      and bad[0] in str(reply.get("error")) and after == before),
              time.monotonic() - started, error=reply.get("error"), error_code=reply.get("error_code"),
              leftover=sorted(set(after) - set(before)))

    # 4. privileged under [runtime] privileged = "host-capabilities": the bounding set, GPUs still exact.
    started = time.monotonic()
    reply = await d.runtime("workload-run", workload={
        "name": "", "image": CAPSULE, "remove_after_exit": True, "pull_policy": "never", "network": "none",
        "privileged": True, "gpus": ["0"], "seccomp_unconfined": True, "entrypoint": "sh",
        "command": ["-c", "grep -E 'CapEff|CapBnd|Seccomp:' /proc/self/status; ls /dev | grep -c . ; ls /dev/nvidia*"]})
    host_bnd = next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("CapBnd"))
    text = _output(reply)
    eff = next((int(line.split()[1], 16) for line in text.splitlines() if line.startswith("CapEff")), 0)
    bnd = int(host_bnd, 16)
    # Every capability the engine can name from the bounding set: SYS_ADMIN (21), SYS_TIME (25) in,
    # SYS_RESOURCE (24, absent from this VM's bounding set) out, nothing beyond the bounding set.
    d.row("privileged (host-capabilities) + gpus",
          bool(reply["ok"] and eff and eff & ~bnd == 0 and eff >> 21 & 1 and eff >> 25 & 1 and not eff >> 24 & 1
               and "/dev/nvidia0" in text), time.monotonic() - started, host_capbnd=host_bnd,
          container_capeff=f"{eff:016x}", output=text[-1500:], error=reply.get("error"))

    # 5. The in-capsule probe through the daemon (control-socket `probe`), each driver twice.
    probes: dict[str, Any] = {}
    for driver in ("n610", "n580"):
        for attempt in ("fresh", "cached"):
            started = time.monotonic()
            try:
                result = await call_control(d.state_dir, {"operation": "probe", "driver": driver, "device": "0",
                                                          "image": CAPSULE})
                error = None
            except Exception as exc:  # recorded as the row's outcome
                result, error = {}, f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - started
            probes[f"{driver}-{attempt}"] = result
            profile = result.get("profile") or {}
            features = {f["id"]: f["status"] for f in profile.get("features", [])}
            d.row(f"probe --image {driver} ({attempt})",
                  bool(result.get("admitted") and result.get("cached") == (attempt == "cached")), seconds,
                  admitted=result.get("admitted"), cached=result.get("cached"), error=error or result.get("error"),
                  identity=profile.get("identity"), features=features)
    (Path(args.out) / "probes.json").write_text(json.dumps(probes, indent=1))
    if args.engine:
        await engine_cold_start(d, args)
    (Path(args.out) / "gpus.json").write_text(json.dumps(d.rows, indent=1))
    return 0 if all(r["ok"] for r in d.rows) else 1


if __name__ == "__main__":
    sys.exit(anyio.run(main))

"""Tensor-parallel capture and restore (issue 16): cold TP engine vs two restores, side by side, plus the failures.

    python bench/tp2_restore.py --criu CRIU --out DIR [--world-size 2] [--layers 16] [--tokens 16]
                                [--root /dev/shm/cs-tp2]

One run, on a host with `--world-size` GPUs (`scripts/device tp-bare` on nvidia-h200-x2), ranks as host processes:
1. cold start: every rank of engines/engine_tp.py from process start (imports, CUDA init, weights, process
   group, graph capture) to the first streamed token; the reference tokens and first-step logits digest.
2. capture: one `python -m coldsnap_probe capture` worker per rank, meeting through a coordinator directory;
   the engine destroys its communicators and collective graph first (`recreate-from-plan` on driver 580).
3. two restores from the unchanged images: one restore worker per rank (CRIU restore paused, CUDA restore
   after every rank exists, released together, communicators recreated and the graph re-captured), then the
   first token; tokens and first-step logits must equal the cold run's, on every rank.
4. what must fail, and leave no rank running: a tampered graph policy record on one rank, a peer that never
   arrives at the barrier, a rank whose restored process dies mid-restore. A last restore shows the images
   still restore after all of them.
Prints one table and writes tp2-restore.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import become_subreaper, kill_and_reap, stages, table
from coldsnap_probe import image_digest

PROMPT = [1, 415, 2936, 9060, 285, 1142, 10575, 754, 272, 17898, 3914]


def generate(engine_dir: Path, max_tokens: int) -> dict[str, Any]:
    """Ask rank 0 for tokens; the unix time of the first streamed token comes back as `first_unix`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(120)
        sock.connect(str(engine_dir / "rank-0.sock"))
        sock.sendall(json.dumps({"op": "generate", "prompt": PROMPT, "max_tokens": max_tokens}).encode() + b"\n")
        first, buffer = 0.0, b""
        while part := sock.recv(1 << 16):
            buffer += part
            if not first and b"\n" in buffer:
                first = time.time()
    lines = [json.loads(line) for line in buffer.splitlines()]
    final = lines[-1]
    if not final.get("done"):
        raise RuntimeError(f"generate failed: {final}")
    return {**final, "first_unix": first}


def start_ranks(command: str, world: int, engine_dir: Path, layers: int, *,
                ras: bool = False) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "NCCL_RAS_ENABLE": "1" if ras else "0"}
    return [subprocess.Popen([sys.executable, str(ROOT / "engines" / "engine_tp.py"), command, "--rank", str(r),
                              "--world-size", str(world), "--dir", str(engine_dir), "--layers", str(layers),
                              "--log", str(engine_dir / f"rank-{r}.log")],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=None if command == "weights" else subprocess.DEVNULL,
                             start_new_session=True, env=env, cwd=ROOT)
            for r in range(world)]


def wait_ready(engine_dir: Path, world: int, procs: list[subprocess.Popen[bytes]], deadline_s: float = 600) -> None:
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        logs = [stages(engine_dir / f"rank-{r}.log") for r in range(world)]
        if any("failed" in s for s in logs) or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a rank failed to start: {[s.get('failed') for s in logs]}")
        if all("ready" in s for s in logs):
            return
        time.sleep(0.05)
    raise RuntimeError("the ranks did not get ready")


def workers(command: str, world: int, extra: dict[int, list[str]], *, ranks: list[int] | None = None,
            on_poll: Any = None) -> list[tuple[int, dict[str, Any] | str]]:
    """One worker per rank, all at once; each rank's report, or its error text."""
    procs = {r: subprocess.Popen([sys.executable, "-m", "coldsnap_probe", command, *extra[r]],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
             for r in (ranks if ranks is not None else range(world))}
    while on_poll is not None and any(p.poll() is None for p in procs.values()):
        on_poll()
        time.sleep(0.001)
    out: list[tuple[int, dict[str, Any] | str]] = []
    for p in procs.values():
        stdout, stderr = p.communicate()
        out.append((p.returncode, json.loads(stdout) if p.returncode == 0 else stderr.decode().strip()[-600:]))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.world = args, args.world_size
        self.root = Path(args.root)
        shutil.rmtree(self.root, ignore_errors=True)
        self.engine_dir, self.coord = self.root / "engine", self.root / "coord"
        self.images = [self.root / "images" / f"rank-{r}" for r in range(self.world)]
        self.engine_dir.mkdir(parents=True)
        self.coord.mkdir()

    def rank_args(self, command: str, namespace: str, images: list[Path] | None = None,
                  timeout: float = 120) -> dict[int, list[str]]:
        images = images or self.images
        return {r: ["--images", str(images[r]), "--criu", self.args.criu, "--rank", str(r), "--world-size",
                    str(self.world), "--coordinator", str(self.coord), "--namespace", namespace,
                    "--barrier-timeout", str(timeout),
                    *(["--work-dir", str(self.root / "work" / f"{namespace}-{r}")] if command == "restore" else [])]
                for r in range(self.world)}

    def cold(self, *, ras: bool = False) -> dict[str, Any]:
        if not (self.engine_dir / "weights-rank-0.json").exists() and any(
                p.wait() != 0 for p in start_ranks("weights", self.world, self.engine_dir, self.args.layers)):
            raise RuntimeError("writing the weights failed")
        for r in range(self.world):  # a fresh log per start: readiness is read from it
            (self.engine_dir / f"rank-{r}.log").unlink(missing_ok=True)
        t0 = time.time()
        procs = start_ranks("serve", self.world, self.engine_dir, self.args.layers, ras=ras)
        try:
            wait_ready(self.engine_dir, self.world, procs)
        except BaseException:
            kill_and_reap([p.pid for p in procs])
            raise
        result = generate(self.engine_dir, self.args.tokens)
        again = generate(self.engine_dir, self.args.tokens)
        logs = [stages(self.engine_dir / f"rank-{r}.log") for r in range(self.world)]
        start = logs[0]["process_start"]["unix_start"]
        return {"ttft_s": result["first_unix"] - t0, "tokens": result["tokens"],
                "first_logits_sha256": result["first_logits_sha256"], "peers_agree": result["peers_agree"],
                "repeatable": again["tokens"] == result["tokens"],
                "stages_s": {k: round(v["unix"] - start, 3) for k, v in logs[0].items()},
                "process_group_s": logs[0]["process_group"]["seconds"],
                "graph_capture_s": logs[0]["graph_capture"]["seconds"],
                "pids": [p.pid for p in procs], "procs": procs}

    def capture_workers(self, pids: list[int], namespace: str,
                        images: list[Path]) -> list[tuple[int, dict[str, Any] | str]]:
        extra = self.rank_args("capture", namespace, images)
        for r in range(self.world):
            extra[r] += ["--pid", str(pids[r]), "--engine", str(self.engine_dir / f"rank-{r}.sock"),
                         "--hydration", str(self.engine_dir / f"rank-{r}.weights.sock")]
        return workers("capture", self.world, extra)

    def capture(self, pids: list[int], procs: list[subprocess.Popen[bytes]]) -> list[dict[str, Any]]:
        results = self.capture_workers(pids, "capture", self.images)
        if any(rc != 0 for rc, _ in results):
            kill_and_reap([p.pid for p in procs])
            raise RuntimeError(f"capture failed: {results}")
        for p in procs:
            p.wait()  # the captured ranks end with the capture: reap them so their PIDs are free for restore
        return [report for _, report in results]  # type: ignore[misc]

    def restore(self, namespace: str, reference: dict[str, Any]) -> dict[str, Any]:
        t0 = time.time()
        results = workers("restore", self.world, self.rank_args("restore", namespace))
        if any(rc != 0 for rc, _ in results):
            kill_and_reap([r["restored_pid"] for rc, r in results if rc == 0])  # type: ignore[index]
            raise RuntimeError(f"restore {namespace} failed: {results}")
        reports: list[dict[str, Any]] = [r for _, r in results]  # type: ignore[misc]
        workers_done = time.time()
        result = generate(self.engine_dir, self.args.tokens)
        kill_and_reap([r["restored_pid"] for r in reports])
        return {"ttft_s": result["first_unix"] - t0, "workers_s": workers_done - t0,
                "identical": result["tokens"] == reference["tokens"]
                and result["first_logits_sha256"] == reference["first_logits_sha256"] and result["peers_agree"],
                "tokens": result["tokens"], "ranks": [{
                    "criu_s": r["criu_restore_seconds"], "cuda_s": r.get("cuda_restore_seconds"),
                    "recreate_s": r.get("communicator_recreate_seconds"),
                    "hydration_s": r.get("hydration", {}).get("phase_seconds"),
                    "hydration_gbps": r.get("hydration", {}).get("gbps"),
                    "nccl_init_s": r.get("engine_resume", {}).get("init_seconds"),
                    "graph_capture_s": r.get("engine_resume", {}).get("capture_seconds"),
                    "barrier_wait_s": r.get("barrier_wait_s"), "ready_s": r["ready_seconds"]} for r in reports]}

    def failures(self) -> list[dict[str, Any]]:
        rows = []
        # A tampered graph policy record on the last rank (in a copy: the images stay unchanged).
        tampered = self.root / "images-tampered"
        shutil.copytree(self.images[-1], tampered)
        record = json.loads((tampered / "graph.json").read_text())
        record["record"]["decision"] = "qualified_exact_nccl_in_place"
        (tampered / "graph.json").write_text(json.dumps(record))
        results = workers("restore", self.world, self.rank_args("restore", "tampered",
                                                                [*self.images[:-1], tampered]))
        rows.append(self._failure("tampered graph record on the last rank", results))
        # A peer that never arrives: only rank 0 is started.
        results = workers("restore", self.world, self.rank_args("restore", "lonely", timeout=5), ranks=[0])
        rows.append(self._failure("peer never arrives (rank 0 alone, 5 s barrier)", results))
        # A rank's restored process dies between its CRIU restore and its CUDA restore.
        victim = self.coord / "dies" / "criu-restored" / f"{self.world - 1}.json"
        killed: list[int] = []

        def kill_victim() -> None:
            if not killed and victim.exists():
                try:
                    pid = int(json.loads(victim.read_text())["value"]["pid"])
                except (ValueError, KeyError, OSError):
                    return
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)

        results = workers("restore", self.world, self.rank_args("restore", "dies", timeout=30), on_poll=kill_victim)
        rows.append(self._failure(f"rank {self.world - 1}'s restored process killed after CRIU", results))
        return rows

    def refused_capture(self, reference: dict[str, Any]) -> dict[str, Any]:
        """Engines that keep NCCL's RAS sockets: every rank's capture is refused and every rank keeps serving."""
        cold = self.cold(ras=True)
        images = [self.root / "images-refused" / f"rank-{r}" for r in range(self.world)]
        results = self.capture_workers(cold["pids"], "capture-refused", images)
        alive_after = all(alive(p) for p in cold["pids"])
        served = generate(self.engine_dir, self.args.tokens) if alive_after else {}
        kill_and_reap(cold["pids"])
        return {"case": "capture with NCCL RAS sockets left after quiesce", "every_rank_failed":
                all(rc != 0 for rc, _ in results), "ranks_still_serving": alive_after,
                "same_tokens_after_rollback": served.get("tokens") == reference["tokens"]
                and served.get("first_logits_sha256") == reference["first_logits_sha256"],
                "errors": [str(e)[-300:] for _, e in results]}

    def _failure(self, case: str, results: list[tuple[int, dict[str, Any] | str]]) -> dict[str, Any]:
        present = [p for p in self._restored_pids() if Path(f"/proc/{p}").exists()]
        survivors = [p for p in present if alive(p)]
        kill_and_reap(present)  # the zombies too: a restored PID must be free for the next restore
        return {"case": case, "every_rank_failed": all(rc != 0 for rc, _ in results),
                "ranks_left_running": len(survivors), "errors": [str(e)[-300:] for _, e in results]}

    def _restored_pids(self) -> list[int]:
        pids = []
        for path in self.coord.glob("*/criu-restored/*.json"):
            pids.append(int(json.loads(path.read_text())["value"]["pid"]))
        return pids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--criu", default="criu")
    parser.add_argument("--out", required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--root", default="/dev/shm/cs-tp2")
    args = parser.parse_args()
    become_subreaper()
    run = Run(args)
    cold = run.cold()
    print(f"cold: {cold['ttft_s']:.2f} s to the first token, tokens {cold['tokens'][:8]}...", flush=True)
    captures = run.capture(cold.pop("pids"), cold.pop("procs"))
    print(f"captured: {[c['timings_s'] for c in captures]}", flush=True)
    before = [image_digest(p) for p in run.images]
    restores = [run.restore(f"restore-{i}", cold) for i in (1, 2)]
    failures = run.failures()
    restores.append(run.restore("restore-after-failures", cold))
    refused = run.refused_capture(cold)
    unchanged = [image_digest(p) for p in run.images] == before
    result = {"world_size": args.world_size, "layers": args.layers, "cold": cold, "restores": restores,
              "failures": failures, "refused_capture": refused, "images_unchanged": unchanged,
              "capture": [{"cuda_checkpoint_s": c["timings_s"].get("cuda_checkpoint"),
                           "criu_dump_s": c["timings_s"].get("criu_dump"),
                           "quiesce_s": c["timings_s"].get("engine_quiesce"), "image_bytes": c["image_bytes"],
                           "graph_policy": c.get("graph_policy")} for c in captures]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp2-restore.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    rows = [["cold start", f"{cold['ttft_s']:.2f}", "-", "-", "-", "-", "-", "reference"]]
    for i, r in enumerate(restores):
        ranks = r["ranks"]
        rows.append([f"restore {i + 1}", f"{r['ttft_s']:.2f}",
                     " / ".join(f"{x['criu_s']:.2f}" for x in ranks),
                     " / ".join(f"{x['cuda_s']:.2f}" for x in ranks),
                     " / ".join(f"{x['hydration_s'] or 0:.2f}" for x in ranks),
                     " / ".join(f"{x['recreate_s']:.2f}" for x in ranks),
                     f"{cold['ttft_s'] / r['ttft_s']:.1f}x", "identical" if r["identical"] else "DIFFERENT"])
    print(table(["run", "to first token (s)", "CRIU restore per rank (s)", "CUDA restore per rank (s)",
                 "weight hydration per rank (s)", "NCCL + graph recreate per rank (s)", "vs cold",
                 "tokens + first logits"], rows))
    print(table(["failure", "every rank failed", "ranks left running"],
                [[f["case"], f["every_rank_failed"], f["ranks_left_running"]] for f in failures]))
    print(table(["capture failure", "every rank refused", "ranks still serving", "same tokens after rollback"],
                [[refused["case"], refused["every_rank_failed"], refused["ranks_still_serving"],
                  refused["same_tokens_after_rollback"]]]))
    print(f"images unchanged: {unchanged}; image bytes per rank: {[c['image_bytes'] for c in captures]}")


if __name__ == "__main__":
    main()

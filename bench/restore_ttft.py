"""Restore to first token vs cold start to first token, side by side (run on the GPU machine).

    python bench/restore_ttft.py --sizes 2,16 --criu /path/to/criu [--root /tmp/coldsnap-ttft]

For each size: a cold start of bench/_ttft_server.py timed from process start to the first
streamed token (with its stages: imports, CUDA init, weight load, graph capture); a capture by
the worker (`python -m coldsnap_probe capture`); two restores from the same unchanged images,
each timed from the restore command to the first token. The restored process must produce the
same tokens and the same first-step logits (bitwise) as the original. Pinned host-to-device
bandwidth is measured in the same run. Results: a table on stdout and JSON in --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "bench" / "_ttft_server.py"
PROMPT = [1, 15043, 29892, 920, 526, 366, 29973, 13]
sys.path.insert(0, str(ROOT))

from bench._common import table
from coldsnap_probe import image_digest

PR_SET_CHILD_SUBREAPER = 36


def connect(path: Path, deadline_s: float = 120.0) -> socket.socket:
    """Connect, retrying until the (restored) server listens again."""
    give_up = time.time() + deadline_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError:
            sock.close()
            if time.time() > give_up:
                raise
            time.sleep(0.002)


def operation(path: Path, op: str) -> float:
    """`sleep` (release the weights' backing) or `wake` (re-map and hydrate); returns the server's seconds."""
    with connect(path) as sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps({"op": op}).encode() + b"\n")
        stream.flush()
        return float(json.loads(stream.readline())["seconds"])


def request(path: Path, max_tokens: int) -> tuple[float, list[int], str]:
    """(first-token unix time, tokens, first-logits digest)."""
    with connect(path) as sock, sock.makefile("rwb") as stream:
        stream.write(json.dumps({"prompt": PROMPT, "max_tokens": max_tokens}).encode() + b"\n")
        stream.flush()
        first, tokens = 0.0, []
        for line in stream:
            message = json.loads(line)
            if "token" in message:
                first = first or time.time()
                tokens.append(message["token"])
            elif message.get("done"):
                return first, tokens, message["first_logits_sha256"]
    raise RuntimeError("server closed the stream early")


def stages(log: Path) -> dict[str, dict[str, Any]]:
    """The server's stage lines by name (first occurrence): {"unix": ..., ...}."""
    marks: dict[str, dict[str, Any]] = {}
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        marks.setdefault(entry["stage"], entry)
    return marks


def pinned_h2d_gbps() -> float:
    code = "\n".join([
        "import torch, time",
        "x = torch.empty(4 << 30, dtype=torch.uint8).pin_memory(); y = torch.empty_like(x, device='cuda')",
        "best = 1e9",
        "for _ in range(5):",
        "    torch.cuda.synchronize(); t = time.perf_counter(); y.copy_(x, non_blocking=True)",
        "    torch.cuda.synchronize(); best = min(best, time.perf_counter() - t)",
        "print((4 << 30) / best / 1e9)"])
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def worker(*args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker {args[0]} failed: {done.stderr.strip()}")
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def kill_tree(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    while True:  # we are the subreaper of the restored tree: reap it so its PIDs are free again
        try:
            if os.waitpid(-1, 0)[0] == pid:
                return
        except ChildProcessError:
            return


def run_size(gib: float, root: Path, criu: str, max_tokens: int, hydrate: bool) -> dict[str, Any]:
    """One size in one mode: the whole device state in the images, or weights hydrated after restore."""
    weights = root / f"weights-{gib:g}g.bin"
    if not weights.exists():
        subprocess.run([sys.executable, str(SERVER), "--gib", str(gib), "--weights", str(weights), "--generate"],
                       check=True)
    images = root / f"images-{gib:g}g{'-hydrate' if hydrate else ''}"
    subprocess.run(["rm", "-rf", str(images)], check=True)
    log = root / f"server-{gib:g}g.log"
    path = root / f"server-{gib:g}g.sock"
    path.unlink(missing_ok=True)
    # Cold start: from process start to the first token.
    t0 = time.time()
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, str(SERVER), "--gib", str(gib), "--weights", str(weights),
                                   "--socket", str(path), *(["--vmm-weights"] if hydrate else [])],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                  start_new_session=True)
    while "ready" not in stages(log):
        if server.poll() is not None:
            raise RuntimeError(f"server exited {server.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.01)
    cold_first, cold_tokens, cold_hash = request(path, max_tokens)
    entries = stages(log)
    device_bytes = entries["graph_captured"]["device_bytes"]
    marks = {name: entry["unix"] for name, entry in entries.items()}
    cold = {"ttft_s": cold_first - t0,
            "interpreter_s": marks["process_start"] - t0,  # python itself, before `import torch`
            "cuda_init_s": marks["cuda_init"] - t0,  # process start, imports and CUDA context
            "weight_load_s": marks["weights_loaded"] - marks["cuda_init"],
            "graph_capture_s": marks["graph_captured"] - marks["weights_loaded"],
            "first_token_s": cold_first - marks["ready"]}
    # Capture (the worker kills the dumped tree; reap the original so its PID is free for restore).
    sleep_s = operation(path, "sleep") if hydrate else 0.0
    capture = worker("capture", "--pid", str(server.pid), "--images", str(images), "--criu", criu)
    server.wait()
    digest_before = image_digest(images)
    restores = []
    for attempt in (1, 2):
        path.unlink(missing_ok=True)  # the dead process's socket file; the restored one binds it again
        t0 = time.time()
        report = worker("restore", "--images", str(images), "--criu", criu,
                        "--work-dir", str(images.with_name(f"{images.name}-work-{attempt}")))
        wake_s = operation(path, "wake") if hydrate else 0.0
        first, tokens, first_hash = request(path, max_tokens)
        restores.append({"ttft_s": first - t0, "criu_restore_s": report["criu_restore_seconds"],
                         "cuda_restore_s": report["cuda_restore_seconds"],
                         "worker_s": report["restore_seconds"], "wake_s": wake_s,
                         "tokens_identical": tokens == cold_tokens, "logits_identical": first_hash == cold_hash,
                         "timeline": report["timeline"]})
        kill_tree(report["restored_pid"])
    unchanged = image_digest(images) == digest_before
    for done in (images, *images.parent.glob(f"{images.name}-work-*")):  # the disk holds one size at a time
        subprocess.run(["rm", "-rf", str(done)], check=True)
    return {"gib": gib, "mode": "weights hydrated" if hydrate else "full image", "device_bytes": device_bytes,
            "sleep_s": sleep_s, "cold": cold, "capture": capture["timings_s"],
            "image_bytes": capture["image_bytes"], "restores": restores, "images_unchanged": unchanged,
            "tokens": cold_tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="2,16")
    parser.add_argument("--criu", default="criu")
    parser.add_argument("--root", default="/tmp/coldsnap-ttft")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--modes", default="full", help="comma-separated: full (whole state in the images), "
                                                         "hydrate (weights re-hydrated after restore)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)  # restored trees are reparented to us
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    h2d = pinned_h2d_gbps()
    results = [run_size(float(size), root, args.criu, args.tokens, mode == "hydrate")
               for size in args.sizes.split(",") for mode in args.modes.split(",")]
    rows = []
    for r in results:
        c, best = r["cold"], min(r["restores"], key=lambda x: x["ttft_s"])
        # Device bytes back per second: through the CUDA restore, or (hydrated) through restore + wake.
        gbps = r["device_bytes"] / (best["cuda_restore_s"] + best["wake_s"]) / 1e9
        rows.append([f"{r['gib']:g} GiB", r["mode"], f"{c['ttft_s']:.2f}", f"{best['ttft_s']:.2f}",
                     f"{c['ttft_s'] / best['ttft_s']:.2f}x",
                     f"{c['cuda_init_s']:.2f} / {c['weight_load_s']:.2f} / {c['graph_capture_s']:.2f}",
                     f"{best['criu_restore_s']:.2f} / {best['cuda_restore_s']:.2f} / {best['wake_s']:.2f}",
                     f"{r['image_bytes'] / 1e9:.1f}",
                     f"{gbps:.1f} ({gbps / h2d:.0%} of {h2d:.1f})",
                     "yes" if all(x["tokens_identical"] and x["logits_identical"] for x in r["restores"]) else "NO",
                     "yes" if r["images_unchanged"] else "NO"])
    print(table(["model", "mode", "cold TTFT s", "restore TTFT s", "speed-up", "cold: CUDA init / weights / graphs s",
                 "restore: CRIU / CUDA / hydrate s", "images GB", "device GB/s back (of pinned H2D)",
                 "identical tokens+logits", "images unchanged"], rows))
    Path(args.out, "restore_ttft.json").write_text(json.dumps({"pinned_h2d_gbps": h2d, "results": results},
                                                               indent=2))


if __name__ == "__main__":
    main()

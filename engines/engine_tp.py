"""A tensor-parallel engine (issues 16, 27, 28): a Llama-shaped decoder sharded over N ranks, NCCL all-reduce in
CUDA graphs, at any world size and up to 70B/405B layer shapes.

    python engines/engine_tp.py weights --rank R --world-size N --dir DIR [--shape small|70b|405b] [--layers L]
    python engines/engine_tp.py serve --rank R --world-size N --dir DIR [--weights WDIR] [--shape S] [--layers L]
                                      [--hydrator SOCKET] [--log FILE]

One process per rank, one GPU each (`cuda:R`, or the only visible one), torch.distributed with NCCL over a
FileStore in DIR (`NCCL_NVLS_ENABLE=0`, `NCCL_RAS_ENABLE=0`; peer-to-peer left on). Attention heads and the MLP
are split Megatron-style: q/k/v and gate/up column-parallel, o and down row-parallel, so each layer all-reduces
twice; embedding, norms and the LM head are replicated, so every rank computes the same logits and the same
greedy token. Shapes (`SHAPES`): `small` (hidden 4096, 32/8 heads, FFN 14336, vocab 32000, 16 layers), `70b`
(Llama-3-70B: hidden 8192, 64/8 heads, FFN 28672, vocab 128256, 80 layers) and `405b` (hidden 16384, 128/8
heads, FFN 53248, 126 layers); `--layers` takes fewer (the bench's "largest that fits"). Weights come from fixed
seeds per (layer, matrix, rank), generated on the rank's GPU and written once per rank to
WDIR/weights-rank-R.bin (WDIR defaults to DIR; /dev/shm on the GPU machines). Serving loads them into a
`coldsnap_probe.WeightArena` (a VMM reservation every weight tensor is a view of) whose control socket
DIR/rank-R.weights.sock lets the capture worker release them and the restore worker hydrate them back at the
same addresses, so the CRIU images carry no weights. With `--hydrator SOCKET` the arena is exportable and every
hydration after a restore goes through that node hydrator (the rank's weights page-locked once, staged on the
rank's GPU while CRIU restores the process, adopted by the engine); the cold load reads the file itself.
One decode step (token and position in device tensors, static KV cache, masked attention over it, greedy
argmax) is captured in a CUDA graph *with its collectives*; the prompt is fed through the same graph.
Cold-start stages go to FILE as JSON lines (opened and closed per line: no descriptor held across a
checkpoint).

Control socket DIR/rank-R.sock, one JSON line per connection, answer read to EOF:
* `{"op": "generate", "prompt": [ids], "max_tokens": n}` to rank 0 streams `{"token", "unix"}` lines, then
  `{"done": true, "tokens", "first_logits_sha256", "decode_tokens_per_s", "peers_agree"}`; rank 0 forwards it to
  the other ranks (which answer their tokens) so that every rank runs the same collective steps.
* `{"op": "allreduce", "bytes": b, "iters": n}` to rank 0: every rank all-reduces a bf16 buffer of b bytes n
  times (after two warm-up rounds) on the process group; answers each rank's algorithm and bus bandwidth
  (busbw = algbw * 2(N-1)/N, as nccl-tests reports it). The buffer is freed afterwards.
* `{"op": "quiesce", "policy": p}`: the capture's request. Drops the graph (it holds NCCL kernels), destroys
  the process group and its communicators, and answers `communicators: 0`. `preserve-nccl-exec` is refused:
  this engine has no in-place NCCL provider.
* `{"op": "resume", "store": path, "rank", "world_size"}`: a fresh process group on that store, then warm-up
  and graph re-capture (`recreate-from-plan`); answers the seconds spent.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # the process start is stamped before anything is imported
import hashlib
import json
import os
import socket
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_COMMON = {"head_dim": 128, "max_seq": 512, "eps": 1e-5, "rope_theta": 500000.0}
SHAPES: dict[str, dict[str, Any]] = {  # bench/tp_plan.py sizes each rank's bytes from the same numbers
    "small": {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000, "layers": 16, **_COMMON},
    "70b": {"hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "vocab": 128256, "layers": 80, **_COMMON},
    "405b": {"hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "vocab": 128256, "layers": 126,
             **_COMMON},
}
LOG_PATH = ""


def stage(name: str, **extra: object) -> None:
    if LOG_PATH:
        with open(LOG_PATH, "a") as log:
            log.write(json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(), **extra}) + "\n")


ALIGN = 1 << 12  # every tensor's offset in a rank's weight file (and so in its arena)


def weight_paths(directory: str, rank: int) -> tuple[Path, Path]:
    return Path(directory, f"weights-rank-{rank}.bin"), Path(directory, f"weights-rank-{rank}.json")


def weight_specs(shape: str, world_size: int, layers: int, rank: int) -> list[tuple[str, tuple[int, int], int, int]]:
    """(name, shape, seed, fan-in) of every weight of a rank, in file order (seeds fixed per rank); bench/tp_plan.py
    sizes the files from the same list."""
    s = SHAPES[shape]
    d, hidden = s["head_dim"], s["hidden"]
    heads, kv_heads, ffn = s["heads"] // world_size, s["kv_heads"] // world_size, s["ffn"] // world_size
    out = [("embed", (s["vocab"], hidden), 1, 1), ("lm_head", (s["vocab"], hidden), 2, hidden)]
    for layer in range(layers):
        seed = 1000 * (layer + 1) + 10 * rank
        out += [(f"{layer}.q", (heads * d, hidden), seed + 1, hidden),
                (f"{layer}.k", (kv_heads * d, hidden), seed + 2, hidden),
                (f"{layer}.v", (kv_heads * d, hidden), seed + 3, hidden),
                (f"{layer}.o", (hidden, heads * d), seed + 4, s["heads"] * d),
                (f"{layer}.gate", (ffn, hidden), seed + 5, hidden),
                (f"{layer}.up", (ffn, hidden), seed + 6, hidden),
                (f"{layer}.down", (hidden, ffn), seed + 7, s["ffn"])]
    return out


class Engine:
    def __init__(self, rank: int, world_size: int, layers: int, shape: str = "small") -> None:
        import torch

        self.torch = torch
        self.rank, self.world_size, self.layers, self.shape = rank, world_size, layers, shape
        s = self.s = SHAPES[shape]
        if s["heads"] % world_size or s["kv_heads"] % world_size or s["ffn"] % world_size:
            raise ValueError(f"the {shape} shape does not split over {world_size} ranks")
        if not 1 <= layers <= s["layers"]:
            raise ValueError(f"layers must be within [1, {s['layers']}] for the {shape} shape, got {layers}")
        self.device = torch.device("cuda", rank if torch.cuda.device_count() > rank else 0)
        torch.cuda.set_device(self.device)
        torch.cuda.init()
        stage("cuda_init")
        self.heads, self.kv_heads, self.ffn = (s["heads"] // world_size, s["kv_heads"] // world_size,
                                               s["ffn"] // world_size)
        self.graph: Any = None
        self.communicators = 0
        self.arena: Any = None

    def load(self, directory: str, hydrator: str = "") -> None:
        """The rank's weight file into a WeightArena (digests checked); every weight a view of the arena.
        With a hydrator the arena is exportable, so that the hydrator can fill it after a restore."""
        from engine_llama import DeviceBytes  # a sibling script: bench/ on the host, /opt/engine in a capsule

        from coldsnap_probe import WeightArena, WeightRegion

        torch = self.torch
        data, index_path = weight_paths(directory, self.rank)
        index = json.loads(index_path.read_text())
        found = (index.get("shape", "small"), index["layers"], index["world_size"])
        if found != (self.shape, self.layers, self.world_size):
            raise ValueError(f"{data} holds {found[1]} {found[0]} layers of {found[2]} ranks, not {self.layers} "
                             f"{self.shape} layers of {self.world_size}")
        self.arena = WeightArena(index["bytes"], device=self.device.index, exportable=bool(hydrator))
        self.arena.declare([WeightRegion(f"rank-{self.rank}", self.arena.address, index["bytes"], str(data), 0,
                                         index["digest"])])
        report = self.arena.load(strategy="ring")
        stage("weights_loaded", **{k: v for k, v in report.items() if k != "strategy"})
        views = {name: torch.as_tensor(DeviceBytes(self.arena.address + offset, int(torch.Size(shape).numel()) * 2),
                                       device=self.device).view(torch.bfloat16).view(shape)
                 for name, (offset, shape) in index["tensors"].items()}
        self.embed, self.lm_head = views["embed"], views["lm_head"]
        self.blocks = [{k: views[f"{layer}.{k}"] for k in ("q", "k", "v", "o", "gate", "up", "down")}
                       for layer in range(self.layers)]
        self._state()

    def random_weight(self, shape: tuple[int, ...], seed: int, fan_in: int) -> Any:
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return (torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
                * fan_in ** -0.5).to(torch.bfloat16)

    def _state(self) -> None:
        """The KV cache, rotary tables and the graph's input and output tensors."""
        torch, s, d = self.torch, self.s, self.s["head_dim"]
        self.kv = torch.zeros((self.layers, 2, s["max_seq"], self.kv_heads, d), dtype=torch.bfloat16,
                              device=self.device)
        inv = 1.0 / (s["rope_theta"] ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(s["max_seq"], device=self.device, dtype=torch.float32), inv)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.token = torch.zeros(1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.positions = torch.arange(s["max_seq"], device=self.device)
        self.logits = torch.zeros(s["vocab"], dtype=torch.float32, device=self.device)
        self.next = torch.zeros(1, dtype=torch.long, device=self.device)
        torch.cuda.synchronize()

    # -- the decode step (captured) -------------------------------------------------------------------------
    def _norm(self, x: Any) -> Any:
        torch = self.torch
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.s["eps"])).to(torch.bfloat16)

    def _rope(self, x: Any) -> Any:
        torch = self.torch
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # [1, d/2]
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(torch.bfloat16)

    def _step(self) -> None:
        torch, d = self.torch, self.s["head_dim"]
        dist = torch.distributed
        x = self.embed[self.token]  # [1, hidden]
        masked = (self.positions > self.pos).view(1, -1)  # [1, S]
        for layer, w in enumerate(self.blocks):
            h = self._norm(x)
            q = self._rope((h @ w["q"].T).view(self.heads, d))
            k = self._rope((h @ w["k"].T).view(self.kv_heads, d))
            v = (h @ w["v"].T).view(self.kv_heads, d)
            self.kv[layer, 0].index_copy_(0, self.pos, k.unsqueeze(0))
            self.kv[layer, 1].index_copy_(0, self.pos, v.unsqueeze(0))
            keys = self.kv[layer, 0].repeat_interleave(self.heads // self.kv_heads, dim=1)  # [S, h, d]
            values = self.kv[layer, 1].repeat_interleave(self.heads // self.kv_heads, dim=1)
            scores = torch.einsum("hd,shd->hs", q.float(), keys.float()) * d ** -0.5
            probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
            attn = torch.einsum("hs,shd->hd", probs, values.float()).to(torch.bfloat16).view(1, -1)
            out = attn @ w["o"].T
            if self.world_size > 1:
                dist.all_reduce(out)
            x = x + out
            h = self._norm(x)
            mlp = (torch.nn.functional.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T
            if self.world_size > 1:
                dist.all_reduce(mlp)
            x = x + mlp
        self.logits.copy_((self._norm(x) @ self.lm_head.T).float().view(-1))
        self.next.copy_(self.logits.argmax().view(1))

    # -- communicators and the graph --------------------------------------------------------------------------
    def connect(self, store_path: str) -> float:
        torch = self.torch
        started = time.perf_counter()
        if self.world_size > 1:
            store = torch.distributed.FileStore(store_path, self.world_size)
            torch.distributed.init_process_group("nccl", store=store, rank=self.rank, world_size=self.world_size,
                                                 device_id=self.device, timeout=timedelta(seconds=120))
            probe = torch.ones(1, device=self.device)
            torch.distributed.all_reduce(probe)  # the communicator exists and works before the graph needs it
            torch.cuda.synchronize()
            self.communicators = 1
        return time.perf_counter() - started

    def capture_graph(self) -> float:
        torch = self.torch
        started = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def quiesce(self) -> dict[str, Any]:
        torch = self.torch
        started = time.perf_counter()
        torch.cuda.synchronize()
        self.graph = None  # its NCCL kernels reference the communicator about to go
        if self.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.communicators = 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the graph's pool: less device state to checkpoint
        return {"communicators": self.communicators, "graphs": 0, "seconds": time.perf_counter() - started}

    def resume(self, store: str) -> dict[str, Any]:
        init = self.connect(store)
        graph = self.capture_graph()
        return {"communicators": self.communicators, "graphs": 1, "init_seconds": init, "capture_seconds": graph,
                "seconds": init + graph}

    def generate(self, prompt: list[int], max_tokens: int, emit: Any = None) -> dict[str, Any]:
        if self.graph is None:
            raise RuntimeError("the engine is quiesced: no graph to run")
        if not prompt or max_tokens < 1 or len(prompt) + max_tokens > self.s["max_seq"]:
            raise ValueError(f"prompt and max_tokens (>= 1) must fit in {self.s['max_seq']} positions")
        tokens: list[int] = []
        first, stamps = "", []
        for position in range(len(prompt) + max_tokens - 1):
            if position < len(prompt):
                self.token.fill_(prompt[position])
            self.pos.fill_(position)
            self.graph.replay()
            if position >= len(prompt) - 1:
                token = int(self.next.item())  # waits for the step: each stamp is a finished token
                stamps.append(time.perf_counter())
                if not first:
                    first = hashlib.sha256(self.logits.cpu().numpy().tobytes()).hexdigest()
                tokens.append(token)
                self.token.copy_(self.next)
                if emit is not None:
                    emit({"token": token, "unix": time.time()})
        decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
        return {"tokens": tokens, "first_logits_sha256": first, "decode_tokens_per_s": decode}

    def allreduce(self, size: int, iters: int) -> dict[str, Any]:
        """Bus bandwidth of an all-reduce of `size` bytes on the process group (nccl-tests' definition)."""
        torch = self.torch
        if self.world_size < 2 or not torch.distributed.is_initialized():
            raise RuntimeError("no process group to all-reduce on")
        if not (1 << 20) <= size <= (8 << 30) or not 1 <= iters <= 1000:
            raise ValueError("bytes must be within [1 MiB, 8 GiB] and iters within [1, 1000]")
        with torch.cuda.device(self.device):  # a request's thread starts on device 0: pin it to this rank's GPU
            buffer = torch.zeros(size // 2, dtype=torch.bfloat16, device=self.device)
            try:
                for _ in range(2):  # warm-up: NCCL sets up its channels for this size
                    torch.distributed.all_reduce(buffer)
                torch.cuda.synchronize(self.device)
                started = time.perf_counter()
                for _ in range(iters):
                    torch.distributed.all_reduce(buffer)
                torch.cuda.synchronize(self.device)
                seconds = (time.perf_counter() - started) / iters
            finally:
                del buffer
                torch.cuda.empty_cache()  # nothing of the measurement stays in the device state a capture saves
        algbw = size / seconds / 1e9
        return {"rank": self.rank, "bytes": size, "iters": iters, "seconds": seconds, "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (self.world_size - 1) / self.world_size}


def _fan_out(engine: Engine, directory: str, message: dict[str, Any], own: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Rank 0 sends `message` to every other rank and runs `own()` meanwhile: every rank runs the same collective
    steps. Returns rank 0's result and the others' answers, in rank order."""
    from coldsnap_probe import jsonline

    with ThreadPoolExecutor(max(1, engine.world_size - 1)) as pool:
        peers = [pool.submit(jsonline.request, os.path.join(directory, f"rank-{rank}.sock"), message, timeout=600.0)
                 for rank in range(1, engine.world_size)]
        result = own()
        return result, [peer.result() for peer in peers]


def _handle(engine: Engine, directory: str, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
    """The answer to one control request (a generation streams its tokens first)."""
    from coldsnap_probe import jsonline

    op = request.get("op")
    if op == "quiesce":
        if request.get("policy") == "preserve-nccl-exec":
            raise ValueError("preserve-nccl-exec needs an admitted in-place NCCL provider; this engine has none")
        return {"ok": True, **engine.quiesce()}
    if op == "resume":
        if (request.get("rank"), request.get("world_size")) != (engine.rank, engine.world_size):
            raise ValueError(f"resume names rank {request.get('rank')} of {request.get('world_size')}, "
                             f"this is rank {engine.rank} of {engine.world_size}")
        return {"ok": True, **engine.resume(str(request["store"]))}
    if op == "status":
        return {"ok": True, "rank": engine.rank, "communicators": engine.communicators,
                "graph": engine.graph is not None}
    if op == "allreduce":
        size, iters = int(request["bytes"]), int(request["iters"])
        if engine.rank != 0:
            return {"ok": True, **engine.allreduce(size, iters)}
        mine, others = _fan_out(engine, directory, {"op": "allreduce", "bytes": size, "iters": iters},
                                lambda: engine.allreduce(size, iters))
        return {"ok": True, "ranks": [mine, *others], "busbw_gbps": min(r["busbw_gbps"] for r in [mine, *others])}
    if op != "generate":
        raise ValueError(f"unknown op {op!r}")
    prompt, max_tokens = [int(t) for t in request["prompt"]], int(request["max_tokens"])
    if engine.rank != 0:
        return {"ok": True, **engine.generate(prompt, max_tokens)}
    message = {"op": "generate", "prompt": prompt, "max_tokens": max_tokens}
    result, answers = _fan_out(engine, directory, message,
                               lambda: engine.generate(prompt, max_tokens,
                                                       emit=lambda line: jsonline.send_line(conn, line)))
    agree = all(a.get("tokens") == result["tokens"] and a.get("first_logits_sha256") == result["first_logits_sha256"]
                for a in answers)
    return {"done": True, **result, "peers_agree": agree}


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    """All of `data` at `offset` (one write moves at most 2 GiB - 4 KiB on Linux; a 405B embedding is 4.2 GB)."""
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def write_weights(rank: int, world_size: int, directory: str, layers: int, shape: str) -> None:
    """The rank's weights, generated on its GPU, written to a new file in `directory` (renamed into place once
    whole, with its index: a file that exists is complete); the host copy and the write overlap the next
    tensor's generation."""
    from coldsnap_probe import region_digest

    engine = Engine(rank, world_size, layers, shape)
    data, index_path = weight_paths(directory, rank)
    partial = data.with_suffix(".partial")
    tensors, offset, started = {}, 0, time.perf_counter()
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        with ThreadPoolExecutor(2) as writers:
            pending: list[Any] = []
            for name, dims, seed, fan_in in weight_specs(shape, world_size, layers, rank):
                host = engine.random_weight(dims, seed, fan_in).view(engine.torch.uint8).cpu().numpy()
                pending.append(writers.submit(_write_at, fd, memoryview(host).cast("B"), offset))
                tensors[name] = (offset, list(dims))
                offset = -(-(offset + host.nbytes) // ALIGN) * ALIGN
                if len(pending) > 2:  # at most three tensors on the host at once
                    pending.pop(0).result()
            for done in pending:
                done.result()
        os.ftruncate(fd, offset)
    finally:
        os.close(fd)
    written = time.perf_counter() - started
    index = {"shape": shape, "layers": layers, "world_size": world_size, "bytes": offset, "tensors": tensors,
             "digest": region_digest(partial, 0, offset)}
    os.rename(partial, data)
    index_path.write_text(json.dumps(index))
    stage("weights_written", rank=rank, bytes=offset, write_s=written,
          digest_s=time.perf_counter() - started - written)


def serve(args: argparse.Namespace) -> None:
    stage("process_start", unix_start=T_START)
    import torch

    stage("import_torch", version=torch.__version__)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # NCCL's RAS service keeps TCP sockets (a listener and links between the ranks) after every communicator is
    # destroyed; a checkpoint cannot carry them, so this engine does without it.
    os.environ.setdefault("NCCL_RAS_ENABLE", "0")
    rank, directory = args.rank, args.dir
    engine = Engine(rank, args.world_size, args.layers, args.shape)
    engine.load(args.weights or directory, args.hydrator)
    engine.arena.serve(os.path.join(directory, f"rank-{rank}.weights.sock"),
                       strategy=f"hydrator:{args.hydrator}" if args.hydrator else "ring")
    stage("process_group", seconds=engine.connect(os.path.join(directory, "init.store")))
    stage("graph_capture", seconds=engine.capture_graph())
    from coldsnap_probe import jsonline

    def answer(conn: socket.socket, _peer: jsonline.Peer) -> jsonline.Answer:
        try:
            return _handle(engine, directory, conn, jsonline.read_request(conn))
        except Exception as exc:  # a bad request is answered (ok: false by the server), never fatal
            stage("request_failed", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
            raise

    path = os.path.join(directory, f"rank-{rank}.sock")
    server = jsonline.LineServer(jsonline.listen(path), answer, peers=jsonline.Peers(), request_timeout=600.0)
    stage("ready", socket=path)
    try:
        server.run()
    finally:
        engine.arena.stop_serving()


def main() -> int:
    global LOG_PATH
    parser = argparse.ArgumentParser(prog="engine_tp.py")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "weights"):
        run = sub.add_parser(name)
        run.add_argument("--rank", type=int, required=True)
        run.add_argument("--world-size", type=int, required=True)
        run.add_argument("--dir", required=True, help="the run directory (sockets, store); weights too by default")
        run.add_argument("--weights", default="", help="where the weight files are (default: --dir)")
        run.add_argument("--shape", choices=sorted(SHAPES), default="small")
        run.add_argument("--layers", type=int, default=0, help="default: the shape's own layer count")
        run.add_argument("--hydrator", default="", help="hydrate through this node hydrator's socket")
        run.add_argument("--log", default="")
    args = parser.parse_args()
    LOG_PATH = args.log
    args.layers = args.layers or SHAPES[args.shape]["layers"]
    if args.command == "weights":
        write_weights(args.rank, args.world_size, args.weights or args.dir, args.layers, args.shape)
        return 0
    try:
        serve(args)
    except BaseException as exc:
        stage("failed", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

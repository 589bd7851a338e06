"""A tensor-parallel engine (issue 16): a Llama-shaped decoder sharded over ranks, NCCL all-reduce in CUDA graphs.

    python engines/engine_tp2.py weights --rank R --world-size N --dir DIR [--layers 16]   write a rank's weights once
    python engines/engine_tp2.py serve --rank R --world-size N --dir DIR [--layers 16] [--log FILE]

One process per rank, one GPU each (`cuda:R`, or the only visible one), torch.distributed with NCCL over a
FileStore in DIR (`NCCL_NVLS_ENABLE=0`, `NCCL_RAS_ENABLE=0`). Attention heads and the MLP are split
Megatron-style: q/k/v and gate/up column-parallel, o and down row-parallel, so each layer all-reduces
twice; embedding, norms and the LM head are replicated, so every rank computes the same logits and the
same greedy token. Weights come from fixed seeds per (layer, matrix, rank), written once per rank to
DIR/weights-rank-R.bin; serving loads them into a `coldsnap_probe.WeightArena` (a VMM reservation every
weight tensor is a view of) whose control socket DIR/rank-R.weights.sock lets the capture worker release
them and the restore worker hydrate them back at the same addresses, so the CRIU images carry no weights.
One decode step (token and position in device tensors, static KV cache, masked attention over it, greedy
argmax) is captured in a CUDA graph *with its collectives*; the prompt is fed through the same graph.
Cold-start stages go to FILE as JSON lines (opened and closed per line: no descriptor held across a
checkpoint).

Control socket DIR/rank-R.sock, one JSON line per connection, answer read to EOF:
* `{"op": "generate", "prompt": [ids], "max_tokens": n}` to rank 0 streams `{"token", "unix"}` lines, then
  `{"done": true, "tokens", "first_logits_sha256", "peers_agree"}`; rank 0 forwards it to the other ranks
  (which answer their tokens) so that every rank runs the same collective steps.
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

SHAPE = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 14336, "vocab": 32000,
         "max_seq": 512, "eps": 1e-5, "rope_theta": 500000.0}
LOG_PATH = ""


def stage(name: str, **extra: object) -> None:
    if LOG_PATH:
        with open(LOG_PATH, "a") as log:
            log.write(json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(), **extra}) + "\n")


ALIGN = 1 << 12  # every tensor's offset in a rank's weight file (and so in its arena)


def weight_paths(directory: str, rank: int) -> tuple[Path, Path]:
    return Path(directory, f"weights-rank-{rank}.bin"), Path(directory, f"weights-rank-{rank}.json")


class Engine:
    def __init__(self, rank: int, world_size: int, layers: int) -> None:
        import torch

        self.torch = torch
        self.rank, self.world_size, self.layers = rank, world_size, layers
        self.device = torch.device("cuda", rank if torch.cuda.device_count() > rank else 0)
        torch.cuda.set_device(self.device)
        torch.cuda.init()
        stage("cuda_init")
        s = SHAPE
        if s["heads"] % world_size or s["kv_heads"] % world_size or s["ffn"] % world_size:
            raise ValueError(f"the shape does not split over {world_size} ranks")
        self.heads, self.kv_heads, self.ffn = (s["heads"] // world_size, s["kv_heads"] // world_size,
                                               s["ffn"] // world_size)
        self.graph: Any = None
        self.communicators = 0
        self.arena: Any = None

    def generated_weights(self) -> list[tuple[str, Any]]:
        """Every weight of this rank, from its fixed seed, in file order."""
        s, d, hidden, r = SHAPE, SHAPE["head_dim"], SHAPE["hidden"], self.rank
        out = [("embed", self._randn((s["vocab"], hidden), 1, 1)),
               ("lm_head", self._randn((s["vocab"], hidden), 2, hidden))]
        for layer in range(self.layers):
            seed = 1000 * (layer + 1) + 10 * r
            out += [(f"{layer}.q", self._randn((self.heads * d, hidden), seed + 1, hidden)),
                    (f"{layer}.k", self._randn((self.kv_heads * d, hidden), seed + 2, hidden)),
                    (f"{layer}.v", self._randn((self.kv_heads * d, hidden), seed + 3, hidden)),
                    (f"{layer}.o", self._randn((hidden, self.heads * d), seed + 4, s["heads"] * d)),
                    (f"{layer}.gate", self._randn((self.ffn, hidden), seed + 5, hidden)),
                    (f"{layer}.up", self._randn((self.ffn, hidden), seed + 6, hidden)),
                    (f"{layer}.down", self._randn((hidden, self.ffn), seed + 7, s["ffn"]))]
        return out

    def load(self, directory: str) -> None:
        """The rank's weight file into a WeightArena (digests checked); every weight a view of the arena."""
        from engine_llama import DeviceBytes  # a sibling script: bench/ on the host, /opt/engine in a capsule

        from coldsnap_probe import WeightArena, WeightRegion

        torch = self.torch
        data, index_path = weight_paths(directory, self.rank)
        index = json.loads(index_path.read_text())
        if (index["layers"], index["world_size"]) != (self.layers, self.world_size):
            raise ValueError(f"{data} holds {index['layers']} layers of {index['world_size']} ranks")
        self.arena = WeightArena(index["bytes"], device=self.device.index)
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

    def _randn(self, shape: tuple[int, ...], seed: int, fan_in: int) -> Any:
        torch = self.torch
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return (torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
                * fan_in ** -0.5).to(torch.bfloat16)

    def _state(self) -> None:
        """The KV cache, rotary tables and the graph's input and output tensors."""
        torch, s, d = self.torch, SHAPE, SHAPE["head_dim"]
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
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + SHAPE["eps"])).to(torch.bfloat16)

    def _rope(self, x: Any) -> Any:
        torch = self.torch
        cos, sin = self.cos[self.pos], self.sin[self.pos]  # [1, d/2]
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(torch.bfloat16)

    def _step(self) -> None:
        torch, d = self.torch, SHAPE["head_dim"]
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
        if not prompt or len(prompt) + max_tokens > SHAPE["max_seq"]:
            raise ValueError(f"prompt and max_tokens must fit in {SHAPE['max_seq']} positions")
        tokens: list[int] = []
        first = ""
        for position in range(len(prompt) + max_tokens - 1):
            if position < len(prompt):
                self.token.fill_(prompt[position])
            self.pos.fill_(position)
            self.graph.replay()
            if position >= len(prompt) - 1:
                token = int(self.next.item())
                if not first:
                    first = hashlib.sha256(self.logits.cpu().numpy().tobytes()).hexdigest()
                tokens.append(token)
                self.token.copy_(self.next)
                if emit is not None:
                    emit({"token": token, "unix": time.time()})
        return {"tokens": tokens, "first_logits_sha256": first}


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
    if op != "generate":
        raise ValueError(f"unknown op {op!r}")
    prompt, max_tokens = [int(t) for t in request["prompt"]], int(request["max_tokens"])
    if engine.rank != 0:
        return {"ok": True, **engine.generate(prompt, max_tokens)}
    message = {"op": "generate", "prompt": prompt, "max_tokens": max_tokens}
    with ThreadPoolExecutor(max(1, engine.world_size - 1)) as pool:  # every rank runs the same collective steps
        peers = [pool.submit(jsonline.request, os.path.join(directory, f"rank-{rank}.sock"), message, timeout=600.0)
                 for rank in range(1, engine.world_size)]
        result = engine.generate(prompt, max_tokens, emit=lambda line: jsonline.send_line(conn, line))
        answers = [peer.result() for peer in peers]
    agree = all(a.get("tokens") == result["tokens"] and a.get("first_logits_sha256") == result["first_logits_sha256"]
                for a in answers)
    return {"done": True, **result, "peers_agree": agree}


def write_weights(rank: int, world_size: int, directory: str, layers: int) -> None:
    from coldsnap_probe import region_digest

    engine = Engine(rank, world_size, layers)
    data, index_path = weight_paths(directory, rank)
    tensors, offset = {}, 0
    with open(data, "wb") as f:
        for name, tensor in engine.generated_weights():
            raw = tensor.view(engine.torch.uint8).cpu().numpy().tobytes()
            f.seek(offset)
            f.write(raw)
            tensors[name] = (offset, list(tensor.shape))
            offset = -(-(offset + len(raw)) // ALIGN) * ALIGN
        f.truncate(offset)
    index = {"layers": layers, "world_size": world_size, "bytes": offset, "tensors": tensors,
             "digest": region_digest(data, 0, offset)}
    index_path.write_text(json.dumps(index))


def serve(rank: int, world_size: int, directory: str, layers: int) -> None:
    stage("process_start", unix_start=T_START)
    import torch

    stage("import_torch", version=torch.__version__)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # NCCL's RAS service keeps TCP sockets (a listener and links between the ranks) after every communicator is
    # destroyed; a checkpoint cannot carry them, so this engine does without it.
    os.environ.setdefault("NCCL_RAS_ENABLE", "0")
    engine = Engine(rank, world_size, layers)
    engine.load(directory)
    engine.arena.serve(os.path.join(directory, f"rank-{rank}.weights.sock"), strategy="ring")
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
    parser = argparse.ArgumentParser(prog="engine_tp2.py")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "weights"):
        run = sub.add_parser(name)
        run.add_argument("--rank", type=int, required=True)
        run.add_argument("--world-size", type=int, required=True)
        run.add_argument("--dir", required=True)
        run.add_argument("--layers", type=int, default=16)
        run.add_argument("--log", default="")
    args = parser.parse_args()
    LOG_PATH = args.log
    if args.command == "weights":
        write_weights(args.rank, args.world_size, args.dir, args.layers)
        return 0
    try:
        serve(args.rank, args.world_size, args.dir, args.layers)
    except BaseException as exc:
        stage("failed", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())

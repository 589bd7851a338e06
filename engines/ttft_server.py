"""A small decoder-only transformer served over a local Unix socket (the restore benchmark's workload).

    python engines/ttft_server.py --gib 2 --weights FILE --socket PATH   serve
    python engines/ttft_server.py --gib 2 --weights FILE --generate      write the weights file once

Random weights from a fixed seed (no downloads), bf16, loaded from a local file through pinned
staging buffers; a static KV cache; the decode step is captured as a CUDA graph; greedy
generation. With --vmm-weights the weights live in a `coldsnap_probe.hydration.WeightArena`: one
region (a 64 MiB-aligned prefix of the weights file, digest given by --region-digest), released
and hydrated by the restore worker through --control (the product path, not this server's code);
with --kv-discard the KV cache sits in the same arena as a discarded region (kept out of the images,
zeroed at restore).
Stage timestamps go to stdout as JSON lines. (A Unix socket, not TCP: CRIU 4.1.1 reads
SO_PASSCRED from every socket it dumps, which kernels from 6.16 refuse on inet sockets.) Protocol: one JSON line
{"prompt": [ids], "max_tokens": n} per connection; one {"token": id} line per token, then
{"done": true, "first_logits_sha256": hex}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import sys
import time
from collections.abc import Iterator

T_START = time.time()


def anonymous_bytes() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Anonymous:"))


def stage(name: str, **extra: object) -> None:
    """One JSON line; `anonymous` (the process's anonymous memory so far) shows what each stage adds to the images."""
    sys.stdout.write(json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(),
                                 "anonymous": anonymous_bytes(), **extra}) + "\n")
    sys.stdout.flush()


stage("process_start", since=T_START)
import torch

VOCAB, HIDDEN, HEADS, MAX_LEN = 32000, 4096, 32, 128  # 128 positions: the KV cache stays small in the images
PER_LAYER = 12 * HIDDEN * HIDDEN + 2 * HIDDEN  # qkv, o, up (4h), down (4h), two norms


def layers_for(gib: float) -> int:
    budget = gib * (1 << 30) / 2 - VOCAB * HIDDEN - HIDDEN
    return max(1, int(budget // PER_LAYER))


def param_count(layers: int) -> int:
    return VOCAB * HIDDEN + HIDDEN + layers * PER_LAYER


def region_bytes(gib: float) -> int:
    """The model's bytes rounded up to 64 MiB (the digest chunk): a prefix of a larger model's file."""
    return -(-param_count(layers_for(gib)) * 2 // (64 << 20)) * (64 << 20)


def random_chunks(total: int, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Seeded normal(0, 0.02) in bf16, generated on the GPU: (first element, chunk) up to `total` elements."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    chunk = 1 << 28
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        yield start, (torch.randn(n, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)


def generate(path: str, gib: float, seed: int) -> None:
    """Write the weights once."""
    with open(path + ".tmp", "wb") as f:
        for _, block in random_chunks(region_bytes(gib) // 2, seed):
            f.write(block.view(torch.int16).cpu().numpy().data)
    os.replace(path + ".tmp", path)


def kv_bytes(layers: int) -> int:
    """The static KV cache's bytes: keys and values, bf16, MAX_LEN positions per layer."""
    return 2 * layers * MAX_LEN * HIDDEN * 2


class Model:
    def __init__(self, flat: torch.Tensor, layers: int, kv: torch.Tensor | None = None) -> None:
        offset = 0

        def take(*shape: int) -> torch.Tensor:
            nonlocal offset
            n = math.prod(shape)
            view = flat[offset:offset + n].view(*shape)
            offset += n
            return view

        self.embed = take(VOCAB, HIDDEN)
        self.final_norm = take(HIDDEN)
        self.layers = [dict(qkv=take(HIDDEN, 3 * HIDDEN), o=take(HIDDEN, HIDDEN), up=take(HIDDEN, 4 * HIDDEN),
                            down=take(4 * HIDDEN, HIDDEN), n1=take(HIDDEN), n2=take(HIDDEN)) for _ in range(layers)]
        dev = flat.device
        shape = (2, layers, MAX_LEN, HEADS, HIDDEN // HEADS)
        cache = kv.view(shape) if kv is not None else torch.zeros(shape, dtype=torch.bfloat16, device=dev)
        self.k, self.v = cache[0], cache[1]
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.logits = torch.zeros(VOCAB, dtype=torch.float32, device=dev)
        self.positions = torch.arange(MAX_LEN, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None

    @staticmethod
    def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * (1 + weight)

    def _step(self) -> None:
        d = HIDDEN // HEADS
        x = self.embed[self.token]  # (1, H)
        mask = self.positions <= self.pos  # attend to positions 0..pos
        for i, w in enumerate(self.layers):
            q, k, v = (self._norm(x, w["n1"]) @ w["qkv"]).split(HIDDEN, dim=-1)
            self.k[i].index_copy_(0, self.pos, k.view(1, HEADS, d))
            self.v[i].index_copy_(0, self.pos, v.view(1, HEADS, d))
            scores = torch.einsum("hd,thd->ht", q.view(HEADS, d).float(), self.k[i].float()) / math.sqrt(d)
            scores = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            attn = torch.einsum("ht,thd->hd", scores, self.v[i].float()).to(x.dtype).reshape(1, HIDDEN)
            x = x + attn @ w["o"]
            x = x + torch.nn.functional.silu(self._norm(x, w["n2"]) @ w["up"]) @ w["down"]
        self.logits.copy_((self._norm(x, self.final_norm) @ self.embed.T).float().view(-1))

    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        torch.cuda.synchronize()

    def step(self, token: int, pos: int) -> torch.Tensor:
        self.token.fill_(token)
        self.pos.fill_(pos)
        assert self.graph is not None
        self.graph.replay()
        return self.logits


def hydrate(path: str, flat: torch.Tensor, *, threads: int = 8, chunk_bytes: int = 64 << 20) -> None:
    """Read the weights file into `flat` through a ring of pinned buffers, one per reader thread.

    Each thread preads its own chunks (the GIL is released while reading) into its pinned buffer
    and copies them on its own stream, so disk/page-cache reads and H2D copies overlap.
    """
    from concurrent.futures import ThreadPoolExecutor

    total, chunk = flat.numel(), chunk_bytes // 2
    chunks = -(-total // chunk)
    buffers = [torch.empty(chunk, dtype=torch.bfloat16).pin_memory() for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)

    def work(worker: int) -> None:
        stream, event, buffer = torch.cuda.Stream(), torch.cuda.Event(), buffers[worker]
        for index in range(worker, chunks, threads):
            start = index * chunk
            n = min(chunk, total - start)
            event.synchronize()  # this buffer's previous copy has finished
            if os.preadv(fd, [memoryview(buffer[:n].view(torch.uint8).numpy())], start * 2) != n * 2:
                raise RuntimeError(f"weights file {path} is short")
            with torch.cuda.stream(stream):
                flat[start:start + n].copy_(buffer[:n], non_blocking=True)
                event.record(stream)
        event.synchronize()

    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, range(threads)))
    finally:
        os.close(fd)
    torch.cuda.synchronize()


def load(path: str, gib: float, seed: int) -> Model:
    """The weights from the file, or (`path` is "device") generated on the GPU: no file to read, none to keep."""
    layers = layers_for(gib)
    flat = torch.empty(param_count(layers), dtype=torch.bfloat16, device="cuda")
    if path == "device":
        for start, block in random_chunks(flat.numel(), seed):
            flat[start:start + block.numel()].copy_(block)
    else:
        hydrate(path, flat)
    return Model(flat, layers)


def bf16_at(address: int, nbytes: int) -> torch.Tensor:
    """A bf16 tensor over device memory torch did not allocate (the arena's)."""
    interface = {"shape": (nbytes // 2,), "typestr": "<i2", "data": (address, False), "version": 3}
    holder = type("CudaArray", (), {"__cuda_array_interface__": interface})()
    return torch.as_tensor(holder, device="cuda").view(torch.bfloat16)


def load_arena(path: str, gib: float, region_digest: str, strategy: str, kv_discard: bool) -> tuple[Model, object]:
    """The weights in a WeightArena (coldsnap_probe's hydration API), loaded and verified through it; with
    `kv_discard` the KV cache lives there too, in a discarded region (not in the images, zeroed at restore)."""
    from coldsnap_probe import WeightArena, WeightRegion

    layers, size = layers_for(gib), region_bytes(gib)
    kv = kv_bytes(layers) if kv_discard else 0
    arena = WeightArena(size + kv, exportable=strategy.startswith("hydrator:"))
    arena.declare([WeightRegion("weights", arena.address, size, path, 0, region_digest),
                   *([WeightRegion("kv", arena.address + size, arena.size - size, "", 0, "", "discard")]
                     if kv else [])])
    report = arena.load(strategy=strategy)
    stage("weights_hydrated", **{k: v for k, v in report.items() if isinstance(v, int | float | str)})
    cache = bf16_at(arena.address + size, kv) if kv else None
    return Model(bf16_at(arena.address, size), layers, cache), arena


def serve(model: Model, path: str, arena: object = None) -> None:
    """One generation per connection (coldsnap_probe.jsonline): token lines streamed, then the `done` line."""
    from coldsnap_probe import jsonline

    def generate(conn: socket.socket, _peer: jsonline.Peer) -> jsonline.Answer:
        request = jsonline.read_request(conn)
        if arena is not None:
            arena.wait_ready()  # type: ignore[attr-defined]  # never serve half-hydrated weights
        tokens, first_hash = list(request["prompt"]), None
        pos = 0
        for pos, token in enumerate(tokens[:-1]):
            model.step(token, pos)
        last, pos = tokens[-1], len(tokens) - 1
        for _ in range(request["max_tokens"]):
            logits = model.step(last, pos)
            if first_hash is None:
                first_hash = hashlib.sha256(logits.cpu().numpy().tobytes()).hexdigest()
            last = int(logits.argmax())
            jsonline.send_line(conn, {"token": last})
            pos += 1
        return {"done": True, "first_logits_sha256": first_hash}

    server = jsonline.LineServer(jsonline.listen(path), generate, peers=jsonline.Peers(), request_timeout=600.0)
    stage("ready", socket=path)
    try:
        server.run()
    finally:
        if arena is not None:
            arena.stop_serving()  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, required=True)
    parser.add_argument("--weights", required=True, help="the weights file, or \"device\": generated on the GPU "
                        "from --seed (not with --vmm-weights or --generate)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--socket", default="")
    parser.add_argument("--generate", action="store_true")
    parser.add_argument("--vmm-weights", action="store_true", help="weights in a releasable VMM reservation")
    parser.add_argument("--region-digest", default="", help="the weights region's digest (--vmm-weights)")
    parser.add_argument("--control", default="", help="hydration control socket for the worker (--vmm-weights)")
    parser.add_argument("--strategy", default="register", help="hydration strategy (--vmm-weights)")
    parser.add_argument("--stack-bytes", type=int, default=0, help="CUDA per-thread stack limit (0: the driver's)")
    parser.add_argument("--kv-discard", action="store_true", help="the KV cache in a discarded arena region "
                        "(--vmm-weights)")
    args = parser.parse_args()
    if args.weights == "device" and (args.vmm_weights or args.generate):
        parser.error("--weights device: the weights are generated on the GPU; --vmm-weights and --generate need a file")
    if args.generate:
        generate(args.weights, args.gib, args.seed)
        return
    torch.zeros(1, device="cuda").sum().item()
    if args.stack_bytes:  # less local memory reserved per thread: less device state to checkpoint and restore
        from cuda.bindings import driver

        (err,) = driver.cuCtxSetLimit(driver.CUlimit.CU_LIMIT_STACK_SIZE, args.stack_bytes)
        if int(err):
            raise RuntimeError(f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {args.stack_bytes}): {err}")
    stage("cuda_init")
    arena = None
    if args.vmm_weights:
        model, arena = load_arena(args.weights, args.gib, args.region_digest, args.strategy, args.kv_discard)
    else:
        model = load(args.weights, args.gib, args.seed)
    vmm_bytes = arena.size if arena else 0  # type: ignore[attr-defined]  # torch's allocator does not see it
    stage("weights_loaded", device_bytes=torch.cuda.memory_allocated() + vmm_bytes)
    model.capture()
    # Keep the checkpointed state small: no cached free device blocks, no cached pinned host buffers.
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    free, total = torch.cuda.mem_get_info()
    stage("graph_captured", device_bytes=torch.cuda.memory_allocated() + vmm_bytes, device_used=total - free,
          torch_reserved=torch.cuda.memory_reserved())
    if arena is not None:
        arena.serve(args.control, strategy=args.strategy)
    serve(model, args.socket, arena)


if __name__ == "__main__":
    main()

"""A small decoder-only transformer served over a local Unix socket (the restore benchmark's workload).

    python bench/_ttft_server.py --gib 2 --weights FILE --socket PATH   serve
    python bench/_ttft_server.py --gib 2 --weights FILE --generate      write the weights file once

Random weights from a fixed seed (no downloads), bf16, loaded from a local file through pinned
staging buffers; a static KV cache; the decode step is captured as a CUDA graph; greedy
generation. Stage timestamps go to stdout as JSON lines. (A Unix socket, not TCP: CRIU 4.1.1 reads
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

T_START = time.time()


def stage(name: str, **extra: object) -> None:
    sys.stdout.write(json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(), **extra}) + "\n")
    sys.stdout.flush()


stage("process_start", since=T_START)
import torch

VOCAB, HIDDEN, HEADS, MAX_LEN = 32000, 4096, 32, 512
PER_LAYER = 12 * HIDDEN * HIDDEN + 2 * HIDDEN  # qkv, o, up (4h), down (4h), two norms


def layers_for(gib: float) -> int:
    budget = gib * (1 << 30) / 2 - VOCAB * HIDDEN - HIDDEN
    return max(1, int(budget // PER_LAYER))


def param_count(layers: int) -> int:
    return VOCAB * HIDDEN + HIDDEN + layers * PER_LAYER


def generate(path: str, gib: float, seed: int) -> None:
    """Write the weights once: seeded normal(0, 0.02) in bf16, generated on the GPU in chunks."""
    total = param_count(layers_for(gib))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    chunk = 1 << 28
    with open(path + ".tmp", "wb") as f:
        for start in range(0, total, chunk):
            n = min(chunk, total - start)
            block = (torch.randn(n, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)
            f.write(block.view(torch.int16).cpu().numpy().tobytes())
    os.replace(path + ".tmp", path)


class Model:
    def __init__(self, flat: torch.Tensor, layers: int) -> None:
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
        self.k = torch.zeros(layers, MAX_LEN, HEADS, HIDDEN // HEADS, dtype=torch.bfloat16, device=dev)
        self.v = torch.zeros_like(self.k)
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


class VmmWeights:
    """Weights in a VMM reservation: the backing can be released and re-created at the same address.

    Captured CUDA graphs keep pointing at the reservation, so after `release()` (before a
    checkpoint: nothing of the weights goes into the images) and `remap()` + hydration (after
    restore) they replay unchanged.
    """

    def __init__(self, count: int) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = torch.cuda.current_device()
        granule = self._ok(cu.cuMemGetAllocationGranularity(
            self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        self.size = -(-count * 2 // granule) * granule
        self.va = int(self._ok(cu.cuMemAddressReserve(self.size, 0, 0, 0)))
        self.handle = None
        self.remap()
        interface = {"shape": (count,), "typestr": "<i2", "data": (self.va, False), "version": 3}
        holder = type("CudaArray", (), {"__cuda_array_interface__": interface})()
        self.tensor = torch.as_tensor(holder, device="cuda").view(torch.bfloat16)

    @staticmethod
    def _ok(result: tuple) -> object:  # type: ignore[type-arg]
        err, *out = result
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return out[0] if out else None

    def remap(self) -> None:
        cu = self.cu
        self.handle = self._ok(cu.cuMemCreate(self.size, self.prop, 0))
        self._ok(cu.cuMemMap(self.va, self.size, 0, self.handle, 0))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.prop.location.id
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._ok(cu.cuMemSetAccess(self.va, self.size, [access], 1))

    def release(self) -> None:
        torch.cuda.synchronize()
        self._ok(self.cu.cuMemUnmap(self.va, self.size))
        self._ok(self.cu.cuMemRelease(self.handle))
        self.handle = None


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


def load(path: str, gib: float, *, vmm: bool) -> tuple[Model, VmmWeights | None]:
    layers = layers_for(gib)
    total = param_count(layers)
    weights = VmmWeights(total) if vmm else None
    flat = weights.tensor if weights else torch.empty(total, dtype=torch.bfloat16, device="cuda")
    hydrate(path, flat)
    return Model(flat, layers), weights


def serve(model: Model, path: str, weights: VmmWeights | None, weights_file: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    stage("ready", socket=path)
    while True:
        conn, _ = listener.accept()
        with conn, conn.makefile("rwb") as stream:
            request = json.loads(stream.readline())
            if request.get("op") in ("sleep", "wake"):
                if weights is None:
                    raise RuntimeError("sleep/wake need --vmm-weights")
                started = time.time()
                if request["op"] == "sleep":
                    weights.release()
                else:
                    weights.remap()
                    hydrate(weights_file, weights.tensor)
                stream.write(json.dumps({"ok": True, "seconds": time.time() - started}).encode() + b"\n")
                stream.flush()
                continue
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
                stream.write(json.dumps({"token": last}).encode() + b"\n")
                stream.flush()
                pos += 1
            stream.write(json.dumps({"done": True, "first_logits_sha256": first_hash}).encode() + b"\n")
            stream.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, required=True)
    parser.add_argument("--weights", required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--socket", default="")
    parser.add_argument("--generate", action="store_true")
    parser.add_argument("--vmm-weights", action="store_true", help="weights in a releasable VMM reservation")
    args = parser.parse_args()
    if args.generate:
        generate(args.weights, args.gib, args.seed)
        return
    torch.zeros(1, device="cuda").sum().item()
    stage("cuda_init")
    model, weights = load(args.weights, args.gib, vmm=args.vmm_weights)
    vmm_bytes = weights.size if weights else 0  # torch's allocator does not see the VMM reservation
    stage("weights_loaded", device_bytes=torch.cuda.memory_allocated() + vmm_bytes)
    model.capture()
    stage("graph_captured", device_bytes=torch.cuda.memory_allocated() + vmm_bytes)
    serve(model, args.socket, weights, args.weights)


if __name__ == "__main__":
    main()

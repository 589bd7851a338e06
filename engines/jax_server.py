"""A small decoder-only transformer in JAX served over a local Unix socket: engines/ttft_server.py's model,
protocol and stages, with XLA's allocator and compiler in place of torch's.

    python engines/jax_server.py --gib 2 --weights device --socket PATH      weights made on the device from --seed
    python engines/jax_server.py --gib 2 --weights FILE --socket PATH        ttft_server.py's weights file (bf16)

The same shape as ttft_server.py (VOCAB x HIDDEN embedding tied to the output, pre-norm layers of a fused qkv, o,
a 4x SiLU MLP; a static KV cache of MAX_LEN positions; greedy decoding). The layers' weights are stacked
(one array per kind, a leading layer axis) so the decode step is one `lax.scan`: one small program XLA compiles
once, whatever the depth. Each layer is made (or read) and written into its stack by a jitted update that
donates the stack, so the device holds the model and one layer in flight, never two models: with a growing
BFC pool (`XLA_PYTHON_CLIENT_PREALLOCATE=false`), what XLA took from the driver stays close to what the model
uses (docs/interposer.md, "JAX and XLA"). The decode step donates the KV cache and is compiled (and run once)
before `ready`: the compile is the cold start's "graph capture".

Stage timestamps go to stdout as JSON lines (ttft_server.py's names: process_start, cuda_init, weights_loaded,
graph_captured, ready), `cuda_init` naming the platform, the device and the allocator's environment,
`graph_captured` XLA's own memory statistics. Protocol (ttft_server.py's): one JSON line
{"prompt": [ids], "max_tokens": n} per connection; one {"token": id} line per token, then
{"done": true, "first_logits_sha256": hex}. `--hidden`, `--heads` and `--vocab` shrink the model (the CPU tests
run it with JAX_PLATFORMS=cpu).
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
from dataclasses import dataclass
from typing import Any

T_START = time.time()
MAX_LEN = 128  # ttft_server.py's: the KV cache stays small
# What decides how XLA takes device memory from the driver (docs/interposer.md, "JAX and XLA"): named in cuda_init.
ALLOCATOR_ENV = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_FLAGS", "JAX_PLATFORMS")


def anonymous_bytes() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Anonymous:"))


def stage(name: str, **extra: object) -> None:
    """One JSON line; `anonymous` (the process's anonymous memory so far) shows what each stage adds to the images."""
    sys.stdout.write(json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(),
                                 "anonymous": anonymous_bytes(), **extra}) + "\n")
    sys.stdout.flush()


stage("process_start", since=T_START)
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BF16 = jnp.bfloat16


@dataclass(frozen=True)
class Shape:
    """The model's dimensions; the tensors in ttft_server.py's weights-file order."""

    vocab: int
    hidden: int
    heads: int
    layers: int

    @staticmethod
    def for_gib(gib: float, vocab: int, hidden: int, heads: int) -> Shape:
        """As many layers as fit `gib` of bf16 weights beside the embedding (at least one), as ttft_server.py."""
        per_layer = 12 * hidden * hidden + 2 * hidden
        budget = gib * (1 << 30) / 2 - vocab * hidden - hidden
        return Shape(vocab, hidden, heads, max(1, int(budget // per_layer)))

    def layer_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        h = self.hidden
        return [("qkv", (h, 3 * h)), ("o", (h, h)), ("up", (h, 4 * h)), ("down", (4 * h, h)), ("n1", (h,)),
                ("n2", (h,))]

    def tensors(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """(name, layer or -1, shape) in file order: embed, final_norm, then each layer's."""
        order: list[tuple[str, int, tuple[int, ...]]] = [("embed", -1, (self.vocab, self.hidden)),
                                                         ("final_norm", -1, (self.hidden,))]
        order += [(name, layer, shape) for layer in range(self.layers) for name, shape in self.layer_tensors()]
        return order

    def params(self) -> int:
        return sum(math.prod(shape) for _, _, shape in self.tensors())


def _put(stack: jax.Array, layer: int, block: jax.Array) -> jax.Array:
    return stack.at[layer].set(block)


# The stack is donated: XLA writes the layer in place rather than copying the stack for each layer.
_put_layer = jax.jit(_put, donate_argnums=0)


def _normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(BF16)


_normal_jit = jax.jit(_normal, static_argnums=1)


class Weights:
    """Where each tensor comes from: made on the device from the seed (one key per tensor, in file order), or
    read from ttft_server.py's weights file (raw bf16, tensors back to back)."""

    def __init__(self, source: str, seed: int, shape: Shape) -> None:
        self.key = jax.random.key(seed)
        self.file: np.ndarray[Any, Any] | None = None
        if source != "device":
            need = shape.params() * 2
            have = os.stat(source).st_size
            if have < need:
                raise SystemExit(f"--weights: {source} holds {have} bytes; a {shape.layers}-layer model needs "
                                 f"{need} (generate it with engines/ttft_server.py --generate)")
            self.file = np.memmap(source, dtype=np.dtype(BF16), mode="r", shape=(shape.params(),))
        self.offset = 0
        self.index = 0

    def next(self, shape: tuple[int, ...]) -> jax.Array:
        """The next tensor in file order, on the device."""
        count = math.prod(shape)
        self.index += 1
        if self.file is None:
            block = _normal_jit(jax.random.fold_in(self.key, self.index), shape)
        else:
            block = jax.device_put(np.asarray(self.file[self.offset:self.offset + count]).reshape(shape))
        self.offset += count
        return block


def load(source: str, seed: int, shape: Shape) -> dict[str, jax.Array]:
    """Every tensor on the device: the embedding and final norm as they are, each layer kind stacked."""
    weights = Weights(source, seed, shape)
    params: dict[str, jax.Array] = {}
    for name, layer, tensor_shape in shape.tensors():
        block = weights.next(tensor_shape)
        if layer < 0:
            params[name] = block
            continue
        if layer == 0:
            params[name] = jnp.zeros((shape.layers, *tensor_shape), BF16)
        params[name] = _put_layer(params[name], layer, block)
    jax.block_until_ready(params)
    return params


def _norm(x: jax.Array, weight: jax.Array) -> jax.Array:
    scale = lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True) + 1e-6)
    return x * scale.astype(x.dtype) * (1 + weight)


def _decode(params: dict[str, jax.Array], k: jax.Array, v: jax.Array, token: jax.Array,
            pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token at `pos`: (float32 logits, the greedy next token, the updated caches)."""
    layers, _, heads, d = k.shape
    hidden = heads * d
    x = params["embed"][token]
    visible = jnp.arange(MAX_LEN) <= pos  # attend to positions 0..pos

    def layer(x: jax.Array, w: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        qkv, o, up, down, n1, n2, k_layer, v_layer = w
        q, key, value = jnp.split(_norm(x, n1) @ qkv, 3)
        k_layer = lax.dynamic_update_slice(k_layer, key.reshape(1, heads, d), (pos, 0, 0))
        v_layer = lax.dynamic_update_slice(v_layer, value.reshape(1, heads, d), (pos, 0, 0))
        scores = jnp.einsum("hd,thd->ht", q.reshape(heads, d).astype(jnp.float32),
                            k_layer.astype(jnp.float32)) / math.sqrt(d)
        scores = jax.nn.softmax(jnp.where(visible[None, :], scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("ht,thd->hd", scores, v_layer.astype(jnp.float32)).astype(x.dtype).reshape(hidden)
        x = x + attn @ o
        x = x + jax.nn.silu(_norm(x, n2) @ up) @ down
        return x, (k_layer, v_layer)

    stacks = tuple(params[name] for name in ("qkv", "o", "up", "down", "n1", "n2"))
    x, (k, v) = lax.scan(layer, x, (*stacks, k, v), length=layers)
    logits = (_norm(x, params["final_norm"]) @ params["embed"].T).astype(jnp.float32)
    return logits, jnp.argmax(logits), k, v


class Model:
    """The parameters, the KV cache (donated to each step: updated in place) and the compiled decode step."""

    def __init__(self, params: dict[str, jax.Array], shape: Shape) -> None:
        self.params = params
        cache = (shape.layers, MAX_LEN, shape.heads, shape.hidden // shape.heads)
        self.k = jnp.zeros(cache, BF16)
        self.v = jnp.zeros(cache, BF16)
        self.decode = jax.jit(_decode, donate_argnums=(1, 2))

    def compile(self) -> float:
        """Compile the step and run it once (every request rewrites each position before it reads it)."""
        started = time.time()
        self.step(0, 0)[0].block_until_ready()
        return time.time() - started

    def step(self, token: int, pos: int) -> tuple[jax.Array, jax.Array]:
        logits, best, self.k, self.v = self.decode(self.params, self.k, self.v, jnp.int32(token), jnp.int32(pos))
        return logits, best


def memory_stats() -> dict[str, int]:
    """XLA's own accounting of device memory (bytes_in_use, peak, the pool's size and limit); {} on a CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    return {key: int(value) for key, value in stats.items() if isinstance(value, int)}


def live_bytes() -> int:
    return sum(array.nbytes for array in jax.live_arrays())


def serve(model: Model, path: str) -> None:
    """One generation per connection (coldsnap_probe.jsonline): token lines streamed, then the `done` line."""
    from coldsnap_probe import jsonline

    def generate(conn: socket.socket, _peer: jsonline.Peer) -> jsonline.Answer:
        request = jsonline.read_request(conn)
        tokens, first_hash = [int(t) for t in request["prompt"]], None
        if not tokens or not 0 < len(tokens) + int(request["max_tokens"]) <= MAX_LEN:
            raise ValueError(f"prompt: 1 to {MAX_LEN} positions with max_tokens, not {len(tokens)} + "
                             f"{request['max_tokens']}")
        for pos, token in enumerate(tokens[:-1]):
            model.step(token, pos)
        last, pos = tokens[-1], len(tokens) - 1
        for _ in range(int(request["max_tokens"])):
            logits, best = model.step(last, pos)
            if first_hash is None:
                first_hash = hashlib.sha256(np.asarray(logits).tobytes()).hexdigest()
            last = int(best)
            jsonline.send_line(conn, {"token": last})
            pos += 1
        return {"done": True, "first_logits_sha256": first_hash}

    server = jsonline.LineServer(jsonline.listen(path), generate, peers=jsonline.Peers(), request_timeout=600.0)
    stage("ready", socket=path)
    server.run()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, required=True, help="the weights' size (as ttft_server.py)")
    parser.add_argument("--weights", required=True, help="ttft_server.py's weights file, or \"device\": made on "
                        "the device from --seed")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    if args.gib <= 0:
        parser.error(f"--gib must be above 0, not {args.gib}")
    if min(args.hidden, args.heads, args.vocab) < 1 or args.hidden % args.heads:
        parser.error(f"--hidden ({args.hidden}) must be a positive multiple of --heads ({args.heads}), "
                     f"--vocab ({args.vocab}) positive")
    if args.weights != "device" and not os.path.isfile(args.weights):
        parser.error(f"--weights: {args.weights} is not a file (or \"device\")")
    return args


def main() -> None:
    args = arguments()
    device = jax.devices()[0]
    jnp.zeros(1).block_until_ready()  # the client, its context and (preallocating) its pool
    stage("cuda_init", platform=device.platform, device=device.device_kind, jax=jax.__version__,
          environment={name: os.environ[name] for name in ALLOCATOR_ENV if name in os.environ},
          xla_memory=memory_stats())
    shape = Shape.for_gib(args.gib, args.vocab, args.hidden, args.heads)
    model = Model(load(args.weights, args.seed, shape), shape)
    stage("weights_loaded", device_bytes=live_bytes(), layers=shape.layers, xla_memory=memory_stats())
    compile_s = model.compile()
    xla = memory_stats()
    stage("graph_captured", device_bytes=live_bytes(), device_used=xla.get("pool_bytes", xla.get("bytes_in_use", 0)),
          compile_s=compile_s, xla_memory=xla)
    serve(model, args.socket)


if __name__ == "__main__":
    main()

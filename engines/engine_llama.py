"""A real-engine-shaped inference server: an 8B-shaped Llama decoder (transformers + torch), issue 12 item 3.

    python engines/engine_llama.py weights DIR              write deterministic bf16 weights once (safetensors)
    python engines/engine_llama.py serve DIR --socket PATH [--log FILE] [--hydration SOCKET] [--stack-bytes N]
        load, warm up (compile + CUDA graphs), serve. Without --hydration the weights are plain torch tensors
        (what an engine that does not cooperate holds). --stack-bytes sets the CUDA per-thread stack limit
        (less local memory reserved per thread: less device state to checkpoint and restore); 0 keeps the
        driver's. With --hydration the weights live in a
        coldsnap_probe.hydration.WeightArena (a VMM reservation laid out as the safetensors shards' data
        sections, filled from them, parameters are views of it) whose control socket the restore worker
        uses to release the weights before capture and hydrate them after restore; with --hydrator SOCKET
        the hydration goes through a long-lived HydratorServer (python -m coldsnap_probe.hydration serve).
    python engines/engine_llama.py launch --pid-floor N --log FILE -- ENGINE ARGV...   a container init for a
        capturable engine: push the PID allocator past N, start ENGINE as a session leader with its stdio on
        /dev/null (no pipe to the container runtime that a restore could not recreate), then reap children
        and outlive it (a capture's worker must finish after CRIU has killed the engine)

Shape of an 8B model (hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336, vocab 128256; ~16 GB in bf16)
with weights from a fixed seed (no downloads). Serving: a static KV cache, so `generate` compiles the decode
step with torch.compile and replays it as CUDA graphs; greedy. Every cold-start stage (imports, CUDA init,
weight load, warm-up compilation and graph capture) goes to stdout as a JSON line with its wall-clock time,
so a driver can put them on one timeline with the container's creation; with --log each line is also
appended to FILE, opened and closed per line (no descriptor held across a checkpoint). Protocol (the same as
engines/ttft_server.py): one JSON line {"prompt": [ids], "max_tokens": n} per connection on a Unix socket;
one {"token": id, "unix": t} line per token as generated, then {"done": true, "first_logits_sha256": hex}.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # the process start is stamped before anything is imported
import hashlib
import json
import os
import socket
import struct
import sys
import traceback
from pathlib import Path
from typing import Any

SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
WARMUP_PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679]


LOG_PATH = ""


def stage(name: str, **extra: object) -> None:
    line = json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(), **extra}) + "\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    if LOG_PATH:
        with open(LOG_PATH, "a") as log:
            log.write(line)


def _children() -> list[int]:
    kids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        kids.extend(int(c) for c in Path(f"/proc/self/task/{task}/children").read_text().split())
    return kids


def launch(argv: list[str], pid_floor: int) -> None:
    """PID 1 of a capturable serving container (see the module docstring); never returns."""
    stage("launcher_start", since=T_START)
    while True:  # the captured PIDs must be free in the restore unit, whose own processes take the low ones
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        if pid >= pid_floor:
            break
    engine = os.fork()
    if engine == 0:
        try:
            os.setsid()  # CRIU dumps a tree whose root leads its session
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.closerange(3, 1 << 16)  # nothing of the launcher's reaches the captured tree
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    stage("engine_forked", engine_pid=engine)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            time.sleep(3600)
            continue
        if pid == engine:
            stage("engine_exited", engine_pid=engine, status=os.waitstatus_to_exitcode(status))


REGIONS_FILE = "coldsnap-regions.json"
ALIGN = 2 << 20


def write_weights(directory: str, layers: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {**SHAPE, **({"num_hidden_layers": layers} if layers else {})}  # fewer layers: a quick shakedown
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(directory)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    stage("weights_written", bytes=size)
    try:  # the hydration regions' digests, computed once (the engine's load verifies them again)
        from coldsnap_probe import region_digest
    except ImportError:
        return
    regions = []
    for shard in _shards(directory):
        regions.append({"file": os.path.basename(shard["path"]), "offset": shard["offset"], "size": shard["size"],
                        "digest": region_digest(shard["path"], shard["offset"], shard["size"])})
    Path(directory, REGIONS_FILE).write_text(json.dumps(regions, indent=1))
    stage("regions_digested", regions=len(regions))


def _shards(directory: str) -> list[dict[str, Any]]:
    """Each safetensors file's data section (offset, size) and its tensors (name, dtype, shape, begin, end)."""
    shards = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        tensors = {name: (t["dtype"], t["shape"], *t["data_offsets"]) for name, t in header.items()}
        shards.append({"path": str(path), "offset": 8 + length, "size": max(t[3] for t in tensors.values()),
                       "tensors": tensors})
    return shards


class DeviceBytes:
    """A device address range as a CUDA array (torch.as_tensor makes a view of it, no copy)."""

    def __init__(self, address: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def _arena_model(directory: str, control: str, hydrator: str = "") -> tuple[Any, Any]:
    """The model with every parameter a view of a WeightArena filled from the shards (see serve --hydration)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from coldsnap_probe import WeightArena, WeightRegion, region_digest

    shards = _shards(directory)
    known = {}
    if Path(directory, REGIONS_FILE).exists():
        known = {(r["file"], r["offset"], r["size"]): r["digest"]
                 for r in json.loads(Path(directory, REGIONS_FILE).read_text())}
    regions, bases, total = [], [], 0
    for i, shard in enumerate(shards):
        bases.append(total)
        key = (os.path.basename(shard["path"]), shard["offset"], shard["size"])
        digest = known.get(key) or region_digest(shard["path"], shard["offset"], shard["size"])
        regions.append((f"shard-{i}", total, shard, digest))
        total += -(-shard["size"] // ALIGN) * ALIGN
    # With a hydrator (a long-lived process keeping the shards page-locked) the allocation is exported to it
    # at each hydration; an exported allocation is released before every capture anyway.
    arena = WeightArena(total, exportable=bool(hydrator))
    arena.declare([WeightRegion(name, arena.address + base, shard["size"], shard["path"], shard["offset"], digest)
                   for name, base, shard, digest in regions])
    report = arena.load(strategy="ring")
    stage("weights_hydrated", arena_bytes=arena.size, **{k: v for k, v in report.items() if k != "strategy"})
    config = LlamaConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    try:  # the rotary embedding's buffers are computed at construction: make them on the GPU
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device="cuda")
    except Exception as exc:  # another transformers: build on the GPU (bf16, freed below) and replace
        stage("meta_construction_fallback", error=f"{type(exc).__name__}: {exc}")
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(default)
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    assigned = set()
    for base, shard in zip(bases, shards, strict=True):
        for name, (dtype, shape, begin, end) in shard["tensors"].items():
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            if leaf not in module._parameters:
                raise RuntimeError(f"{name} in {shard['path']} is not a parameter of the model")
            # One storage per parameter (no aliasing between the compiled graph's inputs), all in the arena.
            raw = torch.as_tensor(DeviceBytes(arena.address + base + begin, end - begin), device="cuda")
            view = raw.view(dtypes[dtype]).view(shape)
            module._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)
            assigned.add(name)
    missing = {n for n, _ in model.named_parameters()} - assigned
    if missing:
        raise RuntimeError(f"parameters without weights: {sorted(missing)[:5]}")
    torch.cuda.empty_cache()  # nothing but the arena holds the weights (a fallback's copies go back)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"tensors left on the meta device: {meta[:5]}")
    try:
        model.generation_config = GenerationConfig.from_pretrained(directory)
    except OSError:
        pass
    arena.serve(control, strategy=f"hydrator:{hydrator}" if hydrator else "ring")
    return model, arena


class _Streamer:
    """transformers' streamer protocol (put/end): each new token goes to the client as it is generated."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.prompt_seen = conn, False

    def put(self, value: Any) -> None:
        from coldsnap_probe import jsonline

        if not self.prompt_seen:  # generate first hands over the prompt
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            jsonline.send_line(self.conn, {"token": int(token), "unix": time.time()})

    def end(self) -> None:
        pass


def serve(directory: str, socket_path: str, hydration: str = "", hydrator: str = "", stack_bytes: int = 0) -> None:
    try:
        _serve(directory, socket_path, hydration, hydrator, stack_bytes)
    except BaseException as exc:
        stage("failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        raise


def _set_stack_limit(stack_bytes: int) -> None:
    from cuda.bindings import driver

    (err,) = driver.cuCtxSetLimit(driver.CUlimit.CU_LIMIT_STACK_SIZE, stack_bytes)
    if int(err):
        raise RuntimeError(f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {stack_bytes}): {err}")


def _serve(directory: str, socket_path: str, hydration: str, hydrator: str, stack_bytes: int) -> None:
    stage("process_start", since=T_START)
    import torch

    stage("import_torch")
    import transformers
    from transformers import LlamaForCausalLM

    stage("import_transformers", version=transformers.__version__)
    torch.zeros(1, device="cuda").sum().item()
    if stack_bytes:  # on torch's primary context, before anything compiles or captures a graph
        _set_stack_limit(stack_bytes)
    stage("cuda_init", device=torch.cuda.get_device_name(0), stack_bytes=stack_bytes)
    arena = None
    if hydration:
        model, arena = _arena_model(directory, hydration, hydrator)
    else:
        model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    model.generation_config.cache_implementation = "static"
    torch.cuda.synchronize()
    stage("weights_loaded", bytes=torch.cuda.memory_allocated())

    def generate(prompt: list[int], max_tokens: int, streamer: Any = None) -> tuple[list[int], str]:
        if arena is not None:
            arena.wait_ready()  # after a restore: until the worker's hydration has verified the weights
        ids = torch.tensor([prompt], device="cuda")
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, streamer=streamer,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        first = out.logits[0].float().cpu().numpy().tobytes()
        return out.sequences[0, len(prompt):].tolist(), hashlib.sha256(first).hexdigest()

    tokens, digest = generate(WARMUP_PROMPT, 16)
    stage("warmup_1_compile_and_capture", tokens=tokens, first_logits_sha256=digest)
    tokens, digest = generate(WARMUP_PROMPT, 16)
    stage("warmup_2", tokens=tokens, first_logits_sha256=digest)
    try:  # inductor's compile workers would be children of the captured tree: stop them once compiled
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
    except Exception as exc:  # recorded; the capture then dumps them too
        stage("compile_workers_kept", error=f"{type(exc).__name__}: {exc}")
    from coldsnap_probe import jsonline

    def answer(conn: socket.socket, _peer: jsonline.Peer) -> jsonline.Answer:
        request = jsonline.read_request(conn)
        tokens, digest = generate(list(request["prompt"]), int(request.get("max_tokens", 16)), _Streamer(conn))
        stage("served", tokens=len(tokens))
        return {"done": True, "tokens": tokens, "first_logits_sha256": digest}

    # Bound at its final path: CRIU re-binds a listening socket under the name it was bound with. Mode 0600,
    # root and this engine's uid only (jsonline.listen): the bench's client runs as root.
    server = jsonline.LineServer(jsonline.listen(socket_path), answer, peers=jsonline.Peers(), request_timeout=600.0)
    # What warm-up and compilation freed stays cached by torch's allocator; returned now, it is not part of the
    # device state a capture checkpoints (and copies through the CRIU images).
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    stage("ready", socket=socket_path, children=_children(), allocated=torch.cuda.memory_allocated(),
          reserved=torch.cuda.memory_reserved(), device_used=total - free)
    try:
        server.run()
    finally:
        if arena is not None:
            arena.stop_serving()


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    weights = sub.add_parser("weights")
    weights.add_argument("directory")
    weights.add_argument("--layers", type=int, default=0, help="fewer layers than the 8B shape's 32")
    server = sub.add_parser("serve")
    server.add_argument("directory")
    server.add_argument("--socket", required=True)
    server.add_argument("--log", default="")
    server.add_argument("--hydration", default="", help="weights in a WeightArena; its control socket")
    server.add_argument("--hydrator", default="", help="hydrate through this HydratorServer socket")
    server.add_argument("--stack-bytes", type=int, default=0, help="CUDA per-thread stack limit (0: the driver's)")
    launcher = sub.add_parser("launch")
    launcher.add_argument("--pid-floor", type=int, default=512)
    launcher.add_argument("--log", default="")
    launcher.add_argument("engine", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    global LOG_PATH
    LOG_PATH = getattr(args, "log", "")
    if args.command == "weights":
        write_weights(args.directory, args.layers)
    elif args.command == "launch":
        argv = args.engine[1:] if args.engine[:1] == ["--"] else args.engine
        if not argv:
            parser.error("launch needs an engine command after --")
        launch(argv, args.pid_floor)
    else:
        if args.stack_bytes < 0:
            parser.error(f"--stack-bytes {args.stack_bytes}: give 0 (the driver's) or a positive byte count")
        serve(args.directory, args.socket, args.hydration, args.hydrator, args.stack_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

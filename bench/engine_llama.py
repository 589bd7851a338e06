"""A real-engine-shaped inference server: an 8B-shaped Llama decoder (transformers + torch), issue 12 item 3.

    python bench/engine_llama.py weights DIR              write deterministic bf16 weights once (safetensors)
    python bench/engine_llama.py serve DIR --socket PATH   load, warm up (compile + CUDA graphs), serve

Shape of an 8B model (hidden 4096, 32 layers, 32 heads / 8 KV heads, FFN 14336, vocab 128256; ~16 GB in bf16)
with weights from a fixed seed (no downloads). Serving: a static KV cache, so `generate` compiles the decode
step with torch.compile and replays it as CUDA graphs; greedy. Every cold-start stage (imports, CUDA init,
weight load, warm-up compilation and graph capture) goes to stdout as a JSON line with its wall-clock time,
so a driver can put them on one timeline with the container's creation. Protocol (the same as
bench/_ttft_server.py): one JSON line {"prompt": [ids], "max_tokens": n} per connection on a Unix socket;
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
import sys
from typing import Any

SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
WARMUP_PROMPT = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679]


def stage(name: str, **extra: object) -> None:
    sys.stdout.write(json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(), **extra}) + "\n")
    sys.stdout.flush()


def write_weights(directory: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(directory)
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    stage("weights_written", bytes=size)


class _Streamer:
    """transformers' streamer protocol (put/end): each new token goes to the client as it is generated."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.prompt_seen = conn, False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate first hands over the prompt
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.conn.sendall(json.dumps({"token": int(token), "unix": time.time()}).encode() + b"\n")

    def end(self) -> None:
        pass


def serve(directory: str, socket_path: str) -> None:
    stage("process_start", since=T_START)
    import torch

    stage("import_torch")
    import transformers
    from transformers import LlamaForCausalLM

    stage("import_transformers", version=transformers.__version__)
    torch.zeros(1, device="cuda").sum().item()
    stage("cuda_init", device=torch.cuda.get_device_name(0))
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    model.generation_config.cache_implementation = "static"
    torch.cuda.synchronize()
    stage("weights_loaded", bytes=torch.cuda.memory_allocated())

    def generate(prompt: list[int], max_tokens: int, streamer: Any = None) -> tuple[list[int], str]:
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
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path + ".tmp")
    os.chmod(socket_path + ".tmp", 0o666)
    server.listen(8)
    os.rename(socket_path + ".tmp", socket_path)  # appears only when it accepts
    stage("ready", socket=socket_path)
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(conn.makefile("rb").readline())
            tokens, digest = generate(list(request["prompt"]), int(request.get("max_tokens", 16)), _Streamer(conn))
            conn.sendall(json.dumps({"done": True, "tokens": tokens, "first_logits_sha256": digest}).encode() + b"\n")
        stage("served", tokens=len(tokens))


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    weights = sub.add_parser("weights")
    weights.add_argument("directory")
    server = sub.add_parser("serve")
    server.add_argument("directory")
    server.add_argument("--socket", required=True)
    args = parser.parse_args()
    if args.command == "weights":
        write_weights(args.directory)
    else:
        serve(args.directory, args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A server split in two processes, the shape of vLLM's V1 engine: a front end and the engine core it starts.

    python engines/split_server.py --socket PATH                                  the CPU toy model
    python engines/split_server.py --socket PATH --cuda --gib G --weights FILE    ttft_server's transformer

The front end (the process started) owns the listening socket, tokenizes and detokenizes, and never touches the
GPU; the engine core (its child, `core`) alone runs the model and, with --cuda, holds the GPU. They talk as vLLM's
API server and EngineCore do, without ZMQ (not in the GPU image): a socketpair carries fixed-size records
(`RECORD`: kind, request number, three numbers), and a shared-memory ring (`multiprocessing.shared_memory`, a file
in /dev/shm that both map) carries the token ids both ways and the first logits' digest. Nothing here knows about
capture or restore: the worker captures the tree unchanged.

Client protocol (engines/ttft_server.py's, on a Unix socket, one request per connection): one JSON line
{"prompt": [ids], "max_tokens": n} or {"text": str, "max_tokens": n}, optionally with "conversation": name (the
core keeps each conversation's tokens, so a later turn depends on every earlier one: state only the core holds);
one {"token": id, "text": piece} line per generated token, then {"done": true, "first_logits_sha256": hex,
"text": completion}. {"op": "state"} answers both processes' state: pids, requests served, conversations, the
ring's name and the digest of its whole contents, the core's own counters.

Without --cuda the core's model is a deterministic toy (each token a digest of the conversation so far, standard
library only: the CPU tests run the tree under CRIU alone); with --cuda it is engines/ttft_server.py's model, its
stage lines (cuda_init, weights_loaded, graph_captured) written by the core and `ready` by the front end once both
serve, so bench/restore_ttft.py reads this server as it reads ttft_server. The core ends when the front end does
(PR_SET_PDEATHSIG), and the front end exits 1 when the core dies (a server without its engine answers nothing).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory
from typing import Any

RECORD = struct.Struct("<4sIIII")  # kind, request number, a, b, c
MAGIC = b"CSRING01"
HEADER = 64  # magic, request number, prompt length, tokens written, reserved, first-logits digest (32 bytes)
MAX_PROMPT = MAX_TOKENS = 4096
PROMPT_AT, OUT_AT = HEADER, HEADER + 4 * MAX_PROMPT
RING_BYTES = 64 << 10
BYTE_BASE = 3  # token ids 3..258 are the bytes 0..255 (the toy tokenizer); 0..2 are reserved as in Llama's
PR_SET_PDEATHSIG = 1


def stage(name: str, **extra: object) -> None:
    """One JSON line on stdout, as engines/ttft_server.py writes them (bench/_common.stages reads both)."""
    sys.stdout.write(json.dumps({"stage": name, "unix": time.time(), "pid": os.getpid(), **extra}) + "\n")
    sys.stdout.flush()


def tokenize(text: str) -> list[int]:
    return [b + BYTE_BASE for b in text.encode()]


def detokenize(token: int) -> str:
    return bytes([token - BYTE_BASE]).decode(errors="replace") if BYTE_BASE <= token < BYTE_BASE + 256 else \
        f"<{token}>"


def send_record(sock: socket.socket, kind: bytes, number: int, a: int = 0, b: int = 0, c: int = 0) -> None:
    sock.sendall(RECORD.pack(kind, number, a, b, c))


def read_record(sock: socket.socket) -> tuple[bytes, int, int, int, int]:
    """One record (EOFError when the other process is gone)."""
    data = b""
    while len(data) < RECORD.size:
        part = sock.recv(RECORD.size - len(data))
        if not part:
            raise EOFError("the other process closed the engine channel")
        data += part
    return RECORD.unpack(data)  # type: ignore[return-value]


class Ring:
    """The shared ring over a mapping of the segment: the prompt in, the tokens and the first digest out."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer

    def put_prompt(self, number: int, prompt: list[int]) -> None:
        struct.pack_into("<8sIII", self.buffer, 0, MAGIC, number, len(prompt), 0)
        struct.pack_into(f"<{len(prompt)}i", self.buffer, PROMPT_AT, *prompt)

    def prompt(self) -> tuple[int, list[int]]:
        magic, number, length = struct.unpack_from("<8sII", self.buffer, 0)
        if magic != MAGIC:
            raise ValueError(f"the ring's header is {magic!r}, not {MAGIC!r}")
        return number, list(struct.unpack_from(f"<{length}i", self.buffer, PROMPT_AT))

    def put_token(self, index: int, token: int) -> None:
        struct.pack_into("<i", self.buffer, OUT_AT + 4 * index, token)
        struct.pack_into("<I", self.buffer, 16, index + 1)

    def token(self, index: int) -> int:
        return int(struct.unpack_from("<i", self.buffer, OUT_AT + 4 * index)[0])

    def put_digest(self, digest: bytes) -> None:
        self.buffer[24:56] = digest

    def digest(self) -> str:
        return bytes(self.buffer[24:56]).hex()

    def sha256(self) -> str:
        return hashlib.sha256(bytes(self.buffer[:RING_BYTES])).hexdigest()


# --- the engine core -------------------------------------------------------------------------------------------
class ToyModel:
    """Each next token a digest of the conversation so far: deterministic, no CUDA, state in the core only."""

    def generate(self, context: list[int], prompt: list[int], max_tokens: int) -> tuple[bytes, list[int]]:
        tokens, out = context + prompt, []
        first = hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).digest()
        state = first
        for _ in range(max_tokens):
            token = BYTE_BASE + 32 + int.from_bytes(state[:4], "little") % 95  # printable ASCII, once detokenized
            out.append(token)
            state = hashlib.sha256(state + struct.pack("<i", token)).digest()
        return first, out


class CudaModel:
    """engines/ttft_server.py's transformer, loaded and graph-captured as ttft_server does it."""

    def __init__(self, gib: float, weights: str, seed: int, stack_bytes: int) -> None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import torch
        import ttft_server

        torch.zeros(1, device="cuda").sum().item()
        if stack_bytes:  # as ttft_server's --stack-bytes: less local memory reserved per thread
            from cuda.bindings import driver

            (err,) = driver.cuCtxSetLimit(driver.CUlimit.CU_LIMIT_STACK_SIZE, stack_bytes)
            if int(err):
                raise RuntimeError(f"cuCtxSetLimit(CU_LIMIT_STACK_SIZE, {stack_bytes}): {err}")
        stage("cuda_init")
        self.torch, self.model = torch, ttft_server.load(weights, gib, seed)
        self.positions = ttft_server.MAX_LEN
        stage("weights_loaded", device_bytes=torch.cuda.memory_allocated())
        self.model.capture()
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        free, total = torch.cuda.mem_get_info()
        stage("graph_captured", device_bytes=torch.cuda.memory_allocated(), device_used=total - free)

    def generate(self, context: list[int], prompt: list[int], max_tokens: int) -> tuple[bytes, list[int]]:
        if context:
            raise ValueError("conversations are the toy model's (the CUDA model's KV cache holds 128 positions)")
        if len(prompt) + max_tokens > self.positions:
            raise ValueError(f"prompt and max_tokens exceed the model's {self.positions} positions")
        for pos, token in enumerate(prompt[:-1]):
            self.model.step(token, pos)
        last, pos, first, out = prompt[-1], len(prompt) - 1, b"", []
        for _ in range(max_tokens):
            logits = self.model.step(last, pos)
            if not first:
                first = hashlib.sha256(logits.cpu().numpy().tobytes()).digest()
            last = int(logits.argmax())
            out.append(last)
            pos += 1
        return first, out


def core(channel: socket.socket, segment: str, args: argparse.Namespace) -> None:
    """The engine core: serves the front end's records until it goes (then the kernel's SIGTERM ends us)."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        return
    fd = os.open(f"/dev/shm/{segment}", os.O_RDWR)  # mapped directly: no resource tracker of its own to unlink it
    try:
        ring = Ring(mmap.mmap(fd, RING_BYTES))
    finally:
        os.close(fd)
    model = CudaModel(args.gib, args.weights, args.seed, args.stack_bytes) if args.cuda else ToyModel()
    conversations: dict[int, list[int]] = {}
    served = 0
    send_record(channel, b"RDY\0", 0, os.getpid())
    while True:
        try:
            kind, number, a, b, c = read_record(channel)
        except EOFError:  # the front end is gone (the kernel's SIGTERM may not have arrived yet)
            return
        if kind == b"STA\0":
            send_record(channel, b"STA\0", number, served, len(conversations),
                        sum(len(t) for t in conversations.values()))
            continue
        written, prompt = ring.prompt()
        if kind != b"GEN\0" or written != number or len(prompt) != a:
            raise ValueError(f"record {kind!r} {number} does not match the ring (request {written}, "
                             f"{len(prompt)} tokens)")
        context = conversations.get(c, [])
        try:
            first, tokens = model.generate(context, prompt, b)
        except ValueError as exc:  # a request the model cannot serve: refused, the core serves on
            sys.stderr.write(f"split_server core: request {number} refused: {exc}\n")
            send_record(channel, b"ERR\0", number)
            continue
        ring.put_digest(first)
        for index, token in enumerate(tokens):
            ring.put_token(index, token)
            send_record(channel, b"TOK\0", number, index)
        if c:
            conversations[c] = context + prompt + tokens
        served += 1
        send_record(channel, b"END\0", number, len(tokens))


# --- the front end ---------------------------------------------------------------------------------------------
class FrontEnd:
    """The front end's state: the ring, the channel to the core, the requests served, the conversations' ids."""

    def __init__(self, ring: Ring, channel: socket.socket, core_pid: int, segment: str) -> None:
        self.ring, self.channel, self.core_pid, self.segment = ring, channel, core_pid, segment
        self.lock = threading.Lock()  # one request at a time on the ring
        self.served = 0
        self.conversations: dict[str, int] = {}

    def request(self, request: dict[str, Any], send: Any) -> dict[str, Any]:
        if request.get("op") == "state":
            return self.state()
        prompt = [int(t) for t in request["prompt"]] if "prompt" in request else tokenize(str(request["text"]))
        max_tokens = int(request["max_tokens"])
        if not prompt or len(prompt) > MAX_PROMPT or not 1 <= max_tokens <= MAX_TOKENS:
            raise ValueError(f"a prompt of 1 to {MAX_PROMPT} tokens and max_tokens 1 to {MAX_TOKENS}")
        with self.lock:
            name = str(request.get("conversation") or "")
            conversation = self.conversations.setdefault(name, len(self.conversations) + 1) if name else 0
            number = self.served + 1
            self.ring.put_prompt(number, prompt)
            send_record(self.channel, b"GEN\0", number, len(prompt), max_tokens, conversation)
            text = []
            while True:
                kind, answered, index, _, _ = read_record(self.channel)
                if answered != number:
                    raise ValueError(f"the core answered request {answered} during request {number}")
                if kind == b"END\0":
                    break
                if kind == b"ERR\0":
                    raise ValueError(f"the engine core refused request {number} (its log says why)")
                token = self.ring.token(index)
                text.append(detokenize(token))
                send({"token": token, "text": text[-1]})
            self.served = number
            return {"done": True, "first_logits_sha256": self.ring.digest(), "text": "".join(text)}

    def state(self) -> dict[str, Any]:
        with self.lock:
            send_record(self.channel, b"STA\0", self.served)
            _, _, served, conversations, tokens = read_record(self.channel)
            return {"front_pid": os.getpid(), "core_pid": self.core_pid, "served": self.served,
                    "conversations": dict(self.conversations), "ring": self.segment, "ring_sha256": self.ring.sha256(),
                    "core": {"served": served, "conversations": conversations, "tokens": tokens}}


def watch_core(process: subprocess.Popen[bytes]) -> None:
    """A front end without its engine answers nothing: it ends when the core does."""
    code = process.wait()
    sys.stderr.write(f"split_server: the engine core {process.pid} ended ({code}): the front end exits\n")
    os._exit(1)


def serve(args: argparse.Namespace) -> None:
    from coldsnap_probe import jsonline

    segment = shared_memory.SharedMemory(create=True, size=RING_BYTES)
    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "core", "--fd", str(theirs.fileno()),
                                    "--segment", segment.name, *(["--cuda"] if args.cuda else []),
                                    "--gib", str(args.gib), "--weights", args.weights, "--seed", str(args.seed),
                                    "--stack-bytes", str(args.stack_bytes)],
                                   pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        kind, _, core_pid, _, _ = read_record(ours)
        if kind != b"RDY\0":
            raise RuntimeError(f"the engine core said {kind!r} first, not RDY")
        front = FrontEnd(Ring(segment.buf), ours, core_pid, segment.name)
        threading.Thread(target=watch_core, args=(process,), name="split-watch-core", daemon=True).start()

        def answer(conn: socket.socket, _peer: jsonline.Peer) -> jsonline.Answer:
            return front.request(jsonline.read_request(conn), lambda line: jsonline.send_line(conn, line))

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        server = jsonline.LineServer(jsonline.listen(args.socket), answer, peers=jsonline.Peers(),
                                     request_timeout=600.0)
        stage("ready", socket=args.socket, core_pid=core_pid, ring=segment.name)
        server.run()
    finally:
        segment.close()
        segment.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["serve", "core"], default="serve")
    parser.add_argument("--socket", default="", help="the front end's Unix socket (serve)")
    parser.add_argument("--cuda", action="store_true", help="engines/ttft_server.py's model on the GPU")
    parser.add_argument("--gib", type=float, default=2.0, help="the CUDA model's size")
    parser.add_argument("--weights", default="device", help="its weights file, or \"device\" (made on the GPU)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--stack-bytes", type=int, default=0, help="CUDA per-thread stack limit (0: the driver's)")
    parser.add_argument("--fd", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--segment", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "core":
        core(socket.socket(fileno=args.fd), args.segment, args)
        return
    if not args.socket:
        parser.error("serve needs --socket")
    stage("process_start")
    serve(args)


if __name__ == "__main__":
    main()

"""A server that forks workers (issue 23's fault case "a server that forked workers"), small enough to read.

    python engines/forking_server.py serve --port P [--host H] [--workers N] [--cuda]
    python engines/forking_server.py ask --port P [--host H] [--workers N] [--limit S]

`serve` binds and listens once, then forks N workers that all accept on that one listening socket (the
pre-fork model of gunicorn, uvicorn's `--workers`, Apache): the parent only supervises. Each answer to
`GET /` is JSON naming the worker (`worker`, `pid`, `parent`, `served`); with `--cuda` each worker also
holds a 64 MiB tensor on the GPU (initialised after the fork, as CUDA requires) and answers its sum, computed
on the device per request, so an answer after a restore proves that worker's device memory came back. If a
worker dies the parent stops the others and exits 1: a respawned worker would hide the loss (and change the
PIDs a restore must keep); a worker whose parent dies gets SIGTERM. SIGTERM stops every worker and exits 0.
Standard library only, torch with `--cuda`.

`ask` (`ask_workers`) sends requests until every worker has answered once; the kernel wakes the accept
waiters in turn, so N requests usually reach N workers, and the client retries while the port is closed (a
restore in progress).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import sys
import time
from typing import Any

MAX_HEAD = 16 << 10
TENSOR_ELEMENTS = 16 << 20  # float32: 64 MiB, above the CUDA interposer's 2 MiB threshold
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ForkingServerError(Exception):
    """A worker did not answer in time, or answered something other than its JSON."""


def _read_head(conn: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(4096)
        if not data:
            raise ValueError("the client closed before the end of its request head")
        head += data
        if len(head) > MAX_HEAD:
            raise ValueError(f"request head over {MAX_HEAD} bytes")
    return head.split(b"\r\n\r\n", 1)[0]


def _response(status: int, reason: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode() + data


class _Device:
    """The worker's device state: a tensor of `index + 1`s, summed on the GPU at every request."""

    def __init__(self, index: int) -> None:
        import torch  # only with --cuda: the server itself needs nothing outside the standard library

        self.values = torch.full((TENSOR_ELEMENTS,), float(index + 1), dtype=torch.float32, device="cuda")
        self.name = torch.cuda.get_device_name()

    def answer(self) -> dict[str, Any]:
        return {"device_sum": float(self.values.sum().item()), "device": self.name}


def _worker(listener: socket.socket, index: int, cuda: bool, parent: int) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # A worker never outlives its supervisor (SIGKILLed, it cannot stop them): the kernel sends SIGTERM when
    # the parent dies, and CRIU restores that setting with the tree. The parent may already be gone by now.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        return
    device = _Device(index) if cuda else None
    served = 0
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            try:
                request = _read_head(conn).split(b"\r\n", 1)[0].split()
            except (OSError, ValueError):
                continue  # that client's problem, not the worker's
            if request[:2] != [b"GET", b"/"]:
                conn.sendall(_response(404, "Not Found", {"error": "only GET / is served"}))
                continue
            served += 1
            body = {"worker": index, "pid": os.getpid(), "parent": os.getppid(), "served": served,
                    **(device.answer() if device else {})}
            conn.sendall(_response(200, "OK", body))


def serve(host: str, port: int, workers: int, *, cuda: bool) -> int:
    """Listen, fork `workers` workers on the one socket, supervise them; returns the exit code."""
    listener = socket.create_server((host, port), backlog=128)
    parent, pids = os.getpid(), list[int]()
    for index in range(workers):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _worker(listener, index, cuda, parent)
            except BaseException as exc:  # the child must never return into the parent's code
                sys.stderr.write(f"worker {index}: {type(exc).__name__}: {exc}\n")
            finally:
                os._exit(code)
        pids.append(pid)
    listener.close()  # the workers hold it; the parent only supervises
    live = set(pids)  # Invariant: the workers not yet reaped (a reaped PID may already be someone else's)
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for child in live:
            os.kill(child, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    pid, status = os.wait()
    live.discard(pid)
    failed = not stopping
    if failed:
        sys.stderr.write(f"worker process {pid} ended ({status:#x}): stopping the others\n")
        stop(signal.SIGTERM, None)
    while live:
        live.discard(os.wait()[0])
    return 1 if failed else 0


def ask_worker(host: str, port: int, timeout: float) -> dict[str, Any]:
    """One `GET /`: the answering worker's JSON (OSError while nothing listens)."""
    with socket.create_connection((host, port), timeout=timeout) as conn:
        conn.sendall(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while data := conn.recv(65536):
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if not status.startswith(b"HTTP/1.1 200 "):
        raise ForkingServerError(f"the server answered {status[:100]!r}")
    try:
        answer = json.loads(body)
    except ValueError as exc:
        raise ForkingServerError(f"the answer is not JSON: {body[:200]!r}") from exc
    if not isinstance(answer, dict) or not isinstance(answer.get("worker"), int):
        raise ForkingServerError(f"the answer names no worker: {body[:200]!r}")
    return answer


def ask_workers(host: str, port: int, workers: int, *, limit_s: float = 60.0) -> dict[int, dict[str, Any]]:
    """Each worker's answer (by worker index), asking until all `workers` answered or `limit_s` passed."""
    answers: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + limit_s
    last = "no request was answered"
    while len(answers) < workers:
        if time.monotonic() > deadline:
            missing = sorted(set(range(workers)) - set(answers))
            raise ForkingServerError(f"workers {missing} of {workers} never answered on {host}:{port} within "
                                     f"{limit_s:g} s (last: {last})")
        try:
            answer = ask_worker(host, port, timeout=max(1.0, deadline - time.monotonic()))
        except OSError as exc:  # refused while the port is closed (a restore in progress), reset
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.02)
            continue
        if answer["worker"] in answers:
            time.sleep(0.05)  # another worker is still starting (importing torch): no need to spin
        answers.setdefault(answer["worker"], answer)
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "ask"):
        command = sub.add_parser(name)
        command.add_argument("--host", default="127.0.0.1")
        command.add_argument("--port", type=int, required=True)
        command.add_argument("--workers", type=int, default=2, choices=range(1, 65), metavar="1..64")
    sub.choices["serve"].add_argument("--cuda", action="store_true", help="each worker holds GPU memory")
    sub.choices["ask"].add_argument("--limit", type=float, default=60.0)
    args = parser.parse_args()
    if args.command == "serve":
        return serve(args.host, args.port, args.workers, cuda=args.cuda)
    try:
        print(json.dumps(ask_workers(args.host, args.port, args.workers, limit_s=args.limit)))
    except ForkingServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

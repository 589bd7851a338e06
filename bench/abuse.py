"""Legitimate latency with and without abusive clients, side by side in one run.

    .venv/bin/python bench/abuse.py [--calls 400]

Abuse: 50 slow-loris connections (a partial line, then silence), and loops sending
malformed JSON, 1 MiB unterminated lines, wrong tokens and wrong hosts as fast as they
are answered. The legitimate client issues image-inspect calls.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
from _common import Session, running_daemon, summary, table

IMAGE = "coldsnap-test/busybox:1"


async def legit(session: Session, calls: int) -> tuple[list[float], int]:
    samples, errors = [], 0
    for _ in range(calls):
        started = time.perf_counter()
        reply = await session.runtime("image-inspect", image=IMAGE)
        samples.append(time.perf_counter() - started)
        errors += not reply.ok
    return samples, errors


async def main(calls: int) -> None:
    async with running_daemon("[server]\nrequest_read_timeout_s = 5.0\n") as daemon:
        session = await daemon.open_session()
        await legit(session, 50)
        quiet, quiet_errors = await legit(session, calls)
        stop = anyio.Event()
        abusive = 0

        async def slow_loris() -> None:
            while not stop.is_set():
                try:
                    async with await anyio.connect_unix(session.socket) as stream:
                        await stream.send(b'{"format":1,')
                        with anyio.move_on_after(10):
                            await stop.wait()
                except OSError:
                    pass

        async def flood(payload: bytes) -> None:
            nonlocal abusive
            while not stop.is_set():
                try:
                    await session.raw(payload)
                    abusive += 1
                except OSError:
                    pass

        wrong_token = json.dumps({**session.envelope("capabilities"), "token": "forged"}).encode() + b"\n"
        wrong_host = json.dumps(session.envelope("exec", host="elsewhere", arguments=["true"])).encode() + b"\n"
        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(slow_loris)
            for payload in (b"{not json\n", b'{"id":"x","' + b"a" * (1 << 20), wrong_token, wrong_host):
                tg.start_soon(flood, payload)
            await anyio.sleep(0.5)
            loud, loud_errors = await legit(session, calls)
            stop.set()
        q, lo = summary(quiet), summary(loud)
        print(table(["legitimate image-inspect", "p50 ms", "p99 ms", "errors", "abusive requests answered"], [
            ["alone", f"{q['p50']:.2f}", f"{q['p99']:.2f}", quiet_errors, "-"],
            ["under abuse (50 slow-loris + 4 floods)", f"{lo['p50']:.2f}", f"{lo['p99']:.2f}", loud_errors, abusive],
            ["ratio", f"{lo['p50'] / q['p50']:.2f}x", f"{lo['p99'] / q['p99']:.2f}x", "", ""],
        ]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=400)
    anyio.run(main, parser.parse_args().calls, backend="asyncio")

"""A client's view of an OpenAI-compatible server: one streaming `/v1/chat/completions` request, timed.

HTTP/1.1 over a plain TCP connection (`Connection: close`, so no connection outlives the request and a
capture right after finds the server idle), the body decoded as the server sends it (chunked or not), the
Server-Sent Events split into `data:` payloads, each chunk's arrival time kept. The parser (`SSEStream`) is
fed bytes and knows nothing of sockets, so CI checks it on recorded and adversarial input.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

MAX_HEAD = 64 << 10
MAX_EVENT = 4 << 20


class ClientError(Exception):
    """The server's answer is not a well-formed streaming completion (the message says what was wrong)."""


@dataclass
class SSEStream:
    """Incremental parser: HTTP status line and headers, chunked or plain body, SSE `data:` events."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    events: list[Any] = field(default_factory=list)  # decoded JSON payloads; "[DONE]" as the string
    done: bool = False
    _head: bytearray = field(default_factory=bytearray)
    _body: bytearray = field(default_factory=bytearray)  # undecoded chunked framing
    _text: bytearray = field(default_factory=bytearray)  # decoded body not yet split into events
    _chunked: bool = False
    _ended: bool = False  # the chunked body's last chunk was seen

    @property
    def complete(self) -> bool:
        """`data: [DONE]` seen (OpenAI's end marker), or the chunked body's last chunk (servers that send no
        marker, `transformers serve` among them, end the stream with the body)."""
        return self.done or self._ended

    def feed(self, data: bytes) -> list[Any]:
        """Consume bytes; return the events they completed."""
        before = len(self.events)
        if not self.status:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                if len(self._head) > MAX_HEAD:
                    raise ClientError(f"no end of the HTTP head within {MAX_HEAD} bytes")
                return []
            self._parse_head(bytes(self._head[:end]))
            data = bytes(self._head[end + 4:])
            self._head.clear()
        if self._chunked:
            self._body += data
            self._unchunk()
        else:
            self._text += data
        self._split()
        return self.events[before:]

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ClientError(f"not an HTTP/1.x status line: {lines[0][:200]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ClientError(f"malformed header line {line[:200]!r}")
            self.headers[name.strip().lower()] = value.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()

    def _unchunk(self) -> None:
        while not self._ended:
            end = self._body.find(b"\r\n")
            if end < 0:
                return
            size_text = bytes(self._body[:end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError as exc:
                raise ClientError(f"bad chunk size {size_text[:40]!r}") from exc
            if size > MAX_EVENT:
                raise ClientError(f"chunk of {size} bytes exceeds {MAX_EVENT}")
            if size == 0:
                self._ended = True
                return
            if len(self._body) < end + 2 + size + 2:
                return
            if self._body[end + 2 + size:end + 4 + size] != b"\r\n":
                raise ClientError("a chunk does not end with CRLF")
            self._text += self._body[end + 2:end + 2 + size]
            del self._body[:end + 4 + size]

    def _split(self) -> None:
        text = self._text.replace(b"\r\n", b"\n")
        while True:
            end = text.find(b"\n\n")
            if end < 0:
                break
            block, text = text[:end], text[end + 2:]
            data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if not data:
                continue  # a comment or keep-alive
            payload = b"\n".join(data)
            if payload == b"[DONE]":
                self.events.append("[DONE]")
                self.done = True
                continue
            try:
                self.events.append(json.loads(payload))
            except ValueError as exc:
                raise ClientError(f"an event's data is not JSON: {payload[:200]!r}") from exc
        if len(text) > MAX_EVENT:
            raise ClientError(f"an event exceeds {MAX_EVENT} bytes")
        self._text = bytearray(text)


def content_of(event: Any) -> str:
    """The text a chat-completion chunk adds ('' for role-only, usage or finish chunks)."""
    if not isinstance(event, dict):
        return ""
    if "error" in event:
        raise ClientError(f"the server reported an error mid-stream: {str(event['error'])[:500]}")
    choices = event.get("choices") or []
    delta = (choices[0] or {}).get("delta") if choices and isinstance(choices[0], dict) else None
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


def chat_request(model: str, prompt: str, *, max_tokens: int, seed: int = 0) -> dict[str, Any]:
    """Greedy (temperature 0), fixed seed, streamed."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "seed": seed}


def http_post(host: str, port: int, path: str, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            ).encode() + payload


@dataclass
class Completion:
    connected: float = 0.0  # host clock: the connection was accepted
    requested: float = 0.0  # the request was sent
    first: float = 0.0  # the first chunk with content arrived
    last: float = 0.0
    text: str = ""
    chunks: int = 0
    finish_reason: str = ""
    connect_attempts: int = 0


async def connect(host: str, port: int, *, limit: float, step: float = 0.01) -> tuple[Any, int]:
    """Connect, retrying while nothing listens (a starting or restoring server) for up to `limit` seconds."""
    attempts = 0
    with anyio.fail_after(limit):
        while True:
            attempts += 1
            try:
                return await anyio.connect_tcp(host, port), attempts
            except OSError:
                await anyio.sleep(step)


async def stream_chat(host: str, port: int, body: dict[str, Any], *, connect_limit: float = 600.0,
                      limit: float = 300.0) -> Completion:
    """One streaming chat completion; every phase stamped with the host clock."""
    result = Completion()
    stream, result.connect_attempts = await connect(host, port, limit=connect_limit)
    result.connected = time.time()
    parser = SSEStream()
    async with stream:
        await stream.send(http_post(host, port, "/v1/chat/completions", body))
        result.requested = time.time()
        with anyio.fail_after(limit):
            closed = False
            while not parser.complete:
                try:
                    data = await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    closed = True
                    break
                for event in parser.feed(data):
                    text = content_of(event)
                    if isinstance(event, dict):
                        result.chunks += 1
                        choices = event.get("choices") or [{}]
                        reason = choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
                        result.finish_reason = reason or result.finish_reason
                    if text:
                        result.first = result.first or time.time()
                        result.last = time.time()
                        result.text += text
    if parser.status != 200:
        raise ClientError(f"HTTP {parser.status or 'no answer'}: {bytes(parser._text)[:500]!r}")
    if not (parser.complete or (closed and parser.status and not parser._chunked)):
        raise ClientError(f"the connection closed mid-stream after {result.chunks} chunks (no [DONE], no end of "
                          "the chunked body)")
    if not (parser.done or result.finish_reason):
        raise ClientError(f"the stream ended without [DONE] or a finish_reason after {result.chunks} chunks")
    if not result.first:
        raise ClientError(f"the completion has no content ({result.chunks} chunks, finish {result.finish_reason})")
    return result

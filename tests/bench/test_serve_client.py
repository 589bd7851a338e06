"""bench/serve_client.py: the SSE parser on recorded and adversarial bytes, and the client against real TCP
servers that answer the way `transformers serve` does (chunked SSE, no [DONE]), late, wrongly or not at all."""

from __future__ import annotations

import json
import socket
import time

import anyio
import pytest
from anyio.abc import SocketStream

from bench.serve_client import ClientError, SSEStream, chat_request, content_of, http_post, stream_chat


def _chunk(event: dict[str, object] | str) -> bytes:
    data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _delta(text: str | None, finish: str | None = None) -> dict[str, object]:
    delta = {"content": text} if text is not None else {"role": "assistant"}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
EVENTS = [_delta(None), _delta(" w1"), _delta(" w2"), _delta("", "length")]
RECORDED = HEAD + b"".join(_chunk(e) for e in EVENTS) + b"0\r\n\r\n"


def test_parser_byte_by_byte_equals_whole() -> None:
    whole = SSEStream()
    whole.feed(RECORDED)
    split = SSEStream()
    for i in range(len(RECORDED)):
        split.feed(RECORDED[i:i + 1])
    assert whole.events == split.events == EVENTS
    assert whole.complete and split.complete and not whole.done  # ended by the body, no [DONE]
    assert "".join(content_of(e) for e in whole.events) == " w1 w2"


def test_parser_done_marker_and_comments_and_crlf_events() -> None:
    body = b": keep-alive\r\n\r\ndata: " + json.dumps(_delta("a")).encode() + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    parser = SSEStream()
    events = parser.feed(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + body)
    assert events == [_delta("a"), "[DONE]"]
    assert parser.done and parser.complete


@pytest.mark.parametrize(("raw", "message"), [
    (b"SMTP 220 hello\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno-colon-here\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcXY", "does not end with CRLF"),
    (b"HTTP/1.1 200 OK\r\n\r\ndata: {not json}\n\n", "not JSON"),
    (b"HTTP/1.1 200 OK\r\n" + b"x" * (70 << 10), "no end of the HTTP head"),
])
def test_parser_refuses_malformed_input_naming_it(raw: bytes, message: str) -> None:
    with pytest.raises(ClientError, match=message):
        SSEStream().feed(raw)


def test_content_of_raises_on_an_error_event_and_ignores_other_shapes() -> None:
    with pytest.raises(ClientError, match="error mid-stream: boom"):
        content_of({"error": "boom"})
    assert content_of("[DONE]") == ""
    assert content_of({"choices": []}) == ""
    assert content_of({"choices": [{"delta": {"content": 5}}]}) == ""


def test_request_is_greedy_seeded_and_closes_the_connection() -> None:
    body = chat_request("/weights", "hi", max_tokens=7, seed=3)
    assert body["temperature"] == 0 and body["seed"] == 3 and body["stream"] is True and body["max_tokens"] == 7
    raw = http_post("127.0.0.1", 1, "/v1/chat/completions", body)
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"Connection: close" in head and f"Content-Length: {len(payload)}".encode() in head
    assert json.loads(payload) == body


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(port: int, answer: bytes, *, delay: float = 0.0, pause: float = 0.0) -> None:
    """A one-request server: optionally starts listening late; sends `answer` in two halves `pause` apart."""
    await anyio.sleep(delay)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    async with listener:
        async def handle(stream: SocketStream) -> None:
            async with stream:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += await stream.receive()
                half = len(answer) // 2
                await stream.send(answer[:half])
                await anyio.sleep(pause)
                await stream.send(answer[half:])
            raise anyio.get_cancelled_exc_class()  # one request, then stop listening

        try:
            await listener.serve(handle)
        except anyio.get_cancelled_exc_class():
            pass


async def _client_against(answer: bytes, **server: float) -> object:
    port = _free_port()
    result: list[object] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _serve(port, answer, **server))

        async def client() -> None:
            try:
                result.append(await stream_chat("127.0.0.1", port, chat_request("m", "p", max_tokens=2),
                                                connect_limit=10, limit=10))
            except ClientError as exc:
                result.append(exc)
            tg.cancel_scope.cancel()

        tg.start_soon(client)
    return result[0]


async def test_stream_chat_times_a_late_server_and_reads_the_whole_completion() -> None:
    started = time.time()
    done = await _client_against(RECORDED, delay=0.3, pause=0.2)
    assert not isinstance(done, Exception), done
    assert done.text == " w1 w2" and done.finish_reason == "length"  # type: ignore[attr-defined]
    assert done.connect_attempts > 1  # type: ignore[attr-defined]  # refused while the port was closed
    assert started + 0.3 <= done.connected <= done.requested <= done.first <= done.last  # type: ignore[attr-defined]


async def test_stream_chat_refuses_a_stream_cut_mid_body() -> None:
    cut = RECORDED[:-len(b"0\r\n\r\n") - len(_chunk(EVENTS[-1]))]  # the server died before the end
    error = await _client_against(cut)
    assert isinstance(error, ClientError) and "closed mid-stream" in str(error)


async def test_stream_chat_names_an_http_error() -> None:
    error = await _client_against(b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found")
    assert isinstance(error, ClientError) and "HTTP 404" in str(error) and "not found" in str(error)


async def test_stream_chat_refuses_a_completion_without_content() -> None:
    empty = HEAD + _chunk(_delta(None)) + _chunk(_delta("", "stop")) + b"0\r\n\r\n"
    error = await _client_against(empty)
    assert isinstance(error, ClientError) and "no content" in str(error)

"""Property tests of the metrics endpoint's request-head parser (`parse_head`, no I/O; issue 37 item 8): whatever
bytes arrive, the answer is a GET or HEAD of /metrics with its Accept value, or one well-formed refusal; a head
over 8 KiB is always 431, however it arrived. The endpoint itself, over real sockets: tests/provider/test_metrics.py."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coldsnap_provider._metrics_http import MAX_HEAD_BYTES, parse_head

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOKEN = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_!#$%&'*+.^`|~"),
                min_size=1, max_size=12)
FIELD_TEXT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF), max_size=40)  # latin-1, no CR/LF
PAD = st.text(st.sampled_from(" \t"), max_size=3)


def refusal(answer: bytes) -> int:
    """The status of a refusal, checked well-formed: a status line, Content-Length matching its body, close."""
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 ") and b"Connection: close" in lines
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"Content-Length:"))
    assert length == len(body) > 0
    return int(lines[0].split(b" ")[1])


@SETTINGS
@given(st.binary(max_size=10_000))
def test_any_head_is_a_metrics_request_or_one_well_formed_refusal(head: bytes) -> None:
    answer = parse_head(head)
    if isinstance(answer, bytes):
        assert refusal(answer) in (400, 404, 405, 431)
    else:
        method, accept = answer
        assert method in (b"GET", b"HEAD") and isinstance(accept, str)


@SETTINGS
@given(start=st.binary(max_size=300), fill=st.binary(min_size=1, max_size=4),
       size=st.integers(MAX_HEAD_BYTES - 3, MAX_HEAD_BYTES + 4000))
def test_a_head_over_the_bound_is_431_whatever_it_holds(start: bytes, fill: bytes, size: int) -> None:
    head = (start + fill * size)[:size]  # any bytes first, then a run to `size` (its blank line adds 4)
    answer = parse_head(head)
    assert isinstance(answer, bytes) and refusal(answer) == 431


@SETTINGS
@given(method=st.sampled_from([b"GET", b"HEAD"]), query=st.none() | st.text(st.sampled_from("ab=&%1"), max_size=20),
       version=st.sampled_from([b"HTTP/1.0", b"HTTP/1.1"]),
       headers=st.lists(st.tuples(TOKEN, PAD, FIELD_TEXT, PAD), max_size=5),
       accept=st.none() | st.tuples(st.sampled_from(["Accept", "accept", "ACCEPT", " Accept"]), PAD, FIELD_TEXT, PAD))
def test_a_valid_request_gives_its_method_and_last_accept_value(method: bytes, query: str | None, version: bytes,
                                                               headers: list[tuple[str, str, str, str]],
                                                               accept: tuple[str, str, str, str] | None) -> None:
    target = b"/metrics" + (b"?" + query.encode() if query is not None else b"")
    fields = [h for h in headers if h[0].strip().lower() != "accept"] + ([accept] if accept else [])
    head = b"\r\n".join([method + b" " + target + b" " + version,
                         *(f"{name}:{before}{value}{after}".encode("latin-1")
                           for name, before, value, after in fields)])
    answer = parse_head(head)
    if len(head) + 4 > MAX_HEAD_BYTES:
        assert isinstance(answer, bytes) and refusal(answer) == 431
        return
    assert answer == (method, accept[2] if accept else "")


@SETTINGS
@given(method=TOKEN, target=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40))
def test_another_method_is_405_and_another_target_404(method: str, target: str) -> None:
    answer = parse_head(f"{method} {target} HTTP/1.1".encode())
    if method not in ("GET", "HEAD"):
        assert isinstance(answer, bytes) and refusal(answer) == 405
    elif target.split("?", 1)[0] != "/metrics":
        assert isinstance(answer, bytes) and refusal(answer) == 404

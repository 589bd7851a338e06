"""The envelope decoder and reply encoder, without I/O (hypothesis-friendly)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coldsnap_provider._envelope import (
    Capabilities,
    Exec,
    Reply,
    Runtime,
    decode_request,
    encode_reply,
    error_reply,
    lenient_id,
)
from coldsnap_runtime.errors import NotFound, RequestRejected
from coldsnap_runtime.schema import ImageInfo, RuntimeResponse, WorkloadInfo

BASE = {"format": 1, "id": "1", "token": "t", "session": "s"}


def line(**fields: object) -> bytes:
    return json.dumps({**BASE, **fields}).encode()


class TestDecode:
    def test_decode_capabilities_is_typed(self) -> None:
        assert isinstance(decode_request(line(operation="capabilities")), Capabilities)

    def test_decode_exec_decodes_base64_input(self) -> None:
        request = decode_request(line(operation="exec", host="h", arguments=["cat"], input="AAEC"))
        assert isinstance(request, Exec) and request.input == b"\x00\x01\x02"

    @pytest.mark.parametrize(
        ("fields", "message"),
        [
            pytest.param({"operation": "capabilities", "injected": 1},
                         "host-provider request has unknown fields: injected", id="unknown-key"),
            pytest.param({"operation": "nope"}, "unsupported host-provider operation 'nope'", id="unknown-op"),
            pytest.param({"operation": "capabilities", "format": True}, "got `bool` - at `$.format`", id="format-true"),
            pytest.param({"operation": "capabilities", "format": 2}, "`$.format`", id="format-2"),
            pytest.param({"operation": "capabilities", "format": 1.0}, "`$.format`", id="format-float"),
            pytest.param({"operation": "capabilities", "id": ""}, "`$.id`", id="empty-id"),
            pytest.param({"operation": "capabilities", "id": 7}, "`$.id`", id="int-id"),
            pytest.param({"operation": "exec", "host": "h", "arguments": ["x"], "input": "%%%"},
                         "Invalid base64 encoded string - at `$.input`", id="bad-base64"),
            pytest.param({"operation": "exec", "host": "h", "arguments": []}, "`$.arguments`", id="no-argv"),
            pytest.param({"operation": "exec", "host": "h", "arguments": [""]}, "arguments[0]", id="empty-argv0"),
            pytest.param({"operation": "exec", "host": "h", "arguments": ["a\u0000b"]}, "NUL", id="nul-arg"),
            pytest.param({"operation": "exec", "arguments": ["x"]}, "missing required field `host`", id="no-host"),
            pytest.param({"operation": "exec", "host": "h", "arguments": ["x"], "combined": 1},
                         "Expected `bool`, got `int`", id="int-bool"),
            pytest.param({"operation": "runtime", "host": "h", "runtime": {"action": "nope"}},
                         "unsupported manager runtime action 'nope'", id="unknown-action"),
            pytest.param({"operation": "capabilities", "token": "a\nb"}, "`$.token`", id="token-newline"),
        ],
    )
    def test_decode_invalid_request_is_rejected_with_a_named_rule(self, fields: dict[str, object],
                                                                   message: str) -> None:
        with pytest.raises(RequestRejected) as info:
            decode_request(line(**fields))
        assert message in str(info.value)

    @pytest.mark.parametrize("data", [b"[]", b"1", b"null", b'"x"'])
    def test_decode_non_object_is_rejected(self, data: bytes) -> None:
        with pytest.raises(RequestRejected, match="must be a JSON object"):
            decode_request(data)

    def test_decode_trailing_json_is_rejected(self) -> None:
        with pytest.raises(RequestRejected, match="not valid JSON"):
            decode_request(line(operation="capabilities") + b" {}")

    def test_peek_id_tolerates_anything(self) -> None:
        assert lenient_id(b'{"id":"42","junk":[1]}') == "42"
        assert lenient_id(b'{"id":42}') == ""
        assert lenient_id(b"\xff\x00") == ""

    @given(st.binary(max_size=512))
    @settings(max_examples=300)
    def test_decode_arbitrary_bytes_only_ever_rejects(self, data: bytes) -> None:
        try:
            decode_request(data)
        except RequestRejected:
            pass

    @given(st.dictionaries(st.sampled_from(["format", "id", "token", "session", "operation", "host",
                                            "arguments", "input", "combined", "runtime", "x"]),
                           st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8),
                                     st.lists(st.text(max_size=4), max_size=3)), max_size=10))
    @settings(max_examples=300)
    def test_decode_arbitrary_objects_only_ever_rejects_or_types(self, obj: dict[str, object]) -> None:
        try:
            request = decode_request(json.dumps(obj).encode())
        except RequestRejected:
            return
        assert isinstance(request, Capabilities | Exec | Runtime)


class TestReply:
    def test_reply_has_only_protocol_keys_and_compact_newline(self) -> None:
        data = encode_reply(Reply(format=1, id="9", ok=True, runtime=RuntimeResponse()))
        assert data == b'{"format":1,"id":"9","ok":true,"runtime":{}}\n'

    def test_error_reply_carries_error_code_only_for_backend_errors(self) -> None:
        rejected = msgspec.json.decode(encode_reply(error_reply("1", RequestRejected("nope"))))
        assert rejected == {"format": 1, "id": "1", "ok": False, "error": "nope"}
        missing = msgspec.json.decode(encode_reply(error_reply("1", NotFound(kind="image", ref="x",
                                                                            action="image-inspect"))))
        assert missing["error_code"] == "not_found"

    def test_workload_info_omits_started_at_unless_set(self) -> None:
        info = WorkloadInfo(id="i", image="m", state="running", exit_code=0, running=True, paused=False,
                            labels={})
        assert set(msgspec.json.decode(msgspec.json.encode(info))) == {
            "id", "image", "state", "exit_code", "running", "paused", "labels"}

    def test_image_info_keys_are_exact(self) -> None:
        data = msgspec.json.decode(msgspec.json.encode(ImageInfo(id="sha256:x", repo_digests=[], size=3)))
        assert set(data) == {"id", "repo_digests", "size"}

    def test_oversize_reply_becomes_small_error(self) -> None:
        data = encode_reply(Reply(format=1, id="1", ok=True, output=b"x" * (50 << 20)))
        assert b"exceeds 67108864 bytes" in data and len(data) < 1000

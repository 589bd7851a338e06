"""The real daemon over real sockets: framing, auth, host checks and spec 9.14 rejections."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coldsnap_provider import ProtocolError
from coldsnap_provider._client import check_reply
from tests.helpers import Daemon, Session, module_daemon, running_daemon


async def reply_of(session: Session, payload: bytes) -> dict[str, object]:
    data = await session.raw(payload)
    assert data.endswith(b"\n") and data.count(b"\n") == 1, data
    return msgspec.json.decode(data)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """One daemon of the default configuration for this module's tests that each open a session of their own and
    change nothing of the daemon's (the framing and rejection checks, the fuzz tests): a start and a stop are
    about a second of the 2-core CI box."""
    yield from module_daemon(None)


async def test_capabilities_handshake_advertises_what_is_implemented(daemon: Daemon) -> None:
    session = await daemon.open_session()
    reply = await session.call("capabilities")
    assert reply.ok and reply.provider == "coldsnap-provider"
    assert reply.capabilities == ["exec", "oci-pull", "oci-push", "runtime-v1", "upload"]


async def test_capabilities_follow_registry_configuration() -> None:
    async with running_daemon("[registry]\npull = false\npush = false\n") as daemon:
        session = await daemon.open_session()
        reply = await session.call("capabilities")
        assert reply.capabilities == ["exec", "runtime-v1", "upload"]
        pull = await session.runtime("image-pull", image="127.0.0.1:1/x:1")
        assert not pull.ok and pull.error == "unsupported host-provider capability 'oci-pull'"


async def test_rejections_echo_format_and_id(daemon: Daemon) -> None:
    s = await daemon.open_session("op-1", hosts=["localhost", "node-b"])
    cases: list[tuple[dict[str, object], str]] = [
        ({**s.envelope("capabilities"), "token": "wrong"}, "host-provider session is unauthorized"),
        ({**s.envelope("capabilities"), "session": "op-2"}, "host-provider session is unauthorized"),
        (s.envelope("exec", host="node-z", arguments=["true"]), "host-provider target is outside this request"),
        ({**s.envelope("exec", host="localhost", arguments=["true"]), "injected": 1},
         "host-provider request has unknown fields: injected"),
        (s.envelope("huggingface-resolve", host="localhost", image="busybox:1", repository="org/m",
                    revision="main"), "unsupported host-provider capability 'huggingface-resolve'"),
        (s.envelope("oci-pull", host="localhost"), "Object missing required field `image`"),
        (s.envelope("oci-copy", host="localhost"), "unsupported host-provider operation"),
    ]
    for request, message in cases:
        reply = await reply_of(s, json.dumps(request).encode() + b"\n")
        assert reply["format"] == 1 and reply["id"] == request["id"]
        assert reply["ok"] is False and message in str(reply["error"]), reply
        assert "error_code" not in reply


async def test_authorized_host_this_node_does_not_serve_is_refused_clearly() -> None:
    async with running_daemon('[node]\nnames = ["node-a"]\n') as daemon:
        s = await daemon.open_session(hosts=["node-a", "node-b"])
        ok = await s.call("exec", host="node-a", arguments=["true"])
        assert ok.ok and ok.exit_code == 0
        refused = await s.call("exec", host="node-b", arguments=["true"])
        assert not refused.ok and "not served by this node" in str(refused.error)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        pytest.param(b'{"format":1,"id":"5","operation":"capabilities"}', "not newline-terminated", id="no-newline"),
        pytest.param(b'{"format":1,"id":"5"}\n{}\n', "trailing data", id="trailing-line"),
        pytest.param(b"\n", "empty", id="empty"),
        pytest.param(b"not json\n", "not valid JSON", id="garbage"),
        pytest.param(b"[1,2]\n", "must be a JSON object", id="array"),
    ],
)
async def test_framing_errors_are_answered_not_ok(daemon: Daemon, payload: bytes, message: str) -> None:
    s = await daemon.open_session()
    reply = await reply_of(s, payload)
    assert reply["ok"] is False and message in str(reply["error"])
    assert reply["format"] == 1


async def test_trailing_data_still_echoes_a_parseable_id(daemon: Daemon) -> None:
    s = await daemon.open_session()
    request = s.envelope("capabilities")
    reply = await reply_of(s, json.dumps(request).encode() + b"\nextra")
    assert reply["id"] == request["id"] and "trailing data" in str(reply["error"])


async def test_oversize_request_is_rejected_without_reading_it_all(daemon: Daemon) -> None:
    s = await daemon.open_session()
    payload = b'{"format":1,"id":"big","pad":"' + b"x" * (64 << 20) + b'"}\n'
    async with await anyio.connect_unix(s.socket) as stream:
        try:
            await stream.send(payload)
            await stream.send_eof()
        except (anyio.BrokenResourceError, OSError):
            pass  # the daemon may answer and close before we finish sending
        data = b""
        try:
            while True:
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass
    reply = msgspec.json.decode(data)
    assert reply["ok"] is False and "exceeds 67108864 bytes" in reply["error"]


async def test_strict_client_accepts_every_reply_shape(daemon: Daemon) -> None:
    """Every reply the daemon gives passes the Go-strict decoder (unknown keys fail at any depth)."""
    s = await daemon.open_session()
    for operation, fields in [("capabilities", {}), ("exec", {"host": "localhost", "arguments": ["id"]}),
                              ("exec", {"host": "nope", "arguments": ["id"]})]:
        request = s.envelope(operation, **fields)
        data = await s.raw(json.dumps(request).encode() + b"\n")
        check_reply(data, str(request["id"]))


def test_strict_client_rejects_unknown_keys_wrong_identity_and_trailing_data() -> None:
    with pytest.raises(ProtocolError, match="invalid"):
        check_reply(b'{"format":1,"id":"1","ok":true,"result":{}}\n', "1")
    with pytest.raises(ProtocolError, match="invalid"):
        check_reply(b'{"format":1,"id":"1","ok":true,"runtime":{"image":{"id":"x","debug":1}}}', "1")
    with pytest.raises(ProtocolError, match="identity"):
        check_reply(b'{"format":1,"id":"2","ok":false,"error":"x"}', "1")
    with pytest.raises(ProtocolError):
        check_reply(b'{"format":1.0,"id":"1","ok":true}', "1")
    with pytest.raises(ProtocolError, match="trailing"):
        check_reply(b'{"format":1,"id":"1","ok":true}\n{}', "1")


@pytest.fixture(scope="module")
def fuzz_daemon(daemon: Daemon) -> object:
    """The module's daemon for the fuzz tests (hypothesis examples must not each start a process), a session and
    a marker file that no fuzzed request may create."""
    import tempfile

    session = anyio.run(daemon.open_session)
    marker = Path(tempfile.mkdtemp(prefix="cs-marker-")) / "executed"
    yield daemon, session, marker


_MUTATIONS = st.sampled_from(["token", "session", "format", "unknown", "host", "base64", "trailing",
                              "no-newline", "argv-type", "combined-type", "truncate"])


@given(mutation=_MUTATIONS, noise=st.binary(max_size=64), cut=st.integers(min_value=1, max_value=40))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_invalid_exec_requests_never_execute(fuzz_daemon: tuple[Daemon, Session, Path],
                                                     mutation: str, noise: bytes, cut: int) -> None:
    daemon, session, marker = fuzz_daemon
    request = session.envelope("exec", host="localhost", arguments=["touch", str(marker)])
    payload_suffix = b"\n"
    match mutation:
        case "token":
            request["token"] = "forged"
        case "session":
            request["session"] = "other"
        case "format":
            request["format"] = True
        case "unknown":
            request["x" + noise.hex()[:8]] = 1
        case "host":
            request["host"] = "elsewhere"
        case "base64":
            request["input"] = "%" + base64.b64encode(noise).decode()
        case "trailing":
            payload_suffix = b"\n" + (noise or b"x")
        case "no-newline":
            payload_suffix = b""
        case "argv-type":
            request["arguments"] = "touch " + str(marker)
        case "combined-type":
            request["combined"] = 1
    payload = json.dumps(request).encode()
    if mutation == "truncate":
        payload = payload[: max(1, len(payload) - cut)]
    data = anyio.run(session.raw, payload + payload_suffix)
    reply = msgspec.json.decode(data)
    assert reply["ok"] is False and reply["format"] == 1
    assert not marker.exists(), f"{mutation} executed"
    assert daemon.process is not None and daemon.process.poll() is None


@given(st.binary(min_size=1, max_size=256))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_arbitrary_bytes_get_one_reply_or_close(fuzz_daemon: tuple[Daemon, Session, Path], data: bytes) -> None:
    daemon, session, _ = fuzz_daemon
    out = anyio.run(session.raw, data)
    if out:
        reply = msgspec.json.decode(out)
        assert reply["ok"] is False and reply["format"] == 1 and out.count(b"\n") == 1
    assert daemon.process is not None and daemon.process.poll() is None
    assert os.path.exists(session.socket)

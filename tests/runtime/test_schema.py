"""Spec 6.2 and 9: accepted shapes, rejected examples, and proof that rejects never reach Docker."""

from __future__ import annotations

import json
import secrets

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coldsnap_provider import Runtime, decode_request
from coldsnap_runtime.schema import RuntimeRequest, explain
from tests.conftest import docker
from tests.helpers import Session

DIGEST_REF = "registry.example/capsules/m@sha256:05b3abf2579a5eb66403cd78be557fd860633a1fe2103c7642030defe32c657f"

# The runtime objects of spec section 9, verbatim.
SPEC_SHAPES = [
    {"action": "image-inspect", "image": DIGEST_REF},
    {"action": "image-pull", "image": DIGEST_REF},
    {"action": "image-build", "build": {
        "dockerfile": "RlJPTSBjb2xkc25hcC1sb2NhbC1iYXNlOm9wLTEtbjYxMC11bml0LXVuaXQtMApBUkcgU09VUkNF"
                      "X0RBVEVfRVBPQ0g9MAo=",
        "context": "/var/lib/coldsnap/captures/op-1/drivers/n610/units/unit-0",
        "contexts": {"coldsnap_seed": "/var/lib/coldsnap/capsule-cache-seeds/op-1/units/unit-0"},
        "arguments": {"SOURCE_DATE_EPOCH": "0"}, "tag": "coldsnap-capsule/op-1:op-1-n610-unit-unit-0"}},
    {"action": "workload-run", "workload": {
        "name": "job-1_node_0", "image": DIGEST_REF, "detached": True, "network": "host", "privileged": True,
        "seccomp_unconfined": True, "memlock_unlimited": True, "shared_memory_bytes": 34359738368,
        "gpus": ["0", "1"], "environment": {"COLDSNAP_ENGINE": "vllm", "NCCL_CUMEM_ENABLE": "1"},
        "labels": {"io.sparksq.coldsnap.capture": "cap-7", "io.sparksq.coldsnap.driver": "n610"},
        "mounts": [{"source": "/var/lib/coldsnap/operations/ns/coordinator.endpoint",
                    "target": "/run/coldsnap/coordinator.endpoint", "read_only": True}],
        "devices": [{"source": "/dev/infiniband", "target": "/dev/infiniband"}],
        "command": ["/usr/local/bin/coldsnap-engine-rank-n610", "--engine", "vllm", "restore", "--", "vllm"]}},
    {"action": "workload-run", "workload": {
        "name": "", "image": DIGEST_REF, "remove_after_exit": True, "pull_policy": "never", "network": "host",
        "privileged": True, "seccomp_unconfined": True, "entrypoint": "/opt/coldsnap/criu/bin/criu",
        "command": ["check"], "combined": True}},
    {"action": "workload-inspect", "name": "job-1_node_0", "include_start_time": True},
    {"action": "workload-exec", "name": "job-1_node_0", "execution": {"command": ["cat"],
                                                                      "input": "YmluYXJ5AGlucHV0Cg=="}},
    {"action": "workload-logs", "name": "job-1_node_0", "tail": 400},
    {"action": "workload-copy-from", "name": "op-1-capture-unit-unit-0", "path": "/root/.triton/cache",
     "destination": "/var/lib/coldsnap/capsule-cache-seeds/op-1/units/unit-0/root/.triton/cache"},
    {"action": "workload-remove", "name": "job-1_node_0"},
    {"action": "image-tag", "source": "sha256:b79606fb3afea5bd1609ed40b622142f1c98125abcfe89a76a661b0e8e343910",
     "target": "registry.example/capsules/m:op-1-n610-unit-unit-0"},
    {"action": "image-push", "image": "registry.example/capsules/m:op-1-n610-unit-unit-0"},
    {"action": "image-remove", "image": "coldsnap-local-base:op-1-n610-unit-unit-0"},
]


def envelope(runtime: dict[str, object]) -> bytes:
    return json.dumps({"format": 1, "id": "1", "token": "tkn", "session": "op-1", "operation": "runtime",
                       "host": "node-a", "runtime": runtime}).encode()


def test_the_twelve_actions_and_no_others() -> None:
    from coldsnap_runtime.schema import ACTIONS

    assert {"image-inspect", "image-pull", "image-push", "image-tag", "image-remove", "image-build",
                       "workload-run", "workload-remove", "workload-inspect", "workload-exec", "workload-logs",
                       "workload-copy-from"} == ACTIONS
    assert {str(shape["action"]) for shape in SPEC_SHAPES} == ACTIONS


@pytest.mark.parametrize("runtime", SPEC_SHAPES, ids=lambda r: str(r["action"]))
def test_every_spec_request_shape_decodes(runtime: dict[str, object]) -> None:
    request = decode_request(envelope(runtime))
    assert isinstance(request, Runtime)
    assert msgspec.to_builtins(request.runtime)["action"] == runtime["action"]


# Spec 6.2: the reference's rejected examples, with the field each message must name.
REJECTED = [
    ({"action": "nope"}, "unsupported manager runtime action 'nope'"),
    ({"action": "image-inspect", "image": "--all-tags"}, "$.runtime.image"),
    ({"action": "image-push", "image": "a", "command": ["x"]}, "unknown fields: command - at `$.runtime`"),
    ({"action": "workload-run", "workload": {"image": "i", "privileged": "false"}},
     "Expected `bool`, got `str` - at `$.runtime.workload.privileged`"),
    ({"action": "workload-run", "workload": {"image": "i", "network": "unimplemented"}},
     "$.runtime.workload.network"),
    ({"action": "workload-run", "workload": {"image": "i", "unknown_requirement": True}},
     "unknown fields: unknown_requirement - at `$.runtime.workload`"),
    ({"action": "workload-run", "workload": {"image": "i", "shared_memory_bytes": True}},
     "Expected `int`, got `bool` - at `$.runtime.workload.shared_memory_bytes`"),
    ({"action": "workload-run", "workload": {"image": "i", "mounts": [{"source": "tmp", "target": "/x"}]}},
     "path: absolute, normalised"),
    ({"action": "workload-run", "workload": {"image": "i", "mounts": [{"source": "/tmp:rw", "target": "/x"}]}},
     "$.runtime.workload.mounts[0].source"),
    ({"action": "workload-run", "workload": {"image": "i", "input": "%%%"}},
     "Invalid base64 encoded string - at `$.runtime.workload.input`"),
    ({"action": "workload-run", "workload": {"image": "i", "detached": True}}, "detached workloads need"),
    ({"action": "workload-run", "workload": {"name": "n", "image": "i", "detached": True, "input": ""}},
     "`input` must be absent"),
    ({"action": "workload-exec", "name": "n", "execution": {"command": []}}, "`command` must be a non-empty"),
    ({"action": "workload-logs", "name": "n", "tail": -1}, "Expected `int` >= 0 - at `$.runtime.tail`"),
    ({"action": "workload-copy-from", "name": "n", "path": "/a", "destination": "other:/dest"},
     "$.runtime.destination"),
    ({"action": "workload-inspect", "name": "n", "include_start_time": "true"}, "$.runtime.include_start_time"),
    ({"action": "workload-run", "workload": {"image": "i", "gpus": ["0,1"]}}, "GPU device id"),
    ({"action": "workload-run", "workload": {"image": "i", "environment": {"A=B": "x"}}}, "mapping key"),
    ({"action": "image-build", "build": {"dockerfile": "", "context": "/c", "tag": "t"}}, "`dockerfile` must be"),
    ({"action": "image-build", "build": {"dockerfile": "eA==", "context": "/c", "tag": "t",
                                         "contexts": {"s": "rel"}}}, "$.runtime.build.contexts"),
]


@pytest.mark.parametrize(("runtime", "message"), REJECTED, ids=[str(i) for i in range(len(REJECTED))])
async def test_rejected_runtime_requests_name_the_field_and_reach_nothing(
        session: Session, runtime: dict[str, object], message: str) -> None:
    before = docker("ps", "-aq").stdout
    reply = await session.call("runtime", host="localhost", runtime=runtime)
    assert not reply.ok and reply.error_code is msgspec.UNSET, reply
    assert message in str(reply.error), reply.error
    assert docker("ps", "-aq").stdout == before


_BAD_VALUES = st.sampled_from([True, 1, -1, "", "-x", "a b", "rel/path", "/a/../b", "/a:b", None, [], {},
                               "%%%", "x\u0000y", 1.5])
_WORKLOAD_KEYS = st.sampled_from(["name", "image", "detached", "remove_after_exit", "pull_policy", "network",
                                  "privileged", "seccomp_unconfined", "memlock_unlimited", "shared_memory_bytes",
                                  "gpus", "user", "entrypoint", "environment", "labels", "mounts", "devices",
                                  "command", "input", "combined", "unknown_requirement"])


def _is_valid(workload: dict[str, object]) -> bool:
    """Whether this exact workload decodes (those draws are skipped: they would really run)."""
    try:
        decode_request(envelope({"action": "workload-run", "workload": workload}))
    except Exception:
        return False
    return True


@given(key=_WORKLOAD_KEYS, value=_BAD_VALUES)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_invalid_workloads_never_reach_docker(session: Session, busybox_image: str, key: str,
                                              value: object) -> None:
    # A fresh name per example: a name shared across examples made a valid draw collide ("Conflict").
    marker = f"hyp-{secrets.token_hex(6)}"
    workload = {"name": marker, "image": busybox_image, "detached": True, "command": ["sleep", "1"], key: value}
    if _is_valid(workload):  # the oracle judges the request that is sent, not a different one
        return
    images_before = docker("images", "-q", "--no-trunc").stdout
    reply = anyio.run(lambda: session.call("runtime", host="localhost",
                                           runtime={"action": "workload-run", "workload": workload}))
    assert not reply.ok and reply.error_code is msgspec.UNSET
    assert docker("inspect", marker, check=False).returncode != 0
    assert docker("images", "-q", "--no-trunc").stdout == images_before


# Every identifier and path of a runtime request, with the JSON path its error must name.
_NL = "x\n"
_NEWLINE_FIELDS = [
    ({"action": "image-inspect", "image": _NL}, "$.image"),
    ({"action": "image-pull", "image": _NL}, "$.image"),
    ({"action": "image-push", "image": _NL}, "$.image"),
    ({"action": "image-remove", "image": _NL}, "$.image"),
    ({"action": "image-tag", "source": _NL, "target": "t"}, "$.source"),
    ({"action": "image-tag", "source": "s", "target": _NL}, "$.target"),
    ({"action": "image-build", "build": {"dockerfile": "eA==", "context": "/c\n", "tag": "t"}}, "$.build.context"),
    ({"action": "image-build", "build": {"dockerfile": "eA==", "context": "/c", "tag": _NL}}, "$.build.tag"),
    ({"action": "image-build", "build": {"dockerfile": "eA==", "context": "/c", "tag": "t",
                                         "contexts": {"s\n": "/s"}}}, "$.build.contexts"),
    ({"action": "image-build", "build": {"dockerfile": "eA==", "context": "/c", "tag": "t",
                                         "contexts": {"s": "/s\n"}}}, "$.build.contexts"),
    ({"action": "image-build", "build": {"dockerfile": "eA==", "context": "/c", "tag": "t",
                                         "arguments": {"A\n": "v"}}}, "$.build.arguments"),
    ({"action": "workload-run", "workload": {"image": _NL}}, "$.workload.image"),
    ({"action": "workload-run", "workload": {"image": "i", "name": _NL}}, "$.workload.name"),
    ({"action": "workload-run", "workload": {"image": "i", "user": "65534\n"}}, "$.workload.user"),
    ({"action": "workload-run", "workload": {"image": "i", "gpus": ["0\n"]}}, "$.workload.gpus[0]"),
    ({"action": "workload-run", "workload": {"image": "i", "environment": {"K\n": "v"}}},
     "$.workload.environment"),
    ({"action": "workload-run", "workload": {"image": "i", "labels": {"k\n": "v"}}}, "$.workload.labels"),
    ({"action": "workload-run", "workload": {"image": "i", "mounts": [{"source": "/nlmount\n", "target": "/m"}]}},
     "$.workload.mounts[0].source"),
    ({"action": "workload-run", "workload": {"image": "i", "mounts": [{"source": "/s", "target": "/m\n"}]}},
     "$.workload.mounts[0].target"),
    ({"action": "workload-run", "workload": {"image": "i", "devices": [{"source": "/dev/x\n"}]}},
     "$.workload.devices[0].source"),
    ({"action": "workload-run", "workload": {"image": "i", "devices": [{"source": "/dev/x", "target": "/y\n"}]}},
     "$.workload.devices[0].target"),
    ({"action": "workload-remove", "name": _NL}, "$.name"),
    ({"action": "workload-inspect", "name": _NL}, "$.name"),
    ({"action": "workload-exec", "name": _NL, "execution": {"command": ["true"]}}, "$.name"),
    ({"action": "workload-exec", "name": "n", "execution": {"command": ["true"], "user": "0\n"}},
     "$.execution.user"),
    ({"action": "workload-logs", "name": _NL}, "$.name"),
    ({"action": "workload-copy-from", "name": _NL, "path": "/p", "destination": "/d"}, "$.name"),
    ({"action": "workload-copy-from", "name": "n", "path": "/p\n", "destination": "/d"}, "$.path"),
    ({"action": "workload-copy-from", "name": "n", "path": "/p", "destination": "/d\n"}, "$.destination"),
]
_RUNTIME_DECODER = msgspec.json.Decoder(RuntimeRequest)


@pytest.mark.parametrize(("runtime", "field"), _NEWLINE_FIELDS, ids=[f for _, f in _NEWLINE_FIELDS])
def test_schema_trailing_newline_in_an_identifier_or_path_is_rejected_naming_the_field(
        runtime: dict[str, object], field: str) -> None:
    """Regression: #11 (finding 11): `$` also matched before a final newline."""
    text = json.dumps(runtime)
    assert "\\n" in text
    with pytest.raises(msgspec.ValidationError) as caught:
        _RUNTIME_DECODER.decode(text.encode())
    message = explain(str(caught.value))
    assert f"`{field}" in message, message  # "at `$.x`" or "at `key` in `$.x`"
    without = json.loads(text)  # the same request without the newline is accepted
    _RUNTIME_DECODER.decode(json.dumps(without).replace("\\n", "").encode())


def test_schema_newline_inside_commands_and_values_is_still_accepted() -> None:
    request = _RUNTIME_DECODER.decode(json.dumps({"action": "workload-run", "workload": {
        "image": "i", "command": ["sh", "-c", "echo a\necho b\n"], "environment": {"K": "v\n"},
        "entrypoint": "/bin/sh"}}).encode())
    assert request.workload.command[-1].endswith("\n")  # type: ignore[union-attr]

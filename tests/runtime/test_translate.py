"""Pure translations: WorkloadSpec -> Engine API body, image references, demux, registry auth."""

from __future__ import annotations

import base64
import struct

import msgspec
import pytest

from coldsnap_runtime.backend._translate import (
    MANAGED_LABEL,
    container_config,
    demux,
    image_matches,
    parse_reference,
    registry_auth,
)
from coldsnap_runtime.schema import WorkloadSpec

RANK = {
    "name": "job-1_node_0", "image": "registry.example/capsules/m@sha256:" + "0" * 64, "detached": True,
    "network": "host", "privileged": True, "seccomp_unconfined": True, "memlock_unlimited": True,
    "shared_memory_bytes": 34359738368, "gpus": ["0", "1"],
    "environment": {"B": "2 $x;*", "A": "1"},
    "labels": {"io.sparksq.coldsnap.workload": "job-1", "io.sparksq.coldsnap.rank": "0"},
    "mounts": [{"source": "/a", "target": "/b", "read_only": True}, {"source": "/c", "target": "/d"}],
    "devices": [{"source": "/dev/infiniband", "target": "/dev/infiniband"}, {"source": "/dev/x"}],
    "command": ["/usr/local/bin/coldsnap-engine-rank-n610", "", "x y"],
}


def spec(**fields: object) -> WorkloadSpec:
    return msgspec.convert(fields, WorkloadSpec)


def test_container_config_realises_every_rank_requirement() -> None:
    config = container_config(spec(**RANK))
    host = config["HostConfig"]
    assert host["NetworkMode"] == "host" and host["Privileged"] is True
    assert host["SecurityOpt"] == ["seccomp=unconfined"]
    assert host["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    assert host["ShmSize"] == 34359738368
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "Count": 0, "DeviceIDs": ["0", "1"],
                                       "Capabilities": [["gpu"]]}]
    assert host["Binds"] == ["/a:/b:ro", "/c:/d"]
    assert host["Devices"] == [
        {"PathOnHost": "/dev/infiniband", "PathInContainer": "/dev/infiniband", "CgroupPermissions": "rwm"},
        {"PathOnHost": "/dev/x", "PathInContainer": "/dev/x", "CgroupPermissions": "rwm"}]
    assert config["Env"] == ["A=1", "B=2 $x;*"]
    assert config["Labels"] == {**RANK["labels"], MANAGED_LABEL: "true"}  # type: ignore[dict-item]
    assert config["Cmd"] == RANK["command"] and "Entrypoint" not in config
    assert config["AttachStdin"] is False and host["AutoRemove"] is False


def test_container_config_defaults_keep_the_image_semantics() -> None:
    config = container_config(spec(name="", image="img"))
    assert "Cmd" not in config and "Entrypoint" not in config and "User" not in config
    host = config["HostConfig"]
    assert host["NetworkMode"] == "default" and "SecurityOpt" not in host and "Ulimits" not in host
    assert "ShmSize" not in host and "DeviceRequests" not in host


@pytest.mark.parametrize(("network", "mode"), [("", "default"), ("default", "default"), ("host", "host"),
                                               ("none", "none")])
def test_container_config_network_modes(network: str, mode: str) -> None:
    assert container_config(spec(image="i", network=network))["HostConfig"]["NetworkMode"] == mode


def test_container_config_stdin_attached_whenever_input_key_is_present() -> None:
    assert container_config(spec(image="i", input=""))["AttachStdin"] is True
    assert container_config(spec(image="i", input="aGk="))["OpenStdin"] is True
    assert container_config(spec(image="i"))["OpenStdin"] is False


def test_container_config_entrypoint_user_and_autoremove() -> None:
    config = container_config(spec(name="n", image="i", entrypoint="python3", user="0:0", detached=True,
                                   remove_after_exit=True))
    assert config["Entrypoint"] == ["python3"] and config["User"] == "0:0"
    assert config["HostConfig"]["AutoRemove"] is True


@pytest.mark.parametrize(
    ("ref", "repository", "tag", "digest", "registry", "normalized"),
    [
        ("busybox", "busybox", "", "", "docker.io", "busybox:latest"),
        ("library/busybox:1", "library/busybox", "1", "", "docker.io", "busybox:1"),
        ("docker.io/library/busybox:1", "docker.io/library/busybox", "1", "", "docker.io", "busybox:1"),
        ("127.0.0.1:5000/a/b:t", "127.0.0.1:5000/a/b", "t", "", "127.0.0.1:5000", "127.0.0.1:5000/a/b:t"),
        ("localhost/x", "localhost/x", "", "", "localhost", "localhost/x:latest"),
        ("r.example/c/m@sha256:" + "a" * 64, "r.example/c/m", "", "sha256:" + "a" * 64, "r.example",
         "r.example/c/m@sha256:" + "a" * 64),
    ],
)
def test_parse_reference(ref: str, repository: str, tag: str, digest: str, registry: str, normalized: str) -> None:
    parsed = parse_reference(ref)
    assert parsed is not None
    assert (parsed.repository, parsed.tag, parsed.digest, parsed.registry) == (repository, tag, digest, registry)
    assert parsed.normalized() == normalized


def test_bare_image_ids_are_not_references() -> None:
    assert parse_reference("sha256:" + "b" * 64) is None


def test_image_matches_is_exact() -> None:
    inspect = {"Id": "sha256:" + "c" * 64, "RepoTags": ["busybox:latest", "127.0.0.1:5000/x:1"],
               "RepoDigests": ["127.0.0.1:5000/x@sha256:" + "d" * 64]}
    assert image_matches("busybox", inspect) and image_matches("docker.io/library/busybox:latest", inspect)
    assert image_matches("sha256:" + "c" * 64, inspect)
    assert image_matches("127.0.0.1:5000/x@sha256:" + "d" * 64, inspect)
    assert not image_matches("cccccc", inspect)  # engine-side ID prefix: not exact
    assert not image_matches("busybox:1", inspect)
    assert not image_matches("sha256:" + "e" * 64, inspect)


def test_demux_yields_complete_frames_and_keeps_partial_ones() -> None:
    buffer = bytearray(struct.pack(">BxxxL", 1, 3) + b"out" + struct.pack(">BxxxL", 2, 4) + b"er")
    assert list(demux(buffer)) == [(1, b"out")]
    buffer += b"r\n"
    assert list(demux(buffer)) == [(2, b"err\n")] and buffer == b""


def test_registry_auth_reads_docker_config_auths() -> None:
    auth = base64.b64encode(b"user:pa:ss").decode()
    credentials = {"auths": {"127.0.0.1:5000": {"auth": auth}, "https://index.docker.io/v1/": {
        "username": "u", "password": "p"}}}
    assert registry_auth(credentials, "127.0.0.1:5000") == {"username": "user", "password": "pa:ss",
                                                            "serveraddress": "127.0.0.1:5000"}
    assert registry_auth(credentials, "docker.io") == {"username": "u", "password": "p",
                                                       "serveraddress": "https://index.docker.io/v1/"}
    assert registry_auth(credentials, "elsewhere") is None
    assert registry_auth({}, "elsewhere") is None

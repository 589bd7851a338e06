"""Each WorkloadSpec field, created through the provider and read back from the Engine API."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Registry
from tests.helpers import Daemon, Session, module_daemon
from tests.runtime.conftest import container_exists, inspect_container, main_dockerd_pid, uniq

pytestmark = pytest.mark.usefixtures("no_leftovers")


@pytest.fixture(scope="module")
def daemon(registry: Registry, busybox_image: str) -> Iterator[Daemon]:
    """This module's daemon: `privileged` realised as the host's capabilities where the engine lacks some.

    On an engine whose bounding set is incomplete (dockerd without CAP_SYS_RESOURCE, as here),
    the default policy refuses `privileged: true`; this policy grants what the host has, so the
    field still reaches the container and is checked below.
    """
    yield from module_daemon(registry.credentials_file, '[runtime]\nprivileged = "host-capabilities"\n')


async def test_every_field_arrives_in_the_container(session: Session, busybox_image: str) -> None:
    name = uniq("fields")
    first, second = tempfile.mkdtemp(prefix="cs-m1-"), tempfile.mkdtemp(prefix="cs-m2-")
    workload = {
        "name": name, "image": busybox_image, "detached": True, "network": "none", "privileged": True,
        "seccomp_unconfined": True, "shared_memory_bytes": 67108864,
        "user": "65534:65534", "entrypoint": "sleep", "command": ["60"],
        "environment": {"COLDSNAP_ENGINE": "vllm", "ODD": "a b $HOME;*", "EMPTY": ""},
        "labels": {"io.sparksq.coldsnap.workload": "other-cluster", "k": "v"},
        "mounts": [{"source": first, "target": "/run/coldsnap/coordinator.endpoint", "read_only": True},
                   {"source": second, "target": "/payload"}],
        "devices": [{"source": "/dev/null", "target": "/dev/coldsnap-null"}],
    }
    reply = await session.runtime("workload-run", workload=workload)
    assert reply.ok, reply.error
    try:
        info = inspect_container(name)
        host, config = info["HostConfig"], info["Config"]
        assert "seccomp=unconfined" in host["SecurityOpt"]
        if host["Privileged"] is not True:  # host-capabilities: Docker's privileged minus what the engine lacks
            assert {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SYS_PTRACE"} <= set(host["CapAdd"])
            assert host["DeviceCgroupRules"] == ["a *:* rwm"] and host["MaskedPaths"] == []
            assert "apparmor=unconfined" in host["SecurityOpt"]
        assert host["ShmSize"] == 67108864 and host["NetworkMode"] == "none"
        assert host["Binds"] == [f"{first}:/run/coldsnap/coordinator.endpoint:ro", f"{second}:/payload"]
        assert [(m["Destination"], m["RW"]) for m in info["Mounts"]] in (
            [("/run/coldsnap/coordinator.endpoint", False), ("/payload", True)],
            [("/payload", True), ("/run/coldsnap/coordinator.endpoint", False)])
        assert host["Devices"][0] == {"PathOnHost": "/dev/null", "PathInContainer": "/dev/coldsnap-null",
                                      "CgroupPermissions": "rwm"}  # the host's nodes follow it when granted
        assert host["Privileged"] is True or "/dev/coldsnap-null" not in [
            d["PathInContainer"] for d in host["Devices"][1:]]
        assert config["User"] == "65534:65534" and config["Entrypoint"] == ["sleep"] and config["Cmd"] == ["60"]
        assert {"COLDSNAP_ENGINE=vllm", "ODD=a b $HOME;*", "EMPTY="} <= set(config["Env"])
        assert config["Labels"]["k"] == "v" and "sparkrun.cluster_id" not in config["Labels"]  # other cluster
        assert info["State"]["Running"] is True
    finally:
        assert (await session.runtime("workload-remove", name=name)).ok


async def test_absent_entrypoint_keeps_the_images_own(session: Session, busybox_image: str) -> None:
    name = uniq("ep")
    reply = await session.runtime("workload-run", workload={"name": name, "image": busybox_image,
                                                            "command": ["echo", "image entrypoint kept"]})
    try:
        assert reply.ok and reply.runtime.output == b"image entrypoint kept\n"  # type: ignore[union-attr]
        assert inspect_container(name)["Config"]["Entrypoint"] is None
        assert inspect_container(name)["HostConfig"]["NetworkMode"] == "default"
    finally:
        assert (await session.runtime("workload-remove", name=name)).ok


@pytest.mark.parametrize(("network", "shared"), [("host", True), ("none", False), ("", False)])
async def test_network_mode_decides_the_namespace(session: Session, busybox_image: str, network: str,
                                                  shared: bool) -> None:
    reply = await session.runtime("workload-run", workload={
        "name": "", "image": busybox_image, "network": network, "remove_after_exit": True,
        "command": ["readlink", "/proc/self/ns/net"]})
    assert reply.ok, reply.error
    inside = reply.runtime.output.decode().strip()  # type: ignore[union-attr]
    assert (inside == os.readlink("/proc/self/ns/net")) is shared


def _dockerd_has_cap_sys_resource() -> bool:
    pid = main_dockerd_pid()
    caps = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("CapEff"))
    return bool(int(caps.split()[1], 16) & (1 << 24))  # CAP_SYS_RESOURCE


async def test_memlock_unlimited_reaches_the_runtime(session: Session, busybox_image: str) -> None:
    """RLIMIT_MEMLOCK -1/-1 needs CAP_SYS_RESOURCE in dockerd: unlimited where it has it, a clean failure otherwise."""
    name = uniq("memlock")
    reply = await session.runtime("workload-run", workload={
        "name": name, "image": busybox_image, "memlock_unlimited": True, "command": ["sh", "-c", "ulimit -l"]})
    try:
        if _dockerd_has_cap_sys_resource():
            assert reply.ok and reply.runtime.output == b"unlimited\n"  # type: ignore[union-attr]
            assert inspect_container(name)["HostConfig"]["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}]
        else:
            # RLIMIT_MEMLOCK is rlimit type 8: the requirement reached runc, which could not grant it.
            assert not reply.ok and reply.error_code == "runtime_failed"
            assert "rlimit type 8" in str(reply.error)
            assert not container_exists(name)
    finally:
        assert (await session.runtime("workload-remove", name=name)).ok

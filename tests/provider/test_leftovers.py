"""The tests' own leftover check (tests/conftest.py, `no_leftovers`) judges only what this test run made.

Issue 38: it counted every new container on the engine and force-removed it, so beside another client of the
same engine it failed and destroyed that client's containers.
"""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import pytest

from coldsnap_provider._hosts import instance_id
from tests.conftest import all_containers, docker, leftovers
from tests.helpers import MADE, running_daemon


def _foreign_container(image: str) -> str:
    """A container another client of the engine makes: the Docker CLI run directly, not through the tests' helper."""
    name = f"foreign-{secrets.token_hex(4)}"
    subprocess.run(["docker", "run", "-d", "--name", name, image, "sleep", "60"], check=True, capture_output=True)
    return name


async def test_what_the_daemon_leaves_behind_is_reported_and_another_clients_container_is_not(
        busybox_image: str) -> None:
    before = all_containers()
    foreign = _foreign_container(busybox_image)
    name = f"left-{secrets.token_hex(4)}"
    try:
        async with running_daemon() as daemon:
            session = await daemon.open_session()
            reply = await session.runtime("workload-run", workload={
                "name": name, "image": busybox_image, "command": ["sleep", "60"], "detached": True})
            assert reply.ok, reply
        left = leftovers(before)
        assert sorted(left.values()) == [name]  # the daemon's workload, which the test never removed
        assert foreign not in left.values()
    finally:
        docker("rm", "-f", name, check=False)
        still_there = docker("inspect", foreign, check=False).returncode == 0
        subprocess.run(["docker", "rm", "-f", foreign], capture_output=True)
    assert still_there  # nothing removed the other client's container


def test_containers_the_docker_helper_makes_are_this_runs(busybox_image: str) -> None:
    before = all_containers()
    foreign = _foreign_container(busybox_image)
    left: dict[str, str] = {}
    try:
        anonymous = docker("create", busybox_image, "true").stdout.decode().strip()  # no name: its label says
        named = f"helper-{secrets.token_hex(4)}"
        docker("create", "--name", named, busybox_image, "true")
        left = leftovers(before)
        assert set(left) >= {anonymous} and named in left.values()
        assert foreign not in left.values()
    finally:
        for container in (foreign, *left):
            docker("rm", "-f", container, check=False)


@pytest.mark.usefixtures("no_leftovers")
def test_the_fixture_leaves_another_clients_container_alone(busybox_image: str) -> None:
    """The container outlives this test and its fixture (the next test checks and removes it)."""
    _STRANGERS.append(_foreign_container(busybox_image))


def test_another_clients_container_outlived_the_fixture() -> None:
    assert _STRANGERS, "runs after test_the_fixture_leaves_another_clients_container_alone"
    try:
        assert docker("inspect", _STRANGERS[0], check=False).returncode == 0
    finally:
        subprocess.run(["docker", "rm", "-f", *_STRANGERS], capture_output=True)


_STRANGERS: list[str] = []


def test_the_daemons_instance_labels_are_recognised(tmp_path: Path) -> None:
    """Containers an RPC owns carry the daemon's instance label: the check computes it as the daemon does."""
    assert MADE.instance(tmp_path) == instance_id(tmp_path)

"""A real daemon wired to the real dockerd and registry, shared by a test module."""

from __future__ import annotations

import json
import secrets
import socket
import struct
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from tests.conftest import Registry, docker
from tests.helpers import MADE, Daemon, Session, module_daemon


@pytest.fixture(scope="module")
def daemon(registry: Registry, busybox_image: str) -> Iterator[Daemon]:
    yield from module_daemon(registry.credentials_file)


@pytest.fixture(scope="module")
def session(daemon: Daemon) -> Session:
    return anyio.run(lambda: daemon.open_session(
        hosts=["localhost"], cluster_id="runtime-contract",
        labels={"sparkrun.cluster_id": "runtime-contract"}))


def uniq(prefix: str = "cst") -> str:
    """A fresh name, recorded as this process's (a workload or backend instance the tests name: tests.helpers.Made)."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    MADE.add(name)
    return name


def inspect_container(name: str) -> dict[str, Any]:
    return json.loads(docker("inspect", name).stdout)[0]  # type: ignore[no-any-return]


def container_exists(name: str) -> bool:
    return docker("inspect", name, check=False).returncode == 0


def image_exists(ref: str) -> bool:
    return docker("image", "inspect", ref, check=False).returncode == 0


def main_dockerd_pid() -> int:
    """The pid of the engine behind /var/run/docker.sock (node-b's second dockerd runs beside it)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect("/var/run/docker.sock")
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)

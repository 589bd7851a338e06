"""What a remote node gets from this one (#24 finding 9): no registry credentials unless its entry lists the
registry, no GPU or capability facts of this node; and a build sends only its base images' registries."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

from tests.conftest import Registry, docker
from tests.helpers import running_daemon
from tests.provider.test_copy_limits import small_tmpfs  # noqa: F401 - fixture
from tests.provider.test_remote import NodeB, node_b, node_b_registry  # noqa: F401 - fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="node-b needs root (namespaces, a second dockerd)")


async def test_remote_push_without_the_registry_listed_sends_no_credentials(
        node_b: NodeB, node_b_registry: Registry, busybox_image: str) -> None:  # noqa: F811
    """Regression: #24 finding 9 (every remote engine received all of this node's registry credentials)."""
    pushed = f"{node_b_registry.address}/coldsnap/remote-unlisted:{os.getpid()}"
    config = node_b.config() + f'\n[registry]\ncredentials_file = "{node_b_registry.credentials_file}"\n'
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        try:
            assert (await s.runtime("image-tag", host="node-b", source=busybox_image, target=pushed)).ok
            push = await s.runtime("image-push", host="node-b", image=pushed)
        finally:
            node_b.docker("rmi", "-f", pushed, check=False)
    assert not push.ok and push.error_code == "runtime_failed"
    assert "no basic auth credentials" in push.error or "unauthorized" in push.error.lower(), push.error


async def test_remote_gpu_run_reads_no_facts_of_this_node(node_b: NodeB, busybox_image: str) -> None:  # noqa: F811
    """Regression: #24 finding 9 (a remote run was given this node's GPU inventory and driver files)."""
    name = f"coldsnap-remote-gpu-{os.getpid()}"
    async with running_daemon(node_b.config() + '\n[gpus]\nmode = "native"\n') as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        try:
            run = await s.runtime("workload-run", host="node-b", workload={
                "image": busybox_image, "name": name, "detached": True, "gpus": ["0"], "command": ["true"]})
        finally:
            node_b.docker("rm", "-f", name, check=False)
    assert not run.ok and run.error_code == "runtime_failed"
    assert "native: the engine's node is another host, whose GPUs cannot be listed from here" in run.error
    assert node_b.docker("container", "inspect", name, check=False).returncode != 0


@asynccontextmanager
async def _recording_proxy(path: Path, recorded: bytearray) -> AsyncIterator[None]:
    """A byte-for-byte proxy to the real dockerd that keeps what clients sent (the request headers)."""

    async def pump(source: anyio.abc.ByteStream, sink: anyio.abc.ByteStream, keep: bool) -> None:
        try:
            async for chunk in source:
                if keep:
                    recorded.extend(chunk[:1 << 16])
                await sink.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            await sink.aclose()

    async def serve(client: anyio.abc.ByteStream) -> None:
        async with client, await anyio.connect_unix("/var/run/docker.sock") as engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump, client, engine, True)
                tg.start_soon(pump, engine, client, False)

    listener = await anyio.create_unix_listener(path)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield
        tg.cancel_scope.cancel()


def _registry_configs(recorded: bytes) -> list[dict[str, object]]:
    found = []
    for line in recorded.split(b"\r\n"):
        if line.lower().startswith(b"x-registry-config:"):
            found.append(json.loads(base64.urlsafe_b64decode(line.split(b":", 1)[1].strip())))
    return found


async def test_build_sends_only_the_credentials_of_its_base_images_registries(
        busybox_image: str, tmp_path: Path) -> None:
    """Regression: #24 finding 9 (every build sent all of this node's registry credentials)."""
    base = f"127.0.0.1:5999/coldsnap/base:{os.getpid()}"
    tag = f"coldsnap-test/creds-built:{os.getpid()}"
    entry = {"auth": base64.b64encode(b"user:secret").decode()}
    credentials = tmp_path / "config.json"
    credentials.write_text(json.dumps({"auths": {"127.0.0.1:5999": entry, "other.example": entry}}))
    context = tmp_path / "context"
    context.mkdir()
    proxy = Path(f"/tmp/cs-proxy-{os.getpid()}.sock")
    recorded = bytearray()
    docker("tag", busybox_image, base)
    config = f'[docker]\nurl = "unix://{proxy}"\n[registry]\ncredentials_file = "{credentials}"\n'
    try:
        async with _recording_proxy(proxy, recorded), running_daemon(config) as daemon:
            s = await daemon.open_session(hosts=["localhost"])
            built = await s.runtime("image-build", build={
                "dockerfile": base64.b64encode(f"FROM {base}\n".encode()).decode(), "context": str(context),
                "tag": tag, "pull": False})
    finally:
        docker("rmi", "-f", base, tag, check=False)
        proxy.unlink(missing_ok=True)
    assert built.ok, built.error
    assert _registry_configs(bytes(recorded)) == [{"127.0.0.1:5999": {
        "username": "user", "password": "secret", "serveraddress": "127.0.0.1:5999"}}]


async def test_remote_upload_and_copy_from_past_copy_max_bytes_fail_and_place_nothing(
        node_b: NodeB, busybox_image: str) -> None:  # noqa: F811
    """Regression: #24 finding 8 (remote copy-from, upload and build staged whole trees without a bound)."""
    import shutil
    import tempfile

    name = f"coldsnap-remote-capped-{os.getpid()}"
    source = Path(tempfile.mkdtemp(prefix="cs-up-cap-", dir="/var/tmp"))
    (source / "big").write_bytes(os.urandom(2 << 20))
    dest = f"/tmp/coldsnap-remote-capped-{os.getpid()}"
    config = node_b.config() + "\n[docker]\ncopy_max_bytes = 1048576\n"
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        try:
            upload = await s.call("upload", host="node-b", sources=[str(source / "big")], destination=dest)
            run = await s.runtime("workload-run", host="node-b", workload={
                "image": busybox_image, "name": name, "detached": True,
                "command": ["sh", "-c", "head -c 2097152 /dev/urandom > /big && touch /done; sleep 300"]})
            assert run.ok, run.error
            with anyio.fail_after(10):
                while (await s.runtime("workload-exec", host="node-b", name=name,
                                       execution={"command": ["test", "-e", "/done"]})).error_code:
                    await anyio.sleep(0.1)
            copied = await s.runtime("workload-copy-from", host="node-b", name=name, path="/big",
                                     destination=f"{dest}-copy")
        finally:
            node_b.docker("rm", "-f", name, check=False)
            shutil.rmtree(source, ignore_errors=True)
    for reply in (upload, copied):
        assert not reply.ok and reply.error_code == "runtime_failed"
        assert "exceeds 1048576 bytes (docker.copy_max_bytes)" in reply.error, reply.error
    assert not node_b.path(dest).exists() and not node_b.path(f"{dest}-copy").exists()


async def test_remote_copy_from_sparse_file_is_spooled_sparse_both_ways(node_b: NodeB, busybox_image: str,  # noqa: F811
                                                                        small_tmpfs: Path) -> None:  # noqa: F811
    """Regression: #24 finding 8 (remote copy-from staged whole trees, sparse files expanded)."""
    name = f"coldsnap-remote-sparse-{os.getpid()}"
    dest = f"/tmp/coldsnap-remote-sparse-{os.getpid()}"
    config = node_b.config() + f'\n[docker]\nspool_dir = "{small_tmpfs}"\n'
    async with running_daemon(config) as daemon:
        s = await daemon.open_session(hosts=["node-b"])
        try:
            run = await s.runtime("workload-run", host="node-b", workload={
                "image": busybox_image, "name": name, "detached": True,
                "command": ["sh", "-c", "truncate -s 64M /sparse && touch /done; sleep 300"]})
            assert run.ok, run.error
            with anyio.fail_after(10):
                while (await s.runtime("workload-exec", host="node-b", name=name,
                                       execution={"command": ["test", "-e", "/done"]})).error_code:
                    await anyio.sleep(0.1)
            copied = await s.runtime("workload-copy-from", host="node-b", name=name, path="/sparse",
                                     destination=dest)
        finally:
            node_b.docker("rm", "-f", name, check=False)
    try:
        assert copied.ok, copied.error  # a 16 MiB spool held the 64 MiB file twice: as holes
        assert node_b.path(dest).stat().st_size == 64 << 20
        assert os.listdir(small_tmpfs) == []
    finally:
        node_b.path(dest).unlink(missing_ok=True)

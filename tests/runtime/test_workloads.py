"""workload-* actions against the real dockerd, read back through the Engine."""

from __future__ import annotations

import base64
import os
import tempfile
from pathlib import Path

import anyio
import pytest

from tests.conftest import docker
from tests.helpers import Session
from tests.runtime.conftest import container_exists, inspect_container, uniq

pytestmark = pytest.mark.usefixtures("no_leftovers")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def run(session: Session, busybox_image: str, **workload: object) -> object:
    return await session.runtime("workload-run", workload={"name": "", "image": busybox_image, **workload})


async def remove(session: Session, name: str) -> None:
    reply = await session.runtime("workload-remove", name=name)
    assert reply.ok, reply.error


async def test_sync_run_returns_stdout_only_and_removes_after_exit(session: Session, busybox_image: str) -> None:
    reply = await run(session, busybox_image, remove_after_exit=True, entrypoint="sh",
                      command=["-c", "echo '{\"x\":1}'; echo noise >&2"])
    assert reply.ok and reply.runtime.output == b'{"x":1}\n'  # type: ignore[attr-defined]


async def test_sync_run_combined_merges_stderr(session: Session, busybox_image: str) -> None:
    reply = await run(session, busybox_image, remove_after_exit=True, combined=True,
                      command=["sh", "-c", "echo out; echo err >&2"])
    # Both streams, in arrival order (stdout and stderr are separate pipes, as with `docker run`).
    assert reply.ok and sorted(reply.runtime.output.splitlines()) == [b"err", b"out"]  # type: ignore[attr-defined]


async def test_sync_run_feeds_binary_stdin(session: Session, busybox_image: str) -> None:
    data = b"binary\x00input\n" + bytes(range(256))
    reply = await run(session, busybox_image, remove_after_exit=True, command=["cat"], input=b64(data))
    assert reply.ok and reply.runtime.output == data  # type: ignore[attr-defined]


async def test_sync_run_nonzero_exit_is_runtime_failed_with_diagnostics(session: Session,
                                                                        busybox_image: str) -> None:
    reply = await run(session, busybox_image, remove_after_exit=True, network="none",
                      command=["sh", "-c", "echo partial; echo 'CRIU check failed' >&2; exit 3"])
    assert not reply.ok and reply.error_code == "runtime_failed"  # type: ignore[attr-defined]
    assert "exited 3" in reply.error and "CRIU check failed" in reply.error  # type: ignore[attr-defined]


async def test_named_sync_run_without_remove_keeps_the_exited_container(session: Session,
                                                                        busybox_image: str) -> None:
    name = uniq()
    reply = await run(session, busybox_image, name=name, command=["true"])
    assert reply.ok
    info = await session.runtime("workload-inspect", name=name)
    assert info.ok and info.runtime.workload.state == "exited"  # type: ignore[union-attr]
    await remove(session, name)
    assert not container_exists(name)


async def test_detached_value_is_the_inspected_id_with_labels_and_start_time(session: Session,
                                                                             busybox_image: str) -> None:
    name = uniq()
    labels = {"io.sparksq.coldsnap.capture": "cap-7", "io.sparksq.coldsnap.driver": "n610",
              "io.sparksq.coldsnap.managed": "true", "io.sparksq.coldsnap.workload": "runtime-contract",
              "io.sparksq.coldsnap.rank": "0", "io.sparksq.coldsnap.unit": "unit-0"}
    reply = await run(session, busybox_image, name=name, detached=True, labels=labels, command=["sleep", "60"])
    try:
        assert reply.ok, reply.error  # type: ignore[attr-defined]
        value = reply.runtime.value  # type: ignore[attr-defined]
        assert len(value) == 64 and reply.runtime.output == (value + "\n").encode()  # type: ignore[attr-defined]
        plain = await session.runtime("workload-inspect", name=name)
        workload = plain.runtime.workload  # type: ignore[union-attr]
        assert workload.id == value and workload.running and not workload.paused
        assert workload.state == "running" and workload.exit_code == 0 and workload.image == busybox_image
        for key, val in labels.items():
            assert workload.labels[key] == val
        assert workload.labels["sparkrun.cluster_id"] == "runtime-contract"  # injected manager label
        assert "started_at" not in (await session.raw(
            (__import__("json").dumps(session.envelope("runtime", host="localhost", runtime={
                "action": "workload-inspect", "name": name})) + "\n").encode())).decode()
        timed = await session.runtime("workload-inspect", name=name, include_start_time=True)
        started = timed.runtime.workload.started_at  # type: ignore[union-attr]
        assert started == inspect_container(name)["State"]["StartedAt"] and started.endswith("Z")
    finally:
        await remove(session, name)


async def test_workload_remove_is_idempotent_and_refuses_foreign_containers(session: Session,
                                                                           busybox_image: str) -> None:
    assert (await session.runtime("workload-remove", name=uniq("absent"))).ok
    foreign = uniq("foreign")
    docker("create", "--name", foreign, busybox_image, "true")
    try:
        reply = await session.runtime("workload-remove", name=foreign)
        assert not reply.ok and "not created by coldsnap-provider" in str(reply.error)
        assert container_exists(foreign)
    finally:
        docker("rm", "-f", foreign)


async def test_inspect_missing_workload_is_not_found_and_id_prefix_does_not_resolve(session: Session,
                                                                                    busybox_image: str) -> None:
    missing = await session.runtime("workload-inspect", name=uniq("absent"))
    assert not missing.ok and missing.error_code == "not_found"
    name = uniq()
    reply = await run(session, busybox_image, name=name, detached=True, command=["sleep", "60"])
    try:
        prefix = reply.runtime.value[:12]  # type: ignore[attr-defined]
        by_prefix = await session.runtime("workload-inspect", name=prefix)
        assert not by_prefix.ok and by_prefix.error_code == "not_found"
    finally:
        await remove(session, name)


async def test_exec_round_trips_binary_stdin_and_reports_failures(session: Session, busybox_image: str) -> None:
    name = uniq()
    assert (await run(session, busybox_image, name=name, detached=True, command=["sleep", "60"])).ok
    try:
        echo = await session.runtime("workload-exec", name=name,
                                     execution={"command": ["cat"], "input": "YmluYXJ5AGlucHV0Cg=="})
        assert echo.ok and echo.runtime.output == b"binary\x00input\n"  # type: ignore[union-attr]
        user = await session.runtime("workload-exec", name=name, execution={"command": ["id", "-u"],
                                                                          "user": "65534"})
        assert user.runtime.output == b"65534\n"  # type: ignore[union-attr]
        split = await session.runtime("workload-exec", name=name,
                                      execution={"command": ["sh", "-c", "echo o; echo e >&2"]})
        assert split.runtime.output == b"o\n"  # type: ignore[union-attr]
        both = await session.runtime("workload-exec", name=name, execution={
            "command": ["sh", "-c", "echo o; echo e >&2"], "combined": True})
        assert sorted(both.runtime.output.splitlines()) == [b"e", b"o"]  # type: ignore[union-attr]
        failed = await session.runtime("workload-exec", name=name, execution={"command": ["test", "-s", "/x"]})
        assert not failed.ok and failed.error_code == "runtime_failed" and "exited 1" in str(failed.error)
    finally:
        await remove(session, name)
    gone = await session.runtime("workload-exec", name=name, execution={"command": ["true"]})
    assert not gone.ok and gone.error_code == "not_found"


async def test_logs_are_demultiplexed_merged_and_tailed(session: Session, busybox_image: str) -> None:
    name = uniq()
    # Spaced writes: the engine copies each stream on its own, so only time orders them.
    script = "for i in 1 2 3 4 5 6; do echo out$i; sleep 0.05; echo err$i >&2; sleep 0.05; done; echo runtime-ready"
    assert (await run(session, busybox_image, name=name, command=["sh", "-c", script])).ok
    try:
        everything = await session.runtime("workload-logs", name=name)
        text = everything.runtime.output.decode()  # type: ignore[union-attr]
        assert text == "".join(f"out{i}\nerr{i}\n" for i in range(1, 7)) + "runtime-ready\n"
        tail = await session.runtime("workload-logs", name=name, tail=3)
        assert tail.runtime.output.decode().splitlines() == ["out6", "err6", "runtime-ready"]  # type: ignore[union-attr]
    finally:
        await remove(session, name)


async def test_copy_from_file_directory_and_missing_paths(session: Session, busybox_image: str) -> None:
    name = uniq()
    script = "mkdir -p /root/.triton/cache/sub && echo k > /root/.triton/cache/sub/k && " \
             "ln -s /etc/passwd /root/.triton/cache/link && chown -R 65534:65534 /root/.triton && sleep 60"
    assert (await run(session, busybox_image, name=name, detached=True, command=["sh", "-c", script])).ok
    base = Path(tempfile.mkdtemp(prefix="cs-copy-"))
    try:
        with anyio.fail_after(10):
            while not (await session.runtime("workload-exec", name=name, execution={
                    "command": ["test", "-e", "/root/.triton/cache/link"]})).ok:
                await anyio.sleep(0.1)
        directory = await session.runtime("workload-copy-from", name=name, path="/root/.triton/cache",
                                          destination=str(base / "seed"))
        assert directory.ok, directory.error
        assert (base / "seed" / "sub" / "k").read_text() == "k\n"
        assert os.readlink(base / "seed" / "link") == "/etc/passwd"
        assert os.stat(base / "seed" / "sub" / "k").st_uid == 65534
        single = await session.runtime("workload-copy-from", name=name, path="/data/hello.txt",
                                       destination=str(base / "hello.txt"))
        assert single.ok and (base / "hello.txt").read_text() == "hello from the image\n"
        missing = await session.runtime("workload-copy-from", name=name, path="/root/.nothing",
                                        destination=str(base / "none"))
        assert not missing.ok and missing.error_code == "path_not_found"
        assert "could not find the file" in str(missing.error).lower()
        assert not (base / "none").exists()
        assert sorted(p.name for p in base.iterdir()) == ["hello.txt", "seed"]  # no staging left behind
    finally:
        await remove(session, name)
    absent = await session.runtime("workload-copy-from", name=name, path="/x", destination=str(base / "y"))
    assert not absent.ok and absent.error_code == "not_found"


async def test_run_failure_after_create_leaves_nothing_behind(session: Session, busybox_image: str) -> None:
    name = uniq()
    reply = await run(session, busybox_image, name=name, detached=True, command=["/no/such/binary"])
    assert not reply.ok and reply.error_code == "runtime_failed"  # type: ignore[attr-defined]
    assert not container_exists(name)


async def test_gpu_request_reaches_docker_and_fails_cleanly_without_nvidia(session: Session,
                                                                         busybox_image: str) -> None:
    """No NVIDIA runtime here: the DeviceRequest reaches dockerd, start fails, nothing is left."""
    name = uniq("gpu")
    events = docker("events", "--since", "0s", "--until", "0s", check=False)  # warm the CLI; no assertion
    del events
    reply = await run(session, busybox_image, name=name, detached=True, gpus=["0"], command=["true"])
    assert not reply.ok and reply.error_code == "runtime_failed"  # type: ignore[attr-defined]
    assert "nvidia" in str(reply.error).lower() or "gpu" in str(reply.error).lower()  # type: ignore[attr-defined]
    assert not container_exists(name)

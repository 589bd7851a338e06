"""DockerBackend against the real dockerd, used as a library (no daemon in between)."""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiodocker
import aiohttp
import anyio
import pytest

from coldsnap_runtime import OUTPUT_LIMIT, DockerBackend, Owner
from coldsnap_runtime.backend._containers import INSTANCE_LABEL
from coldsnap_runtime.backend._engine import docker_errors
from coldsnap_runtime.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    EngineRejected,
    NotFound,
    OutputTooLarge,
    RuntimeFailed,
)
from coldsnap_runtime.schema import Execution, ImageBuild, WorkloadSpec
from tests.conftest import Registry, docker
from tests.helpers import ROOT
from tests.runtime.conftest import container_exists, image_exists, uniq

pytestmark = pytest.mark.usefixtures("no_leftovers")
NOBODY = pwd.getpwnam("nobody")


@asynccontextmanager
async def detached(backend: DockerBackend, image: str, script: str) -> AsyncIterator[str]:
    name = uniq("lib")
    await backend.workload_run(WorkloadSpec(image=image, name=name, detached=True, command=["sh", "-c", script]),
                               allow_pull=False)
    try:
        yield name
    finally:
        await backend.workload_remove(name)


# --- the one translation edge ------------------------------------------------------------

DEPENDENCY_ERRORS = [
    (aiodocker.DockerError(404, {"message": "no such container"}), NotFound),
    (aiodocker.DockerError(409, {"message": "Conflict"}), EngineRejected),
    (aiodocker.DockerError(900, {"message": "cannot connect"}), BackendUnavailable),
    (EngineRejected(action="a", status=404, detail="gone"), NotFound),
    (EngineRejected(action="a", status=500, detail="boom"), EngineRejected),
    (TimeoutError(), BackendTimeout),
    (aiohttp.ServerTimeoutError("read"), BackendTimeout),
    (aiohttp.ClientConnectionError("reset"), BackendUnavailable),
    (aiohttp.ClientPayloadError("truncated"), RuntimeFailed),
    (aiohttp.InvalidURL("http://x/%2f"), RuntimeFailed),
    (anyio.BrokenResourceError(), BackendUnavailable),
    (anyio.EndOfStream(), BackendUnavailable),
    (ConnectionRefusedError(111, "Connection refused"), BackendUnavailable),
    (FileNotFoundError(2, "No such file or directory"), BackendUnavailable),
]


@pytest.mark.parametrize(("raised", "expected"), DEPENDENCY_ERRORS,
                         ids=[type(e).__name__ for e, _ in DEPENDENCY_ERRORS])
def test_docker_errors_maps_each_dependency_error_to_a_typed_one(raised: BaseException,
                                                                 expected: type[BackendError]) -> None:
    """Regression: #11 (finding 12): an aiohttp error escaped untyped ("internal error")."""
    with pytest.raises(expected) as caught, docker_errors("workload-inspect", kind="workload", ref="w"):
        raise raised
    assert type(caught.value) is expected
    assert caught.value.__cause__ is raised or caught.value is raised  # chained, never `from None`


# --- workloads ---------------------------------------------------------------------------


async def test_workload_names_outside_dockers_rule_are_typed_and_never_reach_the_engine(busybox_image: str) -> None:
    """Regression: #11 (finding 12): `x%2f` became an aiohttp redirect error."""
    async with DockerBackend() as backend:
        for name in ("x%2f", "x%2F..%2F..%2Fimages%2Fjson", "-x", "a/b", "x?all=1"):
            with pytest.raises(NotFound):
                await backend.workload_inspect(name, include_start_time=False)
            with pytest.raises(NotFound):
                await backend.workload_logs(name, tail=0)
            with pytest.raises(NotFound):
                await backend.workload_exec(name, Execution(command=["true"]))
            await backend.workload_remove(name)  # absent is success
            with pytest.raises(RuntimeFailed, match="invalid workload name"):
                await backend.workload_run(WorkloadSpec(image=busybox_image, name=name, command=["true"]),
                                           allow_pull=False)


async def test_workload_logs_of_a_million_short_lines_come_back_whole(busybox_image: str) -> None:
    """Regression: #11 (finding 7): summing every chunk per read made logs quadratic."""
    name = uniq("logs")
    async with DockerBackend() as backend:
        await backend.workload_run(WorkloadSpec(image=busybox_image, name=name, command=["seq", "1", "1000000"]),
                                   allow_pull=False)
        try:
            output = await backend.workload_logs(name, tail=0)
        finally:
            await backend.workload_remove(name)
    assert output == "".join(f"{i}\n" for i in range(1, 1_000_001)).encode()


async def test_every_workload_is_told_its_image_layers_and_a_manager_cannot_say_others(busybox_image: str) -> None:
    """Issue 36 item 4: a restore checks that its capsule image is built on the image the capture ran in, and a
    container cannot read its image's layers: the backend names them, over any value the manager gave."""
    layers = docker("image", "inspect", "--format", "{{json .RootFS.Layers}}", busybox_image).stdout
    async with DockerBackend() as backend:
        reply = await backend.workload_run(WorkloadSpec(
            image=busybox_image, name="", remove_after_exit=True, command=["sh", "-c", "echo $COLDSNAP_CAPSULE_LAYERS"],
            environment={"COLDSNAP_CAPSULE_LAYERS": "sha256:" + "0" * 64}), allow_pull=False)
    assert reply.output == (",".join(json.loads(layers)) + "\n").encode() and reply.output.startswith(b"sha256:")


async def test_workload_exec_output_over_the_limit_is_output_too_large(busybox_image: str) -> None:
    """Regression: #11 (finding 12): the limit surfaced inside an ExceptionGroup."""
    async with DockerBackend() as backend, detached(backend, busybox_image, "sleep 60") as name:
        with pytest.raises(OutputTooLarge, match=f"output exceeds {OUTPUT_LIMIT} bytes"):
            await backend.workload_exec(name, Execution(command=["head", "-c", str(OUTPUT_LIMIT + (1 << 20)),
                                                                 "/dev/zero"]))
        with pytest.raises(OutputTooLarge):
            await backend.workload_run(WorkloadSpec(image=busybox_image, name="", remove_after_exit=True, command=[
                "head", "-c", str(OUTPUT_LIMIT + (1 << 20)), "/dev/zero"]), allow_pull=False)


async def test_copy_from_as_an_owner_refuses_a_planted_symlink_and_writes_owned_files(busybox_image: str,
                                                                                     top: Path) -> None:
    """Regression: #11 (finding 8): copy-from wrote as root, through links, with setuid bits."""
    shared = top / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    secret = top / "root-only"
    secret.mkdir(mode=0o700)
    (shared / "planted").symlink_to(secret)
    nobody = Owner(NOBODY.pw_uid, NOBODY.pw_gid)
    script = "mkdir -p /seed/sub && echo k > /seed/sub/k && cp /bin/busybox /seed/tool && chmod 4755 /seed/tool " \
             "&& touch /ready && sleep 60"
    async with DockerBackend() as backend, detached(backend, busybox_image, script) as name:
        with anyio.fail_after(15):
            while True:
                try:
                    await backend.workload_exec(name, Execution(command=["test", "-e", "/ready"]))
                    break
                except RuntimeFailed:
                    await anyio.sleep(0.1)
        with pytest.raises(RuntimeFailed, match="symbolic link"):
            await backend.workload_copy_from(name, "/seed", str(shared / "planted" / "seed"), owner=nobody)
        assert list(secret.iterdir()) == []
        await backend.workload_copy_from(name, "/seed", str(shared / "seed"), owner=nobody)
    tool = (shared / "seed" / "tool").stat()
    assert (tool.st_uid, tool.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid) and not tool.st_mode & 0o7000
    assert (shared / "seed" / "sub" / "k").read_text() == "k\n"
    assert (shared / "seed" / "sub" / "k").stat().st_uid == NOBODY.pw_uid


async def test_image_build_as_an_owner_reads_the_context_as_that_owner(busybox_image: str, top: Path) -> None:
    """Regression: image-build read `context` directories as root: any host file could be built into an image."""
    nobody = Owner(NOBODY.pw_uid, NOBODY.pw_gid)
    context = top / "ctx"
    (context / "private").mkdir(parents=True)
    (context / "private" / "key").write_text("root only\n")
    (context / "private").chmod(0o700)
    (context / "shadow").symlink_to("/etc/shadow")
    tag = f"coldsnap-capsule/{uniq('owner')}:1"
    dockerfile = f"FROM {busybox_image}\nCOPY . /ctx\n".encode()
    try:
        async with DockerBackend() as backend:
            with pytest.raises(RuntimeFailed, match=rf"image-build failed: cannot read {context}/private: "
                                                    "Permission denied"):
                await backend.image_build(ImageBuild(dockerfile=dockerfile, context=str(context), tag=tag),
                                          owner=nobody)
            assert not image_exists(tag)
            (context / "private").chmod(0o755)  # now nobody may read it: the same build succeeds
            await backend.image_build(ImageBuild(dockerfile=dockerfile, context=str(context), tag=tag), owner=nobody)
            reply = await backend.workload_run(WorkloadSpec(
                image=tag, name="", remove_after_exit=True, pull_policy="never",
                command=["sh", "-c", "cat /ctx/private/key; test -L /ctx/shadow && readlink /ctx/shadow"]),
                allow_pull=False)
        assert reply.output == b"root only\n/etc/shadow\n"  # the link travelled as a link, not as its content
    finally:
        docker("image", "rm", tag, check=False)


def test_private_aiodocker_request_api_is_used_only_by_stream() -> None:
    """aiodocker's private request methods appear once in the backend: in the documented Engine.stream."""
    texts = {p.name: p.read_text() for p in (ROOT / "coldsnap_runtime" / "backend").glob("*.py")}
    assert not [name for name, text in texts.items() if "_query_json" in text or "_query_chunked_post" in text]
    assert {name: text.count("._query(") for name, text in texts.items() if "._query(" in text} == {"_engine.py": 1}
    text = texts["_engine.py"]
    stream = text[text.index("    async def stream("):text.index("    # --- streaming JSON progress")]
    assert "self.docker._query(" in stream


# --- leftovers of a killed daemon (finding 15) ---------------------------------------------

_CHILD = """
import sys, anyio
from coldsnap_runtime import DockerBackend
from coldsnap_runtime.schema import WorkloadSpec

async def main() -> None:
    async with DockerBackend(instance=sys.argv[1]) as backend:
        await backend.workload_run(WorkloadSpec(image=sys.argv[2], name=sys.argv[3], remove_after_exit=True,
                                                command=["sleep", "60"]), allow_pull=False)

anyio.run(main)
"""


def _instance_containers(instance: str) -> list[str]:
    out = docker("ps", "-aq", "--no-trunc", "--filter", f"label={INSTANCE_LABEL}={instance}").stdout
    return out.decode().split()


async def _kill_mid_run(instance: str, image: str, name: str) -> str:
    """A backend process that dies by SIGKILL while its synchronous run is attached; the container it left."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, instance, image, name], cwd=ROOT)
    try:
        with anyio.fail_after(15):
            while not (left := docker("ps", "-q", "--no-trunc", "--filter",
                                      f"label={INSTANCE_LABEL}={instance}").stdout.decode().split()):
                assert child.poll() is None, "the child exited before its run started"
                await anyio.sleep(0.1)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert container_exists(left[0])  # nobody cleaned up: the leftover the finding describes
    return left[0]


async def test_recover_removes_only_this_instances_leftovers(busybox_image: str) -> None:
    """Regression: #11 (finding 15): a killed daemon's remove_after_exit/anonymous runs stayed behind."""
    mine, other = uniq("inst"), uniq("inst")
    anonymous = await _kill_mid_run(mine, busybox_image, "")
    foreign = await _kill_mid_run(other, busybox_image, "")
    try:
        async with DockerBackend(instance=mine) as backend:
            await backend.recover()
        assert not container_exists(anonymous)
        assert container_exists(foreign)  # another daemon's state directory: not ours to touch
    finally:
        async with DockerBackend(instance=other) as backend:
            await backend.recover()
    assert not container_exists(foreign) and _instance_containers(mine) == []


async def test_named_run_reclaims_its_name_from_a_leftover_of_this_instance(busybox_image: str) -> None:
    """Regression: #11 (finding 15): the next run got "Conflict" after the daemon was killed."""
    instance, name = uniq("inst"), uniq("named")
    await _kill_mid_run(instance, busybox_image, name)
    async with DockerBackend(instance=uniq("inst")) as stranger:  # another instance must not reclaim it
        with pytest.raises(RuntimeFailed, match=r"Conflict|already in use"):
            await stranger.workload_run(WorkloadSpec(image=busybox_image, name=name, remove_after_exit=True,
                                                     command=["true"]), allow_pull=False)
    async with DockerBackend(instance=instance) as backend:  # no recover() first: the name itself is reclaimed
        reply = await backend.workload_run(WorkloadSpec(image=busybox_image, name=name, remove_after_exit=True,
                                                        command=["echo", "again"]), allow_pull=False)
    assert reply.output == b"again\n" and not container_exists(name)


# --- the image ledger (finding 17) ---------------------------------------------------------


async def test_image_remove_refuses_a_reference_the_provider_did_not_make(busybox_image: str, tmp_path: Path) -> None:
    """Regression: #11 (finding 17): image-remove removed any image."""
    outside = f"coldsnap-outside/{uniq('img')}:1"
    docker("tag", busybox_image, outside)
    try:
        async with DockerBackend(image_ledger=tmp_path / "images.json") as backend:
            with pytest.raises(RuntimeFailed, match="not pulled, built or tagged by this provider"):
                await backend.image_remove(outside)
            with pytest.raises(RuntimeFailed, match="not pulled, built or tagged by this provider"):
                await backend.image_remove(busybox_image)
        assert image_exists(outside) and image_exists(busybox_image)
    finally:
        docker("image", "rm", outside)


async def test_image_remove_removes_what_the_provider_tagged_and_built(busybox_image: str, tmp_path: Path) -> None:
    ledger = tmp_path / "images.json"
    tagged, built = f"coldsnap-local-base:{uniq('op')}", f"coldsnap-capsule/{uniq('op')}:1"
    context = tmp_path / "ctx"
    context.mkdir()
    try:
        async with DockerBackend(image_ledger=ledger) as backend:
            await backend.image_tag(busybox_image, tagged)
            await backend.image_build(ImageBuild(dockerfile=f"FROM {tagged}\nLABEL k=v\n".encode(),
                                                 context=str(context), tag=built))
        recorded = json.loads(ledger.read_text())["references"]
        assert recorded == sorted([tagged, built]) and ledger.stat().st_mode & 0o777 == 0o600
        async with DockerBackend(image_ledger=ledger) as backend:  # the ledger outlives the process
            await backend.image_remove(built)
            await backend.image_remove(tagged)
        assert not image_exists(tagged) and not image_exists(built) and image_exists(busybox_image)
        assert json.loads(ledger.read_text())["references"] == []
    finally:
        docker("image", "rm", tagged, built, check=False)


async def test_image_remove_removes_what_the_provider_pulled(busybox_image: str, registry: Registry,
                                                             tmp_path: Path) -> None:
    reference = f"{registry.address}/capsules/{uniq('pulled')}:1"
    credentials = str(registry.credentials_file)
    try:
        async with DockerBackend(credentials_file=credentials, image_ledger=tmp_path / "a.json") as backend:
            await backend.image_tag(busybox_image, reference)
            await backend.image_push(reference)
        docker("image", "rm", reference)
        async with DockerBackend(credentials_file=credentials, image_ledger=tmp_path / "b.json") as backend:
            await backend.image_pull(reference)
            await backend.image_remove(reference)
        assert not image_exists(reference)
    finally:
        docker("image", "rm", reference, check=False)
        # The push left `<repository>@sha256:...` on the shared busybox image: other tests expect none.
        digests = json.loads(docker("image", "inspect", busybox_image).stdout)[0]["RepoDigests"] or []
        for digest in digests:
            if digest.startswith(reference.rsplit(":", 1)[0] + "@"):
                docker("image", "rm", digest, check=False)


def test_output_limit_is_one_definition() -> None:
    texts = [p.read_text() for p in (ROOT / "coldsnap_runtime" / "backend").glob("*.py")]
    assert not [text for text in texts if "OUTPUT_LIMIT = " in text] and OUTPUT_LIMIT == 46 << 20
    assert os.path.exists(ROOT / "coldsnap_runtime" / "limits.py")

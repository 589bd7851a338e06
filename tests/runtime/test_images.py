"""image-* actions against the real dockerd and a real htpasswd registry on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import Registry, docker
from tests.helpers import Session, running_daemon
from tests.runtime.conftest import image_exists, uniq

pytestmark = pytest.mark.usefixtures("no_leftovers")


def image_id(ref: str) -> str:
    return str(json.loads(docker("image", "inspect", ref).stdout)[0]["Id"])


async def test_inspect_reports_config_digest_size_and_not_found(session: Session, busybox_image: str) -> None:
    reply = await session.runtime("image-inspect", image=busybox_image)
    image = reply.runtime.image  # type: ignore[union-attr]
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", image.id) and image.id == image_id(busybox_image)
    assert image.size > 0 and image.repo_digests == []
    by_id = await session.runtime("image-inspect", image=image.id)
    assert by_id.runtime.image.id == image.id  # type: ignore[union-attr]
    prefix = await session.runtime("image-inspect", image=image.id[7:19])
    assert not prefix.ok and prefix.error_code == "not_found"
    absent = await session.runtime("image-inspect", image="registry.example/capsules/m@sha256:" + "0" * 64)
    assert not absent.ok and absent.error_code == "not_found"


async def test_tag_and_remove_touch_exactly_the_named_pair(session: Session, busybox_image: str) -> None:
    source_id = image_id(busybox_image)
    target = f"coldsnap-local-base:{uniq('op')}-n610-unit-unit-0"
    tagged = await session.runtime("image-tag", source=source_id, target=target)
    assert tagged.ok and image_id(target) == source_id
    removed = await session.runtime("image-remove", image=target)
    assert removed.ok and not image_exists(target) and image_exists(busybox_image)
    again = await session.runtime("image-remove", image=target)
    assert not again.ok and again.error_code == "not_found"
    ambiguous = await session.runtime("image-remove", image=source_id[7:19])
    assert not ambiguous.ok and ambiguous.error_code == "not_found" and image_exists(busybox_image)


async def test_push_then_inspect_shows_the_registry_digest_and_pull_restores(
        session: Session, busybox_image: str, registry: Registry) -> None:
    repository = f"{registry.address}/capsules/{uniq('m')}"
    tag = f"{repository}:op-1-n610-unit-unit-0"
    assert (await session.runtime("image-tag", source=busybox_image, target=tag)).ok
    pushed = await session.runtime("image-push", image=tag)
    assert pushed.ok, pushed.error
    digests = (await session.runtime("image-inspect", image=tag)).runtime.image.repo_digests  # type: ignore[union-attr]
    matching = [d for d in digests if d.startswith(repository + "@sha256:")]
    assert len(matching) == 1 and re.fullmatch(r".*@sha256:[0-9a-f]{64}", matching[0])
    docker("image", "rm", tag)
    docker("image", "rm", matching[0], check=False)  # may already be gone with its last tag
    assert not image_exists(matching[0])
    pulled = await session.runtime("image-pull", image=matching[0])
    assert pulled.ok, pulled.error
    assert (await session.runtime("image-inspect", image=matching[0])).ok
    docker("image", "rm", matching[0])


async def test_registry_errors_inside_the_stream_are_failures(session: Session, registry: Registry) -> None:
    missing = await session.runtime("image-pull", image=f"{registry.address}/capsules/absent:1")
    assert not missing.ok and missing.error_code in ("runtime_failed", "not_found")
    assert "absent" in str(missing.error)
    local_only = await session.runtime("image-pull", image="sha256:" + "1" * 64)
    assert not local_only.ok and "must already be resident" in str(local_only.error)


async def test_push_without_credentials_is_refused_by_the_registry(busybox_image: str,
                                                                   registry: Registry) -> None:
    from tests.helpers import running_daemon

    async with running_daemon() as daemon:  # no credentials file configured
        session = await daemon.open_session()
        tag = f"{registry.address}/capsules/{uniq('noauth')}:1"
        assert (await session.runtime("image-tag", source=busybox_image, target=tag)).ok
        try:
            pushed = await session.runtime("image-push", image=tag)
            assert not pushed.ok and pushed.error_code == "runtime_failed"
            assert "auth" in str(pushed.error).lower()
        finally:
            docker("image", "rm", tag)


async def test_credentials_never_reach_logs(daemon: object, registry: Registry) -> None:
    from tests.helpers import Daemon

    assert isinstance(daemon, Daemon)
    log = daemon.log()
    assert registry.password not in log and base64.b64encode(
        f"{registry.username}:{registry.password}".encode()).decode() not in log


def build_request(dockerfile: str, context: str, tag: str, **extra: object) -> dict[str, object]:
    return {"dockerfile": base64.b64encode(dockerfile.encode()).decode(), "context": context, "tag": tag, **extra}


async def test_build_with_named_contexts_local_base_and_arguments(session: Session, busybox_image: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="cs-build-"))
    (root / "ctx").mkdir()
    (root / "ctx" / "capsule.txt").write_text("capsule\n")
    (root / "seed" / "root" / ".triton").mkdir(parents=True)
    (root / "seed" / "root" / ".triton" / "k").write_text("seed\n")
    (root / "overlay" / "etc").mkdir(parents=True)
    (root / "overlay" / "etc" / "overlay.txt").write_text("overlay\n")
    base_tag = f"coldsnap-local-base:{uniq('op')}"
    assert (await session.runtime("image-tag", source=busybox_image, target=base_tag)).ok
    tag = f"coldsnap-capsule/{uniq('op')}:n610-unit-unit-0"
    dockerfile = (
        f"FROM overlay AS over\n"
        f"FROM {base_tag}\n"
        "ARG SOURCE_DATE_EPOCH\n"
        "LABEL io.sparksq.coldsnap.kind=unit-capsule\n"
        "COPY capsule.txt /capsule.txt\n"
        "COPY --from=coldsnap_seed --chown=65534:65534 /root/.triton /root/.triton\n"
        "COPY --from=over /etc/overlay.txt /overlay.txt\n"
        'RUN test -s /root/.triton/k && echo "epoch=$SOURCE_DATE_EPOCH" > /epoch\n'
    )
    try:
        built = await session.runtime("image-build", build=build_request(
            dockerfile, str(root / "ctx"), tag,
            contexts={"coldsnap_seed": str(root / "seed"), "overlay": str(root / "overlay")},
            arguments={"SOURCE_DATE_EPOCH": "0"}))
        assert built.ok, built.error
        image = (await session.runtime("image-inspect", image=tag)).runtime.image  # type: ignore[union-attr]
        assert image.size > 0
        check = await session.runtime("workload-run", workload={
            "name": "", "image": tag, "remove_after_exit": True, "pull_policy": "never",
            "command": ["sh", "-c",
                        "cat /capsule.txt /root/.triton/k /overlay.txt /epoch; stat -c %u /root/.triton/k"]})
        assert check.runtime.output == b"capsule\nseed\noverlay\nepoch=0\n65534\n"  # type: ignore[union-attr]
    finally:
        docker("image", "rm", "-f", tag, base_tag, check=False)


async def test_failed_build_is_runtime_failed_and_leaves_no_container(session: Session, busybox_image: str) -> None:
    root = tempfile.mkdtemp(prefix="cs-build-")
    tag = f"coldsnap-capsule/{uniq('bad')}:1"
    reply = await session.runtime("image-build", build=build_request(
        f"FROM {busybox_image}\nRUN echo building && false\n", root, tag))
    assert not reply.ok and reply.error_code == "runtime_failed" and "returned a non-zero code" in str(reply.error)
    assert not image_exists(tag)
    missing_base = await session.runtime("image-build", build=build_request(
        "FROM coldsnap-local-base:does-not-exist\n", root, tag))
    assert not missing_base.ok and "coldsnap-local-base:does-not-exist is not resident and pull is false" in str(
        missing_base.error)
    no_context = await session.runtime(
        "image-build", build=build_request(f"FROM {busybox_image}\n", "/nonexistent", tag))
    assert not no_context.ok and "/nonexistent is not a directory" in str(no_context.error)


async def test_build_context_is_read_as_exec_user_not_as_the_daemon(busybox_image: str) -> None:
    """Regression: image-build read context directories as root; with `exec.user = nobody` it reads as nobody."""
    root = Path(tempfile.mkdtemp(prefix="cs-build-", dir="/tmp"))
    try:
        root.chmod(0o755)
        (root / "ctx" / "secret").mkdir(parents=True)
        (root / "ctx" / "secret" / "id_rsa").write_text("root's key\n")
        (root / "ctx" / "secret" / "id_rsa").chmod(0o600)
        tag = f"coldsnap-capsule/{uniq('asuser')}:1"
        async with running_daemon('[exec]\nuser = "nobody"\n') as daemon:
            session = await daemon.open_session(hosts=["localhost"])
            reply = await session.runtime("image-build", build=build_request(
                f"FROM {busybox_image}\nCOPY . /ctx\n", str(root / "ctx"), tag))
        assert not reply.ok and reply.error_code == "runtime_failed"
        assert reply.error == f"image-build failed: cannot read {root}/ctx/secret/id_rsa: Permission denied"
        assert not image_exists(tag)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_pull_policies(session: Session, busybox_image: str, registry: Registry) -> None:
    never = await session.runtime("workload-run", workload={
        "name": "", "image": "127.0.0.1:1/never:1", "pull_policy": "never", "remove_after_exit": True})
    assert not never.ok and never.error_code == "not_found"  # port 1 was never contacted
    repository = f"{registry.address}/capsules/{uniq('pp')}"
    tag = f"{repository}:1"
    assert (await session.runtime("image-tag", source=busybox_image, target=tag)).ok
    assert (await session.runtime("image-push", image=tag)).ok
    docker("image", "rm", tag)
    missing = await session.runtime("workload-run", workload={
        "name": "", "image": tag, "pull_policy": "missing", "remove_after_exit": True, "command": ["echo", "pulled"]})
    assert missing.ok and missing.runtime.output == b"pulled\n"  # type: ignore[union-attr]
    docker("image", "rm", tag)

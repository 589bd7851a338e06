"""Legacy top-level `oci-pull` / `oci-push` (spec 3.6): the runtime registry actions under their old
names, against the real dockerd and the htpasswd registry the runtime tests use."""

from __future__ import annotations

import re
import secrets

import msgspec

from tests.conftest import Registry, docker
from tests.helpers import running_daemon


def _image_exists(ref: str) -> bool:
    return docker("image", "inspect", ref, check=False).returncode == 0


async def test_legacy_oci_push_then_pull_round_trips_through_the_registry(busybox_image: str,
                                                                         registry: Registry) -> None:
    config = f'[registry]\ncredentials_file = "{registry.credentials_file}"\n'
    repository = f"{registry.address}/capsules/legacy-{secrets.token_hex(4)}"
    tag = f"{repository}:op-1"
    digest = ""
    async with running_daemon(config) as daemon:
        session = await daemon.open_session(hosts=["localhost"])
        assert (await session.runtime("image-tag", source=busybox_image, target=tag)).ok
        try:
            pushed = await session.call("oci-push", host="localhost", image=tag)
            assert pushed.ok, pushed.error
            assert set(msgspec.to_builtins(pushed)) == {"format", "id", "ok"}  # no runtime object
            inspected = await session.runtime("image-inspect", image=tag)
            digests = inspected.runtime.image.repo_digests  # type: ignore[union-attr]
            [digest] = [d for d in digests if re.fullmatch(rf"{re.escape(repository)}@sha256:[0-9a-f]{{64}}", d)]
            docker("image", "rm", tag)
            docker("image", "rm", digest, check=False)
            assert not _image_exists(digest)
            pulled = await session.call("oci-pull", host="localhost", image=digest)
            assert pulled.ok, pulled.error
            assert _image_exists(digest)
        finally:
            for ref in (tag, digest):
                if ref:
                    docker("image", "rm", ref, check=False)
            # The push leaves `<repository>@sha256:…` on the shared busybox image, whatever failed above;
            # the other image tests expect it to have no repo digests.
            left = msgspec.json.decode(docker("image", "inspect", busybox_image).stdout)[0]["RepoDigests"] or []
            for ref in left:
                if ref.startswith(repository + "@"):
                    docker("image", "rm", ref, check=False)
        # The same failure, word for word, as the runtime action it stands for.
        absent = f"{registry.address}/capsules/absent:{secrets.token_hex(2)}"
        legacy = await session.call("oci-pull", host="localhost", image=absent)
        runtime = await session.runtime("image-pull", image=absent)
        assert not legacy.ok and legacy.error_code == runtime.error_code and legacy.error == runtime.error
        outside = await session.call("oci-pull", host="node-elsewhere", image=absent)
        assert not outside.ok and outside.error == "host-provider target is outside this request"


async def test_legacy_oci_operations_need_their_capabilities(busybox_image: str) -> None:
    async with running_daemon("[registry]\npull = false\npush = false\n") as daemon:
        session = await daemon.open_session(hosts=["localhost"])
        caps = await session.call("capabilities")
        pull = await session.call("oci-pull", host="localhost", image=busybox_image)
        push = await session.call("oci-push", host="localhost", image=busybox_image)
    assert caps.capabilities == ["exec", "runtime-v1", "upload"]
    assert not pull.ok and pull.error == "unsupported host-provider capability 'oci-pull'"
    assert not push.ok and push.error == "unsupported host-provider capability 'oci-push'"

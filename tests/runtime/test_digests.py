"""image.id is the config digest: the selection walk (pure), and against the real htpasswd registry."""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp
import anyio
import pytest

from coldsnap_runtime import DockerBackend
from coldsnap_runtime.backend._digests import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    OCI_INDEX,
    OCI_MANIFEST,
    Platform,
    RegistryReader,
    config_digest,
    id_needs_resolution,
    registry_is_insecure,
    repository_path,
    resolve_step,
    uses_containerd_store,
)
from coldsnap_runtime.backend._engine import registry_errors
from coldsnap_runtime.errors import RuntimeFailed
from tests.conftest import Registry, docker
from tests.runtime.conftest import uniq

AMD64 = Platform.of("linux", "amd64")


def doc(value: dict[str, Any]) -> tuple[str, bytes]:
    content = json.dumps(value).encode()
    return "sha256:" + hashlib.sha256(content).hexdigest(), content


LAYERS = {"type": "layers", "diff_ids": ["sha256:" + "1" * 64]}
CONFIG_AMD64 = doc({"architecture": "amd64", "os": "linux", "rootfs": LAYERS})
CONFIG_ARM64 = doc({"architecture": "arm64", "os": "linux", "rootfs": LAYERS})
ATTESTATION = {"vnd.docker.reference.type": "attestation-manifest"}


def manifest(config: tuple[str, bytes], media_type: str = OCI_MANIFEST) -> tuple[str, bytes]:
    return doc({"schemaVersion": 2, "mediaType": media_type,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config[0],
                           "size": len(config[1])}, "layers": []})


def entry(target: tuple[str, bytes], platform: dict[str, str] | None, **annotations: str) -> dict[str, Any]:
    value: dict[str, Any] = {"mediaType": OCI_MANIFEST, "digest": target[0], "size": len(target[1])}
    if platform is not None:
        value["platform"] = platform
    if annotations:
        value["annotations"] = annotations
    return value


class TestSelection:
    def test_resolve_step_index_picks_this_platform_past_attestations(self) -> None:
        amd, arm = manifest(CONFIG_AMD64), manifest(CONFIG_ARM64)
        index = doc({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
            entry(arm, {"os": "unknown", "architecture": "unknown"}, **ATTESTATION),
            entry(arm, {"os": "linux", "architecture": "arm64", "variant": "v8"}),
            entry(amd, {"os": "linux", "architecture": "amd64"})]})
        assert resolve_step("manifest", *index, AMD64) == ("manifest", amd[0])
        assert resolve_step("manifest", *index, Platform.of("linux", "aarch64")) == ("manifest", arm[0])

    def test_resolve_step_docker_manifest_list_and_manifest_lead_to_the_config(self) -> None:
        amd = manifest(CONFIG_AMD64, DOCKER_MANIFEST)
        listing = doc({"schemaVersion": 2, "mediaType": DOCKER_LIST, "manifests": [
            entry(amd, {"os": "linux", "architecture": "amd64"})]})
        assert resolve_step("manifest", *listing, AMD64) == ("manifest", amd[0])
        assert resolve_step("manifest", *amd, AMD64) == ("config", CONFIG_AMD64[0])
        assert resolve_step("config", *CONFIG_AMD64, AMD64) == ("done", CONFIG_AMD64[0])

    def test_resolve_step_index_without_this_platform_names_it(self) -> None:
        index = doc({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
            entry(manifest(CONFIG_ARM64), {"os": "linux", "architecture": "arm64"})]})
        with pytest.raises(RuntimeFailed, match=r"has no manifest for linux/amd64"):
            resolve_step("manifest", *index, AMD64)

    def test_resolve_step_entry_without_platform_only_when_none_names_this_one(self) -> None:
        amd, arm = manifest(CONFIG_AMD64), manifest(CONFIG_ARM64)
        loose = doc({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [entry(arm, None)]})
        both = doc({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
            entry(arm, None), entry(amd, {"os": "linux", "architecture": "amd64"})]})
        assert resolve_step("manifest", *loose, AMD64) == ("manifest", arm[0])
        assert resolve_step("manifest", *both, AMD64) == ("manifest", amd[0])

    def test_resolve_step_content_of_another_digest_is_refused(self) -> None:
        with pytest.raises(RuntimeFailed, match="has another digest"):
            resolve_step("manifest", CONFIG_ARM64[0], manifest(CONFIG_AMD64)[1], AMD64)

    async def test_config_digest_walks_index_manifest_config_and_checks_layers(self) -> None:
        amd = manifest(CONFIG_AMD64)
        index = doc({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
            entry(amd, {"os": "linux", "architecture": "amd64"})]})
        store = dict([index, amd, CONFIG_AMD64])
        reads: list[tuple[str, str]] = []

        async def read(kind: Literal["manifest", "config"], digest: str) -> bytes:
            reads.append((kind, digest))
            return store[digest]

        assert await config_digest(index[0], read, AMD64, layers=["sha256:" + "1" * 64]) == CONFIG_AMD64[0]
        assert reads == [("manifest", index[0]), ("manifest", amd[0]), ("config", CONFIG_AMD64[0])]
        with pytest.raises(RuntimeFailed, match="does not describe the local image's layers"):
            await config_digest(index[0], read, AMD64, layers=["sha256:" + "2" * 64])

    def test_id_needs_resolution_classic_no_descriptor_newer_engines_yes(self) -> None:
        classic = {"Id": CONFIG_AMD64[0]}
        described = {"Id": "sha256:" + "a" * 64, "Descriptor": {"mediaType": OCI_INDEX, "digest": "sha256:" + "a" * 64}}
        assert not id_needs_resolution(classic, containerd_store=False)
        assert id_needs_resolution(classic, containerd_store=True)
        assert id_needs_resolution(described, containerd_store=False)
        config_target = {"Id": "sha256:" + "a" * 64, "Descriptor": {
            "mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + "a" * 64}}
        assert not id_needs_resolution(config_target, containerd_store=True)

    def test_uses_containerd_store_reads_the_driver_type(self) -> None:
        assert uses_containerd_store({"DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]})
        assert not uses_containerd_store({"DriverStatus": [["Backing Filesystem", "extfs"]]})
        assert not uses_containerd_store({})

    def test_registry_is_insecure_as_the_engine_decides(self) -> None:
        indexes = {"docker.io": {"Secure": True}, "reg.local:5000": {"Secure": False}}
        info = {"RegistryConfig": {"InsecureRegistryCIDRs": ["127.0.0.0/8"], "IndexConfigs": indexes}}
        assert registry_is_insecure(info, "127.0.0.1:5000") and registry_is_insecure(info, "reg.local:5000")
        assert not registry_is_insecure(info, "docker.io") and not registry_is_insecure(info, "10.0.0.1:5000")
        assert not registry_is_insecure(info, "registry.example")

    @pytest.mark.parametrize(("written", "path"), [
        ("busybox", "library/busybox"), ("docker.io/busybox", "library/busybox"), ("user/app", "user/app"),
        ("127.0.0.1:5000/capsules/m", "capsules/m"), ("localhost/x", "x"), ("registry.example/a/b", "a/b")])
    def test_repository_path_is_the_registry_apis_name(self, written: str, path: str) -> None:
        assert repository_path(written) == path

    @pytest.mark.parametrize("raised", [TimeoutError(), aiohttp.ClientConnectionError("refused"),
                                        aiohttp.ClientPayloadError("truncated"), ConnectionResetError(104, "reset")])
    def test_registry_errors_maps_every_transport_error_to_runtime_failed(self, raised: BaseException) -> None:
        with pytest.raises(RuntimeFailed, match=r"registry 127\.0\.0\.1:1") as caught:
            with registry_errors("image-inspect", "127.0.0.1:1"):
                raise raised
        assert caught.value.__cause__ is raised


# --- against the real registry ---------------------------------------------------------------


class RegistryApi:
    """Just enough of the Registry HTTP API v2 to publish an index by hand (Basic auth)."""

    def __init__(self, registry: Registry, repository: str) -> None:
        self.base = f"http://{registry.address}/v2/{repository}"
        token = base64.b64encode(f"{registry.username}:{registry.password}".encode()).decode()
        self.auth = {"Authorization": f"Basic {token}"}

    def request(self, method: str, url: str, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(url if url.startswith("http") else self.base + url, data=data, method=method,
                                     headers={**self.auth, **(headers or {})})
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, dict(response.headers), response.read()

    def manifest(self, reference: str) -> tuple[str, bytes]:
        accept = {"Accept": f"{OCI_MANIFEST}, {DOCKER_MANIFEST}"}
        _, headers, body = self.request("GET", f"/manifests/{reference}", headers=accept)
        return headers["Docker-Content-Digest"], body

    def put_blob(self, content: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(content).hexdigest()
        _, headers, _ = self.request("POST", "/blobs/uploads/")
        location = headers["Location"]
        location = location if location.startswith("http") else self.base.split("/v2/")[0] + location
        separator = "&" if "?" in location else "?"
        self.request("PUT", f"{location}{separator}digest={digest}", data=content,
                     headers={"Content-Type": "application/octet-stream"})
        return digest

    def put_manifest(self, reference: str, content: bytes, media_type: str) -> str:
        _, headers, _ = self.request("PUT", f"/manifests/{reference}", data=content,
                                     headers={"Content-Type": media_type})
        return headers["Docker-Content-Digest"]


@pytest.fixture
def pushed(busybox_image: str, registry: Registry) -> Iterator[tuple[str, str]]:
    """busybox pushed as <registry>/capsules/<unique>:1; (repository, tag). Leaves nothing behind."""
    repository = f"{registry.address}/capsules/{uniq('digest')}"
    tag = f"{repository}:1"
    docker("tag", busybox_image, tag)
    try:
        yield repository, tag
    finally:
        docker("image", "rm", tag, check=False)
        digests = json.loads(docker("image", "inspect", busybox_image).stdout)[0]["RepoDigests"] or []
        for digest in digests:
            if digest.startswith(repository + "@"):
                docker("image", "rm", digest, check=False)


def publish_index(registry: Registry, path: str, local: dict[str, Any]) -> tuple[str, str, str]:
    """Beside the pushed `:1`, a second platform's image by hand (same layers, another config) and an
    OCI index over both, its first entry an attestation as BuildKit publishes them.

    Returns (the pushed manifest's digest, the index's digest, the arm64 config digest).
    """
    api = RegistryApi(registry, path)
    manifest_digest, manifest_body = api.manifest("1")
    pushed_manifest = json.loads(manifest_body)
    assert pushed_manifest["config"]["digest"] == local["Id"]  # classic store: .Id is the config digest
    arm_config_content = json.dumps({"architecture": "arm64", "os": "linux",
                                     "rootfs": {"type": "layers", "diff_ids": local["RootFS"]["Layers"]}}).encode()
    arm_config = api.put_blob(arm_config_content)
    arm_content = json.dumps({**pushed_manifest, "config": {
        **pushed_manifest["config"], "digest": arm_config, "size": len(arm_config_content)}}).encode()
    media = pushed_manifest["mediaType"]
    arm_digest = api.put_manifest("arm64", arm_content, media)

    def points_at(digest: str, content: bytes, platform: dict[str, str], **annotations: str) -> dict[str, Any]:
        value = {"mediaType": media, "digest": digest, "size": len(content), "platform": platform}
        return {**value, "annotations": annotations} if annotations else value

    index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [
        points_at(arm_digest, arm_content, {"os": "unknown", "architecture": "unknown"}, **ATTESTATION),
        points_at(arm_digest, arm_content, {"os": "linux", "architecture": "arm64", "variant": "v8"}),
        points_at(manifest_digest, manifest_body, {"os": "linux", "architecture": "amd64"})]}).encode()
    index_digest = api.put_manifest("multi", index, OCI_INDEX)
    assert index_digest == "sha256:" + hashlib.sha256(index).hexdigest()
    try:  # the registry really refuses anonymous reads: the reader's credentials are what lets it in
        urllib.request.urlopen(f"http://{registry.address}/v2/{path}/manifests/multi", timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
    else:
        raise AssertionError("the registry answered an anonymous read")
    return manifest_digest, index_digest, arm_config


async def test_config_digest_from_a_real_registry_manifest_and_index(busybox_image: str, registry: Registry,
                                                                    pushed: tuple[str, str]) -> None:
    repository, tag = pushed
    local = json.loads(docker("image", "inspect", busybox_image).stdout)[0]
    async with DockerBackend(credentials_file=str(registry.credentials_file)) as backend:
        await backend.image_push(tag)
    path = repository.split("/", 1)[1]
    manifest_digest, index_digest, arm_config = await anyio.to_thread.run_sync(publish_index, registry, path, local)
    layers = local["RootFS"]["Layers"]
    arm64 = Platform.of("linux", "arm64")

    async with aiohttp.ClientSession() as session:
        reader = RegistryReader(session, registry=registry.address, repository=path,
                                auth={"username": registry.username, "password": registry.password}, insecure=True)
        assert await config_digest(manifest_digest, reader.read, AMD64, layers=layers) == local["Id"]
        assert await config_digest(index_digest, reader.read, AMD64, layers=layers) == local["Id"]
        assert await config_digest(index_digest, reader.read, arm64, layers=layers) == arm_config
        anonymous = RegistryReader(session, registry=registry.address, repository=path, auth=None, insecure=True)
        with pytest.raises(RuntimeFailed, match="registry needs credentials"):
            await config_digest(index_digest, anonymous.read, AMD64)

    # The backend's own path: an inspect whose Id is an index (as the containerd store's is),
    # resolved with the daemon's credentials file and the engine's own insecure-registry and
    # platform answers.
    inspect = {"Id": index_digest, "Descriptor": {"mediaType": OCI_INDEX, "digest": index_digest},
               "RepoDigests": [f"{repository}@{index_digest}"], "RootFS": local["RootFS"]}
    async with DockerBackend(credentials_file=str(registry.credentials_file)) as backend:
        assert await backend._images.config_digest(f"{repository}@{index_digest}", inspect) == local["Id"]
        # Content-addressed, so remembered: once known, the registry is not asked again.
        assert await backend._images.config_digest("capsule:local", {**inspect, "RepoDigests": []}) == local["Id"]
    async with DockerBackend(credentials_file=str(registry.credentials_file)) as backend:
        with pytest.raises(RuntimeFailed, match="no registry repository holds it"):
            await backend._images.config_digest("capsule:local", {**inspect, "RepoDigests": []})

"""The backend seam: dispatch, the runtime context and manager labels."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from coldsnap_runtime import Backend, DockerBackend, Owner, RuntimeContext, dispatch
from coldsnap_runtime.backend import with_manager_labels
from coldsnap_runtime.errors import NotFound, RuntimeFailed
from coldsnap_runtime.schema import ImagePull, ImagePush, WorkloadSpec


def spec(**fields: object) -> WorkloadSpec:
    return msgspec.convert(fields, WorkloadSpec)


def test_manager_labels_apply_only_to_the_sessions_cluster() -> None:
    ctx = RuntimeContext(host="h", allow_pull=True, cluster_id="runtime-contract",
                         manager_labels={"sparkrun.cluster_id": "runtime-contract"})
    mine = spec(image="i", labels={"io.sparksq.coldsnap.workload": "runtime-contract"})
    other = spec(image="i", labels={"io.sparksq.coldsnap.workload": "else"})
    assert with_manager_labels(mine, ctx).labels["sparkrun.cluster_id"] == "runtime-contract"
    assert with_manager_labels(other, ctx) is other


def test_runtime_context_has_no_push_permission_and_an_optional_owner() -> None:
    """The provider gates image-pull/image-push; the runtime knows no capability wire text."""
    fields = {f.name for f in msgspec.structs.fields(RuntimeContext)}
    assert fields == {"host", "allow_pull", "owner", "cluster_id", "manager_labels", "manager_uid", "reaches_all",
                      "capabilities"}
    assert RuntimeContext(host="h", allow_pull=False).owner is None
    assert RuntimeContext(host="h", allow_pull=False).manager_uid is None
    assert RuntimeContext(host="h", allow_pull=False, owner=Owner(65534, 65534)).owner == Owner(uid=65534, gid=65534)


async def test_dispatch_passes_pull_and_push_to_the_backend_without_a_capability_gate() -> None:
    ctx = RuntimeContext(host="h", allow_pull=False)
    async with DockerBackend() as backend:
        with pytest.raises(RuntimeFailed, match="must already be resident"):  # the backend's answer, not a gate
            await dispatch(backend, ImagePull(image="sha256:" + "1" * 64), ctx)
        with pytest.raises(NotFound):
            await dispatch(backend, ImagePush(image="coldsnap-absent/never:1"), ctx)


def test_docker_backend_implements_every_method_of_the_seam() -> None:
    wanted = {name for name, _ in inspect.getmembers(Backend, inspect.iscoroutinefunction)}
    assert {"recover", "workload_copy_from", "aclose"} <= wanted
    for name in wanted:
        assert inspect.iscoroutinefunction(getattr(DockerBackend, name)), name
    copy = inspect.signature(DockerBackend.workload_copy_from).parameters["owner"]
    assert copy.kind is inspect.Parameter.KEYWORD_ONLY and copy.default is None

"""The backend seam: dispatch, the runtime context and manager labels."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from coldsnap_runtime import Backend, DockerBackend, Owner, RuntimeContext, dispatch
from coldsnap_runtime.backend import REPORT_DIR_LABEL, with_manager_labels, with_report_dir
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


def test_report_dir_is_mounted_named_and_labelled_unless_the_manager_took_the_target() -> None:
    ctx = RuntimeContext(host="h", allow_pull=True, report_dir="/state/capsule-reports/0a1b")
    given = spec(image="i", environment={"COLDSNAP_REPORT_DIR": "/elsewhere", "A": "1"})
    unit = with_report_dir(given, ctx)
    assert [(str(m.source), str(m.target), m.read_only) for m in unit.mounts] == [
        ("/state/capsule-reports/0a1b", "/run/coldsnap/reports", False)]
    assert unit.environment == {"COLDSNAP_REPORT_DIR": "/run/coldsnap/reports", "A": "1"}
    assert unit.labels[REPORT_DIR_LABEL] == "0a1b"
    taken = spec(image="i", mounts=[{"source": "/mine", "target": "/run/coldsnap/reports"}])
    assert with_report_dir(taken, ctx) is taken
    assert with_report_dir(given, RuntimeContext(host="h", allow_pull=True)) is given


def test_runtime_context_has_no_push_permission_and_an_optional_owner() -> None:
    """The provider gates image-pull/image-push; the runtime knows no capability wire text."""
    fields = {f.name for f in msgspec.structs.fields(RuntimeContext)}
    assert fields == {"host", "allow_pull", "owner", "cluster_id", "manager_labels", "manager_uid", "reaches_all",
                      "capabilities", "report_dir", "remote_build_sources"}
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

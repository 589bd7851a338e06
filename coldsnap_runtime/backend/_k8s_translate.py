"""Pure translations between runtime-v1 and Kubernetes core/v1 Pods (no I/O).

Every WorkloadSpec field is realised in the Pod or the request is refused here, naming the field
and why, before anything is created (the Docker backend's rule). Only the stable core/v1 API is
used, so the same Pods run on the v1.20 cluster the tests use and on today's releases.

Names: ColdSnap workload names (``cluster_node_0``) are not DNS-1123 labels. The Pod name is derived
from the workload name (readable prefix + a digest of the whole name, so two names never share a
Pod), and the workload name itself travels in an annotation: every action finds the Pod by
deriving its name and then checks the annotation, so a name survives sessions and daemon restarts,
and a Pod the provider did not create is never taken for a workload.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from typing import Any

from msgspec import UNSET

from ..errors import RuntimeFailed
from ..schema import WorkloadInfo, WorkloadSpec
from ._translate import MANAGED_LABEL

__all__ = (
    "CONTAINER",
    "LABELS_ANNOTATION",
    "NAME_ANNOTATION",
    "REMOVE_AFTER_EXIT_LABEL",
    "pod_failure",
    "pod_manifest",
    "pod_name",
    "workload_info",
    "workload_name",
)

# The one container of a workload Pod.
CONTAINER = "workload"
# The workload name as the controller spelt it, and the request's labels exactly (JSON): a Pod label
# value cannot hold every runtime-v1 label value (63 characters of [A-Za-z0-9._-] at most).
NAME_ANNOTATION = "coldsnap-provider.io/workload-name"
LABELS_ANNOTATION = "coldsnap-provider.io/labels"
# A detached run with remove_after_exit: the backend's maintenance deletes the Pod once it has ended.
REMOVE_AFTER_EXIT_LABEL = "io.coldsnap-provider.remove-after-exit"
_POD_PREFIX = "cs-"
_DIGEST_CHARS = 10
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?")
_NUMERIC_USER = re.compile(r"([0-9]+)(?::([0-9]+))?")
_SHM_VOLUME = "coldsnap-shm"


def _refuse(field: str, why: str) -> RuntimeFailed:
    return RuntimeFailed(action="workload-run", detail=f"`{field}` cannot be realised on Kubernetes: {why}")


def pod_name(name: str, node: str) -> str:
    """The Pod of workload `name` on Node `node` (a DNS-1123 label); a fresh random one for an anonymous run.

    The node is part of the digest: two hosts of one cluster may each have a workload `cluster_node_0`.
    """
    if not name:
        return f"{_POD_PREFIX}run-{secrets.token_hex(8)}"
    readable = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40].strip("-")
    digest = hashlib.sha256(f"{node}/{name}".encode()).hexdigest()[:_DIGEST_CHARS]
    return f"{_POD_PREFIX}{readable}-{digest}" if readable else f"{_POD_PREFIX}{digest}"


def workload_name(pod: dict[str, Any]) -> str:
    """The workload name a Pod was created for ('' when it carries none)."""
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(NAME_ANNOTATION) or "")


def _qualified_name(key: str) -> bool:
    """Kubernetes' rule for label and annotation keys: [DNS subdomain prefix '/'] name."""
    prefix, slash, name = key.rpartition("/")
    if slash and not _DNS_SUBDOMAIN.fullmatch(prefix):
        return False
    return _LABEL_NAME.fullmatch(name) is not None


def _labels(spec: WorkloadSpec) -> tuple[dict[str, str], dict[str, str]]:
    """(Pod labels, annotations): every request label in the annotation; those Kubernetes allows as labels too."""
    for key in spec.labels:
        if not _qualified_name(key):
            raise _refuse("labels", f"key {key!r} is not a Kubernetes qualified name "
                                    "([prefix/]name, name up to 63 characters of [A-Za-z0-9._-])")
    labels = {k: v for k, v in spec.labels.items() if _LABEL_VALUE.fullmatch(v)}
    labels[MANAGED_LABEL] = "true"
    annotations = {LABELS_ANNOTATION: json.dumps(dict(spec.labels), sort_keys=True, separators=(",", ":"))}
    if spec.name:
        annotations[NAME_ANNOTATION] = spec.name
    return labels, annotations


def _pull_policy(spec: WorkloadSpec, *, allow_pull: bool) -> str:
    if spec.pull_policy == "always":
        if not allow_pull:
            raise RuntimeFailed(action="workload-run", detail="pull_policy 'always' needs the oci-pull capability")
        return "Always"
    if spec.pull_policy == "never" or not allow_pull:
        return "Never"  # the kubelet must not pull what the session may not pull
    return "IfNotPresent"


def _security_context(spec: WorkloadSpec) -> dict[str, Any]:
    context: dict[str, Any] = {}
    if spec.privileged:  # unrestricted only: a profile's privileged Pod is refused (_refusals)
        context["privileged"] = True
    if spec.seccomp_unconfined:
        context["seccompProfile"] = {"type": "Unconfined"}
    if spec.user:
        match = _NUMERIC_USER.fullmatch(spec.user)
        if match is None:
            raise _refuse("user", f"{spec.user!r} is not numeric; a Pod runs as uid[:gid] only "
                                  "(securityContext.runAsUser/runAsGroup), never a name from the image")
        context["runAsUser"] = int(match.group(1))
        if match.group(2) is not None:
            context["runAsGroup"] = int(match.group(2))
    return context


def _refusals(spec: WorkloadSpec, capabilities: tuple[str, ...] | None) -> None:
    """The fields core/v1 has no way to honour: refused, never dropped."""
    if spec.gpus:
        raise _refuse("gpus", "core/v1 can only count GPUs (an extended resource such as nvidia.com/gpu), "
                              "never select exact devices, so the Pod could get a different GPU; exact devices "
                              "need Dynamic Resource Allocation (resource.k8s.io), which this cluster lacks")
    if spec.memlock_unlimited:
        raise _refuse("memlock_unlimited", "a Pod cannot set resource limits (ulimits); raise the container "
                                           "runtime's default RLIMIT_MEMLOCK on the node instead")
    if spec.network == "none":
        raise _refuse("network", "'none' has no Pod equivalent (a Pod always has its own network namespace "
                                 "with the cluster network)")
    if capabilities is not None and (spec.privileged or spec.seccomp_unconfined):
        field = "privileged" if spec.privileged else "seccomp_unconfined"
        raise _refuse(field, "under an admission profile a capsule runs only under the provider's capsule seccomp "
                             "profile (no mount: CAP_SYS_ADMIN mounts a procfs whose core_pattern is host root), "
                             "and Kubernetes 1.20 takes a seccomp profile only from a file on the node "
                             "(docs/threat-model.md)")
    if spec.devices and (not spec.privileged or capabilities is not None):
        raise _refuse("devices", "a Pod reaches a host device only through a hostPath volume, which the device "
                                 "cgroup lets it open only in a fully privileged Pod (not granted here)")
    if not spec.detached and spec.input is not UNSET:
        raise _refuse("input", "a Pod's stdin is attachable only after its container started, so bytes "
                               "cannot be guaranteed to reach it from the start; use workload-exec")
    if not spec.detached and not spec.combined:
        raise _refuse("combined", "the Kubernetes log API returns stdout and stderr interleaved (splitting them "
                                  "needs PodLogsQuerySplitStreams, 1.32+), so a synchronous run can only "
                                  "return combined output; send combined: true")


def pod_manifest(spec: WorkloadSpec, *, pod: str, namespace: str, node: str, allow_pull: bool,
                 extra_labels: dict[str, str], capabilities: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The core/v1 Pod realising `spec` on Node `node` (raises RuntimeFailed naming a field it cannot realise).

    `capabilities` is the admission policy's grant: `privileged` is realised as exactly those capabilities.
    """
    _refusals(spec, capabilities)
    labels, annotations = _labels(spec)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": _pull_policy(spec, allow_pull=allow_pull),
        "env": [{"name": k, "value": v} for k, v in sorted(spec.environment.items())],
        "volumeMounts": [],
    }
    if spec.entrypoint:
        container["command"] = [spec.entrypoint]
    if spec.command:
        container["args"] = list(spec.command)
    if context := _security_context(spec):
        container["securityContext"] = context
    volumes: list[dict[str, Any]] = []
    for index, mount in enumerate(spec.mounts):
        volumes.append({"name": f"mount-{index}", "hostPath": {"path": mount.source}})
        container["volumeMounts"].append({"name": f"mount-{index}", "mountPath": mount.target,
                                          "readOnly": mount.read_only})
    for index, device in enumerate(spec.devices):
        volumes.append({"name": f"device-{index}", "hostPath": {"path": device.source, "type": "CharDevice"}})
        container["volumeMounts"].append({"name": f"device-{index}", "mountPath": device.target or device.source})
    if spec.shared_memory_bytes:
        volumes.append({"name": _SHM_VOLUME, "emptyDir": {"medium": "Memory",
                                                          "sizeLimit": str(spec.shared_memory_bytes)}})
        container["volumeMounts"].append({"name": _SHM_VOLUME, "mountPath": "/dev/shm"})
    if spec.detached and spec.remove_after_exit:
        labels[REMOVE_AFTER_EXIT_LABEL] = "true"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod, "namespace": namespace, "labels": {**labels, **extra_labels},
                     "annotations": annotations},
        "spec": {
            "nodeName": node,  # pinned: the scheduler never moves a workload to another host
            "restartPolicy": "Never",  # Docker's default: a container that ends stays ended
            "hostNetwork": spec.network == "host",
            "automountServiceAccountToken": False,  # a workload gets no credential for the cluster
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 10,
            "containers": [container],
            "volumes": volumes,
        },
    }


def _state(pod: dict[str, Any]) -> tuple[str, bool, int, str]:
    """(Docker-style state, running, exit code, started_at) of a Pod's workload container."""
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    statuses = [s for s in status.get("containerStatuses") or [] if s.get("name") == CONTAINER]
    state = (statuses[0].get("state") or {}) if statuses else {}
    if running := state.get("running"):
        if metadata.get("deletionTimestamp"):
            return "removing", True, 0, str(running.get("startedAt") or "")
        return "running", True, 0, str(running.get("startedAt") or "")
    if terminated := state.get("terminated"):
        return "exited", False, int(terminated.get("exitCode") or 0), str(terminated.get("startedAt") or "")
    if metadata.get("deletionTimestamp"):
        return "removing", False, 0, ""
    if status.get("phase") in ("Failed", "Succeeded"):  # evicted or ended without a container status
        return "exited", False, 0 if status.get("phase") == "Succeeded" else 1, ""
    return "created", False, 0, ""


def workload_info(pod: dict[str, Any], *, include_start_time: bool) -> WorkloadInfo:
    """workload-inspect's answer for a Pod (labels exactly as the request gave them)."""
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    try:
        labels = json.loads(annotations.get(LABELS_ANNOTATION) or "{}")
    except ValueError:
        labels = {}
    if not isinstance(labels, dict):
        labels = {}
    labels = {str(k): str(v) for k, v in labels.items()}
    for key in (MANAGED_LABEL, *(k for k in (metadata.get("labels") or {}) if k.startswith("io.coldsnap-provider."))):
        if key in (metadata.get("labels") or {}):
            labels[key] = str(metadata["labels"][key])
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    state, running, exit_code, started = _state(pod)
    return WorkloadInfo(
        id=str(metadata.get("uid") or ""),
        image=str(containers[0].get("image") or ""),
        state=state,
        exit_code=exit_code,
        running=running,
        paused=False,  # a Pod cannot be paused
        labels=labels,
        started_at=started if include_start_time and started else UNSET,
    )


def pod_failure(pod: dict[str, Any]) -> str:
    """Why the kubelet will not run this Pod's container ('' while it may still start)."""
    status = pod.get("status") or {}
    if status.get("phase") == "Failed" and not status.get("containerStatuses"):
        message = status.get("message") or "the Pod failed before its container ran"
        return f"{status.get('reason') or 'Failed'}: {message}"
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = str(waiting.get("reason") or "")
        if reason in _NEVER_STARTS:
            return f"{reason}: {waiting.get('message') or 'the container cannot start'}"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == "Unschedulable":
            return f"Unschedulable: {condition.get('message') or ''}"
    return ""


# Waiting reasons after which the kubelet will not start the container without a change to the Pod.
_NEVER_STARTS = frozenset({
    "ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ImageInspectError",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError", "CrashLoopBackOff",
})

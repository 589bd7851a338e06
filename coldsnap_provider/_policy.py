"""The runtime admission policy (issue 24; docs/policy.md): what a manager's sessions may ask a runtime for.

Every runtime-v1 request, every Hugging Face request (its repository: ``huggingface_repos`` and
the owner, issue 37) and every control-socket `probe` passes :meth:`Policy.admit_operation` (or
:meth:`Policy.admit_probe`) once, above the host routing, before any backend is asked: the same
rules hold for this node, for ``[[remote]]`` nodes and for Kubernetes nodes. A manager's
profile is chosen from ``[policy]`` by its uid and primary gid (root and the daemon's uid get
``policy.admin``). The outcome is a :class:`Decision`, logged here and handed back to the caller;
a refusal is :class:`PolicyRefused` (a plain ``ok:false``) naming the field, the value and the rule,
and nothing has been created.

This module does no I/O except reading the host's filesystem to check mount sources of requests
for this node (:func:`check_source`): dockerd resolves a bind source as root, so a symbolic link
or a directory the manager can rename would let it escape its roots.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import stat
from collections.abc import Iterable
from typing import NoReturn

import msgspec
import structlog

from coldsnap_runtime.dockerfile import remote_sources
from coldsnap_runtime.errors import RequestRejected
from coldsnap_runtime.schema import (
    ImageBuildAction,
    ImagePull,
    ImagePush,
    ImageTag,
    RuntimeRequest,
    WorkloadCopyFrom,
    WorkloadRun,
    WorkloadSpec,
)

from ._config import CAPSULE_CAPABILITIES, PolicyConfig, ProfileConfig
from ._envelope import Exec, HuggingfacePublish, HuggingfaceResolve, OciPull, OciPush, Request, Runtime, Upload
from ._sessions import SessionRecord

__all__ = ("PROVIDER_LABEL_PREFIX", "Decision", "Policy", "PolicyRefused", "Profile", "check_source")

log = structlog.get_logger(__name__)

PROVIDER_LABEL_PREFIX = "io.coldsnap-provider."
# Host paths no profile but `unrestricted` mounts, nor any directory above them.
SYSTEM_PATHS = ("/etc", "/proc", "/sys", "/dev", "/run", "/var/run", "/boot")


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A named profile; `unrestricted` admits everything (today's behaviour, for root by default)."""

    name: str
    rules: ProfileConfig
    unrestricted: bool = False


UNRESTRICTED = Profile(name="unrestricted", rules=ProfileConfig(), unrestricted=True)
CAPSULE = Profile(name="capsule", rules=ProfileConfig())


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """One admission decision: who asked for what, under which profile, and the outcome.

    `rule`, `field` and `value` name what refused it ("" when admitted). `capabilities`: a restricted
    profile's grant: the workload is confined and a `privileged` request is exactly these (None: unconfined,
    `privileged` as ``[runtime] privileged`` says)."""

    manager_uid: int
    session: str
    host: str
    action: str
    profile: str
    admitted: bool
    rule: str = ""
    field: str = ""
    value: str = ""
    message: str = ""
    capabilities: tuple[str, ...] | None = None


class PolicyRefused(RequestRejected):
    """The manager's profile refuses the request (nothing was created); carries the decision."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.message)
        self.decision = decision


class _Refusal(Exception):
    def __init__(self, rule: str, field: str, value: str, message: str) -> None:
        super().__init__(message)
        self.rule, self.field, self.value = rule, field, value


class Policy:
    """The profiles of ``[policy]`` and the rules they impose (pure apart from :func:`check_source`).

    `protected`: host paths that are never mounted under a restricted profile, nor any directory
    above them (the Docker socket, the state directory, credential files). `trusted_uids`: who may
    own a directory above a mount source (root and the daemon)."""

    def __init__(self, config: PolicyConfig, *, protected: Iterable[str] = (),
                 trusted_uids: frozenset[int] | None = None) -> None:
        self._config = config
        self._profiles = {"unrestricted": UNRESTRICTED, "capsule": CAPSULE,
                          **{name: Profile(name=name, rules=rules) for name, rules in config.profiles.items()}}
        self._protected = tuple(sorted({os.path.normpath(p) for p in protected if p}))
        self._trusted = trusted_uids if trusted_uids is not None else frozenset({0, os.geteuid()})

    def profile_for(self, uid: int, gid: int) -> Profile:
        """Root and the daemon's uid: `admin`; else the first [[policy.assign]] naming the uid or gid;
        else `managers`."""
        if uid in (0, os.geteuid()):
            return self._profiles[self._config.admin]
        for entry in self._config.assign:
            if uid in entry.uids or gid in entry.gids:
                return self._profiles[entry.profile]
        return self._profiles[self._config.managers]

    def admit_operation(self, request: Request, record: SessionRecord, *, local: bool,
                        hub_owner: int | None = None) -> Decision | None:
        """The one admission call of a session's request: runtime-v1 (and the legacy oci-pull/-push)
        and the Hub operations under the manager's profile; None for exec and upload (they run as
        exec.user on this node). On a remote node what runs as its SSH user passes `remote_ssh_user`
        first. `hub_owner`: the manager that owns a publish's repository (_hub_owners.py), if any."""
        if not local:
            self._admit_remote_identity(request, record)
        match request:
            case HuggingfacePublish() | HuggingfaceResolve():
                return self._admit_hub(request, record, hub_owner)
            case Runtime(runtime=runtime):
                action: RuntimeRequest = runtime
            case OciPull(image=image):
                action = ImagePull(image=image)
            case OciPush(image=image):
                action = ImagePush(image=image)
            case _:
                return None
        return self.admit(action, uid=record.uid, gid=record.gid, session=record.session, host=request.host,
                          local=local)

    def _admit_remote_identity(self, request: Request, record: SessionRecord) -> None:
        """A [[remote]] node runs exec and upload, reads build contexts and Hub files and writes copy-from
        destinations as its SSH user, who holds that node's engine socket: root there, around every other
        rule. Only a profile that says `remote_ssh_user` (and `unrestricted`) admits them."""
        match request:
            case Exec() | Upload() | HuggingfacePublish() | HuggingfaceResolve():
                action = str(request.__struct_config__.tag)
            case Runtime(runtime=WorkloadCopyFrom() | ImageBuildAction() as runtime):
                action = str(runtime.__struct_config__.tag)
            case _:
                return
        profile = self.profile_for(record.uid, record.gid)
        if profile.unrestricted or profile.rules.remote_ssh_user:
            return
        self._refuse(profile, record.uid, record.session, request.host, action, _Refusal(
            "remote-ssh-user", "host", request.host, (
                f"{action}: host {request.host} runs it as that node's SSH user, who controls its container "
                f"engine (root there); profile {profile.name} does not admit that (remote_ssh_user)")))

    def admit(self, request: RuntimeRequest, *, uid: int, gid: int, session: str, host: str,
              local: bool) -> Decision:
        """Admit one runtime request or raise PolicyRefused; `local`: the host is this node (mount
        sources are then checked on this filesystem too, not only by their text)."""
        profile = self.profile_for(uid, gid)
        action = str(request.__struct_config__.tag)
        capabilities = None
        try:
            if not profile.unrestricted:
                self._check_request(profile, request, local=local)
                if isinstance(request, WorkloadRun):  # a profile's workload is confined, privileged or not
                    capabilities = _grant(profile)
        except _Refusal as refusal:
            self._refuse(profile, uid, session, host, action, refusal)
        return self._admitted(profile, uid, session, host, action, capabilities)

    def _admit_hub(self, request: HuggingfacePublish | HuggingfaceResolve, record: SessionRecord,
                   owner: int | None) -> Decision:
        """A Hub request (issue 37, finding 2): its repository against the profile's `huggingface_repos`
        (not for `unrestricted`), and a publish only into a repository that no other manager owns (root
        and the daemon's uid reach every one; reading, resolve, is the allow-list's alone, as images are)."""
        uid, profile = record.uid, self.profile_for(record.uid, record.gid)
        action, repository = str(request.__struct_config__.tag), request.repository
        patterns = profile.rules.huggingface_repos
        try:
            if not profile.unrestricted and not any(fnmatch.fnmatchcase(repository, p) for p in patterns):
                raise _Refusal("huggingface-repos", "repository", repository, (
                    f"repository: {repository} matches none of the Hugging Face repositories profile {profile.name} "
                    f"allows ({', '.join(patterns) or 'none: set huggingface_repos'})"))
            if (isinstance(request, HuggingfacePublish) and owner is not None and owner != uid
                    and uid not in (0, os.geteuid())):
                raise _Refusal("huggingface-owner", "repository", repository, (
                    f"repository: {repository} belongs to another manager (its sessions published there first); "
                    "a manager publishes only to repositories that are its own or that no session published to"))
        except _Refusal as refusal:
            self._refuse(profile, uid, record.session, request.host, action, refusal)
        return self._admitted(profile, uid, record.session, request.host, action, None)

    def admit_probe(self, image: str, *, uid: int, gid: int, host_process: bool) -> Decision:
        """The control socket's `probe`: its image under the manager's profile; the probe then runs
        with `capabilities` (what CRIU's check and the CUDA probe need), never privileged."""
        profile = self.profile_for(uid, gid)
        rules = profile.rules
        try:
            if not profile.unrestricted and not host_process:
                _check_image(profile, "probe.image", image)
                if not rules.gpus:
                    raise _Refusal("gpus", "probe.device", "", f"probe.device: profile {profile.name} gives no GPUs")
                if rules.privileged == "refuse":
                    raise _Refusal("privileged", "probe", image, (
                        f"probe: the probe needs {', '.join(CAPSULE_CAPABILITIES)}, and profile {profile.name} "
                        "refuses privileged workloads"))
        except _Refusal as refusal:
            self._refuse(profile, uid, "", "", "probe", refusal)
        # The probe runs as the profile's own privileged workloads would, never on the host network: a
        # capabilities profile gets its capabilities; one whose `privileged` is the host's ([runtime]
        # privileged: unrestricted, or privileged = "host") gets that, because CRIU's whole `criu check`
        # needs a writable ns_last_pid, which a capability-only container lacks (measured on the H200).
        capabilities = None if profile.unrestricted else _grant(profile)
        return self._admitted(profile, uid, "", "", "probe", capabilities)

    def admit_session_labels(self, labels: dict[str, str], *, uid: int, gid: int, session: str) -> None:
        """session-open's manager labels, which the workloads of its cluster carry after admission:
        the same `provider_labels` rule as a workload's own labels (PolicyRefused; nothing opened)."""
        profile = self.profile_for(uid, gid)
        if profile.unrestricted or profile.rules.provider_labels:
            return
        for key in labels:
            if key.startswith(PROVIDER_LABEL_PREFIX):
                self._refuse(profile, uid, session, "", "session-open", _Refusal(
                    "provider-labels", f"labels.{key}", key,
                    f"labels.{key}: labels under {PROVIDER_LABEL_PREFIX} belong to the provider "
                    f"(profile {profile.name})"))

    def seccomp_unconfined(self, uid: int, gid: int) -> bool:
        """Whether the manager's profile lets its workloads (and its probes) run seccomp-unconfined."""
        profile = self.profile_for(uid, gid)
        return profile.unrestricted or profile.rules.seccomp_unconfined

    def build_remote_sources(self, uid: int, gid: int) -> bool:
        """Whether the manager's builds may have the engine fetch from the network (an ADD of a URL): the
        Dockerfile is checked at admission, its base images' ONBUILD triggers by the backend (issue 37)."""
        profile = self.profile_for(uid, gid)
        return profile.unrestricted or profile.rules.build_remote_sources

    # --- the rules ---------------------------------------------------------------------------

    def _check_request(self, profile: Profile, request: RuntimeRequest, *, local: bool) -> None:
        match request:
            case WorkloadRun(workload=spec):
                self._check_workload(profile, spec, local=local)
            case ImagePull(image=image) | ImagePush(image=image):
                _check_image(profile, "image", image)
            case ImageTag(source=source, target=target):
                _check_image(profile, "source", source)
                _check_image(profile, "target", target)
            case ImageBuildAction(build=build):
                _check_image(profile, "build.tag", build.tag)
                if not profile.rules.build_remote_sources:
                    _check_build_sources(profile, build.dockerfile)
            case _:
                pass  # inspect, remove, exec, logs, copy-from: ownership is the runtime's rule (dispatch)

    def _check_workload(self, profile: Profile, spec: WorkloadSpec, *, local: bool) -> None:
        rules, name = profile.rules, profile.name
        _check_image(profile, "workload.image", spec.image)
        if spec.privileged and rules.privileged == "refuse":
            raise _Refusal("privileged", "workload.privileged", "true",
                           f"workload.privileged: true is refused by profile {name}")
        if spec.seccomp_unconfined and not rules.seccomp_unconfined:
            raise _Refusal("seccomp", "workload.seccomp_unconfined", "true",
                           f"workload.seccomp_unconfined: true is refused by profile {name}")
        if spec.network == "host" and not rules.host_network:
            raise _Refusal("host-network", "workload.network", "host",
                           f"workload.network: host is refused by profile {name} (the host's network namespace)")
        if spec.gpus and not rules.gpus:
            raise _Refusal("gpus", "workload.gpus", ",".join(spec.gpus),
                           f"workload.gpus: {','.join(spec.gpus)}: profile {name} gives no GPUs")
        for index, device in enumerate(spec.devices):
            if device.source not in rules.devices:
                field = f"workload.devices[{index}].source"
                raise _Refusal("devices", field, device.source, (
                    f"{field}: {device.source} is not a device profile {name} allows "
                    f"({', '.join(rules.devices) or 'none'}; GPUs come through `gpus`)"))
        for key in spec.environment:
            if key in rules.denied_environment:
                raise _Refusal("environment", f"workload.environment.{key}", key, (
                    f"workload.environment.{key}: profile {name} refuses setting {key} "
                    "(it reaches host devices around `gpus`)" if key == "NVIDIA_VISIBLE_DEVICES" else
                    f"workload.environment.{key}: profile {name} refuses setting {key}"))
        for key in spec.labels:
            if key.startswith(PROVIDER_LABEL_PREFIX) and not rules.provider_labels:
                raise _Refusal("provider-labels", f"workload.labels.{key}", key, (
                    f"workload.labels.{key}: labels under {PROVIDER_LABEL_PREFIX} belong to the provider "
                    f"(profile {name})"))
        for index, mount in enumerate(spec.mounts):
            # CAP_SYS_ADMIN (a privileged capsule) can remount a read-only bind read-write.
            writable = not mount.read_only or spec.privileged
            self._check_mount(profile, f"workload.mounts[{index}].source", mount.source, local=local,
                              writable=writable)

    def _check_mount(self, profile: Profile, field: str, source: str, *, local: bool, writable: bool) -> None:
        name = profile.name
        roots = profile.rules.mount_roots
        if not any(source == root or source.startswith(root.rstrip("/") + "/") for root in roots):
            raise _Refusal("mount-roots", field, source, (
                f"{field}: {source} is outside the allowed roots of profile {name}"
                + ("" if roots else " (it allows no mounts)")))
        for path in (*SYSTEM_PATHS, *self._protected):
            if source == path or source.startswith(path + "/") or path.startswith(source.rstrip("/") + "/"):
                raise _Refusal("protected-paths", field, source, (
                    f"{field}: {source} is or contains {path}, which profile {name} never mounts"))
        if local and (problem := check_source(source, self._trusted) or (writable and _check_nosuid(source))):
            rule, detail = problem
            raise _Refusal(rule, field, source, f"{field}: {source} {detail} (profile {name})")

    # --- outcomes ------------------------------------------------------------------------------

    @staticmethod
    def _refuse(profile: Profile, uid: int, session: str, host: str, action: str, refusal: _Refusal) -> NoReturn:
        decision = Decision(manager_uid=uid, session=session, host=host, action=action, profile=profile.name,
                            admitted=False, rule=refusal.rule, field=refusal.field, value=refusal.value,
                            message=str(refusal))
        log.warning("admission", manager_uid=uid, session=session or None, host=host or None, action=action,
                    profile=profile.name, decision="refused", rule=refusal.rule, error=decision.message)
        raise PolicyRefused(decision)

    @staticmethod
    def _admitted(profile: Profile, uid: int, session: str, host: str, action: str,
                  capabilities: tuple[str, ...] | None) -> Decision:
        log.info("admission", manager_uid=uid, session=session or None, host=host or None, action=action,
                 profile=profile.name, decision="admitted", rule="unrestricted" if profile.unrestricted else "profile")
        return Decision(manager_uid=uid, session=session, host=host, action=action, profile=profile.name,
                        admitted=True, capabilities=capabilities)


def _grant(profile: Profile) -> tuple[str, ...] | None:
    """A restricted profile's grant: `privileged: true` realised as its capabilities (none where it refuses
    `privileged`), and the workload confined (coldsnap_runtime.backend._confine); None where the profile gives
    the host's privilege (`privileged = "host"`: [runtime] privileged, unconfined)."""
    match profile.rules.privileged:
        case "capabilities":
            return tuple(profile.rules.capabilities)
        case "refuse":
            return ()
        case _:
            return None


def _check_image(profile: Profile, field: str, image: str) -> None:
    patterns = profile.rules.images
    if not any(fnmatch.fnmatchcase(image, pattern) for pattern in patterns):
        raise _Refusal("images", field, image, (
            f"{field}: {image} matches none of the images profile {profile.name} allows ({', '.join(patterns)})"))


_REMOTE_WHY = {
    "url": "the engine fetches a URL itself, in the host's network namespace (the host's loopback included)",
    "git": "a git source is fetched over the network",
    "variable": "a build argument or an ENV could make it a URL the engine fetches",
}


def _check_build_sources(profile: Profile, dockerfile: bytes) -> None:
    """An ADD the engine would fetch from the network (issue 37, finding 4): the first one refuses."""
    for source in remote_sources(dockerfile.decode("utf-8", "replace")):
        field = f"build.dockerfile line {source.line}"
        raise _Refusal("build-remote-sources", field, source.source, (
            f"{field}: {source.instruction} {source.source}: {_REMOTE_WHY[source.why]}; profile {profile.name} "
            "refuses remote build sources (build_remote_sources; COPY files from the context instead)"))


def check_source(source: str, trusted: frozenset[int]) -> tuple[str, str] | None:
    """(rule, why) when dockerd, resolving `source` as root, could be led elsewhere than it reads now.

    Each component is opened relative to its parent with O_NOFOLLOW (a symbolic link anywhere is
    refused, so the text is the path). Nobody but a `trusted` uid may be able to rename or replace
    a component after this check: every directory above the source must be owned by a trusted uid
    and not writable by group or others, or be sticky (like /tmp) with the next component owned by
    a trusted uid. The source must exist (the engine would create a missing one as root) and be a
    directory or a regular file.
    """
    parts = [p for p in source.split("/") if p]
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent = os.fstat(fd)
        walked = ""
        for part in parts:
            walked += "/" + part
            try:
                child = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                return "mount-missing", "does not exist (the engine would create it as root)"
            except OSError as exc:
                if exc.errno == errno.ENOTDIR:
                    return "mount-kind", f"passes through {walked.rsplit('/', 1)[0]}, which is not a directory"
                return "mount-missing", f"cannot be checked: {walked}: {exc.strerror}"
            info = os.fstat(child)
            os.close(fd)
            fd = child
            if stat.S_ISLNK(info.st_mode):
                return "mount-symlink", f"passes through {walked}, a symbolic link the engine would follow as root"
            if not _fixed(parent, info, trusted):
                where = walked.rsplit("/", 1)[0] or "/"
                return "mount-writable", (
                    f"lies in {where}, which uid {parent.st_uid} (mode {stat.S_IMODE(parent.st_mode):04o}) could "
                    "change after this check; every directory above a mount source must be writable only by root")
            parent = info
        if not (stat.S_ISDIR(parent.st_mode) or stat.S_ISREG(parent.st_mode)):
            return "mount-kind", "is neither a directory nor a regular file"
        return None
    finally:
        os.close(fd)


def _check_nosuid(source: str) -> tuple[str, str] | None:
    """(rule, why) when a capsule writing `source` as root could hand its manager host root.

    The capsule is uid 0 without a user namespace: in a writable mount it can leave a setuid-root
    program or a device node (CAP_FOWNER, CAP_MKNOD are the engine's defaults) that the manager,
    who can reach the directory on the host, then runs or opens there. Only a filesystem mounted
    ``nosuid,nodev`` on the host makes both inert. Called after :func:`check_source` admitted it,
    so `source` holds no symbolic link and cannot be swapped.
    """
    flags = os.statvfs(source).f_flag
    missing = [opt for opt, bit in (("nosuid", os.ST_NOSUID), ("nodev", os.ST_NODEV)) if not flags & bit]
    if not missing:
        return None
    return "mount-nosuid", (
        f"lies on a filesystem mounted without {','.join(missing)}: a capsule writing there as root could leave a "
        "setuid program or a device node its manager runs on the host; mount the root nosuid,nodev, "
        "or mount the source read_only in a workload that is not privileged")


def _fixed(directory: os.stat_result, entry: os.stat_result, trusted: frozenset[int]) -> bool:
    """Whether only a trusted uid can rename or replace `entry` inside `directory`."""
    if directory.st_uid not in trusted:
        return False
    if not directory.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return True
    # Sticky (e.g. /tmp): only the entry's owner (or the directory's) may rename or remove it.
    return bool(directory.st_mode & stat.S_ISVTX) and entry.st_uid in trusted

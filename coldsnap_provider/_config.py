"""Configuration: one frozen Struct decoded strictly from TOML (unknown keys are errors)."""

from __future__ import annotations

import os
import pwd
import socket
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from ._errors import ConfigError

__all__ = ("BUILTIN_PROFILES", "CAPSULE_CAPABILITIES", "Config", "ConfigError", "KubernetesConfig", "MetricsConfig",
           "PolicyConfig", "ProfileConfig", "RemoteConfig", "checked_config", "default_state_dir", "load_config",
           "local_host_label", "node_names", "spool_dir")


class _Section(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ServerConfig(_Section, frozen=True):
    state_dir: str = ""
    control_group: str = ""
    control_uids: list[Annotated[int, Meta(ge=0)]] = []
    control_gids: list[Annotated[int, Meta(ge=0)]] = []
    max_connections: Annotated[int, Meta(ge=1)] = 512
    max_connections_per_uid: Annotated[int, Meta(ge=1)] = 128
    max_buffered_bytes: Annotated[int, Meta(ge=1 << 20)] = 512 << 20
    max_buffered_bytes_per_uid: Annotated[int, Meta(ge=1 << 20)] = 160 << 20
    max_sessions_per_uid: Annotated[int, Meta(ge=1)] = 64
    request_read_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    reply_write_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    shutdown_grace_s: Annotated[float, Meta(ge=0)] = 60.0
    # "" = serve's --log-level (default info); set, it wins, and SIGHUP applies a change (_reload.py).
    log_level: Literal["", "debug", "info", "warning", "error"] = ""


class ProviderConfig(_Section, frozen=True):
    name: Annotated[str, Meta(min_length=1, pattern=r"^[^\r\n\x00]+$")] = "coldsnap-provider"


class NodeConfig(_Section, frozen=True):
    names: list[Annotated[str, Meta(min_length=1)]] = []


class ExecConfig(_Section, frozen=True):
    user: str = ""


class DockerConfig(_Section, frozen=True):
    url: Annotated[str, Meta(min_length=1)] = "unix:///var/run/docker.sock"
    # Where copies and build contexts are spooled, on disk ("" = /var/tmp); never the state directory.
    spool_dir: Annotated[str, Meta(pattern=r"^(?:/[^\x00]*)?\Z")] = ""
    # The most bytes one copy may spool (its tar's size: a sparse file counts in full).
    copy_max_bytes: Annotated[int, Meta(ge=1 << 20)] = 32 << 30
    # The node's capture store (coldsnap_runtime/store.py): capsules' capture data as chunks ("" = none).
    capture_store: Annotated[str, Meta(pattern=r"^(?:/[^\x00]*)?\Z")] = ""


class RegistryConfig(_Section, frozen=True):
    credentials_file: str = ""
    pull: bool = True
    push: bool = True


class HuggingfaceConfig(_Section, frozen=True):
    token_file: Annotated[str, Meta(pattern=r"^(?:/[^\x00]*)?\Z")] = ""
    endpoint: Annotated[str, Meta(pattern=r"^https?://[^\s/?#]+(?:/[^\s?#]*)?\Z")] = "https://huggingface.co"
    request_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    operation_timeout_s: Annotated[float, Meta(gt=0)] = 3600.0


class GpusConfig(_Section, frozen=True):
    """How `gpus` reaches containers (coldsnap_runtime/backend/_gpus.py; README "GPUs")."""

    mode: Literal["auto", "device-request", "cdi", "native"] = "auto"
    # Native mode: host paths of the driver's user-space files, bound read-only ([] = discover).
    driver_paths: list[Annotated[str, Meta(pattern=r"^/[^:\x00]*$")]] = []
    # One managed workload per GPU at a time (false: shared, as Docker itself allows).
    exclusive: bool = False


class RuntimeConfig(_Section, frozen=True):
    """`privileged` where the engine cannot grant every capability (README "GPUs")."""

    privileged: Literal["docker", "host-capabilities"] = "docker"


_ABSOLUTE = r"^/[^\x00]*$"

# host:port ([v6]:port) or unix:/absolute/path; the port's range is checked in load_config.
_METRICS_ADDRESS = r"^(?:unix:/[^\x00]*|(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5})?\Z"


class MetricsConfig(_Section, frozen=True):
    """The Prometheus endpoint and the capsule reports that feed it (docs/metrics.md)."""

    # "" = no endpoint (and no capsule reports).
    address: Annotated[str, Meta(pattern=_METRICS_ADDRESS)] = ""
    # Give each local workload-run a report directory its in-capsule worker writes phase timings to.
    capsule_reports: bool = True
    # How often every backend is asked whether it answers (coldsnap_provider_backend_up; `status` asks too).
    backend_probe_interval_s: Annotated[float, Meta(ge=1)] = 15.0
    # The node hydrators whose own stage counts feed coldsnap_provider_hydrator_stage_*_total, asked for their
    # status every backend_probe_interval_s (their sockets: `python -m coldsnap_probe.hydration serve --socket`).
    hydrator_sockets: Annotated[list[Annotated[str, Meta(pattern=_ABSOLUTE)]], Meta(max_length=16)] = []


class AuditConfig(_Section, frozen=True):
    """The audit trail (docs/metrics.md): always to the log (the journal under systemd); also to `file`."""

    file: Annotated[str, Meta(pattern=r"^(?:/[^\x00]*)?\Z")] = ""


class RemoteConfig(_Section, frozen=True, kw_only=True):
    """One `[[remote]]` node reached over SSH (docs: README.md, "Remote hosts")."""

    hosts: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)]
    address: Annotated[str, Meta(min_length=1, pattern=r"^[^\s\x00]+$")]
    port: Annotated[int, Meta(ge=1, le=65535)] = 22
    user: Annotated[str, Meta(min_length=1, pattern=r"^[^\s\x00@:]+$")]
    identity_file: Annotated[str, Meta(pattern=_ABSOLUTE)]
    known_hosts: Annotated[str, Meta(pattern=_ABSOLUTE)]
    docker_socket: Annotated[str, Meta(pattern=_ABSOLUTE)] = "/var/run/docker.sock"
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    keepalive_interval_s: Annotated[float, Meta(gt=0)] = 15.0
    max_sessions: Annotated[int, Meta(ge=1)] = 10  # the remote sshd's MaxSessions (OpenSSH default 10)
    # Registries whose credentials ([registry] credentials_file) may be sent to this node's engine.
    registries: list[Annotated[str, Meta(min_length=1, pattern=r"^[^\s/\x00]+$")]] = []


# A DNS-1123 label (a namespace) and subdomain (a Node name), as the apiserver checks them.
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
_HOST = Annotated[str, Meta(min_length=1)]


class KubernetesConfig(_Section, frozen=True, kw_only=True):
    """One `[[kubernetes]]` cluster; each host one of its Nodes (docs/kubernetes.md)."""

    hosts: Annotated[list[_HOST], Meta(min_length=1)]
    kubeconfig: Annotated[str, Meta(pattern=_ABSOLUTE)]
    namespace: Annotated[str, Meta(pattern=_DNS_LABEL)] = "coldsnap"
    # host -> Node name, for a Node whose name is not the host name.
    node_names: dict[_HOST, Annotated[str, Meta(pattern=_DNS_SUBDOMAIN)]] = {}
    # Every apiserver call; an apiserver that is down or slow fails within this bound.
    request_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # A detached workload-run whose container has not started by then is deleted and fails.
    start_timeout_s: Annotated[float, Meta(gt=0)] = 120.0

    def node(self, host: str) -> str:
        return self.node_names.get(host, host)


# What CRIU and CUDA checkpoint need inside a capsule, and no more (seen on the H200 machine,
# /work/shared/device/README.md): CRIU's dump and restore (SYS_ADMIN, SYS_PTRACE, NET_ADMIN, SYS_CHROOT)
# and its monotonic clock offset on restore (SYS_TIME, through a time namespace; the calls that set the
# host's clock are refused by the capsule seccomp profile). Not DAC_READ_SEARCH: it is what
# open_by_handle_at checks, which opens any file of a filesystem the container has a file of (issue 37).
CAPSULE_CAPABILITIES = ("SYS_ADMIN", "SYS_PTRACE", "NET_ADMIN", "SYS_CHROOT", "SYS_TIME")
# Built-in profile names: an administrator defines profiles of other names.
BUILTIN_PROFILES = ("unrestricted", "capsule")
_PROFILE_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
_CAPABILITY = r"^[A-Z][A-Z0-9_]*$"


class ProfileConfig(_Section, frozen=True):
    """One admission profile, ``[policy.profiles.NAME]``; every default is the built-in `capsule`'s
    (docs/policy.md). An empty table is therefore the capsule profile."""

    # Image references a workload, pull, push, tag or build may name (fnmatch patterns; "*" = any).
    images: list[Annotated[str, Meta(min_length=1, pattern=r"^[^\s\x00]+$")]] = msgspec.field(
        default_factory=lambda: ["*"])
    # Host directories under which mount sources may lie ([] = no mounts).
    mount_roots: list[Annotated[str, Meta(pattern=_ABSOLUTE)]] = []
    # Host device nodes `devices` may name (exact paths); GPUs come through `gpus`.
    devices: list[Annotated[str, Meta(pattern=_ABSOLUTE)]] = []
    gpus: bool = True
    # `privileged: true` is refused, realised as exactly `capabilities`, or as [runtime] privileged says.
    privileged: Literal["refuse", "capabilities", "host"] = "capabilities"
    capabilities: list[Annotated[str, Meta(pattern=_CAPABILITY)]] = msgspec.field(
        default_factory=lambda: list(CAPSULE_CAPABILITIES))
    seccomp_unconfined: bool = True
    host_network: bool = False
    # Environment names a workload may not set (NVIDIA_VISIBLE_DEVICES reaches GPUs around `gpus`).
    denied_environment: list[Annotated[str, Meta(min_length=1)]] = msgspec.field(
        default_factory=lambda: ["NVIDIA_VISIBLE_DEVICES"])
    # Whether a workload may carry labels under io.coldsnap-provider. (the provider's own).
    provider_labels: bool = False
    # Whether exec, upload, Hugging Face, workload-copy-from and image-build contexts may run on [[remote]]
    # nodes, where they run as the SSH user, who holds that node's engine socket: root there.
    remote_ssh_user: bool = False
    # Hugging Face repositories (`namespace/name`, fnmatch patterns) huggingface-publish and -resolve may
    # name. [] = none: the daemon publishes with the node's one token, which may write far more than a
    # manager's own repositories, so an administrator names those (docs/policy.md, "Hugging Face").
    huggingface_repos: list[Annotated[str, Meta(min_length=1, pattern=r"^[^\s\x00]+$")]] = []
    # Whether image-build may name sources the engine fetches itself (ADD of a URL): it fetches them
    # in the host's network namespace, where the host's loopback services answer.
    build_remote_sources: bool = False


class AssignConfig(_Section, frozen=True, kw_only=True):
    """``[[policy.assign]]``: the profile of managers with one of these uids or (primary) gids."""

    uids: list[Annotated[int, Meta(ge=0)]] = []
    gids: list[Annotated[int, Meta(ge=0)]] = []
    profile: Annotated[str, Meta(pattern=_PROFILE_NAME)]


class PolicyConfig(_Section, frozen=True):
    """``[policy]``: which admission profile each manager's sessions get (docs/policy.md)."""

    # Root and the daemon's own uid.
    admin: Annotated[str, Meta(pattern=_PROFILE_NAME)] = "unrestricted"
    # Every other manager not matched by an [[policy.assign]] entry.
    managers: Annotated[str, Meta(pattern=_PROFILE_NAME)] = "capsule"
    assign: list[AssignConfig] = []
    profiles: dict[Annotated[str, Meta(pattern=_PROFILE_NAME)], ProfileConfig] = {}


class Config(_Section, frozen=True):
    server: ServerConfig = ServerConfig()
    provider: ProviderConfig = ProviderConfig()
    node: NodeConfig = NodeConfig()
    exec: ExecConfig = ExecConfig()
    docker: DockerConfig = DockerConfig()
    registry: RegistryConfig = RegistryConfig()
    remote: list[RemoteConfig] = []
    kubernetes: list[KubernetesConfig] = []
    gpus: GpusConfig = GpusConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    huggingface: HuggingfaceConfig = HuggingfaceConfig()
    policy: PolicyConfig = PolicyConfig()
    metrics: MetricsConfig = MetricsConfig()
    audit: AuditConfig = AuditConfig()


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Decode `path`, or the embedded default when None."""
    if path is None:
        data = resources.files("coldsnap_provider").joinpath("default-config.toml").read_bytes()
        source = "<embedded default>"
    else:
        source = os.fspath(path)
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"{source}: {exc.strerror}") from exc
    try:
        config = msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from exc
    for check in (_remote_problem, _kubernetes_problem, _policy_problem, _exec_problem, _metrics_problem):
        if problem := check(config):
            raise ConfigError(f"{source}: {problem}")
    return config


_FORBIDDEN_ROOTS = ("/", "/etc", "/proc", "/sys", "/dev", "/run", "/var/run", "/boot")


def _policy_problem(config: Config) -> str:
    """Profiles named by [policy] exist; built-ins are not redefined; no root exposes the host."""
    policy = config.policy
    for name in policy.profiles:
        if name in BUILTIN_PROFILES:
            return f"policy.profiles.{name}: {name!r} is a built-in profile; define a profile of another name"
    known = set(BUILTIN_PROFILES) | set(policy.profiles)
    named = [("policy.admin", policy.admin), ("policy.managers", policy.managers),
             *((f"policy.assign[{i}].profile", a.profile) for i, a in enumerate(policy.assign))]
    for key, name in named:
        if name not in known:
            return f"{key}: no profile {name!r} (profiles: {', '.join(sorted(known))})"
    for index, entry in enumerate(policy.assign):
        if not entry.uids and not entry.gids:
            return f"policy.assign[{index}]: names no uids and no gids, so it matches nobody"
    for name, profile in policy.profiles.items():
        for index, root in enumerate(profile.mount_roots):
            normal = os.path.normpath(root)
            exposed = any(normal == f or (f != "/" and normal.startswith(f + "/")) for f in _FORBIDDEN_ROOTS)
            if normal != root or exposed:
                return (f"policy.profiles.{name}.mount_roots[{index}]: {root!r} must be a normalised path outside "
                        f"{', '.join(_FORBIDDEN_ROOTS)}")
    return ""


def _exec_problem(config: Config) -> str:
    """Managers who are not root must never get exec as the daemon (issue 24, finding 9)."""
    if not (config.server.control_uids or config.server.control_gids):
        return ""
    user = config.exec.user.partition(":")[0]
    if not user or _uid_of(user) == 0:
        return ("exec.user must name an unprivileged account when server.control_uids or server.control_gids "
                f"admit non-root managers (it is {config.exec.user!r}, which runs their exec and upload as "
                f"{'the daemon' if not user else 'root'})")
    return ""


def _metrics_problem(config: Config) -> str:
    address = config.metrics.address
    if address and not address.startswith("unix:") and not 1 <= int(address.rpartition(":")[2]) <= 65535:
        return f"metrics.address {address!r}: the port must be 1-65535"
    sockets = config.metrics.hydrator_sockets
    if twice := next((path for index, path in enumerate(sockets) if path in sockets[:index]), None):
        return f"metrics.hydrator_sockets lists {twice!r} twice (its stages would be counted twice)"
    return ""


def _listed_once(section: str, entries: list[list[str]], local: frozenset[str]) -> str:
    """Every host of `section`'s entries is listed once across them, and is not also served locally."""
    seen: dict[str, int] = {}
    for index, hosts in enumerate(entries):
        where = f"{section}[{index}]"
        for host in hosts:
            if host in local:
                return f"{where}: host {host!r} is also served locally (node.names); list it once"
            if host in seen:
                other = "the same entry" if seen[host] == index else f"{section}[{seen[host]}]"
                return f"{where}: host {host!r} is already listed by {other}; list it once"
            seen[host] = index
    return ""


def _remote_problem(config: Config) -> str:
    """Rules spanning entries: every host is served exactly once (locally or by one remote)."""
    return _listed_once("remote", [remote.hosts for remote in config.remote], node_names(config))


def _kubernetes_problem(config: Config) -> str:
    """Each host's runtime is served once: locally, by one [[remote]] or by one [[kubernetes]] entry.

    A host may be both a [[kubernetes]] Node and a [[remote]] entry: the cluster runs its workloads and
    the SSH connection carries its node-local operations (exec, upload, copy-from destinations).
    """
    if problem := _listed_once("kubernetes", [cluster.hosts for cluster in config.kubernetes], node_names(config)):
        return problem
    for index, cluster in enumerate(config.kubernetes):
        where = f"kubernetes[{index}]"
        for host in cluster.node_names:
            if host not in cluster.hosts:
                return f"{where}.node_names: {host!r} is not one of this entry's hosts"
        nodes = [cluster.node(h) for h in cluster.hosts]
        if len(set(nodes)) != len(nodes):
            return f"{where}: two hosts name the same Node; each host is one Node"
    return ""


def _uid_of(user: str) -> int | None:
    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None  # resolve_identity names the unknown user at start-up


def default_state_dir(uid: int | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """/run/coldsnap-provider for root; else $XDG_RUNTIME_DIR/coldsnap-provider, else /tmp/coldsnap-provider-<uid>."""
    uid = os.geteuid() if uid is None else uid
    environ = os.environ if environ is None else environ
    if uid == 0:
        return Path("/run/coldsnap-provider")
    runtime_dir = environ.get("XDG_RUNTIME_DIR", "")
    if runtime_dir and os.path.isabs(runtime_dir) and os.path.isdir(runtime_dir):
        return Path(runtime_dir) / "coldsnap-provider"
    return Path(f"/tmp/coldsnap-provider-{uid}")


def checked_config(path: str | None) -> Config:
    """`path` (None: the embedded default) loaded, with what only this host can say checked too: exec.user,
    the spool directory, each kubeconfig as the backend loads it (check-config, serve and SIGHUP all check these)."""
    from ._exec import resolve_identity  # setpriv and capabilities: not needed to decode a file

    config = load_config(path)
    try:
        resolve_identity(config.exec.user)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not os.path.isdir(spool_dir(config)):
        raise ConfigError(f"docker.spool_dir: {spool_dir(config)} is not a directory")
    from ._config_files import kubeconfig_problems  # the Kubernetes client: only for a config that names one

    # What the backend would die of at start, said in one line.
    if problems := kubeconfig_problems([cluster.kubeconfig for cluster in config.kubernetes]):
        raise ConfigError(problems[0])
    return config


def spool_dir(config: Config) -> str:
    """Where the daemon spools copies and build contexts: on disk, not the (tmpfs) state directory."""
    return config.docker.spool_dir or "/var/tmp"


def local_host_label(config: Config) -> str:
    """The host name the local Docker Engine's health is reported under: the first of node.names, else this
    machine's name (configuration, never a request: a bounded metric label)."""
    return config.node.names[0] if config.node.names else socket.gethostname()


def node_names(config: Config) -> frozenset[str]:
    if config.node.names:
        return frozenset(config.node.names)
    return frozenset({socket.gethostname(), socket.getfqdn(), "localhost"})

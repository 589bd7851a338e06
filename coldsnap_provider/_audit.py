"""The audit trail: one event per privileged or state-changing action, naming who did what, where.

Each event is one log line (``"event": "audit"``, the fields under ``audit``: JSON on stderr,
which is what the journal takes under systemd) and, with ``[audit] file`` set, one JSON line
appended to that file. Events never carry a token, input bytes, exec arguments or environment
values (docs/metrics.md lists every field). A file that cannot be written costs an error line,
never the request. SIGHUP reopens the file (logrotate's ``postrotate``: systemd/coldsnap-provider.logrotate).
"""

from __future__ import annotations

import os
import stat
from typing import Any

import msgspec
import structlog

from coldsnap_runtime.errors import ColdsnapError
from coldsnap_runtime.schema import (
    ImageBuildAction,
    ImagePull,
    ImagePush,
    ImageRemove,
    ImageTag,
    RuntimeRequest,
    WorkloadCopyFrom,
    WorkloadExec,
    WorkloadRemove,
    WorkloadRun,
)

from ._errors import ConfigError
from ._logging import outcome_level

__all__ = ("AUDITED_CONTROL", "Audit", "AuditEvent", "audited_action", "loggable", "runtime_target")

log = structlog.get_logger(__name__)

# Control-socket operations that change state or run something on the node.
AUDITED_CONTROL = frozenset({"session-open", "session-close", "workload-stop", "workload-remove", "probe", "reload",
                             "capture-remove", "capture-gc"})
# Provider operations that only read (inspect, logs, resolve, capabilities) are not audited...
_READ_ONLY_OPERATIONS = frozenset({"capabilities", "huggingface-resolve"})
_READ_ONLY_ACTIONS = frozenset({"image-inspect", "workload-inspect", "workload-logs"})


def audited_action(operation: str, action: str) -> bool:
    """...unless they were refused before they ran (an unauthorized attempt is worth recording too)."""
    return operation not in _READ_ONLY_OPERATIONS and action not in _READ_ONLY_ACTIONS


def loggable(error: BaseException) -> str:
    """An error's text as a log line and the audit trail may carry it: never a program's output
    (``CommandFailed.loggable``: its status, length and digest), whatever the reply carries."""
    return error.loggable() if isinstance(error, ColdsnapError) else str(error) or type(error).__name__


def runtime_target(request: RuntimeRequest) -> str:
    """The workload or image a runtime action acts on (names, never paths' contents or environment)."""
    match request:
        case WorkloadRun(workload=spec):
            return f"{spec.name or '(anonymous)'} image={spec.image}"
        case WorkloadRemove(name=name) | WorkloadExec(name=name) | WorkloadCopyFrom(name=name):
            return name
        case ImagePull(image=image) | ImagePush(image=image) | ImageRemove(image=image):
            return image
        case ImageTag(source=source, target=target):
            return f"{source} -> {target}"
        case ImageBuildAction(build=build):
            return build.tag
    return ""


class AuditEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One audited action. Field by field in docs/metrics.md ("Audit trail")."""

    time: float  # unix seconds, when the answer was sent
    socket: str  # "session" or "control"
    operation: str  # the envelope's or the control request's `operation`
    action: str = ""  # the runtime-v1 action, for operation "runtime"
    outcome: str  # "ok", the wire error_code, "rejected" (refused before it ran), "internal",
    # "client-gone" (it hung up before the reply) or "cancelled" (the daemon stopped it)
    uid: int | None  # the manager: the session's owner (session socket) or the peer (control socket)
    peer_uid: int | None = None  # the connected process (SO_PEERCRED); differs from uid only for root
    peer_pid: int | None = None
    session: str = ""
    host: str = ""
    request_id: str = ""
    target: str = ""  # the workload, image, destination or session acted on
    decision: str = ""  # the admission policy's decision for workload-run ("admitted", "refused")
    profile: str = ""  # the policy profile that decided
    error: str = ""  # the reply's error text when outcome is not ok
    duration_ms: float = 0.0


_encode = msgspec.json.Encoder().encode


class Audit:
    """Where audit events go; owned by the daemon, which closes it last."""

    def __init__(self, path: str = "") -> None:
        self.path = path
        self._fd = _open_append(path) if path else None

    def record(self, event: AuditEvent) -> None:
        fields: dict[str, Any] = msgspec.to_builtins(event)
        log.log(outcome_level(event.outcome), "audit", audit=fields)  # failed actions reach `journalctl -p err`
        if self._fd is None:
            return
        try:
            os.write(self._fd, _encode(event) + b"\n")  # one write: O_APPEND keeps lines whole
        except OSError as exc:
            log.error("audit file write failed", error=f"{self.path}: {exc.strerror}")

    def reopen(self, path: str) -> None:
        """Write to `path` from now on, opened anew (SIGHUP: after logrotate renamed the file away, events go to
        a new file there). The new file is opened before the old one is closed: a path that cannot be opened
        raises ConfigError and changes nothing; no event is written in between (one thread)."""
        fd = _open_append(path) if path else None
        old, self._fd, self.path = self._fd, fd, path
        if old is not None:
            os.close(old)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _open_append(path: str) -> int:
    """Open (or create 0600) the audit file for appending, never through a symlink, never a non-file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o600)
    except OSError as exc:
        raise ConfigError(f"audit.file {path!r}: cannot open: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"audit.file {path!r}: not a regular file")
        if info.st_uid != os.geteuid():
            raise ConfigError(f"audit.file {path!r}: owned by uid {info.st_uid}, not this daemon's")
        if stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)  # an existing file readable by others is tightened, not trusted
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd

"""Structured logging: JSON lines on stderr, each at its priority; the keys a request line may carry.

Under systemd, stderr is a journald stream (``JOURNAL_STREAM`` names it): each line then starts with the
syslog priority as ``<N>``, which journald's stream parser takes as the entry's PRIORITY (the unit's
``SyslogLevelPrefix=`` defaults to yes) and strips, so ``journalctl -p err`` shows failed actions and
``-p warning`` refusals too. The level is a threshold applied per event, so SIGHUP can change it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

__all__ = ("ADMISSION_KEYS", "REQUEST_KEYS", "at_least_info", "configure_logging", "journal_stream",
           "outcome_level", "set_log_level")

# Never tokens, stdin bytes or environment values: only these keys describe a request.
REQUEST_KEYS = (
    "session",
    "request_id",
    "operation",
    "action",
    "host",
    "ok",
    "error_code",
    "error",
    "duration_ms",
    "outcome",  # ok, the error code, rejected, internal, client-gone or cancelled (docs/metrics.md)
    "profile",  # the admission profile that admitted or refused a runtime action (_policy.py)
)

# The one `admission` event per decision of the runtime admission policy (_policy.py).
ADMISSION_KEYS = ("manager_uid", "session", "host", "action", "profile", "decision", "rule", "error")

# syslog(3) priorities, as sd-daemon(3)'s prefixes carry them.
_PRIORITY = {"critical": 2, "error": 3, "exception": 3, "warning": 4, "info": 6, "debug": 7}
_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "exception": logging.ERROR,
           "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}
# Outcomes that are the peer's doing or the daemon's decision, not a failure on the node: warning. (A controller
# inspects workloads that may be gone: not_found is routine, not an incident.)
_REFUSED = frozenset({"rejected", "client-gone", "cancelled", "not_found", "path_not_found"})


def outcome_level(outcome: str) -> int:
    """The level of a request's line and audit event: ok at info, a refusal at warning (the request was
    malformed, unauthorised, refused by the policy, named nothing there, or its client left), a failed action
    (runtime_failed, internal) at error."""
    if outcome == "ok":
        return logging.INFO
    return logging.WARNING if outcome in _REFUSED else logging.ERROR


class _Threshold:
    """The level below which events are dropped; set at start and by SIGHUP."""

    level = logging.INFO

    def __call__(self, logger: object, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if _LEVELS.get(method, logging.ERROR) < self.level:
            raise structlog.DropEvent
        return event


class _Render:
    """One JSON line; with the journal's `<N>` prefix when stderr is the journal's stream."""

    def __init__(self, journal: bool) -> None:
        self._json = structlog.processors.JSONRenderer()
        self._journal = journal

    def __call__(self, logger: object, method: str, event: MutableMapping[str, Any]) -> str:
        rendered = self._json(logger, method, event)  # json.dumps: str
        line = rendered.decode() if isinstance(rendered, bytes) else rendered
        return f"<{_PRIORITY.get(event.get('level', ''), 6)}>{line}" if self._journal else line


class _PrefixFormatter(logging.Formatter):
    """Lines of libraries that log through `logging` (asyncssh...) carry their priority too."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelname.lower(), 6)}>{super().format(record)}"


_threshold = _Threshold()


def journal_stream(environ: Mapping[str, str] = os.environ, fd: int = 2) -> bool:
    """Whether `fd` is the journal stream systemd connected (systemd.exec(5): JOURNAL_STREAM is
    ``device:inode`` of it; a child whose stderr was redirected inherits the variable, not the stream)."""
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        info = os.fstat(fd)
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == (int(device), int(inode))


def set_log_level(level: str) -> None:
    """Apply `level` (debug, info, warning, error) to every logger from now on."""
    _threshold.level = _LEVELS[level.lower()]
    logging.getLogger().setLevel(_threshold.level)


def at_least_info() -> None:
    """Let info events through until the next set_log_level (a reload's report, whatever the level was)."""
    _threshold.level = min(_threshold.level, logging.INFO)


def configure_logging(level: str = "info") -> None:
    """Only the CLI calls this; library code just asks structlog for a logger."""
    journal = journal_stream()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_PrefixFormatter("%(message)s") if journal else logging.Formatter("%(message)s"))
    logging.basicConfig(handlers=[handler])
    set_log_level(level)
    structlog.configure(
        processors=[
            _threshold,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _Render(journal),
        ],
        # Every level reaches the processors; _threshold decides, so that SIGHUP can change it.
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

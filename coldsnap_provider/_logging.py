"""Structured logging: JSON lines on stderr; the keys a request line may carry."""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ("ADMISSION_KEYS", "REQUEST_KEYS", "configure_logging")

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


def configure_logging(level: str = "info") -> None:
    """Only the CLI calls this; library code just asks structlog for a logger."""
    logging.basicConfig(format="%(message)s", stream=sys.stderr, level=level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )

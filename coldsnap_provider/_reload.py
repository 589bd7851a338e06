"""SIGHUP: reload what can change without a restart, report what cannot.

Reloaded: ``[policy]`` (sessions stay open; their next requests are admitted under the new profiles),
``server.log_level``, and the audit file (always closed and opened again, so that logrotate's
``postrotate`` can move the old file away). Every other key is reported as needing a restart and keeps
its running value. A file that fails to load or to pass check-config's checks changes nothing: one error
line names the key and the rule, and the daemon serves on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from ._config import Config, checked_config
from ._errors import ConfigError
from ._logging import at_least_info, set_log_level

if TYPE_CHECKING:
    from ._daemon import Daemon
    from ._policy import Policy

__all__ = ("Reloader", "changed_keys")

log = structlog.get_logger(__name__)

# What a reload applies: whole sections, or section.key.
_RELOADABLE = ("policy", "audit.file", "server.log_level")


def changed_keys(running: Config, loaded: Config) -> list[str]:
    """The keys whose values differ, as ``section.key`` (a list section such as ``remote``: the section)."""
    old: dict[str, Any] = msgspec.to_builtins(running)
    new: dict[str, Any] = msgspec.to_builtins(loaded)
    keys: list[str] = []
    for section in sorted(old.keys() | new.keys()):
        before, after = old.get(section), new.get(section)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            keys += [f"{section}.{key}" for key in sorted(before.keys() | after.keys())
                     if before.get(key) != after.get(key)]
        else:
            keys.append(section)
    return keys


def _reloadable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in _RELOADABLE)


class Reloader:
    """Applies the configuration file to a running daemon (serve's SIGHUP)."""

    def __init__(self, path: str | None, daemon: Daemon, *, log_level: str,
                 policy: Callable[[Config], Policy]) -> None:
        self._path = path  # None: the embedded default
        self._daemon = daemon
        self._flag_level = log_level  # serve --log-level: the level while server.log_level is ""
        self._policy = policy

    def reload(self) -> dict[str, list[str]]:
        """Load, check, then apply all or nothing; one log line says which, and the answer (for the control
        socket's `reload`) too. ConfigError, naming the key and the rule, when nothing changed."""
        running = self._daemon.config
        try:
            loaded = checked_config(self._path)
            applied = msgspec.structs.replace(
                running, policy=loaded.policy, audit=loaded.audit,
                server=msgspec.structs.replace(running.server, log_level=loaded.server.log_level))
            policy = self._policy(applied)
            self._daemon.audit.reopen(loaded.audit.file)  # the last step that can fail
        except ConfigError as exc:
            log.error("reload refused; nothing changed", error=str(exc))
            raise
        self._daemon.operations.policy = policy
        self._daemon.config = applied
        changed = changed_keys(running, loaded)
        report = {"changed": [k for k in changed if _reloadable(k)],
                  "needs_restart": [k for k in changed if not _reloadable(k)]}
        at_least_info()  # the report shows whichever way the level moves
        log.info("reloaded", **report, audit_file=loaded.audit.file or None)
        set_log_level(loaded.server.log_level or self._flag_level)
        return report

"""The daemon as the shipped systemd unit runs it, for tests on a machine without systemd as PID 1.

The settings are read from ``systemd/coldsnap-provider.service`` itself, so a change to the unit
changes what the tests run under; the account is created from the shipped sysusers.d file with
``systemd-sysusers``. What is reproduced (see ``tests/_unit_launch.py`` for how):

* ``User=``, ``Group=``, ``SupplementaryGroups=``, ``AmbientCapabilities=``, ``CapabilityBoundingSet=``,
  ``NoNewPrivileges=`` (explicit, or implied as systemd implies it for ``RestrictAddressFamilies=``
  with ``User=``), ``UMask=``;
* ``RestrictAddressFamilies=`` as a seccomp filter on ``socket(2)`` answering EAFNOSUPPORT;
* ``ProtectSystem=`` and ``ProtectHome=`` (``no``/``read-only``; any other value is refused
  here rather than approximated) as read-only bind mounts in a private mount namespace;
* ``RuntimeDirectory=``/``RuntimeDirectoryMode=``: the test's state directory is given to the
  account with that mode, and ``$HOME`` points to it (the account's home is the runtime directory).

Not reproduced: ``ProtectKernelTunables/Modules/Logs``, ``ProtectControlGroups``, ``ProtectClock``,
``ProtectHostname``, ``RestrictRealtime``, ``RestrictSUIDSGID``, ``LockPersonality``,
``SystemCallArchitectures`` and the cgroup. None of them is on the path of exec, upload,
copies, SSH or HTTPS; ``docs/systemd.md`` says so too.

``COLDSNAP_TEST_UNIT=1`` runs every test daemon (:func:`tests.helpers.running_daemon`) this way.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "coldsnap-provider.service"
SYSUSERS = ROOT / "systemd" / "coldsnap-provider.sysusers.conf"
_LAUNCH = Path(__file__).with_name("_unit_launch.py")
_PROTECT_SYSTEM = {"no": [], "yes": ["/usr", "/boot", "/efi"], "full": ["/usr", "/boot", "/efi", "/etc"],
                   "strict": ["/"]}
_PROTECT_HOME = {"no": [], "read-only": ["/home", "/root", "/run/user"]}


def enabled() -> bool:
    return os.environ.get("COLDSNAP_TEST_UNIT") == "1"


def service_settings(text: str | None = None) -> dict[str, list[str]]:
    """The [Service] section: each key with all its values, in order (repeated keys accumulate)."""
    section, settings = "", {}
    for raw in (UNIT.read_text() if text is None else text).splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).extend(value.split())
    return settings


def _one(settings: dict[str, list[str]], key: str, default: str) -> str:
    return settings.get(key, [default])[-1] if settings.get(key) else default


def _caps(names: list[str]) -> str:
    return ",".join("+" + name.lower().removeprefix("cap_") for name in names)


def account() -> pwd.struct_passwd:
    """The unit's User=, created from the shipped sysusers.d file (idempotent)."""
    user = service_settings()["User"][0]
    subprocess.run(["systemd-sysusers", str(SYSUSERS)], check=True, capture_output=True)
    return pwd.getpwnam(user)


def launch_settings() -> dict[str, object]:
    settings = service_settings()
    entry = account()
    families = settings.get("RestrictAddressFamilies", [])
    if any(f.startswith("~") for f in families):
        raise ValueError("RestrictAddressFamilies=~... (a deny list) is not reproduced by tests/_unit_launch.py")
    protect_home = _one(settings, "ProtectHome", "no")
    if protect_home not in _PROTECT_HOME:
        raise ValueError(f"ProtectHome={protect_home} is not reproduced by tests/_unit_launch.py")
    read_only = _PROTECT_SYSTEM[_one(settings, "ProtectSystem", "no")] + _PROTECT_HOME[protect_home]
    user_set = "User" in settings
    explicit = _one(settings, "NoNewPrivileges", "no") == "yes"
    return {
        "uid": entry.pw_uid,
        "gid": grp.getgrnam(settings["Group"][0]).gr_gid if "Group" in settings else entry.pw_gid,
        "groups": [grp.getgrnam(g).gr_gid for g in settings.get("SupplementaryGroups", [])],
        "caps": _caps(settings.get("AmbientCapabilities", [])),
        "bounding": _caps(settings.get("CapabilityBoundingSet", [])),
        "no_new_privs": explicit or (user_set and bool(families)),
        "families": families,
        "read_only": read_only,
        "umask": int(_one(settings, "UMask", "0022"), 8),
    }


def prepare(state_dir: Path, config_path: Path) -> dict[str, str]:
    """Give the state directory to the account as RuntimeDirectory= would; the environment systemd sets."""
    settings = service_settings()
    entry = account()
    os.chown(state_dir, entry.pw_uid, entry.pw_gid)
    os.chmod(state_dir, int(_one(settings, "RuntimeDirectoryMode", "0755"), 8))
    # /etc/coldsnap-provider/config.toml is root's and world-readable (the tmpfiles.d snippet).
    os.chmod(config_path.parent, 0o755)
    os.chmod(config_path, 0o644)
    return {"HOME": str(state_dir), "USER": entry.pw_name, "LOGNAME": entry.pw_name, "SHELL": entry.pw_shell}


def wrap(argv: list[str]) -> list[str]:
    """`argv` started as the unit starts the daemon (run this as root)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        raise RuntimeError("the unit is reproduced only by root, with setpriv on PATH")
    return [sys.executable, str(_LAUNCH), json.dumps(launch_settings()), "--", *argv]

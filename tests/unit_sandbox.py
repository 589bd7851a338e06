"""The daemon as the shipped systemd unit runs it, for tests on a machine without systemd as PID 1.

The settings are read from ``systemd/coldsnap-provider.service`` itself, so a change to the unit
changes what the tests run under; the account is created from the shipped sysusers.d file with
``systemd-sysusers``. What is reproduced (see ``tests/_unit_launch.py`` for how):

* ``User=``, ``Group=``, ``SupplementaryGroups=``, ``AmbientCapabilities=``, ``CapabilityBoundingSet=``,
  ``NoNewPrivileges=`` (explicit, or implied as systemd implies it for ``RestrictAddressFamilies=``
  with ``User=``), ``UMask=``;
* ``RestrictAddressFamilies=``, ``SystemCallFilter=~...`` (with ``SystemCallErrorNumber=``), the system
  calls ``ProtectClock=``, ``ProtectKernelModules=``, ``ProtectKernelLogs=`` and ``ProtectHostname=`` deny,
  and ``RestrictNamespaces=yes``, as one seccomp filter answering as systemd's does;
* ``ProtectSystem=``, ``ProtectHome=`` (``no``/``read-only``; any other value is refused here rather
  than approximated) and ``ProtectKernelTunables=`` as read-only bind mounts in a private mount
  namespace with slave propagation (``PrivateMounts=``);
* ``RuntimeDirectory=``/``RuntimeDirectoryMode=``: the test's state directory is given to the
  account with that mode, and ``$HOME`` points to it (the account's home is the runtime directory).

Not reproduced (``docs/systemd.md`` lists them too): the file-system side of ``ProtectKernelLogs=`` and
``ProtectKernelModules=``, ``ProtectHostname=``'s UTS namespace, ``RestrictRealtime=``,
``RestrictSUIDSGID=``, ``LockPersonality=``, ``SystemCallArchitectures=``, ``RemoveIPC=``, the cgroup.

``COLDSNAP_TEST_UNIT=1`` runs every test daemon (:func:`tests.helpers.running_daemon`) this way.
"""

from __future__ import annotations

import errno
import functools
import grp
import json
import os
import pwd
import re
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
_UNISTD = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")  # linux-libc-dev: system call numbers
_KILL_PROCESS = 0x80000000  # what systemd does to a denied call without SystemCallErrorNumber=
_RET_ERRNO = 0x00050000
# System calls that settings other than SystemCallFilter= deny (systemd.exec(5)); all answer EPERM.
_IMPLIED = {"ProtectClock": ["@clock"], "ProtectKernelModules": ["@module"], "ProtectKernelLogs": ["syslog"],
            "ProtectHostname": ["sethostname", "setdomainname"]}


def _syscall_numbers() -> dict[str, int]:
    if not _UNISTD.exists():
        raise RuntimeError(f"{_UNISTD} (linux-libc-dev) is needed to reproduce the unit's system call filter")
    return {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+) (\d+)", _UNISTD.read_text())}


def _expand(names: list[str]) -> set[str]:
    """System call names of `names` (names and @groups, as systemd-analyze syscall-filter lists them)."""
    calls = {n for n in names if not n.startswith("@")}
    groups = [n for n in names if n.startswith("@")]
    if groups:
        listing = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", *groups],
                                 capture_output=True, text=True, check=True).stdout
        members = [line.strip() for line in listing.splitlines() if line.startswith((" ", "\t"))]
        calls |= _expand([m for m in members if m and not m.startswith("#")])
    return calls


def _seccomp(settings: dict[str, list[str]], families: list[str]) -> dict[str, object]:
    numbers = _syscall_numbers()
    denied: dict[int, int] = {}
    for key, names in _IMPLIED.items():
        if _one(settings, key, "no") == "yes":
            denied |= {numbers[c]: _RET_ERRNO | errno.EPERM for c in _expand(names) if c in numbers}
    rules = settings.get("SystemCallFilter", [])
    if rules and not rules[0].startswith("~"):
        raise ValueError("SystemCallFilter= as an allow list is not reproduced by tests/_unit_launch.py")
    if rules:
        code = _one(settings, "SystemCallErrorNumber", "")
        action = _RET_ERRNO | getattr(errno, code) if code else _KILL_PROCESS
        denied |= {numbers[c]: action for c in _expand([r.lstrip("~") for r in rules]) if c in numbers}
    namespaces = _one(settings, "RestrictNamespaces", "no")
    if namespaces not in ("yes", "no"):
        raise ValueError(f"RestrictNamespaces={namespaces} is not reproduced by tests/_unit_launch.py")
    return {"families": families, "denied": sorted(denied.items()), "namespaces": namespaces == "yes",
            "numbers": {name: numbers[name] for name in ("socket", "clone", "clone3", "unshare", "setns")}}


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


@functools.cache
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
    if _one(settings, "ProtectKernelTunables", "no") == "yes":
        read_only += ["/proc/sys", "/sys"]  # /sys/fs/cgroup with it: ProtectControlGroups= too
    user_set = "User" in settings
    explicit = _one(settings, "NoNewPrivileges", "no") == "yes"
    return {
        "uid": entry.pw_uid,
        "gid": grp.getgrnam(settings["Group"][0]).gr_gid if "Group" in settings else entry.pw_gid,
        "groups": [grp.getgrnam(g).gr_gid for g in settings.get("SupplementaryGroups", [])],
        "caps": _caps(settings.get("AmbientCapabilities", [])),
        "bounding": _caps(settings.get("CapabilityBoundingSet", [])),
        "no_new_privs": explicit or (user_set and bool(families)),
        "seccomp": _seccomp(settings, families),
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

"""Dropping to a manager's identity with nothing of the daemon's privilege (the runtime side).

The provider runs programs for managers through ``setpriv`` (``coldsnap_provider._exec``);
the programs of this package that touch host paths for a manager (``_archive.py``) drop
in-process with :func:`become` or :func:`shed`. Both sides keep the same rules
(``docs/systemd.md``, "Privilege drops"):

1. the bounding set is emptied first, while ``CAP_SETPCAP`` is still effective (leaving uid 0
   takes it away), so that no later ``execve`` of a file with capabilities regains any;
2. supplementary groups are cleared, then the real, effective and saved gid and uid are set;
3. the ambient, inheritable, permitted and effective sets are emptied: the kernel clears them
   on ``setresuid`` only when the caller leaves uid 0, so a daemon that holds capabilities as
   a non-root account (the systemd unit's ``AmbientCapabilities=``) would pass on every one;
4. ``no_new_privs`` is set: no set-user-ID program or file capability raises the result again;
5. the result is read back from ``/proc/self/status``; anything left is a failure.

Standard library only (``ctypes``): ``_archive.py`` loads this file by path in an isolated
interpreter before it touches any host path.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ("CapabilitySets", "DropFailed", "become", "read_capabilities", "shed")

_PR_CAPBSET_READ = 23
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522  # two 32-bit words per set
_CAP_SETPCAP = 8


class DropFailed(Exception):
    """The identity or the capability sets could not be brought to what was asked (the message says which)."""


@dataclass(frozen=True, slots=True)
class CapabilitySets:
    """A process's capability sets (bit masks) and its no_new_privs flag, as /proc reports them."""

    inheritable: int
    permitted: int
    effective: int
    bounding: int
    ambient: int
    no_new_privs: bool

    @property
    def held(self) -> bool:
        """Whether the process holds, or passes on at exec, any capability at all."""
        return bool(self.inheritable | self.permitted | self.effective | self.ambient)

    @property
    def can_clear_bounding(self) -> bool:
        """Whether a drop from here can empty the bounding set, or need not: holding nothing, there
        is nothing to pass on, and no_new_privs stops file capabilities (a daemon run by a plain user)."""
        return not (self.held and self.bounding) or bool(self.effective >> _CAP_SETPCAP & 1)


def read_capabilities(pid: int | str = "self") -> CapabilitySets:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return CapabilitySets(
        inheritable=int(fields["CapInh"], 16), permitted=int(fields["CapPrm"], 16),
        effective=int(fields["CapEff"], 16), bounding=int(fields["CapBnd"], 16),
        ambient=int(fields["CapAmb"], 16), no_new_privs=fields.get("NoNewPrivs") == "1")


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _call(libc: ctypes.CDLL, what: str, name: str, *args: object) -> int:
    result: int = getattr(libc, name)(*args)
    if result < 0:
        code = ctypes.get_errno()
        raise DropFailed(f"{what} failed: {os.strerror(code)}")
    return result


def _clear_bounding(libc: ctypes.CDLL, start: CapabilitySets) -> None:
    if not start.can_clear_bounding:
        raise DropFailed("cannot clear the capability bounding set without CAP_SETPCAP "
                         "(grant it, as the shipped systemd unit does, or run the daemon as root)")
    if not (start.held and start.bounding):
        return
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if start.bounding >> cap & 1:
            _call(libc, f"dropping capability {cap} from the bounding set", "prctl", _PR_CAPBSET_DROP, cap, 0, 0, 0)


def _clear_sets(libc: ctypes.CDLL) -> None:
    _call(libc, "clearing the ambient set", "prctl", _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = _Header(_CAPABILITY_VERSION_3, 0)
    data = (_Data * 2)()  # all zero: lowering every set is always allowed
    _call(libc, "clearing the permitted, effective and inheritable sets", "capset",
          ctypes.byref(header), ctypes.byref(data))
    _call(libc, "setting no_new_privs", "prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _check(left: CapabilitySets, *, bounding: bool) -> None:
    if left.held or (bounding and left.bounding) or not left.no_new_privs:
        raise DropFailed(f"capabilities left after the drop: {left}")


def become(uid: int, gid: int) -> None:
    """Irrevocably take `uid`:`gid` with no supplementary groups and no capability (rules 1 to 5).

    Root asked to stay root is left as it is: that is an exec.user of root under a root daemon,
    which the provider side does not wrap either."""
    same = (os.getresuid(), os.getresgid()) == ((uid,) * 3, (gid,) * 3) and os.getgroups() in ([], [gid])
    if same and uid == 0:
        return
    libc = _libc()
    start = read_capabilities()
    _clear_bounding(libc, start)
    if not same:
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            raise DropFailed(f"could not take the identity {uid}:{gid}: {exc.strerror}") from exc
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
            raise DropFailed(f"could not take the identity {uid}:{gid}")
    _clear_sets(libc)
    _check(read_capabilities(), bounding=start.held)


def shed() -> None:
    """Keep the current uid, gid and groups; give up every capability (rules 1, 3, 4 and 5)."""
    libc = _libc()
    start = read_capabilities()
    _clear_bounding(libc, start)
    _clear_sets(libc)
    _check(read_capabilities(), bounding=start.held)

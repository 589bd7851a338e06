"""Start a program as the shipped systemd unit starts the daemon, without systemd as PID 1.

Run as root: ``python _unit_launch.py SETTINGS_JSON -- ARGV...`` (:mod:`tests.unit_sandbox` builds the
settings from ``systemd/coldsnap-provider.service``). One process all along (each step ``exec``s the next):

1. as root: a private mount namespace (propagation slave, as systemd's) in which the trees of
   ``ProtectSystem=`` and ``ProtectHome=read-only`` are bind-remounted read-only with every mount
   below them; ``UMask=``;
2. ``setpriv``: ``User=``/``Group=``/``SupplementaryGroups=``, the inheritable and ambient sets of
   ``AmbientCapabilities=``, the bounding set of ``CapabilityBoundingSet=``, ``NoNewPrivileges=``;
3. ``python -I _unit_launch.py --seccomp SPEC -- ARGV``: one seccomp filter for
   ``RestrictAddressFamilies=`` (``socket(2)`` with another family fails with EAFNOSUPPORT, as
   systemd's filter answers; ``socketpair(2)`` and passed sockets are unaffected, as there),
   ``SystemCallFilter=~...`` with ``SystemCallErrorNumber=`` and the system calls that
   ``ProtectClock=``, ``ProtectKernelModules=``, ``ProtectKernelLogs=`` and ``ProtectHostname=`` deny,
   and ``RestrictNamespaces=yes`` (namespace flags of ``clone``/``unshare`` and ``setns`` fail with
   EPERM, ``clone3`` with ENOSYS, as systemd does); then ARGV.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import subprocess
import sys
from typing import Any

_AUDIT_ARCH = {"x86_64": 0xC000003E}
_LD_ABS_W, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_NAMESPACE_FLAGS = 0x7E020080  # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET,TIME}
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_CLONE_NEWNS = 0x00020000


def _mounts_under(path: str) -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == path or point.startswith(path.rstrip("/") + "/"):
                points.append(point)
    return sorted(points, key=len)


def _read_only(path: str) -> None:
    if not os.path.isdir(path):
        return
    points = _mounts_under(path)
    if path not in points:  # a plain directory: make it a mount point so that it can be remounted
        subprocess.run(["mount", "--rbind", path, path], check=True)
        points = _mounts_under(path)
    for point in points:
        subprocess.run(["mount", "-o", "remount,bind,ro", point], check=False)  # autofs and the like refuse


def _flag_block(nr: int) -> list[tuple[int, int, int, int]]:
    """`nr` with any namespace flag in its first argument fails with EPERM (systemd's RestrictNamespaces=)."""
    return [(_JEQ_K, 0, 4, nr), (_LD_ABS_W, 0, 0, 16), (_JSET_K, 0, 1, _NAMESPACE_FLAGS),
            (_RET_K, 0, 0, _RET_ERRNO | _EPERM), (_RET_K, 0, 0, _RET_ALLOW)]


def _program(spec: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    numbers: dict[str, int] = spec["numbers"]
    program = [(_LD_ABS_W, 0, 0, 4), (_JEQ_K, 1, 0, _AUDIT_ARCH[os.uname().machine]),
               (_RET_K, 0, 0, _RET_ALLOW), (_LD_ABS_W, 0, 0, 0)]
    families = [int(getattr(socket, name)) for name in spec["families"]]
    if families:  # socket(2) with another family: EAFNOSUPPORT (systemd's RestrictAddressFamilies=)
        count = len(families)
        program += [(_JEQ_K, 0, count + 3, numbers["socket"]), (_LD_ABS_W, 0, 0, 16)]  # args[0], low half
        program += [(_JEQ_K, count - index, 0, family) for index, family in enumerate(families)]
        program += [(_RET_K, 0, 0, _RET_ERRNO | _EAFNOSUPPORT), (_RET_K, 0, 0, _RET_ALLOW)]
    for nr, action in spec["denied"]:  # SystemCallFilter=~..., and what ProtectClock= and the like imply
        program += [(_JEQ_K, 0, 1, nr), (_RET_K, 0, 0, action)]
    if spec["namespaces"]:  # clone3's flags are out of reach: systemd answers ENOSYS (glibc then uses clone)
        program += _flag_block(numbers["clone"]) + _flag_block(numbers["unshare"])
        program += [(_JEQ_K, 0, 1, numbers["clone3"]), (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS),
                    (_JEQ_K, 0, 1, numbers["setns"]), (_RET_K, 0, 0, _RET_ERRNO | _EPERM)]
    return [*program, (_RET_K, 0, 0, _RET_ALLOW)]


def _seccomp(spec: dict[str, Any]) -> None:
    program = _program(spec)
    code = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(code)
    fprog = ctypes.create_string_buffer(struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buffer)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def main(argv: list[str]) -> None:
    split = argv.index("--")
    head, program = argv[:split], argv[split + 1:]
    if head[0] == "--seccomp":
        _seccomp(json.loads(head[1]))
        os.execvp(program[0], program)
    settings = json.loads(head[0])
    if ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWNS) != 0:  # os.unshare is Python 3.12+
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rslave", "/"], check=True)
    for path in settings["read_only"]:
        _read_only(path)
    os.umask(settings["umask"])
    drop = ["setpriv", f"--reuid={settings['uid']}", f"--regid={settings['gid']}",
            f"--groups={','.join(map(str, settings['groups']))}" if settings["groups"] else "--clear-groups",
            f"--inh-caps=-all,{settings['caps']}", f"--ambient-caps=-all,{settings['caps']}",
            f"--bounding-set=-all,{settings['bounding']}"]
    if settings["no_new_privs"]:
        drop.append("--no-new-privs")
    os.execvp("setpriv", [*drop, "--", sys.executable, "-I", os.path.abspath(__file__),
                          "--seccomp", json.dumps(settings["seccomp"]), "--", *program])


if __name__ == "__main__":
    main(sys.argv[1:])

"""Start a program as the shipped systemd unit starts the daemon, without systemd as PID 1.

Run as root: ``python _unit_launch.py SETTINGS_JSON -- ARGV...`` (:mod:`tests.unit_sandbox` builds the
settings from ``systemd/coldsnap-provider.service``). One process all along (each step ``exec``s the next):

1. as root: a private mount namespace (propagation slave, as systemd's) in which the trees of
   ``ProtectSystem=`` and ``ProtectHome=read-only`` are bind-remounted read-only with every mount
   below them; ``UMask=``;
2. ``setpriv``: ``User=``/``Group=``/``SupplementaryGroups=``, the inheritable and ambient sets of
   ``AmbientCapabilities=``, the bounding set of ``CapabilityBoundingSet=``, ``NoNewPrivileges=``;
3. ``python -I _unit_launch.py --families AF_UNIX,... -- ARGV``: the seccomp filter of
   ``RestrictAddressFamilies=`` (``socket(2)`` with any other family fails with EAFNOSUPPORT, as
   systemd's filter answers; ``socketpair(2)`` and passed sockets are unaffected, as there), then ARGV.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import subprocess
import sys

_ARCHES = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}  # AUDIT_ARCH_*, __NR_socket
_LD_ABS_W, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
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


def _seccomp(families: list[str]) -> None:
    arch, nr_socket = _ARCHES[os.uname().machine]
    numbers = [int(getattr(socket, name)) for name in families]
    allow = len(numbers) + 1  # jump targets are relative to the next instruction
    program = [(_LD_ABS_W, 0, 0, 4), (_JEQ_K, 0, len(numbers) + 4, arch),
               (_LD_ABS_W, 0, 0, 0), (_JEQ_K, 0, len(numbers) + 2, nr_socket),
               (_LD_ABS_W, 0, 0, 16)]  # args[0], low 32 bits (little-endian)
    for index, number in enumerate(numbers):
        program.append((_JEQ_K, allow - index - 1, 0, number))
    program += [(_RET_K, 0, 0, _RET_ERRNO | 97), (_RET_K, 0, 0, _RET_ALLOW)]  # 97: EAFNOSUPPORT
    code = b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
    buffer = ctypes.create_string_buffer(code)
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog_buffer, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def main(argv: list[str]) -> None:
    split = argv.index("--")
    head, program = argv[:split], argv[split + 1:]
    if head[0] == "--families":
        if head[1]:
            _seccomp(head[1].split(","))
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
                          "--families", ",".join(settings["families"]), "--", *program])


if __name__ == "__main__":
    main(sys.argv[1:])

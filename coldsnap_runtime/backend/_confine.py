"""How a workload admitted under an admission profile's grant (a `capsule`) is confined on a Docker Engine.

A profile's workloads never run seccomp-unconfined and never share the host's cgroup namespace, whatever
they ask for: `seccomp_unconfined: true` is realised as the capsule seccomp profile below. It allows the
system calls of a known kernel (``_syscalls``) but the ones whose effect is not confined to the container's
own namespaces, mounts first: CAP_SYS_ADMIN (which CRIU needs, and which Docker 20.10 cannot replace with
CAP_CHECKPOINT_RESTORE) is host root through a fresh procfs otherwise. A call newer than that table is
refused (ENOSYS, so a C library falls back) until it is reviewed. The filesystem ioctls that check
CAP_SYS_ADMIN against the host (freeze, shut down, search or open by handle the filesystem a bound file
lives on) are refused by their command's type. A private cgroup namespace hides the hierarchy roots (and
cgroup v1's `release_agent`) as a second wall.

What this does not confine, and why, is in docs/threat-model.md ("What a `privileged` capsule can still do").
"""

from __future__ import annotations

import functools
import json
import platform
from typing import Any

from ._syscalls import LINUX_6_1_SYSCALLS

__all__ = ("CAPSULE_DENIED_IOCTL_TYPES", "CAPSULE_DENIED_SYSCALLS", "confine", "seccomp_profile")

# Each group: calls that act on something every container shares with the host, with the reason.
_DENIED: dict[str, tuple[str, ...]] = {
    # With CAP_SYS_ADMIN: a fresh procfs (its /proc/sys is writable: core_pattern runs a program of the
    # capsule's as the host's root), cgroup hierarchies, read-only binds remounted writable, the masks over
    # /proc unmounted. CRIU restores a capsule's tree without mounting (third_party/criu/capsule.patch).
    "mounts": ("mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
               "open_tree", "mount_setattr"),
    # A file by its handle on any filesystem the container has a file of: /etc/hosts is bound from the
    # engine's data root, so this reaches the whole host filesystem ("shocker").
    "host files by handle": ("open_by_handle_at",),
    # Filesystem-wide marks on a bound file's filesystem hand out descriptors of any host file.
    "filesystem-wide events": ("fanotify_init",),
    # The clocks are the host's (CRIU's monotonic offset goes through a time namespace, not these).
    "the host's clock": ("settimeofday", "clock_settime", "clock_settime64", "clock_adjtime", "clock_adjtime64",
                         "adjtimex", "stime"),
    # Kernel-wide programs, tracing and keyrings (keyed by uid, which a capsule's root shares with the host's).
    "kernel-wide state": ("bpf", "perf_event_open", "add_key", "keyctl", "request_key", "syslog",
                          "lookup_dcookie", "acct", "quotactl", "quotactl_fd", "swapon", "swapoff"),
    # The kernel itself and the machine.
    "the kernel and the machine": ("init_module", "finit_module", "delete_module", "create_module",
                                   "kexec_load", "kexec_file_load", "reboot", "iopl", "ioperm", "vhangup",
                                   "nfsservctl", "uselib", "_sysctl"),
}
CAPSULE_DENIED_SYSCALLS: tuple[str, ...] = tuple(name for names in _DENIED.values() for name in names)

# ioctl command types (bits 8-15) whose commands act on a whole filesystem with CAP_SYS_ADMIN, checked
# against the host's user namespace: 'X' (FIFREEZE, FITHAW, FITRIM, EXT4_IOC_SHUTDOWN, XFS bulkstat and open
# by handle), 0x94 (btrfs tree search, FICLONE, FS_IOC_SETFSLABEL), 0xf5 (f2fs). And ext4's 'f' commands of
# that kind, one by one ('f' also holds FS_IOC_FIEMAP, which CRIU uses): SWAP_BOOT, CHECKPOINT, SETFSUUID.
CAPSULE_DENIED_IOCTL_TYPES: tuple[int, ...] = (0x58, 0x94, 0xF5)
_EXT4_TYPE, _EXT4_DENIED = 0x66, (17, 43, 44)

# Every ABI a process of the container can enter the kernel through (a 32-bit call is filtered too).
_ARCHITECTURES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}
_EPERM, _ENOSYS = 1, 38


def _patterns(excluded: set[int], bits: int = 8, prefix: int = 0, depth: int = 0) -> list[tuple[int, int]]:
    """(mask, value) pairs whose masked equality covers every `bits`-bit number but `excluded`, each once."""
    span = range(prefix << (bits - depth), (prefix + 1) << (bits - depth))
    if not any(v in excluded for v in span):
        mask = ((1 << depth) - 1) << (bits - depth)
        return [(mask, prefix << (bits - depth))]
    if depth == bits:
        return []
    return [*_patterns(excluded, bits, prefix << 1, depth + 1), *_patterns(excluded, bits, prefix << 1 | 1, depth + 1)]


def _ioctl_rules() -> list[dict[str, Any]]:
    """ioctl allowed by its command's type and number, but the filesystem-wide ones (EPERM). One comparison
    a rule (libseccomp's limit per argument), and no two rules overlap, so none depends on precedence."""
    def rule(action: str, mask: int, value: int) -> dict[str, Any]:
        arg = {"index": 1, "value": mask, "valueTwo": value, "op": "SCMP_CMP_MASKED_EQ"}
        return {"names": ["ioctl"], "action": action, "args": [arg],
                **({"errnoRet": _EPERM} if action == "SCMP_ACT_ERRNO" else {})}

    types = {*CAPSULE_DENIED_IOCTL_TYPES, _EXT4_TYPE}
    return [
        *(rule("SCMP_ACT_ALLOW", m << 8, v << 8) for m, v in _patterns(types)),
        *(rule("SCMP_ACT_ALLOW", 0xFF00 | m, _EXT4_TYPE << 8 | v) for m, v in _patterns(set(_EXT4_DENIED))),
        *(rule("SCMP_ACT_ERRNO", 0xFF00, kind << 8) for kind in CAPSULE_DENIED_IOCTL_TYPES),
        *(rule("SCMP_ACT_ERRNO", 0xFFFF, _EXT4_TYPE << 8 | nr) for nr in _EXT4_DENIED),
    ]


@functools.cache  # the same text for every workload of this daemon: built once
def seccomp_profile(machine: str = "") -> str:
    """The capsule seccomp profile, in the Engine's JSON form (the value of ``seccomp=`` in SecurityOpt)."""
    denied = {*CAPSULE_DENIED_SYSCALLS, "ioctl"}
    rules: list[dict[str, Any]] = [
        {"names": sorted(LINUX_6_1_SYSCALLS - denied), "action": "SCMP_ACT_ALLOW"},
        {"names": list(CAPSULE_DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM},
        *_ioctl_rules(),
    ]
    profile = {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": _ENOSYS,
        "architectures": _ARCHITECTURES.get(machine or platform.machine(), []),
        "syscalls": rules,
    }
    return json.dumps(profile, separators=(",", ":"))


def confine(host: dict[str, Any]) -> None:
    """Apply the capsule confinement to a create body's HostConfig (any seccomp option replaced)."""
    options = [o for o in host.get("SecurityOpt", []) if not o.startswith("seccomp=")]
    host["SecurityOpt"] = [*options, f"seccomp={seccomp_profile()}"]
    host["CgroupnsMode"] = "private"

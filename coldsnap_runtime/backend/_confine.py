"""How a workload admitted under an admission profile's grant (a `capsule`) is confined on a Docker Engine.

A profile's workloads never run seccomp-unconfined and never share the host's cgroup namespace, whatever
they ask for: `seccomp_unconfined: true` is realised as the capsule seccomp profile below, which allows
every call CRIU and the CUDA checkpoint make inside a capsule and refuses (EPERM) the calls whose effect is
not confined to the container's own namespaces, mounts first: CAP_SYS_ADMIN (which CRIU needs, and which
Docker 20.10 cannot replace with CAP_CHECKPOINT_RESTORE) is host root through a fresh procfs otherwise.
A private cgroup namespace hides the hierarchy roots (and cgroup v1's `release_agent`) as a second wall.

What this does not confine, and why, is in docs/threat-model.md ("What a `privileged` capsule can still do").
"""

from __future__ import annotations

import json
import platform
from typing import Any

__all__ = ("CAPSULE_DENIED_SYSCALLS", "confine", "seccomp_profile")

# Each group: calls that act on something every container shares with the host, with the reason.
_DENIED: dict[str, tuple[str, ...]] = {
    # A file by its handle on any filesystem the container has a file of: /etc/hosts is bound from the
    # engine's data root, so this reaches the whole host filesystem ("shocker").
    "host files by handle": ("open_by_handle_at",),
    # With CAP_SYS_ADMIN: a fresh procfs (its /proc/sys is writable: core_pattern runs a program of the
    # capsule's as the host's root), cgroup hierarchies, read-only binds remounted writable, the masks over
    # /proc unmounted. CRIU restores a capsule's tree without mounting (its mount probe is patched to take
    # EPERM as "feature absent": third_party/criu/capsule.patch).
    "mounts": ("mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
               "open_tree", "mount_setattr"),
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

# Every ABI a process of the container can enter the kernel through (a 32-bit call is filtered too).
_ARCHITECTURES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}
_EPERM = 1


def seccomp_profile(machine: str = "") -> str:
    """The capsule seccomp profile, in the Engine's JSON form (the value of ``seccomp=`` in SecurityOpt)."""
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": _ARCHITECTURES.get(machine or platform.machine(), []),
        "syscalls": [{"names": list(CAPSULE_DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": _EPERM}],
    }
    return json.dumps(profile, separators=(",", ":"))


def confine(host: dict[str, Any]) -> None:
    """Apply the capsule confinement to a create body's HostConfig (any seccomp option replaced)."""
    options = [o for o in host.get("SecurityOpt", []) if not o.startswith("seccomp=")]
    host["SecurityOpt"] = [*options, f"seccomp={seccomp_profile()}"]
    host["CgroupnsMode"] = "private"

"""Issue 37 finding 1: what a `privileged` capsule of a non-root manager can reach on the host.

A manager under a restricted profile, through its session only, runs busybox with `privileged: true` and a
small static program (compiled here, sent on stdin) that tries the calls whose effect leaves the container:
opening a file by handle (the "shocker" read/write of any host file), the host's clock, a fresh procfs
(whose writable core_pattern is host root) and cgroup v1's `release_agent` at a hierarchy root. Every
answer comes from the real kernel, through the real dockerd; and CRIU still dumps and restores there.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from coldsnap_runtime.backend import CAPSULE_DENIED_IOCTL_TYPES, CAPSULE_DENIED_SYSCALLS, seccomp_profile
from tests.conftest import docker
from tests.helpers import running_daemon, session_as
from tests.provider.test_policy import NOBODY, inspect, mount_root, names, policy_config, uniq
from tests.provider.test_remote import NodeB, node_b

__all__ = ("mount_root", "names", "node_b")  # the fixtures these tests use

pytestmark = pytest.mark.usefixtures("no_leftovers")

# Each line: the call, then "ok" or the errno's text.
PROBE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static const char *said(int rc) { return rc >= 0 ? "ok" : strerror(errno); }

int main(void) {
    struct { struct file_handle head; unsigned char bytes[128]; } handle;
    int mount_id, dir = open("/etc/hosts", O_RDONLY);
    handle.head.handle_bytes = sizeof handle.bytes;
    printf("name_to_handle_at %s\n", said(name_to_handle_at(AT_FDCWD, "/etc/hosts", &handle.head, &mount_id, 0)));
    printf("open_by_handle_at %s\n", said(open_by_handle_at(dir, &handle.head, O_RDONLY)));
    /* the system call itself (glibc's wrapper reads *tv): checks CAP_SYS_TIME, then sets nothing */
    printf("settimeofday %s\n", said((int)syscall(SYS_settimeofday, NULL, NULL)));
    /* thaws nothing (nothing is frozen): EINVAL once past CAP_SYS_ADMIN's check against the host */
    printf("FITHAW %s\n", said(ioctl(dir, FITHAW, 0)));
    /* Linux 6.15's open_tree_attr (467): a writable clone of the read-only /proc/sys, never written */
    printf("open_tree_attr %s\n", said((int)syscall(467, AT_FDCWD, "/proc/sys", 1, NULL, 0)));
    return 0;
}
"""

# The program, then the mounts of the known escapes: a fresh procfs (its /proc/sys/kernel/core_pattern runs a
# program as the host's root; opened for appending only, never written) and a cgroup v1 hierarchy (release_agent).
SCRIPT = ("cat > /tmp/probe && chmod 755 /tmp/probe && /tmp/probe; mkdir -p /tmp/cg /tmp/p; "
          "if mount -t proc proc /tmp/p 2>/dev/null; then "
          "(exec 3>>/tmp/p/sys/kernel/core_pattern) 2>/dev/null && echo 'procfs core_pattern-writable' "
          "|| echo 'procfs read-only'; else echo 'procfs refused'; fi; "
          "if mount -t cgroup -o memory cgroup /tmp/cg 2>/dev/null; then "
          "[ -e /tmp/cg/release_agent ] && echo 'cgroup release_agent-reachable' "
          "|| echo 'cgroup release_agent-hidden'; "
          "else echo 'cgroup refused'; fi")


@pytest.fixture(scope="module")
def probe_program(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    source = tmp_path_factory.mktemp("probe") / "probe.c"
    source.write_text(PROBE)
    binary = source.with_suffix("")
    subprocess.run(["gcc", "-static", "-O1", "-o", str(binary), str(source)], check=True, capture_output=True)
    return binary.read_bytes()


def outcomes(output: bytes) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in output.decode().splitlines() if line)


@pytest.mark.parametrize("unconfined", [True, False], ids=["seccomp-unconfined-asked", "seccomp-default"])
async def test_privileged_capsule_reaches_no_host_file_clock_or_release_agent(
        busybox_image: str, mount_root: Path, names: list[str], probe_program: bytes, unconfined: bool) -> None:
    name = uniq("boundary")
    names.append(name)
    async with running_daemon(policy_config(mount_root)) as daemon:
        reply = await session_as(NOBODY, daemon).runtime("workload-run", workload={
            "name": name, "image": busybox_image, "privileged": True, "seccomp_unconfined": unconfined,
            "input": base64.b64encode(probe_program).decode(), "entrypoint": "sh", "command": ["-c", SCRIPT]})
        assert reply.ok, reply.error
        assert reply.runtime is not None and isinstance(reply.runtime.output, bytes)
    said = outcomes(reply.runtime.output)
    # The handle itself is harmless to learn; opening by it is what reaches every file of that filesystem.
    assert said.get("open_by_handle_at") == "Operation not permitted", reply.runtime.output
    assert said.get("settimeofday") == "Operation not permitted", said
    assert said.get("FITHAW") == "Operation not permitted", said
    assert said.get("open_tree_attr") in ("Function not implemented", "Operation not permitted"), said
    assert said.get("procfs") == "refused" and said.get("cgroup") == "refused", said
    host = inspect(name)["HostConfig"]
    assert host["CgroupnsMode"] == "private"
    assert "seccomp=unconfined" not in host["SecurityOpt"]
    assert "CAP_DAC_READ_SEARCH" not in host["CapAdd"] and "DAC_READ_SEARCH" not in host["CapAdd"]


async def test_an_unprivileged_capsule_asking_seccomp_unconfined_is_confined_too(
        busybox_image: str, mount_root: Path, names: list[str], probe_program: bytes) -> None:
    name = uniq("boundary-unpriv")
    names.append(name)
    async with running_daemon(policy_config(mount_root)) as daemon:
        reply = await session_as(NOBODY, daemon).runtime("workload-run", workload={
            "name": name, "image": busybox_image, "seccomp_unconfined": True,
            "input": base64.b64encode(probe_program).decode(), "entrypoint": "sh", "command": ["-c", SCRIPT]})
        assert reply.ok and reply.runtime is not None and isinstance(reply.runtime.output, bytes), reply.error
    said = outcomes(reply.runtime.output)
    assert said.get("open_tree_attr") in ("Function not implemented", "Operation not permitted"), said
    host = inspect(name)["HostConfig"]
    assert host["CgroupnsMode"] == "private" and "seccomp=unconfined" not in host["SecurityOpt"]
    assert any(o.startswith("seccomp={") for o in host["SecurityOpt"]), host["SecurityOpt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="node-b needs root (namespaces, a second dockerd)")
async def test_a_remote_nodes_privileged_capsule_is_confined_the_same(
        node_b: NodeB, busybox_image: str, mount_root: Path, probe_program: bytes) -> None:
    name = uniq("boundary-remote")
    async with running_daemon(node_b.config() + policy_config(mount_root)) as daemon:
        try:
            reply = await session_as(NOBODY, daemon, hosts=("node-b",)).runtime("workload-run", host="node-b",
                                                                                 workload={
                "name": name, "image": busybox_image, "privileged": True, "seccomp_unconfined": True,
                "input": base64.b64encode(probe_program).decode(), "entrypoint": "sh", "command": ["-c", SCRIPT]})
            host = json.loads(node_b.docker("container", "inspect", name).stdout)[0]["HostConfig"]
        finally:
            node_b.docker("rm", "-f", name, check=False)
    assert reply.ok and reply.runtime is not None and isinstance(reply.runtime.output, bytes), reply.error
    said = outcomes(reply.runtime.output)
    assert said.get("open_by_handle_at") == "Operation not permitted", reply.runtime.output
    assert said.get("procfs") == "refused" and said.get("cgroup") == "refused", said
    assert host["CgroupnsMode"] == "private" and "seccomp=unconfined" not in host["SecurityOpt"]


async def test_root_unrestricted_workloads_keep_what_they_ask(busybox_image: str, names: list[str]) -> None:
    """The confinement is the restricted profiles': an unrestricted `seccomp_unconfined` stays unconfined."""
    name = uniq("boundary-root")
    names.append(name)
    async with running_daemon() as daemon:
        session = await daemon.open_session()
        reply = await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "seccomp_unconfined": True, "command": ["true"]})
        assert reply.ok, reply.error
    host = inspect(name)["HostConfig"]
    assert host["SecurityOpt"] == ["seccomp=unconfined"] and host.get("CgroupnsMode") != "private"


def test_the_profile_allows_a_known_kernels_calls_but_the_denied_and_refuses_any_newer() -> None:
    profile = json.loads(seccomp_profile("x86_64"))
    assert (profile["defaultAction"], profile["defaultErrnoRet"]) == ("SCMP_ACT_ERRNO", 38)  # ENOSYS: libc falls back
    assert profile["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    allowed, denied, *ioctl = profile["syscalls"]
    assert denied == {"names": list(CAPSULE_DENIED_SYSCALLS), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    assert not set(allowed["names"]) & {*CAPSULE_DENIED_SYSCALLS, "ioctl", "open_tree_attr"}
    assert {"read", "clone3", "ptrace", "process_vm_readv", "userfaultfd", "setns", "unshare"} <= set(allowed["names"])
    assert {"open_by_handle_at", "settimeofday", "clock_settime", "bpf", "keyctl", "fanotify_init", "mount",
            "umount2", "open_tree", "fsopen"} <= set(CAPSULE_DENIED_SYSCALLS)

    def verdict(command: int) -> list[str]:
        return [rule["action"] for rule in ioctl
                if command & rule["args"][0]["value"] == rule["args"][0]["valueTwo"]]

    # Every ioctl command meets exactly one rule: the filesystem-wide ones are refused, the rest allowed.
    for command in range(1 << 16):
        kind, nr = command >> 8, command & 0xFF
        refused = kind in CAPSULE_DENIED_IOCTL_TYPES or (kind == 0x66 and nr in (17, 43, 44))
        assert verdict(command) == ["SCMP_ACT_ERRNO" if refused else "SCMP_ACT_ALLOW"], hex(command)


# --- CRIU still works in a confined capsule -------------------------------------------------------------------

# In the capsule: a session leader to capture, CRIU's dump (which kills it), the reap, CRIU's kernel probe into a
# cache of its own as the restore worker runs it (kdat-cache.patch), CRIU's restore of the same PID loading that
# cache, and the restored process answering. CRIU's logs follow on failure.
CRIU_SCRIPT = """
setsid sh -c 'echo $$ > /tmp/leader; while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &
while [ ! -s /tmp/leader ]; do sleep 0.1; done
pid=$(cat /tmp/leader)
mkdir -p /tmp/img
export CRIU_DUMP_THREADS=4
if criu dump --tree "$pid" --images-dir /tmp/img -o dump.log -v4; then echo dumped; else cat /tmp/img/dump.log; fi
case "$(cat /tmp/img/dump.log)" in *"dump-threads: $pid: "*) echo "pages read by threads";; esac
wait
mkdir /tmp/kdat
CRIU_KDAT_CACHE=/tmp/kdat/criu.kdat criu check --feature pagemap_scan >/dev/null 2>&1
if CRIU_KDAT_CACHE=/tmp/kdat/criu.kdat criu restore --images-dir /tmp/img -o restore.log -v4 -d; then echo restored
else cat /tmp/img/restore.log; fi
case "$(cat /tmp/img/restore.log)" in *"Loaded kdat cache from /tmp/kdat/criu.kdat"*) echo "kdat cached";; esac
kill -0 "$pid" && echo "alive $pid"
"""


@pytest.fixture(scope="module")
def criu_image() -> str:
    """busybox and the project's CRIU (scripts/criu/build, with its patches) with every library it loads."""
    from tests.criu import CRIU

    if CRIU is None:
        pytest.skip("needs root and scripts/criu/build's CRIU")
    tag = f"coldsnap-test/criu-capsule:{CRIU.parents[2].name}"
    if docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    libraries = CRIU.parent.parent / "usr/lib/x86_64-linux-gnu"
    ldd = subprocess.run(["ldd", str(CRIU)], capture_output=True, text=True, check=True,
                         env={"LD_LIBRARY_PATH": str(libraries)}).stdout
    with tempfile.TemporaryDirectory() as root:
        rootfs = Path(root)
        for d in ("bin", "tmp", "lib64", "lib"):
            (rootfs / d).mkdir()
        os.chmod(rootfs / "tmp", 0o1777)
        busybox = shutil.which("busybox") or "/bin/busybox"
        shutil.copy2(busybox, rootfs / "bin/busybox")
        for applet in ("sh", "setsid", "sleep", "cat", "mkdir", "kill", "echo"):
            (rootfs / "bin" / applet).symlink_to("busybox")
        shutil.copy2(CRIU, rootfs / "bin/criu")
        for path in re.findall(r"(/\S+) \(0x", ldd):  # every library, at the path the loader looks for it
            target = rootfs / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            (rootfs / "lib" / target.name).unlink(missing_ok=True)
            if target.parent != rootfs / "lib":
                shutil.copy2(path, rootfs / "lib" / target.name)
        tar = subprocess.run(["tar", "-C", root, "-c", "."], capture_output=True, check=True).stdout
        docker("import", "--change", "ENV PATH=/bin", "--change", "ENV LD_LIBRARY_PATH=/lib", "-", tag, input=tar)
    return tag


async def test_a_confined_privileged_capsule_still_dumps_and_restores_a_process_with_criu(
        criu_image: str, mount_root: Path, names: list[str]) -> None:
    name = uniq("boundary-criu")
    names.append(name)
    async with running_daemon(policy_config(mount_root)) as daemon:
        reply = await session_as(NOBODY, daemon).runtime("workload-run", workload={
            "name": name, "image": criu_image, "privileged": True, "seccomp_unconfined": True,
            "entrypoint": "sh", "command": ["-c", CRIU_SCRIPT]})
        assert reply.ok, reply.error
        assert reply.runtime is not None and isinstance(reply.runtime.output, bytes)
    output = reply.runtime.output.decode(errors="replace")
    assert "dumped" in output and "restored" in output and "alive" in output, output[-6000:]
    assert "kdat cached" in output, output[-6000:]  # the kernel probe's cache works under the capsule's confinement
    assert "pages read by threads" in output  # the capsule's seccomp profile lets dump-threads.patch read them
    assert inspect(name)["HostConfig"]["CgroupnsMode"] == "private"

"""The runtime admission policy (issue 24): profiles per manager, enforced before any backend call.

Managers who are not root open their sessions as a real non-root uid (a forked child on the control
socket); what the daemon did is read back from the real dockerd.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_provider import Reply
from coldsnap_provider._config import CAPSULE_CAPABILITIES, PolicyConfig, ProfileConfig, load_config
from coldsnap_provider._errors import ConfigError
from coldsnap_provider._logging import ADMISSION_KEYS
from coldsnap_provider._policy import Policy, PolicyRefused
from coldsnap_runtime.schema import WorkloadRun, WorkloadSpec
from tests.conftest import docker
from tests.helpers import EXEC_AS_NOBODY, ROOT, Session, control_as, next_id, running_daemon, session_as

NOBODY = 65534
OTHER = 65533  # a second non-root manager (any uid: the control socket checks SO_PEERCRED, not passwd)


def uniq(prefix: str) -> str:
    return f"{prefix}-{next_id()[-9:]}"


def container_exists(name: str) -> bool:
    return docker("container", "inspect", name, check=False).returncode == 0


def inspect(name: str) -> dict[str, Any]:
    data: list[dict[str, Any]] = json.loads(docker("container", "inspect", name).stdout)
    return data[0]


@pytest.fixture
def mount_root() -> Iterator[Path]:
    """A root-owned mount root under /tmp (sticky, root-owned), a filesystem mounted nosuid,nodev:
    what a capsule profile may name (a capsule writes there as root)."""
    root = Path(tempfile.mkdtemp(prefix="cs-polroot-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,mode=0755,size=16m", "cs-polroot", str(root)],
                   check=True)
    yield root
    subprocess.run(["umount", "-l", str(root)], check=False)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def suid_root() -> Iterator[Path]:
    """A root-owned mount root on a filesystem where setuid bits and device nodes work (/tmp's)."""
    root = Path(tempfile.mkdtemp(prefix="cs-suidroot-", dir="/tmp"))
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def names() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for name in made:
        docker("rm", "-f", name, check=False)


def policy_config(root: Path, extra: str = "") -> str:
    return (f"{EXEC_AS_NOBODY}[server]\ncontrol_uids = [{NOBODY}, {OTHER}]\n"
            f"[policy.profiles.tenant]\nmount_roots = [\"{root}\"]\n{extra}"
            f"[[policy.assign]]\nuids = [{NOBODY}, {OTHER}]\nprofile = \"tenant\"\n")


async def run(session: Session, **workload: Any) -> Reply:
    return await session.runtime("workload-run", workload=workload)


# --- refusals: the field, the value, the rule; nothing created ----------------------------------


async def test_policy_non_root_manager_mount_outside_roots_refused_exactly_and_nothing_created(
        busybox_image: str, mount_root: Path) -> None:
    """Regression: #24 (the model): a session could bind-mount /etc (or anything) into a workload."""
    name = uniq("pol-etc")
    async with running_daemon(policy_config(mount_root)) as daemon:
        session = session_as(NOBODY, daemon)
        reply = await run(session, image=busybox_image, name=name, command=["true"],
                          mounts=[{"source": str(mount_root), "target": "/a"}, {"source": "/etc", "target": "/b"}])
        assert not reply.ok and not reply.error_code  # a plain ok:false rejection
        assert reply.error == "workload.mounts[1].source: /etc is outside the allowed roots of profile tenant"
        assert not container_exists(name)
        [event] = [e for e in daemon.log_events() if e.get("event") == "admission" and e.get("decision") == "refused"]
        assert event["manager_uid"] == NOBODY and event["profile"] == "tenant" and event["rule"] == "mount-roots"
        assert event["session"] == session.session and event["host"] == "localhost"
        assert event["action"] == "workload-run"
        admitted = [e for e in daemon.log_events() if e.get("event") == "admission"]
        assert all(set(e) <= {*ADMISSION_KEYS, "event", "level", "timestamp"} for e in admitted)


async def test_policy_refusal_is_audited_with_its_profile(busybox_image: str, mount_root: Path) -> None:
    """The audit trail names the decision and the profile of every runtime request (issue 26 item 3)."""
    audit = mount_root / "audit.jsonl"
    name = uniq("pol-audit")
    async with running_daemon(policy_config(mount_root) + f'[audit]\nfile = "{audit}"\n') as daemon:
        session = session_as(NOBODY, daemon)
        refused = await run(session, image=busybox_image, name=name, command=["true"], network="host")
        assert refused.error == "workload.network: host is refused by profile tenant (the host's network namespace)"
        assert (await session.runtime("workload-remove", name=name)).ok
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    runtime = [(e["action"], e["outcome"], e["decision"], e["profile"], e["uid"])
               for e in events if e["operation"] == "runtime"]
    assert runtime == [("workload-run", "rejected", "refused", "tenant", NOBODY),
                       ("workload-remove", "ok", "admitted", "tenant", NOBODY)]
    assert not container_exists(name)


@pytest.mark.parametrize(("workload", "expected"), [
    pytest.param({"network": "host"}, "workload.network: host is refused by profile tenant", id="host-network"),
    pytest.param({"devices": [{"source": "/dev/kmsg"}]},
                 "workload.devices[0].source: /dev/kmsg is not a device profile tenant allows", id="device"),
    pytest.param({"environment": {"NVIDIA_VISIBLE_DEVICES": "all"}},
                 "workload.environment.NVIDIA_VISIBLE_DEVICES: profile tenant refuses setting", id="gpu-env"),
    pytest.param({"labels": {"io.coldsnap-provider.instance": "x"}},
                 "workload.labels.io.coldsnap-provider.instance: labels under io.coldsnap-provider.", id="label"),
    pytest.param({"mounts": [{"source": "/var/run/docker.sock", "target": "/s"}]},
                 "workload.mounts[0].source: /var/run/docker.sock is outside the allowed roots", id="docker-sock"),
    pytest.param({"privileged": True}, "workload.privileged: true is refused by profile tenant", id="privileged"),
])
async def test_policy_capsule_rules_refuse_naming_field_and_value(
        busybox_image: str, mount_root: Path, workload: dict[str, Any], expected: str) -> None:
    name = uniq("pol-rule")
    extra = "privileged = \"refuse\"\n" if "privileged" in workload else ""
    async with running_daemon(policy_config(mount_root, extra)) as daemon:
        reply = await run(session_as(NOBODY, daemon), image=busybox_image, name=name, command=["true"], **workload)
        assert not reply.ok and str(reply.error).startswith(expected), reply.error
        assert not container_exists(name)


async def test_policy_image_allow_list_covers_run_pull_and_tag(busybox_image: str, mount_root: Path) -> None:
    async with running_daemon(policy_config(mount_root, "images = [\"registry.invalid/capsules/*\"]\n")) as daemon:
        session = session_as(NOBODY, daemon)
        reply = await run(session, image=busybox_image, command=["true"])
        assert reply.error == (f"workload.image: {busybox_image} matches none of the images profile tenant allows "
                               "(registry.invalid/capsules/*)")
        reply = await session.runtime("image-pull", image="docker.io/library/alpine:3")
        assert str(reply.error).startswith("image: docker.io/library/alpine:3 matches none")
        reply = await session.runtime("image-tag", source=busybox_image, target="registry.invalid/capsules/x:1")
        assert str(reply.error).startswith(f"source: {busybox_image} matches none")
        assert docker("image", "inspect", "registry.invalid/capsules/x:1", check=False).returncode != 0


async def test_policy_symlink_and_manager_writable_directory_under_a_root_refused(
        busybox_image: str, mount_root: Path, names: list[str]) -> None:
    """dockerd resolves a bind source as root: a link or a swappable directory would escape the root."""
    (mount_root / "link").symlink_to("/etc")
    mine = mount_root / "mine"
    (mine / "sub").mkdir(parents=True)
    os.chown(mine, NOBODY, NOBODY)
    async with running_daemon(policy_config(mount_root)) as daemon:
        session = session_as(NOBODY, daemon)
        reply = await run(session, image=busybox_image, command=["true"],
                          mounts=[{"source": f"{mount_root}/link", "target": "/x"}])
        assert reply.error == (f"workload.mounts[0].source: {mount_root}/link passes through {mount_root}/link, a "
                               "symbolic link the engine would follow as root (profile tenant)")
        reply = await run(session, image=busybox_image, command=["true"],
                          mounts=[{"source": f"{mine}/sub", "target": "/x"}])
        assert str(reply.error).startswith(f"workload.mounts[0].source: {mine}/sub lies in {mine}, which uid "
                                           f"{NOBODY} (mode 0755) could change after this check")
        reply = await run(session, image=busybox_image, command=["true"],
                          mounts=[{"source": f"{mount_root}/absent", "target": "/x"}])
        assert "does not exist (the engine would create it as root)" in str(reply.error)
        assert not (mount_root / "absent").exists()
        os.mkfifo(mount_root / "fifo")
        reply = await run(session, image=busybox_image, command=["true"],
                          mounts=[{"source": f"{mount_root}/fifo", "target": "/x"}])
        assert reply.error == (f"workload.mounts[0].source: {mount_root}/fifo is neither a directory nor a regular "
                               "file (profile tenant)")
        # The manager's own directory directly under the root is fine: nobody but root can swap it.
        name = uniq("pol-mount")
        names.append(name)
        reply = await run(session, image=busybox_image, name=name, command=["ls", "/x"],
                          mounts=[{"source": str(mine), "target": "/x"}])
        assert reply.ok, reply.error
        assert reply.runtime is not None and reply.runtime.output == b"sub\n"


async def test_policy_writable_mount_on_a_suid_filesystem_refused(
        busybox_image: str, suid_root: Path, names: list[str]) -> None:
    """Review of #24: a capsule is uid 0 on the host's files: in its manager's writable directory it left
    a setuid-root shell (or a device node) that the manager then ran on the host: host root."""
    mine = suid_root / "mine"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    plant = ["sh", "-c", "cp /bin/busybox /x/sh && chmod 4755 /x/sh && mknod /x/mem c 1 1"]
    async with running_daemon(policy_config(suid_root)) as daemon:
        session = session_as(NOBODY, daemon)
        reply = await run(session, image=busybox_image, remove_after_exit=True, command=plant,
                          mounts=[{"source": str(mine), "target": "/x"}])
        assert not reply.ok and not reply.error_code, reply.error
        assert reply.error == (
            f"workload.mounts[0].source: {mine} lies on a filesystem mounted without nosuid,nodev: a capsule writing "
            "there as root could leave a setuid program or a device node its manager runs on the host; mount the "
            "root nosuid,nodev, or mount the source read_only in a workload that is not privileged (profile tenant)")
        assert list(mine.iterdir()) == []
        # CAP_SYS_ADMIN remounts a read-only bind read-write: a privileged capsule is refused it too.
        reply = await run(session, image=busybox_image, remove_after_exit=True, privileged=True, command=plant,
                          mounts=[{"source": str(mine), "target": "/x", "read_only": True}])
        assert str(reply.error).startswith(f"workload.mounts[0].source: {mine} lies on a filesystem mounted without")
        assert list(mine.iterdir()) == []
        # Read-only in a capsule without privileges: it cannot write there, so it is admitted.
        reply = await run(session, image=busybox_image, remove_after_exit=True, command=plant,
                          mounts=[{"source": str(mine), "target": "/x", "read_only": True}])
        assert reply.error_code == "runtime_failed" and "Read-only file system" in str(reply.error), reply.error
        assert list(mine.iterdir()) == []


async def test_policy_provider_labels_refused_in_session_open_labels_too(
        busybox_image: str, mount_root: Path, names: list[str]) -> None:
    """Review of #24: session-open's manager labels reach the cluster's workloads after admission, so a
    manager put io.coldsnap-provider.* labels (the daemon's instance and incarnation) on its workloads."""
    name = uniq("pol-lbl")
    names.append(name)
    async with running_daemon(policy_config(mount_root)) as daemon:
        os.chmod(daemon.state_dir / "control.sock", 0o666)
        session = uniq("op-lbl")
        answer = control_as(NOBODY, daemon.state_dir, {
            "operation": "session-open", "session": session, "hosts": ["localhost"], "cluster_id": "c1",
            "labels": {"team": "a", "io.coldsnap-provider.instance": "forged"}})
        assert not answer["ok"] and answer["error"] == (
            "labels.io.coldsnap-provider.instance: labels under io.coldsnap-provider. belong to the provider "
            "(profile tenant)"), answer
        listed = control_as(NOBODY, daemon.state_dir, {"operation": "session-list"})
        assert session not in json.dumps(listed)
        [event] = [e for e in daemon.log_events() if e.get("event") == "admission" and e.get("decision") == "refused"]
        assert event["action"] == "session-open" and event["rule"] == "provider-labels"
        # Other labels still reach the cluster's workloads; root (unrestricted) may set the provider's.
        answer = control_as(NOBODY, daemon.state_dir, {
            "operation": "session-open", "session": session, "hosts": ["localhost"], "cluster_id": "c1",
            "labels": {"team": "a"}})
        assert answer["ok"], answer
        result = answer["result"]
        reply = await run(Session(socket=result["socket"], token=result["token"], session=result["session"]),
                          image=busybox_image, name=name, detached=True, labels={"io.sparksq.coldsnap.workload": "c1"},
                          command=["sleep", "30"])
        assert reply.ok, reply.error
        assert inspect(name)["Config"]["Labels"]["team"] == "a"
        root = await daemon.open_session(labels={"io.coldsnap-provider.note": "root's"})
        assert root.session


async def test_policy_privileged_capsule_gets_exactly_the_profile_capabilities(
        busybox_image: str, mount_root: Path, names: list[str]) -> None:
    """Regression: #24: `privileged` under a restricted profile is its capabilities, not the host."""
    name = uniq("pol-caps")
    names.append(name)
    async with running_daemon(policy_config(mount_root)) as daemon:
        reply = await run(session_as(NOBODY, daemon), image=busybox_image, name=name, detached=True,
                          privileged=True, seccomp_unconfined=True, command=["sleep", "60"])
        assert reply.ok, reply.error
    host = inspect(name)["HostConfig"]
    assert host["Privileged"] is False
    assert sorted(c.removeprefix("CAP_") for c in host["CapAdd"]) == sorted(CAPSULE_CAPABILITIES)
    assert not host["Devices"] and not host.get("DeviceCgroupRules")
    assert "apparmor=unconfined" in host["SecurityOpt"] and "seccomp=unconfined" not in host["SecurityOpt"]
    assert [json.loads(o.removeprefix("seccomp="))["defaultAction"] for o in host["SecurityOpt"]
            if o.startswith("seccomp=")] == ["SCMP_ACT_ERRNO"]  # the capsule profile (test_capsule_boundary.py)
    assert host["NetworkMode"] != "host" and host["CgroupnsMode"] == "private"


async def test_policy_root_keeps_unrestricted_by_default(busybox_image: str, mount_root: Path) -> None:
    async with running_daemon(policy_config(mount_root)) as daemon:
        session = await daemon.open_session()
        reply = await run(session, image=busybox_image, remove_after_exit=True, command=["ls", "/h/hostname"],
                          mounts=[{"source": "/etc", "target": "/h", "read_only": True}])
        assert reply.ok and reply.runtime is not None and reply.runtime.output == b"/h/hostname\n"


# --- finding 3: the control socket's probe ------------------------------------------------------


async def test_probe_non_root_manager_image_outside_profile_refused(busybox_image: str, mount_root: Path) -> None:
    """Regression: #24 finding 3: any control peer ran any image privileged on the host network."""
    async with running_daemon(policy_config(mount_root, "images = [\"registry.invalid/*\"]\n")) as daemon:
        os.chmod(daemon.state_dir / "control.sock", 0o666)
        answer = control_as(NOBODY, daemon.state_dir, {"operation": "probe", "driver": "n610",
                                                       "image": busybox_image})
        assert answer["ok"] is False
        assert answer["error"] == (f"probe.image: {busybox_image} matches none of the images profile tenant "
                                   "allows (registry.invalid/*)")
        assert not [e for e in daemon.log_events() if e.get("event") == "workload started"]


def test_probe_workloads_run_with_capabilities_not_privileged_nor_host_network() -> None:
    from coldsnap_provider._probe import ProbeOptions, criu_workload, probe_workload
    from coldsnap_runtime.backend import PrivilegeGrant, container_config

    options = ProbeOptions(driver="n610", image="capsule@sha256:" + "0" * 64)
    grant = PrivilegeGrant(capabilities=options.capabilities, devices=(), whole_host=False)
    for spec in (criu_workload(options), probe_workload(options, Path("/state/probe-package-x/coldsnap_probe"))):
        host = container_config(spec, privilege=grant)["HostConfig"]
        assert host["Privileged"] is False and host["CapAdd"] == list(CAPSULE_CAPABILITIES)
        assert host["NetworkMode"] == "none" and not host.get("DeviceCgroupRules")


def test_probe_host_process_cache_is_scoped_to_the_manager() -> None:
    """Regression: #24 finding 9: a host-process result was cached for every manager alike."""
    from coldsnap_provider._probe import ProbeOptions, cache_scope

    scopes = {cache_scope(ProbeOptions(driver="n610", host_process=True, manager_uid=uid)) for uid in (NOBODY, OTHER)}
    assert len(scopes) == 2 and cache_scope(ProbeOptions(driver="n610", host_process=True)) not in scopes


# --- finding 4: another manager's workloads -------------------------------------------------------


async def test_runtime_workload_actions_answer_not_found_for_another_managers_workload(
        busybox_image: str, mount_root: Path, names: list[str]) -> None:
    """Regression: #24 finding 4: manager A read B's secret through workload-exec and removed it."""
    name = uniq("pol-own")
    names.append(name)
    async with running_daemon(policy_config(mount_root)) as daemon:
        owner, other = session_as(NOBODY, daemon), session_as(OTHER, daemon)
        reply = await run(owner, image=busybox_image, name=name, detached=True,
                          environment={"SECRET": "s3cret"}, command=["sleep", "60"])
        assert reply.ok, reply.error
        calls: list[tuple[str, dict[str, Any]]] = [
            ("workload-inspect", {}), ("workload-logs", {}),
            ("workload-exec", {"execution": {"command": ["sh", "-c", "echo $SECRET"]}}),
            ("workload-copy-from", {"path": "/etc/hostname", "destination": f"{mount_root}/copied"}),
        ]
        for action, fields in calls:
            answer = await other.runtime(action, name=name, **fields)
            assert not answer.ok and answer.error_code == "not_found", (action, answer.error)
            assert answer.error == f"{action}: no such workload: {name}"
        assert (await other.runtime("workload-remove", name=name)).ok  # absent to this manager: nothing to do
        assert container_exists(name)
        assert not (mount_root / "copied").exists()
        mine = await owner.runtime("workload-exec", name=name, execution={"command": ["sh", "-c", "echo $SECRET"]})
        assert mine.ok and mine.runtime is not None and mine.runtime.output == b"s3cret\n"
        admin = await (await daemon.open_session()).runtime("workload-inspect", name=name)
        assert admin.ok  # root reaches every workload
        assert (await owner.runtime("workload-remove", name=name)).ok
        assert not container_exists(name)


async def test_runtime_images_tag_remove_push_limited_to_the_managers_own_references(
        busybox_image: str, mount_root: Path) -> None:
    """Regression: #24 finding 4: any session could tag, remove or push any image."""
    ref = f"coldsnap-owned/{uniq('img')}:1"
    try:
        async with running_daemon(policy_config(mount_root)) as daemon:
            owner, other = session_as(NOBODY, daemon), session_as(OTHER, daemon)
            assert (await owner.runtime("image-tag", source=busybox_image, target=ref)).ok
            ledger = json.loads((daemon.state_dir / "images.json").read_text())
            assert NOBODY in ledger["owners"].values()
            for action, fields in (("image-remove", {"image": ref}), ("image-push", {"image": ref})):
                reply = await other.runtime(action, **fields)
                assert not reply.ok and f"{ref} was not pulled, built or tagged by this manager's sessions" in str(
                    reply.error), reply.error
            reply = await other.runtime("image-tag", source=busybox_image, target=ref)
            assert not reply.ok and f"{ref} belongs to another manager" in str(reply.error)
            reply = await other.runtime("image-push", image=busybox_image)  # recorded by nobody: not theirs
            assert not reply.ok and "was not pulled, built or tagged by this manager's sessions" in str(reply.error)
            assert docker("image", "inspect", ref, check=False).returncode == 0
            assert (await owner.runtime("image-remove", image=ref)).ok
            assert docker("image", "inspect", ref, check=False).returncode != 0
    finally:
        docker("image", "rm", ref, check=False)


# --- finding 9: configuration --------------------------------------------------------------------


@pytest.mark.parametrize("user", ["", "root", "0", "0:0"])
def test_config_non_root_managers_with_exec_as_root_or_daemon_refused(tmp_path: Path, user: str) -> None:
    """Regression: #24 finding 9: exec.user = "" ran non-root managers' exec as the daemon."""
    path = tmp_path / "c.toml"
    path.write_text(f"[exec]\nuser = \"{user}\"\n[server]\ncontrol_gids = [100]\n")
    with pytest.raises(ConfigError, match=r"exec.user must name an unprivileged account when server.control_uids "
                                          r"or server.control_gids admit non-root managers"):
        load_config(path)
    done = subprocess.run([sys.executable, "-m", "coldsnap_provider", "check-config", str(path)],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 2 and "exec.user must name an unprivileged account" in done.stderr
    served = subprocess.run([sys.executable, "-m", "coldsnap_provider", "serve", "--config", str(path),
                             "--state-dir", str(tmp_path / "state")],
                            capture_output=True, text=True, cwd=ROOT, check=False, timeout=60)
    assert served.returncode == 2 and "exec.user must name an unprivileged account" in served.stderr


@pytest.mark.parametrize(("text", "expected"), [
    pytest.param("[policy]\nmanagers = \"nope\"\n", "policy.managers: no profile 'nope'", id="unknown"),
    pytest.param("[policy.profiles.capsule]\n", "policy.profiles.capsule: 'capsule' is a built-in", id="builtin"),
    pytest.param("[policy.profiles.p]\nmount_roots = [\"/etc/x\"]\n",
                 "policy.profiles.p.mount_roots[0]: '/etc/x' must be a normalised path outside", id="etc-root"),
    pytest.param("[policy.profiles.p]\nmount_roots = [\"/\"]\n", "policy.profiles.p.mount_roots[0]: '/'",
                 id="slash-root"),
    pytest.param("[[policy.assign]]\nprofile = \"capsule\"\n", "policy.assign[0]: names no uids and no gids",
                 id="assign-nobody"),
    pytest.param("[policy.profiles.p]\nprivileged = \"yes\"\n",
                 "Invalid enum value 'yes' - at `$.policy.profiles[...].privileged`", id="privileged"),
    pytest.param("[policy.profiles.p]\ncapabilities = [\"cap_sys_admin\"]\n", "capabilities", id="cap-name"),
    pytest.param("[policy.profiles.p]\nimagez = []\n", "unknown field `imagez`", id="typo"),
    pytest.param("[policy.profiles.p]\nhuggingface_repos = [\"org/ x\"]\n",
                 "at `$.policy.profiles[...].huggingface_repos[0]`", id="hub-pattern"),
])
def test_config_policy_mistakes_refused_naming_the_key(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(path)


def test_embedded_default_config_has_the_policy_section() -> None:
    config = load_config()
    assert config.policy == PolicyConfig()
    assert config.policy.admin == "unrestricted" and config.policy.managers == "capsule"


# --- the pure rules (no daemon: what a remote host gets, where mounts are checked by text) ---------


def _spec(**fields: Any) -> WorkloadRun:
    return WorkloadRun(workload=WorkloadSpec(image="img", **fields))


def test_policy_remote_hosts_checked_by_text_and_choice_by_uid_then_gid() -> None:
    policy = Policy(PolicyConfig(profiles={"wide": ProfileConfig(mount_roots=["/data"], host_network=True)},
                                 assign=[_assign(gids=[500], profile="wide")]), protected=["/data/state"])
    assert policy.profile_for(0, 0).name == "unrestricted"
    assert policy.profile_for(1000, 500).name == "wide"
    assert policy.profile_for(1000, 1000).name == "capsule"
    decision = policy.admit(_spec(network="host", privileged=True, mounts=[_mount("/data/not-here-anyway")]),
                            uid=1000, gid=500, session="s", host="node-b", local=False)
    assert decision.admitted and decision.profile == "wide" and decision.capabilities == CAPSULE_CAPABILITIES
    with pytest.raises(PolicyRefused) as refused:
        policy.admit(_spec(mounts=[_mount("/data")]), uid=1000, gid=500, session="s", host="node-b", local=False)
    assert str(refused.value) == ("workload.mounts[0].source: /data is or contains /data/state, which profile wide "
                                  "never mounts")
    assert refused.value.decision.rule == "protected-paths" and refused.value.decision.value == "/data"
    with pytest.raises(PolicyRefused, match=r"workload\.network: host is refused by profile capsule"):
        policy.admit(_spec(network="host"), uid=1000, gid=1000, session="s", host="h", local=False)


def _assign(**fields: Any) -> Any:
    from coldsnap_provider._config import AssignConfig

    return AssignConfig(**fields)


def _mount(source: str) -> Any:
    from coldsnap_runtime.schema import Mount

    return Mount(source=source, target="/m")


def test_probe_grant_is_what_the_profile_gives_its_privileged_workloads() -> None:
    """Root's (unrestricted) probe runs as [runtime] privileged says, because CRIU's whole `criu check`
    needs a writable ns_last_pid (H200, 2026-12-01); a capabilities profile's probe gets exactly its
    capabilities; neither is on the host's network."""
    from coldsnap_provider._probe import ProbeOptions, criu_workload

    policy = Policy(PolicyConfig(), protected=[])
    assert policy.admit_probe("img", uid=0, gid=0, host_process=False).capabilities is None
    assert policy.admit_probe("img", uid=1000, gid=1000, host_process=False).capabilities == CAPSULE_CAPABILITIES
    assert criu_workload(ProbeOptions(driver="n610", image="img", capabilities=None)).network == "none"

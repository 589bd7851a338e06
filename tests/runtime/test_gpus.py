"""`gpus` and `privileged` realised from host facts (coldsnap_runtime/backend/_gpus.py).

The discovery units read a fake /dev + /proc + driver tree under tmp_path (real files and real
device nodes, made with mknod); the engine round trips talk to the real dockerd through a real
daemon. The H200 round trip (native GPUs, CUDA inside) is scripts/device daemon-gpus.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiodocker
import anyio
import msgspec
import pytest

from coldsnap_provider import Reply
from coldsnap_runtime import DockerBackend
from coldsnap_runtime.backend._gpus import (
    HELD_GPUS_LABEL,
    GpuHolder,
    GpuPolicy,
    HostPolicy,
    cdi_device_names,
    driver_files,
    gpu_conflicts,
    held_gpus,
    native_access,
    parse_inventory,
    realise,
    refuse_held,
    select_gpus,
)
from coldsnap_runtime.backend._host_privilege import (
    CAPABILITY_PROBE_IMAGE,
    engine_process,
    host_devices,
    host_privilege,
    read_bounding_set,
    unknown_capability,
)
from coldsnap_runtime.backend._translate import (
    MANAGED_LABEL,
    GpuAccess,
    PrivilegeGrant,
    capability_names,
    container_config,
    missing_capabilities,
)
from coldsnap_runtime.errors import RuntimeFailed
from coldsnap_runtime.schema import WorkloadSpec
from tests.conftest import docker
from tests.helpers import running_daemon
from tests.probe.test_main import has_nvidia_driver
from tests.runtime.conftest import container_exists, inspect_container, uniq

UUID0 = "GPU-4e9555ec-256a-ac32-a8e8-6df8d49a4ff7"
UUID1 = "GPU-11111111-2222-3333-4444-555555555555"
SMI = f"0, {UUID0}, 00000000:17:00.0\n1, {UUID1}, 00000000:2A:00.0\n"
VM_CAPBND = 0x000001FFFEFFFFFF  # the H200 VM's and this CPU machine's dockerd: no CAP_SYS_RESOURCE


def spec(**fields: object) -> WorkloadSpec:
    return msgspec.convert({"name": "", "image": "capsule:1", **fields}, WorkloadSpec)


def _node(path: Path, minor: int, major: int = 195) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))


def _information(root: Path, bus: str, minor: int, uuid: str) -> None:
    directory = root / "proc/driver/nvidia/gpus" / bus
    directory.mkdir(parents=True)
    (directory / "information").write_text(
        f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"
        f"Device Minor: \t {minor}\nGPU Excluded:\t No\n")


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """Two GPUs (minors 0 and 3, so index and minor differ for the second) and /usr/local/nvidia."""
    _information(tmp_path, "0000:17:00.0", 0, UUID0)
    _information(tmp_path, "0000:2a:00.0", 3, UUID1)
    for name, minor in (("nvidia0", 0), ("nvidia3", 3), ("nvidiactl", 255)):
        _node(tmp_path / "dev" / name, minor)
    _node(tmp_path / "dev/nvidia-uvm", 0, major=508)
    _node(tmp_path / "dev/nvidia-uvm-tools", 1, major=508)
    _node(tmp_path / "dev/null", 3, major=1)
    _node(tmp_path / "dev/loop0", 0, major=7)
    lib = tmp_path / "usr/local/nvidia/lib64"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.580.159.04").write_bytes(b"\x7fELF")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.580.159.04")
    (tmp_path / "usr/local/nvidia/bin").mkdir()
    return tmp_path


class TestInventory:
    def test_parse_inventory_minor_from_proc_bus_normalised(self, host: Path) -> None:
        gpus = parse_inventory(SMI, host)
        assert [(g.index, g.uuid, g.bus_id, g.minor) for g in gpus] == [
            (0, UUID0, "0000:17:00.0", 0), (1, UUID1, "0000:2a:00.0", 3)]

    def test_parse_inventory_gpu_without_proc_entry_left_out(self, tmp_path: Path) -> None:
        _information(tmp_path, "0000:17:00.0", 0, UUID0)
        assert [g.index for g in parse_inventory(SMI, tmp_path)] == [0]

    def test_select_gpus_by_index_and_uuid_dedupes_in_order(self, host: Path) -> None:
        gpus = parse_inventory(SMI, host)
        assert [g.minor for g in select_gpus(["1", UUID0, "0"], gpus)] == [3, 0]

    def test_select_gpus_unknown_id_fails_naming_it(self, host: Path) -> None:
        with pytest.raises(RuntimeFailed, match=r"GPU 7, GPU-nope does not exist on this host \(GPUs here: 0 "):
            select_gpus(["0", "7", "GPU-nope"], parse_inventory(SMI, host))


class TestNative:
    def test_native_access_exactly_the_selected_gpu_nodes(self, host: Path) -> None:
        gpus = select_gpus(["1"], parse_inventory(SMI, host))
        access = native_access(spec(gpus=["1"]), gpus, root=host)
        assert access.devices == ("/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
        assert access.binds == ("/usr/local/nvidia",)
        assert access.environment == {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}

    def test_native_access_library_path_keeps_the_existing_one_after_the_drivers(self, host: Path) -> None:
        gpus = select_gpus(["0"], parse_inventory(SMI, host))
        access = native_access(spec(gpus=["0"]), gpus, root=host, base_library_path="/opt/app/lib")
        assert access.environment == {"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/opt/app/lib"}

    def test_native_access_missing_uvm_node_fails_naming_it(self, host: Path) -> None:
        (host / "dev/nvidia-uvm").unlink()
        gpus = select_gpus(["0"], parse_inventory(SMI, host))
        with pytest.raises(RuntimeFailed, match="needs /dev/nvidia-uvm, which this host lacks"):
            native_access(spec(gpus=["0"]), gpus, root=host)

    def test_native_access_regular_file_is_not_a_device_node(self, host: Path) -> None:
        (host / "dev/nvidia0").unlink()
        (host / "dev/nvidia0").write_text("")
        gpus = select_gpus(["0"], parse_inventory(SMI, host))
        with pytest.raises(RuntimeFailed, match="needs /dev/nvidia0"):
            native_access(spec(gpus=["0"]), gpus, root=host)

    def test_native_access_without_driver_library_fails_pointing_at_the_setting(self, host: Path) -> None:
        (host / "usr/local/nvidia/lib64/libcuda.so.1").unlink()
        gpus = select_gpus(["0"], parse_inventory(SMI, host))
        with pytest.raises(RuntimeFailed, match=r"no driver library \(libcuda.so.1\).*set \[gpus\] driver_paths"):
            native_access(spec(gpus=["0"]), gpus, root=host)

    def test_native_access_paths_the_spec_mounts_or_passes_stay_the_specs(self, host: Path) -> None:
        gpus = select_gpus(["0"], parse_inventory(SMI, host))
        workload = spec(gpus=["0"], mounts=[{"source": "/srv/nv", "target": "/usr/local/nvidia", "read_only": True}],
                        devices=[{"source": "/dev/nvidiactl"}])
        access = native_access(workload, gpus, root=host)
        assert access.binds == () and "/dev/nvidiactl" not in access.devices

    def test_driver_files_system_directory_binds_only_the_drivers_files(self, tmp_path: Path) -> None:
        lib = tmp_path / "usr/lib/x86_64-linux-gnu"
        lib.mkdir(parents=True)
        for name in ("libcuda.so.1", "libcuda.so.580.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1",
                     "libc.so.6", "libcudart.so.12"):
            (lib / name).write_bytes(b"")
        (tmp_path / "usr/bin").mkdir()
        (tmp_path / "usr/bin/nvidia-smi").write_bytes(b"")
        binds, library_dirs = driver_files(tmp_path)
        assert binds == [f"/usr/lib/x86_64-linux-gnu/{n}" for n in (
            "libcuda.so.1", "libcuda.so.580.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1")
        ] + ["/usr/bin/nvidia-smi"]
        assert library_dirs == ["/usr/lib/x86_64-linux-gnu"]

    def test_driver_files_configured_list_is_bound_as_given(self, host: Path) -> None:
        (host / "opt/extra").mkdir(parents=True)
        binds, library_dirs = driver_files(host, ["/usr/local/nvidia", "/opt/extra", "/absent"])
        assert binds == ["/usr/local/nvidia", "/opt/extra"] and library_dirs == ["/usr/local/nvidia/lib64"]

    def test_container_config_native_access_devices_binds_and_environment(self) -> None:
        access = GpuAccess(mechanism="native", devices=("/dev/nvidia0", "/dev/nvidiactl"),
                           binds=("/usr/local/nvidia",), environment={"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"})
        config = container_config(spec(gpus=["0"], environment={"A": "1"}), gpus=access)
        host = config["HostConfig"]
        assert "DeviceRequests" not in host
        assert [d["PathOnHost"] for d in host["Devices"]] == ["/dev/nvidia0", "/dev/nvidiactl"]
        assert all(d["PathInContainer"] == d["PathOnHost"] for d in host["Devices"])
        assert host["Binds"] == ["/usr/local/nvidia:/usr/local/nvidia:ro"]
        assert config["Env"] == ["A=1", "LD_LIBRARY_PATH=/usr/local/nvidia/lib64"]

    def test_container_config_cdi_access_is_a_cdi_device_request(self) -> None:
        config = container_config(spec(gpus=["0"]), gpus=GpuAccess(mechanism="cdi", device_ids=("nvidia.com/gpu=0",)))
        assert config["HostConfig"]["DeviceRequests"] == [{"Driver": "cdi", "DeviceIDs": ["nvidia.com/gpu=0"]}]

    def test_cdi_device_names_from_yaml_and_json_specs(self, tmp_path: Path) -> None:
        (tmp_path / "etc/cdi").mkdir(parents=True)
        (tmp_path / "etc/cdi/nvidia.yaml").write_text(
            'cdiVersion: "0.5.0"\nkind: nvidia.com/gpu\ndevices:\n- name: "0"\n  containerEdits: {}\n'
            f"- name: {UUID0}\n  containerEdits: {{}}\n- name: all\n  containerEdits: {{}}\n")
        (tmp_path / "etc/cdi/other.json").write_text('{"kind": "vendor.com/x", "devices": [{"name": "a"}]}')
        (tmp_path / "etc/cdi/broken.yaml").write_text("kind: [unclosed\n")
        assert cdi_device_names(["/etc/cdi", "/var/run/cdi"], tmp_path) == frozenset(
            {"nvidia.com/gpu=0", f"nvidia.com/gpu={UUID0}", "nvidia.com/gpu=all", "vendor.com/x=a"})


class TestPrivilege:
    def test_missing_capabilities_of_the_vm_bounding_set_is_sys_resource(self) -> None:
        assert missing_capabilities(VM_CAPBND, 40) == ("CAP_SYS_RESOURCE",)
        names = capability_names(VM_CAPBND, 40)
        assert len(names) == 40 and "CAP_SYS_RESOURCE" not in names and names[-1] == "CAP_CHECKPOINT_RESTORE"

    def test_read_bounding_set_from_proc_status(self) -> None:
        assert read_bounding_set("Name:\tdockerd\nCapBnd:\t000001fffeffffff\n") == VM_CAPBND
        assert read_bounding_set("Name:\tx\n") is None

    def test_host_devices_skips_default_nodes_and_excluded(self, host: Path) -> None:
        assert host_devices(host, exclude=["/dev/nvidia3"]) == [
            "/dev/loop0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidiactl"]

    def test_container_config_privilege_grant_replaces_docker_privileged(self) -> None:
        grant = PrivilegeGrant(capabilities=("CAP_SYS_ADMIN", "CAP_SYS_TIME"), devices=("/dev/loop0", "/dev/null"))
        config = container_config(spec(privileged=True, seccomp_unconfined=True,
                                       devices=[{"source": "/dev/null"}]), privilege=grant)
        host = config["HostConfig"]
        assert host["Privileged"] is False and host["CapAdd"] == ["CAP_SYS_ADMIN", "CAP_SYS_TIME"]
        assert [d["PathOnHost"] for d in host["Devices"]] == ["/dev/null", "/dev/loop0"]
        assert host["DeviceCgroupRules"] == ["a *:* rwm"]
        assert host["SecurityOpt"] == ["seccomp=unconfined", "apparmor=unconfined", "label=disable"]
        assert host["MaskedPaths"] == [] and host["ReadonlyPaths"] == []

    def test_container_config_without_grant_keeps_docker_privileged(self) -> None:
        host = container_config(spec(privileged=True))["HostConfig"]
        assert host["Privileged"] is True and "CapAdd" not in host

    def test_unknown_capability_read_from_the_engines_error(self) -> None:
        assert unknown_capability('invalid CapAdd: unknown capability: "CAP_BPF"') == "CAP_BPF"
        assert unknown_capability("No such image: x") is None


# --- the real engine, through a real daemon --------------------------------------------------

engine = pytest.mark.usefixtures("no_leftovers")
_ENGINE_BOUNDING = (engine_process("/var/run/docker.sock") or (None,))[0]
_ENGINE_MISSING = missing_capabilities(_ENGINE_BOUNDING, 40) if _ENGINE_BOUNDING is not None else ()
needs_partial_engine = pytest.mark.skipif(
    not _ENGINE_MISSING, reason="the engine here can grant every capability (Docker's privileged mode works)")


@engine
@needs_partial_engine
async def test_host_capabilities_asks_each_engine_process_once_which_capabilities_it_can_name(tmp_path: Path) -> None:
    """The probe creates (refused by the real engine: nothing is created) run for the first privileged run only."""
    asked: list[list[str]] = []
    socket_path = tmp_path / "engine.sock"  # the same engine, under a path no other test's grant was kept for
    socket_path.symlink_to("/var/run/docker.sock")
    async with aiodocker.Docker() as engine_api:

        async def rejects(caps: list[str]) -> str:
            asked.append(caps)
            try:
                created = await engine_api.containers.create({"Image": CAPABILITY_PROBE_IMAGE,
                                                               "HostConfig": {"CapAdd": caps}})
            except aiodocker.DockerError as exc:
                return str(exc.message)
            await created.delete(force=True)
            return ""

        first = await host_privilege("/", "host-capabilities", str(socket_path), None, rejects)
        probes = len(asked)
        second = await host_privilege("/", "host-capabilities", str(socket_path), None, rejects)
    assert first is not None and second == first and probes >= 1 and len(asked) == probes
    assert not set(_ENGINE_MISSING) & set(first.capabilities)

@engine
@needs_partial_engine
async def test_privileged_docker_policy_missing_capability_refused_before_create(busybox_image: str) -> None:
    name = uniq("priv")
    async with running_daemon() as daemon:
        session = await daemon.open_session()
        reply = await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "detached": True, "privileged": True, "command": ["sleep", "30"]})
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert f"bounding set lacks {', '.join(_ENGINE_MISSING)}" in str(reply.error)
    assert 'privileged = "host-capabilities"' in str(reply.error)
    assert not container_exists(name)


@engine
@needs_partial_engine
async def test_privileged_host_capabilities_runs_with_the_engines_bounding_set(busybox_image: str) -> None:
    assert _ENGINE_BOUNDING is not None
    name = uniq("privcaps")
    async with running_daemon('[runtime]\nprivileged = "host-capabilities"\n') as daemon:
        session = await daemon.open_session()
        reply = await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "detached": True, "privileged": True, "command": ["sleep", "60"]})
        assert reply.ok, reply.error
        try:
            info = inspect_container(name)
            host = info["HostConfig"]
            status = (await session.runtime("workload-exec", name=name, execution={
                "command": ["cat", "/proc/self/status"], "user": ""})).runtime.output.decode()  # type: ignore[union-attr]
        finally:
            assert (await session.runtime("workload-remove", name=name)).ok
    effective = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapEff")), 16)
    granted = {c for c in host["CapAdd"]}
    assert effective & ~_ENGINE_BOUNDING == 0  # nothing beyond what the engine has
    assert {"CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_SYS_TIME", "CAP_NET_ADMIN"} <= granted
    assert "CAP_SYS_RESOURCE" not in granted and effective >> 21 & 1 and effective >> 25 & 1
    assert host["Privileged"] is False and "seccomp=unconfined" in host["SecurityOpt"]
    assert host["DeviceCgroupRules"] == ["a *:* rwm"] and host["Devices"]
    assert "Seccomp:\t0" in status and host["MaskedPaths"] == []


async def run_on_gpu0(image: str, prefix: str, config: str) -> tuple[str, Reply]:
    """A detached `true` with gpus=["0"] through a daemon of `config`: its name and the reply."""
    name = uniq(prefix)
    async with running_daemon(config) as daemon:
        session = await daemon.open_session()
        reply = await session.runtime("workload-run", workload={
            "name": name, "image": image, "detached": True, "gpus": ["0"], "command": ["true"]})
    return name, reply


async def test_native_runs_read_the_inventory_again_only_when_the_drivers_state_changes(host: Path) -> None:
    """nvidia-smi (a script standing in for the driver's tool: no GPU here) runs once per driver state, and a GPU
    swapped in a slot (its `information` changed) is read again; native mode never asks the engine's /info."""
    calls, listing = host / "smi-calls", host / "smi-listing"
    listing.write_text(SMI)
    smi = host / "usr/local/nvidia/bin/nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho run >> {calls}\ncat {listing}\n")
    smi.chmod(0o755)
    (host / "proc/driver/nvidia/version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04\n")
    policy = HostPolicy(gpus=GpuPolicy(mode="native"), root=str(host))

    async def no_info() -> dict[str, object]:
        raise AssertionError("native mode asked the engine's /info")

    async def run(gpu: str) -> tuple[str, ...]:
        realised = await realise(spec(gpus=[gpu], environment={"LD_LIBRARY_PATH": "/x"}), policy, socket_path="",
                                 engine_info=no_info, image_info=no_info, rejects=no_info)
        assert realised.gpus is not None
        return realised.gpus.devices

    assert "/dev/nvidia3" in await run("1") and "/dev/nvidia0" in await run("0")
    assert "/dev/nvidia3" in await run("1") and "/dev/nvidia0" in await run("0")
    assert calls.read_text().count("run") == 1
    swapped = "GPU-99999999-2222-3333-4444-555555555555"
    info = host / "proc/driver/nvidia/gpus/0000:2a:00.0/information"
    info.write_text(info.read_text().replace(UUID1, swapped).replace("Device Minor: \t 3", "Device Minor: \t 0"))
    listing.write_text(SMI.replace(UUID1, swapped))
    assert "/dev/nvidia0" in await run(swapped)
    assert calls.read_text().count("run") == 2
    with pytest.raises(RuntimeFailed, match=UUID1):  # the swapped-out GPU is unknown now
        await run(UUID1)
    (host / "proc/driver/nvidia/version").unlink()  # no driver state to compare: read every time
    await run("0")
    await run("0")
    assert calls.read_text().count("run") == 4


@engine
async def test_gpus_device_request_mode_without_nvidia_runtime_fails_before_create(busybox_image: str) -> None:
    name, reply = await run_on_gpu0(busybox_image, "gpudr", '[gpus]\nmode = "device-request"\n')
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert "device-request: the engine has no registered 'nvidia' runtime" in str(reply.error)
    assert "native" not in str(reply.error)
    assert not container_exists(name)


@engine
async def test_gpus_auto_mode_no_mechanism_names_every_reason(busybox_image: str) -> None:
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this host has an NVIDIA driver")
    name = uniq("gpuauto")
    async with running_daemon() as daemon:
        session = await daemon.open_session()
        reply = await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "gpus": ["0"], "command": ["true"]})
    error = str(reply.error)
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert "no mechanism can give this container GPU 0 ([gpus] mode = 'auto')" in error
    assert "device-request:" in error and "cdi:" in error and "native:" in error
    assert not container_exists(name)


# --- [gpus] exclusive ------------------------------------------------------------------------


class TestExclusive:
    def test_held_gpus_index_and_uuid_are_one_gpu(self, host: Path) -> None:
        inventory = parse_inventory(SMI, host)
        assert held_gpus(["0", UUID0.lower()], inventory) == (UUID0,)
        assert held_gpus(["1", "0", UUID1], inventory) == (UUID1, UUID0)

    def test_held_gpus_all_holds_every_gpu(self, host: Path) -> None:
        assert held_gpus(["all"], parse_inventory(SMI, host)) == (UUID0, UUID1)
        assert held_gpus(["ALL", "0"], None) == ("all", "0")

    def test_held_gpus_without_inventory_are_the_ids_as_given(self) -> None:
        assert held_gpus(["0", UUID0, "0"], None) == ("0", UUID0)
        assert held_gpus(["0"], []) == ("0",)

    def test_refuse_held_holder_recorded_by_index_refuses_the_uuid_naming_gpu_and_holder(self, host: Path) -> None:
        inventory = parse_inventory(SMI, host)
        holders = [GpuHolder(workload="capsule-a", gpus=("0",)), GpuHolder(workload="capsule-b", gpus=(UUID1,))]
        with pytest.raises(RuntimeFailed, match=(
                rf"^workload-run failed: gpus: GPU 0 \({UUID0}\) is held by workload 'capsule-a', "
                r"and \[gpus\] exclusive = true gives a GPU to one managed workload at a time$")):
            refuse_held(held_gpus([UUID0], inventory), holders, inventory)

    def test_refuse_held_every_overlap_named(self, host: Path) -> None:
        inventory = parse_inventory(SMI, host)
        holders = [GpuHolder(workload="a", gpus=(UUID1,)), GpuHolder(workload="b", gpus=("all",))]
        assert gpu_conflicts(held_gpus(["1"], inventory), holders, inventory) == [(UUID1, "a"), (UUID1, "b")]
        with pytest.raises(RuntimeFailed, match=rf"GPU 1 \({UUID1}\) is held by workload 'a'; GPU 1 .* 'b'"):
            refuse_held(held_gpus(["1"], inventory), holders, inventory)

    def test_refuse_held_disjoint_gpus_pass(self, host: Path) -> None:
        inventory = parse_inventory(SMI, host)
        holders = [GpuHolder(workload="a", gpus=(UUID1,)), GpuHolder(workload="b", gpus=())]
        assert gpu_conflicts(held_gpus(["0"], inventory), holders, inventory) == []
        refuse_held(held_gpus(["0"], inventory), holders, inventory)

    def test_gpu_conflicts_all_without_inventory_overlaps_every_gpu(self) -> None:
        assert gpu_conflicts(("0", "3"), [GpuHolder(workload="h", gpus=("all",))], None) == [("0", "h"), ("3", "h")]
        assert gpu_conflicts(("all",), [GpuHolder(workload="h", gpus=("5",))], None) == [("5", "h")]
        with pytest.raises(RuntimeFailed, match=r"gpus: every GPU \(all\) is held by workload 'h'"):
            refuse_held(("all",), [GpuHolder(workload="h", gpus=("all",))], None)

    def test_gpu_conflicts_without_inventory_compares_ids_as_given(self) -> None:
        """No NVML: nothing can say `0` is that UUID (documented in _gpus.py and the README)."""
        assert gpu_conflicts((UUID0,), [GpuHolder(workload="h", gpus=("0",))], None) == []
        assert gpu_conflicts(("0",), [GpuHolder(workload="h", gpus=("0",))], None) == [("0", "h")]


def _holder(image: str, gpus: str, *, state: str = "running", managed: bool = True) -> str:
    """A real container carrying the holder labels (made with the Docker CLI), in `state`."""
    name = uniq("gpuhold")
    labels = ["--label", f"{HELD_GPUS_LABEL}={gpus}"] + (["--label", f"{MANAGED_LABEL}=true"] if managed else [])
    if state == "created":
        docker("create", "--name", name, *labels, image, "sleep", "60")
    elif state == "exited":
        docker("run", "--name", name, *labels, image, "true")
    else:
        docker("run", "-d", "--name", name, *labels, image, "sleep", "60")
        if state == "paused":
            docker("pause", name)
    assert inspect_container(name)["State"]["Status"] == state
    return name


@pytest.fixture
def holders() -> Iterator[list[str]]:
    """Names of holder containers a test made; removed afterwards."""
    made: list[str] = []
    yield made
    for name in made:
        docker("rm", "-f", name, check=False)


@engine
async def test_gpu_holders_every_state_but_exited_holds(busybox_image: str, holders: list[str]) -> None:
    created = _holder(busybox_image, "0", state="created")
    running = _holder(busybox_image, f"{UUID0},{UUID1}")
    paused = _holder(busybox_image, "1", state="paused")
    exited = _holder(busybox_image, "0", state="exited")
    unmanaged = _holder(busybox_image, "0", managed=False)
    holders += [created, running, paused, exited, unmanaged]
    async with DockerBackend() as backend:
        found = {h.workload: h.gpus for h in await backend.gpu_holders() if h.workload in holders}
    assert found == {created: ("0",), running: (UUID0, UUID1), paused: ("1",)}


no_driver = pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this host has an NVIDIA driver")
_EXCLUSIVE = "[gpus]\nexclusive = true\n"


@engine
@no_driver
async def test_gpus_exclusive_gpu_held_by_another_workload_refused_naming_both(
        busybox_image: str, holders: list[str]) -> None:
    holder = _holder(busybox_image, "3,0")
    holders.append(holder)
    name, reply = await run_on_gpu0(busybox_image, "gpuexcl", _EXCLUSIVE)
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert f"gpus: GPU 0 is held by workload {holder!r}" in str(reply.error)
    assert "no mechanism" not in str(reply.error)  # refused before any mechanism is tried
    assert not container_exists(name)


@engine
@no_driver
async def test_gpus_exclusive_exited_holder_and_other_gpus_do_not_hold(busybox_image: str,
                                                                       holders: list[str]) -> None:
    holders += [_holder(busybox_image, "0", state="exited"), _holder(busybox_image, "1"),
                _holder(busybox_image, "0", managed=False)]
    name, reply = await run_on_gpu0(busybox_image, "gpuexcl", _EXCLUSIVE)
    # The check passed: what fails is this GPU-less host, as without exclusivity.
    assert not reply.ok and "no mechanism can give this container GPU 0" in str(reply.error)
    assert "held by" not in str(reply.error)
    assert not container_exists(name)


@engine
@no_driver
async def test_gpus_not_exclusive_held_gpu_is_shared(busybox_image: str, holders: list[str]) -> None:
    holders.append(_holder(busybox_image, "0"))
    name, reply = await run_on_gpu0(busybox_image, "gpushare", "")
    assert not reply.ok and "no mechanism can give this container GPU 0" in str(reply.error)
    assert "held by" not in str(reply.error)
    assert not container_exists(name)


@engine
@no_driver
@pytest.mark.parametrize(("route", "workload"), [
    pytest.param("devices", {"devices": [{"source": "/dev/nvidia0"}]}, id="device-node"),
    pytest.param("environment.NVIDIA_VISIBLE_DEVICES", {"environment": {"NVIDIA_VISIBLE_DEVICES": "0"}}, id="env"),
    pytest.param("privileged", {"privileged": True}, id="privileged"),
])
async def test_gpus_exclusive_gpu_reached_around_gpus_refused_naming_the_route(
        busybox_image: str, holders: list[str], route: str, workload: dict[str, object]) -> None:
    """Regression: #24 finding 6: a GPU reached through devices, NVIDIA_VISIBLE_DEVICES or privileged."""
    holder = _holder(busybox_image, "0")
    holders.append(holder)
    name = uniq("gpuroute")
    config = _EXCLUSIVE + "[runtime]\nprivileged = \"host-capabilities\"\n"
    async with running_daemon(config) as daemon:
        reply = await (await daemon.open_session()).runtime("workload-run", workload={
            "name": name, "image": busybox_image, "detached": True, "command": ["true"], **workload})
    assert not reply.ok and reply.error_code == "runtime_failed"
    assert f"{route}: " in str(reply.error) and f"is held by workload {holder!r}" in str(reply.error), reply.error
    assert not container_exists(name)


@engine
@no_driver
async def test_gpus_exclusive_privileged_workload_holds_every_gpu(busybox_image: str, holders: list[str]) -> None:
    """Regression: #24 finding 6: a privileged container sees every /dev/nvidia*: it holds them all."""
    name = uniq("gpupriv")
    holders.append(name)
    config = _EXCLUSIVE + "[runtime]\nprivileged = \"host-capabilities\"\n"
    async with running_daemon(config) as daemon:
        session = await daemon.open_session()
        reply = await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "detached": True, "privileged": True, "command": ["sleep", "60"]})
        assert reply.ok, reply.error
        assert inspect_container(name)["Config"]["Labels"][HELD_GPUS_LABEL] == "all"
    assert inspect_container(name)["State"]["Running"]  # still holding (a shared engine: nobody removed it)
    second, refused = await run_on_gpu0(busybox_image, "gpuafter", _EXCLUSIVE)
    assert not refused.ok and f"gpus: GPU 0 is held by workload {name!r}" in str(refused.error), refused.error
    assert not container_exists(second)


@engine
async def test_workload_run_managers_own_held_gpus_label_is_dropped(busybox_image: str) -> None:
    """A manager cannot claim GPUs it was not given (and so block other managers' workloads)."""
    name = uniq("gpulabel")
    async with running_daemon(_EXCLUSIVE) as daemon:
        session = await daemon.open_session()
        reply = await session.runtime("workload-run", workload={
            "name": name, "image": busybox_image, "detached": True, "command": ["sleep", "30"],
            "labels": {HELD_GPUS_LABEL: "0", "mine": "kept"}})
        assert reply.ok, reply.error
        try:
            labels = inspect_container(name)["Config"]["Labels"]
        finally:
            assert (await session.runtime("workload-remove", name=name)).ok
    assert labels["mine"] == "kept" and HELD_GPUS_LABEL not in labels


def _gpu0_uuid() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return next(uuid.strip() for index, _, uuid in (line.partition(",") for line in out.splitlines())
                if index.strip() == "0")


@engine
@pytest.mark.skipif(not has_nvidia_driver() or shutil.which("nvidia-smi") is None,
                    reason="needs an NVIDIA driver and nvidia-smi (run on the GPU host)")
async def test_gpus_exclusive_index_then_uuid_of_gpu_0_second_refused_and_one_of_two_racing_wins(
        busybox_image: str) -> None:
    uuid0 = _gpu0_uuid()
    first, second, third = uniq("gpu0a"), uniq("gpu0b"), uniq("gpu0c")
    workload = {"image": busybox_image, "detached": True, "network": "none", "command": ["sleep", "60"]}
    async with running_daemon(_EXCLUSIVE) as daemon:
        session = await daemon.open_session()
        ran = await session.runtime("workload-run", workload={**workload, "name": first, "gpus": ["0"]})
        assert ran.ok, ran.error
        try:
            held = inspect_container(first)["Config"]["Labels"][HELD_GPUS_LABEL]
            refused = await session.runtime("workload-run", workload={**workload, "name": second, "gpus": [uuid0]})
            second_exists = container_exists(second)
        finally:
            assert (await session.runtime("workload-remove", name=first)).ok
            await session.runtime("workload-remove", name=second)
        # Released with its container: the UUID runs now.
        freed = await session.runtime("workload-run", workload={**workload, "name": third, "gpus": [uuid0]})
        assert (await session.runtime("workload-remove", name=third)).ok
        # Two at once, by index and by UUID: exactly one wins.
        raced: dict[str, bool] = {}

        async def race(name: str, gpu: str) -> None:
            raced[name] = (await session.runtime("workload-run", workload={**workload, "name": name,
                                                                             "gpus": [gpu]})).ok

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(race, first, "0")
                tg.start_soon(race, second, uuid0)
            raced_exist = {name: container_exists(name) for name in raced}
        finally:
            for name in (first, second):
                assert (await session.runtime("workload-remove", name=name)).ok
    assert held == uuid0
    assert not refused.ok and refused.error_code == "runtime_failed"
    assert f"gpus: GPU 0 ({uuid0}) is held by workload {first!r}" in str(refused.error)
    assert not second_exists
    assert freed.ok, freed.error
    assert sorted(raced.values()) == [False, True] and raced_exist == raced

"""Host facts behind `gpus` and `privileged`, and how each is realised (DESIGN decision 9, issue 12).

``gpus`` reaches a container by the first mechanism the host supports, chosen by ``[gpus] mode``:

* ``device-request``: the engine has a registered ``nvidia`` runtime (NVIDIA's container toolkit);
  the engine's own ``DeviceRequests`` (driver ``nvidia``) carry the exact IDs.
* ``cdi``: the engine resolves CDI devices (its ``/info`` lists CDI spec directories) and a spec
  there declares ``nvidia.com/gpu=<id>`` for every requested ID.
* ``native``: no toolkit at all. Each requested ID is resolved through NVML (``nvidia-smi``) to its
  PCI bus id, whose ``/proc/driver/nvidia/gpus/<bus>/information`` gives the device minor; the
  container gets exactly ``/dev/nvidia<minor>`` of those GPUs plus ``nvidiactl``, ``nvidia-uvm`` and
  ``nvidia-uvm-tools``, read-only binds of the driver's user-space libraries and binaries (discovered
  on the host, or the configured list) at their host paths, and their library directories on
  ``LD_LIBRARY_PATH`` (after the spec's or the image's own value).

``auto`` tries them in that order. A request no mechanism can honour fails naming every reason,
and so does an ID the host does not have: a workload never runs without the GPUs it asked for.

Exclusivity (``[gpus] exclusive``): every managed container with `gpus` records what it holds in
the HELD_GPUS_LABEL label at create, as GPU UUIDs resolved through the same NVML inventory (so
index ``0`` and the UUID of GPU 0 are one GPU; ``all`` is every GPU). Without an inventory (no
``nvidia-smi``, e.g. device-request mode on a host without the driver's tools) nothing can say
that ``0`` and a UUID are the same GPU, so the IDs are recorded and compared as given. With
``exclusive = true`` a request overlapping what a managed container in any state but exited or
dead holds (:func:`refuse_held`) fails before anything is created; the backend lists the holders
and serialises that check with its create (``DockerBackend._create``).

``privileged`` under ``[runtime] privileged`` (the host side is ``_host_privilege.py``):

* ``docker`` (default): Docker's own ``Privileged``. Docker then asks the kernel for every
  capability; where the engine's bounding set lacks one (these VMs lack CAP_SYS_RESOURCE) runc
  fails late with "unable to apply caps". That is detected before anything is created, by reading
  the engine's ``CapBnd`` (its pid from SO_PEERCRED on the engine socket), and refused naming the
  missing capabilities.
* ``host-capabilities``: the same request realised as every capability in that bounding set, every
  host device, and seccomp, AppArmor, SELinux labels and the masked /proc paths unconfined. Used
  only where Docker's own privileged mode cannot work; logged every time.

Everything that reads the host takes a ``root`` (default ``/``) so the discovery is a pure function
of a directory tree; the engine is asked through two callables the backend passes in.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from ..errors import RuntimeFailed
from ..schema import WorkloadSpec
from ._host_privilege import GPU_NODE, PrivilegedPolicy, host_privilege
from ._translate import GpuAccess, PrivilegeGrant

__all__ = (
    "DEFAULT_LIBRARY_DIRS",
    "HELD_GPUS_LABEL",
    "GpuHolder",
    "GpuMode",
    "GpuPolicy",
    "HostGpu",
    "HostPolicy",
    "Realisation",
    "cdi_device_names",
    "driver_files",
    "gpu_conflicts",
    "gpu_routes",
    "held_gpus",
    "native_access",
    "parse_inventory",
    "reached_gpus",
    "realise",
    "refuse_held",
    "select_gpus",
)

GpuMode = Literal["auto", "device-request", "cdi", "native"]
_ACTION = "workload-run"
_NVIDIA_SMI_TIMEOUT_S = 30.0

# Where a driver installs libcuda.so.1, most specific first (a driver-only tree before system dirs).
DEFAULT_LIBRARY_DIRS = (
    "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib",
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
    "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64",
)
_BIN_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/bin")
# The driver's user-space files in a shared system directory (binds are per file there).
_DRIVER_LIBRARY = re.compile(r"^(libcuda|libcudadebugger|libnvidia-[a-z0-9-]+|libnvcuvid|libnvoptix)\.so(\.[0-9.]+)?$")
_DRIVER_BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced",
                    "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
# On every managed container given `gpus`: what it holds, comma-separated (GPU ids never hold a
# comma): NVML UUIDs, or the IDs as requested where no inventory could be had. Set only by the
# backend (a manager's own label of this name is dropped), read by the exclusivity check.
HELD_GPUS_LABEL = "io.coldsnap-provider.gpus"
_ALL = "all"  # `gpus = ["all"]`: every GPU of the host


@dataclass(frozen=True, slots=True)
class GpuPolicy:
    """``[gpus]``: the mechanism, an optional fixed list of driver paths to bind (native mode), and
    whether a GPU may be given to only one managed workload at a time (``exclusive``)."""

    mode: GpuMode = "auto"
    driver_paths: tuple[str, ...] = ()  # () = discover under DEFAULT_LIBRARY_DIRS
    exclusive: bool = False  # Docker's own rule (GPUs are shared) unless an administrator says so


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """What the administrator chose for GPUs and privilege, plus the host root (``/`` except in tests).

    `root` None: the engine's host is another node, whose files this process cannot read (a remote node).
    Nothing of this node is then read for it: no GPU inventory (native mode is impossible, GPU ids are
    compared as written), no CDI specs (the engine resolves the names itself), no capability bounding
    set (``privileged`` is Docker's own).
    """

    gpus: GpuPolicy = GpuPolicy()
    privileged: PrivilegedPolicy = "docker"
    root: str | None = "/"


@dataclass(frozen=True, slots=True)
class HostGpu:
    """One GPU as NVML numbers it, with its device minor (``/dev/nvidia<minor>``)."""

    index: int
    uuid: str
    bus_id: str  # normalised: 4-digit domain, lower case, e.g. 0000:17:00.0
    minor: int


@dataclass(frozen=True, slots=True)
class GpuHolder:
    """A managed container that holds GPUs: its workload (container) name and its HELD_GPUS_LABEL entries."""

    workload: str
    gpus: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Realisation:
    """What :func:`realise` decided for one spec; `held` goes into HELD_GPUS_LABEL (() = no `gpus`)."""

    gpus: GpuAccess | None = None
    privilege: PrivilegeGrant | None = None
    held: tuple[str, ...] = ()


# --- pure parsing ---------------------------------------------------------------------------


def _normalise_bus(bus_id: str) -> str:
    """NVML prints an 8-digit PCI domain, /proc/driver/nvidia uses 4: compare on the short form."""
    domain, sep, rest = bus_id.strip().lower().partition(":")
    if not sep:
        return bus_id.strip().lower()
    return f"{domain[-4:].rjust(4, '0')}:{rest}"


def _proc_information(root: Path, bus_id: str) -> dict[str, str]:
    path = root / "proc/driver/nvidia/gpus" / bus_id / "information"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def parse_inventory(csv: str, root: str | os.PathLike[str] = "/") -> list[HostGpu]:
    """GPUs from ``nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader`` output.

    The minor of each comes from ``/proc/driver/nvidia/gpus/<bus>/information`` under `root`;
    a GPU whose minor cannot be read is left out (it cannot be given to a container natively).
    """
    gpus: list[HostGpu] = []
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        bus = _normalise_bus(parts[2])
        minor = _proc_information(Path(root), bus).get("Device Minor", "")
        if not minor.isdigit():
            continue
        gpus.append(HostGpu(index=int(parts[0]), uuid=parts[1], bus_id=bus, minor=int(minor)))
    return gpus


def select_gpus(requested: Sequence[str], inventory: Sequence[HostGpu]) -> list[HostGpu]:
    """Exactly the requested GPUs (by NVML index or UUID), in request order, without duplicates."""
    chosen: list[HostGpu] = []
    unknown: list[str] = []
    for wanted in requested:
        match = next((g for g in inventory if (wanted.isdigit() and g.index == int(wanted))
                      or g.uuid.lower() == wanted.lower()), None)
        if match is None:
            unknown.append(wanted)
        elif match not in chosen:
            chosen.append(match)
    if unknown:
        have = ", ".join(f"{g.index} ({g.uuid})" for g in inventory) or "none"
        raise RuntimeFailed(action=_ACTION, detail=(
            f"GPU {', '.join(unknown)} does not exist on this host (GPUs here: {have})"))
    return chosen


def _identities(gpu_id: str, inventory: Sequence[HostGpu] | None) -> list[str]:
    """What `gpu_id` is: the UUIDs of the inventory's GPUs it names, else the ID as given."""
    if inventory:
        if gpu_id.lower() == _ALL:
            return [g.uuid for g in inventory]
        for gpu in inventory:
            if (gpu_id.isdigit() and gpu.index == int(gpu_id)) or gpu.uuid.lower() == gpu_id.lower():
                return [gpu.uuid]
    # No inventory (or an ID it does not know): the ID itself is all there is to compare, so here
    # `0` and a UUID are different GPUs (a holder recorded so is still matched once NVML answers).
    return [_ALL if gpu_id.lower() == _ALL else gpu_id]


def held_gpus(requested: Sequence[str], inventory: Sequence[HostGpu] | None) -> tuple[str, ...]:
    """The GPUs a container given `requested` holds, in request order, without duplicates.

    With an inventory, each is its NVML UUID (index or UUID name the same GPU; ``all`` is every
    GPU); without one (None or empty), the IDs as given.
    """
    held: list[str] = []
    for gpu_id in requested:
        held.extend(i for i in _identities(gpu_id, inventory) if i not in held)
    return tuple(held)


def _describe(identity: str, inventory: Sequence[HostGpu] | None) -> str:
    gpu = next((g for g in inventory or () if g.uuid == identity), None)
    if gpu is not None:
        return f"GPU {gpu.index} ({gpu.uuid})"
    return "every GPU (all)" if identity.lower() == _ALL else f"GPU {identity}"


def gpu_conflicts(wanted: Sequence[str], holders: Sequence[GpuHolder],
                  inventory: Sequence[HostGpu] | None) -> list[tuple[str, str]]:
    """(GPU, holder's workload) for every GPU of `wanted` (held_gpus' output) a holder already has.

    A holder's entries are resolved through the same inventory, so one recorded as an index (when
    no inventory could be had) still matches the UUID of that GPU. ``all`` without an inventory
    overlaps every GPU (what it stands for cannot be listed).
    """
    mine = set(wanted)
    conflicts: list[tuple[str, str]] = []
    for holder in holders:
        theirs = set(held_gpus(holder.gpus, inventory))
        if not theirs:
            continue
        if _ALL in mine or _ALL in theirs:
            shared = sorted(mine if _ALL in theirs else theirs)
        else:
            shared = [g for g in wanted if g in theirs]
        for gpu in shared:
            if (gpu, holder.workload) not in conflicts:
                conflicts.append((gpu, holder.workload))
    return conflicts


def refuse_held(wanted: Sequence[str], holders: Sequence[GpuHolder], inventory: Sequence[HostGpu] | None, *,
                via: str = "gpus") -> None:
    """RuntimeFailed naming the field(s) (`via`), each GPU and its holder when `wanted` overlaps a holder's GPUs."""
    conflicts = gpu_conflicts(wanted, holders, inventory)
    if not conflicts:
        return
    held = "; ".join(f"{_describe(gpu, inventory)} is held by workload {workload!r}" for gpu, workload in conflicts)
    raise RuntimeFailed(action=_ACTION, detail=(
        f"{via}: {held}, and [gpus] exclusive = true gives a GPU to one managed workload at a time"))


_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


def gpu_routes(spec: WorkloadSpec, capabilities: tuple[str, ...] | None = None) -> list[str]:
    """The fields through which `spec` reaches GPUs (issue 24, finding 6): `gpus`, a /dev/nvidia<N>
    device, NVIDIA_VISIBLE_DEVICES (the NVIDIA runtime hook honours it), and `privileged` as the whole
    host (every /dev/nvidia* node; not a profile's capability grant, which adds no device)."""
    routes = ["gpus"] if spec.gpus else []
    if any(GPU_NODE.match(d.source) for d in spec.devices):
        routes.append("devices")
    if spec.environment.get(_VISIBLE_DEVICES, "").strip().lower() not in ("", "none", "void"):
        routes.append(f"environment.{_VISIBLE_DEVICES}")
    if spec.privileged and capabilities is None:
        routes.append("privileged")
    return routes


def reached_gpus(spec: WorkloadSpec, inventory: Sequence[HostGpu] | None,
                 capabilities: tuple[str, ...] | None = None) -> list[str]:
    """GPU IDs `spec` reaches by every route of :func:`gpu_routes` (held_gpus resolves them). A device
    node whose minor the inventory cannot name, and privileged as the whole host, reach every GPU."""
    ids = list(spec.gpus)
    for device in spec.devices:
        if GPU_NODE.match(device.source):
            minor = int(device.source[len("/dev/nvidia"):])
            ids.append(next((g.uuid for g in inventory or () if g.minor == minor), _ALL))
    visible = spec.environment.get(_VISIBLE_DEVICES, "").strip()
    if visible.lower() not in ("", "none", "void"):
        ids += [g.strip() for g in visible.split(",") if g.strip()]
    if spec.privileged and capabilities is None:
        ids.append(_ALL)
    return ids


def _is_char_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(path.stat().st_mode)
    except OSError:
        return False


def driver_files(root: str | os.PathLike[str] = "/", paths: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(host paths to bind read-only, library directories) of the driver's user-space side.

    With `paths` (the configured list) exactly those are bound; their directories holding
    ``libcuda.so.1`` (the path itself, or its ``lib64``/``lib``) are the library directories.
    Otherwise the first of DEFAULT_LIBRARY_DIRS holding ``libcuda.so.1`` decides: inside a
    driver-only tree (a path with an ``nvidia`` component, as ``/usr/local/nvidia/lib64``) the whole
    tree is bound; in a shared system directory only the driver's own libraries and binaries are.
    """
    base = Path(root)

    def exists(path: str) -> bool:
        return os.path.lexists(base / path.lstrip("/"))

    if paths:
        library_dirs = [d for p in paths for d in (p, f"{p}/lib64", f"{p}/lib")
                        if exists(f"{d}/libcuda.so.1")]
        return [p for p in paths if exists(p)], library_dirs
    for directory in DEFAULT_LIBRARY_DIRS:
        if not exists(f"{directory}/libcuda.so.1"):
            continue
        parts = Path(directory).parts
        tree = next((i for i, part in enumerate(parts) if "nvidia" in part.lower()), None)
        if tree is not None:
            return [str(Path(*parts[:tree + 1]))], [directory]
        names = sorted(n for n in os.listdir(base / directory.lstrip("/")) if _DRIVER_LIBRARY.match(n))
        binaries = [f"{d}/{b}" for b in _DRIVER_BINARIES for d in _BIN_DIRS[1:] if exists(f"{d}/{b}")]
        return [f"{directory}/{n}" for n in names] + binaries, [directory]
    return [], []


def native_access(spec: WorkloadSpec, gpus: Sequence[HostGpu], *, root: str | os.PathLike[str] = "/",
                  driver_paths: Sequence[str] = (), base_library_path: str = "") -> GpuAccess:
    """The native realisation of `gpus` (see the module docstring); fails naming what is missing."""
    base = Path(root)
    nodes = [f"/dev/nvidia{g.minor}" for g in gpus] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    missing = [n for n in nodes if not _is_char_device(base / n.lstrip("/"))]
    if missing:
        raise RuntimeFailed(action=_ACTION, detail=(
            f"native GPU access needs {', '.join(missing)}, which this host lacks (is the driver loaded?)"))
    if _is_char_device(base / "dev/nvidia-uvm-tools"):
        nodes.append("/dev/nvidia-uvm-tools")
    binds, library_dirs = driver_files(base, driver_paths)
    if not library_dirs:
        where = ", ".join(driver_paths) if driver_paths else ", ".join(DEFAULT_LIBRARY_DIRS)
        raise RuntimeFailed(action=_ACTION, detail=(
            f"native GPU access found no driver library (libcuda.so.1) under {where}; "
            "set [gpus] driver_paths"))
    # A path the spec already mounts or passes is the spec's (Docker refuses duplicate targets).
    taken = {m.target for m in spec.mounts}
    given = {d.target or d.source for d in spec.devices}
    binds = [b for b in binds if not any(b == t or b.startswith(t.rstrip("/") + "/") for t in taken)]
    nodes = [n for n in nodes if n not in given]
    library_path = ":".join([*library_dirs, *([base_library_path] if base_library_path else [])])
    return GpuAccess(mechanism="native", devices=tuple(nodes), binds=tuple(binds),
                     environment={"LD_LIBRARY_PATH": library_path})


def cdi_device_names(spec_dirs: Sequence[str], root: str | os.PathLike[str] = "/") -> frozenset[str]:
    """Fully qualified CDI device names (``vendor/class=name``) declared by the specs in `spec_dirs`."""
    names: set[str] = set()
    for directory in spec_dirs:
        path = Path(root) / directory.lstrip("/")
        try:
            entries = sorted(path.iterdir())
        except OSError:
            continue
        for entry in entries:
            document = _load_cdi(entry)
            kind = document.get("kind") if isinstance(document, dict) else None
            devices = document.get("devices") if isinstance(document, dict) else None
            if not isinstance(kind, str) or not isinstance(devices, list):
                continue
            names.update(f"{kind}={d['name']}" for d in devices
                         if isinstance(d, dict) and isinstance(d.get("name"), str))
    return frozenset(names)


def _load_cdi(path: Path) -> Any:
    if path.suffix not in (".json", ".yaml", ".yml"):
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        yaml: Any = importlib.import_module("yaml")  # CDI specs are usually YAML; without PyYAML, JSON only
    except ImportError:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


# --- host I/O -----------------------------------------------------------------------------------


def _nvidia_smi(root: str, driver_paths: Sequence[str]) -> str | None:
    if root == "/" and (found := shutil.which("nvidia-smi")):
        return found
    candidates = [f"{p}/bin/nvidia-smi" for p in driver_paths] + [f"{d}/nvidia-smi" for d in _BIN_DIRS]
    for candidate in candidates:
        path = Path(root) / candidate.lstrip("/")
        if os.access(path, os.X_OK):
            return str(path)
    return None


# The last inventory nvidia-smi gave, per (root, nvidia-smi): with the driver state it was read in. nvidia-smi (NVML's
# start) cost every GPU workload-run, a restore's included, tens of milliseconds; what it lists changes only with
# that state.
_INVENTORIES: dict[tuple[str, str], tuple[str, list[HostGpu]]] = {}


def _driver_state(root: str) -> str | None:
    """What the inventory is a function of: the kernel module's version and every GPU's ``information`` (its bus,
    UUID and minor), from procfs under `root`; None where that cannot be read (nothing is then kept)."""
    base = Path(root) / "proc/driver/nvidia"
    try:
        parts = [(base / "version").read_text()]
        for bus in sorted(os.listdir(base / "gpus")):
            parts.append(f"{bus}\n{(base / 'gpus' / bus / 'information').read_text()}")
    except OSError:
        return None
    return "\0".join(parts)


async def _inventory(policy: HostPolicy) -> list[HostGpu] | str:
    """The host's GPUs through NVML, or why they cannot be listed; read again only when the driver's state
    changed (a GPU added, removed or swapped, the module reloaded)."""
    if policy.root is None:
        return "the engine's node is another host, whose GPUs cannot be listed from here"
    smi = _nvidia_smi(policy.root, policy.gpus.driver_paths)
    if smi is None:
        return "nvidia-smi (NVML) was not found, so GPU ids cannot be resolved"
    state = _driver_state(policy.root)
    kept = _INVENTORIES.get((policy.root, smi))
    if state is not None and kept is not None and kept[0] == state:
        return list(kept[1])
    found = await _smi_inventory(smi, policy.root)
    if state is not None and not isinstance(found, str) and _driver_state(policy.root) == state:
        _INVENTORIES[policy.root, smi] = (state, list(found))
    return found


async def _smi_inventory(smi: str, root: str) -> list[HostGpu] | str:
    """nvidia-smi's GPUs, with their minors under `root`, or why they could not be had."""
    try:
        with anyio.fail_after(_NVIDIA_SMI_TIMEOUT_S):
            done = await anyio.run_process([smi, "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"],
                                           check=False)
    except (OSError, TimeoutError) as exc:
        return f"nvidia-smi could not be run: {exc}"
    if done.returncode != 0:
        text = (done.stdout + done.stderr).decode(errors="replace").strip()
        return f"nvidia-smi exited {done.returncode}: {text[-500:]}"
    return parse_inventory(done.stdout.decode(errors="replace"), root)


def _env_value(env: Sequence[str], key: str) -> str:
    prefix = f"{key}="
    return next((item[len(prefix):] for item in env if item.startswith(prefix)), "")


EngineInfo = Callable[[], Awaitable[dict[str, Any]]]
ImageInfo = Callable[[str], Awaitable[dict[str, Any]]]


async def _gpu_access(spec: WorkloadSpec, policy: HostPolicy, inventory: list[HostGpu] | str,
                      engine_info: EngineInfo, image_info: ImageInfo) -> GpuAccess:
    mode = policy.gpus.mode
    # The engine's /info only where a mechanism asks it (native mode never does: one round trip less per run).
    info = await engine_info() if mode != "native" else {}
    reasons: list[str] = []
    if mode in ("auto", "device-request"):
        if "nvidia" in (info.get("Runtimes") or {}):
            return GpuAccess(mechanism="device-request", device_ids=tuple(spec.gpus))
        reasons.append("device-request: the engine has no registered 'nvidia' runtime")
    if mode in ("auto", "cdi"):
        spec_dirs = [d for d in (info.get("CDISpecDirs") or []) if isinstance(d, str)]
        wanted = [f"nvidia.com/gpu={g}" for g in spec.gpus]
        if not spec_dirs:
            reasons.append("cdi: the engine does not resolve CDI devices")
        elif policy.root is None:  # the specs are on the engine's node: it refuses an undeclared name itself
            return GpuAccess(mechanism="cdi", device_ids=tuple(wanted))
        else:
            declared = cdi_device_names(spec_dirs, policy.root)
            if absent := [w for w in wanted if w not in declared]:
                reasons.append(f"cdi: no CDI spec in {', '.join(spec_dirs)} declares {', '.join(absent)}")
            else:
                return GpuAccess(mechanism="cdi", device_ids=tuple(wanted))
    if mode in ("auto", "native"):
        if isinstance(inventory, str):
            reasons.append(f"native: {inventory}")
        else:
            assert policy.root is not None  # an inventory is only ever read under a local root
            gpus = select_gpus(spec.gpus, inventory)
            base = spec.environment.get("LD_LIBRARY_PATH")
            if base is None:
                base = _env_value((await image_info(spec.image)).get("Config", {}).get("Env") or [],
                                  "LD_LIBRARY_PATH")
            return native_access(spec, gpus, root=policy.root, driver_paths=policy.gpus.driver_paths,
                                 base_library_path=base)
    raise RuntimeFailed(action=_ACTION, detail=(
        f"no mechanism can give this container GPU {', '.join(spec.gpus)} ([gpus] mode = {mode!r}): "
        + "; ".join(reasons)))


async def realise(spec: WorkloadSpec, policy: HostPolicy, *, socket_path: str, engine_info: EngineInfo,
                  image_info: ImageInfo, rejects: Callable[[list[str]], Awaitable[str]],
                  holders: Callable[[], Awaitable[list[GpuHolder]]] | None = None,
                  capabilities: tuple[str, ...] | None = None) -> Realisation:
    """How this host gives `spec` its GPUs and privilege; RuntimeFailed (before any create) when it cannot.

    The engine is asked through the backend's callables: `engine_info` (``/info``), `image_info`
    (the image's inspect), `rejects` (see :func:`engine_capabilities`) and, only to enforce
    ``[gpus] exclusive``, `holders` (the managed containers holding GPUs now). An unknown GPU ID
    fails first, then a GPU another workload holds, then a request no mechanism can honour.
    `capabilities` (an admission profile's grant): `privileged` is exactly these, nothing more.
    """
    async def privilege_of(gpus: GpuAccess | None) -> PrivilegeGrant | None:
        if not spec.privileged:
            return None
        if capabilities is not None:
            return PrivilegeGrant(capabilities=capabilities, devices=(), whole_host=False)
        return await host_privilege(policy.root, policy.privileged, socket_path, gpus, rejects)

    via = gpu_routes(spec, capabilities)
    if not spec.gpus and not (holders is not None and via):
        return Realisation(privilege=await privilege_of(None))
    inventory = await _inventory(policy)
    known = inventory if isinstance(inventory, list) else None
    if known is not None and spec.gpus:
        select_gpus(spec.gpus, known)  # an unknown ID fails here, whatever the mechanism
    held = held_gpus(reached_gpus(spec, known, capabilities), known)
    if holders is not None:
        refuse_held(held, await holders(), known, via=" and ".join(via))
    if not spec.gpus:
        return Realisation(privilege=await privilege_of(None), held=held)
    gpus = await _gpu_access(spec, policy, inventory, engine_info, image_info)
    return Realisation(gpus=gpus, privilege=await privilege_of(gpus), held=held)

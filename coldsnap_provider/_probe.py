"""Launch the feature probe where the capsule runs, attach CRIU, admit, cache (DESIGN decision 5).

Two places to run: disposable containers of the capsule image through the runtime
backend (`criu check`, then the profile probe with only the assigned GPU and a disposable
copy of this package mounted read-only; both with network `none` and exactly the capabilities CRIU and CUDA
checkpoint need, never privileged nor on the host's network), or plain processes on this host
(`--host-process`, for qualifying a GPU machine). From the control socket, the manager's
admission profile decides first (``_policy.Policy.admit_probe``).
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import msgspec

import coldsnap_probe
from coldsnap_probe import AdmissionError
from coldsnap_probe import boot_id as this_boot
from coldsnap_runtime import Backend
from coldsnap_runtime.errors import BackendError, CommandFailed
from coldsnap_runtime.schema import WorkloadSpec

from ._config import CAPSULE_CAPABILITIES
from ._exec import ExecIdentity, ExecResult, run_argv

__all__ = ("PROBE_MOUNT", "ProbeOptions", "cache_scope", "criu_workload", "package_copy", "probe_digest",
           "probe_workload", "run_probe")

PROBE_MOUNT = "/opt/coldsnap/probe"
_DAEMON = ExecIdentity()
CAPSULE_CRIU = "/opt/coldsnap/criu/bin/criu"
_PACKAGE_DIR = Path(coldsnap_probe.__file__).resolve().parent


class ProbeOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    driver: str
    device: str = "0"
    image: str = ""
    host_process: bool = False
    criu: str = ""
    memory_bytes: int = 1 << 20
    timeout_s: float = 30.0
    # The capsule containers' grant (the admission profile's): `privileged` is exactly these
    # (None: as [runtime] privileged says, for profiles that may run such workloads anyway).
    capabilities: tuple[str, ...] | None = CAPSULE_CAPABILITIES
    seccomp_unconfined: bool = True
    # Whose probe this is: a host-process result is cached for this manager only (None: the CLI's own).
    manager_uid: int | None = None


def probe_digest() -> str:
    """The probe's own identity: every file of the package, name, length and bytes."""
    h = hashlib.sha256(b"coldsnap-provider-probe\x00format=1\x00")
    for path in sorted(_PACKAGE_DIR.glob("*.py")):
        data = path.read_bytes()
        h.update(f"{path.name}\x00{len(data)}\x00".encode() + data)
    return "sha256:" + h.hexdigest()


def cache_scope(options: ProbeOptions) -> str:
    """What a host-process profile is cached under (an image probe's is the image id instead).

    A host process runs what exec.user's environment holds, which a manager can shape: its result
    is one manager's, never served to another (issue 24, finding 9). An image id names the same
    bytes for everyone, so image probes share their cache."""
    return "host-process" if options.manager_uid is None else f"host-process:uid={options.manager_uid}"


async def _device_identity(device: str, identity: ExecIdentity) -> str:
    """nvidia-smi's driver_version, uuid, name, compute_cap for the device ('' when unavailable)."""
    result = await run_argv(["nvidia-smi", f"--id={device}", "--query-gpu=driver_version,uuid,name,compute_cap",
                             "--format=csv,noheader,nounits"], identity=identity)
    return result.stdout.decode(errors="replace").strip() if result.exit_code == 0 else ""


def _text(result: ExecResult) -> str:
    return (result.stdout + result.stderr).decode(errors="replace").strip()


async def _criu_check(options: ProbeOptions, backend: Backend | None, identity: ExecIdentity) -> str | None:
    """None when `criu check` passed, else the admission error text."""
    if options.host_process:
        criu = options.criu or shutil.which("criu") or ""
        if not criu:
            return "destination kernel failed capsule-pinned CRIU check: criu is not installed on this host"
        result = await run_argv([criu, "check"], combined=True, identity=identity)
        if result.exit_code != 0:
            return f"destination kernel failed capsule-pinned CRIU check: exit {result.exit_code}: {_text(result)}"
        return None
    assert backend is not None
    try:
        await backend.workload_run(criu_workload(options), allow_pull=False, capabilities=options.capabilities)
    except BackendError as exc:
        return f"destination kernel failed capsule-pinned CRIU check: {exc}"
    return None


def _probe_args(options: ProbeOptions) -> list[str]:
    return ["-m", "coldsnap_probe", "profile", "--memory-bytes", str(options.memory_bytes),
            "--timeout", f"{options.timeout_s:g}"]


def criu_workload(options: ProbeOptions) -> WorkloadSpec:
    """The capsule-pinned `criu check`: no network, the probe's capabilities (backend.workload_run's
    `capabilities`), nothing pulled."""
    return msgspec.convert({
        "name": "", "image": options.image, "remove_after_exit": True, "pull_policy": "never",
        "privileged": True, "seccomp_unconfined": options.seccomp_unconfined, "network": "none", "combined": True,
        "entrypoint": options.criu or CAPSULE_CRIU, "command": ["check"]}, WorkloadSpec)


@contextlib.asynccontextmanager
async def package_copy(directory: Path) -> AsyncIterator[Path]:
    """A disposable copy of this package under `directory`, for one probe container, removed after it.

    The probe runs the caller's image with CAP_SYS_ADMIN, which remounts a read-only bind read-write:
    bound directly, the installed package (code the daemon imports as root) was the image's to rewrite."""
    parent = Path(await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(prefix="probe-package-", dir=directory)))
    try:
        copy = parent / "coldsnap_probe"
        await anyio.to_thread.run_sync(lambda: shutil.copytree(
            _PACKAGE_DIR, copy, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")))
        yield copy
    finally:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(parent, ignore_errors=True))


def probe_workload(options: ProbeOptions, package: Path) -> WorkloadSpec:
    """The profile probe: only the assigned GPU, no network, `package` (a :func:`package_copy`) mounted
    read-only; stdout only."""
    return msgspec.convert({
        "name": "", "image": options.image, "remove_after_exit": True, "pull_policy": "never",
        "gpus": [options.device], "privileged": True, "seccomp_unconfined": options.seccomp_unconfined,
        "network": "none",
        "entrypoint": "python3", "command": _probe_args(options), "environment": {"PYTHONPATH": PROBE_MOUNT},
        "mounts": [{"source": str(package), "target": f"{PROBE_MOUNT}/coldsnap_probe", "read_only": True}],
    }, WorkloadSpec)


async def _profile_output(options: ProbeOptions, backend: Backend | None, identity: ExecIdentity,
                          state_dir: Path) -> bytes:
    args = _probe_args(options)
    if options.host_process:
        # Like the capsule: the probe sees only its GPU (as ordinal 0); NVML is told which one it is.
        result = await run_argv(["env", f"CUDA_VISIBLE_DEVICES={options.device}",
                                 f"COLDSNAP_PROBE_NVML_DEVICE={options.device}",
                                 f"PYTHONPATH={_PACKAGE_DIR.parent}", sys.executable, *args], identity=identity)
        if result.exit_code != 0:
            raise CommandFailed(action="probe", status=f"exited {result.exit_code}",
                                output=result.stderr.decode(errors="replace").strip())
        return result.stdout
    assert backend is not None
    async with package_copy(state_dir) as package:
        response = await backend.workload_run(probe_workload(options, package), allow_pull=False,
                                              capabilities=options.capabilities)
    return response.output if isinstance(response.output, bytes) else b""


async def run_probe(options: ProbeOptions, *, state_dir: Path, backend: Backend | None,
                    identity: ExecIdentity = _DAEMON) -> dict[str, Any]:
    """`{"profile", "admitted", "error", "cached"}`; raises ValueError for unusable options.

    Host processes (criu, nvidia-smi, the probe) run as `identity`: on behalf of a manager,
    that is `exec.user`, never more."""
    requirements = coldsnap_probe.requirements(options.driver)
    if not options.host_process and not options.image:
        raise ValueError("a probe needs an `image` or `host_process`")
    capsule = cache_scope(options)
    if not options.host_process:
        assert backend is not None
        capsule = (await backend.image_inspect(options.image)).id
    boot_id, device_identity = this_boot() or "", await _device_identity(options.device, identity)
    # Without a device identity (no nvidia-smi / GPU) nothing could be keyed truthfully: no cache.
    key = coldsnap_probe.cache_key(boot_id, device_identity, capsule, probe_digest(), options.driver,
                                   options.device) if boot_id and device_identity else ""
    if key:
        cached = coldsnap_probe.read_cached(state_dir, key, options.driver)
        if cached is not None and cached["identity"].get("boot_id") == boot_id:
            try:
                coldsnap_probe.admit(requirements, cached)
                return {"profile": cached, "admitted": True, "error": None, "cached": True}
            except AdmissionError:
                pass  # requirements changed: probe afresh
    criu_error = await _criu_check(options, backend, identity)
    profile = coldsnap_probe.decode_profile(await _profile_output(options, backend, identity, state_dir))
    if criu_error is None:
        profile = coldsnap_probe.attach_criu(profile, options.driver)
    try:
        if criu_error is not None:
            raise AdmissionError(criu_error)
        coldsnap_probe.admit(requirements, profile)
    except AdmissionError as exc:
        return {"profile": profile, "admitted": False, "error": str(exc), "cached": False}
    if key:
        coldsnap_probe.write_cached(state_dir, key, profile)
    return {"profile": profile, "admitted": True, "error": None, "cached": False}


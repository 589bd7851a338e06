"""The serve capsule's assembly (scripts/_capsule_rootfs.py --server-site --jax-site --criu-compat) and the CRIU
compatibility preload it builds, run for real: gcc, ldd, and sockets on this kernel."""

from __future__ import annotations

import errno
import importlib.util
import marshal
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "scripts/capsule/criu_sockopt_compat.c"
PROBE = textwrap.dedent("""
    import socket
    s = socket.socket()
    out = []
    for name in (socket.SO_PASSCRED, 34):  # SO_PASSSEC
        try:
            out.append(str(s.getsockopt(socket.SOL_SOCKET, name)))
        except OSError as exc:
            out.append(str(exc.errno))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0) if out[0] == "0" else None
    for call in (lambda: s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1),
                 lambda: s.getsockopt(socket.SOL_SOCKET, 12345)):
        try:
            call()
            out.append("ok")
        except OSError as exc:
            out.append(str(exc.errno))
    print(" ".join(out))
""")

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (the GPU host has it)")


def _build(tmp_path: Path) -> Path:
    library = tmp_path / "criu-compat.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(library), str(SHIM), "-ldl"],
                   check=True)
    return library


def _probe(env: dict[str, str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return done.stdout.split()


def test_preload_reads_refused_pass_options_as_off_and_changes_nothing_else(tmp_path: Path) -> None:
    plain = _probe({})
    shimmed = _probe({"LD_PRELOAD": str(_build(tmp_path))})
    if plain[:2] == ["0", "0"]:
        pytest.skip("this kernel still answers SO_PASSCRED/SO_PASSSEC on TCP sockets (before Linux 6.16)")
    refused, unknown = str(errno.EOPNOTSUPP), str(errno.ENOPROTOOPT)
    assert plain[:2] == [refused, refused]  # what fails CRIU 4.1.1's dump of a TCP socket
    assert shimmed[:2] == ["0", "0"]
    # Turning the option on still fails, and other failures pass through unchanged.
    assert shimmed[2:] == plain[2:] == [refused, unknown]


def wheel_tree(site: Path, package: str, files: dict[str, Path]) -> None:
    """An installed wheel's files as pip lays them out (`nvidia/cu13/bin/ptxas`, `nvidia/cu13/lib/...`), copies of
    real programs and libraries keeping their modes, and its RECORD."""
    for name, source in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, site / name)
    info = site / f"{package}.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("".join(f"{name},,\n" for name in files))


@dataclass(frozen=True)
class Built:
    rootfs: Path
    stdout: str
    host_cuda: Path  # the host's toolkit behind its links (/usr/local/cuda -> /etc/alternatives/cuda -> here)
    jax_site: Path  # a host venv's site: JAX's CUDA plugin and NVIDIA's runtime wheel, no compiler wheel


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """One capsule build for the tests of this file: a server site with its own NVIDIA compiler wheel, a JAX site
    without one, and a host toolkit reached from the PATH through wrapper scripts and two links (as
    /usr/local/cuda -> /etc/alternatives/cuda on a GPU host)."""
    base = tmp_path_factory.mktemp("serve-capsule")
    criu = base / "criu-root/usr/sbin/criu"
    criu.parent.mkdir(parents=True)
    shutil.copy2("/bin/true", criu)  # any dynamically linked program stands in for CRIU here
    site = base / "site"
    (site / "fastapi").mkdir(parents=True)
    (site / "fastapi/__init__.py").write_text("")
    extension = next(Path(sys.prefix).glob("lib/python3*/site-packages/msgspec/_core*.so"))
    shutil.copy2(extension, site / "fastapi" / extension.name)
    (site / "fastapi/__pycache__").mkdir()
    # Any ELF program and library stand in for NVIDIA's: what matters is where they are and their modes.
    library = Path(extension)
    wheel_tree(site, "nvidia_cuda_nvcc-13.0.88", {"nvidia/cu13/bin/ptxas": Path("/bin/true"),
                                                  "nvidia/cu13/bin/nvlink": Path("/bin/false")})
    wheel_tree(site, "nvidia_nvjitlink-13.0.88", {"nvidia/cu13/lib/libnvJitLink.so.13": library})
    wheel_tree(site, "jax_cuda13_pjrt-0.11.2", {"jax_plugins/xla_cuda13/xla_cuda_plugin.so": library})
    jax_site = base / "venv/lib/python3.12/site-packages"
    wheel_tree(jax_site, "jax_cuda13_pjrt-0.11.2", {"jax_plugins/xla_cuda13/xla_cuda_plugin.so": library})
    wheel_tree(jax_site, "nvidia_cuda_runtime-13.0.96", {"nvidia/cu13/lib/libcudart.so.13": library})
    host_cuda = base / "usr/local/cuda-13.0"
    wheel_tree(host_cuda, "nvidia_cuda_nvcc-13.0.88", {"bin/ptxas": Path("/bin/true"), "bin/nvlink": Path("/bin/false"),
                                                       "bin/nvcc": Path("/bin/true")})
    wheel_tree(host_cuda, "nvidia_nvvm-13.0.88", {"nvvm/libdevice/libdevice.10.bc": library})
    (base / "etc/alternatives").mkdir(parents=True)
    (base / "etc/alternatives/cuda").symlink_to(host_cuda)
    (base / "usr/local/cuda").symlink_to(base / "etc/alternatives/cuda")
    # On the PATH: wrapper scripts running the toolkit's programs through those links (as on a host whose toolkit
    # came from wheels).
    wrappers = base / "usr/local/bin"
    wrappers.mkdir()
    for name in ("ptxas", "nvlink"):
        (wrappers / name).write_text(f'#!/bin/sh\nexec {base}/usr/local/cuda/bin/{name} "$@"\n')
        (wrappers / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_ROOT", "XLA_FLAGS")}
    env["PATH"] = f"{wrappers}:{env['PATH']}"
    out = base / "ctx"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/_capsule_rootfs.py"), str(out), "--busybox",
                           shutil.which("busybox") or "/bin/busybox", "--criu-root", str(base / "criu-root"),
                           "--worker", str(ROOT / "coldsnap_probe"), "--server-site", str(site),
                           "--jax-site", str(jax_site), "--criu-compat", str(SHIM)],
                          capture_output=True, text=True, check=False, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    yield Built(out / "rootfs", done.stdout, host_cuda, jax_site)


def test_capsule_carries_the_server_site_and_a_preloading_criu_wrapper(built: Built) -> None:
    assert "server site yes" in built.stdout
    rootfs = built.rootfs
    extension = next(Path(sys.prefix).glob("lib/python3*/site-packages/msgspec/_core*.so"))
    assert (rootfs / "opt/server/site/fastapi" / extension.name).is_file()
    assert not (rootfs / "opt/server/site/fastapi/__pycache__").exists()
    assert (rootfs / "opt/coldsnap/worker/coldsnap_probe/adapters/sitecustomize.py").is_file()
    assert (rootfs / "opt/coldsnap/lib/libcoldsnap_cuda.so").read_bytes()[:4] == b"\x7fELF"  # the CUDA interposer
    assert (rootfs / "opt/coldsnap/worker/coldsnap_probe/hydration/interposer/dump.c").is_file()  # and its sources
    wrapper = (rootfs / "opt/coldsnap/criu/bin/criu-env").read_text()
    assert "LD_PRELOAD=/opt/coldsnap/criu/lib/criu-compat.so " in wrapper
    assert (rootfs / "opt/coldsnap/criu/lib/criu-compat.so").read_bytes()[:4] == b"\x7fELF"
    assert_bytecode_is_baked_in(rootfs)


def test_a_server_sites_nvidia_wheels_keep_their_programs_and_libraries(built: Built) -> None:
    """JAX's XLA runs ptxas from the site's NVIDIA compiler wheel and loads its libraries by name: they stay, the
    programs executable."""
    kept = built.rootfs / "opt/server/site/nvidia/cu13"
    for name in ("bin/ptxas", "bin/nvlink"):
        assert (kept / name).stat().st_mode & 0o777 == 0o755, name
    assert (kept / "lib/libnvJitLink.so.13").read_bytes()[:4] == b"\x7fELF"


def test_the_ptx_tools_a_jax_site_lacks_come_from_the_hosts_toolkit_behind_its_links(built: Built) -> None:
    """Regression: #36. The host's venv has JAX's CUDA plugin but no NVIDIA compiler wheel: its XLA finds ptxas
    elsewhere on the host (here: a wrapper on the PATH running /usr/local/cuda's, a link through /etc/alternatives),
    which a unit mounting the host's /usr cannot follow.
    The capsule carries the real files at /opt/cuda (a root XLA searches), executable, and libdevice beside them;
    nothing else of the toolkit, and nothing for the site that has its own."""
    cuda = built.rootfs / "opt/cuda"
    for name, source in (("ptxas", "/bin/true"), ("nvlink", "/bin/false")):
        carried = cuda / "bin" / name
        assert not carried.is_symlink() and carried.stat().st_mode & 0o777 == 0o755, name
        assert carried.read_bytes() == Path(source).read_bytes(), name
    assert (cuda / "nvvm/libdevice/libdevice.10.bc").is_file()
    if os.geteuid() == 0:  # they run in the capsule alone, with the libraries they load
        runs = [subprocess.run(["chroot", str(built.rootfs), f"/opt/cuda/bin/{n}"], check=False).returncode
                for n in ("ptxas", "nvlink")]
        assert runs == [0, 1], runs
    assert sorted(p.name for p in cuda.rglob("*") if p.is_file()) == ["libdevice.10.bc", "nvlink", "ptxas"]
    line = built.stdout.splitlines()[-1]
    assert f"ptx tools for {built.jax_site}: ptxas {built.host_cuda}/bin/ptxas, nvlink {built.host_cuda}/bin/nvlink, " \
        f"libdevice {built.host_cuda}/nvvm/libdevice at /opt/cuda" in line, line  # (the server site has its own)


def assert_bytecode_is_baked_in(rootfs: Path) -> None:
    """Regression: #22. A unit is a fresh container: without bytecode in the image every worker start compiled its
    modules. The worker's is checked-hash (whatever mtimes the image keeps) and names the paths in the capsule."""
    for name in ("coldsnap_probe/_restore.py", "coldsnap_probe/hydration/_hydrator.py", "pynvml.py"):
        source = rootfs / "opt/coldsnap/worker" / name
        data = Path(importlib.util.cache_from_source(str(source))).read_bytes()
        assert data[:4] == importlib.util.MAGIC_NUMBER and int.from_bytes(data[4:8], "little") == 0b11, name
        assert data[8:16] == importlib.util.source_hash(source.read_bytes()), name
        assert marshal.loads(data[16:]).co_filename == f"/opt/coldsnap/worker/{name}"
    stdlib = rootfs / sysconfig.get_paths()["stdlib"].lstrip("/")
    assert Path(importlib.util.cache_from_source(str(stdlib / "argparse.py"))).is_file()  # the top level too
    assert not list(stdlib.rglob("*.opt-[12].pyc"))  # nothing runs python3 -O


def test_a_jax_site_that_is_not_a_directory_is_refused_naming_it_before_anything_is_built(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts/_capsule_rootfs.py"), str(tmp_path / "ctx"),
                           "--busybox", "/bin/busybox", "--jax-site", str(tmp_path / "nope")],
                          capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 2 and f"--jax-site: {tmp_path / 'nope'} is not a directory" in done.stderr, done.stderr
    assert not (tmp_path / "ctx").exists()

"""Assemble a small capsule build context on a GPU host: busybox, this host's python3 and the probe's deps.

    python3 scripts/_capsule_rootfs.py OUT_DIR --busybox PATH [--criu-root DIR] [--worker PACKAGE_DIR]
                                       [--server-site DIR]

OUT_DIR gets ``rootfs/`` and a ``Dockerfile`` (``FROM scratch``, ``COPY rootfs/ /``). The rootfs holds
a static busybox; the interpreter running this script (its real executable, its standard library,
and, copied into the interpreter's own site-packages, the ``cuda`` (cuda-bindings/pathfinder) and
``pynvml`` packages the probe imports); CRIU at ``/opt/coldsnap/criu/bin/criu`` (the capsule-pinned
CRIU the provider's check runs); and the shared libraries all of them load (ldd closure), the
driver's own excepted: those reach the container through the provider's native GPU access.
No driver library and no GPU state is baked into the image.

With ``--worker`` the capsule also carries the capture/restore worker: the ``coldsnap_probe`` package and
``pynvml`` at ``/opt/coldsnap/worker`` (put on ``PYTHONPATH``; a path the workload's read-only host
mounts of ``/usr`` and ``/opt/torch`` do not cover), and ``/opt/coldsnap/criu/bin/criu-env``, CRIU with its
own libraries from ``/opt/coldsnap/criu/lib`` (its copies under ``/usr/lib`` are hidden when ``/usr`` is
mounted from the host).

With ``--worker`` the capsule also carries the CUDA interposer, ``/opt/coldsnap/lib/libcoldsnap_cuda.so``, built
with gcc from the worker's sources (docs/interposer.md): a workload unit enables it with
``LD_PRELOAD=/opt/coldsnap/lib/libcoldsnap_cuda.so`` and ``COLDSNAP_CUDA_INTERPOSER_SOCKET``; and
``/opt/coldsnap/lib/libcoldsnap_no_io_uring.so`` (``scripts/capsule/no_io_uring.c``), which every server unit
preloads so that uvloop's libuv keeps to epoll without the io_uring ring CRIU cannot dump.

With ``--criu-compat SRC`` the worker's CRIU wrapper preloads SRC built with gcc
(``scripts/capsule/criu_sockopt_compat.c``: CRIU 4.1.1 cannot dump TCP sockets on Linux 6.16 and later).

With ``--server-site`` the capsule carries a server's own Python dependencies (for `transformers serve`:
fastapi, starlette, uvicorn, pydantic, openai and theirs) at ``/opt/server/site``, which the server's unit
puts on ``PYTHONPATH``; their compiled extensions' libraries join the ldd closure.

A JAX server compiles its programs with ptxas (and links with nvlink) at run time, and its XLA looks for them in the
server's site (NVIDIA's wheel: ``nvidia/cu13/bin`` with CUDA 13, ``nvidia/cuda_nvcc/bin`` before), then ``CUDA_ROOT``,
the ``PATH``, ``/usr/local/cuda`` and ``/opt/cuda``. A host often has them only through ``/usr/local/cuda``, a link
through ``/etc/alternatives`` that a unit mounting the host's ``/usr`` cannot follow (issue 36: the JAX row's server
died with "No PTX compilation provider is available"). So for each site a JAX server runs from (``--jax-site``, the
host's venv the units mount; and ``--server-site`` when it holds JAX's CUDA plugin) whose NVIDIA wheels lack ptxas,
the capsule carries the ptxas and nvlink this host's XLA would find, and the libdevice beside them, at ``/opt/cuda``:
a root XLA searches that no host mount of ``/usr`` hides. Nothing else of the toolkit (nvcc, cicc: hundreds of MB).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

_SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
                "dist-packages"}
_DRIVER = re.compile(r"^(libcuda|libnvidia-|libnvcuvid|libcudadebugger)")
_PTX_TOOLS = ("ptxas", "nvlink")  # what XLA runs to compile and link a program's PTX
_CUDA_ROOTS = ("/usr/local/cuda", "/opt/cuda")  # the roots XLA always tries, after the PATH
_CAPSULE_CUDA = "opt/cuda"  # the capsule's: one of those roots, outside the host paths a unit mounts


def _copy(src: str, rootfs: Path) -> None:
    dest = rootfs / src.lstrip("/")
    if dest.exists():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(os.path.realpath(src), dest)


def _libraries(binary: str, env: dict[str, str]) -> list[str]:
    done = subprocess.run(["ldd", binary], capture_output=True, text=True, env=env, check=False)
    found = []
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            path = parts[2]
        elif len(parts) == 2 and parts[1].startswith("(0x"):
            path = parts[0]  # the ELF interpreter
        else:
            continue
        if path.startswith("/") and not _DRIVER.match(os.path.basename(path)):
            found.append(path)
    return found


def _site_has_ptxas(site: Path) -> bool:
    """JAX's XLA finds ptxas in the site itself: an NVIDIA wheel's bin or the CUDA plugin's own tree."""
    return any(p.is_file() for pattern in ("nvidia/*/bin/ptxas", "jax_plugins/xla_cuda*/cuda/bin/ptxas")
               for p in site.glob(pattern))


def _program(path: Path, hops: int = 3) -> Path | None:
    """The executable program at `path`, behind any link; a wrapper script (`exec /real/ptxas "$@"`, as toolkits
    installed from wheels put on the PATH) followed to the program it runs (`hops` scripts deep at most: two
    wrappers naming each other end); None for anything else."""
    if hops < 0 or not (path.is_file() and os.access(path, os.X_OK)):
        return None
    real = path.resolve()
    with open(real, "rb") as f:
        head = f.read(4)
    if head == b"\x7fELF":
        return real
    if head[:2] != b"#!":
        return None
    named = re.findall(rf"(/\S*/{re.escape(path.name)})\b", real.read_text(errors="replace"))
    return next(filter(None, (_program(Path(n), hops - 1) for n in named if Path(n).resolve() != real)), None)


def _host_ptx_tools(search_path: str) -> dict[str, Path]:
    """ptxas and nvlink where this host's XLA finds them outside a site (its data directory: CUDA_ROOT, or
    XLA_FLAGS' --xla_gpu_cuda_data_dir; the PATH; XLA's two roots), each the real file behind any link, and the
    libdevice directory of the toolkit the ptxas comes from."""
    flags = re.findall(r"--xla_gpu_cuda_data_dir=(\S+)", os.environ.get("XLA_FLAGS", ""))
    roots = [r for r in (os.environ.get("CUDA_ROOT"), *flags) if r]
    dirs = [*(f"{r}/bin" for r in roots), *filter(None, search_path.split(os.pathsep)),
            *(f"{r}/bin" for r in _CUDA_ROOTS)]
    found: dict[str, Path] = {}
    for name in _PTX_TOOLS:
        hit = next(filter(None, (_program(Path(d, name)) for d in dirs)), None)
        if hit is not None:
            found[name] = hit
    if "ptxas" in found and (libdevice := found["ptxas"].parent.parent / "nvvm/libdevice").is_dir():
        found["libdevice"] = libdevice
    return found


def _carry_ptx_tools(rootfs: Path, sites: list[Path]) -> tuple[list[str], str]:
    """The PTX tools for the JAX servers of `sites` (those that lack their own) under the capsule's /opt/cuda:
    the executables to add to the ldd closure, and a line for the summary."""
    if not sites:
        return [], ""
    needing = [site for site in sites if not _site_has_ptxas(site)]
    if not needing:
        return [], ", ptx tools: the JAX site's own"
    found = _host_ptx_tools(os.environ.get("PATH", ""))
    if "ptxas" not in found:
        print(f"warning: no ptxas in {', '.join(map(str, needing))} nor on this host (CUDA_ROOT, PATH, "  # noqa: T201
              f"{', '.join(_CUDA_ROOTS)}): a JAX server in this capsule cannot compile", file=sys.stderr)
        return [], ", ptx tools: NONE found"
    cuda = rootfs / _CAPSULE_CUDA
    (cuda / "bin").mkdir(parents=True, exist_ok=True)
    for name in _PTX_TOOLS:
        if name in found:
            shutil.copy2(found[name], cuda / "bin" / name)  # the mode with it: XLA runs them
    if "libdevice" in found:
        shutil.copytree(found["libdevice"], cuda / "nvvm/libdevice", dirs_exist_ok=True)
    size = sum(p.stat().st_size for p in cuda.rglob("*") if p.is_file())
    carried = ", ".join(f"{name} {found[name]}" for name in (*_PTX_TOOLS, "libdevice") if name in found)
    return ([str(found[n]) for n in _PTX_TOOLS if n in found],
            f", ptx tools for {', '.join(map(str, needing))}: {carried} at /{_CAPSULE_CUDA} ({size / 1e6:.1f} MB)")


def _compile(exe: str, rootfs: Path, *trees: Path) -> None:
    """Bytecode for what the worker imports, in the image (issue 22: compiling the worker's modules at every start
    cost it tens of milliseconds). `checked-hash`: valid whatever modification times the image build keeps, and
    checked against the source it sits beside; the file names recorded are the paths inside the capsule."""
    subprocess.run([exe, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "checked-hash",
                    "-s", str(rootfs), "-p", "/", *map(str, trees)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--busybox", required=True)
    parser.add_argument("--criu-root", default="")
    parser.add_argument("--worker", default="", help="the coldsnap_probe package directory to bake in")
    parser.add_argument("--criu-compat", default="", help="C source of an LD_PRELOAD for the worker's CRIU "
                        "(scripts/capsule/criu_sockopt_compat.c), built with gcc")
    parser.add_argument("--server-site", default="", help="a server's site-packages, baked in at /opt/server/site")
    parser.add_argument("--jax-site", action="append", default=[], help="a site-packages a JAX server in this "
                        "capsule runs from (mounted from the host): the capsule carries the PTX tools it lacks")
    args = parser.parse_args()
    if missing := [site for site in args.jax_site if not Path(site).is_dir()]:
        parser.error(f"--jax-site: {', '.join(missing)} is not a directory (a site-packages a JAX server runs from)")
    out = Path(args.out)
    rootfs = out / "rootfs"
    for d in ("bin", "etc", "tmp", "root", "usr/bin", "proc", "sys", "dev"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)
    shutil.copy2(args.busybox, rootfs / "bin/busybox")
    for applet in subprocess.run([args.busybox, "--list"], capture_output=True, text=True, check=True).stdout.split():
        if applet != "busybox" and not (rootfs / "bin" / applet).exists():
            (rootfs / "bin" / applet).symlink_to("busybox")
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (rootfs / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")

    # The interpreter at its real path, python3 beside busybox, the standard library at its own path.
    exe = os.path.realpath(sys.executable)
    _copy(exe, rootfs)
    (rootfs / "usr/bin/python3").unlink(missing_ok=True)
    if exe != "/usr/bin/python3":
        (rootfs / "usr/bin/python3").symlink_to(exe)
    stdlib = sysconfig.get_paths()["stdlib"]
    # With its bytecode (the plain level only: nothing runs python3 -O): a unit is a fresh container, so what an
    # interpreter compiled there would be lost, and every worker start would compile the modules it imports again.
    shutil.copytree(stdlib, rootfs / stdlib.lstrip("/"), symlinks=True, dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if (n in _SKIP_STDLIB and d == stdlib) or ".opt-" in n])
    # The base interpreter's own site-packages (the spec's PYTHONPATH must stay the probe's).
    base_site = subprocess.run([exe, "-I", "-c", "import site; print(site.getsitepackages()[0])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    import cuda.bindings
    import pynvml

    cuda_dir = Path(next(iter(cuda.bindings.__path__))).parent
    target = rootfs / base_site.lstrip("/")
    shutil.copytree(cuda_dir, target / "cuda", symlinks=True, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyx", "*.pxd", "*.cpp", "include"))
    shutil.copy2(pynvml.__file__, target / "pynvml.py")

    if args.server_site:
        site = rootfs / "opt/server/site"
        shutil.copytree(args.server_site, site, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))

    # CRIU where the provider's capsule-pinned check looks for it.
    env = dict(os.environ)
    binaries = [exe]
    if args.criu_root:
        criu_dest = rootfs / "opt/coldsnap/criu/bin/criu"
        criu_dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(args.criu_root) / "usr/sbin/criu", criu_dest)
        (rootfs / "usr/bin/criu").symlink_to("/opt/coldsnap/criu/bin/criu")
        binaries.append(str(Path(args.criu_root) / "usr/sbin/criu"))
    binaries += [str(p) for p in (rootfs / stdlib.lstrip("/")).rglob("*.so")]
    binaries += [str(p) for p in target.rglob("*.so*") if p.is_file()]
    if args.server_site:
        # Libraries too (`libX.so.13`), not only extensions: a wheel's libraries are loaded with dlopen by name.
        binaries += [str(p) for p in (rootfs / "opt/server/site").rglob("*.so*")
                     if p.is_file() and (p.name.endswith(".so") or ".so." in p.name)]
    jax_sites = [Path(s) for s in args.jax_site]
    if args.server_site and any(Path(args.server_site).glob("jax_plugins/xla_cuda*")):
        jax_sites.append(Path(args.server_site))
    tools, tools_line = _carry_ptx_tools(rootfs, jax_sites)
    binaries += tools
    libraries = sorted({lib for b in binaries for lib in _libraries(b, env)})
    # glibc pieces that Python packages dlopen by name (cuda.pathfinder opens libdl.so.2) besides libc.
    libc_dir = next((os.path.dirname(lib) for lib in libraries if os.path.basename(lib) == "libc.so.6"), "")
    extra = [f"{libc_dir}/{n}" for n in ("libdl.so.2", "libpthread.so.0", "librt.so.1", "libm.so.6",
                                          "libutil.so.1", "libgcc_s.so.1") if os.path.exists(f"{libc_dir}/{n}")]
    libraries = sorted({*libraries, *extra})
    for lib in libraries:
        if args.criu_root and lib.startswith(str(Path(args.criu_root).resolve())):
            # CRIU's own libraries (unpacked Debian packages) go to the loader's default directory.
            dest = rootfs / "usr/lib/x86_64-linux-gnu" / os.path.basename(lib)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(lib), dest)
            if args.worker:
                own = rootfs / "opt/coldsnap/criu/lib" / os.path.basename(lib)
                own.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(os.path.realpath(lib), own)
        else:
            _copy(lib, rootfs)
    if args.worker:
        worker = rootfs / "opt/coldsnap/worker"
        shutil.copytree(args.worker, worker / "coldsnap_probe", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(pynvml.__file__, worker / "pynvml.py")
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from coldsnap_probe.hydration import build_library

        build_library(rootfs / "opt/coldsnap/lib")  # where hydration._interposer looks for it in a capsule
        # Every server unit preloads it: uvloop then runs without the io_uring ring CRIU cannot dump.
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror",
                        "-o", str(rootfs / "opt/coldsnap/lib/libcoldsnap_no_io_uring.so"),
                        str(Path(__file__).resolve().parent / "capsule/no_io_uring.c"), "-ldl"], check=True)
        _compile(exe, rootfs, worker, target / "cuda", target / "pynvml.py")
        if args.criu_root:
            preload = ""
            if args.criu_compat:
                compat = rootfs / "opt/coldsnap/criu/lib/criu-compat.so"
                compat.parent.mkdir(parents=True, exist_ok=True)
                subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(compat), args.criu_compat, "-ldl"],
                               check=True)
                preload = "LD_PRELOAD=/opt/coldsnap/criu/lib/criu-compat.so "
            wrapper = rootfs / "opt/coldsnap/criu/bin/criu-env"
            wrapper.write_text("#!/bin/sh\n"
                               f"{preload}LD_LIBRARY_PATH=/opt/coldsnap/criu/lib exec /opt/coldsnap/criu/bin/criu "
                               "\"$@\"\n")
            wrapper.chmod(0o755)
    (out / "Dockerfile").write_text(
        "FROM scratch\nCOPY rootfs/ /\n"
        "ENV PATH=/usr/local/bin:/usr/bin:/bin:/opt/coldsnap/criu/bin\nCMD [\"sh\"]\n")
    size = sum(p.stat().st_size for p in rootfs.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"capsule rootfs: {size / 1e6:.1f} MB, python {exe}, stdlib {stdlib}, site {base_site}, "  # noqa: T201
          f"{len(libraries)} libraries, worker {'yes' if args.worker else 'no'}, "
          f"server site {'yes' if args.server_site else 'no'}{tools_line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

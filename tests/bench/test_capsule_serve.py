"""The serve capsule's assembly (scripts/_capsule_rootfs.py --server-site --criu-compat) and the CRIU
compatibility preload it builds, run for real: gcc, ldd, and sockets on this kernel."""

from __future__ import annotations

import errno
import importlib.util
import marshal
import shutil
import subprocess
import sys
import sysconfig
import textwrap
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


def test_capsule_carries_the_server_site_and_a_preloading_criu_wrapper(tmp_path: Path) -> None:
    criu = tmp_path / "criu-root/usr/sbin/criu"
    criu.parent.mkdir(parents=True)
    shutil.copy2("/bin/true", criu)  # any dynamically linked program stands in for CRIU here
    site = tmp_path / "site"
    (site / "fastapi").mkdir(parents=True)
    (site / "fastapi/__init__.py").write_text("")
    extension = next(Path(sys.prefix).glob("lib/python3*/site-packages/msgspec/_core*.so"))
    shutil.copy2(extension, site / "fastapi" / extension.name)
    (site / "fastapi/__pycache__").mkdir()
    out = tmp_path / "ctx"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/_capsule_rootfs.py"), str(out), "--busybox",
                           shutil.which("busybox") or "/bin/busybox", "--criu-root", str(tmp_path / "criu-root"),
                           "--worker", str(ROOT / "coldsnap_probe"), "--server-site", str(site),
                           "--criu-compat", str(SHIM)], capture_output=True, text=True, check=False, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "server site yes" in done.stdout
    rootfs = out / "rootfs"
    assert (rootfs / "opt/server/site/fastapi" / extension.name).is_file()
    assert not (rootfs / "opt/server/site/fastapi/__pycache__").exists()
    assert (rootfs / "opt/coldsnap/worker/coldsnap_probe/adapters/sitecustomize.py").is_file()
    assert (rootfs / "opt/coldsnap/lib/libcoldsnap_cuda.so").read_bytes()[:4] == b"\x7fELF"  # the CUDA interposer
    assert (rootfs / "opt/coldsnap/worker/coldsnap_probe/hydration/interposer/dump.c").is_file()  # and its sources
    wrapper = (rootfs / "opt/coldsnap/criu/bin/criu-env").read_text()
    assert "LD_PRELOAD=/opt/coldsnap/criu/lib/criu-compat.so " in wrapper
    assert (rootfs / "opt/coldsnap/criu/lib/criu-compat.so").read_bytes()[:4] == b"\x7fELF"
    assert_bytecode_is_baked_in(rootfs)


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

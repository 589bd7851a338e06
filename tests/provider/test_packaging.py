"""What an admin installs: the version, the wheel with the system files, and `install-units` from a fresh venv."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from coldsnap_provider import __version__
from tests.helpers import ROOT

CLI = [sys.executable, "-m", "coldsnap_provider"]
UNITS = ("coldsnap-provider.service", "coldsnap-provider.socket")
# What `install-units` puts where, relative to the prefix (docs/upgrade.md lists the same).
INSTALLED = {
    "etc/systemd/system/coldsnap-provider.service",
    "etc/systemd/system/coldsnap-provider.socket",
    "usr/lib/sysusers.d/coldsnap-provider.conf",
    "usr/lib/tmpfiles.d/coldsnap-provider.conf",
    "etc/logrotate.d/coldsnap-provider",
    "usr/share/doc/coldsnap-provider/README.md",
    "usr/share/doc/coldsnap-provider/CHANGELOG.md",
    "usr/share/doc/coldsnap-provider/docs/systemd.md",
    "usr/share/doc/coldsnap-provider/docs/upgrade.md",
    "usr/share/doc/coldsnap-provider/LICENSE",
    "usr/share/doc/coldsnap-provider/kubernetes/rbac.yaml",
    "etc/coldsnap-provider/config.toml",
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=False, cwd=ROOT)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag_prints_the_package_version_and_exits_0(flag: str) -> None:
    result = cli(flag)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"coldsnap-provider {__version__}\n"


# --- the wheel ------------------------------------------------------------------------------------------------------


def _build_inputs() -> list[Path]:
    """What `pip wheel .` reads: the project files, the system files it copies in, and the packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tops = sorted({name.split(".")[0] for name in project["tool"]["setuptools"]["packages"]})
    paths = [ROOT / name for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "CHANGELOG.md",
                                      "LICENSE")]
    paths += sorted(p for p in (ROOT / "systemd").iterdir() if p.is_file()) + sorted((ROOT / "docs").glob("*.md"))
    paths += sorted((ROOT / "packaging" / "kubernetes").glob("*.yaml"))
    for top in tops:
        paths += sorted(p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts
                        and p.suffix not in (".so", ".pyc"))
    return paths


def _wheel(scratch: Path) -> Path:
    """The wheel of the tree as it is, built from a copy (pip would leave build/ and *.egg-info in the tree)."""
    source = scratch / "src"
    for path in _build_inputs():
        target = source / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(scratch / "dist")],
                           cwd=source, capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (scratch / "dist").glob("coldsnap_provider-*.whl")
    return wheel


def _fresh_venv(directory: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed (no deps: this venv's site-packages lent through a .pth file)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    python = directory / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "lent-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                                "--no-index", str(wheel)], capture_output=True, text=True, check=False)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return directory / "bin" / "coldsnap-provider"


def _documentation(unit: Path) -> list[str]:
    return [word for line in unit.read_text().splitlines() if line.startswith("Documentation=")
            for word in line.removeprefix("Documentation=").split()]


@pytest.mark.timeout(240)
def test_the_wheel_carries_the_units_and_install_units_installs_a_tree_systemd_accepts(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (*UNITS, "coldsnap-provider.sysusers.conf", "coldsnap-provider.tmpfiles.conf"):
        assert f"coldsnap_provider/_system/systemd/{name}" in names, sorted(names)
    assert "coldsnap_provider/_system/doc/docs/upgrade.md" in names
    # The license text twice: in the metadata (setuptools' license_files) and among the installed docs.
    licenses = [n for n in names if n.endswith("/LICENSE")]
    assert {n.split("/")[0].endswith(".dist-info") for n in licenses} == {True, False}, licenses
    assert zipfile.ZipFile(wheel).read("coldsnap_provider/_system/doc/LICENSE") == (ROOT / "LICENSE").read_bytes()

    entry_point = _fresh_venv(tmp_path / "venv", wheel)
    python = str(entry_point.parent / "python")
    where = subprocess.run([python, "-c", "import coldsnap_provider as p; print(p.__file__)"],
                           capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert where.startswith(str(tmp_path / "venv")), where  # the wheel's copy runs, not the source tree
    version = subprocess.run([str(entry_point), "--version"], capture_output=True, text=True, check=False,
                             cwd=tmp_path)
    assert version.returncode == 0 and version.stdout == f"coldsnap-provider {__version__}\n", version

    root = tmp_path / "root"
    dry = subprocess.run([str(entry_point), "install-units", "--prefix", str(root), "--dry-run", "-o", "json"],
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert not root.exists()
    done = subprocess.run([str(entry_point), "install-units", "--prefix", str(root), "-o", "json"],
                          capture_output=True, text=True, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["entry_point"] == str(entry_point)
    assert sorted(report["installed"]) == sorted(json.loads(dry.stdout)["installed"])
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert files >= INSTALLED, sorted(INSTALLED - files)
    assert all((root / f).stat().st_mode & 0o777 == 0o644 for f in files)

    service = root / "etc/systemd/system/coldsnap-provider.service"
    assert re.search(rf"^ExecStart={re.escape(str(entry_point))} serve ", service.read_text(), re.M)
    assert "/usr/local/bin/coldsnap-provider" not in service.read_text()
    documentation = _documentation(service)
    assert documentation and all(d.startswith("file:///") for d in documentation)
    missing = [d for d in documentation if not (root / d.removeprefix("file:///")).is_file()]
    assert not missing, f"Documentation= names files install-units does not install: {missing}"
    assert (root / "usr/lib/sysusers.d/coldsnap-provider.conf").read_bytes() == (
        ROOT / "systemd/coldsnap-provider.sysusers.conf").read_bytes()

    if analyze := shutil.which("systemd-analyze"):
        result = subprocess.run([analyze, "verify", "--man=no", *(str(service.parent / u) for u in UNITS)],
                                capture_output=True, text=True, check=False)
        problems = [line for line in (result.stdout + result.stderr).splitlines() if "coldsnap-provider" in line]
        assert result.returncode == 0 and not problems, result.stdout + result.stderr


def test_install_units_keeps_an_existing_configuration_and_refuses_an_unusable_program(tmp_path: Path) -> None:
    config = tmp_path / "etc/coldsnap-provider/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("# the admin's own\n")
    program = shutil.which("true")
    assert program
    result = cli("install-units", "--prefix", str(tmp_path), "--exec", program, "-o", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kept"] == [str(config)]
    assert config.read_text() == "# the admin's own\n"
    assert f"ExecStart={program} serve " in (tmp_path / "etc/systemd/system/coldsnap-provider.service").read_text()

    for bad, rule in ((tmp_path / "missing", "is not an executable file"),
                      (tmp_path / "etc/coldsnap-provider/config.toml", "is not an executable file"),
                      ("relative/coldsnap-provider", "must be an absolute path"),
                      (f"{program} --debug", "must be an absolute path")):
        before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        refused = cli("install-units", "--prefix", str(tmp_path / "elsewhere"), "--exec", str(bad))
        assert refused.returncode == 2 and "--exec" in refused.stderr and rule in refused.stderr, refused.stderr
        assert not (tmp_path / "elsewhere").exists()
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_stop_then_start_keeps_the_runtime_directory_that_holds_the_control_socket_and_sessions() -> None:
    """The .socket unit's control.sock and the session records live in RuntimeDirectory=; `stop` must not remove it.

    systemd.exec(5): RuntimeDirectoryPreserve=no (the default) removes the directory whenever the service stops,
    `restart` keeps it only across restarts; `yes` keeps it until reboot (/run is a tmpfs)."""
    unit = (ROOT / "systemd/coldsnap-provider.service").read_text()
    socket_unit = (ROOT / "systemd/coldsnap-provider.socket").read_text()
    runtime = re.search(r"^RuntimeDirectory=(\S+)$", unit, re.M)
    assert runtime and f"ListenStream=/run/{runtime[1]}/control.sock" in socket_unit
    assert f"--state-dir /run/{runtime[1]}" in unit
    assert re.findall(r"^RuntimeDirectoryPreserve=(\S+)$", unit, re.M) == ["yes"]

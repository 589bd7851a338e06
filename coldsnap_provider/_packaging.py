"""What an installed copy is: its version, and the system files the wheel carries and installs onto a machine.

The wheel carries the systemd units, the sysusers.d and tmpfiles.d snippets and the documentation the unit
names as `coldsnap_provider/_system/` (setup.py copies them from `systemd/`, `README.md`, `CHANGELOG.md` and
`docs/`); a source tree (an editable install, `python -m` from a clone) has them at those places instead.
`install_units()` copies them under a prefix (`/`, or a staging root), pointing the unit's `Exec*=` lines at
the entry point of the Python environment that runs it. It never overwrites a configuration file.
"""

from __future__ import annotations

import os
import re
import sysconfig
from importlib import metadata, resources
from pathlib import Path

import msgspec

from . import __version__
from ._errors import ConfigError

__all__ = ("Installation", "default_entry_point", "install_units", "package_version")

DISTRIBUTION = "coldsnap-provider"
# The program the shipped unit names; install_units() replaces it with the real entry point.
_SHIPPED_PROGRAM = "/usr/local/bin/coldsnap-provider"
_EXEC_LINE = re.compile(rf"^(Exec[A-Za-z]*=[-@:+!|]*){re.escape(_SHIPPED_PROGRAM)}(?=\s|$)", re.M)
# systemd splits command lines on white space and expands %, $ and \; a path with them would need quoting.
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9._+/-]+$")
_DOC_DIR = "usr/share/doc/coldsnap-provider"
# Where each shipped systemd file goes (relative to the prefix); any other one goes beside the docs.
_PLACES = {
    "coldsnap-provider.service": "etc/systemd/system/coldsnap-provider.service",
    "coldsnap-provider.socket": "etc/systemd/system/coldsnap-provider.socket",
    "coldsnap-provider.sysusers.conf": "usr/lib/sysusers.d/coldsnap-provider.conf",
    "coldsnap-provider.tmpfiles.conf": "usr/lib/tmpfiles.d/coldsnap-provider.conf",
    "coldsnap-provider.logrotate": "etc/logrotate.d/coldsnap-provider",
}
_CONFIG = "etc/coldsnap-provider/config.toml"


def package_version() -> str:
    """The installed distribution's version; the source tree's when it is not installed (python -m from a clone)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return __version__


def default_entry_point() -> Path:
    """The `coldsnap-provider` script of the Python environment running this (a venv's bin/)."""
    return Path(sysconfig.get_path("scripts")) / "coldsnap-provider"


class Installation(msgspec.Struct, kw_only=True):
    """What install_units() wrote (or, with dry_run, would write) and what it left alone."""

    prefix: str
    entry_point: str
    dry_run: bool
    installed: list[str] = msgspec.field(default_factory=list)
    kept: list[str] = msgspec.field(default_factory=list)


def _shipped_files() -> dict[str, bytes]:
    """Bundle name (systemd/NAME, doc/PATH) -> contents, from the wheel's _system/ or else the source tree."""
    bundle = resources.files("coldsnap_provider").joinpath("_system")
    if bundle.is_dir():
        files: dict[str, bytes] = {}
        for top in bundle.iterdir():
            pending = [(top.name, top)]
            while pending:
                name, node = pending.pop()
                if node.is_dir():
                    pending.extend((f"{name}/{child.name}", child) for child in node.iterdir())
                else:
                    files[name] = node.read_bytes()
        return files
    root = Path(__file__).resolve().parent.parent
    sources = {f"systemd/{p.name}": p for p in (root / "systemd").glob("coldsnap-provider.*")}
    sources |= {f"doc/{name}": root / name for name in ("README.md", "CHANGELOG.md", "LICENSE")}
    sources |= {f"doc/docs/{p.name}": p for p in (root / "docs").glob("*.md")}
    sources |= {f"doc/kubernetes/{p.name}": p for p in (root / "packaging" / "kubernetes").glob("*.yaml")}
    if "systemd/coldsnap-provider.service" not in sources:
        raise ConfigError(f"no system files: neither an installed coldsnap_provider/_system nor {root}/systemd")
    return {name: path.read_bytes() for name, path in sources.items()}


def _destination(name: str) -> str:
    kind, _, rest = name.partition("/")
    if kind == "systemd":
        return _PLACES.get(rest, f"{_DOC_DIR}/systemd/{rest}")
    return f"{_DOC_DIR}/{rest}"


def _pointed_unit(text: bytes, entry_point: Path) -> bytes:
    unit, count = _EXEC_LINE.subn(lambda m: m[1] + str(entry_point), text.decode())
    if count == 0:
        raise ConfigError(f"systemd/coldsnap-provider.service: no Exec line runs {_SHIPPED_PROGRAM}")
    return unit.encode()


def _checked_entry_point(entry_point: Path) -> Path:
    if not _PLAIN_PATH.match(str(entry_point)):
        raise ConfigError(f"--exec: {str(entry_point)!r} must be an absolute path of letters, digits and ._+-/ "
                          "(systemd would split or expand anything else)")
    if not os.access(entry_point, os.X_OK) or not entry_point.is_file():
        raise ConfigError(f"--exec: {entry_point} is not an executable file (install the package first, "
                          "or name its coldsnap-provider script)")
    return entry_point


def _write(path: Path, data: bytes) -> None:
    """Replace `path` whole (a reader never sees half a unit), mode 0644, creating directories 0755."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        os.fchmod(out.fileno(), 0o644)
    os.replace(partial, path)


def install_units(prefix: Path, *, entry_point: Path, dry_run: bool = False) -> Installation:
    """Install the units, sysusers/tmpfiles snippets, docs and (if absent) the configuration under `prefix`."""
    entry_point = _checked_entry_point(entry_point)
    files = _shipped_files()
    files["systemd/coldsnap-provider.service"] = _pointed_unit(files["systemd/coldsnap-provider.service"],
                                                               entry_point)
    plan = {_destination(name): data for name, data in sorted(files.items())}
    result = Installation(prefix=str(prefix), entry_point=str(entry_point), dry_run=dry_run)
    config = prefix / _CONFIG
    if config.exists() or config.is_symlink():
        result.kept.append(str(config))
    else:
        plan[_CONFIG] = resources.files("coldsnap_provider").joinpath("default-config.toml").read_bytes()
    for relative, data in plan.items():
        target = prefix / relative
        if not dry_run:
            _write(target, data)
        result.installed.append(str(target))
    return result

"""The runtime side of the privilege drop (``_privileges.py``), run inside the archive program it serves,
started from the shipped unit's account with the unit's capabilities (tests/unit_sandbox.py)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import coldsnap_runtime.backend._archive as archive_module
import coldsnap_runtime.backend._privileges as privileges_module
from coldsnap_runtime.backend._buildctx import context_job
from tests import unit_sandbox

ARCHIVE = archive_module.__file__
PRIVILEGES = privileges_module.__file__
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="reproduces the unit's account: needs root")

# Loads _privileges.py by path as _archive.py does, drops, then reports what is left.
_REPORT = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("p", {PRIVILEGES!r})
p = importlib.util.module_from_spec(spec); sys.modules["p"] = p; spec.loader.exec_module(p)
try:
    p.become(65534, 65534) if sys.argv[1] == "become" else p.shed()
except p.DropFailed as exc:
    print("refused:", exc); sys.exit(1)
print(p.read_capabilities(), os.getresuid(), os.getgroups())
try:
    os.setuid(0)
except PermissionError:
    print("setuid refused")
"""


def as_unit(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(unit_sandbox.wrap(list(argv)), input=stdin, capture_output=True, cwd="/", check=False)


@pytest.fixture
def context(top: Path) -> Path:
    """A build context holding a root-only 0700 directory (as on the node of the finding)."""
    root = top / "context"
    (root / "private").mkdir(parents=True)
    (root / "private").chmod(0o700)
    (root / "private" / "secret").write_text("root only\n")
    (root / "public.txt").write_text("public\n")
    return root


def test_become_from_the_units_account_leaves_no_capability_and_cannot_regain_root() -> None:
    result = as_unit(sys.executable, "-I", "-S", "-c", _REPORT, "become")
    out = result.stdout.decode()
    assert result.returncode == 0, result
    assert ("CapabilitySets(inheritable=0, permitted=0, effective=0, bounding=0, ambient=0, no_new_privs=True) "
            "(65534, 65534, 65534) []") in out
    assert "setuid refused" in out


def test_shed_keeps_the_units_account_and_drops_every_capability() -> None:
    result = as_unit(sys.executable, "-I", "-S", "-c", _REPORT, "shed")
    account = unit_sandbox.account()
    assert result.returncode == 0, result
    assert ("CapabilitySets(inheritable=0, permitted=0, effective=0, bounding=0, ambient=0, no_new_privs=True) "
            f"({account.pw_uid}, {account.pw_uid}, {account.pw_uid})") in result.stdout.decode()


def test_become_without_setpcap_refuses_rather_than_keep_the_bounding_set() -> None:
    caps = "+chown,+dac_override,+fowner,+kill,+setuid,+setgid"  # the unit of 445646e
    result = subprocess.run(
        ["setpriv", "--reuid=61999", "--regid=61999", "--clear-groups", f"--inh-caps=-all,{caps}",
         f"--ambient-caps=-all,{caps}", f"--bounding-set=-all,{caps}", "--",
         sys.executable, "-I", "-S", "-c", _REPORT, "become"], capture_output=True, check=False)
    assert result.returncode == 1 and b"refused: cannot clear the capability bounding set without CAP_SETPCAP" \
        in result.stdout, result


def test_pack_as_nobody_from_the_units_account_cannot_read_a_root_only_directory(context: Path) -> None:
    job = context_job(context=str(context), contexts={}, dockerfile=b"FROM scratch\n")
    result = as_unit(sys.executable, "-I", "-S", ARCHIVE, "--pack", "--as", "65534:65534", stdin=job)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert str(context / "private").encode() in result.stderr and b"Permission denied" in result.stderr
    assert b"root only" not in result.stdout


def test_pack_as_the_units_own_account_cannot_read_a_root_only_directory(context: Path) -> None:
    job = context_job(context=str(context), contexts={}, dockerfile=b"FROM scratch\n")
    result = as_unit(sys.executable, "-I", "-S", ARCHIVE, "--pack", stdin=job)
    assert result.returncode == 1 and b"Permission denied" in result.stderr, (result.returncode, result.stderr)


def test_extract_as_nobody_from_the_units_account_into_a_root_only_directory_is_refused(top: Path) -> None:
    private = top / "private"
    private.mkdir(mode=0o700)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("f")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    result = as_unit(sys.executable, "-I", "-S", ARCHIVE, "f", str(private / "f"), "--as", "65534:65534",
                     stdin=out.getvalue())
    assert result.returncode == 1 and b"Permission denied" in result.stderr, (result.returncode, result.stderr)
    assert list(private.iterdir()) == []

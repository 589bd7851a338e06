"""The copy-from extractor, run as the program the backend runs, as a real unprivileged user."""

from __future__ import annotations

import io
import os
import pwd
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

import coldsnap_runtime.backend._archive as archive_module

PROGRAM = archive_module.__file__
NOBODY = pwd.getpwnam("nobody")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changes identity: needs root")


def member(name: str, data: bytes = b"", **fields: object) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data


def tar_of(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def extract(data: bytes, root: str, destination: Path, *extra: str) -> subprocess.CompletedProcess[bytes]:
    with tempfile.TemporaryFile() as spool:
        spool.write(data)
        spool.seek(0)
        return subprocess.run([sys.executable, "-I", "-S", PROGRAM, root, str(destination), *extra],
                              stdin=spool, capture_output=True, cwd="/", check=False)


def as_nobody() -> tuple[str, str]:
    return "--as", f"{NOBODY.pw_uid}:{NOBODY.pw_gid}"


@pytest.fixture
def shared(top: Path) -> Path:
    """A world-writable sticky directory (like /tmp) in which nobody may create files."""
    base = top / "shared"
    base.mkdir()
    base.chmod(0o1777)
    return base


def test_extract_planted_symlink_in_the_destination_is_not_followed(shared: Path, top: Path) -> None:
    """Regression: #11 (finding 8): a planted link sent the copy into a root-only directory."""
    secret = top / "root-only"
    secret.mkdir(mode=0o700)
    (shared / "link").symlink_to(secret)
    data = tar_of(member("cache", type=tarfile.DIRTYPE, mode=0o755), member("cache/k", b"k\n"))
    for extra in ((), as_nobody()):
        result = extract(data, "cache", shared / "link" / "seed", *extra)
        assert result.returncode == 1 and b"symbolic link" in result.stderr, result.stderr
        assert list(secret.iterdir()) == []


def test_extract_as_nobody_writes_nobodys_files_without_setuid_bits(shared: Path) -> None:
    """Regression: #11 (finding 8): the copy was written as root and kept setuid bits."""
    data = tar_of(member("cache", type=tarfile.DIRTYPE, mode=0o2755, uid=0, gid=0),
                  member("cache/tool", b"#!/bin/sh\n", mode=0o4755, uid=0, gid=0),
                  member("cache/sub/deep", b"d", mode=0o1644, uid=0, gid=0),
                  member("cache/link", type=tarfile.SYMTYPE, linkname="/etc/shadow"))
    result = extract(data, "cache", shared / "seed", *as_nobody())
    assert result.returncode == 0, result.stderr
    seed = shared / "seed"
    for path in (seed, seed / "tool", seed / "sub", seed / "sub" / "deep", seed / "link"):
        info = path.lstat()
        assert (info.st_uid, info.st_gid) == (NOBODY.pw_uid, NOBODY.pw_gid), path
        assert not info.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX), (path, oct(info.st_mode))
    assert stat.S_IMODE((seed / "tool").stat().st_mode) == 0o755 and (seed / "tool").read_bytes() == b"#!/bin/sh\n"
    assert os.readlink(seed / "link") == "/etc/shadow"  # kept as a link, never followed
    assert [p.name for p in shared.iterdir()] == ["seed"]  # no staging left behind


def test_extract_as_nobody_into_a_root_only_directory_is_refused_by_the_kernel(top: Path) -> None:
    private = top / "private"
    private.mkdir(mode=0o755)
    result = extract(tar_of(member("f", b"x")), "f", private / "f", *as_nobody())
    assert result.returncode == 1 and b"Permission denied" in result.stderr, result.stderr
    assert list(private.iterdir()) == []


@pytest.mark.parametrize(("entry", "message"), [
    (member("cache/fifo", type=tarfile.FIFOTYPE), b"device node or FIFO"),
    (member("cache/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3), b"device node or FIFO"),
    (member("cache/out", type=tarfile.LNKTYPE, linkname="etc/passwd"), b"points outside the copied path"),
    (member("/etc/cron.d/x", b"x"), b"outside the copied path"),
    (member("cache/../../x", b"x"), b"outside the copied path"),
], ids=["fifo", "device", "hard-link-out", "absolute", "dot-dot"])
def test_extract_refuses_dangerous_entries_and_leaves_nothing(shared: Path, entry: tuple[tarfile.TarInfo, bytes],
                                                              message: bytes) -> None:
    data = tar_of(member("cache", type=tarfile.DIRTYPE, mode=0o755), member("cache/ok", b"ok"), entry)
    result = extract(data, "cache", shared / "seed", *as_nobody())
    assert result.returncode == 1 and message in result.stderr, result.stderr
    assert list(shared.iterdir()) == []


def test_extract_hard_link_inside_the_copy_becomes_an_independent_file(shared: Path) -> None:
    data = tar_of(member("cache", type=tarfile.DIRTYPE, mode=0o755), member("cache/a", b"same"),
                  member("cache/b", type=tarfile.LNKTYPE, linkname="cache/a"))
    assert extract(data, "cache", shared / "seed", *as_nobody()).returncode == 0
    a, b = shared / "seed" / "a", shared / "seed" / "b"
    assert b.read_bytes() == b"same" and a.stat().st_ino != b.stat().st_ino


def test_extract_merges_into_an_existing_directory_and_keeps_root_owners_only_as_root(shared: Path) -> None:
    existing = shared / "seed"
    existing.mkdir()
    (existing / "old").write_text("old")
    data = tar_of(member("cache", type=tarfile.DIRTYPE, mode=0o755),
                  member("cache/new", b"new", uid=4242, gid=4243))
    assert extract(data, "cache", existing, "--keep-owner").returncode == 0
    copied = existing / "cache" / "new"
    assert copied.read_text() == "new" and (copied.stat().st_uid, copied.stat().st_gid) == (4242, 4243)
    assert extract(data, "cache", shared / "seed2", *as_nobody()).returncode == 0
    assert (shared / "seed2" / "new").stat().st_uid == NOBODY.pw_uid
    # A directory onto an existing file is refused, and so is a missing parent.
    assert b"cannot copy a directory onto the file" in extract(data, "cache", existing / "old").stderr
    assert b"does not exist" in extract(data, "cache", shared / "absent" / "x").stderr


def test_extract_name_listed_twice_is_refused_and_nothing_is_written(shared: Path, top: Path) -> None:
    """Regression: #24 finding 1 (a link, then a file of the same name: the write followed the link)."""
    outside = top / "outside"
    outside.mkdir()
    data = tar_of(member("ctx", type=tarfile.DIRTYPE, mode=0o755),
                  member("ctx/x", type=tarfile.SYMTYPE, linkname=str(outside / "victim")),
                  member("ctx/x", b"pwned\n"))
    for extra in ((), as_nobody()):
        result = extract(data, "ctx", shared / "copy", *extra)
        assert result.returncode == 1 and b"archive entry 'ctx/x' is listed twice" in result.stderr, result.stderr
        assert not (shared / "copy").exists() and list(outside.iterdir()) == []


def test_extract_runs_of_zeros_become_holes(shared: Path) -> None:
    """Regression: #24 finding 8 (a sparse file was written out in full)."""
    size = 64 << 20
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("sparse")
        info.size = size
        tar.addfile(info, io.BytesIO(b"head" + bytes(size - 8) + b"tail"))
    result = extract(out.getvalue(), "sparse", shared / "sparse")
    assert result.returncode == 0, result.stderr
    placed = shared / "sparse"
    assert placed.stat().st_size == size and placed.stat().st_blocks * 512 < 4 << 20
    with placed.open("rb") as f:
        assert f.read(4) == b"head" and f.seek(size - 4) and f.read(4) == b"tail"

"""The node hydrator's `stage-dump` runs as root for peers that may not be: the dump files it copies are
opened once, by descriptor, as the peer could open them, and the copy reads those descriptors. A peer that owns
a directory on a part's path cannot swap in a link to another tenant's file (which the hydrator would then
copy into an allocation the peer adopts) or a FIFO (which would block the hydrator's one request thread)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration._hydrator import _open_dump_parts, _open_readable
from coldsnap_probe.jsonline import Peer

MIB = 1 << 20
NOBODY = Peer(1, 65534, 65534)


@pytest.fixture
def tree() -> Iterator[Path]:
    """/tmp/<new>/ (0755, root) holding `att/d/seg-0.bin` (the peer's own, 'A') and `secret/seg-0.bin`
    (another tenant's 0700 directory, 'S')."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the hydrator's peers are other uids")
    top = Path(tempfile.mkdtemp(prefix="coldsnap-dump-parts-", dir="/tmp"))
    top.chmod(0o755)
    try:
        (top / "att" / "d").mkdir(parents=True)
        (top / "att" / "d" / "seg-0.bin").write_bytes(b"A" * (2 * MIB))
        for p in (top / "att", top / "att" / "d", top / "att" / "d" / "seg-0.bin"):
            os.chown(p, NOBODY.uid, NOBODY.gid)
        (top / "secret").mkdir(mode=0o700)
        (top / "secret" / "seg-0.bin").write_bytes(b"S" * (2 * MIB))
        (top / "secret" / "seg-0.bin").chmod(0o644)
        yield top
    finally:
        shutil.rmtree(top)


def test_the_copy_reads_the_file_that_was_checked_not_what_a_swapped_path_names(tree: Path) -> None:
    part = tree / "att" / "d" / "seg-0.bin"
    parts, fds = _open_dump_parts([{"file": str(part), "bytes": 2 * MIB}], NOBODY)
    try:
        # The peer swaps its directory for a link to the other tenant's after the check, before the copy.
        (tree / "att" / "d").rename(tree / "att" / "d.old")
        (tree / "att" / "d").symlink_to(tree / "secret")
        assert [p.source for p in parts] == [str(part)]
        assert os.pread(fds[str(part)], 16, 0) == b"A" * 16  # what the copy (copy_ring, opened=) reads
    finally:
        for fd in fds.values():
            os.close(fd)
    with pytest.raises(HydrationError, match="may not read"):  # once swapped, the path is checked as it is
        _open_dump_parts([{"file": str(part), "bytes": 2 * MIB}], NOBODY)


def test_a_part_that_is_a_link_is_refused_even_for_a_root_peer(tree: Path) -> None:
    """The restore worker asks as root; the engine owns the dump directory and could leave a link there."""
    part = tree / "att" / "d" / "seg-0.bin"
    part.unlink()
    part.symlink_to(tree / "secret" / "seg-0.bin")
    with pytest.raises(HydrationError, match="not a regular file"):
        _open_dump_parts([{"file": str(part), "bytes": 2 * MIB}], Peer(1, 0, 0))


def test_a_link_swapped_in_after_the_path_was_resolved_is_not_followed(tree: Path) -> None:
    (tree / "att" / "d" / "seg-0.bin").unlink()
    (tree / "att" / "d" / "seg-0.bin").symlink_to(tree / "secret" / "seg-0.bin")
    with pytest.raises(HydrationError, match="not a regular file"):  # root asks: only the link rule refuses
        _open_readable(str(tree / "att" / "d" / "seg-0.bin"), "seg-0.bin", 2 * MIB, Peer(1, 0, 0))
    (tree / "att" / "link").symlink_to(tree / "secret")
    with pytest.raises(HydrationError, match="at link"):
        _open_readable(str(tree / "att" / "link" / "seg-0.bin"), "seg-0.bin", 2 * MIB, Peer(1, 0, 0))


def test_a_fifo_in_place_of_a_part_is_refused_without_blocking(tree: Path) -> None:
    fifo = tree / "att" / "d" / "seg-1.bin"
    os.mkfifo(fifo)
    os.chown(fifo, NOBODY.uid, NOBODY.gid)
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            _open_readable(str(fifo), "seg-1.bin", 2 * MIB, NOBODY)
        except BaseException as exc:
            outcome.append(exc)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(10)
    if asking.is_alive():  # unblock it (a writer opens the FIFO) before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("opening a FIFO part blocked the hydrator")
    assert len(outcome) == 1 and isinstance(outcome[0], HydrationError)
    assert "not a regular file" in str(outcome[0])


def test_a_directory_the_peer_cannot_search_is_refused_on_the_walk(tree: Path) -> None:
    with pytest.raises(HydrationError, match="peer uid 65534 may not read"):
        _open_readable(str(tree / "secret" / "seg-0.bin"), "seg-0.bin", 2 * MIB, NOBODY)
    fd = _open_readable(str(tree / "secret" / "seg-0.bin"), "seg-0.bin", 2 * MIB, Peer(1, 0, 0))
    try:
        assert os.pread(fd, 4, 0) == b"SSSS"
    finally:
        os.close(fd)

"""The node hydrator's `stage-dump` runs as root for peers that may not be: the dump files it copies are
opened once, by descriptor, as the peer could open them, and the copy reads those descriptors. A peer that owns
a directory on a part's path cannot swap in a link to another tenant's file (which the hydrator would then
copy into an allocation the peer adopts) or a FIFO (which would block the hydrator's one request thread)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration._peer_files import dump_layout, open_dump_parts
from coldsnap_probe.hydration._peer_view import OPENERS, PeerView
from tests.probe._peers import AS_NOBODY, connected, listening
from tests.probe._staged import stage_and_read
from tests.probe.test_main import has_nvidia_driver

MIB = 1 << 20
NOBODY_UID = 65534


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
            os.chown(p, NOBODY_UID, NOBODY_UID)
        (top / "secret").mkdir(mode=0o700)
        (top / "secret" / "seg-0.bin").write_bytes(b"S" * (2 * MIB))
        (top / "secret" / "seg-0.bin").chmod(0o644)
        yield top
    finally:
        shutil.rmtree(top)


@contextlib.contextmanager
def view_of(prefix: tuple[str, ...] = ()) -> Iterator[PeerView]:
    """The view of a real peer process (root, or as `prefix` starts it) connected over a real socket."""
    with listening() as (listener, sock), connected(listener, sock, prefix) as (conn, peer, _), \
            PeerView.of(conn, peer, openers=threading.BoundedSemaphore(OPENERS)) as view:
        yield view


def parts_of(*parts: tuple[Path, int]) -> tuple[tuple[str, int, int, int], ...]:
    return dump_layout([{"file": str(path), "bytes": size, "region": 0} for path, size in parts])[0]


def test_the_copy_reads_the_file_that_was_checked_not_what_a_swapped_path_names(tree: Path) -> None:
    part = tree / "att" / "d" / "seg-0.bin"
    with view_of(AS_NOBODY) as nobody:
        parts, fds = open_dump_parts(parts_of((part, 2 * MIB)), nobody)
        try:
            # The peer swaps its directory for a link to the other tenant's after the check, before the copy.
            (tree / "att" / "d").rename(tree / "att" / "d.old")
            (tree / "att" / "d").symlink_to(tree / "secret")
            assert [p.source for p in parts] == [str(part)]
            assert os.pread(fds[str(part)], 16, 0) == b"A" * 16  # what the copy (Pread, opened=) reads
        finally:
            for fd in fds.values():
                os.close(fd)
        with pytest.raises(HydrationError, match="may not read"):  # once swapped, the path is checked as it is
            open_dump_parts(parts_of((part, 2 * MIB)), nobody)


def test_a_part_that_is_a_link_is_refused_even_for_a_root_peer(tree: Path) -> None:
    """The restore worker asks as root; the engine owns the dump directory and could leave a link there."""
    part = tree / "att" / "d" / "seg-0.bin"
    part.unlink()
    part.symlink_to(tree / "secret" / "seg-0.bin")
    with view_of() as root, pytest.raises(HydrationError, match="not a regular file"):
        open_dump_parts(parts_of((part, 2 * MIB)), root)


def test_a_link_on_the_path_is_resolved_as_the_peer_would_with_its_permissions(tree: Path) -> None:
    """A directory link the peer planted leads where the peer itself could go, and no further."""
    (tree / "att" / "link").symlink_to(tree / "secret")
    with view_of(AS_NOBODY) as nobody, pytest.raises(HydrationError, match="peer uid 65534 may not read"):
        open_dump_parts(parts_of((tree / "att" / "link" / "seg-0.bin", 2 * MIB)), nobody)
    with view_of() as root:
        _parts, fds = open_dump_parts(parts_of((tree / "att" / "link" / "seg-0.bin", 2 * MIB)), root)
        assert [os.pread(fd, 4, 0) for fd in fds.values()] == [b"SSSS"]  # root may search 0700: so may its peer
        for fd in fds.values():
            os.close(fd)


def test_a_fifo_in_place_of_a_part_is_refused_without_blocking(tree: Path) -> None:
    fifo = tree / "att" / "d" / "seg-1.bin"
    os.mkfifo(fifo)
    os.chown(fifo, NOBODY_UID, NOBODY_UID)
    outcome: list[BaseException] = []
    with view_of(AS_NOBODY) as nobody:
        def ask() -> None:
            try:
                open_dump_parts(parts_of((fifo, 2 * MIB)), nobody)
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
    with view_of(AS_NOBODY) as nobody, pytest.raises(HydrationError, match="peer uid 65534 may not read"):
        open_dump_parts(parts_of((tree / "secret" / "seg-0.bin", 2 * MIB)), nobody)
    with view_of() as root:
        _parts, fds = open_dump_parts(parts_of((tree / "secret" / "seg-0.bin", 2 * MIB)), root)
        try:
            assert os.pread(fds[str(tree / "secret" / "seg-0.bin")], 4, 0) == b"SSSS"
        finally:
            for fd in fds.values():
                os.close(fd)


def test_a_dump_stage_takes_only_whole_files_its_peer_could_read(tree: Path) -> None:
    part = tree / "att" / "d" / "seg-0.bin"
    layout, sizes = dump_layout([{"file": str(part), "bytes": 2 * MIB, "region": 0},
                                 {"file": str(part), "bytes": 2 * MIB, "region": 1}])
    with view_of() as root:
        parts, fds = open_dump_parts(layout, root)
        for fd in fds.values():
            os.close(fd)
        assert [(p.address, p.size, p.source) for p in parts] == [(0, 2 * MIB, str(part)),
                                                                   (2 * MIB, 2 * MIB, str(part))]
        assert sizes == (2 * MIB, 2 * MIB) and len(fds) == 1  # one file, opened once
        for bad, error in [(parts_of((part, 4 * MIB)), "at least 4194304 bytes"),
                           (parts_of((tree / "none", 2 * MIB)), "No such file")]:
            with pytest.raises(HydrationError, match=error):
                open_dump_parts(bad, root)
    part.chmod(0o600)
    os.chown(part, 0, 0)
    with view_of(AS_NOBODY) as nobody, pytest.raises(HydrationError, match="peer uid 65534 may not read"):
        open_dump_parts(parts_of((part, 2 * MIB)), nobody)


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_dump_staged_on_a_hydrator_is_adopted_with_its_files_bytes(tmp_path: Path) -> None:
    """The real hydrator process: stage-dump fills one allocation from the parts (read through the descriptors it
    opened), adopt hands it over with exactly the files' bytes; a chunk the parts mark as zeros is set on the
    device and never read (the file holds other bytes there: they never reach the device); a part that became a
    link is refused, and the hydrator goes on answering."""
    import hashlib
    import json
    import subprocess
    import sys

    from coldsnap_probe._cuda import Driver
    from coldsnap_probe.jsonline import request
    from tests.helpers import ROOT

    first, second, third = tmp_path / "seg-0.bin", tmp_path / "seg-1.bin", tmp_path / "seg-2.bin"
    first.write_bytes(os.urandom(2 * MIB))
    second.write_bytes(os.urandom(4 * MIB))
    third.write_bytes(os.urandom(66 * MIB))  # a 64 MiB chunk marked zero that is not, then 2 MiB
    control = tmp_path / "hydrator.sock"
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                             "--staging", "--stage-ttl", "30"], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert ready["ring_pin_s"] > 0  # the stage ring's page-locked buffers, allocated at the start
        driver = Driver()
        driver.context(0)
        # One region in two segment files: one allocation of both (the interposer maps it whole).
        parts = [{"file": str(first), "bytes": 2 * MIB, "region": 0}, {"file": str(second), "bytes": 4 * MIB,
                                                                        "region": 0}]
        key = "sha256:" + hashlib.sha256(b"review2-stage-dump").hexdigest()
        staged, held = stage_and_read(driver, str(control), key, parts, ready["device_uuid"])
        assert (staged["bytes"], staged["zero_bytes"], staged["copied_bytes"]) == (6 * MIB, 0, 6 * MIB), staged
        assert held == first.read_bytes() + second.read_bytes()
        zeros = [{"file": str(third), "bytes": 66 * MIB, "region": 0, "zero": 1}]
        staged, held = stage_and_read(driver, str(control), "sha256:" + hashlib.sha256(b"zeros").hexdigest(), zeros,
                                      ready["device_uuid"])
        assert (staged["bytes"], staged["zero_bytes"], staged["copied_bytes"]) == (66 * MIB, 64 * MIB, 2 * MIB)
        assert held == bytes(64 * MIB) + third.read_bytes()[64 * MIB:]  # the marked chunk was set, not read
        second.unlink()
        second.symlink_to(first)  # a link where a part was: refused, and the hydrator still answers
        refused = request(str(control), {"op": "stage-dump", "key": key, "parts": parts,
                                         "device_uuid": ready["device_uuid"]}, timeout=60.0)
        assert not refused["ok"] and "not a regular file" in str(refused["error"]), refused
        assert request(str(control), {"op": "status"}, timeout=10.0)["ok"]
    finally:
        proc.kill()
        proc.wait()


STAGER = """
import json, os, sys, time
from coldsnap_probe.jsonline import request_with_fds
answer, _ = request_with_fds(sys.argv[1], json.loads(sys.argv[2]), fds=[os.pidfd_open(os.getpid())], timeout=120.0)
print(json.dumps(answer), flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_stage_whose_stager_was_killed_is_freed_within_seconds_not_its_ttl(tmp_path: Path) -> None:
    """Issue 35 item 4: a restore worker killed after its stage was filled (it sent its pidfd with the request)
    leaves nothing staged: the hydrator frees the stage at its next idle pass, not after the 120 s TTL."""
    import hashlib
    import json
    import subprocess
    import sys
    import time

    from coldsnap_probe.jsonline import request
    from tests.helpers import ROOT

    part = tmp_path / "seg-0.bin"
    part.write_bytes(os.urandom(2 * MIB))
    control = tmp_path / "hydrator.sock"
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                             "--staging"], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        ask = {"op": "stage-dump", "key": "sha256:" + hashlib.sha256(b"killed-stager").hexdigest(),
               "parts": [{"file": str(part), "bytes": 2 * MIB, "region": 0}], "device_uuid": ready["device_uuid"]}
        stager = subprocess.Popen([sys.executable, "-c", STAGER, str(control), json.dumps(ask)],
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        staged = json.loads(stager.stdout.readline())  # type: ignore[union-attr]
        assert staged["ok"] and staged["staged"], staged
        assert len(request(str(control), {"op": "status"}, timeout=10.0)["staged"]) == 1
        stager.kill()
        stager.wait()
        killed, left = time.monotonic(), [None]
        while left and time.monotonic() - killed < 5:
            left = request(str(control), {"op": "status"}, timeout=10.0)["staged"]
            time.sleep(0.05)
        assert left == [], f"the killed stager's stage is still held after 5 s: {left}"
    finally:
        proc.kill()
        proc.wait()

def test_a_ring_copy_whose_source_cannot_be_opened_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """A Pread copy opens its sources before any CUDA call: one that is missing fails it with nothing left open."""
    from coldsnap_probe.hydration._copy import Pread, copy_to_device, region_pieces
    from coldsnap_probe.hydration._weights import WeightRegion

    for name in ("a.bin", "b.bin"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
    regions = [WeightRegion(name, 0, 4096, str(tmp_path / name), 0, "") for name in ("a.bin", "b.bin", "zz-gone.bin")]
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError):
        copy_to_device(None, None, region_pieces(regions), Pread(threads=1, chunk=4096))
    assert sorted(os.listdir("/proc/self/fd")) == before

"""`_criu_kdat.KernelProbe`: CRIU's kernel-feature cache ahead of a restore, carried in the images or probed (the
restore's CRIU loading it is checked in test_criu_restore.py's restore tests and, in a confined capsule, in
test_capsule_boundary.py). Here its ends: a cache carried with this boot's key is used and no probe runs; another
boot's, another confinement's or a damaged one never is (the probe runs); the built CRIU writes the cache, a CRIU
that ignores the variable leaves the restore to probe for itself, a probe that hangs is killed; the directory goes
every time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from coldsnap_probe import _criu_kdat
from coldsnap_probe._criu_kdat import CARRIED_CACHE, CARRIED_KEY, KDAT_MAGIC, KernelProbe, carry, kernel_key
from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_worker_guard import start_target, worker


def script(tmp_path: Path, body: str) -> str:
    """A program standing in for a CRIU of another build (it is given the probe's arguments)."""
    path = tmp_path / "criu"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
def test_the_built_criu_writes_the_cache_the_restore_is_given(tmp_path: Path) -> None:
    assert CRIU is not None
    (tmp_path / "kdat").mkdir()
    probe = KernelProbe(str(CRIU), tmp_path / "kdat")
    env = probe.environment()
    assert env == {"CRIU_KDAT_CACHE": str(tmp_path / "kdat" / "criu.kdat")}
    assert Path(env["CRIU_KDAT_CACHE"]).stat().st_size > 0 and probe.seconds is not None and probe.seconds > 0
    probe.close()
    assert not (tmp_path / "kdat").exists()


def test_a_criu_that_ignores_the_variable_leaves_the_restore_to_probe(tmp_path: Path) -> None:
    (tmp_path / "kdat").mkdir()
    probe = KernelProbe(script(tmp_path, 'test "$1" = check && test -n "$CRIU_KDAT_CACHE"'), tmp_path / "kdat")
    assert probe.environment() == {}
    probe.close()
    assert not (tmp_path / "kdat").exists()


def test_no_criu_at_the_path_starts_nothing_and_leaves_the_refusal_to_the_checks(tmp_path: Path) -> None:
    (tmp_path / "kdat").mkdir()
    probe = KernelProbe(str(tmp_path / "absent" / "criu"), tmp_path / "kdat")
    assert probe.environment() == {}
    probe.close()
    assert not (tmp_path / "kdat").exists()


def test_a_probe_that_hangs_is_killed_and_the_restore_probes_for_itself(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_criu_kdat, "PROBE_WAIT_S", 0.2)
    (tmp_path / "kdat").mkdir()
    probe = KernelProbe(script(tmp_path, "echo $$ > pid; exec sleep 60"), tmp_path / "kdat")
    started = time.monotonic()
    pid_file = tmp_path / "kdat" / "pid"
    while not (pid_file.exists() and pid_file.read_text().endswith("\n")):  # made before echo writes it
        assert time.monotonic() - started < 10
        time.sleep(0.01)
    pid = int(pid_file.read_text())
    assert probe.environment() == {}
    assert time.monotonic() - started < 5 and not (tmp_path / "kdat").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left running


def carried(tmp_path: Path, data: bytes) -> Path:
    """Images carrying `data` as a capture's dump left it (`carry`, this process's key)."""
    (tmp_path / "images").mkdir()
    (tmp_path / "dump-work").mkdir()
    (tmp_path / "dump-work" / "criu.kdat").write_bytes(data)
    assert carry(tmp_path / "dump-work" / "criu.kdat", tmp_path / "images") == len(data)
    return tmp_path / "images"


CACHE = KDAT_MAGIC.to_bytes(4, "little") + os.urandom(900)  # CRIU checks the rest; the carry only its magic


def test_a_cache_carried_with_this_boots_key_is_used_and_no_probe_runs(tmp_path: Path) -> None:
    images = carried(tmp_path, CACHE)
    (tmp_path / "kdat").mkdir()
    probe = KernelProbe(script(tmp_path, f"touch {tmp_path}/probed"), tmp_path / "kdat", images)
    env = probe.environment()
    assert env == {"CRIU_KDAT_CACHE": str(tmp_path / "kdat" / "criu.kdat")}
    assert Path(env["CRIU_KDAT_CACHE"]).read_bytes() == CACHE  # a copy: CRIU may unlink or rewrite it, not the images'
    assert probe.seconds is None and probe.carried_seconds is not None and not (tmp_path / "probed").exists()
    probe.close()
    assert not (tmp_path / "kdat").exists() and (images / CARRIED_CACHE).read_bytes() == CACHE


def _key(field: str, value: str) -> Callable[[Path], None]:
    def change(images: Path) -> None:
        record = json.loads((images / CARRIED_KEY).read_text())
        record["key"][field] = value
        (images / CARRIED_KEY).write_text(json.dumps(record))
    return change


def _truncate(images: Path) -> None:
    (images / CARRIED_CACHE).write_bytes(CACHE[:100])


def _flip(images: Path) -> None:
    (images / CARRIED_CACHE).write_bytes(CACHE[:-1] + bytes([CACHE[-1] ^ 1]))


@pytest.mark.parametrize("damage", [
    pytest.param(_key("boot_id", "00000000-0000-0000-0000-000000000000"), id="another-boot"),
    pytest.param(_key("kernel", "5.4.0-other"), id="another-kernel"),
    pytest.param(_key("Seccomp", "2"), id="another-confinement"),
    pytest.param(_truncate, id="truncated"),
    pytest.param(_flip, id="a-byte-changed"),
    pytest.param(lambda images: (images / CARRIED_KEY).write_text("{"), id="key-unreadable"),
    pytest.param(lambda images: (images / CARRIED_KEY).unlink(), id="no-key"),
    pytest.param(lambda images: (images / CARRIED_KEY).write_text("[" * 60000), id="key-nested-past-the-parser"),
])
def test_a_stale_or_damaged_carried_cache_is_never_used_and_the_probe_runs(tmp_path: Path,
                                                                             damage: Callable[[Path], None]) -> None:
    images = carried(tmp_path, CACHE)
    damage(images)
    (tmp_path / "kdat").mkdir()
    probe = KernelProbe(script(tmp_path, f"touch {tmp_path}/probed"), tmp_path / "kdat", images)
    assert probe.environment() == {}  # the stand-in wrote no cache: the restore's CRIU probes for itself
    assert (tmp_path / "probed").exists() and probe.seconds is not None and probe.carried_seconds is None
    probe.close()
    assert not (tmp_path / "kdat").exists()


def test_a_dump_that_wrote_no_cache_carries_nothing(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    assert carry(tmp_path / "absent.kdat", tmp_path / "images") is None
    (tmp_path / "other.kdat").write_bytes(b"not CRIU's cache")
    assert carry(tmp_path / "other.kdat", tmp_path / "images") is None
    assert list((tmp_path / "images").iterdir()) == []


@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
def test_a_template_capture_carries_its_dumps_own_probe_with_this_boots_key(tmp_path: Path) -> None:
    """A template (n580) has nothing to probe beside: its dump probes for itself into the worker's work directory
    (no cache there when CRIU starts), the images carry what it wrote with this boot's key, and no scratch directory
    is left. (n610 probes while it locks and checkpoints: tests/probe/test_worker.py's GPU capture.)"""
    scratch, seen = tmp_path / "tmp", tmp_path / "dump-env"
    scratch.mkdir()
    with criu_wrapper(tmp_path) as wrapper:
        logging = script(tmp_path, f'[ "$1" = dump ] && echo "$CRIU_KDAT_CACHE $(test -s "$CRIU_KDAT_CACHE" && '
                                   f'echo present)" > {seen}\nexec {wrapper} "$@"')
        target = start_target(tmp_path / "control", mib=8)
        try:
            done = worker("capture", "--pid", str(target.pid), "--images", str(tmp_path / "images"), "--boundary",
                          "n580", "--criu", logging, env={"TMPDIR": str(scratch)})
            assert done.returncode == 0, done.stderr
        finally:
            os.killpg(target.pid, signal.SIGKILL)
            target.wait()
    (given,) = seen.read_text().split()  # no "present": the work directory held no cache when CRIU started
    assert given.startswith(f"{scratch}/coldsnap-capture-") and given.endswith("/criu.kdat")
    record = json.loads((tmp_path / "images" / CARRIED_KEY).read_text())
    assert record["key"] == kernel_key() and record["bytes"] == (tmp_path / "images" / CARRIED_CACHE).stat().st_size
    assert "kdat_wait" not in json.loads(done.stdout)["timings_s"]
    assert list(scratch.iterdir()) == []


def test_a_link_or_a_pipe_in_the_images_is_never_followed_nor_waited_for(tmp_path: Path) -> None:
    """The images are the manager's, and the captured engine writes into them: a link where the carried cache goes
    is not written through at capture, and a link or a FIFO where a restore reads it is not read (the probe runs)."""
    (tmp_path / "images").mkdir()
    (tmp_path / "target").write_bytes(b"kept")
    (tmp_path / "images" / CARRIED_CACHE).symlink_to(tmp_path / "target")
    (tmp_path / "cache.kdat").write_bytes(CACHE)
    assert carry(tmp_path / "cache.kdat", tmp_path / "images") is None
    assert (tmp_path / "target").read_bytes() == b"kept" and not (tmp_path / "images" / CARRIED_KEY).exists()
    for planted in ("link", "fifo"):
        images = tmp_path / planted
        images.mkdir()
        (images / "dump-work").mkdir()
        (images / "dump-work" / "criu.kdat").write_bytes(CACHE)
        assert carry(images / "dump-work" / "criu.kdat", images) == len(CACHE)
        (images / CARRIED_CACHE).unlink()
        if planted == "link":
            (tmp_path / "elsewhere").write_bytes(CACHE)
            (images / CARRIED_CACHE).symlink_to(tmp_path / "elsewhere")
        else:
            os.mkfifo(images / CARRIED_CACHE)
        (images / "kdat").mkdir()
        probe = KernelProbe(script(images, f"touch {images}/probed"), images / "kdat", images)
        assert probe.environment() == {} and (images / "probed").exists()
        probe.close()


def test_a_restore_worker_failing_before_the_restore_begins_leaves_no_probe_running(tmp_path: Path) -> None:
    """Review 11: the worker starts the probe before its imports; a failure before `restore()` took it over (here
    the first phase's line, its stderr on a full device) left the probe's `criu check` running after the worker
    had gone. It is ended and its directory removed on that path too."""
    scratch, pidfile = tmp_path / "tmp", tmp_path / "check.pid"
    scratch.mkdir()
    (tmp_path / "images").mkdir()
    criu = script(tmp_path, f'if [ "$1" = check ]; then echo $$ > {pidfile}; exec sleep 60; fi\necho "Version: 4.2"')
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "coldsnap_probe", "restore", "--images", str(tmp_path / "images"),
                               "--criu", criu], cwd=ROOT, env={**os.environ, "TMPDIR": str(scratch)},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=full, timeout=60, check=False)
    pid = int(pidfile.read_text())
    try:
        assert done.returncode != 0 and done.stdout == b""
        assert not alive(pid)  # ended by the worker, not left to run out its minute
        assert not list(scratch.glob("coldsnap-kdat-*"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

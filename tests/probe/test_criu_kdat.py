"""`_criu_kdat.KernelProbe`: CRIU's kernel-feature probe run ahead of a restore (the restore's CRIU loading its
cache is checked in test_criu_restore.py's restore test and, in a confined capsule, in test_capsule_boundary.py).
Here its ends: the built CRIU writes the cache, a CRIU that ignores the variable leaves the restore to probe for
itself, a probe that hangs is killed; the directory goes every time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap_probe import _criu_kdat
from coldsnap_probe._criu_kdat import KernelProbe
from tests.criu import CRIU, alive
from tests.helpers import ROOT


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
    while not (tmp_path / "kdat" / "pid").exists():
        assert time.monotonic() - started < 10
        time.sleep(0.01)
    pid = int((tmp_path / "kdat" / "pid").read_text())
    assert probe.environment() == {}
    assert time.monotonic() - started < 5 and not (tmp_path / "kdat").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped, not left running


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

"""The CRIU the CPU tests run: the one `scripts/criu/build` makes (named by `scripts/test` in COLDSNAP_TEST_CRIU,
else found with `--print-dir`), behind the wrapper capsules use, and what a test needs to watch a restored tree."""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import ROOT, refuse_engine

__all__ = ("CRIU", "alive", "criu_wrapper")


def _built_criu() -> Path | None:
    named = os.environ.get("COLDSNAP_TEST_CRIU")
    if named:
        assert os.access(named, os.X_OK), f"COLDSNAP_TEST_CRIU={named} is not an executable: the CRIU build is missing"
        return Path(named)
    done = subprocess.run(["bash", str(ROOT / "scripts/criu/build"), "--print-dir"], capture_output=True, text=True,
                          check=False)
    return Path(done.stdout.strip()) / "usr/sbin/criu" if done.returncode == 0 else None


CRIU = _built_criu() if os.geteuid() == 0 else None  # CRIU needs root


@contextmanager
def criu_wrapper(directory: Path) -> Iterator[str]:
    """The built CRIU behind a wrapper that sets its library path, as the capsule's criu-env does; this process
    is the subreaper of the restored trees meanwhile, so a test can wait for them."""
    refuse_engine("CRIU")
    assert CRIU is not None
    wrapper = directory / "criu-env"
    wrapper.write_text(f"#!/bin/sh\nLD_LIBRARY_PATH={CRIU.parent.parent / 'lib/x86_64-linux-gnu'} exec {CRIU} \"$@\"\n")
    wrapper.chmod(0o755)
    libc = ctypes.CDLL(None)
    libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    try:
        yield str(wrapper)
    finally:
        libc.prctl(36, 0)


def alive(pid: int) -> bool:
    """Runs (a zombie of ours is reaped here and counts as gone)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")

"""Slow builds a test module needs, started in the background when the session begins rather than in its set-up.

A module names what it needs in ``BACKGROUND_BUILDS`` (names of :data:`BUILDS`); when the session has collected a
test of such a module that no skip mark skips, tests/conftest.py's `background_builds` fixture starts those builds,
one after the other in the order of :data:`BUILDS` (the image's own .deb step then finds the package the "deb" build
cached: revision 1 is debian/changelog's), under nice 10 beside the run: on the 2-core CI box the .deb alone is
about 50 s of a core, and the run before these modules mostly waits on dockerd, the kubelet and CRIU. The test then
waits for the build's outcome (:meth:`Builds.result`) and asserts on it as it would on a build of its own.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT

__all__ = ("BUILDS", "Builds", "wanted")


@dataclass(frozen=True)
class Build:
    argv: Callable[[Path], list[str]]  # the command, given a private output directory
    timeout: float
    discard: Callable[[str], list[str]] | None = None  # a command undoing a build no test took (its last line)


_PACKAGE = ["nice", "-n", "10", "bash", str(ROOT / "scripts" / "package")]
BUILDS: dict[str, Build] = {
    # The package at Debian revision 1 (tests/provider/test_deb.py makes revision 2 from it).
    "deb": Build(lambda out: [*_PACKAGE, "deb", "--revision", "1", "--out", str(out)], timeout=500),
    # The daemon's OCI image (tests/provider/test_oci_image.py), under a tag of its own.
    "image": Build(lambda out: [*_PACKAGE, "image", "--tag", f"coldsnap-test/provider-image:{secrets.token_hex(4)}"],
                   timeout=850, discard=lambda tag: ["docker", "rmi", tag]),
}


def wanted(items: Iterable[pytest.Item]) -> set[str]:
    """The builds that the modules of `items` name in BACKGROUND_BUILDS, for the items that will run (a test a
    skip mark already skips, e.g. off root or without docker, needs none)."""
    names: set[str] = set()
    for item in items:
        skipped = any(item.iter_markers("skip")) or any(
            mark.args and mark.args[0] is True for mark in item.iter_markers("skipif"))
        if not skipped:
            names.update(getattr(getattr(item, "module", None), "BACKGROUND_BUILDS", ()))
    return names


class Builds:
    """The background builds of one session: started once, each outcome taken by the test that needs it."""

    def __init__(self, scratch: Path) -> None:
        self._scratch = scratch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="background-build")  # one at a time
        self._outcomes: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
        self._taken: set[str] = set()
        self._running: subprocess.Popen[str] | None = None

    def start(self, wanted: Iterable[str]) -> None:
        """Start the `wanted` builds (names of BUILDS), in BUILDS' order."""
        chosen = set(wanted)
        self._outcomes = {name: self._pool.submit(self._build, name) for name in BUILDS if name in chosen}

    def result(self, name: str) -> subprocess.CompletedProcess[str]:
        """The finished build `name` (waiting for it); what it made is then the caller's to use and remove."""
        assert name in self._outcomes, f"{name!r} is not in this module's BACKGROUND_BUILDS"
        self._taken.add(name)
        return self._outcomes[name].result(timeout=sum(build.timeout for build in BUILDS.values()))

    def close(self) -> None:
        """End a build still running (the session ended early), then undo what finished builds made that no test
        took."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._running is not None and self._running.poll() is None:
            self._running.terminate()
        self._pool.shutdown(wait=True)
        for name, outcome in self._outcomes.items():
            discard = BUILDS[name].discard
            if name in self._taken or discard is None or outcome.cancelled() or outcome.exception() is not None:
                continue
            done = outcome.result()
            if done.returncode == 0 and done.stdout.strip():
                subprocess.run(discard(done.stdout.splitlines()[-1]), capture_output=True, check=False, timeout=60)

    def _build(self, name: str) -> subprocess.CompletedProcess[str]:
        out = self._scratch / name
        out.mkdir()
        self._running = process = subprocess.Popen(BUILDS[name].argv(out), stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            stdout, stderr = process.communicate(timeout=BUILDS[name].timeout)
        finally:  # a timeout: nothing of it outlives the wait
            if process.poll() is None:
                process.kill()
                process.wait()
        return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

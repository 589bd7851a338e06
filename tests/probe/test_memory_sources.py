"""coldsnap_probe.memory, the memory-source seam: one registry in a defined order, capture and restore phases that
name no source, and the loop run for real: the weights source against a real engine control socket (a process of
its own), a failed release and a failed hydrate, and the rollback each triggers, with the real CRIU."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe._coordinator import Coordinator
from coldsnap_probe._reports import CaptureReport, RestoreReport
from coldsnap_probe.errors import WorkerError
from coldsnap_probe.hydration import HydrationManifest
from coldsnap_probe.memory import (
    SOURCES,
    CaptureScope,
    MemoryCaptures,
    MemoryOptions,
    MemoryRestores,
    RestoreScope,
)
from coldsnap_probe.memory import _device_dump as device_dump
from coldsnap_probe.memory import _weights as weights
from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT
from tests.probe.test_hydrate import manifest_for, region, source

PROBE = ROOT / "coldsnap_probe"

# An engine's control socket, served by a process of its own: it answers `release` with the manifest in argv[3]
# (or a document that is no manifest) and `hydrate` as argv[4] says, and logs every op it was asked, in order.
ENGINE = textwrap.dedent("""
    import json, os, socket, sys
    path, log, manifest, hydrate = sys.argv[1:5]
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen()
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        line = b""
        while not line.endswith(b"\\n"):
            line += conn.recv(65536)
        op = json.loads(line)["op"]
        with open(log, "a") as f:
            f.write(op + "\\n")
        if op == "release":
            answer = {"ok": True, "manifest": json.load(open(manifest)) if manifest != "invalid" else {"x": 1}}
        elif hydrate == "ok":
            answer = {"ok": True, "report": {"bytes": 2097152, "seconds": 0.01, "gbps": 0.2, "verified_regions": 1}}
        else:
            answer = {"ok": False, "error": "the arena refused: no backing"}
        conn.sendall(json.dumps(answer).encode() + b"\\n")
        conn.close()
""")


class Engine:
    """The engine process and what it was asked."""

    def __init__(self, directory: Path, *, manifest: str, hydrate: str) -> None:
        self.socket, self.log = str(directory / "engine.sock"), directory / "engine.log"
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, self.socket, str(self.log), manifest, hydrate],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def ops(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.stop()


def weights_manifest(tmp_path: Path, control: str) -> Path:
    """A valid hydration manifest over a real source file, naming `control` as the engine's socket."""
    made = manifest_for([region(source(tmp_path))])
    fields = {f.name: getattr(made, f.name) for f in dataclasses.fields(made) if f.name != "manifest_digest"}
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(HydrationManifest.create(**(fields | {"control": control})).to_json()))
    return path


def capture_report() -> CaptureReport:
    return CaptureReport(boundary="n610", root_pid=os.getpid(), tree=[os.getpid()], rank=0, world_size=1, engine=None)


# -- the registry and its order ------------------------------------------------------------------------------
def test_the_registry_names_each_source_once_weights_before_the_device_dump() -> None:
    assert [s.name for s in SOURCES] == ["weights", "device-dump"]
    assert [type(s) for s in SOURCES] == [weights.WeightsSource, device_dump.DeviceDumpSource]
    for s in SOURCES:  # the protocol's two halves
        assert callable(s.capture) and callable(s.load)


class Recording:
    """A source that records each call into `calls` (and fails where told): the loop's order made visible."""

    def __init__(self, name: str, calls: list[str], *, fail: str = "") -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def _do(self, what: str) -> None:
        self.calls.append(f"{what}:{self.name}")
        if what == self.fail:
            raise WorkerError(f"{self.name} failed at {what}")

    def capture(self, scope: CaptureScope) -> Recording:
        return self

    def load(self, scope: RestoreScope) -> Recording | None:
        self._do("load")
        return None if self.fail == "absent" else self

    def release(self, report: CaptureReport) -> None:
        self._do("release")

    def roll_back(self) -> None:
        self._do("roll_back")

    def warm(self) -> None:
        self._do("warm")

    def warmed(self, report: CaptureReport) -> None:
        self._do("warmed")

    def stage(self) -> None:
        self._do("stage")

    def hydrate(self, report: RestoreReport) -> None:
        self._do("hydrate")

    def discard(self) -> None:
        self._do("discard")


def test_capture_releases_in_order_and_rolls_back_what_was_begun_in_reverse(tmp_path: Path) -> None:
    """Review finding: the device memory's gate holds the engine's copies, so the last released comes back first."""
    calls: list[str] = []
    sources = (Recording("a", calls), Recording("b", calls, fail="release"), Recording("c", calls))
    captures = MemoryCaptures(CaptureScope(tmp_path, [], MemoryOptions()), sources)
    with pytest.raises(WorkerError, match="b failed at release"):
        captures.release(capture_report())
    captures.roll_back()
    # c never began; b failed half-way and is rolled back too, first
    assert calls == ["release:a", "release:b", "roll_back:b", "roll_back:a"]


def test_a_dumped_capture_offers_each_source_warm_in_order_and_one_failing_stops_no_other(tmp_path: Path) -> None:
    calls: list[str] = []
    captures = MemoryCaptures(CaptureScope(tmp_path, [], MemoryOptions()),
                              (Recording("a", calls, fail="warm"), Recording("b", calls, fail="warmed")))
    captures.release(capture_report())
    captures.warm()
    captures.warmed(capture_report())
    assert calls == ["release:a", "release:b", "warm:a", "warm:b", "warmed:a", "warmed:b"]


def test_a_rollback_that_fails_does_not_keep_the_next_sources_memory(tmp_path: Path) -> None:
    calls: list[str] = []
    captures = MemoryCaptures(CaptureScope(tmp_path, [], MemoryOptions()),
                              (Recording("a", calls), Recording("b", calls, fail="roll_back")))
    captures.release(capture_report())
    captures.roll_back()
    assert calls == ["release:a", "release:b", "roll_back:b", "roll_back:a"]


def test_restore_loads_and_stages_in_order_and_hydrates_in_reverse(tmp_path: Path) -> None:
    calls: list[str] = []
    sources = (Recording("a", calls), Recording("none", calls, fail="absent"), Recording("b", calls))
    restores = MemoryRestores(RestoreScope(tmp_path, Coordinator.single()), sources)
    restores.stage()
    restores.hydrate(RestoreReport(rank=0, world_size=1))
    restores.discard()
    assert calls == ["load:a", "load:none", "load:b", "stage:a", "stage:b", "hydrate:b", "hydrate:a",
                     "discard:a", "discard:b"]


def test_a_restore_discards_only_what_was_staged(tmp_path: Path) -> None:
    calls: list[str] = []
    restores = MemoryRestores(RestoreScope(tmp_path, Coordinator.single()),
                              (Recording("a", calls, fail="stage"), Recording("b", calls)))
    with pytest.raises(WorkerError):
        restores.stage()
    restores.discard()
    assert calls == ["load:a", "load:b", "stage:a", "discard:a"]


# -- the phases name no source -----------------------------------------------------------------------------
def _code_names(path: Path) -> set[str]:
    """Every identifier, attribute, imported module and string constant of `path`'s code (docstrings left out:
    the phase lists there say in prose what the sources are)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(node.module.split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.update(node.value.replace("/", " ").replace(".", " ").split())
    return names


@pytest.mark.parametrize("phase", ["_capture.py", "_restore.py"])
def test_the_capture_and_restore_phases_name_no_memory_source(phase: str) -> None:
    source_names = {"hydration", "interposer", "Stager", "HydrationManifest", "check_sources", "device-memory",
                    "hydrate_back"}
    for module in (weights, device_dump):
        source_names |= {module.__name__.rsplit(".", 1)[1], *module.__all__}
    for s in SOURCES:
        source_names |= {type(s).__name__, s.name}
    named = _code_names(PROBE / phase) & source_names
    assert not named, f"{phase} names memory sources: {sorted(named)}"
    assert "memory" in _code_names(PROBE / phase)  # it does reach them, through the seam


# -- the loop for real: the registry's sources against a real engine control socket ---------------------------
def test_a_failed_device_release_rolls_back_the_weights_the_engine_released(tmp_path: Path,
                                                                            engines: list[Engine]) -> None:
    """The weights are released and recorded, then the device dump refuses (one named socket, two CUDA processes):
    the rollback asks the engine to hydrate its weights back and removes their record."""
    engine = Engine(tmp_path, manifest=str(weights_manifest(tmp_path, "/run/engine.sock")), hydrate="ok")
    engines.append(engine)
    images = tmp_path / "images"
    images.mkdir()
    report = capture_report()
    captures = MemoryCaptures(CaptureScope(images, [1, 2], MemoryOptions(weights_control=engine.socket,
                                                                         interposer="/run/x.sock")))
    with pytest.raises(WorkerError, match="names one socket, the tree has 2 CUDA processes"):
        captures.release(report)
    assert report.hydration is not None and report.hydration.released_bytes == 2 * 1024 * 1024
    assert (images / weights.RECORD).exists() and engine.ops() == ["release"]
    captures.roll_back()
    assert engine.ops() == ["release", "hydrate"]
    assert list(images.iterdir()) == []


def test_a_manifest_that_cannot_restore_is_hydrated_back_at_once_and_only_once(tmp_path: Path,
                                                                              engines: list[Engine]) -> None:
    engine = Engine(tmp_path, manifest="invalid", hydrate="ok")
    engines.append(engine)
    images = tmp_path / "images"
    images.mkdir()
    captures = MemoryCaptures(CaptureScope(images, [], MemoryOptions(weights_control=engine.socket)))
    with pytest.raises(WorkerError, match="the engine's hydration manifest is invalid"):
        captures.release(capture_report())
    captures.roll_back()
    assert engine.ops() == ["release", "hydrate"] and list(images.iterdir()) == []


def test_a_capture_without_any_source_records_nothing(tmp_path: Path) -> None:
    report = capture_report()
    MemoryCaptures(CaptureScope(tmp_path, [os.getpid()], MemoryOptions())).release(report)  # no interposer here
    assert report.hydration is None and report.device_memory is None and report.timings_s == {}
    assert list(tmp_path.iterdir()) == []
    assert MemoryRestores(RestoreScope(tmp_path, Coordinator.single())).loaded == []


def test_a_record_that_cannot_restore_is_refused_at_load_naming_it(tmp_path: Path) -> None:
    (tmp_path / weights.RECORD).write_text(json.dumps({"kind": "coldsnap-hydration-manifest", "format": 1}))
    with pytest.raises(WorkerError, match="weight hydration cannot succeed, not restoring: malformed hydration"):
        MemoryRestores(RestoreScope(tmp_path, Coordinator.single()))
    (tmp_path / weights.RECORD).unlink()
    (tmp_path / device_dump.RECORD).write_text(json.dumps({"kind": "coldsnap-device-memory", "format": 2}))
    with pytest.raises(WorkerError, match=r"device-memory\.json: device memory cannot be hydrated.*format-1"):
        MemoryRestores(RestoreScope(tmp_path, Coordinator.single()))


# -- with the real CRIU: a CPU tree restored through the loop, its hydration refused, then accepted -------------
@pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")
def test_a_restore_whose_hydration_fails_kills_the_tree_and_one_that_succeeds_reports_it(
        tmp_path: Path, engines: list[Engine]) -> None:
    control, images = tmp_path / "control", tmp_path / "images"
    control.mkdir()
    with criu_wrapper(tmp_path) as criu:
        target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control),
                                   "--mib", "8"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while not (control / "ready").exists():
            assert time.monotonic() < deadline and target.poll() is None, "the target never became ready"
            time.sleep(0.02)
        done = worker("capture", "--pid", str(target.pid), "--images", str(images), "--boundary", "n580",
                      "--criu", criu)
        assert done.returncode == 0, done.stderr
        target.wait()
        refusing = Engine(_folder(tmp_path / "refusing"), manifest="invalid", hydrate="refuse")
        engines.append(refusing)
        # The images now hold a weights record whose engine refuses to hydrate.
        (images / weights.RECORD).write_text(weights_manifest(tmp_path, refusing.socket).read_text())
        done = worker("restore", "--images", str(images), "--criu", criu)
        assert done.returncode == 1
        assert "weight hydration failed, the restored engine is not released: the arena refused" in done.stderr
        assert refusing.ops() == ["hydrate"]
        assert _gone(target.pid), "the rollback left the restored tree running"
        refusing.stop()
        engines.remove(refusing)

        accepting = Engine(_folder(tmp_path / "accepting"), manifest="invalid", hydrate="ok")
        engines.append(accepting)
        (images / weights.RECORD).write_text(weights_manifest(tmp_path, accepting.socket).read_text())
        done = worker("restore", "--images", str(images), "--criu", criu)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        try:
            assert report["hydration"]["bytes"] == 2 * 1024 * 1024 and report["hydration"]["staged"] is None
            marks = [m["name"] for m in report["timeline"]]
            assert marks.index("process_resumed") < marks.index("hydration_begin") < marks.index("hydration_end")
            assert "device_memory" not in report and "memory_sources" not in report
            assert accepting.ops() == ["hydrate"] and alive(report["restored_pid"])
        finally:
            os.killpg(report["restored_pid"], signal.SIGKILL)
        assert _gone(report["restored_pid"])


def worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=280)


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _folder(path: Path) -> Path:
    path.mkdir()
    return path

"""The CUDA interposer on a GPU: an unchanged torch process (tensors, a cuBLAS matmul, a captured CUDA graph)
under the preload is released (dumped, unmapped), CUDA-checkpointed and restored from a second process, then
hydrated: same digests, the graph replays the same output. A corrupt, a shorter dump and too little device
memory are refused naming the phase and file, leave nothing mapped and keep the gate closed; a launch made while
the memory is released waits for the hydration. Skipped without an NVIDIA driver."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration import DeviceDump, build_library, check_dump
from coldsnap_probe.hydration._digests import DIGEST_CHUNK
from coldsnap_probe.hydration._interposer import interposer_request
from tests.criu import alive
from tests.helpers import ROOT
from tests.probe.test_main import has_nvidia_driver

pytestmark = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
MIB = 1 << 20
TARGET_MIB = 1024


def log_tail(path: Path) -> str:
    """The end of the target's log (beside its request directory)."""
    log = path.parent.parent / "target.log"
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""


def wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> dict[str, Any]:
    give_up = time.monotonic() + timeout
    while not path.exists():
        # After a restore, `proc` (CRIU killed it, it was reaped) is gone and the restored process has its pid.
        assert proc.poll() is None or alive(proc.pid), f"the target exited {proc.returncode}: {log_tail(path)}"
        assert time.monotonic() < give_up, f"no {path.name} within {timeout} s"
        time.sleep(0.02)
    value: dict[str, Any] = json.loads(path.read_text())
    return value


class Target:
    """The torch process and its interposer socket; `ask` leaves a request file and waits for the answer."""

    def __init__(self, root: Path, library: Path, socket: str = "cuda.sock", mib: int = TARGET_MIB,
                 alloc_conf: str = "", zero_mib: int = 160) -> None:
        self.directory = root / "target"
        self.directory.mkdir()
        self.socket = str(root / socket)
        env = {**os.environ, "LD_PRELOAD": str(library), "COLDSNAP_CUDA_INTERPOSER_SOCKET": self.socket}
        if alloc_conf:  # PyTorch's allocator settings (tests/probe/test_interposer_gpu_allocators.py)
            env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
        self.log = root / "target.log"  # a plain file: CRIU dumps it with the process (not a pipe to pytest)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.probe._torch_target", str(self.directory),
                                          str(mib), str(zero_mib)], cwd=ROOT, env=env, start_new_session=True,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        self.ready = wait_for(self.directory / "ready", self.proc)
        self.count = 0

    def ask(self, kind: str, timeout: float = 60.0) -> dict[str, Any]:
        self.count += 1
        (self.directory / f"{kind}-{self.count}").touch()
        return wait_for(self.directory / f"answer-{kind}-{self.count}", self.proc, timeout)

    def request(self, message: dict[str, Any], what: str = "interposer") -> dict[str, Any]:
        """One request; a refusal or a silence (20 s: 1 GiB is dumped or filled in a few) fails naming the
        operation, with the end of the target's log (the interposer writes its complaints there)."""
        try:
            return interposer_request(self.socket, message, f"{what} {message.get('op')}", timeout=20.0)
        except HydrationError as exc:
            raise HydrationError(f"{exc}\n--- target log ---\n{log_tail(self.directory / 'ready')}") from exc

    def release(self, dump: Path) -> DeviceDump:
        if dump.exists():
            shutil.rmtree(dump)
        dump.mkdir(mode=0o700)
        answer = self.request({"op": "release", "dir": str(dump)})
        return DeviceDump.from_json(answer["manifest"], answered=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    root = tmp_path_factory.mktemp("interposer-gpu")
    library, diagnostics = build_library(root / "lib")
    assert diagnostics == ""
    target = Target(root, library)
    try:
        yield target
    finally:
        os.killpg(target.proc.pid, 9)
        target.proc.wait()


def test_torch_allocations_go_through_the_interposer(target: Target) -> None:
    status = target.request({"op": "status"})
    assert status["regions"] > 0 and status["bytes"] >= TARGET_MIB * MIB and status["gate"] == "open"
    assert status["released"] is False
    wrapped = set(status["wrapped"])  # torch's runtime reached the driver through cuGetProcAddress, so through us
    assert "cuMemAlloc_v2" in wrapped and wrapped & {"cuLaunchKernel", "cuLaunchKernel_ptsz"}, wrapped


def test_a_released_dump_matches_its_manifest_and_every_address_stays_reserved(target: Target,
                                                                             tmp_path: Path) -> None:
    dump = target.release(tmp_path / "dump")
    assert dump.bytes >= TARGET_MIB * MIB and dump.gbps > 0, dump.timings_s
    status = target.request({"op": "status"})
    assert status["released"] is True and status["gate"] == "closed" and status["mapped_bytes"] == 0, status
    with pytest.raises(HydrationError, match="released already"):
        target.request({"op": "release", "dir": str(tmp_path)}, "second release")
    check_dump(dump, tmp_path / "dump", content=True)  # the C digests equal the Python ones
    assert dump.segments[0].digest.startswith("crc32-64m:"), dump.segments[0].digest  # the default kind
    # The target's 160 MiB of zeros: its chunks are recorded and never written (holes: less on disk than held).
    zero_chunks = sum(bin(s.zero).count("1") for s in dump.segments)
    assert zero_chunks >= 2, [(s.file, s.size, s.zero) for s in dump.segments]
    held = sum((tmp_path / "dump" / s.file).stat().st_blocks * 512 for s in dump.segments)
    assert held <= dump.bytes - 128 * MIB, (held, dump.bytes)
    report = target.request({"op": "hydrate"})["report"]
    assert report["bytes"] == dump.bytes
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}


def test_a_corrupt_dump_is_refused_and_nothing_stays_mapped(target: Target, tmp_path: Path) -> None:
    dump = target.release(tmp_path / "dump")
    first = tmp_path / "dump" / dump.segments[0].file
    original = first.read_bytes()[4096:4097]
    with open(first, "r+b") as f:
        f.seek(4096)
        f.write(bytes([original[0] ^ 0xFF]))
    with pytest.raises(HydrationError, match=rf"hydrate: fill: dump file {first.name} .* does not match its digest"):
        target.request({"op": "hydrate"})
    status = target.request({"op": "status"})
    assert status["released"] is True and status["gate"] == "closed" and status["mapped_bytes"] == 0
    with open(first, "r+b") as f:
        f.seek(4096)
        f.write(original)
    target.request({"op": "hydrate"})
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}


def test_a_shorter_dump_is_refused_before_anything_is_created(target: Target, tmp_path: Path) -> None:
    dump = target.release(tmp_path / "dump")
    last = tmp_path / "dump" / dump.segments[-1].file
    kept = tmp_path / "kept.bin"
    shutil.copy2(last, kept)
    os.truncate(last, dump.segments[-1].size - 1)
    with pytest.raises(HydrationError, match=rf"hydrate: dump file .*/{last.name} holds .* the dump is shorter"):
        target.request({"op": "hydrate"})
    assert target.request({"op": "status"})["mapped_bytes"] == 0
    shutil.copy2(kept, last)
    target.request({"op": "hydrate"})
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}


def test_too_little_device_memory_is_refused_and_what_was_created_is_released(target: Target,
                                                                             tmp_path: Path) -> None:
    from coldsnap_probe._cuda import Driver

    target.release(tmp_path / "dump")
    driver = Driver()
    driver.context()
    free, _total = driver.call("cuMemGetInfo")
    hog = driver.call("cuMemAlloc_v2", int(free) - 512 * MIB)  # room for some regions, not all
    try:
        with pytest.raises(HydrationError, match=r"hydrate: create: region 0x[0-9a-f]+ .*OUT_OF_MEMORY"):
            target.request({"op": "hydrate"})
        assert target.request({"op": "status"})["mapped_bytes"] == 0
    finally:
        driver.call("cuMemFree_v2", hog)
    target.request({"op": "hydrate"})
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}


def test_a_launch_while_released_waits_for_the_hydration(target: Target, tmp_path: Path) -> None:
    target.release(tmp_path / "dump")
    target.count += 1
    (target.directory / f"launch-{target.count}").touch()
    answer = target.directory / f"answer-launch-{target.count}"
    time.sleep(1.5)
    assert not answer.exists(), "a launch ran on released memory"
    report = target.request({"op": "hydrate", "verify": "sampled"})["report"]
    hydrated = time.time()
    assert report["verify"] == "sampled" and report["zero_bytes"] >= 128 * MIB  # set on the device, not copied
    done = wait_for(answer, target.proc)
    assert done["finished_unix"] <= time.time() and done["finished_unix"] >= hydrated - 0.5
    assert target.ask("check") == {**target.ready, "pid": target.proc.pid}


def checkpoint_and_restore(pid: int) -> None:
    """`pid`'s CUDA state through the driver's checkpoint and back (locked, checkpointed, restored, unlocked), as a
    capture and a restore on the same GPU take it, each state checked."""
    from coldsnap_probe._cuda import Driver
    from coldsnap_probe._process import require_state

    driver = Driver()
    driver.call("cuInit", 0)
    args = driver.cuda.CUcheckpointLockArgs()
    args.timeoutMs = 30_000
    driver.call("cuCheckpointProcessLock", pid, args)
    driver.call("cuCheckpointProcessCheckpoint", pid, None)
    require_state(driver, [pid], "checkpointed", "after checkpoint")
    driver.call("cuCheckpointProcessRestore", pid, None)
    driver.call("cuCheckpointProcessUnlock", pid, None)
    require_state(driver, [pid], "running", "after unlock")


def test_released_checkpointed_restored_hydrated_gives_the_same_bytes_and_graph(target: Target,
                                                                               tmp_path: Path) -> None:
    dump = target.release(tmp_path / "dump")
    pid = target.proc.pid
    checkpoint_and_restore(pid)
    report = target.request({"op": "hydrate", "policy": "same-gpu"})["report"]
    assert report["bytes"] == dump.bytes and report["policy"] == "same-gpu"
    assert target.ask("check") == {**target.ready, "pid": pid}


# -- through the workers: capture finds the socket in the environment, restore hydrates after CRIU + CUDA ------
criu_and_gpu = pytest.mark.skipif(not has_nvidia_driver() or shutil.which("criu") is None,
                                  reason="needs an NVIDIA driver and CRIU (run on the GPU host)")


@pytest.fixture
def torch_target(tmp_path: Path) -> Iterator[Target]:
    """A fresh torch target whose socket name carries its pid (as a unit's environment would)."""
    library, _ = build_library(tmp_path / "lib")
    target = Target(tmp_path, library, socket="cuda-%p.sock", mib=256)
    try:
        yield target
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target.proc.pid, 9)
        target.proc.wait()


@criu_and_gpu
def test_the_workers_capture_and_restore_an_unchanged_torch_process(torch_target: Target, tmp_path: Path) -> None:
    from tests.probe.test_worker import kill_and_reap, worker

    ctypes.CDLL(None).prctl(36, 1)  # a subreaper: the restored tree is reparented here
    images = tmp_path / "images"
    done = worker("capture", "--pid", str(torch_target.proc.pid), "--images", str(images), "--criu",
                  shutil.which("criu") or "")
    assert done.returncode == 0, done.stderr
    torch_target.proc.wait()  # CRIU killed it: its pid is free for the restore
    capture = json.loads(done.stdout)
    [released] = capture["device_memory"]
    assert released["state"] == "released" and released["bytes"] >= 256 * MIB
    assert released["socket"] == torch_target.socket.replace("%p", str(torch_target.proc.pid))
    assert "device_release" in capture["timings_s"] and (images / "device-memory.json").exists()
    done = worker("restore", "--images", str(images), "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [hydrated] = report["device_memory"]
    assert hydrated["bytes"] == released["bytes"] and hydrated["interposer"]["verify"] == "sampled"
    names = [m["name"] for m in report["timeline"]]
    assert names.index("process_resumed") < names.index("device_hydration_begin") < names.index("ready")
    assert torch_target.ask("check") == {**torch_target.ready, "pid": torch_target.proc.pid}
    kill_and_reap(report["restored_pid"])


@criu_and_gpu
def test_a_failed_capture_hydrates_the_process_back_and_removes_the_dump(torch_target: Target,
                                                                         tmp_path: Path) -> None:
    from tests.probe.test_worker import worker

    images = tmp_path / "images"
    done = worker("capture", "--pid", str(torch_target.proc.pid), "--images", str(images), "--criu", "/bin/false")
    assert done.returncode == 1 and "criu dump exited 1" in done.stderr
    socket = torch_target.socket.replace("%p", str(torch_target.proc.pid))
    status = interposer_request(socket, {"op": "status"}, "status")
    assert status["released"] is False and status["gate"] == "open" and status["mapped_bytes"] == status["bytes"]
    assert not list(images.glob("device-*")) and not (images / "device-memory.json").exists()
    assert torch_target.ask("check") == {**torch_target.ready, "pid": torch_target.proc.pid}


@pytest.fixture(scope="module")
def dump_hydrator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A node hydrator that holds no weights and stages device dumps (`serve --staging`, no sources)."""
    root = tmp_path_factory.mktemp("dump-hydrator")
    path, log = root / "hydrator.sock", root / "hydrator.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(path),
                                 "--staging"], cwd=ROOT, stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    try:
        give_up = time.monotonic() + 60
        while '"ready"' not in log.read_text():
            assert proc.poll() is None and time.monotonic() < give_up, log.read_text()[-2000:]
            time.sleep(0.05)
        yield str(path)
    finally:
        proc.kill()
        proc.wait()


def test_a_dump_staged_by_the_node_hydrator_is_mapped_in_place(dump_hydrator: str, tmp_path: Path) -> None:
    """Regression: cuMemMap's offset must be zero, and a part of a larger allocation is refused (the H200 answered
    CUDA_ERROR_NOT_SUPPORTED when every region was mapped onto a part of one staged allocation): the hydrator stages
    one allocation per region, and the interposer maps each whole at its region. Several regions, one over 1 GiB
    (two segment files, one allocation); every byte adopted is compared with the dump (a second release digests
    what the device holds), then the torch tensors, matmul and graph."""
    from coldsnap_probe.hydration import dump_identities
    from coldsnap_probe.memory._device_dump import DumpRecord, hydrate_devices, stages_for

    library, _ = build_library(tmp_path / "lib")
    target = Target(tmp_path, library, socket="staged.sock", mib=1100)
    try:
        dump = target.release(tmp_path / "dump")
        assert len(dump.regions) >= 2, [r.size for r in dump.regions]
        assert any(r.size > 1 << 30 and len(r.segments) == 2 for r in dump.regions), [r.size for r in dump.regions]
        record = DumpRecord(target.proc.pid, target.socket, "dump", dump, dump_identities(dump, tmp_path / "dump"),
                            dump_hydrator)
        stages = stages_for([record], tmp_path)
        [hydrated] = hydrate_devices([record], tmp_path, "same-model", stages=stages)
        assert hydrated.interposer.get("staged") is True, hydrated.interposer
        assert hydrated.interposer["regions"] == len(dump.regions) and hydrated.bytes == dump.bytes
        assert hydrated.interposer["stage"]["bytes"] == dump.bytes
        assert hydrated.interposer["stage"]["allocations"] == len(dump.regions)
        status = target.request({"op": "status"})
        assert status["gate"] == "open" and status["mapped_bytes"] == dump.bytes, status
        assert interposer_request(dump_hydrator, {"op": "status"}, "hydrator status")["staged"] == []  # all taken
        # Nothing ran on the device since: a release now dumps exactly what the adopted allocations hold.
        again = target.release(tmp_path / "again")
        assert [(s.address, s.size, s.digest) for s in again.segments] == [
            (s.address, s.size, s.digest) for s in dump.segments]
        target.request({"op": "hydrate", "verify": "sampled"})  # adopted regions come back like created ones
        assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
    finally:
        os.killpg(target.proc.pid, 9)
        target.proc.wait()


def test_a_dump_half_of_zeros_is_restored_moving_only_its_other_half(dump_hydrator: str, tmp_path: Path) -> None:
    """Issues 34 and 36: chunks of zeros are set on the device, never read from the dump nor moved over the link.
    A process holding 512 MiB of random data and 512 MiB of zeros: the node hydrator's stage reads and copies
    exactly the bytes the manifest does not mark as zeros, and sets the rest; the interposer's own fill with every
    byte digested does the same (the zeros checked as zeros against the release's digests). Every byte is right
    afterwards: a release digests what the device holds, and the torch process's tensors, matmul and graph."""
    from coldsnap_probe.hydration import dump_identities
    from coldsnap_probe.memory._device_dump import DumpRecord, hydrate_devices, stages_for

    library, _ = build_library(tmp_path / "lib")
    target = Target(tmp_path, library, socket="half.sock", mib=512, zero_mib=512)
    try:
        dump = target.release(tmp_path / "dump")
        zero = sum(min(DIGEST_CHUNK, s.size - c * DIGEST_CHUNK) for s in dump.segments
                   for c in range(-(-s.size // DIGEST_CHUNK)) if s.zero >> c & 1)
        assert zero >= 512 * MIB and dump.bytes - zero <= 512 * MIB + 64 * MIB, (zero, dump.bytes)
        record = DumpRecord(target.proc.pid, target.socket, "dump", dump, dump_identities(dump, tmp_path / "dump"),
                            dump_hydrator)
        [hydrated] = hydrate_devices([record], tmp_path, "same-model", stages=stages_for([record], tmp_path))
        stage = hydrated.interposer["stage"]
        assert hydrated.interposer.get("staged") is True, hydrated.interposer
        assert (stage["zero_bytes"], stage["copied_bytes"], stage["bytes"]) == (zero, dump.bytes - zero, dump.bytes)
        assert hydrated.interposer["zero_bytes"] == zero  # recorded; the stage set them
        again = target.release(tmp_path / "again")
        assert [(s.address, s.size, s.digest, s.zero) for s in again.segments] == [
            (s.address, s.size, s.digest, s.zero) for s in dump.segments]
        report = target.request({"op": "hydrate", "verify": "digest"})["report"]
        assert (report["zero_set_bytes"], report["copied_bytes"]) == (zero, dump.bytes - zero), report
        assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
        print(f"half of zeros: {dump.bytes} bytes, {zero} set on the device; stage copy_s {stage['copy_s']:.3f}, "
              f"in-process fill with digests {report['fill_s']:.3f} s")
    finally:
        os.killpg(target.proc.pid, 9)
        target.proc.wait()

"""A capture's device dump offered to the node hydrator's RAM tier once the tree is dumped (`hydration/_warm.py`,
and the capture worker's `DeviceWarm`), so that the first restore's stage is a hit (issue 34).

The CPU tests run the hydrator's own `Warms` behind a real socket (a `jsonline.LineServer`, as the hydrator answers
its connections), a real `RamTier` pinning with mlock (where the hydrator pins with cuMemHostRegister), real dump
files and the peer's real view; the GPU test runs the real hydrator: a warm, then the first stage-dump is
`tier: ram` with the files' bytes."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe import jsonline
from coldsnap_probe._reports import CaptureReport, DumpedDevice
from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration import DeviceDump
from coldsnap_probe.hydration._peer_files import dump_layout, dump_reads, open_dump_parts
from coldsnap_probe.hydration._peer_view import OPENERS, PeerView
from coldsnap_probe.hydration._ram_tier import RamTier
from coldsnap_probe.hydration._request_fields import stage_key
from coldsnap_probe.hydration._warm import Warms
from coldsnap_probe.memory._device_dump import DeviceWarm, DumpRecord, stage_parts
from tests.helpers import ROOT
from tests.probe._peers import AS_NOBODY, connected, listening
from tests.probe.test_interposer import dump_in
from tests.probe.test_main import has_nvidia_driver
from tests.probe.test_ram_tier import mlock, munlock_and_unmap, settle

MIB = 1 << 20


class Hydrator:
    """The hydrator's warm path without its GPU: `Warms` into a RamTier pinning with mlock, answered on a real
    socket as the hydrator answers (a thread per connection; an error is `ok: false` to that peer)."""

    def __init__(self, path: Path, budget: int) -> None:
        self.tier = RamTier(budget, pin=mlock, unpin=munlock_and_unmap)
        self.warms = Warms(self.tier, threading.BoundedSemaphore(OPENERS))
        self.server = jsonline.LineServer(jsonline.listen(str(path)), self._one, peers=jsonline.Peers(),
                                          threads=2).start()

    def _one(self, conn: socket.socket, peer: jsonline.Peer) -> jsonline.Answer:
        message = jsonline.read_request(conn)
        return self.warms.warm(stage_key(message), message, peer, conn)


@pytest.fixture
def hydrator(tmp_path: Path) -> Iterator[tuple[Path, Hydrator]]:
    served = Hydrator(tmp_path / "hydrator.sock", 64 * MIB)
    try:
        yield tmp_path / "hydrator.sock", served
    finally:
        served.server.close()
        served.tier.close()


def captured(images: Path, hydrator: Path, sizes: tuple[int, ...] = (4 * MIB, 2 * MIB)) -> DumpRecord:
    """A released process's record, as the capture writes it: its dump in `images/device-42`, its hydrator named."""
    dump = dump_in(images / "device-42", sizes)
    return DumpRecord(42, "", "device-42", dump, {}, str(hydrator))


def capture_report() -> CaptureReport:
    report = CaptureReport(boundary="n610", root_pid=os.getpid(), tree=[os.getpid()], rank=0, world_size=1,
                           engine=None)
    report.device_memory = [DumpedDevice(pid=42, socket="", state="released"), DumpedDevice(pid=7, socket="",
                                                                                             state="not-started")]
    return report


def first_stage_lease(tier: RamTier, record: DumpRecord, images: Path) -> Any:
    """What the first restore's stage-dump gets from the tier: the parts its `DeviceStage` names, opened in the
    worker's own view (this process, as root), looked up as `_stage_dump` does."""
    parts, _sizes = stage_parts(record.dump, images / record.directory)
    layout, _ = dump_layout(parts)
    with listening() as (listener, sock), connected(listener, sock) as (conn, peer, _), \
            PeerView.of(conn, peer, openers=threading.BoundedSemaphore(OPENERS)) as view:
        _parts, fds = open_dump_parts(layout, view)
        try:
            lease = tier.lease(record.dump.manifest_digest, fds, dump_reads(layout))
            if lease is None:
                return None
            try:
                return {named: ctypes.string_at(at, os.fstat(fds[named]).st_size)
                        for named, at in lease.addresses.items()}
            finally:
                lease.release()
        finally:
            for fd in fds.values():
                os.close(fd)


class TestOffered:
    def test_a_capture_offers_its_dump_and_the_first_restores_stage_is_a_hit(self, tmp_path: Path,
                                                                            hydrator: Any) -> None:
        path, served = hydrator
        images = tmp_path / "images"
        record = captured(images, path)
        assert first_stage_lease(served.tier, record, images) is None  # without the offer: a miss
        report = capture_report()
        DeviceWarm([record], images).record(report)
        offered, other = report.device_memory or []
        assert offered.warm is not None and offered.warm["queued"] is True and offered.warm["seconds"] < 2, offered
        assert other.warm is None  # a process that released nothing is offered nothing
        assert offered.to_json()["warm"] == offered.warm and "warm" not in other.to_json()
        status = settle(served.tier)
        assert (status["entries"], status["bytes"], status["loads"]) == (1, 6 * MIB, 1), status
        held = first_stage_lease(served.tier, record, images)
        assert held == {str(images / "device-42" / f"seg-{i}.bin"): (images / "device-42" / f"seg-{i}.bin")
                        .read_bytes() for i in (0, 1)}
        assert served.warms.status() == {"queued": 1, "not_queued": 0}

    def test_a_dump_offered_again_is_not_queued_twice(self, tmp_path: Path, hydrator: Any) -> None:
        path, served = hydrator
        record = captured(tmp_path / "images", path)
        for _ in range(2):
            DeviceWarm([record], tmp_path / "images").record(report := capture_report())
            settle(served.tier)
        assert (report.device_memory or [])[0].warm == {"queued": False, "seconds": pytest.approx(0, abs=2)}
        assert served.warms.status() == {"queued": 1, "not_queued": 1} and served.tier.status()["loads"] == 1

    def test_a_dump_larger_than_the_budget_is_queued_and_not_held_nothing_evicted(self, tmp_path: Path) -> None:
        path, served = tmp_path / "small.sock", Hydrator(tmp_path / "small.sock", 4 * MIB)
        try:
            small = captured(tmp_path / "small", path, (2 * MIB,))
            DeviceWarm([small], tmp_path / "small").record(capture_report())
            settle(served.tier)
            large = captured(tmp_path / "large", path, (4 * MIB, 2 * MIB))
            DeviceWarm([large], tmp_path / "large").record(capture_report())
            status = settle(served.tier)
            assert (status["entries"], status["skipped"]["too_large"], status["evictions"]) == (1, 1, 0), status
            assert first_stage_lease(served.tier, small, tmp_path / "small") is not None
        finally:
            served.server.close()
            served.tier.close()

    def test_a_removed_capture_is_let_go_at_the_next_prune(self, tmp_path: Path, hydrator: Any) -> None:
        """The warm's cancellation: the capture collected (or rolled back) removes its files."""
        path, served = hydrator
        record = captured(tmp_path / "images", path)
        DeviceWarm([record], tmp_path / "images").record(capture_report())
        assert settle(served.tier)["entries"] == 1
        shutil.rmtree(tmp_path / "images")
        served.tier.prune()
        assert (served.tier.status()["entries"], served.tier.status()["dropped"]) == (0, 1)


class TestRefused:
    def test_no_hydrator_there_is_reported_and_the_capture_goes_on_at_once(self, tmp_path: Path) -> None:
        record = captured(tmp_path / "images", tmp_path / "absent.sock")
        started = time.monotonic()
        DeviceWarm([record], tmp_path / "images").record(report := capture_report())
        warm = (report.device_memory or [])[0].warm
        assert warm is not None and warm["queued"] is False and "absent.sock" in warm["error"], warm
        assert time.monotonic() - started < 2

    def test_a_process_on_two_gpus_is_not_offered(self, tmp_path: Path, hydrator: Any) -> None:
        """As a restore stages it: one stage per process on one GPU."""
        path, served = hydrator
        value = captured(tmp_path / "images", path).dump.to_json()
        value["regions"][1]["device_uuid"] = "GPU-11111111-0000-0000-0000-000000000000"
        record = DumpRecord(42, "", "device-42", DeviceDump.from_json(value, answered=True), {}, str(path))
        DeviceWarm([record], tmp_path / "images").record(report := capture_report())
        assert (report.device_memory or [])[0].warm is None and served.warms.status()["queued"] == 0

    def test_a_file_the_peer_may_not_read_is_refused_naming_it_and_nothing_is_queued(self, tmp_path: Path) -> None:
        if os.geteuid() != 0:
            pytest.skip("needs root: the peer is another uid")
        top = Path("/tmp") / f"cs-warm-{os.getpid()}"
        top.mkdir(mode=0o700)
        tier = RamTier(64 * MIB, pin=mlock, unpin=munlock_and_unmap)
        try:
            record = captured(top, top / "unused.sock")
            parts, _sizes = stage_parts(record.dump, top / "device-42")
            warms = Warms(tier, threading.BoundedSemaphore(OPENERS))
            message = {"op": "warm", "key": record.dump.manifest_digest, "parts": parts}
            with listening() as (listener, sock), connected(listener, sock, AS_NOBODY) as (conn, peer, _), \
                    pytest.raises(HydrationError, match="peer uid 65534 may not read"):
                warms.warm(record.dump.manifest_digest, message, peer, conn)
            assert tier.status()["loading"] == 0 and warms.status() == {"queued": 0, "not_queued": 0}
        finally:
            tier.close()
            shutil.rmtree(top)

    def test_a_sparse_exbibyte_part_is_answered_at_once_and_skipped_as_too_large(self, tmp_path: Path,
                                                                                   hydrator: Any) -> None:
        """A part's bytes are the peer's word, bounded only by its file: on a tmpfs a sparse file may be 4 EiB. The
        runs a warm (or a stage-dump) reads are found from the part's mask, not chunk by chunk: 2**36 chunks of
        64 MiB held the hydrator's thread for days and its memory grew without end (without the fix this answer
        never comes within the timeout)."""
        path, served = hydrator
        record = captured(tmp_path / "images", path)
        huge = Path("/dev/shm") / f"cs-warm-huge-{os.getpid()}.bin"
        huge.touch()
        try:
            try:
                os.truncate(huge, 1 << 62)
            except OSError as exc:
                pytest.skip(f"no tmpfs at /dev/shm to hold a sparse 4 EiB file: {exc}")
            answer = jsonline.request(str(path), {"op": "warm", "key": record.dump.manifest_digest, "parts": [
                {"file": str(huge), "bytes": 1 << 62, "region": 0, "zero": 0b101}]}, timeout=10.0)
            assert answer == {"ok": True, "queued": True}, answer
            status = settle(served.tier)
            assert (status["entries"], status["skipped"]["too_large"], status["evictions"]) == (0, 1, 0), status
        finally:
            huge.unlink()

    def test_bad_parts_are_refused_naming_the_field(self, tmp_path: Path, hydrator: Any) -> None:
        path, served = hydrator
        record = captured(tmp_path / "images", path)
        answer = jsonline.request(str(path), {"op": "warm", "key": record.dump.manifest_digest,
                                              "parts": [{"file": "relative.bin", "bytes": 2 * MIB, "region": 0}]},
                                  timeout=10.0)
        assert answer["ok"] is False and "parts[0] must be" in answer["error"], answer
        assert served.warms.status() == {"queued": 0, "not_queued": 0}


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_the_real_hydrator_serves_the_first_stage_after_a_warm_from_the_ram_tier(tmp_path: Path) -> None:
    """The real hydrator, warming by default (it has a RAM tier): `warm` answers at once (queued), its status
    counts it, and the first stage-dump of the dump is `tier: ram`, the adopted bytes identical to the files'.
    Prints the warm's and the stage's seconds."""
    from coldsnap_probe.jsonline import request
    from tests.probe._staged import stage_and_read
    from tests.probe.test_ram_tier import dump

    first, second = dump(tmp_path / "seg-0.bin", 256 * MIB), dump(tmp_path / "seg-1.bin", 64 * MIB)
    parts = [{"file": str(first), "bytes": 256 * MIB, "region": 0},
             {"file": str(second), "bytes": 64 * MIB, "region": 0}]
    control = str(tmp_path / "hydrator.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--ram-tier-bytes", "1G"],  # warms by default, with a RAM tier
                            stdout=subprocess.PIPE, cwd=ROOT)
    try:
        from tests.probe.test_ram_tier import KEY

        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        started = time.perf_counter()
        warmed = request(control, {"op": "warm", "key": KEY, "parts": parts, "device_uuid": ready["device_uuid"]},
                         timeout=10.0)
        warm_s = time.perf_counter() - started
        assert warmed == {"ok": True, "queued": True}, warmed
        deadline = time.monotonic() + 60
        while (tier := request(control, {"op": "status"}, timeout=10.0)["ram_tier"])["entries"] < 1:
            assert time.monotonic() < deadline, tier
            time.sleep(0.05)
        loaded_s = time.perf_counter() - started
        assert tier["warms"] == {"queued": 1, "not_queued": 0}, tier
        stage, staged_bytes = stage_and_read(None, control, KEY, parts, ready["device_uuid"])
        assert stage["tier"] == "ram" and staged_bytes == first.read_bytes() + second.read_bytes(), stage
        tier = request(control, {"op": "status"}, timeout=10.0)["ram_tier"]
        assert (tier["hits"], tier["misses"]) == (1, 0), tier
        print(json.dumps({"warm_gpu": {"warm_answer_s": warm_s, "loaded_s": loaded_s,
                                       "first_stage": {k: stage[k] for k in ("stage_s", "copy_s", "tier")}}}))
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_a_real_release_offered_at_capture_is_restored_from_the_ram_tier_on_its_first_stage(tmp_path: Path) -> None:
    """Issue 34, both halves on the real chain: a torch process's device memory released by the real interposer
    (512 MiB of data, 512 MiB of zeros), offered by the capture's `DeviceWarm` to a real hydrator whose RAM tier's
    budget is below the dump's size and above its data (as JAX's 35 GB against the 32 GiB default); the first
    stage is `tier: ram`, the zeros set on the device, and every byte is right afterwards (a second release digests
    what the device holds; the process's tensors, matmul and graph check out)."""
    from coldsnap_probe.hydration import build_library, dump_identities
    from coldsnap_probe.hydration._digests import DIGEST_CHUNK
    from coldsnap_probe.memory._device_dump import hydrate_devices, stages_for
    from tests.probe.test_interposer_gpu import Target

    library, _ = build_library(tmp_path / "lib")
    control = tmp_path / "hydrator.sock"
    target = Target(tmp_path, library, socket="warm.sock", mib=512, zero_mib=512)
    hydrator = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                                 "--staging", "--ram-tier-bytes", "800M", "--warm-captures"],
                                stdout=subprocess.PIPE, cwd=ROOT)
    try:
        json.loads(hydrator.stdout.readline())  # type: ignore[union-attr]
        dump = target.release(tmp_path / "dump")
        zero = sum(min(DIGEST_CHUNK, s.size - c * DIGEST_CHUNK) for s in dump.segments
                   for c in range(-(-s.size // DIGEST_CHUNK)) if s.zero >> c & 1)
        assert dump.bytes > 800 * MIB > dump.bytes - zero, (dump.bytes, zero)
        record = DumpRecord(target.proc.pid, target.socket, "dump", dump, dump_identities(dump, tmp_path / "dump"),
                            str(control))
        report = CaptureReport(boundary="n610", root_pid=target.proc.pid, tree=[target.proc.pid], rank=0,
                               world_size=1, engine=None)
        report.device_memory = [DumpedDevice(pid=target.proc.pid, socket=target.socket, state="released")]
        DeviceWarm([record], tmp_path).record(report)
        assert (report.device_memory[0].warm or {}).get("queued") is True, report.device_memory
        deadline = time.monotonic() + 60
        while (tier := jsonline.request(str(control), {"op": "status"}, timeout=10.0)["ram_tier"])["entries"] < 1:
            assert time.monotonic() < deadline and not tier["skipped"]["too_large"], tier
            time.sleep(0.05)
        [hydrated] = hydrate_devices([record], tmp_path, "same-model", stages=stages_for([record], tmp_path))
        stage = hydrated.interposer["stage"]
        assert hydrated.interposer.get("staged") is True and stage["tier"] == "ram", hydrated.interposer
        assert (stage["zero_bytes"], stage["copied_bytes"]) == (zero, dump.bytes - zero), stage
        again = target.release(tmp_path / "again")
        assert [(s.address, s.size, s.digest, s.zero) for s in again.segments] == [
            (s.address, s.size, s.digest, s.zero) for s in dump.segments]
        target.request({"op": "hydrate", "verify": "sampled"})
        assert target.ask("check") == {**target.ready, "pid": target.proc.pid}
    finally:
        os.killpg(target.proc.pid, 9)
        target.proc.wait()
        hydrator.kill()
        hydrator.wait()


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_the_real_hydrators_first_stage_during_a_warm_joins_it_with_the_files_bytes(tmp_path: Path) -> None:
    """Issue 35 on the real hydrator: a stage-dump that comes while the warm's load is partway joins it (`tier:
    joined`): the pinned part copied from RAM beside the rest read from the files, at once, the adopted bytes
    identical to the files'; the load pauses meanwhile and then completes, and the next stage is a hit. Prints
    the stage's and the copy's seconds and what came from RAM."""
    from coldsnap_probe.jsonline import request
    from tests.probe._staged import stage_and_read
    from tests.probe.test_ram_tier import KEY, dump

    files = [dump(tmp_path / f"seg-{n}.bin", 256 * MIB, bytes([n]) * 4096 + os.urandom(4096)) for n in range(8)]
    parts = [{"file": str(f), "bytes": 256 * MIB, "region": 0} for f in files]
    control = str(tmp_path / "hydrator.sock")
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", control,
                             "--staging", "--ram-tier-bytes", "3G", "--warm-captures"],
                            stdout=subprocess.PIPE, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        warmed = request(control, {"op": "warm", "key": KEY, "parts": parts, "device_uuid": ready["device_uuid"]},
                         timeout=10.0)
        assert warmed == {"ok": True, "queued": True}, warmed
        deadline = time.monotonic() + 60
        while not (tier := request(control, {"op": "status"}, timeout=10.0)["ram_tier"])["loading_pinned_bytes"]:
            assert time.monotonic() < deadline and not tier["entries"], tier  # 2 GiB: a load of tenths of seconds
        stage, staged_bytes = stage_and_read(None, control, KEY, parts, ready["device_uuid"])
        assert staged_bytes == b"".join(f.read_bytes() for f in files), stage
        assert stage["tier"] == "joined" and 0 < stage["ram_bytes"] < 2048 * MIB, stage
        while (tier := request(control, {"op": "status"}, timeout=10.0)["ram_tier"])["entries"] < 1:
            assert time.monotonic() < deadline, tier
            time.sleep(0.02)
        again, _ = stage_and_read(None, control, KEY, parts, ready["device_uuid"])
        tier = request(control, {"op": "status"}, timeout=10.0)["ram_tier"]
        assert again["tier"] == "ram" and (tier["joins"], tier["hits"], tier["loads"]) == (1, 1, 1), (again, tier)
        print(json.dumps({"joined_gpu": {k: stage[k] for k in ("stage_s", "copy_s", "ram_bytes", "copied_bytes")} |
                          {"loader_paused_s": tier["loader_paused_s"], "hit_stage_s": again["stage_s"]}}))
    finally:
        proc.kill()
        proc.wait()

"""Weight hydration: the checks that refuse bad input before anything is released, and (on a GPU) the arena."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coldsnap_probe._profile import identity
from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration._arena import WeightArena
from coldsnap_probe.hydration._digests import DIGEST_CHUNK, chunk_digests, region_digest
from coldsnap_probe.hydration._weights import (
    HydrationManifest,
    WeightRegion,
    check_sources,
    plan_for,
    validate_regions,
)
from tests.helpers import ROOT
from tests.probe.test_coordinator import stand_in_criu
from tests.probe.test_main import has_nvidia_driver

BASE = 0x7F0000000000
MIB = 1 << 20


def source(tmp_path: Path, size: int = 3 * MIB, name: str = "weights.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path


def region(path: Path, *, name: str = "weights", address: int = BASE, size: int = 2 * MIB,
           offset: int = 4096) -> WeightRegion:
    return WeightRegion(name, address, size, str(path), offset, region_digest(path, offset, size))


def manifest_for(regions: list[WeightRegion], size: int = 8 * MIB) -> HydrationManifest:
    layout, plan = plan_for(regions, address=BASE, size=size, granularity=2 * MIB, generation="g1")
    identities = check_sources(regions, content=True)
    return HydrationManifest.create(generation="g1", device=0, reservation_address=BASE, reservation_size=size,
                                    granularity=2 * MIB, regions=tuple(sorted(regions, key=lambda r: r.address)),
                                    sources=tuple(identities[s] for s in sorted(identities)), layout=layout,
                                    plan=plan, control="/nonexistent/control.sock")


def test_region_digest_is_the_digest_of_its_chunk_digests(tmp_path: Path) -> None:
    import hashlib

    path = source(tmp_path, DIGEST_CHUNK + 5 * MIB)
    data = path.read_bytes()[100:100 + DIGEST_CHUNK + MIB]
    chunks = [hashlib.sha256(data[:DIGEST_CHUNK]).digest(), hashlib.sha256(data[DIGEST_CHUNK:]).digest()]
    assert chunk_digests(path, 100, len(data)) == chunks
    assert region_digest(path, 100, len(data)) == "sha256-64m:" + hashlib.sha256(b"".join(chunks)).hexdigest()


def test_validate_regions_overlapping_regions_refused_naming_the_region(tmp_path: Path) -> None:
    path = source(tmp_path)
    a = region(path, name="layer.0", size=MIB)
    b = region(path, name="layer.1", address=BASE + MIB - 4096, size=MIB)
    with pytest.raises(HydrationError, match=r"region layer\.1: overlaps region layer\.0") as caught:
        validate_regions([b, a], BASE, 8 * MIB)
    assert caught.value.region == "layer.1"


def test_validate_regions_region_past_the_reservation_refused(tmp_path: Path) -> None:
    path = source(tmp_path)
    late = region(path, address=BASE + 7 * MIB)
    with pytest.raises(HydrationError, match=r"region weights: .* exceeds the reservation"):
        validate_regions([late], BASE, 8 * MIB)
    early = region(path, address=BASE - 4096)
    with pytest.raises(HydrationError, match="exceeds the reservation"):
        validate_regions([early], BASE, 8 * MIB)


def test_validate_regions_duplicate_names_and_bad_digests_refused(tmp_path: Path) -> None:
    path = source(tmp_path)
    a = region(path, size=MIB)
    with pytest.raises(HydrationError, match="declared more than once"):
        validate_regions([a, region(path, address=BASE + 2 * MIB, size=MIB)], BASE, 8 * MIB)
    with pytest.raises(HydrationError, match="digest must be sha256-64m:"):
        validate_regions([WeightRegion("w", BASE, MIB, str(path), 0, "sha256:abc")], BASE, 8 * MIB)
    with pytest.raises(HydrationError, match="no weight regions"):
        validate_regions([], BASE, 8 * MIB)


def test_check_sources_truncated_source_refused(tmp_path: Path) -> None:
    path = source(tmp_path)
    weights = region(path)
    os.truncate(path, MIB)
    with pytest.raises(HydrationError, match=r"region weights: source .* is truncated: 1048576 bytes"):
        check_sources([weights])


def test_check_sources_missing_source_refused(tmp_path: Path) -> None:
    path = source(tmp_path)
    weights = region(path)
    path.unlink()
    with pytest.raises(HydrationError, match=r"region weights: source .* cannot be read"):
        check_sources([weights])


def test_check_sources_altered_source_refused_once_its_identity_changed(tmp_path: Path) -> None:
    path = source(tmp_path)
    weights = region(path)
    recorded = check_sources([weights], content=True)
    assert check_sources([weights], recorded) == recorded  # unchanged: the identity suffices
    with path.open("r+b") as f:
        f.seek(4096 + MIB)
        f.write(b"\x00" * 16)
    with pytest.raises(HydrationError, match=r"region weights: source .* does not match the digest"):
        check_sources([weights], recorded)  # the identity changed, so the content decides
    with pytest.raises(HydrationError, match="does not match the digest"):
        check_sources([weights], content=True)


def test_manifest_round_trips_and_refuses_tampering(tmp_path: Path) -> None:
    path = source(tmp_path)
    manifest = manifest_for([region(path, name="a", size=MIB), region(path, name="b", address=BASE + 2 * MIB)])
    document = json.loads(json.dumps(manifest.to_json()))
    assert HydrationManifest.from_json(document) == manifest
    assert manifest.layout.layout_kind == "per-layer" and manifest.layout.groups == ("a", "b")
    assert manifest.plan.actions == ("release-backing", "remap-pages")
    moved = json.loads(json.dumps(document))
    moved["regions"][1]["address"] += 4096
    with pytest.raises(HydrationError, match="digest does not recompute"):
        HydrationManifest.from_json(moved)
    forged = json.loads(json.dumps(document))
    forged["layout"]["logical_bytes"] += 1
    with pytest.raises(HydrationError, match="layout digest does not recompute"):
        HydrationManifest.from_json(forged)
    with pytest.raises(HydrationError, match="not a format-1 coldsnap-hydration-manifest"):
        HydrationManifest.from_json({"kind": "other"})


def test_a_discard_region_has_no_source_and_an_arena_keeps_a_weight_region(tmp_path: Path) -> None:
    path = source(tmp_path)
    weights = region(path)
    with pytest.raises(HydrationError, match="region kv: source must be empty for a discard region, got '/"):
        validate_regions([weights, WeightRegion("kv", BASE + 2 * MIB, MIB, str(path), 0, "", "discard")], BASE,
                         8 * MIB)
    with pytest.raises(HydrationError, match="region kv: source must be a string, got NoneType"):
        validate_regions([weights, WeightRegion("kv", BASE + 2 * MIB, MIB, None, 0, "", "discard")],  # type: ignore[arg-type]
                         BASE, 8 * MIB)
    with pytest.raises(HydrationError, match="region kv: size must be an integer, got float"):
        validate_regions([weights, WeightRegion("kv", BASE + 2 * MIB, 1e6, "", 0, "", "discard")],  # type: ignore[arg-type]
                         BASE, 8 * MIB)
    with pytest.raises(HydrationError, match="region kv: policy 'keep' must be one of preserve, discard"):
        validate_regions([weights, WeightRegion("kv", BASE + 2 * MIB, MIB, "", 0, "", "keep")], BASE, 8 * MIB)
    with pytest.raises(HydrationError, match="every region is discarded"):
        validate_regions([WeightRegion("kv", BASE, MIB, "", 0, "", "discard")], BASE, 8 * MIB)
    with pytest.raises(HydrationError, match="region kv: overlaps region weights"):
        validate_regions([weights, WeightRegion("kv", BASE + MIB, MIB, "", 0, "", "discard")], BASE, 8 * MIB)


def test_discarded_regions_have_their_own_kv_cache_layout_in_the_plan(tmp_path: Path) -> None:
    path = source(tmp_path)
    kv = WeightRegion("kv", BASE + 4 * MIB, 2 * MIB, "", 0, "", "discard")
    manifest = manifest_for([region(path), kv])
    assert manifest.plan.policies == (("kv_cache", "discard"), ("weights", "preserve"))
    assert [name for name, _ in manifest.plan.layout_digests] == ["kv_cache", "weights"]
    assert manifest.layout.groups == ("weights",) and [s.path for s in manifest.sources] == [str(path)]
    document = json.loads(json.dumps(manifest.to_json()))
    assert HydrationManifest.from_json(document) == manifest
    assert "policy" not in document["regions"][0] and document["regions"][1]["policy"] == "discard"
    grown = json.loads(json.dumps(document))
    grown["regions"][1]["size"] += 2 * MIB
    with pytest.raises(HydrationError, match="digest does not recompute"):
        HydrationManifest.from_json(grown)


def test_restore_with_a_truncated_weight_source_is_refused_naming_it(tmp_path: Path) -> None:
    """Before CRIU for a tree it restores running (a paused CUDA tree's records are checked while CRIU runs, which
    tests/probe/test_criu_restore.py covers with a real CRIU): this CRIU answers only `--version`, so CRIU never ran."""
    path = source(tmp_path)
    manifest = manifest_for([region(path)])
    images = tmp_path / "images"
    images.mkdir()
    criu = stand_in_criu(tmp_path)
    (images / "capture.json").write_text(json.dumps({"boundary": "n580", "root_pid": 1, "cuda_pids": [],
                                                     "identity": identity(None, criu=str(criu))}))
    (images / "hydration.json").write_text(json.dumps(manifest.to_json()))
    os.truncate(path, MIB)
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", "restore", "--images", str(images),
                           "--criu", str(criu), "--work-dir", str(tmp_path / "work")], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "error: restore phase validate: " in done.stderr and not (tmp_path / "work" / "restore.log").exists()
    assert "weight hydration cannot succeed, not restoring: region weights: source" in done.stderr
    assert "is truncated" in done.stderr


# --------------------------------------------------------------------------------------------- on a GPU host

gpu = pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")


def declared_arena(path: Path, weights: int, *, offset: int = 0, exportable: bool = False,
                   size: int = 0) -> WeightArena:
    """A WeightArena (of `size` bytes, default `weights`) whose one region, "weights", is `weights` bytes of `path`
    from `offset` (on a GPU host)."""
    arena = WeightArena(size or weights, exportable=exportable)
    SERVED.append(arena)
    arena.declare([WeightRegion("weights", arena.address, weights, str(path), offset,
                                region_digest(path, offset, weights))])
    return arena


SERVED: list[WeightArena] = []  # arenas this module made: their control threads are joined after each test


@pytest.fixture(autouse=True)
def _stop_serving() -> Iterator[None]:
    yield
    while SERVED:
        SERVED.pop().stop_serving()


def device_bytes(arena: object, size: int) -> bytes:
    from coldsnap_probe.hydration._vmm import cucall

    buffer = ctypes.create_string_buffer(size)
    cucall(arena.driver, "cuMemcpyDtoH", ctypes.addressof(buffer), arena.address, size)  # type: ignore[attr-defined]
    return buffer.raw


@gpu
@pytest.mark.parametrize("strategy", ["register", "ring"])
def test_arena_release_and_restore_same_address_same_bytes(tmp_path: Path, strategy: str) -> None:

    path = source(tmp_path, 8 * MIB)
    arena = declared_arena(path, 4 * MIB)
    arena.load(strategy=strategy)
    address, before = arena.address, device_bytes(arena, 4 * MIB)
    assert before == path.read_bytes()[:4 * MIB]
    manifest = arena.release("g1")
    assert not arena.mapped and not arena.ready.is_set() and manifest.regions[0].address == address
    report = arena.restore(strategy=strategy)
    assert arena.address == address and arena.ready.is_set() and report["verified_regions"] == 1
    assert device_bytes(arena, 4 * MIB) == before


def with_kv(arena: WeightArena, weights: int) -> WeightArena:
    """Redeclare `arena` with a discarded region after its `weights` bytes, filled with a pattern."""
    from coldsnap_probe.hydration._vmm import cucall

    kv = WeightRegion("kv", arena.address + weights, arena.size - weights, "", 0, "", "discard")
    arena.declare([arena.regions[0], kv])
    pattern = b"\xa5" * kv.size
    cucall(arena.driver, "cuMemcpyHtoD", kv.address, pattern, kv.size)
    return arena


@gpu
def test_a_discarded_region_comes_back_zeroed_and_the_weights_intact(tmp_path: Path) -> None:
    path = source(tmp_path, 8 * MIB)
    arena = declared_arena(path, 4 * MIB, size=6 * MIB)
    arena.load()
    with_kv(arena, 4 * MIB)
    manifest = arena.release("g1")
    assert manifest.plan.policies == (("kv_cache", "discard"), ("weights", "preserve"))
    report = arena.restore()
    assert report["zeroed_bytes"] == 2 * MIB and report["bytes"] == 4 * MIB and report["verified_regions"] == 1
    assert device_bytes(arena, 6 * MIB) == path.read_bytes()[:4 * MIB] + bytes(2 * MIB)


@gpu
def test_arena_release_with_an_altered_source_refuses_and_keeps_serving(tmp_path: Path) -> None:

    path = source(tmp_path, 4 * MIB)
    arena = declared_arena(path, 4 * MIB)
    arena.load()
    before = device_bytes(arena, 4 * MIB)
    with path.open("r+b") as f:
        f.write(b"\xff" * 8)
    with pytest.raises(HydrationError, match=r"region weights: source .* does not match the digest"):
        arena.release("g1")
    assert arena.mapped and arena.ready.is_set()  # nothing was released
    assert device_bytes(arena, 4 * MIB) == before


@gpu
def test_arena_restore_with_too_little_free_memory_refuses_then_succeeds(tmp_path: Path) -> None:
    from coldsnap_probe.hydration._vmm import cucall

    path = source(tmp_path, 64 * MIB)
    arena = declared_arena(path, 64 * MIB)
    arena.load()
    arena.release("g1")
    free, _total = cucall(arena.driver, "cuMemGetInfo")
    hog = cucall(arena.driver, "cuMemAlloc", int(free) - 32 * MIB)
    try:
        with pytest.raises(HydrationError, match="hydration needs 67108864"):
            arena.restore()
        assert not arena.mapped and not arena.ready.is_set()  # not released to serve
    finally:
        cucall(arena.driver, "cuMemFree", hog)
    assert arena.restore()["verified_regions"] == 1 and arena.ready.is_set()


@gpu
def test_arena_restore_with_a_truncated_source_stays_unready(tmp_path: Path) -> None:

    path = source(tmp_path, 4 * MIB)
    arena = declared_arena(path, 4 * MIB)
    arena.load()
    arena.release("g1")
    os.truncate(path, MIB)
    with pytest.raises(HydrationError, match=r"region weights: source .* is truncated"):
        arena.restore()
    assert not arena.mapped and not arena.ready.is_set()


def test_manifest_names_its_hydrator_only_when_it_has_one(tmp_path: Path) -> None:
    import dataclasses

    plain = manifest_for([region(source(tmp_path))])
    assert "hydrator" not in plain.to_json()  # manifests written before staging keep their digest
    staged = HydrationManifest.create(**{f.name: getattr(plain, f.name) for f in dataclasses.fields(plain)
                                         if f.name != "manifest_digest"} | {"hydrator": "/run/hydrator.sock"})
    again = HydrationManifest.from_json(staged.to_json())
    assert again.hydrator == "/run/hydrator.sock" and again.manifest_digest != plain.manifest_digest
    request = again.stage_request("adopt")
    assert (request["op"], request["key"], request["base"], request["size"]) == (
        "adopt", again.manifest_digest, BASE, 8 * MIB)
    tampered = {**staged.to_json(), "hydrator": "/elsewhere.sock"}
    with pytest.raises(HydrationError, match="digest does not recompute"):
        HydrationManifest.from_json(tampered)


@pytest.fixture
def hydrator(tmp_path: Path, request: pytest.FixtureRequest) -> object:
    """A long-lived hydrator process holding one 16 MiB source page-locked (its GPU is GPU 0, as the arena's);
    `serve` options of its own through indirect parametrization."""
    path = source(tmp_path, 16 * MIB, "shard.bin")
    control = tmp_path / "hydrator.sock"
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                             "--staging", "--stage-ttl", "2", *getattr(request, "param", ()), str(path)],
                            stdout=subprocess.PIPE, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        assert ready["ready"] and ready["device_uuid"].startswith("GPU-")
        yield path, str(control)
    finally:
        proc.kill()
        proc.wait()


def staged_arena(tmp_path: Path, shard: Path, control: str) -> tuple[object, HydrationManifest]:

    arena = declared_arena(shard, 8 * MIB, offset=4 * MIB, exportable=True)
    arena.load(strategy="ring")
    arena.serve(str(tmp_path / "engine.sock"), strategy=f"hydrator:{control}")
    return arena, arena.release("g1")


@gpu
def test_staged_weights_are_adopted_in_place_with_the_same_bytes(tmp_path: Path, hydrator: tuple[Path, str]) -> None:
    from coldsnap_probe.hydration._staging import Stager

    shard, control = hydrator
    arena, manifest = staged_arena(tmp_path, shard, control)
    assert manifest.hydrator == control
    stager = Stager(manifest)
    staged = stager.result()
    assert staged["staged"] and staged["bytes"] == 8 * MIB, staged
    assert "ticket" not in staged and stager.ticket  # the ticket goes to the engine, never into a report
    report = arena.restore(strategy=f"hydrator:{control}", ticket=stager.ticket)  # type: ignore[attr-defined]
    assert report["staged"] and report["strategy"].startswith("hydrator-staged:") and report["verified_regions"] == 1
    assert device_bytes(arena, 8 * MIB) == shard.read_bytes()[4 * MIB:12 * MIB]
    # Adopted once: a second release and restore finds nothing staged and hydrates the regular way.
    arena.release("g2")  # type: ignore[attr-defined]
    again = arena.restore(strategy=f"hydrator:{control}")  # type: ignore[attr-defined]
    assert again["staged"] is False and "nothing is staged" in again["adopt_refusal"]
    assert device_bytes(arena, 8 * MIB) == shard.read_bytes()[4 * MIB:12 * MIB]


@gpu
@pytest.mark.parametrize("hydrator", [["--device-tier-bytes", "64M"]], indirect=True)
def test_the_next_stage_of_the_same_weights_comes_from_the_device_tier_with_the_same_bytes(
        tmp_path: Path, hydrator: tuple[Path, str]) -> None:
    """With a device tier the first stage of the weights is kept on the hydrator's GPU (`tier: ram`: from its
    page-locked source) and the second, after the engine used and released them again, is a copy within the GPU
    (`tier: device`); both adopted with the shard's bytes."""
    from coldsnap_probe.hydration._staging import Stager
    from coldsnap_probe.jsonline import request

    shard, control = hydrator
    arena, manifest = staged_arena(tmp_path, shard, control)
    for generation, tier in (("g2", "ram"), ("g3", "device")):
        stager = Stager(manifest)
        staged = stager.result()
        assert staged["staged"] and staged["tier"] == tier and staged["bytes"] == 8 * MIB, staged
        report = arena.restore(strategy=f"hydrator:{control}", ticket=stager.ticket)  # type: ignore[attr-defined]
        assert report["staged"] and report["verified_regions"] == 1, report
        assert device_bytes(arena, 8 * MIB) == shard.read_bytes()[4 * MIB:12 * MIB]
        manifest = arena.release(generation)  # type: ignore[attr-defined]
    kept = request(control, {"op": "status"})["device_tier"]
    assert (kept["entries"], kept["hits"], kept["misses"], kept["in_use"]) == (1, 1, 1, 0), kept


@gpu
def test_staged_weights_with_a_discarded_region_come_back_with_it_zeroed(tmp_path: Path,
                                                                         hydrator: tuple[Path, str]) -> None:
    from coldsnap_probe.hydration._staging import Stager

    shard, control = hydrator
    arena = declared_arena(shard, 8 * MIB, offset=4 * MIB, exportable=True, size=12 * MIB)
    arena.load(strategy="ring")
    with_kv(arena, 8 * MIB)
    arena.serve(str(tmp_path / "engine.sock"), strategy=f"hydrator:{control}")
    stager = Stager(arena.release("g1"))
    staged = stager.result()
    assert staged["staged"] and staged["bytes"] == 8 * MIB, staged
    report = arena.restore(strategy=f"hydrator:{control}", ticket=stager.ticket)
    assert report["staged"] and report["zeroed_bytes"] == 4 * MIB
    assert device_bytes(arena, 12 * MIB) == shard.read_bytes()[4 * MIB:12 * MIB] + bytes(4 * MIB)


@gpu
def test_staging_for_another_gpu_is_refused_and_the_restore_still_hydrates(tmp_path: Path,
                                                                          hydrator: tuple[Path, str]) -> None:
    from coldsnap_probe.jsonline import request

    shard, control = hydrator
    arena, manifest = staged_arena(tmp_path, shard, control)
    answer = request(control, manifest.stage_request("stage", device_uuid="GPU-00000000-0000-0000-0000-000000000000"))
    assert not answer["ok"] and "is not this hydrator's GPU-" in answer["error"]
    report = arena.restore(strategy=f"hydrator:{control}")  # type: ignore[attr-defined]
    assert report["staged"] is False and report["verified_regions"] == 1
    assert device_bytes(arena, 8 * MIB) == shard.read_bytes()[4 * MIB:12 * MIB]


@gpu
def test_an_unadopted_stage_is_freed_after_its_ttl(tmp_path: Path, hydrator: tuple[Path, str]) -> None:
    import time

    from coldsnap_probe.hydration._staging import Stager
    from coldsnap_probe.hydration._vmm import cucall

    shard, control = hydrator
    arena, manifest = staged_arena(tmp_path, shard, control)
    driver = arena.driver  # type: ignore[attr-defined]
    before, _ = cucall(driver, "cuMemGetInfo")
    assert Stager(manifest).result()["staged"]
    during, _ = cucall(driver, "cuMemGetInfo")
    assert int(before) - int(during) >= 8 * MIB  # the hydrator holds the staged allocation
    time.sleep(4)  # TTL 2 s, checked every second
    after, _ = cucall(driver, "cuMemGetInfo")
    assert int(after) >= int(during) + 8 * MIB
    report = arena.restore(strategy=f"hydrator:{control}")  # type: ignore[attr-defined]
    assert report["staged"] is False and report["verified_regions"] == 1


@gpu
def test_weights_hydrated_through_the_hydrator_are_freed_at_release(tmp_path: Path,
                                                                    hydrator: tuple[Path, str]) -> None:
    """The hydrator closes the descriptor of every allocation it filled: an engine's release frees the memory."""
    from coldsnap_probe.hydration._vmm import cucall

    shard, control = hydrator
    arena = declared_arena(shard, 8 * MIB, exportable=True)
    assert arena.load(strategy=f"hydrator:{control}")["verified_regions"] == 1
    held, _ = cucall(arena.driver, "cuMemGetInfo")
    arena.serve(str(tmp_path / "engine.sock"), strategy=f"hydrator:{control}")
    arena.release("g1")
    freed, _ = cucall(arena.driver, "cuMemGetInfo")
    assert int(freed) - int(held) >= 8 * MIB


@pytest.mark.parametrize("key", [None, "", "k", "sha256:" + "0" * 63, "sha256:" + "G" * 64, 7])
def test_a_stage_key_must_be_a_manifest_digest(key: object) -> None:
    from coldsnap_probe.hydration._request_fields import stage_key

    with pytest.raises(HydrationError, match="key must be a manifest digest"):
        stage_key({"key": key})


def test_stage_requests_are_keyed_by_the_manifest_digest(tmp_path: Path) -> None:
    from coldsnap_probe.hydration._request_fields import stage_key

    manifest = manifest_for([region(source(tmp_path))])
    assert stage_key(manifest.stage_request("stage")) == manifest.manifest_digest


# --- who may ask (#24, finding 5) ---------------------------------------------------------------------------


# The read rule itself (a peer is served only what it could open in its own view): tests/probe/test_peer_view.py.


def test_a_stage_is_held_only_with_its_ticket() -> None:
    from coldsnap_probe.hydration._hydrator import _Staged

    staged = _Staged((), 0, 1, (), 0.0, 0.0, 0.0, owner=1000, ticket="t" * 43)
    assert staged.held_by("t" * 43)
    assert not staged.held_by("u" * 43) and not staged.held_by("") and not staged.held_by(None)
    assert not staged.held_by("\udcff")  # whatever JSON can carry: refused, never an error


@pytest.fixture
def shared_hydrator(tmp_path: Path) -> Iterator[tuple[Path, Path, str]]:
    """A hydrator whose socket nobody can reach (group nogroup, 0660) and which admits nobody's uid; it holds a
    root-only source and one anyone may read."""
    import pwd
    import shutil
    import tempfile

    nobody = pwd.getpwnam("nobody")
    shared = Path(tempfile.mkdtemp(prefix="cs-hydrator-", dir="/tmp"))
    shared.chmod(0o755)
    private, public = source(shared, 16 * MIB, "private.bin"), source(shared, 16 * MIB, "public.bin")
    private.chmod(0o600)
    public.chmod(0o644)
    control = shared / "hydrator.sock"
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                             "--staging", "--allow-uid", str(nobody.pw_uid), "--socket-group", str(nobody.pw_gid),
                             str(private), str(public)], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert json.loads(proc.stdout.readline())["ready"]  # type: ignore[union-attr]
        yield private, public, str(control)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(shared)


@gpu
def test_a_hydrator_tenant_cannot_list_adopt_or_discard_another_tenants_stage(
        tmp_path: Path, shared_hydrator: tuple[Path, Path, str]) -> None:
    """Regression: #24 (finding 5): any process reaching the hydrator listed, adopted and discarded stages."""
    from coldsnap_probe.hydration._staging import Stager
    from coldsnap_probe.jsonline import request
    from tests.probe.test_jsonline import ask_as_nobody

    _private, public, control = shared_hydrator
    arena, manifest = staged_arena(tmp_path, public, control)
    stager = Stager(manifest)
    assert stager.result()["staged"]
    assert [s["key"] for s in request(control, {"op": "status"})["staged"]] == [manifest.manifest_digest]
    assert ask_as_nobody(control, "status")["staged"] == []  # another tenant does not even see it
    for ticket in ("", "forged"):  # the digest alone (it is in the manifest) is not enough
        assert ask_as_nobody(control, manifest.stage_request("adopt", ticket=ticket)) == {
            "ok": False, "staged": False, "error": f"nothing is staged for {manifest.manifest_digest}"}
        assert ask_as_nobody(control, manifest.stage_request("discard", ticket=ticket)) == {
            "ok": True, "discarded": False}
    assert request(control, manifest.stage_request("discard", ticket="forged"))["discarded"] is False
    report = arena.restore(strategy=f"hydrator:{control}", ticket=stager.ticket)  # type: ignore[attr-defined]
    assert report["staged"] and report["verified_regions"] == 1


@gpu
def test_a_hydrator_gives_a_peer_no_byte_of_a_source_it_could_not_read(
        tmp_path: Path, shared_hydrator: tuple[Path, Path, str]) -> None:
    """Regression: #24 (finding 5): any byte range of any source the hydrator held went to any peer."""
    from tests.probe.test_jsonline import ask_as_nobody

    private, _public, control = shared_hydrator
    arena = declared_arena(private, 8 * MIB, exportable=True)
    manifest = arena.release("g1")
    answer = ask_as_nobody(control, manifest.stage_request("stage", device_uuid=""))
    assert not answer["ok"] and "is not this hydrator's" in answer["error"]  # the GPU is checked first
    from coldsnap_probe.hydration._vmm import device_uuid

    uuid = device_uuid(arena.driver, 0)
    answer = ask_as_nobody(control, manifest.stage_request("stage", device_uuid=uuid))
    assert answer == {"ok": False, "error": f"HydrationError: peer uid 65534 may not read source {private}: "
                                            "Permission denied (in its own view)"}


@gpu
def test_a_hydrator_serves_a_root_peer_only_what_it_can_see_and_read_itself(tmp_path: Path) -> None:
    """Regression: #37 finding 6: root in another container (another mount namespace, where the tenant's
    directory is not), or root without CAP_DAC_OVERRIDE, was served a tenant's 0600 source for being uid 0."""
    import shutil
    import tempfile

    from coldsnap_probe.hydration._vmm import device_uuid
    from coldsnap_probe.jsonline import request
    from tests.probe._peers import NO_CAPABILITIES, ask_as, hiding

    shared = Path(tempfile.mkdtemp(prefix="cs-hydrator-view-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        (shared / "tenant").mkdir(mode=0o755)
        weights = source(shared / "tenant", 16 * MIB)
        weights.chmod(0o600)
        for path in (shared / "tenant", weights):
            os.chown(path, 4242, 4242)
        control = shared / "hydrator.sock"
        proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                                 "--staging", str(weights)], stdout=subprocess.PIPE, cwd=ROOT)
        try:
            assert json.loads(proc.stdout.readline())["ready"]  # type: ignore[union-attr]
            arena = declared_arena(weights, 8 * MIB, exportable=True)
            manifest = arena.release("g1")
            ask = manifest.stage_request("stage", device_uuid=device_uuid(arena.driver, 0))
            hidden = ask_as(hiding(shared / "tenant"), control, ask)
            assert not hidden["ok"] and f"source {weights}: No such file or directory (in the view of peer pid " \
                in hidden["error"], hidden
            assert ask_as(NO_CAPABILITIES, control, ask) == {
                "ok": False, "error": f"HydrationError: peer uid 0 may not read source {weights}: Permission denied "
                                      "(in its own view)"}
            served = ask_as((), control, ask)  # root that sees the file and holds its capabilities
            assert served["ok"] and served["staged"], served
            assert request(str(control), manifest.stage_request("discard", ticket=served["ticket"]))["discarded"]
        finally:
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(shared)


@gpu
def test_the_engine_control_socket_answers_no_other_uid(tmp_path: Path) -> None:
    """Regression: #24 (finding 5): the engine's control socket (umask mode) released for any peer."""
    import pwd
    import shutil
    import stat
    import tempfile

    from tests.probe.test_jsonline import ask_as_nobody

    nobody = pwd.getpwnam("nobody")
    shared = Path(tempfile.mkdtemp(prefix="cs-engine-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        arena = declared_arena(source(tmp_path, 8 * MIB), 4 * MIB)
        arena.load(strategy="ring")
        arena.serve(shared / "control.sock")
        assert stat.S_IMODE(os.lstat(shared / "control.sock").st_mode) == 0o600
        assert ask_as_nobody(shared / "control.sock", "release") == {"os_error": 13}
        arena.stop_serving()  # served again below, reachable by nobody's group but not admitted
        arena.serve(shared / "control.sock", group=nobody.pw_gid)
        answer = ask_as_nobody(shared / "control.sock", {"op": "release", "generation": "g1"})
        assert not answer["ok"] and "peer uid 65534" in answer["error"]
        assert arena.mapped and arena.ready.is_set()  # nothing was released
    finally:
        shutil.rmtree(shared)


def test_a_stager_is_hung_up_only_once_it_closed_its_end_not_when_it_only_ended_its_request() -> None:
    """The hydrator frees a filled stage whose stager left (a refused or dead restore worker); one that only
    ended its writing after the request still waits for the answer, and must get it."""
    from coldsnap_probe.hydration._hydrator import _hung_up

    server, stager = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with server, stager:
        assert not _hung_up(server)
        stager.sendall(b'{"op": "status"}\n')
        stager.shutdown(socket.SHUT_WR)
        assert not _hung_up(server)
        stager.close()
        assert _hung_up(server)

"""Several ranks: the coordinator's barriers and aborts, and the restore path's checks that stop every rank.

The rank workers here are real processes meeting through a real directory, up to eight of them. The GPU half
(capture and restore of a TP engine) runs on the 2/4/8-GPU machines: `scripts/device tp-bare`, `scripts/device tp`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe import default_graph_policy, graph_record
from coldsnap_probe._coordinator import Coordinator
from coldsnap_probe._profile import identity
from coldsnap_probe._worker import tp_execution
from coldsnap_probe.errors import ContractError, RankAborted, WorkerError
from coldsnap_probe.hydration import HydrationManifest, WeightRegion, check_sources, region_digest
from coldsnap_probe.hydration._weights import plan_for
from tests.helpers import ROOT

RANK_SCRIPT = """
import json, sys
from pathlib import Path
from coldsnap_probe._coordinator import Coordinator
from coldsnap_probe.errors import RankAborted
root, rank, world, timeout = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
c = Coordinator(root, "activation", rank, world, timeout=timeout)
try:
    print(json.dumps(c.barrier("ready", {"rank": rank, "pid": __import__("os").getpid()})))
except RankAborted as exc:
    print(json.dumps({"aborted": str(exc)}))
"""


def ranks(root: Path, world: int, *, only: list[int] | None = None, timeout: float = 20) -> list[Any]:
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(root), str(r), str(world), str(timeout)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for r in (only if only is not None else range(world))]
    return [json.loads(p.communicate(timeout=60)[0]) for p in procs]


@pytest.mark.parametrize("world", [4, 8])
def test_barrier_of_rank_processes_returns_every_ranks_value_in_rank_order(tmp_path: Path, world: int) -> None:
    answers = ranks(tmp_path, world)
    assert all([v["rank"] for v in answer] == list(range(world)) for answer in answers)
    assert len({tuple(v["pid"] for v in answer) for answer in answers}) == 1  # every rank saw the same arrivals


def test_barrier_of_eight_ranks_one_never_arriving_aborts_all_seven(tmp_path: Path) -> None:
    answers = ranks(tmp_path, 8, only=list(range(7)), timeout=1)
    assert all("rank(s) 7 never reached ready" in a["aborted"] for a in answers)  # whichever rank gave up first
    [late] = ranks(tmp_path, 8, only=[7])
    assert "activation aborted at ready" in late["aborted"]


def test_barrier_peer_that_never_arrives_aborts_naming_it_and_a_late_peer_sees_the_abort(tmp_path: Path) -> None:
    [alone] = ranks(tmp_path, 3, only=[0], timeout=0.5)
    assert "rank(s) 1, 2 never reached ready" in alone["aborted"]
    [late] = ranks(tmp_path, 3, only=[2])
    assert "activation aborted at ready" in late["aborted"] and "never reached ready" in late["aborted"]


def test_abort_by_one_rank_wakes_a_rank_waiting_at_a_barrier(tmp_path: Path) -> None:
    waiting = Coordinator(tmp_path, "a", 0, 2, timeout=30)
    failing = Coordinator(tmp_path, "a", 1, 2)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            waiting.barrier("cuda-restored")
        except RankAborted as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    failing.abort("rank 1 restore: CUDA restore failed")
    failing.abort("a second reason is not kept")
    thread.join(10)
    assert not thread.is_alive()
    assert [str(e) for e in errors] == ["activation aborted at cuda-restored: rank 1 restore: CUDA restore failed"]


def test_namespace_serves_one_activation(tmp_path: Path) -> None:
    Coordinator(tmp_path, "restore-1", 0, 1).barrier("validated")
    with pytest.raises(WorkerError, match="already arrived at validated in restore-1"):
        Coordinator(tmp_path, "restore-1", 0, 1).barrier("validated")


@pytest.mark.parametrize(("namespace", "rank", "world", "message"), [
    ("../escape", 0, 2, "namespace must match"), ("ok", 2, 2, "rank must be within"),
    ("ok", 0, 0, "rank must be within"), ("a\n", 0, 1, "namespace must match")])
def test_coordinator_refuses_bad_names_and_ranks(tmp_path: Path, namespace: str, rank: int, world: int,
                                                 message: str) -> None:
    with pytest.raises(WorkerError, match=message):
        Coordinator(tmp_path, namespace, rank, world)


def test_several_ranks_need_a_directory() -> None:
    with pytest.raises(WorkerError, match="coordinator directory"):
        Coordinator(None, "x", 0, 2)


# --- who may write in a namespace (#24, finding 7) -------------------------------------------------------------

NOBODY = pwd.getpwnam("nobody")
AS_NOBODY = ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups"]
PLANT = """
import json, os, sys
root, link = sys.argv[1], sys.argv[2] == "link"
if link:
    os.makedirs(root + "/elsewhere/validated")
    os.symlink(root + "/elsewhere", root + "/restore-1")
else:
    os.makedirs(root + "/restore-1/validated", mode=0o777)
base = root + ("/elsewhere" if link else "/restore-1")
with open(base + "/validated/1.json", "w") as f:
    json.dump({"rank": 1, "value": {"plan_sha256": None}, "unix_ns": 1}, f)
with open(base + "/abort.json", "w") as f:
    json.dump({"rank": 1, "reason": "planted"}, f)
"""


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A coordinator root any user may write in (as a shared /tmp-like directory is)."""
    path = Path(tempfile.mkdtemp(prefix="cs-coord-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to plant files as nobody")
@pytest.mark.parametrize("link", [False, True], ids=["directory", "symlink"])
def test_a_namespace_another_user_planted_is_refused(shared_root: Path, link: bool) -> None:
    """Regression: #24 (finding 7): rank 0 passed `validated` alone on a rank 1 arrival another user forged."""
    subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-c", PLANT, str(shared_root), "link" if link else "dir"],
                   check=True, timeout=30)
    expected = "cannot be opened as a directory" if link else f"is owned by uid {NOBODY.pw_uid}"
    with pytest.raises(WorkerError, match=f"coordinator namespace {shared_root}/restore-1 {expected}"):
        Coordinator(shared_root, "restore-1", 0, 2, timeout=0.5).barrier("validated")


def test_a_namespace_others_may_write_in_is_refused(tmp_path: Path) -> None:
    (tmp_path / "restore-1").mkdir(mode=0o700)
    (tmp_path / "restore-1").chmod(0o777)
    with pytest.raises(WorkerError, match="restore-1 is writable by others"):
        Coordinator(tmp_path, "restore-1", 0, 2)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_an_arrival_or_abort_not_written_by_a_rank_is_refused(tmp_path: Path) -> None:
    """Regression: #24 (finding 7): arrivals and abort.json were read without an owner check."""
    with Coordinator(tmp_path, "a", 0, 2, timeout=0.5) as rank0:
        forged = tmp_path / "a" / "ready"
        forged.mkdir(mode=0o700)
        (forged / "1.json").write_text(json.dumps({"rank": 1, "value": {}}))
        os.chown(forged / "1.json", NOBODY.pw_uid, NOBODY.pw_gid)
        with pytest.raises(WorkerError, match=f"rank 1's arrival at ready is owned by uid {NOBODY.pw_uid}"):
            rank0.barrier("ready")
        (tmp_path / "a" / "abort.json").write_text(json.dumps({"rank": 1, "reason": "planted"}))
        os.chown(tmp_path / "a" / "abort.json", NOBODY.pw_uid, NOBODY.pw_gid)
        assert "the abort record is owned by uid" in str(rank0.aborted())  # never the planted reason
        (tmp_path / "a" / "abort.json").unlink()
        (tmp_path / "a" / "abort.json").symlink_to(tmp_path / "elsewhere.json")
        assert rank0.aborted() == "the abort record is unreadable"  # a link is not followed


@pytest.mark.parametrize(("driver", "policy"), [("580.159.04", "recreate-from-plan"),
                                                ("610.43.02", "preserve-nccl-exec")])
def test_default_graph_policy_per_driver(driver: str, policy: str) -> None:
    assert default_graph_policy(driver) == policy


def test_default_graph_policy_without_a_driver_version_is_refused() -> None:
    with pytest.raises(ContractError, match="no major number"):
        default_graph_policy("")


# --- the restore path of several ranks, up to the point where CRIU would run ---------------------------------

def stand_in_criu(directory: Path) -> Path:
    """A CRIU that answers `--version` (the restore checks that the capsule's CRIU runs before anything else) and
    fails anything else: these restores must stop before CRIU is reached."""
    path = directory / "criu"
    if not path.exists():
        path.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "Version: 4.2"; exit 0; }\nexit 1\n')
        path.chmod(0o755)
    return path


def rank_images(directory: Path, rank: int, world: int, *, tamper: bool = False) -> Path:
    """Images of a pre-CUDA rank as capture writes their records (no CRIU images: CRIU must never be reached)."""
    directory.mkdir(parents=True)
    (directory / "capture.json").write_text(json.dumps({
        "format": 1, "boundary": "n580", "root_pid": 4242, "rank": rank, "world_size": world, "cuda_pids": [],
        "identity": identity(None, criu=str(stand_in_criu(directory.parent)))}))
    execution = tp_execution(world, "coldsnap-engine")
    record = graph_record(async_graphs=True, graph_policy="recreate-from-plan", engine="coldsnap-engine",
                          execution=execution)
    if tamper:
        record["policy_effective"] = "preserve-nccl-exec"
    (directory / "graph.json").write_text(json.dumps({"record": record, "execution": execution}))
    return directory


def restore_workers(tmp_path: Path, images: list[Path], only: list[int], timeout: float = 20) -> list[Any]:
    criu = str(stand_in_criu(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-m", "coldsnap_probe", "restore", "--images", str(images[r]),
                               "--criu", criu, "--rank", str(r), "--world-size", str(len(images)),
                               "--coordinator", str(tmp_path / "coord"), "--namespace", "restore-1",
                               "--barrier-timeout", str(timeout), "--work-dir", str(tmp_path / f"work-{r}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for r in only]
    return [(p.wait(timeout=60), p.stderr.read() if p.stderr else "") for p in procs]


def test_restore_tampered_graph_record_on_one_rank_stops_every_rank_before_criu(tmp_path: Path) -> None:
    images = [rank_images(tmp_path / "r0", 0, 2), rank_images(tmp_path / "r1", 1, 2, tamper=True)]
    (rc0, err0), (rc1, err1) = restore_workers(tmp_path, images, [0, 1])
    assert rc1 == 1 and "graph.json: graph policy record" in err1
    assert rc0 == 1 and "RankAborted: activation aborted at validated: rank 1 restore" in err0
    assert "criu" not in err0 + err1  # nothing was restored on any rank
    assert not list((tmp_path / "coord" / "restore-1").glob("criu-restored/*"))


def test_restore_peer_that_never_arrives_stops_the_rank_before_criu(tmp_path: Path) -> None:
    images = [rank_images(tmp_path / "r0", 0, 2), rank_images(tmp_path / "r1", 1, 2)]
    [(rc, err)] = restore_workers(tmp_path, images, [0], timeout=0.5)
    assert rc == 1 and "rank(s) 1 never reached validated" in err and "criu" not in err


def test_restore_images_of_another_rank_are_refused(tmp_path: Path) -> None:
    images = [rank_images(tmp_path / "r1", 1, 2), rank_images(tmp_path / "r0", 0, 2)]  # swapped
    results = restore_workers(tmp_path, images, [0, 1])
    assert all(rc == 1 for rc, _ in results)
    assert any("these images are rank 1 of 2, not rank 0 of 2" in err for _, err in results)


def test_restore_ranks_whose_records_differ_are_stopped(tmp_path: Path) -> None:
    images = [rank_images(tmp_path / "r0", 0, 2), rank_images(tmp_path / "r1", 1, 2)]
    stored = json.loads((images[1] / "graph.json").read_text())
    stored["execution"]["adapter"]["payload"]["tensor"] = 3  # a valid record of another plan
    stored["record"] = graph_record(async_graphs=True, graph_policy="recreate-from-plan",
                                    engine="coldsnap-engine", execution=stored["execution"])
    (images[1] / "graph.json").write_text(json.dumps(stored))
    results = restore_workers(tmp_path, images, [0, 1])
    assert all(rc == 1 and "graph records disagree" in err for rc, err in results)


# --- four and eight ranks: whatever stops one rank's restore stops every rank, before CRIU (issues 27, 28) ----

GRANULE = 2 << 20
BASE = 0x7F0000000000


def with_weights(images: Path, rank: int, sources: Path, *, seen_at: str = "") -> Path:
    """The rank's images with the hydration manifest a release writes: its weights are rank-R's file, named
    as the worker sees it (`seen_at`: the directory `sources` is mounted at in a unit)."""
    source = sources / f"weights-rank-{rank}.bin"
    source.write_bytes(os.urandom(GRANULE + 4096 * (rank + 1)))
    size = source.stat().st_size
    named = f"{seen_at}/{source.name}" if seen_at else str(source)
    region = WeightRegion(f"rank-{rank}", BASE, size, named, 0, region_digest(source, 0, size))
    reservation = -(-size // GRANULE) * GRANULE
    layout, plan = plan_for([region], address=BASE, size=reservation, granularity=GRANULE, generation="g1")
    identities = check_sources([dataclasses.replace(region, source=str(source))], content=True)
    manifest = HydrationManifest.create(
        generation="g1", device=0, reservation_address=BASE, reservation_size=reservation, granularity=GRANULE,
        regions=(region,), sources=tuple(dataclasses.replace(i, path=named) for i in identities.values()),
        layout=layout, plan=plan, control=str(sources / f"rank-{rank}.weights.sock"))
    (images / "hydration.json").write_text(json.dumps(manifest.to_json()))
    return images


def world_images(tmp_path: Path, world: int, **tamper: int) -> list[Path]:
    """Every rank's images with its weights' manifest; `tamper={"graph": r}` tampers rank r's graph record,
    `{"host": r}` says rank r was captured on another architecture."""
    sources = tmp_path / "weights"
    sources.mkdir()
    images = [with_weights(rank_images(tmp_path / f"r{r}", r, world, tamper=tamper.get("graph") == r), r, sources)
              for r in range(world)]
    if (moved := tamper.get("host")) is not None:
        captured = json.loads((images[moved] / "capture.json").read_text())
        captured["identity"]["architecture"] = "riscv64"
        (images[moved] / "capture.json").write_text(json.dumps(captured))
    return images


def assert_every_rank_stopped_by(results: list[Any], culprit: int, own: str, tmp_path: Path,
                                 culprit_exit: int = 1) -> None:
    """`culprit` failed with `own` in its error (exiting `culprit_exit`: 3 for a host refused before any work);
    every other rank was aborted naming it; nothing reached CRIU."""
    for rank, (rc, err) in enumerate(results):
        assert rc == (culprit_exit if rank == culprit else 1), (rank, err)
        if rank == culprit:
            assert own in err, err
        else:
            assert f"RankAborted: activation aborted at validated: rank {culprit} restore" in err, (rank, err)
            assert own in err, (rank, err)  # the peers' errors name the culprit's cause too
        assert "criu" not in err.lower()
    assert not list((tmp_path / "coord" / "restore-1").glob("criu-restored/*"))


@pytest.mark.parametrize("world", [4, 8])
def test_restore_hydration_source_missing_on_one_rank_stops_every_rank_naming_it(tmp_path: Path,
                                                                                  world: int) -> None:
    images = world_images(tmp_path, world)
    culprit = world // 2
    (tmp_path / "weights" / f"weights-rank-{culprit}.bin").unlink()
    results = restore_workers(tmp_path, images, list(range(world)))
    assert_every_rank_stopped_by(results, culprit, f"region rank-{culprit}: source "
                                 f"{tmp_path}/weights/weights-rank-{culprit}.bin cannot be read", tmp_path)


@pytest.mark.parametrize("world", [4, 8])
def test_restore_hydration_source_corrupt_on_one_rank_stops_every_rank_naming_it(tmp_path: Path,
                                                                                 world: int) -> None:
    images = world_images(tmp_path, world)
    culprit = world - 1
    with open(tmp_path / "weights" / f"weights-rank-{culprit}.bin", "r+b") as f:  # one byte, in place
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    results = restore_workers(tmp_path, images, list(range(world)))
    assert_every_rank_stopped_by(results, culprit, f"region rank-{culprit}: source "
                                 f"{tmp_path}/weights/weights-rank-{culprit}.bin does not match the digest",
                                 tmp_path)


def test_restore_of_eight_ranks_with_intact_sources_passes_validation_together(tmp_path: Path) -> None:
    """The control case: the same images with nothing removed get every rank past `validated` (and then to
    CRIU, which is a stand-in that only answers --version here)."""
    images = world_images(tmp_path, 8)
    results = restore_workers(tmp_path, images, list(range(8)))
    assert all(rc == 1 for rc, _ in results)
    assert len(list((tmp_path / "coord" / "restore-1" / "validated").glob("*.json"))) == 8
    assert not any("hydration cannot succeed" in err for _, err in results)


@pytest.mark.parametrize(("world", "case", "own"), [
    (8, "graph", "graph.json: graph policy record"),
    (4, "host", "architecture-mismatch (architecture: captured 'riscv64'")])
def test_restore_one_bad_rank_of_many_stops_every_rank_before_criu(tmp_path: Path, world: int, case: str,
                                                                   own: str) -> None:
    culprit = world - 1
    images = world_images(tmp_path, world, **{case: culprit})
    results = restore_workers(tmp_path, images, list(range(world)))
    assert_every_rank_stopped_by(results, culprit, own, tmp_path, culprit_exit=3 if case == "host" else 1)


def test_restore_of_eight_ranks_one_never_arriving_stops_the_seven(tmp_path: Path) -> None:
    images = world_images(tmp_path, 8)
    results = restore_workers(tmp_path, images, list(range(7)), timeout=1)
    assert all(rc == 1 and "rank(s) 7 never reached validated" in err for rc, err in results)
    assert not list((tmp_path / "coord" / "restore-1").glob("criu-restored/*"))


def test_a_peer_abort_ends_the_wait_for_an_engine_that_never_answers(tmp_path: Path) -> None:
    """A restored engine blocked on a dead peer (e.g. in its communicator rendezvous) must not hold this rank's
    worker for the request timeout: the activation's abort ends the wait."""
    import socket
    import time

    from coldsnap_probe._engine import engine_request

    path = str(tmp_path / "engine.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as engine:
        engine.bind(path)
        engine.listen()  # accepts (in the backlog) and never answers
        rank0 = Coordinator(tmp_path / "coord", "restore-1", 0, 2)
        peer = Coordinator(tmp_path / "coord", "restore-1", 1, 2)
        aborting = threading.Timer(0.3, peer.abort, args=("rank 1 restore: its process died",))
        aborting.start()
        started = time.monotonic()
        with pytest.raises(RankAborted, match=r"engine restore: the activation was aborted .* rank 1 restore: its"):
            engine_request(path, {"op": "resume"}, "engine restore", timeout=60, ranks=rank0)
        assert time.monotonic() - started < 5
        aborting.join()

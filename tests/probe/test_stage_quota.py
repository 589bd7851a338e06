"""The node hydrator's cap per tenant (peer uid) on what it holds in stages: the rule is a pure function of the
stage table and the request (tested here without a GPU); the command line that sets it; and, on a GPU host, the
real hydrator refusing a stage beyond the cap while the uid's earlier stage stays adoptable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldsnap_probe.errors import HydrationError
from coldsnap_probe.hydration.__main__ import _bytes, main
from coldsnap_probe.hydration._stage_quota import STAGE_UID_COUNT, StageQuota, check_stage_quota
from tests.probe.test_main import has_nvidia_driver

MIB, GIB = 1 << 20, 1 << 30


@dataclass
class Stage:
    owner: int
    size: int


def key(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


QUOTA = StageQuota(count=2, bytes=40 * GIB)


def test_a_stage_within_the_uids_cap_is_admitted() -> None:
    staged = {key(1): Stage(1001, 30 * GIB)}
    check_stage_quota(staged, key=key(2), uid=1001, size=10 * GIB, quota=QUOTA)  # exactly at the byte cap


def test_a_stage_beyond_the_uids_count_is_refused_naming_the_uid_the_cap_and_what_it_holds() -> None:
    """Regression (issue 22): one uid could hold every stage slot for the stage TTL."""
    staged = {key(1): Stage(1001, GIB), key(2): Stage(1001, 2 * GIB)}
    with pytest.raises(HydrationError, match=r"^uid 1001 holds 2 stage\(s\) of 3221225472 bytes already: at most 2 "
                                             r"per uid \(serve --stage-uid-count\)$"):
        check_stage_quota(staged, key=key(3), uid=1001, size=MIB, quota=QUOTA)


def test_a_stage_beyond_the_uids_bytes_is_refused_and_changes_nothing() -> None:
    """Regression (issue 22): one uid could hold most of a GPU's free memory for the stage TTL."""
    staged = {key(1): Stage(1001, 30 * GIB), key(2): Stage(1002, 50 * GIB)}
    before = dict(staged)
    with pytest.raises(HydrationError, match=r"^uid 1001 holds 1 stage\(s\) of 32212254720 bytes: 10737418241 more "
                                             r"would exceed its cap of 42949672960 bytes \(serve --stage-uid-bytes\)$"):
        check_stage_quota(staged, key=key(3), uid=1001, size=10 * GIB + 1, quota=QUOTA)
    assert staged == before  # the rule frees nothing, of the asker's or of anyone else's


def test_other_uids_stages_never_count_against_a_uid() -> None:
    staged = {key(n): Stage(1002, 40 * GIB) for n in range(2)}  # uid 1002 is at both of its caps
    check_stage_quota(staged, key=key(9), uid=1001, size=40 * GIB, quota=QUOTA)
    with pytest.raises(HydrationError, match=r"^uid 1002 holds 2 stage"):
        check_stage_quota(staged, key=key(9), uid=1002, size=MIB, quota=QUOTA)


def test_a_retry_of_the_uids_own_stage_replaces_it_rather_than_counting_twice() -> None:
    staged = {key(1): Stage(1001, 30 * GIB), key(2): Stage(1001, 10 * GIB)}
    check_stage_quota(staged, key=key(2), uid=1001, size=10 * GIB, quota=QUOTA)
    with pytest.raises(HydrationError, match="would exceed its cap"):
        check_stage_quota(staged, key=key(2), uid=1001, size=10 * GIB + 1, quota=QUOTA)


def test_a_shared_hydrator_defaults_to_two_stages_and_half_the_gpu_per_uid() -> None:
    assert StageQuota.default(141 * GIB, shared=True, stages=4) == StageQuota(count=STAGE_UID_COUNT,
                                                                             bytes=141 * GIB // 2)
    assert StageQuota.default(141 * GIB, shared=True, stages=4, count=1, size=8 * GIB) == StageQuota(1, 8 * GIB)


def test_a_single_tenant_hydrator_defaults_to_its_own_limits_so_one_engine_may_stage_most_of_the_gpu() -> None:
    """Only root and the hydrator's uid may ask: one tenant, whose engine may keep 90% of the GPU (vLLM's
    default), dump and all; a cap of half the GPU would have sent every such restore to the slow path."""
    quota = StageQuota.default(141 * GIB, shared=False, stages=4)
    assert quota == StageQuota(count=4, bytes=141 * GIB)
    check_stage_quota({}, key=key(1), uid=0, size=127 * GIB, quota=quota)
    assert StageQuota.default(141 * GIB, shared=False, stages=4, size=8 * GIB) == StageQuota(4, 8 * GIB)


def test_a_quota_of_nothing_is_refused() -> None:
    with pytest.raises(HydrationError, match="at least one stage and one byte"):
        StageQuota(count=0, bytes=GIB)


@pytest.mark.parametrize(("text", "size"), [("1048576", MIB), ("40G", 40 * GIB), ("40GiB", 40 * GIB),
                                            ("512m", 512 * MIB), ("2 TB", 2 << 40)])
def test_a_stage_size_is_read_in_binary_units(text: str, size: int) -> None:
    assert _bytes(text) == size


@pytest.mark.parametrize(("option", "value"), [("--stage-uid-bytes", "lots"), ("--stage-uid-bytes", "0"),
                                               ("--stage-uid-bytes", "4X"), ("--stage-uid-count", "0"),
                                               ("--stage-uid-count", "1.5")])
def test_a_bad_cap_on_the_command_line_is_refused_naming_the_option(option: str, value: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--socket", "/nonexistent/h.sock", "--staging", option, value])
    assert exited.value.code == 2
    assert f"argument {option}: must be a positive" in capsys.readouterr().err


@pytest.mark.skipif(not has_nvidia_driver(), reason="needs an NVIDIA driver")
def test_the_hydrator_refuses_a_stage_beyond_the_cap_and_keeps_the_earlier_one(tmp_path: Path) -> None:
    """The real hydrator with --stage-uid-count 1 and --stage-uid-bytes 8M: a second stage of this uid is refused
    naming it; one larger than 8 MiB too; the first stays staged (listed, then discarded with its ticket)."""
    from coldsnap_probe.jsonline import request
    from tests.helpers import ROOT

    part = tmp_path / "seg-0.bin"
    part.write_bytes(os.urandom(4 * MIB))
    big = tmp_path / "seg-1.bin"
    big.write_bytes(os.urandom(10 * MIB))
    control = tmp_path / "hydrator.sock"
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                             "--staging", "--stage-ttl", "30", "--stage-uid-count", "1", "--stage-uid-bytes", "8M"],
                            stdout=subprocess.PIPE, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]

        def stage(n: int, path: Path, size: int) -> dict[str, object]:
            return request(str(control), {"op": "stage-dump", "key": key(n), "device_uuid": ready["device_uuid"],
                                          "parts": [{"file": str(path), "bytes": size, "region": 0}]}, timeout=120.0)

        first = stage(1, part, 4 * MIB)
        assert first["ok"], first
        second = stage(2, part, 4 * MIB)
        # The answer names the error class first (HydrationError: ...), then the uid, what it holds and the cap.
        assert not second["ok"] and (f"uid {os.geteuid()} holds 1 stage(s) of {4 * MIB} bytes already: at most 1 "
                                     "per uid") in str(second["error"]), second
        retry = stage(1, big, 10 * MIB)  # replacing its own stage, but beyond the byte cap: refused, first kept
        assert not retry["ok"] and f"its cap of {8 * MIB} bytes" in str(retry["error"]), retry
        status = request(str(control), {"op": "status"}, timeout=10.0)
        assert [s["key"] for s in status["staged"]] == [key(1)] and status["quota"] == {"count": 1, "bytes": 8 * MIB}
        discarded = request(str(control), {"op": "discard", "key": key(1), "ticket": first["ticket"]}, timeout=10.0)
        assert discarded["discarded"] is True
    finally:
        proc.kill()
        proc.wait()


def as_nobody(path: str, message: dict[str, object]) -> dict[str, object]:
    """One request to the hydrator at `path` from a child process running as uid/gid 65534 (another tenant)."""
    from coldsnap_probe.jsonline import request

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, ask, write the answer, leave without running the parent's cleanups
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, json.dumps(request(path, message, timeout=120.0)).encode())
        except BaseException as exc:
            os.write(write, json.dumps({"ok": False, "error": f"child: {exc!r}"}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        data = answer.read()
    os.waitpid(pid, 0)
    decoded: dict[str, object] = json.loads(data)
    return decoded


@pytest.mark.skipif(not has_nvidia_driver() or os.geteuid() != 0, reason="needs an NVIDIA driver and root")
def test_another_uid_staging_the_same_key_neither_blocks_nor_replaces_a_stage() -> None:
    """Regression (review3): stages were keyed by the manifest digest alone, so a tenant that staged first under
    another's key (the same model's manifest, or one it guessed from the images) had the other's stage refused
    ("staged by another peer") for the stage TTL. Now each uid's stage is its own: both stage under one key, each
    lists and discards only its own with its own ticket."""
    import shutil
    import tempfile

    from coldsnap_probe.jsonline import request
    from tests.helpers import ROOT

    folder = Path(tempfile.mkdtemp(prefix="cs-squat-", dir="/tmp"))
    folder.chmod(0o755)  # nobody may search it (the socket) and read the part (the hydrator checks as the peer)
    part = folder / "seg-0.bin"
    part.write_bytes(os.urandom(4 * MIB))
    part.chmod(0o644)
    control = folder / "hydrator.sock"
    proc = subprocess.Popen([sys.executable, "-m", "coldsnap_probe.hydration", "serve", "--socket", str(control),
                             "--staging", "--stage-ttl", "60", "--allow-uid", "65534", "--socket-group", "65534"],
                            stdout=subprocess.PIPE, cwd=ROOT)
    try:
        ready = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        stage = {"op": "stage-dump", "key": key(7), "device_uuid": ready["device_uuid"],
                 "parts": [{"file": str(part), "bytes": 4 * MIB, "region": 0}]}
        squatter = as_nobody(str(control), stage)
        assert squatter["ok"], squatter
        mine = request(str(control), stage, timeout=120.0)
        assert mine["ok"], mine  # was: HydrationError: sha256:... is staged by another peer
        assert [s["key"] for s in request(str(control), {"op": "status"}, timeout=10.0)["staged"]] == [key(7)]
        assert [s["key"] for s in as_nobody(str(control), {"op": "status"})["staged"]] == [key(7)]  # type: ignore
        # a ticket opens only its own stage: the squatter's discards its own, mine stays adoptable
        assert as_nobody(str(control), {"op": "discard", "key": key(7), "ticket": squatter["ticket"]})["discarded"]
        assert as_nobody(str(control), {"op": "status"})["staged"] == []
        assert request(str(control), {"op": "discard", "key": key(7), "ticket": mine["ticket"]},
                       timeout=10.0)["discarded"] is True
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)

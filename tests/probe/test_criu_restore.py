"""CRIU on the CPU: the project's worker dumps and restores a real process with the parallel page restore.

The CRIU is the one `scripts/criu/build` makes (third_party/criu plus the parallel-restore patch); `scripts/test`
builds it and names it in COLDSNAP_TEST_CRIU, and then these tests must run. Run alone they find the build
with `scripts/criu/build --print-dir` and skip only when it was never built (or not as root: CRIU needs it).
"""

from __future__ import annotations

import ctypes
import difflib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from coldsnap_probe._criu_kdat import CARRIED_CACHE, CARRIED_KEY
from coldsnap_probe._images_fs import images_filesystem
from coldsnap_probe._process import CriuRun, image_digest
from tests.criu import CRIU, alive, criu_wrapper
from tests.helpers import ROOT

TARGET_MIB = 512
ZERO_MIB = 16  # of the target's private memory about 60 % pages written with zeros (bench/criu_target.py)
THP_FLAGS = frozenset({"hg", "nh"})  # smaps VmFlags of MADV_HUGEPAGE and MADV_NOHUGEPAGE


pytestmark = pytest.mark.skipif(CRIU is None, reason="needs root and scripts/criu/build's CRIU")


@pytest.fixture
def criu(tmp_path: Path) -> Iterator[str]:
    with criu_wrapper(tmp_path) as wrapper:
        yield wrapper


@dataclass(frozen=True)
class Capture:
    """A capture of the default target (see `captured`): its control directory, the images, its PID, and (for
    `advised`) its mappings just before the dump."""
    control: Path
    images: Path
    pid: int
    before: tuple[Vma, ...] = ()


@pytest.fixture(scope="module")
def shared_capture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Capture]]:
    """One capture of the default target for this module's tests that restore it (ending the restored process) or
    refuse to, without changing it: a capture is about 3.5 s of the 2-core CI box, and seven tests need one.
    A list, so that `plain` can replace it when its PID was taken meanwhile (pid_max may be 32768)."""
    base = tmp_path_factory.mktemp("capture")
    with criu_wrapper(base) as wrapper:
        yield [Capture(*captured(base, wrapper))]


def _advised(tmp_path: Path, criu: str) -> Capture:
    """A capture of the target with 16 MiB advised NOHUGEPAGE, and its mappings as they were before the dump."""
    before: list[Vma] = []
    return Capture(*captured(tmp_path, criu, nothp_mib=16, before=before), before=tuple(before))


@pytest.fixture(scope="module")
def shared_advised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Capture]]:
    """As `shared_capture`, of `_advised`'s target: the huge-page test restores it with each thread count."""
    base = tmp_path_factory.mktemp("advised")
    with criu_wrapper(base) as wrapper:
        yield [_advised(base, wrapper)]


def _reused(shared: list[Capture], tmp_path: Path, recapture: Callable[[Path], Capture]) -> Iterator[Capture]:
    """The shared capture, its target not running and its control directory as the capture left it; a fresh one
    (`recapture`) when another process holds its PID now. Whatever the test restored is ended afterwards."""
    current = shared[0]
    if Path(f"/proc/{current.pid}").exists():
        (tmp_path / "recaptured").mkdir()
        current = shared[0] = recapture(tmp_path / "recaptured")
    for name in ("exit", "verify", "result"):
        (current.control / name).unlink(missing_ok=True)
    try:
        yield current
    finally:
        if alive(current.pid):  # a failed assertion before the test's own end()
            end(current.control, current.pid)


@pytest.fixture
def plain(shared_capture: list[Capture], criu: str, tmp_path: Path) -> Iterator[Capture]:
    """The shared capture of the default target (`_reused`)."""
    yield from _reused(shared_capture, tmp_path, lambda into: Capture(*captured(into, criu)))


@pytest.fixture
def advised(shared_advised: list[Capture], criu: str, tmp_path: Path) -> Iterator[Capture]:
    """The shared capture of `_advised`'s target (`_reused`)."""
    yield from _reused(shared_advised, tmp_path, lambda into: _advised(into, criu))


def private_images(images: Path, into: Path) -> Path:
    """A copy of `images` that a test may change: links to every file, so a test must replace (never write into)
    the files it changes."""
    into.mkdir()
    for f in images.iterdir():
        os.link(f, into / f.name)
    return into


def worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], capture_output=True, text=True,
                          cwd=ROOT, check=False, timeout=280, env={**os.environ, **(env or {})})


def wait_file(path: Path, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def captured(tmp_path: Path, criu: str, nothp_mib: int = 0, before: list[Vma] | None = None,
             fork: bool = False, env: dict[str, str] | None = None) -> tuple[Path, Path, int]:
    """The target (private, THP, shared anonymous and file-backed memory, pages written with zeros; `nothp_mib`
    MiB advised NOHUGEPAGE; with `fork` a child sharing it copy-on-write, each overwriting with zeros pages the
    other keeps) dumped by the worker (n580) and reaped: (its control directory, the images, its PID). `before`
    receives its mappings as they were just before the dump."""
    control, images = tmp_path / "control", tmp_path / "images"
    control.mkdir()
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control),
                               "--mib", str(TARGET_MIB), "--thp-mib", "64", "--nothp-mib", str(nothp_mib),
                               "--shared-mib", "16", "--file-mib", "8", "--zero-mib", str(ZERO_MIB),
                               *(["--fork"] if fork else [])],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    wait_file(control / "ready")
    if before is not None:
        before.extend(mappings(target.pid))
    # The pages dumped by threads (dump-threads.patch; unset keeps stock CRIU's path on the 2-core CI box): the
    # restores below read what the GPU machine's captures write.
    done = worker("capture", "--pid", str(target.pid), "--images", str(images), "--boundary", "n580",
                  "--criu", criu, env={"CRIU_DUMP_THREADS": "4", **(env or {})})
    assert done.returncode == 0, done.stderr
    assert json.loads((images / "capture.json").read_text())["criu_dump_stats"]["threads"] == 4
    target.wait()  # CRIU killed it: reap, so that its PID is free for the restore
    if fork:  # and its child, orphaned to this process (the subreaper)
        assert gone_within(int((control / "child").read_text()), 10)
    return control, images, target.pid


@dataclass(frozen=True)
class Vma:
    """One mapping of /proc/PID/smaps: its range, permissions, VmFlags and PMD-mapped huge page kB."""
    start: int
    end: int
    perms: str
    flags: frozenset[str]
    anon_huge_kb: int


def mappings(pid: int) -> list[Vma]:
    out: list[Vma] = []
    span: list[str] = []
    huge = 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            span = head
        elif head[0] == "AnonHugePages:":
            huge = int(head[1])
        elif head[0] == "VmFlags:":
            start, end = (int(x, 16) for x in span[0].split("-"))
            out.append(Vma(start, end, span[1], frozenset(head[1:]), huge))
    return out


def holding(vmas: list[Vma], at: int, size: int) -> list[Vma]:
    """The mappings that cover [at, at + size)."""
    return [v for v in vmas if v.start < at + size and v.end > at]


def layout(vmas: list[Vma]) -> list[str]:
    """Address ranges with their permissions and THP flags, neighbours alike joined: premapping every private
    VMA lets the kernel merge a library's read-only data with its (then read-only) relocated part, a split
    the restored process never sees."""
    joined: list[tuple[int, int, str, frozenset[str]]] = []
    for v in vmas:
        if joined and joined[-1][1] == v.start and joined[-1][2:] == (v.perms, v.flags & THP_FLAGS):
            joined[-1] = (joined[-1][0], v.end, v.perms, v.flags & THP_FLAGS)
        else:
            joined.append((v.start, v.end, v.perms, v.flags & THP_FLAGS))
    return [f"{start:x}-{end:x} {perms} {' '.join(sorted(flags))}" for start, end, perms, flags in joined]


def thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text.split("[", 1)[1].split("]", 1)[0]


def verified(control: Path, prefix: str = "") -> dict[str, object]:
    """The target's own check of its memory (`prefix` "child-": its forked child's)."""
    (control / f"{prefix}result").unlink(missing_ok=True)
    (control / f"{prefix}verify").touch()
    result: dict[str, object] = json.loads(wait_file(control / f"{prefix}result"))
    return result


def end(control: Path, pid: int) -> None:
    (control / "exit").touch()
    deadline = time.monotonic() + 30
    while alive(pid):
        assert time.monotonic() < deadline, f"the restored process {pid} did not exit"
        time.sleep(0.05)


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("threads", [1, 4])
def test_restore_writes_every_page_back_and_leaves_the_images_unchanged(tmp_path: Path, criu: str, plain: Capture,
                                                                        threads: int) -> None:
    control, images, pid = plain.control, plain.images, plain.pid
    before = image_digest(images, contents=True)
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"),
                  env={"CRIU_RESTORE_THREADS": str(threads)})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["restored_pid"] == pid
    # The worker's own start, then CRIU's run inside the restore, in order (issue 35: each phase measured).
    start = [(m["name"], m["unix_ns"], m["since_restore_begin_s"]) for m in report["worker_start"]]
    # The guard before the imports, this host's identity read while they run (issue 35 item 2: CRIU sooner).
    assert [name for name, _, _ in start] == ["worker_main", "guard_started", "imports_done"]
    assert [ns for _, ns, _ in start] == sorted(ns for _, ns, _ in start) and all(s < 0 for _, _, s in start)
    marks = {m["name"]: m["unix_ns"] for m in report["timeline"]}
    # A tree CRIU leaves running (no CUDA process, eager): every record is checked before CRIU starts.
    assert start[-1][1] <= marks["restore_begin"] <= marks["validated"] <= marks["criu_restore_begin"]
    assert marks["criu_restore_end"] - marks["criu_restore_begin"] >= report["criu_restore_seconds"] * 1e9 * 0.9
    result = verified(control)
    assert result == {"ok": True, "bad": [], "bytes": (TARGET_MIB + 64 + 16 + 8 + ZERO_MIB) << 20, "pid": pid}
    log = (tmp_path / "work/restore.log").read_text()
    assert f"{threads} thread(s) restore private pages" in log
    if threads > 1:
        assert f"by {threads} threads" in log  # the restoring task's pages went through the parallel fill
    else:
        assert "by 1 threads" not in log and " chunks by " not in log  # stock: the restorer's one preadv stream
    # The capture carried its dump's kernel-feature cache (same boot, same confinement): no probe ran, the
    # restore's CRIU loaded a copy of it (kdat-cache.patch), and the copy's directory is gone with the worker.
    cache = re.search(r"Loaded kdat cache from (/\S+/coldsnap-kdat-\w+/criu\.kdat)$", log, re.MULTILINE)
    assert cache is not None, log[:2000]
    assert not Path(cache.group(1)).parent.exists()
    # Where CRIU's time went, from its log, in the report (issue 35 item 2).
    phases = report["criu_restore_phases"]
    assert "kdat_probe_s" not in phases and 0 <= phases["kdat_carried_s"] < 1
    assert 0 < phases["probe_setup_s"] < phases["logged_s"]
    assert {"images_fork_s", "restorer_s", "seize_stop_s"} <= set(phases)
    assert ("fill_s" in phases) == (threads > 1)  # the stock restore fills in the restorer: no line of its own
    end(control, pid)
    assert image_digest(images, contents=True) == before


def _another_boot(images: Path) -> None:
    record = json.loads((images / CARRIED_KEY).read_text())
    record["key"]["boot_id"] = "00000000-0000-0000-0000-000000000000"
    (images / CARRIED_KEY).write_text(json.dumps(record))


def _forged_short(images: Path) -> None:
    """A cache cut short with a key that vouches for it (a manager forging its own images): only CRIU can tell."""
    data = (images / CARRIED_CACHE).read_bytes()[:64]
    (images / CARRIED_CACHE).write_bytes(data)
    record = json.loads((images / CARRIED_KEY).read_text())
    (images / CARRIED_KEY).write_text(json.dumps({**record, "bytes": len(data), "crc32": zlib.crc32(data)}))


@pytest.mark.parametrize(("change", "probed", "logged"), [
    pytest.param(_another_boot, True, "Loaded kdat cache from", id="another-boot: the worker probes"),
    pytest.param(_forged_short, False, "Stale /", id="forged-short: CRIU probes"),
])
def test_a_carried_kernel_cache_not_of_this_boot_or_not_whole_is_not_used_and_the_restore_is_whole(
        tmp_path: Path, criu: str, plain: Capture, change: Callable[[Path], None], probed: bool, logged: str) -> None:
    images = private_images(plain.images, tmp_path / "images")
    for name in (CARRIED_CACHE, CARRIED_KEY):  # links to the shared capture's files: replaced, never written into
        data = (images / name).read_bytes()
        (images / name).unlink()
        (images / name).write_bytes(data)
    change(images)
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    phases = report["criu_restore_phases"]
    assert ("kdat_probe_s" in phases) == probed and ("kdat_carried_s" in phases) != probed
    assert logged in (tmp_path / "work/restore.log").read_text()
    assert report["restored_pid"] == plain.pid and alive(plain.pid)
    if not probed:  # CRIU's own probe replaced what the forged cache said: every page is back all the same
        assert verified(plain.control)["ok"] is True
    end(plain.control, plain.pid)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_truncated_pages_image_fails_naming_it_and_leaves_no_process(tmp_path: Path, criu: str, plain: Capture,
                                                                       threads: int) -> None:
    images, pid = private_images(plain.images, tmp_path / "images"), plain.pid
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    pages.unlink()  # a link to the shared capture's file: a copy short of its last 8 MiB replaces it
    with open(plain.images / pages.name, "rb") as whole, open(pages, "wb") as short:
        left = os.fstat(whole.fileno()).st_size - (8 << 20)
        while left > 0:
            left -= os.sendfile(short.fileno(), whole.fileno(), None, left)
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"),
                  env={"CRIU_RESTORE_THREADS": str(threads)})
    assert done.returncode != 0
    # Stock CRIU looped forever here (preadv returning 0); the patch fails: in the restorer with one thread,
    # naming the file with several.
    named = "The pages image" if threads == 1 else pages.name
    assert f"{named} ends at offset" in done.stderr and "before its pagemap's pages" in done.stderr, done.stderr
    assert "criu restore exited" in done.stderr
    assert gone_within(pid, 10), f"a process of the tree ({pid}) is left"



def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_libcuda_loads(), reason="this host's libcuda loads: the failure below cannot happen here")
def test_a_cuda_driver_that_fails_while_criu_restores_leaves_no_process(tmp_path: Path, criu: str,
                                                                        plain: Capture) -> None:
    """CRIU starts before the CUDA driver loads (issue 35): a driver that cannot load meanwhile fails the restore
    naming CRIU's phase, once CRIU's tree exists, and the rollback kills that tree."""
    images, pid = private_images(plain.images, tmp_path / "images"), plain.pid
    record = images / "capture.json"
    captured = json.loads(record.read_text())
    record.unlink()  # a link to the shared capture's: a copy that records the target as a CUDA process replaces it
    record.write_text(json.dumps({**captured, "cuda_pids": [pid]}))
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 1
    assert "error: restore phase criu-restore: WorkerError: CudaLibraryMissing: libcuda.so.1 could not be loaded" \
        in done.stderr, done.stderr
    assert "Restore finished successfully" in (tmp_path / "work/restore.log").read_text()  # CRIU ran meanwhile
    assert gone_within(pid, 10), f"the restored tree ({pid}) outlived the failed restore"

@pytest.mark.parametrize("flags", [[], ["--lazy-pages"]], ids=["running", "paused"])
def test_a_shared_file_that_cannot_be_put_back_fails_in_criu_s_phase_and_leaves_no_process(
        tmp_path: Path, criu: str, plain: Capture, flags: list[str]) -> None:
    """Review 14: the /dev/shm files are put back as CRIU starts, CRIU's phase. Regression (issue 35's reorder):
    CRIU began before its phase was entered, so a failure there named `stage` (a tree restored running, several
    ranks) or `validate` (one rank's paused tree), phases of records and of a node hydrator's stages."""
    from coldsnap_probe._shm_files import save_shared_files

    images, pid = private_images(plain.images, tmp_path / "images"), plain.pid
    path = Path(f"/dev/shm/cs-review14-{os.getpid()}-{len(flags)}")
    path.write_bytes(b"ring")
    try:
        save_shared_files([str(path)], images)  # new files beside the links: the shared capture stays as it was
        path.unlink()
        path.mkdir()  # a directory where the file goes back: the rename over it fails
        done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"),
                      *flags)
        assert done.returncode == 1
        assert f"error: restore phase criu-restore: WorkerError: shared-memory file {path} could not be put back" \
            in done.stderr, done.stderr
        assert not alive(pid) and [p.name for p in path.parent.glob(f"{path.name}.coldsnap-*")] == []
    finally:
        if path.is_dir():
            path.rmdir()
        path.unlink(missing_ok=True)


def test_a_bad_record_is_the_reason_given_when_criu_fails_too(tmp_path: Path, criu: str, plain: Capture) -> None:
    """Review 14: one rank's paused tree checks its records while CRIU runs. Regression: when CRIU failed as well,
    its error was the one given (under `validate`) and the record's, which the order before named, was lost."""
    images = private_images(plain.images, tmp_path / "images")
    record = images / "capture.json"
    captured = json.loads(record.read_text())
    record.unlink()  # links to the shared capture's files: copies replace those changed
    record.write_text(json.dumps({**captured, "cuda_pids": [plain.pid]}))  # a CUDA tree: restored paused
    (images / "graph.json").write_text("{")
    pages = max(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    pages.unlink()
    pages.write_bytes(b"")  # CRIU fails too
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 1 and "\nerror: restore phase validate: WorkerError: " in done.stderr, done.stderr
    assert "graph.json" in done.stderr.split("\nerror: ")[1] and not alive(plain.pid), done.stderr


def test_images_without_their_process_tree_are_refused_naming_it(tmp_path: Path, criu: str, plain: Capture) -> None:
    """Review 14: the patched CRIU died of SIGSEGV on images without pstree.img; the worker refuses them first."""
    images = private_images(plain.images, tmp_path / "images")
    (images / "pstree.img").unlink()
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 1 and "restore phase criu-restore: WorkerError: these images lack pstree.img (CRIU's " \
        "process tree)" in done.stderr, done.stderr
    assert "criu restore exited" not in done.stderr and not alive(plain.pid)


def test_a_killed_restore_leaves_no_process(tmp_path: Path, criu: str, plain: Capture) -> None:
    # CRIU run bare keeps its work files (stats-restore.img) beside the images: links, so the shared ones stay as
    # they were.
    images, pid = private_images(plain.images, tmp_path / "images"), plain.pid
    restore = subprocess.Popen([criu, "restore", "--images-dir", str(images), "--restore-detached", "-v4",
                                "--log-file", str(tmp_path / "killed.log")],
                               env={**os.environ, "CRIU_RESTORE_THREADS": "4"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not Path(f"/proc/{pid}").exists():  # the tree's root exists: CRIU is filling its memory
        assert restore.poll() is None and time.monotonic() < deadline, "the restore ended before it could be killed"
        time.sleep(0.001)
    os.killpg(restore.pid, signal.SIGKILL)
    restore.wait()
    assert gone_within(pid, 10), f"a process of the tree ({pid}) outlived the killed restore"


def test_a_bad_thread_count_is_refused_before_anything_is_restored(tmp_path: Path, criu: str, plain: Capture) -> None:
    images, pid = plain.images, plain.pid
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"),
                  env={"CRIU_RESTORE_THREADS": "lots"})
    assert done.returncode != 0 and "CRIU_RESTORE_THREADS=lots: must be a whole number from 1 to 256" in done.stderr
    assert not alive(pid)


def test_the_capture_records_criu_s_version_and_a_different_criu_is_refused(tmp_path: Path, criu: str,
                                                                             plain: Capture) -> None:
    images, pid = plain.images, plain.pid
    recorded = json.loads((images / "capture.json").read_text())["identity"]["criu"]
    assert recorded["version_exit_code"] == 0 and recorded["version"].startswith("Version: 4.2\nGitID: v4.2-coldsnap")
    other = tmp_path / "other-criu"
    other.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo 'Version: 4.1.1'; exit 0; }}\nexec {criu} \"$@\"\n")
    other.chmod(0o755)
    before = image_digest(images, contents=True)
    done = worker("restore", "--images", str(images), "--criu", str(other), "--work-dir", str(tmp_path / "work"))
    assert done.returncode == 3, done.stderr
    assert json.loads(done.stdout)["refused"] == [
        {"code": "criu-mismatch", "fact": "criu", "captured": recorded["version"], "current": "Version: 4.1.1"}]
    assert not (tmp_path / "work/restore.log").exists() and not alive(pid)
    assert image_digest(images, contents=True) == before


def test_a_refused_restore_never_loaded_what_only_the_phases_after_criu_need(tmp_path: Path, criu: str) -> None:
    """Issue 35 item 2: the path to CRIU imports only what the checks need; the later phases' module (the held tree,
    CRIU's log, the CUDA driver's wrapper), the hydration pools' modules (and `logging` with them) are imported while
    CRIU runs, so a restore refused by its checks never loads them; nor the weights manifest's machinery (no
    `hydration.json`), `platform` (os.uname says the same) or `secrets` (os.urandom)."""
    images = tmp_path / "images"
    images.mkdir()
    (images / "capture.json").write_text(json.dumps({"format": 1, "boundary": "n580", "root_pid": 300,
                                                     "identity": {"architecture": "not-this-one"}}))
    done = subprocess.run([sys.executable, "-S", "-X", "importtime", "-m", "coldsnap_probe", "restore", "--images",
                           str(images), "--criu", criu], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 3, done.stderr
    assert json.loads(done.stdout)["refused"][0]["code"] == "architecture-mismatch"
    imported = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "coldsnap_probe._restore" in imported and "coldsnap_probe._host" in imported
    later = {"concurrent.futures", "logging", "coldsnap_probe._restore_after_criu", "coldsnap_probe._held_tree",
             "coldsnap_probe._thread_hold", "coldsnap_probe._criu_restore_log", "coldsnap_probe._cuda",
             "coldsnap_probe.hydration._weights", "coldsnap_probe._memory", "platform", "secrets", "hmac"}
    assert not later & set(imported)


def test_criu_s_seconds_are_its_own_run_whenever_the_worker_waits_for_it(tmp_path: Path, criu: str) -> None:
    """A restore worker waits for CRIU only once its CUDA driver is up: CRIU's seconds must still be CRIU's."""
    run = CriuRun(criu, ["--version"], tmp_path / "version.log")
    time.sleep(0.5)  # the worker's own work meanwhile, longer than CRIU's (~5 ms)
    assert run.wait() < 0.4

def test_the_capture_reports_where_criu_s_dump_and_the_worker_s_start_went(plain: Capture) -> None:
    """Issue 35 item 3: CRIU's own account of the dump (stats-dump) and the worker's phases outside CRIU."""
    report = json.loads((plain.images / "capture.json").read_text())
    stats, timings = report["criu_dump_stats"], report["timings_s"]
    assert 0 < stats["memwrite_s"] <= stats["memdump_s"] <= stats["frozen_s"] < timings["criu_dump"]
    assert 0 <= stats["freezing_s"] < timings["criu_dump"]
    pages = sum(f.stat().st_size for f in plain.images.glob("pages-*.img"))
    assert 0 < stats["pages_written"] <= stats["pages_scanned"]
    assert stats["pages_written"] * 4096 <= pages  # the private pages written, the shared ones beside them
    assert stats["pages_written"] >= (TARGET_MIB << 20) // 4096 // 2  # most of the target's data
    assert 0 < timings["worker_start"] < 10 and 0 <= timings["finish"] < 10 and 0 <= timings["interpreter_start"] < 10
    assert report["images_filesystem"] == images_filesystem(plain.images) and report["images_filesystem"]["type"]


def test_a_host_that_cannot_restore_is_refused_before_any_work_naming_every_fact(tmp_path: Path, criu: str) -> None:
    """Issue 36 item 4: the capture records the layers of the image it ran in (the provider names them), the
    kernel and what the capsule sees; a restore elsewhere is refused (exit 3) with one code and both values per
    fact, before CRIU runs; a capsule image built on the captured one (upstream's flow) restores."""
    base = ["sha256:" + "a" * 64, "sha256:" + "b" * 64]
    control, images, pid = captured(tmp_path, criu, env={"COLDSNAP_CAPSULE_LAYERS": ",".join(base)})
    record = json.loads((images / "capture.json").read_text())
    facts = record["identity"]
    assert facts["image_layers"] == base and facts["kernel"] == os.uname().release
    assert {"gpu_devices", "cuda_driver_api"} <= set(facts)
    facts["kernel"] = "2.6.32-754.el6.x86_64"  # what another node would have recorded
    (images / "capture.json").write_text(json.dumps(record))
    before = image_digest(images, contents=True)
    other = ["sha256:" + "d" * 64, "sha256:" + "b" * 64, "sha256:" + "c" * 64]  # not built on the captured image
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"),
                  env={"COLDSNAP_CAPSULE_LAYERS": ",".join(other)})
    assert done.returncode == 3, done.stderr
    answer = json.loads(done.stdout)
    assert answer["kind"] == "restore-refused" and answer["checked_seconds"] > 0
    here = os.uname().release
    assert answer["refused"] == [
        {"code": "kernel-mismatch", "fact": "kernel", "captured": "2.6.32-754.el6.x86_64", "current": here},
        {"code": "capsule-image-mismatch", "fact": "image_layers", "captured": f"2 layers, the top {base[-1]}",
         "current": f"3 layers, the top {other[-1]}"}]
    assert "error: restore phase validate: TargetRefused: not restoring on this host: kernel-mismatch" in done.stderr
    assert not (tmp_path / "work/restore.log").exists() and not alive(pid)
    assert image_digest(images, contents=True) == before
    facts["kernel"] = here  # this node, in a capsule image built FROM the captured one: restored
    (images / "capture.json").write_text(json.dumps(record))
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work-2"),
                  env={"COLDSNAP_CAPSULE_LAYERS": ",".join([*base, "sha256:" + "e" * 64])})
    try:
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["identity_compatibility"] == "pre-cuda-template" and verified(control)["ok"]
    finally:
        end(control, pid)


@pytest.mark.parametrize("threads", [1, 4])
def test_huge_page_advice_and_the_mappings_are_restored_exactly(tmp_path: Path, criu: str, advised: Capture,
                                                                threads: int) -> None:
    """With the parallel fill the premapped copies are 2 MiB-congruent to their final addresses and carry the
    dumped MADV_[NO]HUGEPAGE: every byte comes back, every mapping has its range, permissions and VmFlags
    (no premap padding is left behind), the NOHUGEPAGE region has no huge page and the HUGEPAGE one has
    huge pages where the system's THP mode allows them."""
    control, images, pid, before = advised.control, advised.images, advised.pid, list(advised.before)
    try:
        done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"),
                      env={"CRIU_RESTORE_THREADS": str(threads)})
        assert done.returncode == 0, done.stderr
        result = verified(control)
        assert result["ok"] and result["bad"] == [], result
        after = mappings(pid)
        spans = json.loads((control / "regions.json").read_text())
        # Stock CRIU itself changes some flags (`ac` on private file text it maps writable first): THP's are compared.
        shown = [layout(vmas) for vmas in (before, after)]
        assert shown[1] == shown[0], "\n".join(difflib.unified_diff(shown[0], shown[1], "dumped", "restored"))
        thp, nothp = holding(after, *spans["thp"]), holding(after, *spans["nothp"])
        assert thp and all("hg" in v.flags and "nh" not in v.flags for v in thp), thp
        assert nothp and all("nh" in v.flags and "hg" not in v.flags for v in nothp), nothp
        assert sum(v.anon_huge_kb for v in nothp) == 0, nothp
        if threads > 1:
            if thp_mode() == "never":
                pytest.skip("/sys/kernel/mm/transparent_hugepage/enabled is never: no huge page to check")
            assert sum(v.anon_huge_kb for v in thp) > 0, (thp, "no huge page in the MADV_HUGEPAGE region")
    finally:
        end(control, pid)  # a failed assertion or the skip leaves no restored process behind


def test_a_forked_child_s_copy_on_write_memory_comes_back_with_its_huge_pages(tmp_path: Path, criu: str) -> None:
    """A child's private memory shared copy-on-write with its parent is filled in the parent's premapped area
    and moved into the child's: both check every byte, and both have huge pages in the MADV_HUGEPAGE region
    (the move between the two premapped areas is 2 MiB-congruent too)."""
    control, images, pid = captured(tmp_path, criu, fork=True)
    child = int((control / "child").read_text())
    try:
        done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "work"),
                      env={"CRIU_RESTORE_THREADS": "4"})
        assert done.returncode == 0, done.stderr
        for prefix, who in (("", pid), ("child-", child)):
            result = verified(control, prefix)
            assert result["ok"] and result["bad"] == [] and result["pid"] == who, (prefix, result)
        spans = json.loads((control / "regions.json").read_text())
        if thp_mode() == "never":
            pytest.skip("/sys/kernel/mm/transparent_hugepage/enabled is never: no huge page to check")
        for who in (pid, child):
            assert sum(v.anon_huge_kb for v in holding(mappings(who), *spans["thp"])) > 0, who
    finally:
        end(control, pid)
        assert gone_within(child, 10), f"the restored child {child} outlived its parent"


def pages_of_zeros(images: Path) -> tuple[int, int]:
    """Bytes in the pages images and how many of them are 4 KiB pages of zeros."""
    size = zeros = 0
    for path in images.glob("pages-*.img"):
        data = path.read_bytes()
        size += len(data)
        zeros += sum(not any(data[at:at + 4096]) for at in range(0, len(data), 4096))
    return size, zeros


def bare_dump(criu: str, pid: int, images: Path, zero_pages: str,
              threads: str = "") -> subprocess.CompletedProcess[str]:
    """CRIU's own dump of the tree at `pid`, left as it was (running, or stopped if it was); `threads`: its
    CRIU_DUMP_THREADS (empty: unset, the CPUs)."""
    images.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CRIU_DUMP_THREADS"} | {"CRIU_DUMP_ZERO_PAGES": zero_pages}
    return subprocess.run([criu, "dump", "--tree", str(pid), "--images-dir", str(images), "--leave-running", "-v4",
                           "--log-file", "dump.log"], capture_output=True, text=True, check=False, timeout=120,
                          env=env | ({"CRIU_DUMP_THREADS": threads} if threads else {}))


def test_pages_of_zeros_are_not_dumped_and_come_back_as_zeros_in_parent_child_and_lazily(tmp_path: Path,
                                                                                         criu: str) -> None:
    """zero-pages.patch (issue 35): a page of zeros in private anonymous memory is neither written nor read, and
    reads back as zeros where the restore would otherwise show other bytes: a child's page of zeros over data its
    parent keeps (copy-on-write: the child's memory starts as its parent's), a parent's under its child's data,
    pages of zeros in a private file mapping (kept: else the file's bytes would show), with one restore thread
    and lazily (userfaultfd). The dump reads the process without changing it; a bad setting changes nothing."""
    control = tmp_path / "control"
    control.mkdir()
    target = subprocess.Popen([sys.executable, str(ROOT / "bench/criu_target.py"), "--dir", str(control), "--mib",
                               "8", "--zero-mib", "16", "--file-mib", "8", "--shared-mib", "4", "--fork"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    pid, child = int(wait_file(control / "ready")), int(wait_file(control / "child"))
    try:
        refused = bare_dump(criu, pid, tmp_path / "refused", "none")
        assert refused.returncode != 0
        assert "CRIU_DUMP_ZERO_PAGES=none: must be skip or write" in (tmp_path / "refused/dump.log").read_text()
        assert not list((tmp_path / "refused").glob("*.img"))  # refused before anything was seized or written
        for who in (child, pid):  # both dumps see the same memory
            os.kill(who, signal.SIGSTOP)
        for zero_pages in ("skip", "write"):
            done = bare_dump(criu, pid, tmp_path / zero_pages, zero_pages)
            assert done.returncode == 0, (tmp_path / zero_pages / "dump.log").read_text()[-2000:]
        for who in (pid, child):
            os.kill(who, signal.SIGCONT)
        for prefix in ("", "child-"):  # the dumps (the parasite read every page) changed nothing
            assert verified(control, prefix)["ok"], prefix
    except BaseException:
        (control / "exit").touch()
        target.wait()
        raise
    (skipped, kept), (written, zeros) = pages_of_zeros(tmp_path / "skip"), pages_of_zeros(tmp_path / "write")
    # Each process has 2596 pages of zeros in its zero region and 649 over the file's data; the child 270 more
    # over its parent's data and the parent 263 under its child's; Python's own heap has some.
    assert kept == 2 * 649, "the file mapping's private pages of zeros (and only those) are kept"
    assert zeros - kept >= 2 * 2596 + 270 + 263
    assert written - skipped == (zeros - kept) * 4096  # every other page is written as before
    images = tmp_path / "images"
    done = worker("capture", "--pid", str(pid), "--images", str(images), "--boundary", "n580", "--criu", criu)
    assert done.returncode == 0, done.stderr
    target.wait()
    assert gone_within(child, 10)
    for how, env, flags in (("one-thread", {"CRIU_RESTORE_THREADS": "1"}, []), ("lazy", {}, ["--lazy-pages"])):
        for name in ("exit", "result", "child-result"):
            (control / name).unlink(missing_ok=True)
        done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / how),
                      *flags, env=env)
        try:
            assert done.returncode == 0, done.stderr
            if how == "lazy":  # the lazy-pages daemon loads the kernel probe's cache too
                assert "Loaded kdat cache from" in (tmp_path / how / "lazy-pages.log").read_text()
                # A tree CRIU leaves paused: its records are checked while CRIU runs (issue 35 item 2).
                marks = {m["name"]: m["unix_ns"] for m in json.loads(done.stdout)["timeline"]}
                assert marks["criu_restore_begin"] <= marks["validated"]
            for prefix, who in (("", pid), ("child-", child)):
                result = verified(control, prefix)
                assert result["ok"] and result["pid"] == who, (how, prefix, result)
        finally:
            end(control, pid)
            assert gone_within(child, 10), f"the restored child {child} outlived its parent"
    # A record found bad while CRIU restores the paused tree: refused in its phase, the tree killed, never resumed.
    (images / "graph.json").write_text("{")
    for name in ("exit", "result"):
        (control / name).unlink(missing_ok=True)
    (control / "verify").touch()  # a resumed tree would answer it
    done = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(tmp_path / "bad"),
                  "--lazy-pages")
    assert done.returncode == 1 and "error: restore phase validate: " in done.stderr, done.stderr
    assert "graph.json" in done.stderr and gone_within(pid, 10) and gone_within(child, 10)
    assert not (control / "result").exists()


def test_the_worker_runs_a_criu_kept_with_its_libraries_as_its_version_check_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review): `criu --version` ran with CRIU's own library directory but the dump and restore with
    the caller's environment, so the two could load different libraries. Both use `criu_environment` now."""
    from coldsnap_probe._host import criu_identity
    from coldsnap_probe._process import criu_environment, run_criu

    assert CRIU is not None
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    libraries = str(CRIU.parent.parent / "lib" / "x86_64-linux-gnu")
    assert criu_environment(str(CRIU))["LD_LIBRARY_PATH"].split(":")[0] == libraries
    assert criu_identity(str(CRIU))["version_exit_code"] == 0
    assert run_criu(str(CRIU), ["check"], tmp_path / "check.log") > 0  # the binary, not a wrapper, runs

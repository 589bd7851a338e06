"""The CUDA interposer without a GPU: it builds warning-free, loads inert, keeps dlsym's RTLD_NEXT exact, and its
control socket refuses other peers and bad requests; the dump manifest's checks (digest, shorter dump, foreign
files). tests/probe/test_interposer_gpu.py drives the real thing on the H200."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coldsnap_probe._cuda_ipc import refuse_cuda_ipc
from coldsnap_probe._reports import CaptureReport
from coldsnap_probe.errors import HydrationError, WorkerError
from coldsnap_probe.hydration import (
    DeviceDump,
    build_library,
    check_dump,
    dump_identities,
    interposer_socket,
    region_digest,
    verification,
)
from coldsnap_probe.hydration._interposer import DUMP_KIND
from coldsnap_probe.jsonline import request
from coldsnap_probe.memory import MemoryOptions
from coldsnap_probe.memory._device_dump import (
    RECORD,
    DeviceRelease,
    DumpRecord,
    hydrate_devices,
    prefetch_dumps,
    validated_dumps,
)
from tests.probe.interposer_harness import UNITY

MIB = 1 << 20


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, diagnostics = build_library(tmp_path_factory.mktemp("interposer"))
    assert diagnostics == "", f"gcc -Wall -Wextra -Werror is not clean:\n{diagnostics}"
    return path


def test_the_library_builds_warning_free_and_exports_only_driver_names_and_dlsym(library: Path) -> None:
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout.split()
    exported = {s for s in symbols if s[0].isalpha() and len(s) > 2}
    assert "dlsym" in exported and {"cuGetProcAddress", "cuGetProcAddress_v2", "cuMemAlloc_v2",
                                    "cuLaunchKernel_ptsz", "cuMemcpyHtoD_v2_ptds"} <= exported
    assert all(s.startswith("cu") or s == "dlsym" for s in exported if s not in ("T", "W", "B", "D", "V"))


def run_preloaded(library: Path, code: str, env: dict[str, str] | None = None,
                  preload: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "LD_PRELOAD": preload or str(library), **(env or {})})


def has_driver() -> bool:
    """libcuda.so.1 and every entry point the interposer itself calls can be loaded here."""
    return subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libcuda.so.1')"],
                          capture_output=True, check=False).returncode == 0


def test_without_a_socket_it_is_inert_and_a_driver_call_without_libcuda_fails_cleanly(library: Path) -> None:
    code = ("import ctypes, os\n"
            "lib = ctypes.CDLL(None)\n"
            "ptr = ctypes.c_ulonglong()\n"
            "rc = lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(64 << 20))\n"
            "print(rc, ctypes.CDLL('libc.so.6').getpid() == os.getpid())\n")
    done = run_preloaded(library, code)
    assert done.returncode == 0, done.stderr
    rc, lookup = done.stdout.split()
    assert lookup == "True"  # dlsym on a real handle, a name that is not ours: the real answer
    if not has_driver():
        assert rc == "3"  # CUDA_ERROR_NOT_INITIALIZED: no driver to forward to, nothing made up


def test_enabled_it_listens_only_once_something_is_allocated(library: Path, tmp_path: Path) -> None:
    done = run_preloaded(library, "import time; time.sleep(0.2)",
                         {"COLDSNAP_CUDA_INTERPOSER_SOCKET": str(tmp_path / "cuda-%p.sock")})
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_library_preloaded_after_it_still_finds_its_next_definition(library: Path, tmp_path: Path) -> None:
    """dlsym(RTLD_NEXT) is relative to its caller: ours must hand the call on as a tail call, or the library
    after it would find itself and recurse forever."""
    source = tmp_path / "next.c"
    source.write_text("#define _GNU_SOURCE\n#include <dlfcn.h>\n#include <unistd.h>\n"
                      "pid_t getppid(void) { pid_t (*real)(void) = (pid_t (*)(void))dlsym(RTLD_NEXT, \"getppid\");"
                      " return real() + 0; }\n")
    shim = tmp_path / "next.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True)
    done = run_preloaded(library, "import os; print(os.getppid())", preload=f"{library}:{shim}")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == os.getpid()


@pytest.fixture
def engine(library: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    with listening(library) as started:
        yield started


@contextlib.contextmanager
def listening(library: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A process under the interposer that listens from its start (no GPU needed for the socket)."""
    folder = Path(tempfile.mkdtemp(prefix="cs-interposer-", dir="/tmp"))  # others may pass (not list): the
    folder.chmod(0o711)  # socket's own 0600 and the peer check keep them out, test_another_users_peer_is_refused
    env = {**os.environ, "LD_PRELOAD": str(library), "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(folder / "cuda-%p.sock"),
           "COLDSNAP_CUDA_INTERPOSER_LISTEN": "load"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
    path = str(folder / f"cuda-{proc.pid}.sock")
    wait_listening(path)
    try:
        yield proc, path
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_the_cuda_ipc_check_asks_each_process_s_interposer_and_refuses_none_that_holds_no_handle(
        engine: tuple[Any, str], tmp_path: Path) -> None:
    """The capture's check reads the process's socket from its environment and the counts from its `status`
    (a handle needs a GPU: tests/probe/test_split_server.py's refusal); a socket that is not there is not asked."""
    proc, _ = engine
    assert refuse_cuda_ipc([proc.pid], MemoryOptions()) == {"checked": [proc.pid], "unchecked": []}
    absent = MemoryOptions(interposer=str(tmp_path / "absent.sock"))
    assert refuse_cuda_ipc([proc.pid], absent) == {"checked": [], "unchecked": [proc.pid]}


def raw(path: str, payload: bytes, fd: int | None = None) -> dict[str, Any]:
    """One exchange with `payload` as sent (and `fd` riding with it, SCM_RIGHTS), read to EOF."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        if fd is None:
            sock.sendall(payload)
        else:
            socket.send_fds(sock, [payload], [fd])
        sock.shutdown(socket.SHUT_WR)
        return read_answer(sock)


def wait_listening(path: str, limit: float = 20.0) -> None:
    """Until the socket at `path` accepts (the file exists from bind, the socket answers from listen)."""
    give_up = time.monotonic() + limit
    while time.monotonic() < give_up:
        with socket.socket(socket.AF_UNIX) as probe:
            if probe.connect_ex(path) == 0:
                return
        time.sleep(0.01)


def read_answer(sock: socket.socket) -> dict[str, Any]:
    """The answer line, read to EOF (the control socket closes after answering)."""
    data = b""
    while part := sock.recv(65536):
        data += part
    answer: dict[str, Any] = json.loads(data)
    return answer


def test_the_socket_is_0600_and_found_through_the_process_environment(engine: tuple[Any, str]) -> None:
    proc, path = engine
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert interposer_socket(proc.pid) == path
    assert interposer_socket(os.getpid()) is None
    status = request(path, {"op": "status"})
    assert status["ok"] and status["pid"] == proc.pid and status["regions"] == 0 and status["gate"] == "open"
    assert status["released"] is False and set(status["uncovered"]) >= {"below_threshold", "managed", "ipc_imported",
                                                                         "ipc_exported"}
    assert status["wrapped"] == []  # no driver entry point was resolved through it yet
    assert status["driver"] is has_driver()


@pytest.mark.parametrize(("payload", "error"), [
    pytest.param(b"not json\n", "not one JSON object", id="not-json"),
    pytest.param(b'{"op": "status"}', "newline-terminated", id="no-newline"),
    pytest.param(b'{"op": "explode"}\n', "unknown `op`", id="unknown-op"),
    pytest.param(b'{"op": "status", "extra": "1"}\n', "unknown key `extra`", id="unknown-key"),
    pytest.param(b'{"op": 1}\n', "`op` must be a string", id="wrong-type"),
    pytest.param(b'{"op": "status"} trailing\n', "trailing data", id="trailing"),
    pytest.param(b'{"op": "release", "dir": "relative"}\n', "`dir` must be the absolute path", id="relative-dir"),
    pytest.param(b'{"op": "release"}\n', "`dir` must be the absolute path", id="no-dir"),
    pytest.param(b'{"op": "hydrate"}\n', "nothing is released", id="hydrate-before-release"),
    pytest.param(b'{"op": "hydrate", "verify": "fast"}\n', "`verify` must be digest or sampled", id="bad-verify"),
    pytest.param(b'{"op": "hydrate", "policy": "any"}\n', "`policy` must be same-model or same-gpu", id="bad-policy"),
    pytest.param(b'{"op": "hydrate", "dir": "rel"}\n', "`dir` must be an absolute path", id="hydrate-relative"),
    pytest.param(b'{"op": "release", "dir": "/nonexistent/dump"}\n', "dump directory /nonexistent/dump",
                 id="missing-dir"),
    pytest.param(b'{"op": "st\\u00e9"}\n', "printable ASCII", id="non-ascii-escape"),
    pytest.param(b"{" + b'"op": "status", ' * 5000 + b"}\n", "longer than 65536", id="too-long"),
])
def test_bad_requests_are_refused_and_change_nothing(engine: tuple[Any, str], payload: bytes, error: str) -> None:
    _, path = engine
    answer = raw(path, payload)
    assert answer["ok"] is False and error in answer["error"], answer
    status = request(path, {"op": "status"})
    assert status["released"] is False and status["gate"] == "open"


def test_a_dump_directory_others_may_write_is_refused(engine: tuple[Any, str], tmp_path: Path) -> None:
    _, path = engine
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    answer = request(path, {"op": "release", "dir": str(shared)})
    assert not answer["ok"] and "writable by no one else" in answer["error"]


def test_a_digest_kind_the_interposer_does_not_know_refuses_the_release(library: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """COLDSNAP_CUDA_INTERPOSER_DIGEST names the dump's digest; a misspelt one refuses the release before anything
    is written, naming the variable and both kinds, and the gate opens again."""
    monkeypatch.setenv("COLDSNAP_CUDA_INTERPOSER_DIGEST", "md5-64m")
    dump = tmp_path / "dump"
    dump.mkdir(mode=0o700)
    with listening(library) as (_, path):
        answer = request(path, {"op": "release", "dir": str(dump)})
        assert not answer["ok"] and answer["error"] == ("release: COLDSNAP_CUDA_INTERPOSER_DIGEST=md5-64m names no "
                                                        "digest: crc32-64m or sha256-64m"), answer
        assert list(dump.iterdir()) == [] and request(path, {"op": "status"})["gate"] == "open"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to ask as another user")
def test_another_users_peer_is_refused(engine: tuple[Any, str]) -> None:
    _, path = engine
    os.chmod(path, 0o666)  # past the file mode: the SO_PEERCRED check alone must refuse
    code = ("import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(b'{\"op\": \"status\"}\\n')\n"
            "s.shutdown(socket.SHUT_WR); print(s.makefile().read())")
    done = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=30, check=True)
    answer = json.loads(done.stdout)
    assert answer == {"ok": False, "error": "request: peer uid 65534 gid 65534 is not allowed on this socket"}


def test_a_release_of_nothing_leaves_no_record_and_nothing_released(engine: tuple[Any, str],
                                                                    tmp_path: Path) -> None:
    proc, _ = engine
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    release = DeviceRelease(images, [proc.pid, os.getpid()])
    release.release(report := capture_report())  # this process has no interposer: skipped
    assert report.device_memory == release.reports and "device_release" in report.timings_s
    assert [r.state for r in release.reports] == ["empty"]
    assert release.reports[0].uncovered["below_threshold"] == {"count": 0, "bytes": 0}
    assert not (images / RECORD).exists() and list(images.iterdir()) == []
    assert validated_dumps(images) == []


def test_an_explicit_socket_needs_exactly_one_cuda_process(tmp_path: Path) -> None:
    with pytest.raises(WorkerError, match="names one socket, the tree has 2"):
        DeviceRelease(tmp_path, [1, 2], "/run/x.sock").release(capture_report())


def capture_report() -> CaptureReport:
    """An empty capture's report, for a release to fill in."""
    return CaptureReport(boundary="n610", root_pid=os.getpid(), tree=[os.getpid()], rank=0, world_size=1, engine=None)


# -- the manifest (Python side) -------------------------------------------------------------------------------
def dump_in(folder: Path, sizes: tuple[int, ...] = (3 * MIB, 2 * MIB)) -> DeviceDump:
    folder.mkdir(parents=True, exist_ok=True)
    regions, address = [], 0x7F0000000000
    for index, size in enumerate(sizes):
        (folder / f"seg-{index}.bin").write_bytes(os.urandom(size))
        segment = {"file": f"seg-{index}.bin", "offset": 0, "address": address, "size": size,
                   "digest": region_digest(folder / f"seg-{index}.bin", 0, size)}
        regions.append({"address": address, "size": size, "requested": size - 5, "device": 0,
                        "device_uuid": "GPU-00000000-0000-0000-0000-000000000000", "device_name": "NVIDIA H200",
                        "segments": [segment]})
        address += 1 << 30
    answer = {"format": 1, "kind": DUMP_KIND, "pid": 42, "dir": str(folder), "digest_engine": "libcrypto",
              "segment_bytes": 1 << 30, "threshold": 2 * MIB, "bytes": sum(sizes), "regions": regions,
              "uncovered": {"managed": {"count": 0, "bytes": 0}}, "timings_s": {"dump": 0.1}, "gbps": 1.0}
    return DeviceDump.from_json(answer, answered=True)


def test_a_dump_round_trips_and_its_files_check_out(tmp_path: Path) -> None:
    dump = dump_in(tmp_path / "d")
    again = DeviceDump.from_json(json.loads(json.dumps(dump.to_json())))
    assert again == dump and again.manifest_digest.startswith("sha256:")
    check_dump(again, tmp_path / "d", content=True)


def test_a_changed_manifest_is_refused(tmp_path: Path) -> None:
    value = dump_in(tmp_path / "d").to_json()
    value["regions"][0]["address"] += 1 << 21
    value["regions"][0]["segments"][0]["address"] += 1 << 21
    with pytest.raises(HydrationError, match="digest does not recompute"):
        DeviceDump.from_json(value)


@pytest.mark.parametrize(("change", "error"), [
    pytest.param(lambda v: v["regions"][0]["segments"][0].update(file="../etc/passwd"), "must be seg-<n>.bin",
                 id="path-escape"),
    pytest.param(lambda v: v["regions"][0]["segments"][0].update(size=True), "non-negative integer", id="bool-size"),
    pytest.param(lambda v: v["regions"][0]["segments"][0].update(address=1), "starts at 0x1", id="gap"),
    pytest.param(lambda v: v["regions"][0].update(size=v["regions"][0]["size"] * 2), "cover", id="short-cover"),
    pytest.param(lambda v: v["regions"][1]["segments"][0].update(file="seg-0.bin"), "same file", id="same-file"),
    pytest.param(lambda v: v["regions"][0]["segments"][0].update(digest="md5:00"), "digest must be", id="digest"),
    pytest.param(lambda v: v.update(kind="other"), "not a format-1", id="kind"),
    pytest.param(lambda v: v["regions"][0].update(extra=1), "has exactly", id="extra-key"),
])
def test_malformed_manifests_are_refused_naming_the_rule(tmp_path: Path, change: Any, error: str) -> None:
    value = dump_in(tmp_path / "d").body()
    change(value)
    with pytest.raises(HydrationError, match=error):
        DeviceDump.from_json(value, answered=True)


def test_a_shorter_dump_is_refused_naming_the_file(tmp_path: Path) -> None:
    dump = dump_in(tmp_path / "d")
    os.truncate(tmp_path / "d" / "seg-1.bin", MIB)
    with pytest.raises(HydrationError, match=r"seg-1\.bin \(region 0x7f0040000000\) holds 1048576 bytes, its "
                                             "manifest says 2097152: the dump is shorter"):
        check_dump(dump, tmp_path / "d")


def test_a_corrupt_or_foreign_dump_is_refused_by_its_digest(tmp_path: Path) -> None:
    dump = dump_in(tmp_path / "d")
    with open(tmp_path / "d" / "seg-0.bin", "r+b") as f:
        f.seek(MIB)
        f.write(b"\xff")
    check_dump(dump, tmp_path / "d")  # the sizes alone still pass
    with pytest.raises(HydrationError, match=r"seg-0\.bin .* does not match its digest.*corrupt or foreign"):
        check_dump(dump, tmp_path / "d", content=True)


def test_a_restore_refuses_images_whose_device_dump_is_short_before_anything_runs(tmp_path: Path) -> None:
    images = tmp_path / "images"
    dump = dump_in(images / "device-42")
    record = {"format": 1, "kind": "coldsnap-device-memory", "processes": [
        {"pid": 42, "socket": "/run/cuda-42.sock", "directory": "device-42", "manifest": dump.to_json()}]}
    (images / RECORD).write_text(json.dumps(record))
    assert [r.pid for r in validated_dumps(images)] == [42]
    os.truncate(images / "device-42" / "seg-0.bin", 10)
    with pytest.raises(WorkerError, match=r"device-memory\.json: .*seg-0\.bin .* the dump is shorter"):
        validated_dumps(images)
    record["processes"][0]["directory"] = "../elsewhere"
    (images / RECORD).write_text(json.dumps(record))
    with pytest.raises(WorkerError, match="dump directory must be device-42"):
        validated_dumps(images)


def test_only_the_files_the_release_wrote_skip_the_full_digest(tmp_path: Path) -> None:
    """The weights' rule: same device, inode, size, mtime and ctime (a write changes ctime, which no one can
    set back) -> the sampled read-back suffices; anything else -> every byte is digested while filled."""
    dump = dump_in(tmp_path / "d")
    recorded = dump_identities(dump, tmp_path / "d")
    assert verification(dump, tmp_path / "d", recorded) == "sampled"
    assert verification(dump, tmp_path / "d", {}) == "digest"  # a record without identities
    stat = os.stat(tmp_path / "d" / "seg-1.bin")
    with open(tmp_path / "d" / "seg-1.bin", "r+b") as f:
        f.write(b"\0")
    os.utime(tmp_path / "d" / "seg-1.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # mtime put back, not ctime
    assert verification(dump, tmp_path / "d", recorded) == "digest"
    shutil.copytree(tmp_path / "d", tmp_path / "copy")  # the images moved: other inodes
    assert verification(dump, tmp_path / "copy", recorded) == "digest"
    os.unlink(tmp_path / "copy" / "seg-0.bin")
    assert verification(dump, tmp_path / "copy", recorded) == "digest"


def test_a_relative_images_directory_reaches_the_engine_as_an_absolute_one(engine: tuple[Any, str], tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    proc, _ = engine
    monkeypatch.chdir(tmp_path)
    Path("images").mkdir(mode=0o700)
    release = DeviceRelease(Path("images"), [proc.pid])
    release.release(capture_report())  # the engine would refuse a relative `dir`
    assert [r.state for r in release.reports] == ["empty"]


def test_a_hydration_the_engines_refuse_fails_the_restore_naming_each_process(library: Path, tmp_path: Path) -> None:
    """Two processes of one tree are asked at once; a refusal (here: nothing was released) is the restore's error."""
    dump = dump_in(tmp_path / "images" / "device-42")
    with listening(library) as (first, first_socket), listening(library) as (_, second_socket):
        records = [DumpRecord(first.pid, first_socket, "device-42", dump, {}),
                   DumpRecord(first.pid + 1, second_socket, "device-42", dump, {})]
        prefetch_dumps(records, tmp_path / "images")  # reading ahead changes nothing
        with pytest.raises(WorkerError, match=rf"hydration failed, the restored process is not released: hydrate the "
                                              rf"device memory of process {first.pid} .*nothing is released"):
            hydrate_devices(records, tmp_path / "images", "same-model")
        assert request(first_socket, {"op": "status"})["gate"] == "open"


@pytest.mark.parametrize(("payload", "error"), [
    pytest.param(b'{"op": "status"}\n', "only a hydrate request may carry descriptors", id="status-with-fd"),
    pytest.param(b'{"op": "hydrate"}\n', "come with their count (`allocations`, decimal)", id="no-count"),
    pytest.param(b'{"op": "hydrate", "allocations": "12x"}\n', "`allocations` must count", id="bad-count"),
    pytest.param(b'{"op": "hydrate", "allocations": "0"}\n', "`allocations` must count", id="zero-count"),
    pytest.param(b'{"op": "hydrate", "allocations": "+1"}\n', "`allocations` must count", id="signed-count"),
    pytest.param(b'{"op": "hydrate", "allocations": "99999999999999999999999"}\n', "`allocations` must count",
                 id="huge-count"),
    pytest.param(b'{"op": "hydrate", "allocations": "1"}\n', "nothing is released", id="nothing-released"),
])
def test_a_descriptor_rides_only_with_a_staged_hydration_and_is_never_kept(engine: tuple[Any, str], payload: bytes,
                                                                           error: str, tmp_path: Path) -> None:
    proc, path = engine
    marker = tmp_path / "passed-descriptor"
    marker.write_bytes(b"")
    with open(marker, "rb") as held:
        answer = raw(path, payload, held.fileno())
    assert answer["ok"] is False and error in answer["error"], answer
    held_there = []
    for fd in os.listdir(f"/proc/{proc.pid}/fd"):
        with contextlib.suppress(OSError):
            held_there.append(os.readlink(f"/proc/{proc.pid}/fd/{fd}"))
    assert str(marker) not in held_there  # the received descriptor was closed


def test_a_stage_is_asked_only_for_the_captures_own_files_and_fails_softly(tmp_path: Path) -> None:
    """stages_for: a hydrator named and the files unchanged; an unreachable hydrator leaves the regular path."""
    from coldsnap_probe.memory._device_dump import stages_for

    images = tmp_path / "images"
    dump = dump_in(images / "device-42")
    files = dump_identities(dump, images / "device-42")
    records = [DumpRecord(42, "/run/cuda-42.sock", "device-42", dump, files, str(tmp_path / "absent.sock")),
               DumpRecord(43, "/run/cuda-43.sock", "device-42", dump, files, ""),  # no hydrator named
               DumpRecord(44, "/run/cuda-44.sock", "device-42", dump, {}, str(tmp_path / "absent.sock"))]
    stages = stages_for(records, images)
    assert list(stages) == [42]  # 44's files are not provably the capture's: no stage
    assert stages[42].adopt(timeout=10) is None
    assert stages[42].report["staged"] is False and "absent.sock" in stages[42].report["error"]
    stages[42].discard()  # nothing staged: nothing sent, nothing raised


def test_a_socket_another_process_listens_on_is_not_asked_to_release(engine: tuple[Any, str],
                                                                      tmp_path: Path) -> None:
    """One socket path without %p in a tree: the process that took it is the only one released through it."""
    _, path = engine
    images = tmp_path / "images"
    images.mkdir(mode=0o700)
    release = DeviceRelease(images, [os.getpid()], path)
    release.release(capture_report())  # named explicitly, but the socket answers for another pid
    assert [(r.state, r.pid) for r in release.reports] == [("not-started", os.getpid())]
    assert request(path, {"op": "status"})["released"] is False and list(images.iterdir()) == []


HARNESS = UNITY + r"""

/* The manifest writer with two regions (no driver involved): one of 3 GiB (three segments), one of 2 MiB; crc32-64m
 * digests, chunks 0 and 2 of the second segment zeros. */
int main(void)
{
    struct cscu_region r = {0};
    size_t count, bytes = 0;
    double seconds[9] = {0, 0.25, 0.5, 0.125, 4.0, 2.0, 1.0, 0.0625, 0.5};
    unsigned char chunks[CSCU_SEGMENT_CHUNKS][32] = {{0}};
    static char out[1 << 20];
    struct answer a = {out, sizeof(out), 0};
    r.address = 0x7f0000000000ULL;
    r.size = (size_t)3 << 30;
    r.requested = r.size - 5;
    strcpy(r.uuid, "GPU-01234567-89ab-cdef-0123-456789abcdef");
    strcpy(r.name, "NVIDIA \"H200\" \\ test");
    append(&r);
    r.address += (size_t)4 << 30;
    r.size = r.requested = (size_t)2 << 20;
    append(&r);
    struct cscu_region *regions = cscu_regions(&count);
    plan_segments(regions, count, CSCU_KIND_CRC32);
    for (size_t i = 0; i < cscu_segment_count; i++) {
        chunks[0][3] = (unsigned char)i;
        cscu_digest_text(CSCU_KIND_CRC32, (const unsigned char (*)[32])chunks,
                         (cscu_segments[i].size + CSCU_DIGEST_CHUNK - 1) / CSCU_DIGEST_CHUNK, cscu_segments[i].digest);
        bytes += cscu_segments[i].size;
    }
    cscu_segments[1].zero = 5;
    manifest(&a, "/dump/\"dir\"", seconds, bytes, CSCU_KIND_CRC32);
    puts(out);
    return 0;
}
"""


def test_the_manifest_the_library_writes_is_the_one_the_worker_reads(tmp_path: Path) -> None:
    """The C writer (compiled with a harness that only fills the region table: no driver is involved) and
    DeviceDump.from_json agree on every key, type and escape."""
    from coldsnap_probe.hydration._interposer import SOURCES

    (tmp_path / "harness.c").write_text(HARNESS)
    subprocess.run(["gcc", "-O1", "-std=gnu11", "-I", str(SOURCES), "-o", str(tmp_path / "harness"),
                    str(tmp_path / "harness.c"), "-ldl", "-lpthread"], check=True, capture_output=True)
    answer = json.loads(subprocess.run([str(tmp_path / "harness")], capture_output=True, text=True,
                                       check=True).stdout)
    assert answer["ok"] is True
    dump = DeviceDump.from_json(answer["manifest"], answered=True)
    assert dump.dir == '/dump/"dir"' and dump.bytes == (3 << 30) + (2 << 20)
    assert [(r.address, r.size, len(r.segments)) for r in dump.regions] == [
        (0x7F0000000000, 3 << 30, 3), (0x7F0100000000, 2 << 20, 1)]
    assert dump.regions[0].device_name == 'NVIDIA "H200" \\ test'
    assert [s.file for s in dump.segments] == ["seg-0.bin", "seg-1.bin", "seg-2.bin", "seg-3.bin"]
    assert dump.segments[1].address == 0x7F0000000000 + (1 << 30) and dump.timings_s["dump"] == 0.5
    assert set(dump.uncovered) >= {"below_threshold", "managed", "stream_ordered", "ipc_imported"}
    assert dump.segments[1].digest == "crc32-64m:00000001" + "00000000" * 15
    assert dump.segments[3].digest == "crc32-64m:00000003" and dump.digest_engine in {"vpclmul", "pclmul", "tables"}
    assert [s.zero for s in dump.segments] == [0, 5, 0, 0] and dump.timings_s["dump_zero_thread_s"] == 0.0625
    assert dump.timings_s["dump_setup_thread_s"] == 0.5  # the threads' streams and staging buffers
    assert "zero" not in dump.to_json()["regions"][0]["segments"][0]  # absent unless a chunk is all zeros


GATE_HARNESS = UNITY + r"""

static volatile int released_now, stop, violations, calls, nested_inside, nested_done;

/* An engine thread: every gated call must find the memory mapped. */
static void *engine(void *unused)
{
    (void)unused;
    while (!stop) {
        cscu_gate_enter();
        if (released_now)
            __atomic_add_fetch(&violations, 1, __ATOMIC_SEQ_CST);
        __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST);
        cscu_gate_leave();
    }
    return NULL;
}

/* A call that makes another gated call from inside itself while a release is closing the gate. */
static void *nesting(void *unused)
{
    (void)unused;
    cscu_gate_enter();
    nested_inside = 1;
    usleep(100000);  /* the release starts closing meanwhile and waits for this call */
    cscu_gate_enter();
    cscu_gate_leave();
    nested_done = 1;
    cscu_gate_leave();
    return NULL;
}

int main(void)
{
    pthread_t threads[4], nested;
    for (int i = 0; i < 4; i++)
        pthread_create(&threads[i], NULL, engine, NULL);
    for (int round = 0; round < 200; round++) {  /* release, hold, hydrate */
        cscu_gate_close();
        released_now = 1;
        usleep(200);
        released_now = 0;
        cscu_gate_open();
        usleep(200);
    }
    stop = 1;
    for (int i = 0; i < 4; i++)
        pthread_join(threads[i], NULL);
    pthread_create(&nested, NULL, nesting, NULL);
    while (!nested_inside)  /* inside its outer call before the release starts (a loaded machine starts it late) */
        usleep(1000);
    cscu_gate_close();  /* returns only once the nesting call has left: it must not wait on itself */
    int done = nested_done;
    cscu_gate_open();
    pthread_join(nested, NULL);
    printf("%d %d %d\n", violations, calls, done);
    return 0;
}
"""


def test_the_gate_lets_no_call_run_while_released_and_never_waits_on_itself(tmp_path: Path) -> None:
    """The readiness gate with real threads (no driver): 200 release/hydrate rounds against four calling threads,
    and a release that starts while a call is inside a nested one."""
    from coldsnap_probe.hydration._interposer import SOURCES

    (tmp_path / "gate.c").write_text(GATE_HARNESS)
    subprocess.run(["gcc", "-O2", "-std=gnu11", "-I", str(SOURCES), "-o", str(tmp_path / "gate"),
                    str(tmp_path / "gate.c"), "-ldl", "-lpthread"], check=True, capture_output=True)
    done = subprocess.run([str(tmp_path / "gate")], capture_output=True, text=True, check=True, timeout=60,
                          env={**os.environ, "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(tmp_path / "unused.sock")})
    violations, calls, nested = map(int, done.stdout.split())
    assert violations == 0 and calls > 0 and nested == 1


def test_reading_ahead_never_blocks_on_a_fifo_nor_follows_a_link_the_engine_left(tmp_path: Path) -> None:
    """Regression (review): the root restore worker reads dump files the engine's uid wrote; a FIFO swapped in for a
    segment used to block the restore in open(), a link was followed."""
    images = tmp_path / "images"
    dump = dump_in(images / "device-42")
    segment = images / "device-42" / dump.segments[0].file
    segment.unlink()
    os.mkfifo(segment)
    records = [DumpRecord(42, "/run/cuda-42.sock", "device-42", dump, {})]
    done = threading.Event()
    worker = threading.Thread(target=lambda: (prefetch_dumps(records, images), done.set()), daemon=True)
    worker.start()
    assert done.wait(10), "prefetch_dumps blocked on a FIFO"
    segment.unlink()
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * 4096)
    segment.symlink_to(secret)
    prefetch_dumps(records, images)  # refused quietly (O_NOFOLLOW): nothing to assert but that it returns

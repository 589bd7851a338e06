"""The CUDA interposer's Python side: the library (built from `interposer/*.c` beside this module with gcc, as
strictly as nccl_shim: -Wall -Wextra -Werror), its control socket (found in a process's environment), and the
device dump's manifest.

An engine started with ``LD_PRELOAD=libcoldsnap_cuda.so`` and ``COLDSNAP_CUDA_INTERPOSER_SOCKET=PATH`` (``%p``
becomes its pid) gets every device allocation of at least the threshold as an exportable VMM allocation. The
capture worker asks it to `release` (dump every region into a directory, then unmap, the addresses kept) before
the CUDA lock; the restore worker asks it to `hydrate` (map, fill, verify, open the gate) after the CUDA restore.
`DeviceDump` is what a release answered: each region's address, size and GPU, each segment's file, digest per
64 MiB chunk (`crc32-64m` by default, `_weights.crc_digest`; `sha256-64m`, the weights' `region_digest`, when
ENV_DIGEST asks for a content address) and chunks of zeros, and what stayed on the CUDA checkpoint path.
docs/interposer.md says what is covered and how each failure is reported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .. import jsonline
from ..canonical import digest
from ..errors import ChannelError, HydrationError
from ._digests import CRC_PREFIX, DIGEST_CHUNK, DIGEST_PREFIX, digest_like, is_dump_digest

__all__ = ("DUMP_KIND", "ENGINE_DEFAULTS", "ENV_HYDRATOR", "ENV_LIBRARY", "ENV_SOCKET", "LIBRARY", "POLICIES",
           "SOURCES", "DeviceDump", "DumpRegion", "DumpSegment", "build_library", "check_dump", "dump_identities",
           "interposer_request", "interposer_socket", "library_path", "library_sources", "remove_dump", "store_made",
           "verification")

ENV_SOCKET = "COLDSNAP_CUDA_INTERPOSER_SOCKET"
ENV_HYDRATOR = "COLDSNAP_CUDA_INTERPOSER_HYDRATOR"  # a node hydrator that fills the regions while CRIU restores
ENV_LIBRARY = "COLDSNAP_CUDA_INTERPOSER_LIBRARY"  # a built library to use instead of building one
# What a unit under the interposer runs with besides the two variables above (docs/interposer.md, "JAX and XLA"):
# XLA's pool grows with what the engine uses rather than preallocating 75 % of the GPU (112.6 GB on an H200), which
# a capture would have to move whole. Engines without XLA ignore it.
ENGINE_DEFAULTS: Mapping[str, str] = MappingProxyType({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
ENV_DIGEST = "COLDSNAP_CUDA_INTERPOSER_DIGEST"  # the engine's: crc32-64m (default) or sha256-64m
LIBRARY = "libcoldsnap_cuda.so"
CAPSULE_LIBRARY = Path("/opt/coldsnap/lib") / LIBRARY  # where _capsule_rootfs.py bakes it
SOURCES = Path(__file__).resolve().parent / "interposer"
DUMP_KIND = "coldsnap-device-dump"
POLICIES = ("same-model", "same-gpu")
GCC_FLAGS = ("-shared", "-fPIC", "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden")
_SEGMENT_FILE = re.compile(r"seg-[0-9]{1,9}\.bin")
# The node's capture store lists the files it made where a workload sees them (coldsnap_runtime's
# MADE_FILES_TARGET; docs/capture-store.md, "Restores staged"): the two packages share no code.
STORE_FILES = "/run/coldsnap-capture-store/files.json"
STORE_FILES_KIND = "coldsnap-capture-store-files"
_MADE_MAX = 16 << 20  # a listing's bytes read at most (a capture of 100,000 files lists about 6 MB)


def library_sources() -> list[Path]:
    """The C files the library is built from: every `interposer/*.c`, in one order."""
    return sorted(SOURCES.glob("*.c"))


def build_library(out: Path, *, compiler: str = "gcc") -> tuple[Path, str]:
    """Build the interposer into `out` (a directory): its path and the compiler's diagnostics (empty when clean).

    The real driver is found at run time (dlopen "libcuda.so.1"), so nothing CUDA is needed to build it."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / LIBRARY
    sources = [str(p) for p in library_sources()]
    import tempfile  # here: building is no part of a restore's path to CRIU (issue 35 item 2)

    with tempfile.TemporaryDirectory(dir=out) as scratch:  # built aside, renamed in: never a half-written library
        partial = Path(scratch) / LIBRARY
        try:
            done = subprocess.run([compiler, *GCC_FLAGS, "-o", str(partial), *sources, "-ldl", "-lpthread"],
                                  capture_output=True, text=True, check=False)
        except OSError as exc:
            raise HydrationError(f"cannot build {LIBRARY}: {compiler}: {exc.strerror}") from exc
        if done.returncode != 0:
            raise HydrationError(f"cannot build {LIBRARY}: {compiler} exited {done.returncode}: "
                                 f"{done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    return target, done.stderr.strip()


def library_path(cache: Path | None = None) -> Path:
    """The library to preload: $COLDSNAP_CUDA_INTERPOSER_LIBRARY, the capsule's, or one built from these
    sources into `cache` (default ~/.cache/coldsnap), named by the sources' digest so a change rebuilds it."""
    if given := os.environ.get(ENV_LIBRARY):
        if not Path(given).is_file():
            raise HydrationError(f"{ENV_LIBRARY}={given} is not a file")
        return Path(given)
    if CAPSULE_LIBRARY.is_file():
        return CAPSULE_LIBRARY
    import hashlib  # here: OpenSSL's load (3-4 ms) is off a restore's path to CRIU (issue 35 item 2)

    sources = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCES.glob("*.[ch]")))).hexdigest()[:16]
    folder = (cache or Path.home() / ".cache" / "coldsnap") / f"interposer-{sources}"
    if not (folder / LIBRARY).is_file():
        build_library(folder)
    return folder / LIBRARY


def interposer_socket(pid: int, name: str = ENV_SOCKET) -> str | None:
    """The control socket a process was started with (its environment's COLDSNAP_CUDA_INTERPOSER_SOCKET, ``%p``
    replaced by its pid), or None when the interposer is not enabled there; with `name` ENV_HYDRATOR, the node
    hydrator it names."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for entry in environ.split(b"\0"):
        if entry.startswith(name.encode() + b"="):
            value = entry.split(b"=", 1)[1].decode(errors="replace")
            return value.replace("%p", str(pid)) if value.startswith("/") else None
    return None


def interposer_request(socket: str, message: dict[str, Any], what: str, *, timeout: float = 600.0) -> dict[str, Any]:
    """One request to an interposer's control socket; its answer, or HydrationError naming `what` and the socket."""
    try:
        answer = jsonline.request(socket, message, timeout=timeout)
    except ChannelError as exc:
        raise HydrationError(f"{what}: {exc}") from exc
    if not answer.get("ok"):
        raise HydrationError(f"{what} ({socket}): {answer.get('error')}")
    return answer


def _integer(value: Any, name: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HydrationError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def _text(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str):
        raise HydrationError(f"{where}: {name} must be a string, got {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class DumpSegment:
    """`size` bytes of a region at `address`, stored at `offset` of `file` in the dump directory; `zero`: a mask
    of its 64 MiB chunks that are all zeros (never written: the file's holes; the hydration sets them on the
    device), absent from manifests without any."""

    file: str
    offset: int
    address: int
    size: int
    digest: str
    zero: int = 0

    @classmethod
    def from_json(cls, value: Any, where: str) -> DumpSegment:
        keys = {"file", "offset", "address", "size", "digest"}
        if not isinstance(value, dict) or not keys <= set(value) <= keys | {"zero"}:
            raise HydrationError(f"{where}: a segment has exactly file, offset, address, size, digest and "
                                 "optionally zero")
        segment = cls(file=_text(value["file"], "file", where), offset=_integer(value["offset"], "offset", where),
                      address=_integer(value["address"], "address", where),
                      size=_integer(value["size"], "size", where), digest=_text(value["digest"], "digest", where),
                      zero=_integer(value.get("zero", 0), "zero", where))
        if not _SEGMENT_FILE.fullmatch(segment.file):
            raise HydrationError(f"{where}: file {segment.file!r} must be seg-<n>.bin (a name in the dump directory)")
        if segment.size == 0:
            raise HydrationError(f"{where}: a segment is not empty")
        if not is_dump_digest(segment.digest, segment.size):
            raise HydrationError(f"{where}: digest must be {DIGEST_PREFIX}<64 hex digits> or {CRC_PREFIX}<8 hex "
                                 "digits per 64 MiB chunk>")
        if segment.zero >> -(-segment.size // DIGEST_CHUNK):
            raise HydrationError(f"{where}: zero {segment.zero:#x} marks chunks beyond the segment's "
                                 f"{-(-segment.size // DIGEST_CHUNK)}")
        return segment

    def data_runs(self) -> list[tuple[int, int]]:
        """(file offset, bytes) of each run of its chunks not marked zero, in order: what a restore reads of the
        file (a chunk of zeros is set on the device, never read)."""
        runs: list[tuple[int, int]] = []
        for start in range(0, self.size, DIGEST_CHUNK):
            n = min(DIGEST_CHUNK, self.size - start)
            if self.zero >> (start // DIGEST_CHUNK) & 1:
                continue
            if runs and runs[-1][0] + runs[-1][1] == self.offset + start:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((self.offset + start, n))
        return runs

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        if not self.zero:
            del body["zero"]  # a manifest without zero chunks keeps the text (and digest) it had before them
        return body


@dataclass(frozen=True, slots=True)
class DumpRegion:
    """One device allocation the interposer made: its reserved range and GPU, and its segments in order."""

    address: int
    size: int
    requested: int
    device: int
    device_uuid: str
    device_name: str
    segments: tuple[DumpSegment, ...]

    @classmethod
    def from_json(cls, value: Any) -> DumpRegion:
        keys = {"address", "size", "requested", "device", "device_uuid", "device_name", "segments"}
        if not isinstance(value, dict) or set(value) != keys:
            raise HydrationError(f"a dump region has exactly {', '.join(sorted(keys))}")
        where = f"region {value['address']:#x}" if isinstance(value["address"], int) else "region"
        if not isinstance(value["segments"], list):
            raise HydrationError(f"{where}: segments must be a list")
        region = cls(address=_integer(value["address"], "address", where), size=_integer(value["size"], "size", where),
                     requested=_integer(value["requested"], "requested", where),
                     device=_integer(value["device"], "device", where),
                     device_uuid=_text(value["device_uuid"], "device_uuid", where),
                     device_name=_text(value["device_name"], "device_name", where),
                     segments=tuple(DumpSegment.from_json(s, where) for s in value["segments"]))
        at = region.address
        for segment in region.segments:  # in order, back to back, covering the region exactly
            if segment.address != at:
                raise HydrationError(f"{where}: segment {segment.file} starts at {segment.address:#x}, expected "
                                     f"{at:#x}")
            at += segment.size
        if at != region.address + region.size or region.requested > region.size:
            raise HydrationError(f"{where}: the segments cover {at - region.address} of {region.size} bytes")
        return region

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"segments": [s.to_json() for s in self.segments]}


@dataclass(frozen=True, slots=True)
class DeviceDump:
    """A release's manifest: the regions (dumped, then unmapped), what they came from (`moved`: per source, count
    and bytes; absent from manifests written before it was), what stayed on the CUDA checkpoint path (`uncovered`:
    per kind, count and bytes), the timings; `manifest_digest` covers all of it."""

    pid: int
    dir: str
    digest_engine: str
    segment_bytes: int
    threshold: int
    bytes: int
    regions: tuple[DumpRegion, ...]
    uncovered: dict[str, dict[str, int]]
    timings_s: dict[str, float]
    gbps: float
    manifest_digest: str = ""
    moved: dict[str, dict[str, int]] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"format": 1, "kind": DUMP_KIND, "pid": self.pid, "dir": self.dir, "digest_engine": self.digest_engine,
                "segment_bytes": self.segment_bytes, "threshold": self.threshold, "bytes": self.bytes,
                "regions": [r.to_json() for r in self.regions], "uncovered": self.uncovered,
                "timings_s": self.timings_s, "gbps": self.gbps} | ({"moved": self.moved} if self.moved else {})

    def to_json(self) -> dict[str, Any]:
        return {**self.body(), "manifest_digest": self.manifest_digest}

    @property
    def segments(self) -> tuple[DumpSegment, ...]:
        return tuple(s for r in self.regions for s in r.segments)

    @classmethod
    def from_json(cls, value: Any, *, answered: bool = False) -> DeviceDump:
        """Decode and check every field; `answered`: the interposer's own answer (no digest yet: it gets one)."""
        if not isinstance(value, dict) or value.get("kind") != DUMP_KIND or value.get("format") != 1:
            raise HydrationError(f"not a format-1 {DUMP_KIND}")
        try:
            regions = value["regions"]
            if not isinstance(regions, list) or not isinstance(value["uncovered"], dict):
                raise HydrationError("regions must be a list and uncovered an object")
            if not isinstance(moved := value.get("moved", {}), dict):
                raise HydrationError("moved must be an object")
            dump = cls(pid=_integer(value["pid"], "pid", "dump"), dir=_text(value["dir"], "dir", "dump"),
                       digest_engine=_text(value["digest_engine"], "digest_engine", "dump"),
                       segment_bytes=_integer(value["segment_bytes"], "segment_bytes", "dump"),
                       threshold=_integer(value["threshold"], "threshold", "dump"),
                       bytes=_integer(value["bytes"], "bytes", "dump"),
                       regions=tuple(DumpRegion.from_json(r) for r in regions), uncovered=dict(value["uncovered"]),
                       timings_s=dict(value["timings_s"]), gbps=float(value["gbps"]), moved=dict(moved),
                       manifest_digest="" if answered else str(value["manifest_digest"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise HydrationError(f"malformed device dump manifest: {type(exc).__name__}: {exc}") from exc
        if dump.bytes != (held := sum(r.size for r in dump.regions)):
            raise HydrationError(f"the dump says {dump.bytes} bytes, its regions hold {held}")
        if len({s.file for s in dump.segments}) != len(dump.segments):
            raise HydrationError("two segments name the same file")
        recomputed = digest(dump.body())
        if answered:
            return replace(dump, manifest_digest=recomputed)
        if dump.manifest_digest != recomputed:
            raise HydrationError("the device dump manifest's digest does not recompute (changed since capture)")
        return dump


def check_dump(dump: DeviceDump, directory: Path, *, content: bool = False) -> None:
    """Every segment's file is a regular file holding its bytes; with `content`, matching its digest too.
    HydrationError names the file and the region at fault (nothing is changed)."""
    for region in dump.regions:
        for segment in region.segments:
            path = directory / segment.file
            where = f"dump file {path} (region {region.address:#x})"
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError as exc:
                raise HydrationError(f"{where}: {exc.strerror}") from exc
            if not os.path.isfile(path) or os.path.islink(path):
                raise HydrationError(f"{where} is not a regular file")
            if st.st_size < segment.offset + segment.size:
                raise HydrationError(f"{where} holds {st.st_size} bytes, its manifest says "
                                     f"{segment.offset + segment.size}: the dump is shorter than its manifest")
            if content and (found := digest_like(segment.digest, path, segment.offset, segment.size)) != segment.digest:
                raise HydrationError(f"{where} does not match its digest: expected {segment.digest}, found {found}: "
                                     "a corrupt or foreign dump")


def dump_identities(dump: DeviceDump, directory: Path) -> dict[str, list[int]]:
    """What a write, truncation or replacement of each dump file changes (device, inode, size, mtime, ctime),
    recorded right after the release wrote them."""
    identities = {}
    for segment in dump.segments:
        st = os.stat(directory / segment.file, follow_symlinks=False)
        identities[segment.file] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return identities


def store_made(path: str = STORE_FILES) -> frozenset[tuple[int, ...]]:
    """The identities of the files the node's capture store made from chunks it checked against their SHA-256
    (`path`: its listing, which the daemon mounts read-only into a workload that sees those files); empty without
    one, or one that does not parse (then the release's identities alone decide)."""
    try:
        with open(path, "rb") as listing:
            document = json.loads(listing.read(_MADE_MAX))
        if document.get("kind") != STORE_FILES_KIND:
            return frozenset()
        return frozenset(tuple(int(n) for n in identity) for identity in document["files"] if len(identity) == 5)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return frozenset()


def verification(dump: DeviceDump, directory: Path, recorded: dict[str, list[int]],
                 made: frozenset[tuple[int, ...]] = frozenset()) -> str:
    """`sampled` when every dump file is provably the one the release wrote (the weights' rule, `check_sources`:
    same identity, and a write changes ctime, which no one can set back) or one the node's capture store made
    from the capture's checked chunks and listed (`made`, a restore's `store_made()`: the same rule, the store
    being the writer: a pulled capture's files are other inodes than the release's), else `digest`: every byte
    is digested while it is filled."""
    try:
        now = dump_identities(dump, directory)
    except OSError:
        return "digest"  # the hydration names the missing file
    if recorded and now == recorded:
        return "sampled"
    return "sampled" if now and all(tuple(identity) in made for identity in now.values()) else "digest"


def remove_dump(directory: Path) -> None:
    """Delete a dump directory the capture made (a failed capture leaves nothing behind)."""
    shutil.rmtree(directory, ignore_errors=True)

"""The node's capture store: capture data as content-addressed 64 MiB chunks (DESIGN decision 16).

::

    <root>/blobs/sha256/<hex>      one chunk (at most 64 MiB), named by the SHA-256 of its bytes; also
                                   each capture's data document (the OCI config of its registry artifact)
    <root>/captures/<hex>.json     a capture: the OCI manifest (artifact) whose digest is sha256:<hex>;
                                   written last, so a capture listed is one whose every blob is present
    <root>/trees/<hex>/<path>      the capture's files as plain (sparse) files, made at a pull or on first use
    <root>/partial/<hex>/<path>    the files of a pull not finished yet (:mod:`.store_pull`): resumed by its next pull
    <root>/tmp/                    what is being written (a blob before its digest is checked, a tree)

A file is a list of chunks, each a digest or ``None`` for a chunk of zeros: zeros are never stored, moved
or read, and come back as holes. Chunks are 64 MiB from the file's start (a device dump's segment files: the
same weights, the same chunks), or cut by content for files whose bytes shift between captures (CRIU's page
images, :mod:`.chunking`); such a file lists each chunk's length (data document format 2). The same bytes
are one copy on the node, whichever captures hold them: a chunk's *home* is its blob, or the files made for a listed
capture that holds it (a pull writes each fetched chunk once, straight into its place in the capture's files; a
blob of it is written only when those files are dropped while another capture or a write in flight still needs it,
:meth:`CaptureStore.drop_tree`). Every name appears only after its bytes are fsynced under a temporary name
(rename), so a disk that fills up, or a process that dies, leaves nothing half-listed; a chunk is checked against
its name before it counts, so every home holds verified bytes, and an interrupted pull resumes from its partial
files (each chunk there checked again, never fetched again).

The store does blocking I/O: the backend calls it from worker threads. Which captures are in use is the
caller's knowledge (the engine's containers): :meth:`CaptureStore.collect` is given the set it must keep. What a
write in flight (a build's ingest, a pull) has stored but not yet recorded is the store's: such a write holds its
blobs (:meth:`CaptureStore.holding`), and neither removal nor collection deletes a held blob; a blob no capture
names and no write holds (an interrupted pull's, a failed build's) is collected.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import shutil
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO

import msgspec

from .capture_data import (
    CAPTURE_MEDIA_TYPE,
    CHUNK_MEDIA_TYPE,
    DATA_MEDIA_TYPE,
    HEX,
    OCI_MANIFEST,
    CaptureData,
    StoredFile,
    artifact_manifest,
    digest_name,
)
from .chunking import CHUNK_BYTES, ZERO_RUN_BYTES, content_cuts
from .errors import StoreError
from .store_base import Hold, StoreBase, disk_bytes, fsync_directory
from .store_pull import PullTree

__all__ = (
    "CAPTURE_MEDIA_TYPE",
    "CHUNK_BYTES",
    "CHUNK_MEDIA_TYPE",
    "DATA_MEDIA_TYPE",
    "OCI_MANIFEST",
    "CaptureData",
    "CaptureInfo",
    "CaptureStore",
    "Collected",
    "Hold",
    "PullTree",
    "StoredFile",
    "artifact_manifest",
)

_ZEROS_VIEW = memoryview(bytes(CHUNK_BYTES))
# Chunks hashed and written at once; an ingest holds at most this many windows (~64 MiB each) and two more.
INGEST_THREADS = 4
MADE_KIND = "coldsnap-capture-store-files"  # the listing of a tree's files (`CaptureStore.made_files`)
_ZERO_RUN: Future[str | None] = Future()  # a run of zeros cut by content: known to be zeros, never stored
_ZERO_RUN.set_result(None)


class CaptureInfo(msgspec.Struct, frozen=True):
    """What an admin sees of one capture (``capture ls``/``inspect``)."""

    capture: str
    files: int
    size: int  # the files' apparent size
    stored: int  # bytes of its distinct non-zero chunks kept as blobs (a pulled capture's are in its files: `tree`)
    shared: int  # of its distinct non-zero chunks, the bytes other captures also hold
    zero: int  # bytes of zero chunks (neither stored nor moved)
    tree: int  # disk bytes of its files (tier "tree": made at a pull or on first use; `stored` + `tree` is its disk)
    created: float
    used: float
    tiers: list[str]


class Collected(msgspec.Struct, frozen=True):
    """What a collection freed (``capture gc``): the captures removed, the blobs deleted (their chunks and data
    documents, and the blobs no capture named: `orphans` of them) and the disk bytes given back (blobs and files)."""

    removed: list[str]
    blobs: int
    orphans: int
    bytes: int

class CaptureStore(StoreBase):
    """One node's store under `root` (created 0700 on first use)."""

    def ingest(self, path: str, size: int, mode: int, source: IO[bytes], *, by_content: bool = False,
               hold: Hold | None = None) -> StoredFile:
        """Read `size` bytes of one file from `source` into chunks: zeros skipped, present chunks not rewritten,
        each held by `hold` (the build's, until it records its capture); 64 MiB each, or cut by content
        (`by_content`: :func:`.chunking.content_cuts`). Reading is sequential, straight into a few windows used
        again and again (no copy beside the read's, no fresh memory to fault in per window); hashing and writing
        run in :data:`INGEST_THREADS` threads (SHA-256 and writes release the GIL) on views of those windows, at
        most that many chunks in flight. A chunk that fails to be written fails the file, naming it; what the other
        threads wrote is complete or gone (:meth:`put_blob`)."""
        # A window past one chunk and two runs of zeros: each cut by content ends at least one chunk.
        window = CHUNK_BYTES + (2 * ZERO_RUN_BYTES + 1 if by_content else 0)
        # Each chunk in flight, with its window when it is that window's last: free again once it is done.
        pending: deque[tuple[Future[str | None], bytearray | None]] = deque()
        free: list[bytearray] = []
        chunks: list[str | None] = []
        lengths: list[int] = []
        carried, remaining = b"", size
        with ThreadPoolExecutor(INGEST_THREADS, thread_name_prefix="store-ingest") as pool:
            while remaining or carried:
                want = min(window - len(carried), remaining)
                end = len(carried) + want
                buffer = free.pop() if free and end == window else bytearray(end)
                buffer[:len(carried)] = carried
                self._read(source, path, memoryview(buffer)[len(carried):end], size - remaining, size)
                remaining -= want
                pieces = content_cuts(buffer, final=not remaining) if by_content else [(end, False)]
                offset = 0
                for n, (length, zero) in enumerate(pieces, 1):
                    if len(pending) >= INGEST_THREADS:
                        chunks.append(self._done(pending, free, window, path))
                    pending.append((_ZERO_RUN if zero else pool.submit(self._chunk, buffer, offset, length, hold),
                                    buffer if n == len(pieces) else None))
                    lengths.append(length)
                    offset += length
                carried = bytes(memoryview(buffer)[offset:])
                if not pieces and len(buffer) == window:
                    free.append(buffer)
            while pending:
                chunks.append(self._done(pending, free, window, path))
        return StoredFile(path=path, size=size, mode=mode & 0o7777, chunks=chunks,
                          lengths=lengths if by_content else None)

    @staticmethod
    def _done(pending: deque[tuple[Future[str | None], bytearray | None]], free: list[bytearray], window: int,
              path: str) -> str | None:
        """The oldest chunk in flight's digest (None: zeros); its window free again when it was the last there."""
        future, buffer = pending.popleft()
        try:
            digest = future.result()
        except OSError as exc:
            raise StoreError(f"{path}: a chunk could not be stored: {exc.strerror or exc}") from exc
        if buffer is not None and len(buffer) == window:
            free.append(buffer)
        return digest

    @staticmethod
    def _read(source: IO[bytes], path: str, view: memoryview, done: int, size: int) -> None:
        """Fill `view` from `source` (`done` of `size` read before): a short source is an error naming it."""
        filled = 0
        while filled < len(view):
            n = source.readinto(view[filled:])  # type: ignore[attr-defined]
            if not n:
                raise StoreError(f"{path}: the source ended after {done + filled} of {size} bytes")
            filled += n

    def _chunk(self, buffer: bytearray, offset: int, length: int, hold: Hold | None) -> str | None:
        # bytearray.startswith is one memcmp (a memoryview comparison goes element by element, 10x slower).
        if buffer.startswith(_ZEROS_VIEW[:length], offset):
            return None
        return self.put_blob(memoryview(buffer)[offset:offset + length], hold)

    # --- captures --------------------------------------------------------------------

    def record(self, manifest: bytes, data: bytes, *, in_files: bool = False) -> str:
        """List a capture whose every chunk is present (`in_files`: in its own files, which :meth:`settle` just
        named, every chunk checked there): its data document stored, then its manifest named. The capture's id (the
        manifest's digest)."""
        files = self.decode_data(data).files
        with self._listing:
            if not in_files and (missing := [c for f in files for c in f.chunks if c is not None
                                             and not self.has_blob(c)]):
                raise StoreError(f"capture data names {len(missing)} chunks the store lacks, e.g. {missing[0]}")
            config = "sha256:" + hashlib.sha256(data).hexdigest()
            if not self.blob_path(config).exists():  # always a blob (`data` reads it there), never only a file's
                self._write_blob(data, config)
            capture = "sha256:" + hashlib.sha256(manifest).hexdigest()
            target = self._captures / f"{digest_name(capture)}.json"
            if not target.exists():
                temporary = self._tmp / f"{target.name}.{secrets.token_hex(4)}"
                with open(temporary, "xb") as out:
                    out.write(manifest)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temporary, target)
                fsync_directory(self._captures)
                self._homes = None  # its files (if any) are homes from now on
            self.touch(capture)
        return capture

    # --- a pull's files ----------------------------------------------------------------

    def begin_pull(self, capture: str, data: bytes) -> PullTree:
        """The partial files of a pull of `capture` (data document `data`, checked): partial/<hex>, as an interrupted
        pull left them, or fresh; a private directory under tmp/ while another pull writes that one (two pulls never
        write the same files). Kept by collection until the pull and its fetch threads have left them
        (`PullTree.leave`); a full disk fails here, naming the store, and leaves nothing new."""
        files = self.decode_data(data).files
        with self._listing:
            shared = capture not in self._pulling
            if shared:
                self._pulling.add(capture)
                root = self._partial / digest_name(capture)
            else:
                root = self._tmp / f"pull-{digest_name(capture)}.{secrets.token_hex(4)}"

        def end() -> None:  # the files named (settle), or left for the next pull to resume (shared) or deleted
            with self._listing:
                self._promised.pop(root, None)  # nothing more written there: its room is the disk's again
                if shared:
                    self._pulling.discard(capture)
            if not shared:
                shutil.rmtree(root, ignore_errors=True)

        try:
            return PullTree(capture, root, files, end)
        except StoreError:
            end()
            raise
        except OSError as exc:
            end()
            raise StoreError(f"capture {capture}: cannot make its files: {exc.strerror or exc}") from exc

    def settle(self, pull: PullTree, manifest: bytes, data: bytes) -> str:
        """Name the pull's files (every chunk checked in place, every file fsynced: `PullTree.finish`) the capture's,
        then list the capture (its chunks' home is these files now) and vouch for them; the capture's id."""
        target = self._trees / digest_name(pull.capture)
        with self._listing:
            try:
                os.rename(pull.root, target)
                made = True
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
                    raise StoreError(f"capture {pull.capture}: cannot name its files: {exc}") from exc
                made = False  # files made meanwhile (a run after another pull): the same bytes, checked
                shutil.rmtree(pull.root, ignore_errors=True)
            fsync_directory(self._trees)
            self._homes = None
            capture = self.record(manifest, data, in_files=True)
        if made:
            self._vouch(capture, target, self.decode_data(data))
        return capture

    # --- trees (the files a workload sees) --------------------------------------------

    def tree(self, capture: str) -> tuple[Path, int]:
        """The capture's files as plain files (made once, holes for zero chunks), and the bytes read from the
        chunks to make them (0: they were there); every chunk is checked against its digest on the way, so a
        corrupt or truncated blob fails here, naming it."""
        target = self._trees / digest_name(capture)
        if target.is_dir():
            self.touch(capture)
            return target, 0
        data = self.data(capture)
        written = sum(length for f in data.files for chunk, _, length in f.spans() if chunk is not None)
        # A data document may name one chunk many times (a registry's, a manager's image): what its files would
        # write is checked against the room first, never found by filling the node's disk.
        temporary = self._tmp / f"tree-{target.name}.{secrets.token_hex(4)}"
        self.promise(temporary, lambda: written, f"capture {capture}: its files", "nothing was made")
        try:
            temporary.mkdir(mode=0o700)
            for stored in data.files:
                self._assemble(temporary / stored.path, stored)
            fsync_directory(temporary)
            with self._listing:
                os.rename(temporary, target)
                self._homes = None
            self._vouch(capture, target, data)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
                raise StoreError(f"capture {capture}: cannot make its files: {exc}") from exc
            # another caller made them meanwhile: theirs are the same bytes
        finally:
            self.unpromise(temporary)
            if temporary.exists():
                shutil.rmtree(temporary, ignore_errors=True)
        self.touch(capture)
        return target, written

    def made_files(self, capture: str) -> Path | None:
        """The listing of the capture's files as the store made them (None: made before listings existed, or the
        daemon died between making them and listing them: nothing is vouched for, the worker digests them)."""
        path = self._made_path(capture)
        return path if path.is_file() else None

    def _vouch(self, capture: str, tree: Path, data: CaptureData) -> None:
        """List each file's identity (device, inode, size, mtime, ctime) right after the store made it from chunks it
        checked against their digests: a workload's restore that finds a file with that identity knows it holds
        the capture's bytes (a write changes its ctime, which no one can set back), as the worker's own rule does
        for the files a capture's release wrote (docs/capture-store.md, "Restores staged")."""
        identities = []
        for stored in data.files:
            st = os.stat(tree / stored.path, follow_symlinks=False)
            identities.append([st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
        listing = json.dumps({"kind": MADE_KIND, "capture": capture, "files": identities}).encode()
        made = self._made_path(capture)
        temporary = self._tmp / f"{made.name}.{secrets.token_hex(4)}"
        try:  # best effort: without the listing the files are still the capture's, only digested at a restore
            with open(temporary, "xb") as out:
                out.write(listing)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(temporary, 0o644)  # read by the workload's worker through a read-only bind
            os.rename(temporary, made)
            fsync_directory(self._trees)
        except OSError:
            temporary.unlink(missing_ok=True)

    def _assemble(self, path: Path, stored: StoredFile) -> None:
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, (stored.mode & 0o777) or 0o600)
        try:
            self.copy_chunks([(chunk, fd, offset, length, stored.path)
                              for chunk, offset, length in stored.spans() if chunk is not None])
            os.ftruncate(fd, stored.size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def copy_chunks(self, places: list[tuple[str, int, int, int, str]]) -> int:
        """Copy each (chunk, fd, offset, length, file's name) from its home into its place, checked on the way,
        :data:`INGEST_THREADS` at a time; the bytes copied."""
        with ThreadPoolExecutor(INGEST_THREADS, thread_name_prefix="store-tree") as pool:
            for job in [pool.submit(self._copy_chunk, *place) for place in places]:
                job.result()
        return sum(place[3] for place in places)

    def _copy_chunk(self, chunk: str, fd: int, offset: int, length: int, name: str) -> None:
        data = self._read_chunk(chunk, length, name)
        if len(data) != length or "sha256:" + hashlib.sha256(data).hexdigest() != chunk:
            raise StoreError(f"{name}: chunk {chunk} is corrupt or truncated in the node's store")
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, offset + (len(data) - len(view))):]

    # --- admin -----------------------------------------------------------------------

    def describe(self, capture: str, *, holders: dict[str, int] | None = None,
                 among: list[str] | None = None) -> CaptureInfo:
        """Its bytes: apparent, kept as blobs, shared with other captures (`holders`: chunk -> captures holding it;
        else counted `among` these captures, None: all), zeros, and its files'."""
        data = self.data(capture)
        holders = holders if holders is not None else self._holders(among)
        distinct: dict[str, int] = {}
        zero = size = 0
        for stored in data.files:
            size += stored.size
            for chunk, _, length in stored.spans():
                if chunk is None:
                    zero += length
                else:
                    distinct[chunk] = length
        record = (self._captures / f"{digest_name(capture)}.json").stat()
        tree_dir = self._trees / digest_name(capture)
        tree = sum(p.stat().st_blocks * 512 for p in tree_dir.rglob("*") if p.is_file()) if tree_dir.is_dir() else 0
        blobs = sum(n for c, n in distinct.items() if self.blob_path(c).exists())
        return CaptureInfo(capture=capture, files=len(data.files), size=size, stored=blobs,
                           shared=sum(n for c, n in distinct.items() if holders.get(c, 0) > 1), zero=zero,
                           tree=tree, created=record.st_ctime, used=record.st_mtime,
                           tiers=["disk", "tree"] if tree_dir.is_dir() else ["disk"])

    def _holders(self, among: list[str] | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for capture in self.captures() if among is None else [c for c in among if self.has(c)]:
            for chunk in self.chunks(capture):
                counts[chunk] = counts.get(chunk, 0) + 1
        return counts

    def describe_all(self, among: list[str] | None = None) -> list[CaptureInfo]:
        """Every capture listed (`among`: those of them only, their bytes shared counted among them alone: a
        manager's view tells nothing of the chunks other managers' captures hold, review17)."""
        captures = self.captures() if among is None else [c for c in self.captures() if c in among]
        holders = self._holders(captures)
        return [self.describe(capture, holders=holders) for capture in captures]

    def remove(self, capture: str) -> tuple[int, int]:
        """Unlist the capture (its record first, so it is never half-listed), drop its tree, then every blob no
        other capture names and no write in flight holds. Removing an absent capture is an error naming it.
        The blobs deleted and the disk bytes freed."""
        record = self._captures / f"{digest_name(capture)}.json"
        with self._listing:
            others = [c for c in self.captures() if c != capture]
            keep = self._named(others) | set(self._held)
            try:
                manifest = json.loads(record.read_bytes())
            except FileNotFoundError as exc:
                raise StoreError(f"capture {capture} is not in the node's store") from exc
            mine = self.chunks(capture) | {manifest["config"]["digest"]}
            # A capture this daemon cannot read (a newer format, recorded before a rollback) may hold any of them:
            # its chunks are kept, never deleted from under it (review13).
            readable = all(self._readable(c) for c in others)
            # Before it is unlisted: what others need of its files is a blob first (a failure here removes nothing).
            self._move_out(capture, keep if readable else mine)
            record.unlink()
            fsync_directory(self._captures)
            self._homes = None
            freed = self.drop_tree(capture)
            if not readable:
                return 0, freed
            blobs, freed_blobs = self._delete_blobs(mine - keep)
            return blobs, freed + freed_blobs

    def _collect_orphans(self) -> tuple[int, int]:
        """Delete the blobs no capture names and no write in flight holds (an interrupted pull's chunks, a build
        that failed after storing some), and the files made for a capture no longer listed (a removal the daemon
        died in): the blobs deleted and the disk bytes freed. Nothing while a capture cannot be read: it may
        name any blob (a newer format, recorded before a rollback)."""
        with self._listing:
            captures = self.captures()
            if not all(self._readable(c) for c in captures):
                return 0, 0
            keep = self._named(captures) | set(self._held)
            present = {"sha256:" + p.name for p in self._blobs.iterdir() if len(p.name) == 64 and set(p.name) <= HEX}
            blobs, freed = self._delete_blobs(present - keep)
            listed = {c.removeprefix("sha256:") for c in captures}
            for tree in self._trees.iterdir():
                name = tree.name.removesuffix(".made.json")
                if len(name) == 64 and set(name) <= HEX and name not in listed:
                    freed += self._drop_files("sha256:" + name)  # unlisted: no chunk's home
            pulling = {c.removeprefix("sha256:") for c in self._pulling}
            for partial in self._partial.iterdir():
                if partial.name not in pulling:  # a pull interrupted and not resumed
                    freed += sum(disk_bytes(p) for p in partial.rglob("*"))
                    shutil.rmtree(partial, ignore_errors=True)
            return blobs, freed

    def _move_out(self, capture: str, needed: set[str]) -> None:
        """Write as a blob each chunk of `needed` whose only home is the capture's files, read from there and checked
        (caller holds _listing): the files can then go. A copy that does not check fails, naming it."""
        homes, tree = self._tree_homes(), self._trees / digest_name(capture)
        if not self._readable(capture) or not tree.is_dir():
            return  # unlisted or unreadable: its files are no chunk's home
        for stored in self.data(capture).files:
            for chunk, offset, length in stored.spans():
                if chunk is None or chunk not in needed or self.blob_path(chunk).exists() or \
                        any(c != capture for c, _, _ in homes.get(chunk, ())):
                    continue
                with open(tree / stored.path, "rb") as source:
                    data = os.pread(source.fileno(), length, offset)
                if len(data) != length or "sha256:" + hashlib.sha256(data).hexdigest() != chunk:
                    raise StoreError(f"capture {capture}: {stored.path}: its copy of chunk {chunk}, which another "
                                     "capture or a write in flight needs, is corrupt or truncated; nothing was removed")
                try:
                    self._write_blob(data, chunk)
                except OSError as exc:
                    raise StoreError(f"capture {capture}: chunk {chunk}, which another capture or a write in flight "
                                     f"needs, cannot be kept: {exc.strerror or exc}; nothing was removed") from exc

    def drop_tree(self, capture: str) -> int:
        """Drop the files made for the capture, once what a listed capture (itself included) or a write in flight
        needs of them is a blob (`_move_out`); the disk bytes freed."""
        with self._listing:
            self._move_out(capture, self._named(self.captures()) | set(self._held))
            self._homes = None
            return self._drop_files(capture)

    def _drop_files(self, capture: str) -> int:
        made = self._made_path(capture)
        freed = disk_bytes(made)
        made.unlink(missing_ok=True)  # first: it never outlives the files it lists
        tree = self._trees / digest_name(capture)
        if tree.is_dir():
            doomed = self._tmp / f"drop-{tree.name}.{secrets.token_hex(4)}"
            os.rename(tree, doomed)  # gone from trees/ at once, deleted after
            freed += sum(disk_bytes(p) for p in doomed.rglob("*"))
            shutil.rmtree(doomed, ignore_errors=True)
        return freed

    def collect(self, *, in_use: set[str], max_bytes: int | None, older_than_s: float | None) -> Collected:
        """Delete the blobs no capture names (and no write in flight holds), then remove captures not `in_use`:
        those unused for `older_than_s`, then the least recently used until the store holds at most `max_bytes`.
        What it freed."""
        orphans, freed = self._collect_orphans()
        blobs = orphans
        now = time.time()
        removed: list[str] = []
        candidates = sorted((info for info in self.describe_all() if info.capture not in in_use),
                            key=lambda info: info.used)
        doomed = [info for info in candidates if older_than_s is not None and now - info.used >= older_than_s]
        rest = [info for info in candidates if info not in doomed] if max_bytes is not None else []
        for info in [*doomed, *rest]:
            if info not in doomed and max_bytes is not None and self.bytes_on_disk() <= max_bytes:
                break
            count, n = self.remove(info.capture)
            blobs, freed = blobs + count, freed + n
            removed.append(info.capture)
        return Collected(removed=removed, blobs=blobs, orphans=orphans, bytes=freed)

    def bytes_on_disk(self) -> int:
        return sum(p.stat().st_blocks * 512 for p in self._walk())

    def _walk(self) -> Iterator[Path]:
        for top in (self._blobs, self._captures, self._trees, self._partial):
            yield from (p for p in top.rglob("*") if p.is_file())



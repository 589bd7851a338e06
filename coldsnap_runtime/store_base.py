"""The capture store's layout on disk and what every part of it builds on (:mod:`.store`): names, blobs, the
captures listed, where a chunk's bytes are (its homes: its blob, or its place in a listed capture's files), and the
holds of writes in flight. The layout and its rules are in :mod:`.store`'s docstring."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from .capture_data import CaptureData, decode_data, digest_name, manifest_blobs
from .errors import StoreError

__all__ = ("Hold", "StoreBase", "disk_bytes", "fsync_directory")


class Hold:
    """The blobs one write in flight (a build's ingest, a pull) stores or counts on before its capture is recorded:
    removal and collection keep them until the write ends (:meth:`CaptureStore.holding`)."""

    def __init__(self, store: StoreBase) -> None:
        self._store = store
        self._digests: set[str] = set()

    def add(self, digests: Iterable[str]) -> None:
        """Hold these blobs from now on: called before the write looks for them or writes them, so a collection
        either ran before (the write finds them absent and writes them) or keeps them."""
        with self._store._listing:
            fresh = set(digests) - self._digests
            self._digests |= fresh
            self._store._held.update(fresh)

    def release(self) -> None:
        with self._store._listing:
            self._store._held.subtract(self._digests)
            self._store._held = +self._store._held  # drop the zero counts
            self._digests = set()


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StoreBase:
    """One node's store under `root` (created 0700 on first use): its layout and primitives."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._blobs = root / "blobs" / "sha256"
        self._captures = root / "captures"
        self._trees = root / "trees"
        self._partial = root / "partial"
        self._tmp = root / "tmp"
        # Held by record (its chunks checked, then its manifest named) and remove (what others keep, then deleted):
        # a removal never deletes a chunk a capture being recorded has just found present. Re-entrant: dropping a
        # capture's files under a removal moves out what others need (`drop_tree`).
        self._listing = threading.RLock()
        # Invariant (under _listing): each blob a write in flight holds, with how many writes hold it.
        self._held: Counter[str] = Counter()
        # Invariant (under _listing): the captures whose partial/<hex> a pull writes now (collection keeps them).
        self._pulling: set[str] = set()
        # Invariant (under _listing): each write in flight that was given room (a pull's files, a tree being made,
        # by the directory it writes) -> the bytes it may still write. The filesystem's free bytes count none of
        # them yet: two pulls checked alone would each fit, and together fill the disk (review17).
        self._promised: dict[Path, Callable[[], int]] = {}
        # Under _listing: chunk -> the places of it in listed captures' files (None: to be read again from disk,
        # after any change to which captures are listed or have files).
        self._homes: dict[str, list[tuple[str, Path, int]]] | None = None

    def open(self) -> None:
        """Create the layout and drop what an earlier process left half-written (tmp/: a killed daemon's
        temporaries; the blobs it stored for a capture it never recorded are collected by :meth:`collect`)."""
        for directory in (self.root, self._blobs, self._captures, self._trees, self._partial, self._tmp):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for leftover in self._tmp.iterdir():
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    # --- blobs -----------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        return self._blobs / digest_name(digest)

    def has_blob(self, digest: str) -> bool:
        """The node holds the chunk (or document): as a blob, or in a listed capture's files."""
        return self.locate(digest) is not None

    def locate(self, digest: str) -> tuple[Path, int] | None:
        """Where the chunk's bytes are: its blob (offset 0), else its place in a listed capture's files (None:
        nowhere). A reader that finds the file gone asks again: a removal moves out what is held first."""
        blob = self.blob_path(digest)
        if blob.exists():
            return blob, 0
        with self._listing:
            for _ in range(2):
                homes = self._tree_homes().get(digest)
                if not homes:
                    return None
                capture, path, offset = homes[0]
                if path.exists() and self.has(capture):
                    return path, offset
                self._homes = None  # changed behind the store's back (an admin's hand): read again, once
        return None

    def _tree_homes(self) -> dict[str, list[tuple[str, Path, int]]]:
        """chunk -> (capture, file, offset) of every place in listed captures' files (caller holds _listing)."""
        if self._homes is None:
            homes: dict[str, list[tuple[str, Path, int]]] = {}
            for capture in self.captures():
                tree = self._trees / digest_name(capture)
                if not tree.is_dir() or not self._readable(capture):
                    continue
                for stored in self.data(capture).files:
                    for chunk, offset, _ in stored.spans():
                        if chunk is not None:
                            homes.setdefault(chunk, []).append((capture, tree / stored.path, offset))
            self._homes = homes
        return self._homes

    def promise(self, writer: Path, needed: Callable[[], int], what: str, outcome: str) -> None:
        """Give the write into `writer` room for `needed()` more bytes (asked again at each later check: a pull's falls
        as it writes) beside what the other writes in flight were given, or refuse it, naming `what`, the free bytes
        left to it (others' writes are not named) and `outcome`; the room is the writer's until :meth:`unpromise`."""
        with self._listing:
            room = os.statvfs(self.root)
            free = room.f_bavail * room.f_frsize - sum(max(0, left()) for other, left in self._promised.items()
                                                       if other != writer)
            if (need := needed()) > free:
                raise StoreError(f"{what} need {need} bytes more, the store's filesystem has {max(0, free)} free; "
                                 f"{outcome}")
            self._promised[writer] = needed

    def unpromise(self, writer: Path) -> None:
        with self._listing:
            self._promised.pop(writer, None)

    def temporary(self, digest: str) -> Path:
        """A fresh temporary name for a blob being written."""
        return self._tmp / f"{digest_name(digest)}.{secrets.token_hex(4)}"

    @contextmanager
    def holding(self) -> Iterator[Hold]:
        """A write's hold on the blobs it stores or finds present, released when it ends (recorded or not)."""
        hold = Hold(self)
        try:
            yield hold
        finally:
            hold.release()

    def put_blob(self, data: bytes | bytearray | memoryview, hold: Hold | None = None) -> str:
        """Store `data` as a blob (once: present bytes are not written again), held by `hold` first; its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if hold is not None:
            hold.add((digest,))
        if not self.has_blob(digest):
            self._write_blob(data, digest)
        return digest

    def _write_blob(self, data: bytes | bytearray | memoryview, digest: str) -> None:
        """`data` (checked: its digest) under blobs/, fsynced under a temporary name first (a concurrent writer of
        the same bytes wins equally: the name holds the same bytes either way)."""
        temporary = self.temporary(digest)
        try:
            with open(temporary, "xb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.blob_path(digest))
        finally:
            temporary.unlink(missing_ok=True)

    decode_data = staticmethod(decode_data)
    manifest_blobs = staticmethod(manifest_blobs)

    def manifest(self, capture: str) -> bytes:
        try:
            return (self._captures / f"{digest_name(capture)}.json").read_bytes()
        except FileNotFoundError as exc:
            raise StoreError(f"capture {capture} is not in the node's store") from exc

    def blobs(self, capture: str) -> list[tuple[str, int]]:
        """The blobs (digest, size) the capture's manifest names, its data document first, each checked to be the
        document's or one of its chunks (`manifest_blobs`: a capture listed from a registry's manifest before the
        check, or by hand, is refused, naming the blob)."""
        manifest = self.manifest(capture)
        config = self._config(capture)
        try:
            data = self.blob_path(config or "").read_bytes()
        except (FileNotFoundError, StoreError) as exc:
            raise StoreError(f"its data document {config} is missing") from exc
        return manifest_blobs(manifest, data)

    def data(self, capture: str) -> CaptureData:
        config = json.loads(self.manifest(capture))["config"]["digest"]
        try:
            return self.decode_data(self.blob_path(config).read_bytes())
        except FileNotFoundError as exc:
            raise StoreError(f"capture {capture}: its data document {config} is missing") from exc

    def captures(self) -> list[str]:
        return sorted("sha256:" + p.name.removesuffix(".json") for p in self._captures.glob("*.json"))

    def has(self, capture: str) -> bool:
        return (self._captures / f"{digest_name(capture)}.json").exists()

    def touch(self, capture: str) -> None:
        """Mark the capture used now (gc by age counts from its last use)."""
        os.utime(self._captures / f"{digest_name(capture)}.json")

    def _made_path(self, capture: str) -> Path:
        """Where the identities of the capture's files are listed once the store has made them (`_vouch`)."""
        return self._trees / f"{digest_name(capture)}.made.json"

    def _read_chunk(self, chunk: str, length: int, name: str) -> bytes:
        """The chunk's bytes from its home (from a blob up to `length` + 1: a longer blob shows, then the blob
        dropped from the page cache: the made files' copy is the one a restore reads, so the same bytes are never
        cached twice). Read through the cache, not with O_DIRECT: on the H200 machine's disk that read 1.45 GB/s
        against O_DIRECT's 1.02. Asked again once when the home went meanwhile (a removal moved it out)."""
        for _ in range(2):
            if (home := self.locate(chunk)) is None:
                break
            path, offset = home
            try:
                with open(path, "rb") as source:
                    data = os.pread(source.fileno(), length + 1 if path.parent == self._blobs else length, offset)
                    if path.parent == self._blobs:
                        os.posix_fadvise(source.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                return data
            except FileNotFoundError:
                continue
        raise StoreError(f"{name}: chunk {chunk} is missing from the node's store")

    def open_chunk(self, chunk: str, length: int) -> tuple[BinaryIO, int]:
        """The chunk's home opened for reading, and its offset there (a push sends it from there); a blob whose size
        is not `length` is refused, naming it."""
        for _ in range(2):
            if (home := self.locate(chunk)) is None:
                break
            try:
                source = open(home[0], "rb")  # noqa: SIM115 (the caller closes it)
            except FileNotFoundError:
                continue
            if home[0].parent == self._blobs and (found := os.fstat(source.fileno()).st_size) != length:
                source.close()
                raise StoreError(f"blob {chunk} holds {found} bytes in the node's store, its capture says {length}")
            return source, home[1]
        raise StoreError(f"blob {chunk} is missing from the node's store")

    def _config(self, capture: str) -> str | None:
        """The digest of the capture's data document (another capture's manifest may name the same one)."""
        try:
            return str(json.loads(self.manifest(capture))["config"]["digest"])
        except (StoreError, ValueError, KeyError, TypeError):
            return None

    def chunks(self, capture: str) -> set[str]:
        """The chunks the capture names (none when it cannot be read)."""
        try:
            return {c for f in self.data(capture).files for c in f.chunks if c is not None}
        except StoreError:
            return set()

    def _named(self, captures: Iterable[str]) -> set[str]:
        """The blobs these captures name: their chunks and data documents."""
        captures = list(captures)
        return set().union(*(self.chunks(c) for c in captures)) | {config for c in captures
                                                                     if (config := self._config(c))}

    def _delete_blobs(self, digests: Iterable[str]) -> tuple[int, int]:
        """Delete these blobs (caller holds _listing); how many there were and their disk bytes."""
        count = freed = 0
        for blob in digests:
            path = self.blob_path(blob)
            try:
                blocks = path.stat().st_blocks
                path.unlink()
            except FileNotFoundError:
                continue
            count, freed = count + 1, freed + blocks * 512
        return count, freed

    def _readable(self, capture: str) -> bool:
        try:
            self.data(capture)
        except (StoreError, ValueError, KeyError, TypeError):
            return False
        return True


def disk_bytes(path: Path) -> int:
    """The disk bytes of one file (0: gone, or not a file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0

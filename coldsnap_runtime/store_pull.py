"""The files of one capture being pulled (``CaptureStore.begin_pull``): a pull writes each fetched chunk once,
straight into its first place in them, and the files become the capture's (``trees/<hex>``) when every chunk is
there, checked; they are then its chunks' home, no blob beside them (docs/capture-store.md, "On disk").

Why: on the H200 a pull that stored each chunk as a blob and then copied it into the capture's files wrote 20.5 GB
for a 10.35 GB capture (20.9 s, the disk alone 11.5 s of it): every byte twice, ext4 sharing no extents.

The files are made sparse at their full size first, so a span never written reads as a hole. A chunk counts once its
bytes checked against its digest, in place (a fetch hashes them on the way; a chunk another home holds is copied in
and checked; an interrupted pull's files are read back and checked when the next pull resumes them). A chunk a file
holds twice (or two files hold) is fetched once and copied to its other places. No chunk is fsynced on its own: the
files are, once, before they are named; a resumed pull trusts nothing it has not checked again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .capture_data import StoredFile
from .errors import StoreError

__all__ = ("PullTree",)

CHECK_THREADS = 4  # chunks read back and hashed at once when a pull resumes (SHA-256 releases the GIL)


class PullTree:
    """The partial files of one pull of `capture` under `root` (partial/<hex>, which a later pull resumes, or a
    private directory of this pull's own). The pull and each of its fetch threads hold them (`join`, `leave`);
    `on_end` runs when the last one leaves: a fetch its cancelled pull abandoned may write until its next piece, and
    no other pull may take the files before it has ended."""

    def __init__(self, capture: str, root: Path, files: list[StoredFile], on_end: Callable[[], None]) -> None:
        self.capture, self.root = capture, root
        self._on_end = on_end
        self._users, self._lock = 1, threading.Lock()  # the pull itself, then each fetch thread while it runs
        # chunk -> [(file, offset)]: its first place is where a fetch writes it, the others are copies of that.
        self.places: dict[str, list[tuple[Path, int]]] = {}
        self.lengths: dict[str, int] = {}
        # Invariant: the chunks whose first place holds their bytes, checked against their digest.
        self.placed: set[str] = set()
        self._files = files
        if len({stored.path for stored in files}) != len(files):
            raise StoreError(f"capture {capture}: its data document names one file twice; nothing was fetched")
        for stored in files:
            for chunk, offset, length in stored.spans():
                if chunk is not None:
                    self.places.setdefault(chunk, []).append((root / stored.path, offset))
                    self.lengths[chunk] = length
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stored in files:
            path = root / stored.path
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, (stored.mode & 0o777) or 0o600)
            try:
                if os.fstat(fd).st_size != stored.size:
                    os.ftruncate(fd, stored.size)  # sparse: a span never written reads as a hole
            finally:
                os.close(fd)

    def join(self) -> bool:
        """A fetch thread starts writing into the files (False: the pull has ended, write nothing)."""
        with self._lock:
            if self._users:
                self._users += 1
            return bool(self._users)

    def leave(self) -> None:
        """The pull, or one of its fetch threads, is done with the files."""
        with self._lock:
            self._users -= 1
            last = not self._users
        if last:
            self._on_end()

    def needed(self) -> int:
        """The bytes still to be written into the files (every place of a chunk not yet placed, copies included)."""
        return sum(self.lengths[chunk] * (len(places) - (chunk in self.placed))
                   for chunk, places in self.places.items())

    def resume(self, usable: Callable[[str], bool]) -> int:
        """Count as placed each chunk `usable` whose first place an interrupted pull filled (read back and checked:
        nothing it wrote is trusted unchecked); the bytes found. Spans that are holes are skipped unread."""
        candidates = [chunk for chunk in self.places if usable(chunk) and self._written(chunk)]
        with ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="store-resume") as pool:
            found = [chunk for chunk, ok in zip(candidates, pool.map(self._holds, candidates), strict=True) if ok]
        self.placed.update(found)
        return sum(self.lengths[chunk] for chunk in found)

    def _written(self, chunk: str) -> bool:
        path, offset = self.places[chunk][0]
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return os.lseek(fd, offset, os.SEEK_DATA) < offset + self.lengths[chunk]
        except OSError:  # ENXIO: nothing but a hole from there to the end
            return False
        finally:
            os.close(fd)

    def _holds(self, chunk: str) -> bool:
        path, offset = self.places[chunk][0]
        with open(path, "rb") as source:
            data = os.pread(source.fileno(), self.lengths[chunk], offset)
        return len(data) == self.lengths[chunk] and "sha256:" + hashlib.sha256(data).hexdigest() == chunk

    def place(self, chunk: str) -> tuple[Path, int]:
        """Where a fetch writes the chunk: its first place (the caller marks it `placed` once it checked)."""
        return self.places[chunk][0]

    def finish(self, copy: Callable[[list[tuple[str, int, int, int, str]]], int]) -> int:
        """Copy in each chunk not placed from its home in the store (`copy`: ``CaptureStore.copy_chunks``, each
        checked on the way), then every chunk's first place to its other places; every file fsynced. The bytes
        copied from other homes."""
        fds: dict[Path, int] = {}
        try:
            for stored in self._files:
                path = self.root / stored.path
                fds[path] = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            copied = copy([(chunk, fds[places[0][0]], places[0][1], self.lengths[chunk],
                                         places[0][0].relative_to(self.root).as_posix())
                                        for chunk, places in self.places.items() if chunk not in self.placed])
            self.placed.update(self.places)
            for chunk, places in self.places.items():
                if len(places) > 1:
                    self._copy_within(chunk, places, fds)
            for fd in fds.values():
                os.fsync(fd)
        except OSError as exc:
            raise StoreError(f"capture {self.capture}: cannot make its files: {exc.strerror or exc}") from exc
        finally:
            for fd in fds.values():
                os.close(fd)
        for directory in {self.root, *(path.parent for path in fds)}:
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return copied

    def _copy_within(self, chunk: str, places: list[tuple[Path, int]], fds: dict[Path, int]) -> None:
        """The chunk's checked first place copied to its other places (in the kernel: no bytes through Python)."""
        (first, start), length = places[0], self.lengths[chunk]
        with open(first, "rb") as source:
            for path, offset in places[1:]:
                done = 0
                while done < length:
                    n = os.copy_file_range(source.fileno(), fds[path], length - done, start + done, offset + done)
                    if not n:
                        raise StoreError(f"capture {self.capture}: chunk {chunk} ended early in its files")
                    done += n

"""The tree's shared-memory files (/dev/shm), kept with the images (issue 36 item 3: multi-process servers).

A server split in processes passes data through POSIX shared memory (`multiprocessing.shared_memory`, vLLM's
rings, `shm_open`): a file in /dev/shm that each process maps. CRIU records such a mapping by the file's path and
size, not its contents, so a restore maps whatever the file holds then: nothing on a fresh node or in a fresh
container (CRIU fails), and on the node that captured it what the last restored tree wrote (a second restore from
the same images would not see the captured state). So:

capture: before the dump, the linked files under /dev/shm that a process of the tree maps shared and writable, or
holds open for writing, are listed; after the dump (the tree is frozen, then ended, so nothing writes them) each is
copied into the images, `shm/<name>`, and recorded in `shm-files.json` (path, bytes, mode, owner, sha256);
restore: before CRIU runs, every copy is checked against its record (a restore that cannot succeed never
starts); then each file is put back at its path, as its owner and mode, written beside it and renamed over it
(never through a link), so that CRIU maps the contents the tree had when it was dumped.
An unlinked segment is CRIU's own (a ghost file it dumps with the images).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ._records import read_record
from .errors import WorkerError

__all__ = ("RECORD", "SharedFile", "load_shared_files", "put_back", "save_shared_files", "shared_files")

RECORD = "shm-files.json"
RECORD_KIND = "coldsnap-shared-files"
SHM = "/dev/shm/"
COPIES = "shm"


# A tuple, not a dataclass: it is on a restore's path to CRIU (dataclasses' import, ~15 ms on the H200; issue 35).
class SharedFile(NamedTuple):
    """One file as the capture copied it: where it lives, its size, mode, owner and digest."""

    path: str
    bytes: int
    mode: int
    uid: int
    gid: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.bytes, "mode": self.mode, "uid": self.uid, "gid": self.gid,
                "sha256": self.sha256}


def _name(path: str) -> str:
    """The file's name in /dev/shm (WorkerError unless the path is exactly one name there)."""
    name = path[len(SHM):] if path.startswith(SHM) else ""
    if not name or "/" in name or name in (".", "..") or len(name.encode()) > 255:
        raise WorkerError(f"{RECORD}: {path!r} is not a file directly in {SHM}")
    return name


def _written_fds(pid: int) -> set[str]:
    """The /dev/shm files the process holds open for writing (fdinfo's flags: O_WRONLY or O_RDWR)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = next(line for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                         if line.startswith("flags:"))
        except (OSError, StopIteration):  # closed while we looked
            continue
        if target.startswith(SHM) and int(flags.split()[1], 8) & 3:
            found.add(target)
    return found


def shared_files(tree: list[int]) -> list[str]:
    """The linked /dev/shm files any process of the tree maps shared and writable or holds open for writing."""
    found: set[str] = set()
    for pid in tree:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[1].startswith("rw") and fields[1][3] == "s" and \
                        fields[5].startswith(SHM) and not fields[5].endswith(" (deleted)"):
                    found.add(fields[5])
            found |= _written_fds(pid)
        except OSError:  # the process is gone: it holds nothing
            continue
    # A segment is a name directly in /dev/shm (shm_open's); a folder there (an images root, say) holds no segment.
    return sorted(p for p in found if "/" not in p[len(SHM):] and os.path.isfile(p))


def _copy(source: str, target: Path) -> SharedFile:
    """`source` copied to `target` (never through a link), with its identity and digest."""
    import hashlib  # here: OpenSSL's load (3-4 ms) is off a restore's path to CRIU (issue 35 item 2)
    digest = hashlib.sha256()
    with open(os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as src:
        st = os.fstat(src.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WorkerError(f"shared file {source} is not a regular file")
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as dst:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                dst.write(chunk)
    return SharedFile(source, st.st_size, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, digest.hexdigest())


def save_shared_files(paths: list[str], images: Path) -> list[SharedFile]:
    """After the dump: each file copied into the images and recorded; [] (and no record) without any."""
    if not paths:
        return []
    copies = images / COPIES
    copies.mkdir(mode=0o700)
    try:
        saved = [_copy(path, copies / _name(path)) for path in paths]
    except OSError as exc:
        raise WorkerError(f"the tree's shared-memory files could not be kept with the images: {exc}") from exc
    record = {"format": 1, "kind": RECORD_KIND, "files": [f.to_json() for f in saved]}
    (images / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return saved


def _digest(path: Path) -> str:
    import hashlib  # here: OpenSSL's load (3-4 ms) is off a restore's path to CRIU (issue 35 item 2)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _refused(detail: object) -> WorkerError:
    return WorkerError(f"{RECORD}: the tree's shared-memory files cannot be put back, not restoring: {detail}")


def load_shared_files(images: Path) -> list[SharedFile]:
    """Before CRIU: the record, and every copy's size and digest checked against it; [] without a record."""
    try:
        if (stored := read_record(images, RECORD, RECORD_KIND)) is None:
            return []
        files = [SharedFile(str(f["path"]), int(f["bytes"]), int(f["mode"]), int(f["uid"]), int(f["gid"]),
                            str(f["sha256"])) for f in stored["files"]]
        for shared in files:
            copy = images / COPIES / _name(shared.path)
            if copy.lstat().st_size != shared.bytes or _digest(copy) != shared.sha256:
                raise _refused(f"{copy} is not the copy the capture recorded for {shared.path} "
                                 f"({shared.bytes} bytes, sha256 {shared.sha256})")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _refused(exc) from exc
    return files


def put_back(files: list[SharedFile], images: Path, note: Callable[..., None] = lambda **_: None) -> None:
    """Just before CRIU: each file at its path again, as captured (written beside it, then renamed over it). Each
    file written beside one is first `note`d (the worker's journal: its guard removes it if the worker dies)."""
    for shared in files:
        partial = f"{shared.path}.coldsnap-{os.getpid()}"
        note(partial=partial)
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # one that was there is not ours to remove
            raise WorkerError(f"shared-memory file {shared.path} could not be put back: {exc}") from exc
        try:
            try:
                with open(images / COPIES / _name(shared.path), "rb") as src, open(fd, "wb", closefd=False) as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
                if os.geteuid() == 0:
                    os.fchown(fd, shared.uid, shared.gid)
                os.fchmod(fd, shared.mode & 0o777)  # never set-id or sticky: the record is the images' to say
            finally:
                os.close(fd)
            os.replace(partial, shared.path)
        except OSError as exc:
            Path(partial).unlink(missing_ok=True)
            raise WorkerError(f"shared-memory file {shared.path} could not be put back: {exc}") from exc

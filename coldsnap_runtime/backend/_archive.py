"""Tars between the engine and the host, as the owner: a small program the backend runs by path
(``python -I -S _archive.py ...``), standard library only, so it starts fast.

* **extract** (``workload-copy-from``): ``_archive.py ROOT DESTINATION [--as UID:GID] [--keep-owner]
  [--max-bytes N]``, the tar on stdin;
* **pack** (``image-build``'s context directories): ``_archive.py --pack [--as UID:GID]``, a JSON job
  on stdin (:func:`pack`), the tar on stdout.

With ``--as`` the child drops to that identity right after its imports (no supplementary groups, all
ids changed, no capability left: ``_privileges.py``); without it a non-root daemon's child still gives
up every capability. So the kernel, not this code, decides what may be read or written.

Extract: the destination is walked from ``/`` with ``O_NOFOLLOW`` (a symbolic link on the way is
refused); the copy is staged beside its final place and renamed in, so a failure leaves nothing
half-written; absolute names, ``..``, entries below an archived link, duplicate names, device nodes and
FIFOs are refused; a hard link to another entry becomes a copy of its data (counted again against
``--max-bytes``, checked before anything is written), any other is refused; setuid, setgid and sticky
bits are dropped; numeric owners are kept only with ``--keep-owner`` (a root writer, as ``docker cp``).

Pack (Docker's rules for a build context, race-free): directories are walked through descriptors, each
entry opened ``O_NOFOLLOW`` relative to its parent and described by ``fstat`` of what is read; a
symbolic link is archived as its target text, never followed; an unreadable path fails the build
naming it; entries are owned 0:0; sockets are skipped; the main context's ``.dockerignore`` is honoured.

Exit status 0 on success; 1 with one line on stderr saying why; 2 for bad arguments.
"""

from __future__ import annotations

import errno
import fnmatch
import importlib.util
import json
import os
import posixpath
import secrets
import stat
import sys
import tarfile
from typing import IO, Any

__all__ = ("ArchiveRefused", "check_members", "extract_copy", "main", "pack")

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_PERMISSIONS = 0o777  # what survives: no setuid, setgid or sticky bit
# pack: a directory given by the job may be reached through links (the owner's own path);
# nothing below it is. O_NONBLOCK: an entry swapped for a FIFO cannot stall the open.
_TREE = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ArchiveRefused(Exception):
    """The copy cannot be placed at the destination (the message says why); exit status 1."""


def _sibling(name: str) -> Any:
    """The module `name`.py beside this file, loaded by path: run as a program, this file has no package to import
    it from."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_coldsnap{name}", path)
    if spec is None or spec.loader is None:
        raise ArchiveRefused(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


try:
    from ._tarout import TarOut
except ImportError:  # a program (``python -I -S _archive.py``): loaded now, before any identity is dropped
    TarOut = _sibling("_tarout").TarOut  # type: ignore[misc]


def open_directory(path: str) -> int:
    """A descriptor of the absolute directory `path`, reached without following any symbolic link."""
    fd = os.open("/", _DIR)
    walked = ""
    try:
        for part in [p for p in path.split("/") if p]:
            walked += "/" + part
            try:
                child = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError as exc:
                raise ArchiveRefused(f"destination directory {path} does not exist") from exc
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise ArchiveRefused(
                        f"destination component {walked} is a symbolic link; it is not followed") from exc
                raise ArchiveRefused(f"destination component {walked} is not a directory") from exc
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def check_members(tar: tarfile.TarFile, root: str, max_bytes: int | None = None) -> list[tarfile.TarInfo]:
    """A copy's members in order, names normalised; every one inside `root`, none reached through
    a symbolic link of the archive, none listed twice, hard links only to members, no devices or FIFOs.

    `max_bytes`: a bound on the bytes extracting them writes. The tar carries a file's data once and
    each hard link to it as a bare header, but a link is extracted as a copy, so it counts again."""
    members: list[tarfile.TarInfo] = []
    links: set[str] = set()
    seen: set[str] = set()
    sizes: dict[str, int] = {}
    total = 0
    for member in tar:
        name = posixpath.normpath(member.name)
        if name.startswith(("/", "../")) or name == ".." or not (name == root or name.startswith(root + "/")):
            raise ArchiveRefused(f"archive entry {member.name!r} is outside the copied path")
        if name in seen:  # a link first and a file of the same name later is how writes get redirected
            raise ArchiveRefused(f"archive entry {member.name!r} is listed twice")
        seen.add(name)
        parts = name.split("/")
        if any("/".join(parts[:i]) in links for i in range(1, len(parts))):
            raise ArchiveRefused(f"archive entry {member.name!r} passes through a symbolic link")
        if member.islnk():
            target = posixpath.normpath(member.linkname)
            if not (target == root or target.startswith(root + "/")):
                raise ArchiveRefused(f"hard link {member.name!r} points outside the copied path")
            total += sizes.get(target, 0)
        elif member.issym():
            links.add(name)
        elif not (member.isreg() or member.isdir()):
            raise ArchiveRefused(f"archive entry {member.name!r} is a device node or FIFO; those are not copied")
        if member.isreg():
            sizes[name] = member.size
            total += member.size
        if max_bytes is not None and total > max_bytes:
            raise ArchiveRefused(f"the copy's files hold more than {max_bytes} bytes (docker.copy_max_bytes; a hard "
                                 "link counts its file's bytes again); nothing was placed")
        member.name = name
        members.append(member)
    return members


def _open_parent(staging: int, parts: list[str]) -> int:
    """The directory that holds ``parts[-1]`` inside the staging directory (missing ones made 0700)."""
    fd = os.dup(staging)
    try:
        for part in parts[:-1]:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass  # made by an earlier entry; opened below without following links
            child = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _clear(name: str, dir_fd: int) -> None:
    """Make room for a later entry of the same name (tar semantics: the last one wins)."""
    found = _lstat(name, dir_fd)
    if found is None:
        return
    if stat.S_ISDIR(found.st_mode):
        raise ArchiveRefused(f"archive entry {name!r} replaces a directory")
    os.unlink(name, dir_fd=dir_fd)


def _extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str,
                    keep_owner: bool) -> None:
    if member.isdir():
        found = _lstat(name, parent)
        if found is None:
            os.mkdir(name, 0o700, dir_fd=parent)
        elif not stat.S_ISDIR(found.st_mode):
            raise ArchiveRefused(f"archive entry {member.name!r} is both a file and a directory")
        return
    _clear(name, parent)
    if member.issym():
        os.symlink(member.linkname, name, dir_fd=parent)
        if keep_owner:
            os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
        os.utime(name, (member.mtime, member.mtime), dir_fd=parent, follow_symlinks=False)
        return
    source = tar.extractfile(member)  # a hard link reads its target's data
    if source is None:
        raise ArchiveRefused(f"hard link {member.name!r} does not point at a regular file of the copy")
    fd = os.open(name, _FILE, 0o600, dir_fd=parent)
    with os.fdopen(fd, "wb") as out:
        _copy_sparse(source, out)
        if keep_owner:
            os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & _PERMISSIONS)
        os.utime(fd, (member.mtime, member.mtime))


def _copy_sparse(source: IO[bytes], out: IO[bytes]) -> None:
    """Copy, leaving a hole for every block of zeros: a sparse file stays sparse (tar carries it in full)."""
    size = 0
    while block := source.read(1 << 20):
        size += len(block)
        if block.count(0) == len(block):
            out.seek(len(block), os.SEEK_CUR)
        else:
            out.write(block)
    out.truncate(size)
    out.flush()


def _finish_directory(staging: int, parts: list[str], member: tarfile.TarInfo, keep_owner: bool) -> None:
    parent = _open_parent(staging, parts)
    try:
        fd = os.open(parts[-1], _DIR, dir_fd=parent)
    finally:
        os.close(parent)
    try:
        if keep_owner:
            os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & _PERMISSIONS)
        os.utime(fd, (member.mtime, member.mtime))
    finally:
        os.close(fd)


def _remove_tree(parent: int, name: str) -> None:
    """Remove `name` below `parent` without following links (directories made writable first)."""
    found = _lstat(name, parent)
    if found is None:
        return
    if not stat.S_ISDIR(found.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        os.fchmod(fd, 0o700)
        for entry in os.listdir(fd):
            _remove_tree(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _merge(source_parent: int, source_name: str, target_parent: int, target_name: str) -> None:
    """Move the entries of a staged directory into an existing one (files overwrite)."""
    source = os.open(source_name, _DIR, dir_fd=source_parent)
    try:
        target = os.open(target_name, _DIR, dir_fd=target_parent)
        try:
            os.fchmod(source, 0o700)  # being emptied: its entries must be movable out of it
            for entry in os.listdir(source):
                moved = os.stat(entry, dir_fd=source, follow_symlinks=False)
                present = _lstat(entry, target)
                if stat.S_ISDIR(moved.st_mode) and present is not None and stat.S_ISDIR(present.st_mode):
                    _merge(source, entry, target, entry)
                    continue
                if present is not None and stat.S_ISDIR(present.st_mode):
                    _remove_tree(target, entry)
                os.replace(entry, entry, src_dir_fd=source, dst_dir_fd=target)
        finally:
            os.close(target)
    finally:
        os.close(source)


def extract_copy(archive: IO[bytes], root: str, destination: str, *, keep_owner: bool,
                 max_bytes: int | None = None) -> None:
    """Place the archive's `root` entry (the copied path's basename) at `destination`.

    `archive` must be seekable (hard links are read back from it).
    """
    if not root or "/" in root or root in (".", ".."):
        raise ArchiveRefused(f"the engine named the copied path {root!r}, which is not a plain name")
    parent_path, name = posixpath.split(destination)
    parent = open_directory(parent_path or "/")
    final_parent, final_name = parent, name
    try:
        found = _lstat(name, parent) if name else None
        if not name or (found is not None and stat.S_ISDIR(found.st_mode)):
            final_parent = os.open(name, _DIR, dir_fd=parent) if name else os.dup(parent)
            final_name = root
        staging_name = f".coldsnap-copy-{secrets.token_hex(8)}"
        try:
            os.mkdir(staging_name, 0o700, dir_fd=final_parent)
        except OSError as exc:
            where = destination if final_parent != parent else (parent_path or "/")
            raise ArchiveRefused(f"cannot write under {where}: {exc.strerror}") from exc
        try:
            staging = os.open(staging_name, _DIR, dir_fd=final_parent)
            try:
                _stage(archive, root, staging, keep_owner, max_bytes)
                _place(staging, root, final_parent, final_name, shown=posixpath.join(destination, final_name)
                       if final_parent != parent else destination)
            finally:
                os.close(staging)
        finally:
            _remove_tree(final_parent, staging_name)
    finally:
        if final_parent != parent:
            os.close(final_parent)
        os.close(parent)


def _stage(archive: IO[bytes], root: str, staging: int, keep_owner: bool, max_bytes: int | None) -> None:
    directories: list[tuple[list[str], tarfile.TarInfo]] = []
    with tarfile.open(fileobj=archive, mode="r:") as tar:  # the engine sends a plain tar
        for member in check_members(tar, root, max_bytes):
            parts = member.name.split("/")
            parent = _open_parent(staging, parts)
            try:
                _extract_member(tar, member, parent, parts[-1], keep_owner)
            finally:
                os.close(parent)
            if member.isdir():
                directories.append((parts, member))
    if _lstat(root, staging) is None:
        raise ArchiveRefused("the archive did not contain the copied path")
    for parts, member in sorted(directories, key=lambda item: -len(item[0])):  # deepest first
        _finish_directory(staging, parts, member, keep_owner)


def _place(staging: int, root: str, final_parent: int, final_name: str, *, shown: str) -> None:
    copied = os.stat(root, dir_fd=staging, follow_symlinks=False)
    present = _lstat(final_name, final_parent)
    if present is not None and stat.S_ISDIR(present.st_mode):
        if not stat.S_ISDIR(copied.st_mode):
            raise ArchiveRefused(f"cannot overwrite directory {shown} with a non-directory")
        _merge(staging, root, final_parent, final_name)
        return
    if present is not None and stat.S_ISDIR(copied.st_mode):
        raise ArchiveRefused(f"cannot copy a directory onto the file {shown}")
    os.replace(root, final_name, src_dir_fd=staging, dst_dir_fd=final_parent)


# --- pack: build contexts ------------------------------------------------------------------


def _ignore_patterns(data: str) -> list[tuple[bool, str]]:
    """``.dockerignore`` lines as (negated, pattern), in order (the last match decides)."""
    patterns = []
    for line in data.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = posixpath.normpath(line[1:] if negate else line).lstrip("/")
        patterns.append((negate, pattern))
    return patterns


def _ignored(rel: str, patterns: list[tuple[bool, str]]) -> bool:
    ignored = False
    for negate, pattern in patterns:
        if fnmatch.fnmatchcase(rel, pattern) or rel.startswith(pattern + "/"):
            ignored = not negate
    return ignored


def _unreadable(path: str, exc: OSError) -> ArchiveRefused:
    return ArchiveRefused(f"cannot read {path}: {exc.strerror or exc}")


def _read_dockerignore(root: int, path: str) -> list[tuple[bool, str]]:
    try:
        fd = os.open(".dockerignore", _READ, dir_fd=root)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ArchiveRefused(f"{path}/.dockerignore is a symbolic link; it is not followed") from exc
        raise _unreadable(f"{path}/.dockerignore", exc) from exc
    with os.fdopen(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArchiveRefused(f"{path}/.dockerignore is not a regular file")
        return _ignore_patterns(source.read().decode("utf-8", "replace"))


def _header(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    info.uid = info.gid = 0  # as the Docker CLI sends a context
    info.uname = info.gname = ""
    return info


def _changed(path: str) -> ArchiveRefused:
    return ArchiveRefused(f"{path} changed while the build context was read")


def _pack_entry(tar: TarOut, parent: int, name: str, arcname: str, path: str,
                patterns: list[tuple[bool, str]], rel: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return  # removed meanwhile: as if it never was
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    if stat.S_ISDIR(st.st_mode):
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _changed(path) from exc
            raise _unreadable(path, exc) from exc
        try:
            info = _header(arcname, os.fstat(fd))
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
            _pack_directory(tar, fd, arcname + "/", path, patterns, rel + "/")
        finally:
            os.close(fd)
    elif stat.S_ISREG(st.st_mode):
        try:
            fd = os.open(name, _READ, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _changed(path) from exc
            raise _unreadable(path, exc) from exc
        with os.fdopen(fd, "rb"):
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode):
                raise _changed(path)
            info = _header(arcname, opened)
            info.size = opened.st_size
            try:
                tar.addfile(info, fd, path)
            except OSError as exc:
                raise _unreadable(path, exc) from exc
    elif stat.S_ISLNK(st.st_mode):
        info = _header(arcname, st)
        info.type = tarfile.SYMTYPE
        try:
            info.linkname = os.readlink(name, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # no longer a link
                raise _changed(path) from exc
            raise _unreadable(path, exc) from exc
        tar.addfile(info)
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        info = _header(arcname, st)  # the header only: nothing is opened
        info.type = (tarfile.CHRTYPE if stat.S_ISCHR(st.st_mode) else
                     tarfile.BLKTYPE if stat.S_ISBLK(st.st_mode) else tarfile.FIFOTYPE)
        if not stat.S_ISFIFO(st.st_mode):
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
        tar.addfile(info)
    # sockets (and anything else) are skipped, as the Docker CLI does


def _pack_directory(tar: TarOut, fd: int, prefix: str, path: str,
                    patterns: list[tuple[bool, str]], rel: str) -> None:
    try:
        names = sorted(os.listdir(fd))
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    for name in names:
        if patterns and _ignored(rel + name, patterns):
            continue  # an ignored directory is not entered
        _pack_entry(tar, fd, name, prefix + name, f"{path}/{name}", patterns, rel + name)


def pack(job: dict[str, object], out: IO[bytes]) -> None:
    """Write one tar of the job's trees and files to `out`, a file or pipe (written in order, nothing sought).

    `job` = ``{"trees": [{"path", "prefix", "label", "dockerignore", "reserved"}],
    "files": [{"name", "data"}], "max_bytes": N}``: each tree's directory ``path`` goes under ``prefix``
    (``""`` or ``"dir/"``); ``label`` names it in errors; with ``dockerignore`` its
    ``.dockerignore`` applies; a top-level entry named in ``reserved`` is refused. Files
    are the job's own text (the Dockerfile), added last, 0644. A tar that would pass
    ``max_bytes`` (when given) is refused.
    """
    trees = job.get("trees")
    files = job.get("files")
    if not isinstance(trees, list) or not isinstance(files, list) or not all(
            isinstance(item, dict) for item in [*trees, *files]):
        raise ArchiveRefused("the pack job has no trees or files")
    out.flush()
    tar = TarOut(out.fileno(), limit if isinstance(limit := job.get("max_bytes"), int) else None,
                 refused=ArchiveRefused, changed=_changed)
    for tree in trees:
        path, prefix, label = str(tree["path"]), str(tree["prefix"]), str(tree["label"])
        try:
            root = os.open(path, _TREE)
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise ArchiveRefused(f"build {label} {path} is not a directory on this node") from exc
        except OSError as exc:
            raise _unreadable(path, exc) from exc
        try:
            if prefix:
                info = _header(prefix.rstrip("/"), os.fstat(root))
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                try:
                    present = sorted(set(os.listdir(root)) & {str(r) for r in tree.get("reserved") or []})
                except OSError as exc:
                    raise _unreadable(path, exc) from exc
                if present:
                    raise ArchiveRefused(f"the build context must not contain {present[0]!r} (reserved)")
            patterns = _read_dockerignore(root, path) if tree.get("dockerignore") else []
            _pack_directory(tar, root, prefix, path.rstrip("/"), patterns, "")
        finally:
            os.close(root)
    for item in files:
        data = str(item["data"]).encode()
        info = tarfile.TarInfo(str(item["name"]))
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, data)
    tar.close()


def _job(data: bytes) -> dict[str, object]:
    try:
        job = json.loads(data)
    except ValueError as exc:
        raise ArchiveRefused(f"the pack job is not JSON: {exc}") from exc
    if not isinstance(job, dict):
        raise ArchiveRefused("the pack job is not a JSON object")
    return job


def _drop(identity: tuple[int, int] | None) -> None:
    """Take `identity` (None: keep the daemon's own) with no capability; a root daemon keeps root only
    when it is asked to. The rules live in ``_privileges.py`` beside this file, loaded by path: run as
    a program, this file has no package to import it from."""
    if identity is None and os.geteuid() == 0:
        return  # the daemon's own identity is root: nothing to drop (exec.user is empty)
    privileges = _sibling("_privileges")
    try:
        if identity is None:
            privileges.shed()
        else:
            privileges.become(*identity)
    except privileges.DropFailed as exc:
        raise ArchiveRefused(str(exc)) from exc


def _option(args: list[str], flag: str, count: int) -> tuple[int, ...] | None:
    """Take ``flag N[:N]`` out of `args`: its `count` non-negative numbers, None when absent, () when malformed."""
    if flag not in args:
        return None
    at = args.index(flag)
    text = args[at + 1] if at + 1 < len(args) else ""
    del args[at:at + 2]
    numbers = tuple(int(p) for p in text.split(":") if p.isdigit())
    return numbers if len(numbers) == count == len(text.split(":")) else ()


def main(argv: list[str]) -> int:
    """``_archive.py ROOT DESTINATION [--as UID:GID] [--keep-owner] [--max-bytes N]`` with the tar on
    stdin, or ``_archive.py --pack [--as UID:GID]`` with the JSON job on stdin and the tar on stdout."""
    keep_owner = "--keep-owner" in argv
    packing = "--pack" in argv
    args = [a for a in argv if a not in ("--keep-owner", "--pack")]
    as_ids, limit = _option(args, "--as", 2), _option(args, "--max-bytes", 1)
    identity = (as_ids[0], as_ids[1]) if as_ids else None
    bad = as_ids == () or limit == ()
    if packing and (args or keep_owner or limit is not None or bad):
        sys.stderr.write("usage: _archive.py --pack [--as UID:GID] < job.json > context.tar\n")
        return 2
    if not packing and (len(args) != 2 or not args[1].startswith("/") or bad):
        sys.stderr.write("usage: _archive.py ROOT /ABSOLUTE/DESTINATION [--as UID:GID] [--keep-owner] "
                         "[--max-bytes N] < archive.tar\n")
        return 2
    try:
        _drop(identity)
        if packing:
            pack(_job(sys.stdin.buffer.read()), sys.stdout.buffer)
        else:
            extract_copy(sys.stdin.buffer, args[0], args[1], keep_owner=keep_owner,
                         max_bytes=limit[0] if limit else None)
    except ArchiveRefused as exc:
        sys.stderr.write(f"{exc}\n")
        return 1
    except (OSError, tarfile.TarError, EOFError, KeyError, TypeError) as exc:
        detail = f"{exc.strerror}: {exc.filename}" if isinstance(exc, OSError) and exc.filename else str(exc)
        sys.stderr.write(f"{detail}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

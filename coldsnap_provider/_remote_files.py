"""Placing a tar's tree on a remote host over SFTP (`upload` and remote `workload-copy-from`).

Both operations follow `cp`/`docker cp` placement: an existing directory destination receives the copied
entry under its own name; otherwise the entry becomes the destination, whose parent must exist. A new tree is
assembled in a private staging directory beside its final place and renamed into place, so a failed copy
leaves nothing half-written there; files always land through a temporary name and an atomic rename, so an
existing symbolic link at a destination name is replaced, never followed. Setuid, setgid and sticky bits are
dropped, ownership is the SSH user's (the identity remote exec runs as), and device nodes and FIFOs are refused.
"""

from __future__ import annotations

import posixpath
import secrets
import stat
import tarfile
from typing import IO

import anyio
import anyio.to_thread
import asyncssh

from coldsnap_runtime.backend import ArchiveRefused, check_members

from ._errors import PlacementError

__all__ = ("PlacementError", "place_tar")

_CHUNK = 1 << 20
_MODE_BITS = 0o777  # no setuid/setgid/sticky bits on anything we create


def _checked(tar: tarfile.TarFile, root: str) -> list[tarfile.TarInfo]:
    """The copy's members under the same rules as a local copy-from, `root` itself first."""
    try:
        members = check_members(tar, root)
    except ArchiveRefused as exc:
        raise PlacementError(str(exc)) from exc
    if not members or members[0].name != root:
        raise PlacementError("the archive did not contain the copied path")
    return members


async def _lstat(sftp: asyncssh.SFTPClient, path: str) -> asyncssh.SFTPAttrs | None:
    try:
        return await sftp.lstat(path)
    except asyncssh.SFTPNoSuchFile:
        return None


def _is_dir(attrs: asyncssh.SFTPAttrs | None) -> bool:
    return attrs is not None and attrs.permissions is not None and stat.S_ISDIR(attrs.permissions)


async def place_tar(sftp: asyncssh.SFTPClient, archive: IO[bytes], root: str, destination: str) -> str:
    """Place the archive's `root` entry at (or, for an existing directory, under) `destination`; returns where."""
    tar = await anyio.to_thread.run_sync(lambda: tarfile.open(fileobj=archive, mode="r:"))  # noqa: SIM115
    try:
        members = await anyio.to_thread.run_sync(_checked, tar, root)
        dest_attrs = await _lstat(sftp, destination)
        final = posixpath.join(destination, root) if _is_dir(dest_attrs) else destination
        parent = posixpath.dirname(final) or "/"
        if not _is_dir(await _lstat(sftp, parent)):
            raise PlacementError(f"destination directory {parent} does not exist")
        final_attrs = await _lstat(sftp, final)
        copied_is_dir = members[0].isdir()
        if _is_dir(final_attrs):
            if not copied_is_dir:
                raise PlacementError(f"cannot overwrite directory {final} with a non-directory")
            await _write(sftp, tar, members, root, final)  # merge into the existing directory
            return final
        if final_attrs is not None and copied_is_dir:
            raise PlacementError(f"cannot copy a directory onto the file {final}")
        if not copied_is_dir:
            await _write(sftp, tar, members, root, final)
            return final
        staging = posixpath.join(parent, f".coldsnap-copy-{secrets.token_hex(6)}")
        await sftp.mkdir(staging, asyncssh.SFTPAttrs(permissions=0o700))
        try:
            await _write(sftp, tar, members, root, posixpath.join(staging, root))
            await sftp.posix_rename(posixpath.join(staging, root), final)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                try:
                    await sftp.rmtree(staging, ignore_errors=True)
                except (asyncssh.Error, OSError):
                    pass  # best effort: a leftover staging directory is hidden and harmless
        return final
    finally:
        tar.close()


async def _write(sftp: asyncssh.SFTPClient, tar: tarfile.TarFile, members: list[tarfile.TarInfo],
                 root: str, target: str) -> None:
    """Write every member, the archive's `root` becoming `target`."""
    directories: list[tuple[str, int]] = []
    for member in members:
        path = target + member.name[len(root):]
        mode = member.mode & _MODE_BITS
        if member.isdir():
            attrs = await _lstat(sftp, path)
            if attrs is None:
                await sftp.mkdir(path, asyncssh.SFTPAttrs(permissions=0o700))
                directories.append((path, mode))
            elif not _is_dir(attrs):
                raise PlacementError(f"cannot overwrite the non-directory {path} with a directory")
            continue
        temporary = posixpath.join(posixpath.dirname(path), f".coldsnap-part-{secrets.token_hex(6)}")
        try:
            if member.issym():
                await sftp.symlink(member.linkname, temporary)
            else:  # regular file or hard link (written as a copy of its target)
                source = tar.extractfile(member)
                if source is None:
                    raise PlacementError(f"archive entry {member.name!r} has no data")
                async with sftp.open(temporary, "wb", asyncssh.SFTPAttrs(permissions=0o600), encoding=None) as f:
                    while chunk := await anyio.to_thread.run_sync(source.read, _CHUNK):
                        await f.write(chunk)
                await sftp.chmod(temporary, mode, follow_symlinks=False)
            await sftp.posix_rename(temporary, path)
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                try:
                    await sftp.remove(temporary)
                except (asyncssh.Error, OSError):
                    pass  # it was never created, or the link is gone: nothing to undo
            raise
    # Directory modes last (deepest first), so a read-only directory does not block its own contents.
    for path, mode in reversed(directories):
        await sftp.chmod(path, mode, follow_symlinks=False)

"""Trees between this node and a remote node: upload and copy-from destinations out, build contexts in.

Everything moves as a tar spooled in a private directory of the spool directory (``[docker] spool_dir``,
on disk; never the state directory, which is tmpfs under the unit), bounded by
``[docker] copy_max_bytes`` counted as the tar's size:

* out (``upload``, remote ``workload-copy-from``): the tar is placed over SFTP by :func:`._remote_files.place_tar`,
  as the SSH user;
* in (``image-build`` contexts): the node makes the tar itself (``tar`` run there over the link, the context's
  real path resolved there), and it is extracted here by the same program and under the same member rules
  as a local ``workload-copy-from`` (``coldsnap_runtime.backend.extract_archive``): entries are created
  relative to directory descriptors with ``O_NOFOLLOW|O_EXCL``; names outside the tree, entries below a
  symbolic link, names listed twice, devices and FIFOs are refused. Nothing relies on the SSH library's
  client-side checks (an SFTP peer is the remote user's to replace, through ``command=``).
"""

from __future__ import annotations

import os
import posixpath
import shlex
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from typing import IO, cast

import anyio
import anyio.to_thread
import asyncssh

from coldsnap_runtime.backend import extract_archive
from coldsnap_runtime.errors import CommandFailed, RuntimeFailed

from ._errors import PlacementError
from ._exec import ExecIdentity, as_identity, child_environment
from ._remote_files import place_tar
from ._remote_link import RemoteLink
from ._spool import Spool

__all__ = ("RemoteFiles",)

_MESSAGE_LIMIT = 4096
# Resolves the context's real path on the node (a link to it is the user's own business there), refuses
# anything but a directory other than /, and writes the tar of that one directory, named by its basename.
_TREE_TAR = (
    "p=$(realpath -e -- {path}) || exit 1;"
    " [ -d \"$p\" ] && [ \"$p\" != / ] || {{ echo \"$p is not a directory (or is /)\" >&2; exit 1; }};"
    " cd -- \"${{p%/*}}/\" && exec tar -c -f - -- \"${{p##*/}}\""
)


class RemoteFiles:
    """File transfers to and from one node, over its link."""

    def __init__(self, link: RemoteLink, spool: Spool) -> None:
        self._link = link
        self.spool = spool

    async def _place(self, archive_path: str, root: str, destination: str, *, action: str) -> None:
        conn = await self._link.connect(action)
        archive = await anyio.to_thread.run_sync(lambda: open(archive_path, "rb"))  # noqa: SIM115 - closed below
        try:
            with self._link.link_errors(action):
                async with self._link.sessions, conn.start_sftp_client() as sftp:
                    try:
                        await place_tar(sftp, archive, root, destination)
                    except PlacementError as exc:
                        raise RuntimeFailed(action=action, detail=str(exc)) from exc
                    except asyncssh.SFTPError as exc:
                        raise RuntimeFailed(action=action, detail=f"on host {self._link.name}: {exc.reason}") from exc
        finally:
            archive.close()

    async def place_local_tree(self, local: str, root: str, destination: str, *, action: str) -> None:
        """Send a private local tree (already checked) to `destination` on the node."""
        archive = os.path.join(os.path.dirname(local), "tree.tar")

        def pack() -> None:
            with open(archive, "wb") as out:
                holes = _HoleWriter(out)
                with tarfile.open(fileobj=cast(IO[bytes], holes), mode="w") as tar:
                    tar.add(local, arcname=root, recursive=True)
                holes.finish()

        await anyio.to_thread.run_sync(pack)
        if os.path.getsize(archive) > self.spool.max_bytes:
            raise self.spool.too_large(action)
        await self._place(archive, root, destination, action=action)

    async def upload(self, sources: list[str], destination: str, *, recursive: bool,
                     identity: ExecIdentity) -> None:
        """`cp [-R] SOURCES DESTINATION` from this node (read as exec.user) to the remote node (SFTP)."""
        conn = await self._link.connect("upload")
        if len(sources) > 1:
            with self._link.link_errors("upload"):
                async with self._link.sessions, conn.start_sftp_client() as sftp:
                    if not await sftp.isdir(destination):
                        raise RuntimeFailed(action="upload", detail=f"target {destination} is not a directory")
        for source in sources:
            parent, base = os.path.split(source.rstrip("/") or "/")
            if not base:
                raise RuntimeFailed(action="upload", detail="cannot copy /")
            with self.spool.staging("upload") as staging:
                archive = os.path.join(staging, "upload.tar")
                code, message = await _tar_as(identity, parent or "/", base, archive, recursive=recursive,
                                             limit=self.spool.max_bytes)
                if code == _TOO_LARGE:
                    raise self.spool.too_large("upload")
                if code != 0:
                    raise CommandFailed(action="upload", status=f"cannot read {source}", output=message)
                if not recursive and await anyio.to_thread.run_sync(_first_is_dir, archive):
                    raise RuntimeFailed(action="upload", detail=f"-r not specified; omitting directory {source}")
                await self._place(archive, base, destination, action="upload")

    async def fetch_tree(self, remote: str, local: str) -> str:
        """Copy the remote directory `remote` to the new local path `local` (see the module docstring)."""
        action = "image-build"
        conn = await self._link.connect(action)
        with tempfile.TemporaryFile(dir=os.path.dirname(local), prefix="fetch-") as spool:
            async with self._link.sessions:
                with self._link.link_errors(action):
                    process = await conn.create_process(_TREE_TAR.format(path=shlex.quote(remote)), encoding=None,
                                                        stdin=asyncssh.DEVNULL)
                    try:
                        message = await self._receive(process, spool.write, action=action)
                        await process.wait_closed()
                    finally:
                        process.close()
            if process.exit_status != 0:
                raise CommandFailed(action=action, status=f"build context {remote} on host {self._link.name}",
                                    output=message or "tar failed")
            await anyio.to_thread.run_sync(spool.flush)
            spool.seek(0)
            root = await anyio.to_thread.run_sync(_root_directory, spool, remote)
            spool.seek(0)
            os.lseek(spool.fileno(), 0, os.SEEK_SET)  # a seek inside the read buffer moves no descriptor
            await extract_archive(spool, root, local, owner=None, action=action, max_bytes=self.spool.max_bytes)
        return local

    async def _receive(self, process: asyncssh.SSHClientProcess[bytes], write: Callable[[bytes], object], *,
                       action: str) -> str:
        """Spool the process's stdout (bounded); its stderr, truncated, is returned."""
        message = bytearray()
        total = 0

        async def errors() -> None:
            while chunk := await process.stderr.read(1 << 12):
                message.extend(chunk[: _MESSAGE_LIMIT - len(message)])

        failure: list[Exception] = []  # raised below, in this task, not as a group

        async with anyio.create_task_group() as tg:
            tg.start_soon(errors)
            try:
                while chunk := await process.stdout.read(1 << 20):
                    total += len(chunk)
                    if total > self.spool.max_bytes:
                        raise self.spool.too_large(action)
                    await anyio.to_thread.run_sync(write, chunk)
            except Exception as exc:
                failure.append(exc)
                tg.cancel_scope.cancel()
        if failure:
            raise failure[0]
        return message.decode("utf-8", "replace").strip()


class _HoleWriter:
    """Writes runs of zeros as holes: tar carries a sparse file in full, the spool need not."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out, self._size = out, 0

    def write(self, data: bytes) -> int:
        if data.count(0) == len(data):
            self._out.seek(len(data), os.SEEK_CUR)
        else:
            self._out.write(data)
        self._size += len(data)
        return len(data)

    def tell(self) -> int:
        return self._size

    def finish(self) -> None:
        """Give a trailing hole (the tar's end blocks) its size."""
        self._out.truncate(self._size)


def _root_directory(spool: IO[bytes], remote: str) -> str:
    """The tar's first entry: the context directory itself, under its plain name."""
    try:
        with tarfile.open(fileobj=spool, mode="r:") as tar:
            first = tar.next()
    except tarfile.TarError as exc:
        raise RuntimeFailed(action="image-build", detail=f"build context {remote}: not a tar: {exc}") from exc
    name = posixpath.normpath(first.name) if first is not None else ""
    if first is None or not first.isdir() or "/" in name or name in (".", ".."):
        raise RuntimeFailed(action="image-build", detail=(
            f"build context {remote}: the node's tar does not start with the context directory"))
    return name


def _first_is_dir(archive: str) -> bool:
    with tarfile.open(archive, "r:") as tar:
        first = tar.next()
        return first is not None and first.isdir()


_TOO_LARGE = -1


async def _tar_as(identity: ExecIdentity, parent: str, base: str, archive: str, *, recursive: bool,
                  limit: int) -> tuple[int, str]:
    """`tar` of parent/base into the file `archive`, run as exec.user (so only what that user may read is sent).

    Returns tar's exit status and message, or _TOO_LARGE once the tar passes `limit` bytes (tar is killed).
    """
    argv = ["tar", "-c", "-f", "-", "-C", parent, *([] if recursive else ["--no-recursion", "-h"]), "--", base]
    async with await anyio.open_process(as_identity(argv, identity), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        env=child_environment(identity), start_new_session=True) as process:
        assert process.stdout is not None and process.stderr is not None
        message = bytearray()
        too_large = False

        async def errors() -> None:
            assert process.stderr is not None
            async for chunk in process.stderr:
                message.extend(chunk[: _MESSAGE_LIMIT - len(message)])

        out = await anyio.to_thread.run_sync(lambda: open(archive, "wb"))  # noqa: SIM115 - closed below
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(errors)
                async for chunk in process.stdout:
                    if out.tell() + len(chunk) > limit:
                        too_large = True
                        process.kill()
                        break
                    await anyio.to_thread.run_sync(out.write, chunk)
        finally:
            out.close()
        code = await process.wait()
    return (_TOO_LARGE if too_large else code), message.decode("utf-8", "replace").strip()

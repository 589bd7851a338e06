"""workload-copy-from: the engine's archive spooled in the daemon's own directory, then extracted as the owner.

Host paths a manager names are never opened by this process: the destination is written by
``_archive.py`` running as the session's owner, in a child process fed the spool on stdin.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import aiohttp
import anyio
import anyio.to_thread

from ..errors import NotFound, PathNotFound, RuntimeFailed
from ._base import Owner
from ._engine import Engine, docker_errors

__all__ = ("copy_out", "extract_archive", "path_stat")

_ACTION = "workload-copy-from"
# The extractor of workload-copy-from, run by path in a child process as the owner.
_ARCHIVE_PROGRAM = str(Path(__file__).with_name("_archive.py"))


async def copy_out(engine: Engine, container_id: str, *, name: str, path: str, destination: str,
                   owner: Owner | None, spool_dir: str | None, max_bytes: int | None) -> None:
    """`path` of container `container_id` (workload `name`) to `destination` on the host, written as `owner`.

    `max_bytes` bounds the spooled archive (None: unbounded, for library callers).
    """
    # Spooled in the daemon's own directory; only the extractor, as `owner`, writes at the destination.
    with tempfile.TemporaryFile(dir=spool_dir, prefix="coldsnap-copy-") as spool:
        try:
            with docker_errors(_ACTION, kind="path", ref=path):
                async with engine.stream(f"containers/{quote(container_id, safe='')}/archive",
                                         params={"path": path}) as response:
                    stat = path_stat(response.headers.get("X-Docker-Container-Path-Stat", ""))
                    await _spool_copy(response.content, spool, spool_dir=spool_dir, max_bytes=max_bytes)
        except NotFound as exc:
            raise PathNotFound(workload=name, path=path, action=_ACTION) from exc
        spool.seek(0)
        root = str(stat.get("name") or os.path.basename(path))
        await extract_archive(spool, root, destination, owner=owner, action=_ACTION, max_bytes=max_bytes)


async def _spool_copy(content: aiohttp.StreamReader, spool: IO[bytes], *, spool_dir: str | None,
                      max_bytes: int | None) -> None:
    """The engine's tar into `spool`, bounded by its size (a sparse file counts in full, as the tar
    carries it); runs of zeros become holes, so the spool on disk stays as sparse as the files were."""
    total = 0
    async for data in content.iter_chunked(1 << 20):
        total += len(data)
        if max_bytes is not None and total > max_bytes:
            raise RuntimeFailed(action=_ACTION, detail=(
                f"the copy exceeds {max_bytes} bytes (docker.copy_max_bytes); nothing was placed"))
        with _spooling(spool_dir):
            if data.count(0) == len(data):
                spool.seek(len(data), os.SEEK_CUR)
            else:
                await anyio.to_thread.run_sync(spool.write, data)
    with _spooling(spool_dir):
        spool.truncate(total)  # a trailing hole has a size too
        await anyio.to_thread.run_sync(spool.flush)


@contextmanager
def _spooling(spool_dir: str | None) -> Iterator[None]:
    """A full or failing spool is ours, not the engine's: say where (docker.spool_dir)."""
    try:
        yield
    except OSError as exc:
        raise RuntimeFailed(action=_ACTION, detail=(
            f"cannot spool the copy in {spool_dir or tempfile.gettempdir()}: {exc.strerror}")) from exc


def path_stat(header: str) -> dict[str, Any]:
    """The engine's X-Docker-Container-Path-Stat header (base64 JSON); {} when absent or malformed."""
    try:
        value = json.loads(base64.b64decode(header or "e30="))
    except (ValueError, binascii.Error):
        return {}
    return value if isinstance(value, dict) else {}


async def extract_archive(spool: IO[bytes], root: str, destination: str, *, owner: Owner | None,
                          action: str, max_bytes: int | None) -> None:
    """Run the extractor program with `spool` on stdin; it drops to `owner` before touching the destination,
    and writes at most `max_bytes` (hard links count again)."""
    argv = [sys.executable, "-I", "-S", _ARCHIVE_PROGRAM, root, destination]
    if max_bytes is not None:
        argv += ["--max-bytes", str(max_bytes)]
    if owner is not None:
        argv += ["--as", f"{owner.uid}:{owner.gid}"]
    if os.geteuid() == 0 and (owner is None or owner.uid == 0):
        argv.append("--keep-owner")  # a root writer keeps numeric ownership, as `docker cp` does
        # (only a root daemon: under the unit, uid 0 holds no CAP_CHOWN after the drop)
    try:
        result = await anyio.run_process(argv, stdin=spool, check=False, cwd="/",
                                         env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"})
    except OSError as exc:
        raise RuntimeFailed(action=action, detail=f"cannot start the extractor: {exc}") from exc
    if result.returncode != 0:
        lines = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise RuntimeFailed(action=action, detail=lines[-1] if lines else f"extractor exited {result.returncode}")

"""Real peers for the node hydrator's checks: processes that connect to a Unix socket and stay connected, run
as another uid, without capabilities, or in a mount namespace of their own (`unshare`), as a tenant's
process or root in another container would be. They need nothing but /usr/bin/python3's standard library."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from coldsnap_probe import jsonline

# Connects to argv[1], says "connected" and holds the connection until its stdin closes.
HOLD = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\nprint('connected', "
        "flush=True)\nsys.stdin.read()\n")
AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
NO_CAPABILITIES = ("setpriv", "--inh-caps=-all", "--bounding-set=-all")  # root, and an exec drops every one


def as_uid(uid: int, *groups: int) -> tuple[str, ...]:
    """setpriv's prefix for a process of `uid` (its gid the same) with the supplementary `groups`."""
    return ("setpriv", f"--reuid={uid}", f"--regid={uid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups")


def hiding(directory: Path) -> tuple[str, ...]:
    """A prefix that runs the peer in a mount namespace of its own where `directory` is an empty tmpfs: root
    there, as in another container, without the files beneath it."""
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c",
            f"mount -t tmpfs none {shlex.quote(str(directory))} && exec \"$@\"", "sh")


@contextlib.contextmanager
def listening() -> Iterator[tuple[socket.socket, Path]]:
    """A listening socket every uid may reach (in a fresh 0755 directory under /tmp)."""
    directory = Path(tempfile.mkdtemp(prefix="cs-peers-", dir="/tmp"))
    directory.chmod(0o755)
    path = directory / "s.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        path.chmod(0o777)
        listener.listen()
        listener.settimeout(20.0)
        yield listener, path
    finally:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def connected(listener: socket.socket, path: Path, prefix: Sequence[str] = ()) -> Iterator[
        tuple[socket.socket, jsonline.Peer, subprocess.Popen[str]]]:
    """A peer process (`prefix` before /usr/bin/python3) connected to `listener`: the accepted connection, its
    SO_PEERCRED and the process, which holds the connection until the block ends."""
    proc = subprocess.Popen([*prefix, "/usr/bin/python3", "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "connected", proc.poll()
        conn, _ = listener.accept()
        with conn:
            yield conn, jsonline.Peer.of(conn), proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(20)


def read_all(fd: int) -> bytes:
    """A descriptor's whole file, from offset 0 (the descriptor stays open)."""
    return os.pread(fd, os.fstat(fd).st_size, 0)


# Sends argv[2] (one JSON line) to the socket argv[1] and prints the answer (stdlib only).
ASK = """
import json, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    s.sendall(sys.argv[2].encode() + b"\\n")
    data = b"".join(iter(lambda: s.recv(65536), b""))
print(data.decode().strip())
"""


def ask_as(prefix: Sequence[str], path: Path | str, message: dict[str, Any]) -> dict[str, Any]:
    """`message` sent to the socket at `path` by a peer process started with `prefix`; its answer."""
    out = subprocess.run([*prefix, "/usr/bin/python3", "-c", ASK, str(path), json.dumps(message)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return dict(json.loads(out))

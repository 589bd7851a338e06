"""A hostile remote SSH user's forced command (authorized_keys `command=`), run by a real sshd on node-b.

Usage: ``_hostile_peer.py TREE.json``. The tree file lists entries in order, each
``{"name": "ctx/...", "type": "dir"|"file"|"link"|"hardlink", "target": "...", "data": "..."}``; the first
is the tree's root. Depending on what the client asked for (``$SSH_ORIGINAL_COMMAND``):

* the SFTP subsystem: a minimal SFTP v3 server whose READDIR lists the tree's children in that order,
  a name listed twice included (the first a symbolic link, the second a file);
* a `tar -c` of a tree (what the provider runs to fetch a build context): those entries as a tar;
* anything else: the command itself, through ``sh -c`` (the provider's helper commands keep working).

Standard library only: it runs with the node's own python3.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import struct
import sys
import tarfile
from typing import Any, BinaryIO

_ATTR_SIZE, _ATTR_PERMISSIONS = 0x1, 0x4
_MODES = {"dir": 0o040755, "file": 0o100644, "link": 0o120777, "hardlink": 0o100644}


def _tar(tree: list[dict[str, Any]], out: BinaryIO) -> None:
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.GNU_FORMAT) as tar:
        for entry in tree:
            info = tarfile.TarInfo(entry["name"])
            data = entry.get("data", "").encode()
            info.type = {"dir": tarfile.DIRTYPE, "file": tarfile.REGTYPE, "link": tarfile.SYMTYPE,
                         "hardlink": tarfile.LNKTYPE}[entry["type"]]
            info.mode = 0o755 if entry["type"] == "dir" else 0o644
            info.linkname = entry.get("target", "")
            info.size = len(data) if entry["type"] == "file" else 0
            tar.addfile(info, io.BytesIO(data) if entry["type"] == "file" else None)


class _Sftp:
    """Just what asyncssh's recursive `get` asks: LSTAT/STAT, OPENDIR/READDIR, READLINK, OPEN/READ, CLOSE."""

    def __init__(self, tree: list[dict[str, Any]], base: str) -> None:
        self.tree, self.base = tree, base.rstrip("/")
        self.root = tree[0]["name"]
        self.handles: dict[bytes, Any] = {}

    def _entries(self, path: str) -> list[dict[str, Any]]:
        """Every entry whose name maps to `path` (a name listed twice has two)."""
        if path == self.base:
            return [self.tree[0]]
        rel = path[len(self.base) + 1:] if path.startswith(self.base + "/") else None
        return [e for e in self.tree[1:] if rel is not None and e["name"] == f"{self.root}/{rel}"]

    def _children(self, path: str) -> list[dict[str, Any]]:
        rel = self.root if path == self.base else f"{self.root}/{path[len(self.base) + 1:]}"
        return [e for e in self.tree[1:] if posixpath.dirname(e["name"]) == rel]

    @staticmethod
    def _attrs(entry: dict[str, Any]) -> bytes:
        size = len(entry.get("data", "").encode()) if entry["type"] == "file" else 0
        return struct.pack(">IQI", _ATTR_SIZE | _ATTR_PERMISSIONS, size, _MODES[entry["type"]])

    def answer(self, kind: int, rid: int, body: bytes) -> tuple[int, bytes]:
        def string(at: int) -> tuple[bytes, int]:
            (n,) = struct.unpack(">I", body[at:at + 4])
            return body[at + 4:at + 4 + n], at + 4 + n

        def name_reply(entries: list[tuple[str, dict[str, Any]]]) -> tuple[int, bytes]:
            out = struct.pack(">I", len(entries))
            for name, entry in entries:
                raw = name.encode()
                out += struct.pack(">I", len(raw)) + raw + struct.pack(">I", len(raw)) + raw + self._attrs(entry)
            return 104, out

        arg, _ = string(0)
        path = arg.decode()
        if kind in (7, 17):  # LSTAT, STAT
            found = self._entries(path)
            return (105, self._attrs(found[0])) if found else _status(2, "no such file")
        if kind == 16:  # REALPATH
            return name_reply([(path, {"type": "dir"})])
        if kind == 11:  # OPENDIR
            handle = os.urandom(4).hex().encode()
            self.handles[handle] = list(self._children(path))
            return 102, struct.pack(">I", len(handle)) + handle
        if kind == 12:  # READDIR: everything at once, then EOF
            pending = self.handles.get(arg)
            if not pending:
                return _status(1, "eof")
            self.handles[arg] = []
            return name_reply([(posixpath.basename(e["name"]), e) for e in pending])
        if kind == 19:  # READLINK: the first listing of the name that is a link
            links = [e for e in self._entries(path) if e["type"] == "link"]
            return name_reply([(links[0]["target"], links[0])]) if links else _status(2, "not a link")
        if kind == 3:  # OPEN: the last listing of the name (the file)
            handle = os.urandom(4).hex().encode()
            self.handles[handle] = self._entries(path)[-1].get("data", "").encode()
            return 102, struct.pack(">I", len(handle)) + handle
        if kind == 5:  # READ
            offset, length = struct.unpack(">QI", body[len(arg) + 4:len(arg) + 16])
            data = self.handles.get(arg, b"")[offset:offset + length]
            return (103, struct.pack(">I", len(data)) + data) if data else _status(1, "eof")
        if kind == 4:  # CLOSE
            self.handles.pop(arg, None)
            return _status(0, "ok")
        return _status(8, "unsupported")


def _status(code: int, message: str) -> tuple[int, bytes]:
    raw = message.encode()
    return 101, struct.pack(">II", code, len(raw)) + raw + struct.pack(">I", 0)


def _read(stream: BinaryIO, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _serve_sftp(tree: list[dict[str, Any]], base: str) -> None:
    server, rx, tx = _Sftp(tree, base), sys.stdin.buffer, sys.stdout.buffer
    try:
        while True:
            (length,) = struct.unpack(">I", _read(rx, 4))
            packet = _read(rx, length)
            kind = packet[0]
            if kind == 1:  # INIT -> VERSION 3, no extensions
                reply = struct.pack(">BI", 2, 3)
            else:
                (rid,) = struct.unpack(">I", packet[1:5])
                answer, body = server.answer(kind, rid, packet[5:])
                reply = struct.pack(">BI", answer, rid) + body
            tx.write(struct.pack(">I", len(reply)) + reply)
            tx.flush()
    except EOFError:
        return


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    command = os.environ.get("SSH_ORIGINAL_COMMAND", "")
    if "sftp" in command:
        _serve_sftp(spec["tree"], spec["base"])
    elif "tar -c -f -" in command and "realpath" in command:
        _tar(spec["tree"], sys.stdout.buffer)
        sys.stdout.buffer.flush()
    else:
        os.execv("/bin/sh", ["sh", "-c", command])


if __name__ == "__main__":
    main()

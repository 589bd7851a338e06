"""A local HTTP server speaking the part of the Hugging Face Hub API that `huggingface_hub` uses for us.

No Hub is reachable from the test machines, so this stands in for it (the one stand-in the project
allows). It implements what the real, unmodified client calls for `HfApi.model_info`/`repo_info` at a
revision, `create_branch`, and `upload_file`/`create_commit`: preupload, the LFS batch API with a basic
single-part PUT and verify, and the NDJSON commit. Authentication is checked on every call the way the
Hub answers: an unknown token is 401 "Invalid credentials in Authorization header", a read-only token
writing is 403, a missing repository is 404 `RepoNotFound`, a missing revision 404 `RevisionNotFound`.

Faults: ``stall_s`` delays every model_info answer (a silent peer); ``drop_commit_after`` makes the
next commit POST read that many body bytes and then close the connection without a reply (a network
failure in the middle of the upload).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ("HubRepo", "HubServer", "running_hub")

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES = [
    ("GET", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$"), "model_info"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$"), "create_branch"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("PUT", re.compile(r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$"), "lfs_put"),
    ("POST", re.compile(r"^/lfs-verify/(?P<oid>[0-9a-f]{64})$"), "lfs_verify"),
]
_BRANCH = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


def _new_commit() -> str:
    return hashlib.sha1(secrets.token_bytes(16)).hexdigest()


@dataclass
class HubRepo:
    """A model repository: branches point at commits; a commit is a full file tree."""

    branches: dict[str, str] = field(default_factory=dict)
    trees: dict[str, dict[str, bytes]] = field(default_factory=dict)

    @classmethod
    def new(cls) -> HubRepo:
        commit = _new_commit()
        return cls(branches={"main": commit}, trees={commit: {}})

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.trees else None

    def files(self, revision: str) -> dict[str, bytes]:
        return self.trees[self.branches[revision]]


@dataclass
class HubServer:
    """State of the fake Hub; the handler threads take `lock` around every change."""

    url: str = ""
    tokens: dict[str, str] = field(default_factory=dict)  # token -> "read" | "write"
    repos: dict[str, HubRepo] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)
    lfs_threshold: int = 1 << 20  # files at least this big go through LFS
    drop_commit_after: int | None = None
    answer_sha: str | None = None  # set: model_info answers this instead of the real commit
    stall_s: float = 0.0  # model_info waits this long before answering (a silent peer)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, authorization)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # --- plumbing ------------------------------------------------------------------

    def _send(self, status: int, body: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, code: str = "") -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _route(self, method: str) -> None:
        hub = self.server.hub
        path = urlsplit(self.path).path
        with hub.lock:
            hub.requests.append((method, path, self.headers.get("Authorization", "")))
        for route_method, pattern, name in _ROUTES:
            if route_method == method and (m := pattern.match(path)):
                getattr(self, f"_{name}")(**{k: unquote(v) for k, v in m.groupdict().items()})
                return
        self._error(404, f"no route for {method} {path}")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    # --- authorization ---------------------------------------------------------------

    def _role(self) -> str | None:
        """The token's role, or None after answering 401 for a missing or unknown token."""
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        role = self.server.hub.tokens.get(token)
        if role is None:
            self._body()
            self._error(401, "Invalid credentials in Authorization header")
        return role

    def _repo(self, repo: str, *, write: bool) -> HubRepo | None:
        role = self._role()
        if role is None:
            return None
        found = self.server.hub.repos.get(repo)
        if found is None:
            self._body()
            self._error(404, "Repository not found", "RepoNotFound")
            return None
        if write and role != "write":
            self._body()
            self._error(403, "You don't have the rights to create a commit in this repository")
            return None
        return found

    # --- endpoints -------------------------------------------------------------------

    def _model_info(self, repo: str, rev: str) -> None:
        time.sleep(self.server.hub.stall_s)
        if (found := self._repo(repo, write=False)) is None:
            return
        with self.server.hub.lock:
            sha = found.resolve(rev)
        if sha is None:
            self._error(404, "Invalid rev id: " + rev, "RevisionNotFound")
            return
        answer = sha if self.server.hub.answer_sha is None else self.server.hub.answer_sha
        self._send(200, {"id": repo, "modelId": repo, "sha": answer, "private": True})

    def _create_branch(self, repo: str, rev: str) -> None:
        if (found := self._repo(repo, write=True)) is None:
            return
        self._body()
        if not _BRANCH.match(rev) or ".." in rev or re.fullmatch(r"[0-9a-f]{40}", rev):
            self._error(400, f"Invalid reference for a branch: {rev}")
            return
        with self.server.hub.lock:
            if rev in found.branches:
                self._error(409, "Reference already exists")
                return
            found.branches[rev] = found.branches["main"]
        self._send(200, {})

    def _preupload(self, repo: str, rev: str) -> None:
        if (found := self._repo(repo, write=True)) is None:
            return
        payload = json.loads(self._body())
        if rev not in found.branches:
            self._error(404, "Invalid rev id: " + rev, "RevisionNotFound")
            return
        files = []
        for f in payload["files"]:
            mode = "lfs" if f["size"] >= self.server.hub.lfs_threshold else "regular"
            files.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": None})
        self._send(200, {"files": files, "commitOid": found.branches[rev]})

    def _lfs_batch(self, repo: str) -> None:
        if self._repo(repo, write=True) is None:
            return
        payload = json.loads(self._body())
        base = self.server.hub.url
        objects = []
        for obj in payload["objects"]:
            oid, size = obj["oid"], obj["size"]
            actions = {"upload": {"href": f"{base}/lfs-upload/{oid}"},
                       "verify": {"href": f"{base}/lfs-verify/{oid}"}}
            objects.append({"oid": oid, "size": size, "authenticated": True, "actions": actions})
        self._send(200, {"transfer": "basic", "objects": objects})

    def _lfs_put(self, oid: str) -> None:
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            self._error(400, "content does not match its oid")
            return
        with self.server.hub.lock:
            self.server.hub.lfs[oid] = data
        self._send(200, {})

    def _lfs_verify(self, oid: str) -> None:
        if self._role() is None:
            return
        payload = json.loads(self._body())
        with self.server.hub.lock:
            data = self.server.hub.lfs.get(oid)
        if data is None or len(data) != payload["size"]:
            self._error(404, "object not uploaded")
            return
        self._send(200, {})

    def _commit(self, repo: str, rev: str) -> None:
        if (found := self._repo(repo, write=True)) is None:
            return
        hub = self.server.hub
        if hub.drop_commit_after is not None:
            limit, hub.drop_commit_after = hub.drop_commit_after, None
            self.rfile.read(limit)
            self.close_connection = True
            self.connection.shutdown(2)  # socket.SHUT_RDWR: the client sees the connection die
            return
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        if rev not in found.branches:
            self._error(404, "Invalid rev id: " + rev, "RevisionNotFound")
            return
        with hub.lock:
            tree = dict(found.files(rev))
            for item in lines[1:]:
                value = item["value"]
                if item["key"] == "file":
                    tree[value["path"]] = base64.b64decode(value["content"])
                elif item["key"] == "lfsFile":
                    if value["oid"] not in hub.lfs:
                        self._error(400, f"LFS object {value['oid']} was never uploaded")
                        return
                    tree[value["path"]] = hub.lfs[value["oid"]]
            commit = _new_commit()
            found.trees[commit] = tree
            found.branches[rev] = commit
        self._send(200, {"commitUrl": f"{hub.url}/{repo}/commit/{commit}", "commitOid": commit,
                         "success": True})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer


@contextmanager
def running_hub(hub: HubServer | None = None) -> Iterator[HubServer]:
    """Serve `hub` on 127.0.0.1 (a free port) for the duration of the block."""
    hub = hub or HubServer()
    server = _Server(("127.0.0.1", 0), _Handler)
    server.hub = hub
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="hub-server", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)

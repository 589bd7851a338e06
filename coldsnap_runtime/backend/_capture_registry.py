"""A capture's chunks through a registry, beside its capsule image (DESIGN decision 16).

The capture travels as an OCI artifact in the image's own repository: a manifest (``artifactType``
``application/vnd.coldsnap-provider.capture.v1``) whose config is the capture's data document and whose
layers are its distinct non-zero chunks (at most 64 MiB), each a blob named by its SHA-256, uncompressed. The image
names the manifest's digest in a label, so whoever pulls the image finds its capture.

Push asks the registry which blobs it already has (HEAD; or, once the registry showed it mounts a blob from the
repository pushed to, that POST, which begins the upload of a missing one) and uploads only the others (one POST
and one monolithic PUT each), several at once in lanes: worker threads that each take blob after blob on one
kept-alive connection (``_blob_http.py``; ``_blob_upload.py``: the body sent from the store's file by the kernel,
off the event loop), before the manifest, so an interrupted push resumes with the blobs the registry still lacks.
A blob this node saw in the repository before (``_blob_memory.py``) is not asked for; a manifest the registry
refuses for a blob it lost since is put again, every skipped blob asked for first. Pull reads the manifest by
digest (checked), then fetches the chunks the node's store lacks (and those it holds that the pull may not use:
:class:`Possession`), several at once in lanes (``_blob_fetch.py``: streamed straight into its place in the
capture's partial files, ``store_pull.py``, and hashed on the way, off the event loop); each is checked against its
digest and size before it counts, so an interrupted pull resumes from what its files already hold and a corrupt or
truncated blob is refused, naming it. The files, once whole, are the capture's (each byte fetched is written once).
Credentials are the engine's (the same per-registry rule as ``_images.py``); plain HTTP only where the engine
itself uses it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.from_thread
import anyio.lowlevel

from ..errors import RuntimeFailed, StoreError
from ..store import OCI_MANIFEST, CaptureStore, Hold, PullTree
from ._blob_fetch import fetch_blob
from ._blob_http import Lane
from ._blob_memory import KnownBlobs
from ._blob_upload import mounts, upload_blob
from ._digests import answer_challenge
from ._engine import registry_errors

__all__ = ("IN_FLIGHT", "PARALLEL", "CaptureRegistry", "Possession", "Transferred")

PARALLEL = 8  # large blobs in flight at once: enough to fill a link that one stream cannot (each at most 64 MiB)
# Small blobs (a page image's ~190 KiB chunks, thousands a capture) cost round trips, not bytes: more of them in
# flight, beside the large ones (`_lanes`).
SMALL_BYTES = 1 << 20
SMALL_PARALLEL = 32
IN_FLIGHT = PARALLEL + SMALL_PARALLEL  # blobs one push or pull has in flight at most
_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
_MAX_DOCUMENT = 4 << 20  # a registry's own manifest limit
_REFUSAL = 64 << 10  # what a refused manifest's answer is read for its error codes (it may list every blob)
_PULL_SCOPE = re.compile(r'(scope="repository:[^":]+:)pull(?=")')  # a HEAD's challenge asks for a pull-only token
_ANSWERED = 2  # 401 challenges answered for one blob (no token yet, or one for HEAD that does not allow the POST)
Blob = tuple[str, int]  # digest, size
# Moves one blob in a lane's thread: None once moved (or found there), else a 401's challenge to answer first.
Move = Callable[[Lane, Blob, threading.Event, int], str | None]


class Transferred:
    """What one push or pull moved: blobs and bytes sent or fetched, and those already there (of them, `remembered`:
    a push's blobs not asked for, seen in the repository before)."""

    def __init__(self) -> None:
        self.blobs = 0
        self.bytes = 0
        self.present_blobs = 0
        self.present_bytes = 0
        self.remembered = 0

    def add(self, size: int, *, present: bool) -> None:
        if present:
            self.present_blobs, self.present_bytes = self.present_blobs + 1, self.present_bytes + size
        else:
            self.blobs, self.bytes = self.blobs + 1, self.bytes + size


class Possession:
    """Which chunks the node's store holds that one pull may use without fetching them: those of the captures its
    manager reaches (`reached`; None: root and the daemon's account, every chunk) and those its manager's pulls
    fetched before (`proven`, kept by the caller: the registry served their bytes to it). Any other chunk is fetched
    like a missing one (its bytes checked, the same name taken again), so a pull neither tells a manager whether
    another manager's capture holds a chunk (by its time, its byte counts or its reply: a chunk its registry lacks
    fails the pull alike) nor lists, for it to read, a chunk it never had (review of issue 34, item 4)."""

    KEPT = 1 << 16  # (manager, chunk) pairs `proven` keeps, most recent last: a few MiB

    def __init__(self, uid: int | None, reached: set[str] | None,
                 proven: collections.OrderedDict[tuple[int, str], None]) -> None:
        self._uid, self._reached, self._proven = uid, reached, proven

    def usable(self, digest: str) -> bool:
        return self._reached is None or digest in self._reached or (self._uid, digest) in self._proven

    def fetched(self, digest: str) -> None:
        """The registry served the chunk's bytes to this manager: its next pull (a resumed one) may use it."""
        if self._uid is None:
            return
        self._proven[(self._uid, digest)] = None
        self._proven.move_to_end((self._uid, digest))
        while len(self._proven) > self.KEPT:
            self._proven.popitem(last=False)


class CaptureRegistry:
    """One repository of one registry, for the captures of `store`."""

    def __init__(self, store: CaptureStore, *, registry: str, repository: str, auth: Mapping[str, str] | None,
                 insecure: bool, action: str, fetches: anyio.CapacityLimiter, share: anyio.CapacityLimiter,
                 uploads: anyio.CapacityLimiter, known: KnownBlobs | None = None,
                 small_parallel: int = SMALL_PARALLEL) -> None:
        self._store = store
        self._small_parallel = small_parallel  # small blobs in flight (bench/store_push.py compares settings)
        self._known = known  # the blobs the requesting manager saw in this repository (None: ask for every one)
        self._fetches = fetches  # the node's blob-fetch slots, shared by every pull: one per live fetch thread
        self._share = share  # the requesting manager's share of them, held with them
        # anyio's own limit on the threads, never the one that bounds them (an abandoned thread gives its token of
        # this one back at once, and keeps its slot of `fetches` until it ends).
        self._threads = anyio.CapacityLimiter(fetches.total_tokens + uploads.total_tokens)
        self._uploads = uploads  # the node's blob-upload threads, shared by every push
        self._answering = anyio.Lock()  # one lane answers a challenge; the others then use its answer
        self._registry = registry
        host = "registry-1.docker.io" if registry == "docker.io" else registry
        self._origin = f"{'http' if insecure else 'https'}://{host}"
        self._base = f"{self._origin}/v2/{repository}"
        self._repository = repository
        # Whether the registry mounts a blob from this repository (None: not known yet; learnt on the push's first
        # upload): then each blob is asked for by that POST instead of a HEAD, one round trip fewer a new blob.
        self._mounts: bool | None = None
        self._auth = auth or {}
        self._authorization = ""
        self._action = action

    # --- HTTP with the registry's challenge answered once --------------------------------

    async def _send(self, session: aiohttp.ClientSession, method: str, url: str, *,
                    headers: dict[str, str] | None = None, data: bytes | None = None,
                    limit: int = _MAX_DOCUMENT, prefix: bool = False) -> tuple[int, Any, bytes]:
        for attempt in range(2):
            sent = dict(headers or {})
            if self._authorization:
                sent["Authorization"] = self._authorization
            async with session.request(method, url, headers=sent, data=data) as response:
                if response.status == 401 and attempt == 0:
                    challenge = response.headers.get("WWW-Authenticate", "")
                    self._authorization = await answer_challenge(session, challenge, self._auth, self._action)
                    continue
                body = await self._read(response, limit, prefix) if method != "HEAD" else b""
                return response.status, response.headers, body
        raise RuntimeFailed(action=self._action, detail=f"registry {self._registry} refused the credentials")

    async def _read(self, response: aiohttp.ClientResponse, limit: int, prefix: bool) -> bytes:
        """The body, refused past `limit` bytes (a registry's answer is untrusted: never read it whole); with `prefix`,
        its first `limit` bytes (the rest left unread)."""
        body = bytearray()
        async for piece in response.content.iter_chunked(1 << 20):
            body += piece
            if len(body) > limit and prefix:
                return bytes(body[:limit])
            if len(body) > limit:
                raise RuntimeFailed(action=self._action, detail=(
                    f"registry {self._registry} answered more than {limit} bytes for {response.url.path}"))
        return bytes(body)

    def _fail(self, what: str, status: int, body: bytes) -> RuntimeFailed:
        text = body[:300].decode("utf-8", "replace").strip()
        return RuntimeFailed(action=self._action,
                             detail=f"registry {self._registry} answered {status} for {what}: {text}")

    # --- push ------------------------------------------------------------------------

    async def push(self, capture: str) -> Transferred:
        """Upload the capture's blobs the registry lacks, then its manifest (by digest)."""
        manifest = await anyio.to_thread.run_sync(self._store.manifest, capture)
        try:  # its data document and chunks only, each of its own length (never a blob a manifest adds)
            blobs = await anyio.to_thread.run_sync(self._store.blobs, capture)
        except StoreError as exc:
            raise RuntimeFailed(action=self._action, detail=f"capture {capture}: {exc}; nothing was pushed") from exc
        known: list[tuple[str, int]] = []  # seen in the repository before: not asked for
        asked: list[tuple[str, int]] = []
        for blob in blobs:
            (known if self._known is not None and self._known.has(blob[0]) else asked).append(blob)
        done = Transferred()
        with registry_errors(self._action, self._registry):
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
                await self._upload(asked, done)
                status, body = await self._put_manifest(session, capture, manifest)
                if status not in (200, 201) and known and b"BLOB_UNKNOWN" in body and self._known is not None:
                    # The registry lost a blob this node saw there (collected, wiped, replaced). Its answer may name
                    # only the first one, or thousands (more than is read): nothing remembered of the repository is
                    # trusted, every skipped blob asked for (uploaded if missing), the manifest put again. Once.
                    self._known.forget()
                    for digest, _ in asked:  # these the registry answered for during this push
                        self._known.add(digest)
                    await self._upload(known, done)
                    known = []
                    status, body = await self._put_manifest(session, capture, manifest)
                if status not in (200, 201):
                    raise self._fail(f"manifest {capture}", status, body)
        for digest, size in known:  # the registry took a manifest naming them: still there (kept the longest)
            if self._known is not None:
                self._known.add(digest)
            done.add(size, present=True)
        done.remembered = len(known)
        return done

    async def _put_manifest(self, session: aiohttp.ClientSession, capture: str, manifest: bytes) -> tuple[int, bytes]:
        status, _, body = await self._send(session, "PUT", f"{self._base}/manifests/{capture}", limit=_REFUSAL,
                                           prefix=True, headers={"Content-Type": OCI_MANIFEST}, data=manifest)
        return status, body

    async def _upload(self, blobs: list[Blob], done: Transferred) -> None:
        """Upload the blobs the registry lacks in lanes holding the node's upload slots; those it answered for
        counted in `done` and remembered (also when another failed)."""
        moved: list[tuple[Blob, bool]] = []  # appended by the lanes' threads
        try:
            await self._lanes(blobs, functools.partial(self._upload_one, moved), (self._uploads,))
        finally:
            for (digest, size), present in list(moved):
                if self._known is not None:
                    self._known.add(digest)
                done.add(size, present=present)

    def _upload_one(self, moved: list[tuple[Blob, bool]], lane: Lane, blob: Blob, stop: threading.Event,
                    answered: int) -> str | None:
        """The blob from the node's store, sent as it is there (in a lane's thread). A network failure names it."""
        digest, size = blob
        source, offset = self._store.open_chunk(digest, size)  # its blob, or its place in a capture's files
        with source:
            try:
                uploaded = upload_blob(self._base, authorization=self._authorization, digest=digest, size=size,
                                       source=source, offset=offset, within_s=_TIMEOUT.sock_read or 300.0, stop=stop,
                                       lane=lane, mount=self._repository if self._mounts else "")
                if uploaded.status == 201 and self._mounts is None:  # lanes that race here each ask: a few POSTs
                    self._mounts = mounts(self._base, authorization=self._authorization, digest=digest,
                                          repository=self._repository, lane=lane, stop=stop)
            except OSError as exc:
                raise RuntimeFailed(action=self._action, detail=(
                    f"registry {self._registry}: blob {digest} was not pushed: {type(exc).__name__}: {exc}")) from exc
        # No token yet, one that expired, or one for HEAD that does not allow the POST (a token registry scopes
        # each): the request's own challenge answered on the loop, for pull and push at once, then again.
        if uploaded.status == 401 and uploaded.challenge and answered < _ANSWERED:
            return _PULL_SCOPE.sub(r"\1pull,push", uploaded.challenge)
        if uploaded.status not in (200, 201):
            raise self._fail(f"blob {digest}", uploaded.status, uploaded.body)
        moved.append((blob, uploaded.present))
        return None

    # --- pull ------------------------------------------------------------------------

    async def pull(self, capture: str, possession: Possession | None = None) -> Transferred:
        """Fetch the capture's manifest and the chunks the store lacks or `possession` may not use (None: it may use
        every one), and list it in the store."""
        done, possession = Transferred(), possession or Possession(None, None, collections.OrderedDict())
        with registry_errors(self._action, self._registry):
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
                manifest = await self._document(session, "manifests", capture, {"Accept": OCI_MANIFEST})
                try:
                    config = str(json.loads(manifest)["config"]["digest"])
                except (ValueError, TypeError, KeyError, RecursionError) as exc:  # nested past the parser's depth
                    raise RuntimeFailed(action=self._action, detail=(
                        f"registry {self._registry}: manifest {capture} is not a capture's: {exc!r}")) from exc
                data = await self._document(session, "blobs", config, {})
                try:  # a manifest naming a blob its data document does not: never listed, never pushed on
                    self._store.manifest_blobs(manifest, data)
                except StoreError as exc:
                    raise RuntimeFailed(action=self._action, detail=(
                        f"registry {self._registry}: capture {capture}: {exc}; nothing was fetched")) from exc
                # Its chunks held from before they are looked for until it is recorded (or fails): a collection
                # meanwhile never deletes one this pull found present or fetched.
                with self._store.holding() as hold:
                    try:
                        await self._pull_held(capture, manifest, data, hold, possession, done)
                    except StoreError as exc:
                        raise RuntimeFailed(action=self._action, detail=f"capture {capture}: {exc}") from exc
        return done

    async def _pull_held(self, capture: str, manifest: bytes, data: bytes, hold: Hold, possession: Possession,
                         done: Transferred) -> None:
        """A capture the node lists already: the chunks the pull may not use fetched and checked (written nowhere:
        the node holds them), the capture marked used. Else its files: each chunk fetched into its place, the rest
        copied in from their homes, the files named the capture's and the capture listed (``store_pull.py``)."""
        if await anyio.to_thread.run_sync(self._store.has, capture):
            fetch = await anyio.to_thread.run_sync(self._layers, data, hold, possession, None, done)
            await self._fetch(fetch, possession, done, None)
            await anyio.to_thread.run_sync(self._store.record, manifest, data)
            return
        pull = await anyio.to_thread.run_sync(self._store.begin_pull, capture, data)
        try:
            fetch = await anyio.to_thread.run_sync(self._layers, data, hold, possession, pull, done)
            await self._fetch(fetch, possession, done, pull)
            await anyio.to_thread.run_sync(pull.finish, self._store.copy_chunks)
            await anyio.to_thread.run_sync(self._store.settle, pull, manifest, data)
        finally:
            with anyio.CancelScope(shield=True):  # quick (a set; a private directory deleted), and never skipped
                await anyio.to_thread.run_sync(pull.leave)

    def _layers(self, data: bytes, hold: Hold, possession: Possession, pull: PullTree | None,
                done: Transferred) -> list[Blob]:
        """The distinct chunks of the data document to fetch, with their lengths (those the pull may not use as the
        node holds them, `possession`, and that its partial files do not hold checked), all of them held by `hold`
        first; those not fetched are counted present in `done`. Refused when what the files still need would not fit
        the store's filesystem: a registry's document may name 3 TB of chunks, and a pull that fills the disk
        leaves what it fetched for nothing to collect (review13); the figure in the refusal is this capture's own,
        nothing of other managers'."""
        files = self._store.decode_data(data).files
        layers = sorted({(chunk, length) for stored in files for chunk, _, length in stored.spans() if chunk})
        hold.add(chunk for chunk, _ in layers)
        if pull is not None:
            pull.resume(possession.usable)
            # Beside the other pulls' and trees' room (each checked alone would fit, together fill the disk); the
            # files' room falls as the lanes place chunks (`_fetch_one`), and is the disk's again when the pull ends.
            self._store.promise(pull.root, pull.needed, "its files", "nothing was fetched")
        fetch: list[Blob] = []
        for chunk, length in layers:
            placed = pull is not None and chunk in pull.placed
            if placed or (possession.usable(chunk) and self._store.has_blob(chunk)):
                done.add(length, present=True)
            else:
                fetch.append((chunk, length))
        return fetch

    async def _document(self, session: aiohttp.ClientSession, kind: str, digest: str,
                        headers: dict[str, str]) -> bytes:
        status, _, body = await self._send(session, "GET", f"{self._base}/{kind}/{digest}", headers=headers)
        if status != 200:
            raise self._fail(f"{kind.rstrip('s')} {digest}", status, body)
        if len(body) > _MAX_DOCUMENT or "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise RuntimeFailed(action=self._action, detail=(
                f"registry {self._registry}: the document read as {digest} has another digest"))
        return body

    async def _fetch(self, blobs: list[Blob], possession: Possession, done: Transferred,
                     pull: PullTree | None = None) -> None:
        """Fetch `blobs` into their places in `pull`'s files (None: into nothing, only checked: the node holds them)
        in lanes holding the manager's share and the node's fetch slots; those the registry served counted in `done`,
        placed, proven to `possession` and remembered (also when another failed)."""
        fetched: list[Blob] = []  # appended by the lanes' threads
        try:
            await self._lanes(blobs, functools.partial(self._fetch_one, fetched, pull), (self._share, self._fetches))
        finally:
            for digest, size in list(fetched):
                if pull is not None:
                    pull.placed.add(digest)
                possession.fetched(digest)
                if self._known is not None:  # served from this repository: this manager's next push need not ask
                    self._known.add(digest)
                done.add(size, present=False)

    def _fetch_one(self, fetched: list[Blob], pull: PullTree | None, lane: Lane, blob: Blob, stop: threading.Event,
                   answered: int) -> str | None:
        """The blob streamed into its place in `pull`'s files, held by this thread until it ends (a cancelled pull's
        abandoned lane still writes until its next wait: no other pull takes the files before), or into nothing (in
        a lane's thread)."""
        digest, size = blob
        url, within_s = f"{self._base}/blobs/{digest}", _TIMEOUT.sock_read or 300.0
        if pull is None:
            got = fetch_blob(url, authorization=self._authorization, digest=digest, size=size,
                             into=Path(os.devnull), within_s=within_s, stop=stop, lane=lane)
        elif not pull.join():
            raise ConnectionAbortedError(f"blob {digest}: its pull has ended")
        else:
            try:
                into, at = pull.place(digest)
                got = fetch_blob(url, authorization=self._authorization, digest=digest, size=size, into=into, at=at,
                                 within_s=within_s, stop=stop, lane=lane)
            finally:
                pull.leave()
        if got.status == 401 and got.challenge and answered < _ANSWERED:  # no token yet, or it expired
            return got.challenge
        if got.status != 200:
            raise self._fail(f"blob {digest}", got.status, got.body)
        if not got.kept:
            raise RuntimeFailed(action=self._action, detail=(
                f"registry {self._registry}: blob {digest} is corrupt or truncated "
                f"({got.read if got.read <= size else 'more than ' + str(size)} bytes, {size} expected); "
                "nothing of it counts"))
        if pull is not None:
            pull.placed.add(digest)  # at once: the room the pull holds (`needed`) falls by it
        fetched.append(blob)
        return None

    # --- lanes -----------------------------------------------------------------------

    async def _lanes(self, blobs: list[Blob], move: Move, slots: tuple[anyio.CapacityLimiter, ...]) -> None:
        """`move` each blob in lanes: the large ones in PARALLEL lanes and beside them those under SMALL_BYTES in
        `small_parallel`, each lane a worker thread holding `slots` that takes blob after blob on one kept-alive
        connection, never a thread or a task per blob (a registry's document may name 55,000 chunks). The first
        failure (translated) stops the others and is raised; a cancelled transfer does not wait for its threads,
        which end within POLL_S."""
        small = collections.deque(blob for blob in blobs if blob[1] < SMALL_BYTES)
        large = collections.deque(blob for blob in blobs if blob[1] >= SMALL_BYTES)
        stop = threading.Event()

        async def lane(queue: collections.deque[Blob]) -> None:
            first: Blob | None = None  # a blob whose challenge was just answered: the lane goes on with it
            answered = 0
            while True:
                with registry_errors(self._action, self._registry):
                    try:
                        outcome = await self._in_thread(
                            functools.partial(self._lane, queue, move, stop, first, answered), slots)
                    except StoreError as exc:
                        raise RuntimeFailed(action=self._action, detail=str(exc)) from exc
                if outcome is None:
                    return
                blob, challenge, sent = outcome
                answered = answered + 1 if blob == first else 1
                first = blob
                await self._answer(challenge, sent)

        try:
            async with anyio.create_task_group() as group:
                for queue, width in ((large, PARALLEL), (small, self._small_parallel)):
                    for _ in range(min(width, len(queue))):
                        group.start_soon(lane, queue)
        except BaseExceptionGroup as failures:  # the task group's wrapping: the caller gets our one error
            first: BaseException = failures
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from failures
        finally:
            stop.set()  # the lanes still running (a failure, a cancel) end at their next wait

    def _lane(self, queue: collections.deque[Blob], move: Move, stop: threading.Event, first: Blob | None,
              answered: int) -> tuple[Blob, str, str] | None:
        """A lane's thread: blob after blob from `queue` (`first` before them) on one connection, until none is left
        or `stop`; a blob the registry challenged is returned with the challenge and the credentials it was sent."""
        lane = Lane(self._base)
        try:
            blob = first
            while not stop.is_set():
                if blob is None:
                    try:
                        blob, answered = queue.popleft(), 0  # deque: each blob taken once, whichever thread asks
                    except IndexError:
                        return None
                sent = self._authorization
                if (challenge := move(lane, blob, stop, answered)) is not None:
                    return blob, challenge, sent
                blob = None
            return None
        finally:
            lane.close()

    async def _answer(self, challenge: str, sent: str) -> None:
        """The credentials that answer `challenge`, unless another lane answered one since these were sent."""
        async with self._answering:
            if self._authorization != sent:
                return
            async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
                self._authorization = await answer_challenge(session, challenge, self._auth, self._action)

    async def _in_thread(self, run: Callable[[], Any], slots: tuple[anyio.CapacityLimiter, ...]) -> Any:
        """`run` in a thread holding a token of each of `slots` (the node's own limiters, never the daemon's shared
        pool, which every file operation needs) from its start to its end. A cancelled request does not wait for it:
        the thread ends at its next wait (POLL_S), leaving its pull's files, and only then gives its slots back, so
        requests cancelled one after another cannot pile up threads and sockets (review 2026-12-02)."""
        slot, lock = object(), threading.Lock()
        state = {"started": False, "dropped": False}  # under `lock`: the thread began; the request left before it
        token = anyio.lowlevel.current_token()
        taken: list[anyio.CapacityLimiter] = []
        try:
            for limiter in slots:
                await limiter.acquire_on_behalf_of(slot)
                taken.append(limiter)
        except BaseException:
            for limiter in reversed(taken):
                limiter.release_on_behalf_of(slot)
            raise

        def release() -> None:
            for limiter in reversed(taken):
                limiter.release_on_behalf_of(slot)

        def give_back() -> None:
            # Scheduled, not waited for (before the thread's result, so before its caller resumes): a loop that stopped
            # without closing (the daemon ending) never answers, and this thread, which the interpreter's exit waits
            # for, waited for ever (review 15: a test run hung at its exit, holding the test lock).
            with contextlib.suppress(RuntimeError):  # the event loop is closed (the daemon exited): nothing to give
                token.backend_class.run_sync_soon(release, (), token.native_token)

        def thread() -> Any:
            with lock:
                if state["dropped"]:
                    raise RuntimeError("the request left before its thread began")
                state["started"] = True
            try:
                return run()
            finally:
                give_back()

        try:
            return await anyio.to_thread.run_sync(thread, abandon_on_cancel=True, limiter=self._threads)
        except BaseException:
            with lock:
                state["dropped"] = not state["started"]
            if state["dropped"]:  # never ran (cancelled while queued): its slots are given back here
                release()
            raise

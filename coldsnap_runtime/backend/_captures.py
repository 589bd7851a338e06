"""The Docker backend's side of the node's capture store: what image-build, -push, -pull and workload-run
do with a capsule that carries a capture (``_capture_build.py``, ``_capture_registry.py``), and the admin's
list, inspect, remove and collect, which never touch a capture a container of this engine uses.

A container that sees a capture's files carries :data:`CAPTURE_LABEL` naming it: that label is the pin.
Collection and removal ask the engine which captures are pinned, under the same lock that workload-run
holds from making a capture's files to creating its container, so a collection racing a restore either
runs first (and the restore makes the files again, or fails naming the missing capture) or sees the pin.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import IO, Any

import anyio

from ..errors import BackendError, NotFound, RuntimeFailed, StoreError
from ..store import CaptureInfo, CaptureStore, Collected
from ._base import requesting_manager
from ._blob_memory import BlobMemory
from ._capture_build import CAPTURE_LABEL, FILES_LABEL, image_files, store_context
from ._capture_registry import IN_FLIGHT, CaptureRegistry, Possession, Transferred
from ._capture_stubs import StubPaths
from ._containers import Containers
from ._digests import repository_path
from ._engine import Engine, docker_errors
from ._ledger import ledger_key
from ._translate import parse_reference

__all__ = ("CAPTURE_LABEL", "Captures")

FETCH_THREADS = 2 * IN_FLIGHT  # blob-fetch threads of every pull at once (their own limiter, not the shared pool)
_KEPT_SHARES = 256  # managers whose fetch share is kept (then the idle ones are forgotten)
UPLOAD_THREADS = 2 * IN_FLIGHT  # and blob-upload threads of every push at once (a push never waits on a pull's)

# Where a workload sees the store's listing of the capture files it made (coldsnap_probe's STORE_FILES: the
# in-capsule worker reads it there; the two packages share no code). A directory of its own, not the daemon's
# state directory, which a capsule may bind from the host (Docker would make the mount point in the host's).
MADE_FILES_TARGET = "/run/coldsnap-capture-store/files.json"
Auth = Callable[[str], dict[str, str] | None]
# Where a workload's capture files came from (the metrics' tier label: a fixed set): its files already made
# ("tree"), made from the chunks on this node's disk ("disk"), chunks fetched from a registry ("registry").
TIERS = ("tree", "disk", "registry")


class Captures:
    """The capture store of one engine's node (`store` None: this host has none; images that need one are
    refused, naming the image)."""

    def __init__(self, engine: Engine, store: CaptureStore | None, *, spool_dir: str | None, containers: Containers,
                 owned_refs: Callable[[int], list[str]], others_refs: Callable[[int], list[str]]) -> None:
        self._engine = engine
        self.store = store
        self._stubs = StubPaths(engine, containers)
        self._spool_dir = spool_dir
        self._owned_refs = owned_refs  # the image references a manager recorded (the image ledger)
        self._others_refs = others_refs  # the references anyone else recorded
        self._opened = False
        # tier -> [bytes read from it, hits]; read by the metrics endpoint at scrape time.
        self._tiers: dict[str, list[int]] = {tier: [0, 0] for tier in TIERS}
        # Held from making a capture's files to creating the container that pins it, and by removal.
        self.lock = anyio.Lock()
        self._fetches = anyio.CapacityLimiter(FETCH_THREADS)
        # manager -> its share of those (IN_FLIGHT): one manager's pulls from a registry that trickles can hold at
        # most half the node's fetch threads, never starve another manager's pulls (review 2026-12-02, part 2).
        self._shares: dict[int | None, anyio.CapacityLimiter] = {}
        self._uploads = anyio.CapacityLimiter(UPLOAD_THREADS)
        # (manager, chunk): the chunks each manager's pulls fetched, which its next pull may use (`Possession`).
        self._proven: collections.OrderedDict[tuple[int, str], None] = collections.OrderedDict()
        # Which blobs each manager's pushes and pulls saw in each repository: a push skips their HEADs.
        self._seen = BlobMemory()

    async def _ready(self, action: str) -> CaptureStore:
        if self.store is None:
            raise RuntimeFailed(action=action, detail="this host has no capture store ([captures] store)")
        if not self._opened:
            try:
                await anyio.to_thread.run_sync(self.store.open)
            except OSError as exc:
                raise RuntimeFailed(action=action, detail=f"the capture store cannot be opened: {exc}") from exc
            self._opened = True
        return self.store

    # --- build, push, pull -------------------------------------------------------------

    async def filter_context(self, spool: IO[bytes], out: IO[bytes]) -> str | None:
        """The capture the context tar `spool` carried into the store, if any: then `out` holds the context to
        build (stubs in its place), from its start; else (None) `spool` is built as it is."""
        if self.store is None:
            return None
        store = await self._ready("image-build")
        try:
            capture = await anyio.to_thread.run_sync(store_context, spool, out, store)
        except (StoreError, OSError) as exc:
            raise RuntimeFailed(action="image-build", detail=f"the capture store: {exc}") from exc
        spool.seek(0)
        out.seek(0)
        return capture

    async def push(self, image: str, info: dict[str, Any], auth: Auth) -> Transferred | None:
        """Push the capture `image` carries beside it (before the image, so its tag never names a capture the
        registry lacks); None for an image without one."""
        found = self._capture(image, info, "image-push")
        if found is None:
            return None
        store = await self._ready("image-push")
        if not store.has(found):
            raise RuntimeFailed(action="image-push", detail=f"{image} carries capture {found}, which is not in "
                                "the node's capture store (removed or collected): build or pull it again")
        return await (await self._registry(image, store, auth, "image-push")).push(found)

    async def pull(self, image: str, info: dict[str, Any], auth: Auth, *, held: str | None) -> Transferred | None:
        """Fetch the capture the pulled `image` carries into the store (what it lacks) and make its files; None
        without one. `held`: the capture the manager's own reference carried before this pull moved it (`carried`),
        whose chunks it still may use (a pull of the same capsule again fetches only what changed)."""
        found = self._capture(image, info, "image-pull")
        if found is None:
            return None
        store = await self._ready("image-pull")
        # Asked of the registry even when the store holds it: an image's label may name any capture (another
        # manager's), and only a registry that serves its manifest and data shows the image comes with it.
        present = store.has(found)
        registry = await self._registry(image, store, auth, "image-pull")
        moved = await registry.pull(found, await self._possession(store, held))
        if not present:  # its files made by the pull: fetched chunks written into them, present ones copied in
            self._count("registry", moved.bytes)
            if moved.present_bytes:
                self._count("disk", moved.present_bytes)
        # A capture listed before (its files reclaimed, or a build's not yet run): its files made now, not at the
        # first workload-run (a node pulls ahead of restoring). Best effort: the pull itself succeeded, and a
        # failure here (a full disk) must not undo it (the image may have been resident and in use before this
        # pull); the first workload-run makes them or says why not.
        try:
            async with self.lock:  # removal and collection hold it: none drops the capture while its files are made
                _tree, read = await anyio.to_thread.run_sync(store.tree, found)
        except StoreError:
            return moved
        if read:
            self._count("disk", read)
        return moved

    async def _possession(self, store: CaptureStore, held: str | None) -> Possession:
        """What the requesting manager's pull may use of the store's chunks without fetching them (`Possession`):
        the chunks of the captures it reaches (the reference this pull writes counts for none: its image is not
        yet checked, `ImageLedger.writing`) and of `held`."""
        uid = requesting_manager.get()
        reached = await self.visible(uid, "image-pull")
        if reached is not None and held is not None and store.has(held):
            reached.add(held)
        chunks = None if reached is None else \
            await anyio.to_thread.run_sync(lambda: set().union(*(store.chunks(c) for c in reached)))
        return Possession(uid, chunks, self._proven)

    def _count(self, tier: str, read: int) -> None:
        self._tiers[tier][0] += read
        self._tiers[tier][1] += 1

    def tier_stats(self) -> list[tuple[str, int, int]]:
        """(tier, bytes read from it, hits) for each tier: the metrics endpoint's view."""
        return [(tier, read, hits) for tier, (read, hits) in self._tiers.items()]

    async def _registry(self, image: str, store: CaptureStore, auth: Auth, action: str) -> CaptureRegistry:
        from ._digests import registry_is_insecure

        ref = parse_reference(image)
        if ref is None:
            raise RuntimeFailed(action=action, detail=f"{image} names no registry to move its capture through")
        info = await self._engine.info(action)
        repository, credentials = repository_path(ref.repository), auth(ref.registry)
        known = self._seen.scope(manager=requesting_manager.get(), registry=ref.registry, repository=repository,
                                 auth=credentials)
        return CaptureRegistry(store, registry=ref.registry, repository=repository, auth=credentials,
                               insecure=registry_is_insecure(info, ref.registry), action=action,
                               fetches=self._fetches, share=self._share(), uploads=self._uploads, known=known)

    def _share(self) -> anyio.CapacityLimiter:
        """The fetch share of the manager this request runs for (``requesting_manager``)."""
        manager = requesting_manager.get()
        if (share := self._shares.get(manager)) is None:
            if len(self._shares) >= _KEPT_SHARES:
                self._shares = {uid: kept for uid, kept in self._shares.items() if kept.borrowed_tokens}
            share = self._shares[manager] = anyio.CapacityLimiter(IN_FLIGHT)
        return share

    @staticmethod
    def _capture(image: str, info: dict[str, Any], action: str) -> str | None:
        try:
            found = image_files(dict((info.get("Config") or {}).get("Labels") or {}))
        except ValueError as exc:
            raise RuntimeFailed(action=action, detail=f"{image}: {exc}") from exc
        return None if found is None else found[0]

    # --- workload-run ------------------------------------------------------------------

    @staticmethod
    def _files(image: str, info: dict[str, Any]) -> tuple[str, dict[str, str]] | None:
        try:
            return image_files(dict((info.get("Config") or {}).get("Labels") or {}))
        except ValueError as exc:
            raise RuntimeFailed(action="workload-run", detail=f"{image}: {exc}") from exc

    async def stubbed(self, image: str, info: dict[str, Any]) -> frozenset[str]:
        """Which of the capture paths `image` names still hold their own stub: read from the image (a container
        created and removed, once per image id) before :attr:`lock` is taken, which every capsule's run needs. A
        path holding another path's or capture's stub is refused, naming it."""
        found = self._files(image, info)
        if found is None:
            return frozenset()
        capture, files = found
        stubs = await self._stubs.holding(str(info.get("Id") or image), capture, files, "workload-run")
        if stubs.misplaced:
            path, says = stubs.misplaced[0]
            raise RuntimeFailed(action="workload-run", detail=(
                f"{image}: {path} holds a capture stub that is not its own ({says!r}; a later layer moved or copied "
                f"it there, or an older daemon built the image: build it again); nothing was started"))
        return stubs.held

    async def mounts(self, image: str, info: dict[str, Any],
                     stubs: frozenset[str]) -> tuple[str, list[dict[str, Any]]] | None:
        """The capture `image` carries and the read-only binds of its files over `stubs` (`stubbed`: a path where a
        later layer put another file keeps that file); None without one. The caller holds :attr:`lock` until its
        container (labelled with the capture) exists."""
        found = self._files(image, info)
        if found is None:
            return None
        capture, files = found
        store = await self._ready("workload-run")
        try:
            tree, read = await anyio.to_thread.run_sync(store.tree, capture)
            known = {stored.path for stored in (await anyio.to_thread.run_sync(store.data, capture)).files}
        except StoreError as exc:
            raise RuntimeFailed(action="workload-run", detail=(
                f"{image} carries capture {capture}: {exc}; nothing was started (pull the image again)")) from exc
        # The label is the image's (a manager's Dockerfile, a registry): only the capture's own files are mounted,
        # never a path it names outside the tree (``..``) or anything else on the host.
        if strays := sorted(source for source in files.values() if source not in known):
            raise RuntimeFailed(action="workload-run", detail=(
                f"{image}: label {FILES_LABEL} names {strays[0]!r}, which is not a file of capture {capture}"))
        self._count("disk" if read else "tree", read)
        # Only over the stubs: a file a later layer put at such a path is the image's, and stays visible.
        binds = [{"Type": "bind", "Source": str(tree / source), "Target": target, "ReadOnly": True}
                 for target, source in sorted(files.items()) if target in stubs]
        # With them, the store's listing of the files it made: a restore's worker finds them unchanged since,
        # the capture's bytes, and stages its device dump as from the files a release wrote (capture-store.md).
        if binds and (made := store.made_files(capture)) is not None:
            binds.append({"Type": "bind", "Source": str(made), "Target": MADE_FILES_TARGET, "ReadOnly": True})
        return capture, binds

    async def read_stubs(self, image: str, action: str) -> None:
        """Read now which paths of `image` (just built or pulled) hold the stub, so that its first workload-run
        binds without reading the image (0.2 s on the CPU machine); a failure here leaves that to the run."""
        if self.store is None:
            return
        with contextlib.suppress(BackendError, ValueError):
            with docker_errors(action, kind="image", ref=image):
                info = await self._engine.docker.images.inspect(image)
            found = image_files(dict((info.get("Config") or {}).get("Labels") or {}))
            if found is not None:
                await self._stubs.holding(str(info.get("Id") or image), found[0], found[1], action)

    # --- admin -----------------------------------------------------------------------

    async def in_use(self, action: str) -> set[str]:
        """Captures some container of this engine (any state) pins."""
        with docker_errors(action):
            containers = await self._engine.docker.containers.list(all=True, filters={"label": [CAPTURE_LABEL]})
        return {str(labels[CAPTURE_LABEL]) for c in containers if CAPTURE_LABEL in (labels := c["Labels"] or {})}

    async def visible(self, uid: int | None, action: str) -> set[str] | None:
        """The captures manager `uid` reaches: those of the images it recorded (None: every one, for root and
        the daemon's account). Another manager's capture is answered as absent."""
        if uid is None:
            return None
        return await self._carried_by(self._owned_refs(uid), action)

    async def require_reach(self, image: str, info: dict[str, Any], action: str, *, outcome: str) -> None:
        """Refuse `image` (`info`: its inspect) when it carries a capture the requesting manager does not reach
        (``requesting_manager``; `visible`): its run would mount the capture's files, and a tag or a build FROM it
        would record an image of that manager carrying it, which reaches it from then on. `outcome`: what the
        refusal left. A host without a store mounts no capture (its runs of a capsule are refused): nothing to
        reach there."""
        uid = requesting_manager.get()
        if self.store is None or uid is None or (capture := self._capture(image, info, action)) is None:
            return
        owned = self._owned_refs(uid)
        if ledger_key(image) in owned:  # the manager's own reference (no pull or build in it): no inspect per image
            return
        if capture not in await self._carried_by(owned, action):
            raise RuntimeFailed(action=action, detail=(
                f"{image} carries capture {capture}, which this manager does not reach (a manager reaches the "
                "captures of the images its own sessions pulled, built or tagged): pull, build or tag an image of "
                f"your own that carries it; {outcome}"))

    async def carried(self, image: str, action: str) -> str | None:
        """The capture `image` carries now (None: none, or not resident; a host without a store: never asked)."""
        return None if self.store is None else next(iter(await self._carried_by([image], action)), None)

    async def _carried_by(self, refs: list[str], action: str) -> set[str]:
        """The captures these image references carry (a reference gone from the engine carries none)."""
        found: set[str] = set()
        for ref in refs:
            try:
                with docker_errors(action, kind="image", ref=ref):
                    info = await self._engine.docker.images.inspect(ref)
            except NotFound:
                continue
            if (capture := self._capture(ref, info, action)) is not None:
                found.add(capture)
        return found

    async def describe(self, capture: str | None = None, *, uid: int | None = None) -> list[CaptureInfo]:
        """Every capture `uid` reaches (or the one named: NotFound when absent or not its own)."""
        store = await self._ready("capture-inspect")
        mine = await self.visible(uid, "capture-inspect")
        try:
            # Bytes shared counted among the captures it reaches: another manager's holding a chunk is not shown.
            among = None if mine is None else sorted(mine)
            if capture is None:
                return await anyio.to_thread.run_sync(lambda: store.describe_all(among))
            if not store.has(capture) or (mine is not None and capture not in mine):
                raise NotFound(kind="capture", ref=capture, action="capture-inspect")
            return [await anyio.to_thread.run_sync(lambda: store.describe(capture, among=among))]
        except StoreError as exc:
            raise RuntimeFailed(action="capture-inspect", detail=str(exc)) from exc

    async def remove(self, capture: str, *, uid: int | None = None) -> None:
        """Remove one capture `uid` reaches; refused while a container uses it; NotFound when absent."""
        mine = await self.visible(uid, "capture-remove")
        if mine is not None and capture not in mine:
            raise NotFound(kind="capture", ref=capture, action="capture-remove")
        # Captures are content-addressed: a manager holding the same bytes must not remove them from under images
        # of others (review of issue 34, finding 10).
        if uid is not None and capture in await self._carried_by(self._others_refs(uid), "capture-remove"):
            raise RuntimeFailed(action="capture-remove", detail=(
                f"capture {capture} is also carried by images this manager did not record; only root or the "
                "daemon's account can remove it"))
        await self._under_lock("capture-remove", lambda store, used: self._remove_one(store, used, capture))

    async def collect(self, *, max_bytes: int | None, older_than_s: float | None) -> Collected:
        """Collect the blobs no capture names, then captures by age and capacity, never one in use; what it freed."""
        done: list[Collected] = []

        async def run(store: CaptureStore, used: set[str]) -> None:
            done.append(await anyio.to_thread.run_sync(
                lambda: store.collect(in_use=used, max_bytes=max_bytes, older_than_s=older_than_s)))

        await self._under_lock("capture-gc", run)
        return done[0]

    async def _under_lock(self, action: str, run: Callable[[CaptureStore, set[str]], Awaitable[None]]) -> None:
        store = await self._ready(action)
        async with self.lock:
            used = await self.in_use(action)
            try:
                await run(store, used)
            except StoreError as exc:
                raise RuntimeFailed(action=action, detail=str(exc)) from exc

    @staticmethod
    async def _remove_one(store: CaptureStore, used: set[str], capture: str) -> None:
        if not store.has(capture):
            raise NotFound(kind="capture", ref=capture, action="capture-remove")
        if capture in used:
            raise RuntimeFailed(action="capture-remove", detail=f"capture {capture} is in use by a container")
        await anyio.to_thread.run_sync(store.remove, capture)

"""Weight hydration: an engine's weights leave device memory before capture and come back after restore.

The API (engine side, inside the capsule; standard library + cuda-python)::

    arena = WeightArena(total_bytes)                  # VMM reservation + backing, mapped, exact address
    arena.declare([WeightRegion(name, arena.address + off, size, source_path, source_offset, digest),
                   WeightRegion("kv", arena.address + off2, size2, "", 0, "", policy="discard")])  # optional
    arena.load()                                      # cold start: fill from the sources, verified
    arena.serve(control_socket)                       # a thread the restore worker talks to
    ... build tensors over arena.address, serve; before each request: arena.wait_ready() ...

`region_digest(path, offset, size)` computes a region's digest (``sha256-64m:<hex>``: SHA-256 over
the SHA-256 of each 64 MiB chunk, so it is computed in parallel). The worker side::

    manifest = request(control_socket, {"op": "release", "generation": g})  # before CUDA lock
    ... CUDA checkpoint, CRIU dump; restore ...
    report = request(control_socket, {"op": "hydrate"})                  # after CUDA unlock

A `discard` region (a KV cache, scratch buffers) is released with the weights and comes back zero-filled:
its bytes are in neither the images nor any source (the plan's `kv_cache` layout, spec policy `discard`).

`release` is the fail-before-release gate (memory contracts, `_memory.py`): the regions must lie
inside the reservation without overlapping, every source must hold its region and match its
digest, the checkpoint plan must pass `require_checkpoint_plan`; the layout and the sources are
revalidated just before the backing is unmapped (the reservation is kept, so captured CUDA graphs
stay valid). Any failure raises `HydrationError` naming the region, and nothing was released.
`hydrate` (after restore) checks the manifest against the arena (same plan digest), the sources
against the identities recorded at release (device, inode, size, mtime, ctime; on a mismatch the
content digest decides), and the free device memory; then it maps fresh backing at the same
address, copies, verifies sampled blocks against the source, and only then sets `ready`. On a
failure the backing is released again and the engine stays not ready: nothing half-hydrated serves.

Copy strategies (`strategy=`): ``register`` (the source file is mmapped and page-locked with
`cuMemHostRegister`, copied by DMA on several streams; the pinning is paid at every hydration),
``ring`` (reader threads into a ring of pinned buffers; page cache or disk), ``direct`` (the ring
with O_DIRECT reads), and ``hydrator:<socket>``: a long-lived `HydratorServer` process
(``python -m coldsnap_probe.hydration serve --socket S FILE...``) keeps the sources page-locked (paid
once, at its start) and writes into the engine's allocation, which the engine exports
(`cuMemExportToShareableHandle`, SCM_RIGHTS); an exported allocation is released before the next
checkpoint anyway (the weights are released before every capture).

Any engine, unchanged (docs/interposer.md): `_interposer.py` builds and finds `libcoldsnap_cuda.so`, a CUDA
driver API interposer (C, `coldsnap_probe/hydration/interposer/`) that routes an engine's device allocations through
VMM, dumps and releases them before the CUDA lock and hydrates them after restore; `DeviceDump` is its
manifest and `check_dump` its checks.

Where each part lives (this subpackage): `_weights.py` (regions, digests, sources, the manifest; no
CUDA), `_vmm.py` (CUDA virtual memory), `_copy.py` (the copy engine: files or page-locked memory to
the device, the way they are read a strategy), `_arena.py` (the engine's `WeightArena` and
its control socket), `_hydrator.py` (the node's `HydratorServer`), `_staging.py` (the worker's `Stager`),
`_peer_files.py` (what a hydrator's peer may have read: its sources, a stage-dump's parts), `_peer_view.py`
(a peer's files opened in its own view: its root and credentials, never "uid 0 reads everything") and
`__main__.py` (the hydrator's command line); the socket protocol and peer checks are
`coldsnap_probe/jsonline.py`. Every socket here is 0600 from its creation and answers only admitted
peers (SO_PEERCRED); see `HydratorServer` for what each peer may touch.

Each name is imported on first use (PEP 562), as in the package above: a restore worker loads the stager and the
interposer's records, not the engine's `WeightArena`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what each name is, for mypy and readers; at run time `__getattr__` imports it
    from ._arena import WeightArena as WeightArena
    from ._digests import chunk_digests as chunk_digests
    from ._digests import combine_digests as combine_digests
    from ._digests import region_digest as region_digest
    from ._hydrator import DUMP_CHUNK as DUMP_CHUNK
    from ._hydrator import DUMP_THREADS as DUMP_THREADS
    from ._hydrator import HydratorServer as HydratorServer
    from ._interposer import ENGINE_DEFAULTS as ENGINE_DEFAULTS
    from ._interposer import ENV_HYDRATOR as ENV_HYDRATOR
    from ._interposer import DeviceDump as DeviceDump
    from ._interposer import build_library as build_library
    from ._interposer import check_dump as check_dump
    from ._interposer import dump_identities as dump_identities
    from ._interposer import interposer_request as interposer_request
    from ._interposer import interposer_socket as interposer_socket
    from ._interposer import library_path as library_path
    from ._interposer import remove_dump as remove_dump
    from ._interposer import store_made as store_made
    from ._interposer import verification as verification
    from ._staging import ADOPT_PAGE as ADOPT_PAGE
    from ._staging import Stager as Stager
    from ._staging import StageRequest as StageRequest
    from ._weights import HydrationManifest as HydrationManifest
    from ._weights import WeightRegion as WeightRegion
    from ._weights import check_sources as check_sources

_EXPORTS = MappingProxyType({  # public name -> its module
    "WeightArena": "._arena",
    "DUMP_CHUNK": "._hydrator",
    "DUMP_THREADS": "._hydrator",
    "HydratorServer": "._hydrator",
    "Stager": "._staging",
    "ENGINE_DEFAULTS": "._interposer",
    "ENV_HYDRATOR": "._interposer",
    "DeviceDump": "._interposer",
    "build_library": "._interposer",
    "check_dump": "._interposer",
    "dump_identities": "._interposer",
    "interposer_request": "._interposer",
    "interposer_socket": "._interposer",
    "library_path": "._interposer",
    "remove_dump": "._interposer",
    "store_made": "._interposer",
    "verification": "._interposer",
    "ADOPT_PAGE": "._staging",
    "StageRequest": "._staging",
    "HydrationManifest": "._weights",
    "WeightRegion": "._weights",
    "check_sources": "._weights",
    "chunk_digests": "._digests",
    "combine_digests": "._digests",
    "region_digest": "._digests",
})

__all__ = (
    "ADOPT_PAGE",
    "DUMP_CHUNK",
    "DUMP_THREADS",
    "ENGINE_DEFAULTS",
    "ENV_HYDRATOR",
    "DeviceDump",
    "HydrationManifest",
    "HydratorServer",
    "StageRequest",
    "Stager",
    "WeightArena",
    "WeightRegion",
    "build_library",
    "check_dump",
    "check_sources",
    "chunk_digests",
    "combine_digests",
    "dump_identities",
    "interposer_request",
    "interposer_socket",
    "library_path",
    "region_digest",
    "remove_dump",
    "store_made",
    "verification",
)


if not TYPE_CHECKING:  # mypy sees only the imports above: a misspelt name is then an error, not Any

    def __getattr__(name: str) -> Any:
        """`name` imported from its module on first use, then kept as this module's attribute."""
        try:
            module = _EXPORTS[name]
        except KeyError:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
        # __import__, not importlib.import_module: `python -X importtime` then shows what each first use costs.
        value = getattr(__import__(module.lstrip("."), globals(), None, [name], 1), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})

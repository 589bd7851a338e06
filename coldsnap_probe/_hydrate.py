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
(``python -m coldsnap_probe._hydrate serve --socket S FILE...``) keeps the sources page-locked (paid
once, at its start) and writes into the engine's allocation, which the engine exports
(`cuMemExportToShareableHandle`, SCM_RIGHTS); an exported allocation is released before the next
checkpoint anyway (the weights are released before every capture).

Where each part lives: `_weights.py` (regions, digests, sources, the manifest; no CUDA), `_vmm.py` (CUDA
virtual memory and the copy engines), `_arena.py` (the engine's `WeightArena` and its control socket),
`_hydrator.py` (the node's `HydratorServer` and the worker's `Stager`), `jsonline.py` (the socket protocol,
peer checks); this module is the hydrator's command line. Every socket here is 0600 from its creation and
answers only admitted peers (SO_PEERCRED); see `HydratorServer` for what each peer may touch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import jsonline
from ._hydrator import STAGE_TTL, HydratorServer
from ._weights import region_digest

__all__ = ("main",)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coldsnap_probe._hydrate serve --socket PATH FILE...`` (the long-lived hydrator) or
    ``digest FILE OFFSET SIZE``."""
    parser = argparse.ArgumentParser(prog="python -m coldsnap_probe._hydrate")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--socket", required=True)
    serve.add_argument("--staging", action="store_true",
                       help="accept stage requests: fill an engine's weights while its process is restored, in "
                            "device memory this hydrator holds until the engine adopts it (or --stage-ttl)")
    serve.add_argument("--stage-ttl", type=_positive, default=STAGE_TTL,
                       help="seconds a staged allocation waits for its engine before it is freed")
    serve.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                       help="a uid whose processes may ask (repeatable; root and this process's uid always may)")
    serve.add_argument("--allow-gid", type=int, action="append", default=[], metavar="GID",
                       help="a gid whose processes may ask (repeatable; needs --socket-group to reach the socket)")
    serve.add_argument("--socket-group", type=int, default=None, metavar="GID",
                       help="the socket's group: mode 0660 instead of 0600")
    serve.add_argument("sources", nargs="+")
    dig = sub.add_parser("digest")
    dig.add_argument("path")
    dig.add_argument("offset", type=int)
    dig.add_argument("size", type=int)
    args = parser.parse_args(argv)
    try:
        if args.command == "digest":
            sys.stdout.write(region_digest(args.path, args.offset, args.size) + "\n")
            return 0
        peers = jsonline.Peers(uids=frozenset(args.allow_uid), gids=frozenset(args.allow_gid))
        HydratorServer(args.sources, stage_ttl=args.stage_ttl, staging=args.staging, peers=peers,
                       group=args.socket_group).serve(args.socket)
    except Exception as exc:
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The hydrator's command line: ``python -m coldsnap_probe.hydration serve --socket PATH FILE...`` (the node's
long-lived hydrator, `HydratorServer`) or ``digest FILE OFFSET SIZE`` (a region's digest)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from .. import jsonline
from ._device_tier import DEVICE_TIER_TTL
from ._digests import region_digest
from ._hydrator import DUMP_CHUNK, DUMP_CHUNKS, DUMP_THREADS, MAX_DUMP_THREADS, STAGE_TTL, HydratorServer
from ._ram_tier import default_budget, node_memory
from ._stage_quota import STAGE_UID_COUNT, STAGE_UID_SHARE

__all__ = ("main",)


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, not {text}")
    return int(text)


def _dump_threads(text: str) -> int:
    count = _count(text)
    if count > MAX_DUMP_THREADS:  # each reader keeps two page-locked buffers
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DUMP_THREADS}, not {text}")
    return count


def _dump_chunk(text: str) -> int:
    size = _bytes(text)
    if not DUMP_CHUNKS[0] <= size <= DUMP_CHUNKS[1] or size % 4096:
        raise argparse.ArgumentTypeError(f"must be a multiple of 4K from 64K to 64M, not {text}")
    return size


_SIZE = re.compile(r"([0-9]+)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _bytes(text: str) -> int:
    """A size: bytes, or a number with K, M, G or T (binary units; 40G, 40GiB and 40GB are the same)."""
    match = _SIZE.fullmatch(text.strip())
    if not match or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size (bytes, or with K, M, G, T), not {text}")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def _bytes_or_off(text: str) -> int:
    """0 (off) or a size (as `_bytes`)."""
    return 0 if text.strip() == "0" else _bytes(text)


def _budget(text: str) -> int:
    """The RAM tier's budget: 0 (off), `auto` (`default_budget`) or a size (as `_bytes`), at most the node's
    memory."""
    if text.strip() == "0":
        return 0
    if text.strip() == "auto":
        return default_budget()
    try:
        size = _bytes(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 0 (off), auto or a size (bytes, or with K, M, G, T), not "
                                         f"{text}") from None
    if size > (memory := node_memory()):
        raise argparse.ArgumentTypeError(f"must be at most the node's memory ({memory} bytes), not {text}")
    return size


def _serve_parser(serve: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`serve`'s options (the long-lived hydrator's)."""
    serve.add_argument("--socket", required=True)
    serve.add_argument("--staging", action="store_true",
                       help="accept stage requests: fill an engine's weights while its process is restored, in "
                            "device memory this hydrator holds until the engine adopts it (or --stage-ttl)")
    serve.add_argument("--stage-ttl", type=_positive, default=STAGE_TTL,
                       help="seconds a staged allocation waits for its engine before it is freed")
    serve.add_argument("--stage-uid-count", type=_count, default=None, metavar="N",
                       help=f"stages one peer uid may hold at once (default with --allow-uid/--allow-gid: "
                            f"{STAGE_UID_COUNT}; without: every stage)")
    serve.add_argument("--stage-uid-bytes", type=_bytes, default=None, metavar="SIZE",
                       help=f"device bytes one peer uid may hold in stages at once, e.g. 40G (default with "
                            f"--allow-uid/--allow-gid: 1/{STAGE_UID_SHARE} of the GPU's memory; without: all of it)")
    # Off unless asked for until the tier is measured on a GPU (issue 34): it pins up to its budget of host memory.
    serve.add_argument("--ram-tier-bytes", type=_budget, default=0, metavar="SIZE",
                       help="host memory that keeps staged device dumps page-locked across restores, so the next "
                            "stage of one is a DMA at the link's rate, e.g. 32G; auto: a quarter of the node's "
                            "memory; 0: off (the default; only with --staging)")
    serve.add_argument("--device-tier-bytes", type=_bytes_or_off, default=0, metavar="SIZE",
                       help="keep each dump staged in this much of the GPU's memory, so that the next stage of it is "
                       "a copy within the GPU (0: off, the default; only with --staging; memory engines cannot use)")
    serve.add_argument("--device-tier-ttl", type=_positive, default=DEVICE_TIER_TTL, metavar="SECONDS",
                       help="seconds a dump kept on the GPU stays unused before it is freed")
    serve.add_argument("--dump-threads", type=_dump_threads, default=DUMP_THREADS, metavar="N",
                       help=f"reader threads of a device dump's stage from the files (the disk tier; 1 to "
                            f"{MAX_DUMP_THREADS}, default {DUMP_THREADS}): fewer leave more CPU and memory bandwidth "
                            "to the restore beside it")
    serve.add_argument("--dump-chunk", type=_dump_chunk, default=DUMP_CHUNK, metavar="SIZE",
                       help=f"bytes each of those readers reads at a time, e.g. 2M (64K to 64M, a multiple of 4K; "
                            f"default {DUMP_CHUNK >> 20}M; each keeps two page-locked buffers of it)")
    serve.add_argument("--warm-captures", action=argparse.BooleanOptionalAction, default=True,
                       help="load a capture's device dumps into the RAM tier when its capture worker offers them, "
                            "so that its first restore stages from RAM (on by default where the tier is: a restore "
                            "that comes during the load copies what is pinned and reads the rest, never waiting)")
    serve.add_argument("--allow-uid", type=int, action="append", default=[], metavar="UID",
                       help="a uid whose processes may ask (repeatable; root and this process's uid always may)")
    serve.add_argument("--allow-gid", type=int, action="append", default=[], metavar="GID",
                       help="a gid whose processes may ask (repeatable; needs --socket-group to reach the socket)")
    serve.add_argument("--status-uid", type=int, action="append", default=[], metavar="UID",
                       help="a uid whose processes may ask for the status only, the RAM tier's counters included "
                            "(repeatable): the provider daemon's account, for its metrics")
    serve.add_argument("--socket-group", type=int, default=None, metavar="GID",
                       help="the socket's group: mode 0660 instead of 0600")
    serve.add_argument("sources", nargs="*", help="weight files to keep page-locked (none: a hydrator that only "
                       "stages the CUDA interposer's device dumps, with --staging)")
    return serve


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coldsnap_probe.hydration serve --socket PATH FILE...`` (the long-lived hydrator) or
    ``digest FILE OFFSET SIZE``."""
    parser = argparse.ArgumentParser(prog="python -m coldsnap_probe.hydration")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = _serve_parser(sub.add_parser("serve"))
    dig = sub.add_parser("digest")
    dig.add_argument("path")
    dig.add_argument("offset", type=int)
    dig.add_argument("size", type=int)
    args = parser.parse_args(argv)
    if args.command == "serve" and args.ram_tier_bytes and not args.staging:
        serve.error("argument --ram-tier-bytes: only with --staging (the tier holds the dumps this hydrator stages)")
    if args.command == "serve" and args.device_tier_bytes and not args.staging:
        serve.error("argument --device-tier-bytes: only with --staging (the tier holds the dumps this hydrator stages)")
    try:
        if args.command == "digest":
            sys.stdout.write(region_digest(args.path, args.offset, args.size) + "\n")
            return 0
        peers = jsonline.Peers(uids=frozenset(args.allow_uid), gids=frozenset(args.allow_gid))
        HydratorServer(args.sources, stage_ttl=args.stage_ttl, staging=args.staging, peers=peers,
                       group=args.socket_group, stage_uid_count=args.stage_uid_count,
                       stage_uid_bytes=args.stage_uid_bytes, ram_tier_bytes=args.ram_tier_bytes,
                       status_uids=frozenset(args.status_uid), dump_threads=args.dump_threads,
                       warm_captures=args.warm_captures, dump_chunk=args.dump_chunk,
                       device_tier_bytes=args.device_tier_bytes,
                       device_tier_ttl=args.device_tier_ttl).serve(args.socket)
    except Exception as exc:
        sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A CPU process shaped like a restored inference engine, for CRIU to dump and restore (bench/criu_restore_phases.py).

    python bench/engine_shape_target.py --dir DIR [--threads 100] [--anon-mib 680] [--heap-mib 460] [--libs 300]
                                        [--weights-mib 0] [--state-mib 0] [--seed 7] [--heap-seeded]
                                        [--touch 0]

What makes CRIU's restore of `transformers serve` cost more than its page fill, as far as a CPU allows: `--threads`
idle threads (PyTorch's, uvloop's and the tokenizers' pools: each an 8 MiB stack and a guard page), `--libs` shared
libraries of this system loaded (torch's and CUDA's: hundreds of file mappings), `--anon-mib` MiB of private
anonymous memory in 128 MiB mappings (the CUDA checkpoint's host copy) and `--heap-mib` MiB of Python objects of
mixed sizes (the interpreter's heap and malloc's arenas), none of it pages of zeros (a dump leaves those out), a
listening TCP socket on 127.0.0.1, an epoll set over it and an eventfd, and a memfd. For two captures of the same
model (bench/capsule_transfer.py --source criu): `--weights-mib` MiB of distinct pages that are the same bytes every
run (a stream seeded with `--seed`: the model's weights in host memory), then `--state-mib` MiB of fresh random bytes
each run (a KV cache, activations); `--heap-seeded`: the heap's objects hold seeded bytes (each object its own,
the same every run) instead of the repeating pattern, whose few distinct pages are not what a real heap holds.
DIR/shape.json says what it has (threads, mappings, libraries, the port); DIR/ready holds its pid; then it waits
in epoll for ever. Each connection to the port is a request served: `--touch` places of its memory (heap and state,
each place 4 pages) get a few fresh bytes per page (counters, reference counts: a server's first token after a
restore changes ~600 places per GiB of its page image, bench/results/h200-store-second-restored-16l-2026-12-02),
then it answers one byte and closes the connection.
Standard library only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import select
import socket
import threading
from pathlib import Path

MIB = 1 << 20
LIB_DIR = Path("/usr/lib/x86_64-linux-gnu")
# Libraries whose constructors start services, replace malloc, need a display or a GPU, or embed an interpreter:
# not loaded (the GPU machine's /usr/lib holds the driver's).
SKIPPED = ("libc.so", "ld-linux", "libnss", "libpam", "libGL", "libEGL", "libdrm", "libsystemd", "jemalloc",
           "tcmalloc", "san.so", "libSegFault", "libmemusage", "libpcprofile", "libc_malloc", "libvulkan", "nvidia",
           "libcuda", "libnv", "vdpau", "OpenCL", "libgbm", "libwayland", "libpython", "libperl", "libruby")
HEAP_SIZES = (4096, 65536, 300_000, MIB, 4 * MIB)  # small objects in arenas, large ones mmapped by malloc


def load_libraries(count: int) -> int:
    """dlopen up to `count` of this system's shared libraries (and what they need); how many loaded."""
    loaded = 0
    for path in sorted(LIB_DIR.glob("*.so*")):
        if loaded >= count:
            break
        if any(s in path.name for s in SKIPPED):
            continue
        try:
            ctypes.CDLL(str(path))
        except OSError:  # a library needing a symbol this process lacks
            continue
        loaded += 1
    return loaded


def pattern(size: int) -> bytes:
    """`size` bytes with no page of zeros in them."""
    block = bytes(range(1, 256)) * (MIB // 255 + 1)
    return (block * (size // len(block) + 1))[:size]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--threads", type=int, default=100)
    parser.add_argument("--anon-mib", type=int, default=680)
    parser.add_argument("--heap-mib", type=int, default=460)
    parser.add_argument("--libs", type=int, default=300)
    parser.add_argument("--weights-mib", type=int, default=0)
    parser.add_argument("--state-mib", type=int, default=0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--heap-seeded", action="store_true")
    parser.add_argument("--touch", type=int, default=0)
    args = parser.parse_args()
    control = Path(args.dir)
    libs = load_libraries(args.libs)
    one = pattern(MIB)
    regions = []
    for _ in range(-(-args.anon_mib // 128)):
        region = mmap.mmap(-1, 128 * MIB, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for at in range(0, 128 * MIB, MIB):
            region[at:at + MIB] = one
        regions.append(region)
    stream = random.Random(args.seed)
    for size, fill in ((args.weights_mib * MIB, stream.randbytes), (args.state_mib * MIB, os.urandom)):
        if size:
            region = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for at in range(0, size, MIB):
                region[at:at + MIB] = fill(MIB)
            regions.append(region)
    heap, held = [], 0
    while held < args.heap_mib * MIB:
        size = HEAP_SIZES[len(heap) % len(HEAP_SIZES)]
        heap.append(bytearray(stream.randbytes(size) if args.heap_seeded else pattern(size)))
        held += size
    idle = threading.Event()
    for _ in range(args.threads):
        threading.Thread(target=idle.wait, daemon=True).start()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    poller = select.epoll()
    wake = os.eventfd(0)
    poller.register(server.fileno(), select.EPOLLIN)
    poller.register(wake, select.EPOLLIN)
    memfd = os.memfd_create("engine-shape")
    os.ftruncate(memfd, MIB)
    shape = {"threads": threading.active_count(), "libraries": libs,
             "mappings": len(Path("/proc/self/maps").read_text().splitlines()), "port": server.getsockname()[1],
             "anon_bytes": sum(map(len, regions)), "heap_bytes": held}
    (control / "shape.json").write_text(json.dumps(shape))
    (control / "ready").write_text(str(os.getpid()))
    touched = [*heap, *regions[-1:]] if args.state_mib else heap
    while True:
        for fd, _ in poller.poll():
            if fd == server.fileno():
                connection = server.accept()[0]
                touch(touched, args.touch)
                connection.sendall(b"1")
                connection.close()


def touch(memory: list[bytearray] | list[mmap.mmap], places: int) -> None:
    """Write 8 fresh bytes into each of 4 pages at `places` places of `memory`, chosen by their share of its bytes."""
    sizes = [len(m) for m in memory]
    rng = random.Random(os.urandom(8))
    for _ in range(places):
        at = rng.randrange(sum(sizes))
        for block, size in zip(memory, sizes, strict=True):
            if at < size:
                for page in range(at - at % 4096, min(at - at % 4096 + 4 * 4096, size - 8), 4096):
                    block[page:page + 8] = os.urandom(8)
                break
            at -= size


if __name__ == "__main__":
    main()

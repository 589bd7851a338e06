"""A capture's push, side by side in one run (issue 34: push at the registry link's rate):

    python bench/store_push.py [--mib 2048] [--work DIR] [--registry-root DIR] [--chunks-kib 64,161,651]

Debian's `docker-registry` on 127.0.0.1 (its storage under `--registry-root`, tmpfs by default, so the registry's
own disk is not the bound), a capture of `--mib` random MiB in 64 MiB chunks in a fresh node store under `--work`
(the disk, written just before, as after an image-build) for each way:

* the link: the same number of 64 MiB blobs from memory, 8 at a time (POST + PUT, http.client in threads:
  `capsule_transfer.registry_link_parallel`, the figure `scripts/device store` reports);
* the event loop (the push before issue 34's item: aiohttp on the daemon's loop, each blob read whole into a
  `bytes` in a thread, then sent by the loop, 8 at a time; kept here only as the baseline);
* the worker threads (`CaptureRegistry.push`: each blob in a thread of its own limiter, HEAD first, the body sent
  from the store's file by `sendfile`, 8 at a time);
* the same push again: every blob is there already (HEAD only; "a second capture adds ≤ 5 % new bytes").

`--chunks-kib`: instead, what the chunk count costs: for each size, a capture of one `--mib` MiB page image cut in
chunks of that many KiB (as coldsnap_runtime/chunking.py cuts them, on average) pushed by the worker threads to a
fresh repository, pulled into an empty store (`CaptureRegistry.pull`, 8 at a time), then pushed again (HEAD only).
With `--before REF`: the same capture (one size) pushed, pulled and pushed again by REF's coldsnap_runtime (a git
revision) and this checkout's, in turns `--rounds` times, each in a child process importing its own package, with
the CPU seconds each blob cost our process and the registry's (its /proc stat): what is ours, what the registry's.

`--second PERCENT`: instead, a second capture's push (issue 34's memory of the blobs a repository holds): one capture
of a `--mib` MiB page image in ~194 KiB chunks pushed, then captures sharing all but PERCENT % of its chunks pushed to
the same repository by turns with the memory off (a HEAD for every blob) and on (`_blob_memory.py`: a HEAD only for
the blobs not seen there), `--rounds` times each; the blobs asked for (a HEAD, or a POST that mounts it from the
repository) counted in the registry's own access log.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "--side" in sys.argv:  # a side's child: its tree's coldsnap_runtime (`--before`'s revision), imported now (bench's
    sys.path.insert(0, sys.argv[sys.argv.index("--side") + 1])  # modules put the checkout first when imported)
    import coldsnap_runtime  # noqa: F401

from bench._common import table
from bench.capsule_transfer import registry_link_parallel, start_registry
from coldsnap_runtime.backend import BlobMemory, CaptureRegistry, KnownBlobs, Transferred
from coldsnap_runtime.store import CHUNK_BYTES, OCI_MANIFEST, CaptureStore, StoredFile, artifact_manifest

PARALLEL = 8  # large blobs in flight at once, as the daemon's (coldsnap_runtime's _capture_registry.PARALLEL)
SMALL_PARALLEL = 32  # and small ones beside them (_capture_registry.SMALL_PARALLEL)
SECOND_CHUNK_KIB = 194  # a page image's average chunk (coldsnap_runtime/chunking.py)


def fill_cut(root: Path, mib: int, chunk_kib: int) -> tuple[CaptureStore, str]:
    """A store holding one capture of `mib` random MiB: one page image in chunks of `chunk_kib` KiB (format 2)."""
    store = CaptureStore(root)
    store.open()
    size, length = mib << 20, chunk_kib << 10
    lengths = [min(length, size - at) for at in range(0, size, length)]
    return store, record_cut(store, [store.put_blob(os.urandom(n)) for n in lengths], lengths)


def record_cut(store: CaptureStore, chunks: list[str | None], lengths: list[int]) -> str:
    """The capture of one page image made of `chunks` (format 2), recorded in `store`."""
    size = sum(lengths)
    files = [StoredFile(path="images/pages-1.img", size=size, mode=0o644, chunks=chunks, lengths=lengths)]
    data = json.dumps({"format": 2, "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks,
                                                "lengths": f.lengths} for f in files]},
                      sort_keys=True, separators=(",", ":")).encode()
    return store.record(artifact_manifest(data, files), data)


def registry(store: CaptureStore, address: str, repository: str, action: str,
             known: KnownBlobs | None = None, small: int = SMALL_PARALLEL) -> CaptureRegistry:
    """The daemon's registry client, `small` small blobs in flight beside PARALLEL large ones (threads as the daemon's
    node limits give them, per push or pull)."""
    threads = 2 * (PARALLEL + small)
    return CaptureRegistry(store, registry=address, repository=repository, auth=None, insecure=True, action=action,
                           fetches=anyio.CapacityLimiter(threads), share=anyio.CapacityLimiter(threads),
                           uploads=anyio.CapacityLimiter(threads), known=known, small_parallel=small)


def heads(log: Path, address: str, repository: str) -> int:
    """The blobs of `repository` asked for in the registry's access log (a HEAD, or a POST that mounts it from there),
    once a request sent now is in it (each line is written after its answer)."""
    marker = f"/v2/{repository}-marker/blobs/sha256:{os.urandom(32).hex()}"  # another repository: not counted
    connection = http.client.HTTPConnection(address, timeout=30)
    connection.request("HEAD", marker)
    connection.getresponse().read()
    connection.close()
    while marker not in (text := log.read_text()):
        time.sleep(0.01)
    name = re.escape(repository)
    return len(re.findall(rf'"(?:HEAD /v2/{name}/blobs/|POST /v2/{name}/blobs/uploads/\?mount=)sha256:[0-9a-f]{{64}}'
                          r'\S* HTTP', text))


def second_rows(work: Path, address: str, log: Path, mib: int, new_percent: float, rounds: int) -> list[list[str]]:
    """A first capture pushed (filling the memory), then second captures sharing all but `new_percent` % of its chunks
    pushed to the same repository, memory off and on by turns (each with chunks of its own that are new)."""
    store = CaptureStore(work / "second")
    store.open()
    size, length = mib << 20, SECOND_CHUNK_KIB << 10
    lengths = [min(length, size - at) for at in range(0, size, length)]
    chunks: list[str | None] = [store.put_blob(os.urandom(n)) for n in lengths]
    repository = "bench/second"
    known = BlobMemory().scope(manager=None, registry=address, repository=repository, auth=None)
    first = record_cut(store, chunks, lengths)
    seconds, done = timed(lambda: anyio.run(registry(store, address, repository, "image-push", known).push, first))
    rows = [["first capture (fills the memory)", f"{seconds:.2f}", str(heads(log, address, repository)),
             str(done.blobs), f"{done.bytes / 1e6:.1f}", "0"]]
    every = max(1, round(100 / new_percent))
    for turn in range(2 * rounds):
        memory = known if turn % 2 else None
        changed = list(chunks)
        for index in range(turn % every, len(chunks), every):  # each turn's new chunks are its own
            changed[index] = store.put_blob(os.urandom(lengths[index]))
        capture = record_cut(store, changed, lengths)
        asked = heads(log, address, repository)
        seconds, done = timed(lambda c=capture, m=memory: anyio.run(
            registry(store, address, repository, "image-push", m).push, c))
        rows.append([f"second capture, memory {'on' if memory else 'off'}", f"{seconds:.2f}",
                     str(heads(log, address, repository) - asked), str(done.blobs), f"{done.bytes / 1e6:.1f}",
                     str(done.remembered)])
    return rows


def chunk_rows(work: Path, address: str, mib: int, sizes: list[int], smalls: list[int]) -> list[list[str]]:
    """Push, pull and push again of a `mib` MiB capture at each chunk size and each count of small blobs in flight,
    each in a repository of its own (the settings taking turns on one machine, in one run)."""
    rows = []
    for kib in sizes:
        for small in smalls:
            name = f"{kib}-{small}"
            store, capture = fill_cut(work / f"push-{name}", mib, kib)
            pushed = registry(store, address, f"bench/chunks-{name}", "image-push", small=small)
            seconds, done = timed(lambda pushed=pushed, capture=capture: anyio.run(pushed.push, capture))
            empty = CaptureStore(work / f"pull-{name}")
            empty.open()
            pulled = registry(empty, address, f"bench/chunks-{name}", "image-pull", small=small)
            pull_s, fetched = timed(lambda pulled=pulled, capture=capture: anyio.run(pulled.pull, capture))
            again_s, _ = timed(lambda pushed=pushed, capture=capture: anyio.run(pushed.push, capture))
            manifest = len(store.manifest(capture))
            rows.append([f"{kib} KiB", str(small), str(done.blobs), f"{manifest / 1e6:.2f}", f"{seconds:.2f}",
                         f"{done.bytes / seconds / 1e9:.3f}", f"{pull_s:.2f}", f"{fetched.bytes / pull_s / 1e9:.3f}",
                         f"{again_s:.2f}"])
            shutil.rmtree(work / f"push-{name}", ignore_errors=True)
            shutil.rmtree(work / f"pull-{name}", ignore_errors=True)
    return rows


def cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds of `pid` (None: this process, all its threads)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def side(store_root: Path, capture: str, address: str, registry_pid: int, repository: str, small: int,
         pulled: Path) -> dict[str, list[float]]:
    """A child's part: push, pull and push again of `capture`; per phase (seconds, blobs, our CPU s, registry's)."""
    store = CaptureStore(store_root)
    store.open()
    empty = CaptureStore(pulled)
    empty.open()
    phases = {"push": lambda: registry(store, address, repository, "image-push", small=small).push(capture),
              "pull": lambda: registry(empty, address, repository, "image-pull", small=small).pull(capture),
              "again": lambda: registry(store, address, repository, "image-push", small=small).push(capture)}
    out = {}
    for name, run in phases.items():
        ours, theirs, started = cpu_seconds(), cpu_seconds(registry_pid), time.perf_counter()
        done = anyio.run(run)
        out[name] = [time.perf_counter() - started, done.blobs + done.present_blobs, cpu_seconds() - ours,
                     cpu_seconds(registry_pid) - theirs]
    return out


def before_rows(work: Path, address: str, registry_pid: int, mib: int, kib: int, small: int, ref: str,
                rounds: int) -> list[list[str]]:
    """One capture pushed, pulled and pushed again by `ref`'s package and this checkout's, in turns."""
    tree = Path(ref)  # a directory holding a coldsnap_runtime (where the checkout has no git history), or a ref
    if not (tree / "coldsnap_runtime").is_dir():
        tree = work / "before"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "coldsnap_runtime"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    _, capture = fill_cut(work / "source", mib, kib)
    rows = []
    for turn in range(rounds):
        for name, root in ((f"before ({ref})", tree), ("this checkout", ROOT)):
            repository = f"bench/before-{turn}-{'before' if root == tree else 'after'}"
            shutil.rmtree(work / "pulled", ignore_errors=True)
            out = subprocess.run([sys.executable, __file__, "--side", str(root), "--store", str(work / "source"),
                                  "--capture", capture, "--address", address, "--registry-pid", str(registry_pid),
                                  "--repository", repository, "--small-parallel", str(small),
                                  "--pulled", str(work / "pulled")], check=True, capture_output=True, text=True)
            phases = json.loads(out.stdout.splitlines()[-1])
            per_blob = [f"{phases[p][key] / phases[p][1] * 1e3:.2f}" for key in (0, 2, 3) for p in ("push", "pull",
                                                                                                     "again")]
            rows.append([f"{name} #{turn + 1}", str(phases["push"][1]), *[f"{phases[p][0]:.2f}" for p in
                                                                          ("push", "pull", "again")],
                         " / ".join(per_blob[0:3]), " / ".join(per_blob[3:6]), " / ".join(per_blob[6:9])])
    return rows


def fill_store(root: Path, mib: int) -> tuple[CaptureStore, str]:
    """A store holding one capture of `mib` random MiB, one file per 64 MiB chunk."""
    store = CaptureStore(root)
    store.open()
    files = []
    for index in range(max(1, (mib << 20) // CHUNK_BYTES)):
        chunk = store.put_blob(os.urandom(CHUNK_BYTES))
        files.append(StoredFile(path=f"images/pages-{index}.img", size=CHUNK_BYTES, mode=0o644, chunks=[chunk]))
    data = json.dumps({"format": 1, "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": f.chunks}
                                                for f in files]}, sort_keys=True, separators=(",", ":")).encode()
    return store, store.record(artifact_manifest(data, files), data)


async def loop_push(store: CaptureStore, address: str, repository: str, capture: str) -> Transferred:
    """The baseline: every body byte sent by the event loop (the daemon's push before this change)."""
    manifest = store.manifest(capture)
    document = json.loads(manifest)
    blobs = [(document["config"]["digest"], int(document["config"]["size"]))]
    blobs += [(layer["digest"], int(layer["size"])) for layer in document["layers"]]
    base, done, limit = f"http://{address}/v2/{repository}", Transferred(), anyio.Semaphore(PARALLEL)
    async with aiohttp.ClientSession() as session:

        async def one(digest: str, size: int) -> None:
            async with limit:
                async with session.head(f"{base}/blobs/{digest}") as answer:
                    if answer.status == 200:
                        done.add(size, present=True)
                        return
                async with session.post(f"{base}/blobs/uploads/") as answer:
                    location = answer.headers["Location"]
                data = await anyio.to_thread.run_sync(store.blob_path(digest).read_bytes)
                separator = "&" if "?" in location else "?"
                async with session.put(f"{location}{separator}digest={digest}", data=data) as answer:
                    assert answer.status == 201, await answer.text()
                done.add(size, present=False)

        async with anyio.create_task_group() as group:
            for digest, size in blobs:
                group.start_soon(one, digest, size)
        async with session.put(f"{base}/manifests/{capture}", data=manifest,
                               headers={"Content-Type": OCI_MANIFEST}) as answer:
            assert answer.status == 201, await answer.text()
    return done


def thread_push(store: CaptureStore, address: str, repository: str, capture: str) -> Transferred:
    return anyio.run(registry(store, address, repository, "image-push").push, capture)


def timed(work: object) -> tuple[float, Transferred]:
    started = time.perf_counter()
    done = work() if callable(work) else None
    assert isinstance(done, Transferred)
    return time.perf_counter() - started, done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--work", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--registry-root", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--chunks-kib", default="", help="chunk sizes to compare (KiB, comma-separated)")
    parser.add_argument("--small-parallel", default=str(SMALL_PARALLEL),
                        help="with --chunks-kib: small blobs in flight to compare (comma-separated)")
    parser.add_argument("--second", type=float, default=0.0, help="a second capture's new chunks (percent)")
    parser.add_argument("--rounds", type=int, default=2, help="second pushes with the memory off and on, each; "
                        "with --before, turns of each side")
    parser.add_argument("--before", help="with --chunks-kib (one size, one N): a git ref (or a directory holding a "
                        "coldsnap_runtime) whose coldsnap_runtime runs beside this checkout's")
    for hidden in ("--side", "--store", "--capture", "--address", "--registry-pid", "--repository", "--pulled"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)  # a side's child (`--before`)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(Path(args.store), args.capture, args.address, int(args.registry_pid), args.repository,
                              int(args.small_parallel), Path(args.pulled))))
        return
    work = Path(tempfile.mkdtemp(prefix="store-push-", dir=args.work))
    registry_root = Path(tempfile.mkdtemp(prefix="store-push-registry-", dir=args.registry_root))
    process, address = start_registry(registry_root, work / "registry.log")
    try:
        if args.second:
            rows = second_rows(work, address, work / "registry.log", args.mib, args.second, args.rounds)
            print(f"a second capture's push: a {args.mib} MiB page image in {SECOND_CHUNK_KIB} KiB chunks, "
                  f"{args.second} % of them new, docker-registry on 127.0.0.1 (storage on {args.registry_root}), "
                  f"{os.cpu_count()} cores, {PARALLEL} at a time; asks (HEAD or mount) from the registry's access log; "
                  "one run")
            print(table(["push", "s", "asks", "blobs sent", "MB sent", "not asked (remembered)"], rows))
            return
        if args.before:
            kib, small = int(args.chunks_kib), int(args.small_parallel)
            rows = before_rows(work, address, process.pid, args.mib, kib, small, args.before, args.rounds)
            print(f"a {args.mib} MiB page image in {kib} KiB chunks, {small} small blobs at a time, docker-registry "
                  f"on 127.0.0.1 (storage on {args.registry_root}), {os.cpu_count()} cores; each side in a child "
                  "process, by turns; CPU from getrusage (ours, every thread) and /proc (the registry's)")
            print(table(["side", "blobs", "push s", "pull s", "push again s (HEAD only)",
                         "ms a blob: push / pull / again", "our CPU ms a blob", "registry CPU ms a blob"], rows))
            return
        if args.chunks_kib:
            rows = chunk_rows(work, address, args.mib, [int(k) for k in args.chunks_kib.split(",")],
                              [int(n) for n in args.small_parallel.split(",")])
            print(f"a {args.mib} MiB page image by chunk size, docker-registry on 127.0.0.1 (storage on "
                  f"{args.registry_root}), {os.cpu_count()} cores, blobs under 1 MiB N at a time; one run")
            print(table(["chunks", "N", "blobs", "manifest MB", "push s", "push GB/s", "pull s", "pull GB/s",
                         "push again s (HEAD only)"], rows))
            return
        sample = work / "link-sample.bin"
        with sample.open("wb") as out:
            for _ in range(max(1, (args.mib << 20) // CHUNK_BYTES)):
                out.write(os.urandom(CHUNK_BYTES))
        rows: list[list[str]] = []
        ways = (("the event loop (aiohttp, before)", lambda s, c: anyio.run(loop_push, s, address, "bench/loop", c)),
                ("worker threads (sendfile from the store)", lambda s, c: thread_push(s, address, "bench/threads", c)))
        for name, push in ways:
            store, capture = fill_store(work / name.split()[0], args.mib)
            # The link just before each way: on a shared machine the rate moves between measurements.
            link = registry_link_parallel(address, sample)["push"]
            rows.append([f"the link, just before: {args.mib >> 6} blobs of 64 MiB from memory, 8 at a time", "",
                         f"{(args.mib << 20) / 1e9:.2f}", f"{link:.2f}", "100 %"])
            seconds, done = timed(lambda push=push, store=store, capture=capture: push(store, capture))
            gbps = done.bytes / seconds / 1e9
            rows.append([name, f"{seconds:.2f}", f"{done.bytes / 1e9:.2f}", f"{gbps:.2f}", f"{gbps / link:.0%}"])
            if name.startswith("worker"):
                seconds, again = timed(lambda store=store, capture=capture: thread_push(store, address,
                                                                                        "bench/threads", capture))
                rows.append(["the same push again (every blob there: HEAD only)", f"{seconds:.2f}",
                             f"{again.bytes / 1e9:.2f} sent, {again.present_bytes / 1e9:.2f} present", "", ""])
        sample.unlink()
        print(f"push of a {args.mib} MiB capture to docker-registry on 127.0.0.1 (storage on {args.registry_root}), "
              f"{os.cpu_count()} cores; one run")
        print(table(["way", "s", "GB", "GB/s", "of the link just before"], rows))
    finally:
        process.kill()
        process.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(registry_root, ignore_errors=True)


if __name__ == "__main__":
    main()

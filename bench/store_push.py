"""A capture's push, side by side in one run (issue 34: push at the registry link's rate):

    python bench/store_push.py [--mib 2048] [--work DIR] [--registry-root DIR]

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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table
from bench.capsule_transfer import registry_link_parallel, start_registry
from coldsnap_runtime.backend import CaptureRegistry, Transferred
from coldsnap_runtime.store import CHUNK_BYTES, OCI_MANIFEST, CaptureStore, StoredFile, artifact_manifest

PARALLEL = 8  # blobs in flight at once, as the daemon's push (coldsnap_runtime's _capture_registry.PARALLEL)


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
    registry = CaptureRegistry(store, registry=address, repository=repository, auth=None, insecure=True,
                               action="image-push", fetches=anyio.CapacityLimiter(2 * PARALLEL),
                               uploads=anyio.CapacityLimiter(2 * PARALLEL))
    return anyio.run(registry.push, capture)


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
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="store-push-", dir=args.work))
    registry_root = Path(tempfile.mkdtemp(prefix="store-push-registry-", dir=args.registry_root))
    process, address = start_registry(registry_root)
    try:
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

"""The capture store's whole path on one GPU node (issue 34 item 1), as a controller drives it: runtime-v1 only.

    python bench/e2e_store.py --state-dir DIR --capsule TAG --model DIR --work DIR --out DIR --context DIR
                              --store DIR --registry-root DIR [--build CONTEXT=TAG] [--mode MODE] [--restores 3]
                              [--port 18471] [--rate-mib 4096] [--second-capture]

Against a running `coldsnap-provider serve` whose `[docker] capture_store` is `--store`, and Debian's
`docker-registry` started here on 127.0.0.1 (its storage under `--registry-root`: tmpfs on the GPU machine, whose
disk cannot hold the registry beside the store). One run, each phase timed, the run stopping at the first phase
that fails and saying which:

1. the machine's own rates: a memory copy, the store's disk (an O_DIRECT write; O_DIRECT reads by 1 and by 16
   readers; a read through the page cache by 16, as the node hydrator's ring reads), the registry link (2 GiB up
   and down by default, one blob and 64 MiB blobs 8 at a time);
2. `transformers serve`, unchanged, cold in its capsule and captured by the in-capsule worker (bench/e2e_serve.py's
   plumbing, path `--mode`), the images written into `--context`/images;
3. `image-build` of a capsule `FROM` the capsule with `COPY images /images`: the daemon takes the capture into the
   node store (chunks; the image keeps stubs); `image-push` to the registry (the capture beside the image);
4. `image-remove`, the capture removed from the node store (`coldsnap-provider capture rm`), the page cache dropped;
5. `image-pull` (the chunks back into the store, each checked, and the capture's files made from them), then
   `--restores` restores of the pulled capsule, each from a dropped page cache ("capsule already pulled, page cache
   dropped": the issue's goal). Each to the first token of a streamed completion, which must equal the cold one;
   the disk's bytes read during it (the block device's counters) beside the goal, bytes read / the disk's best read
   rate + 1.0 s.

With `--second-capture` (issue 34's goal: a second capture of the same model adds <= 5 % new bytes to the registry
and to the node store), instead of 1, 4 and 5: the cold server is captured, built into the store and pushed, its
images removed; then a second cold server of the same model the same way. What the second adds is read from the
store's directory and the registry's storage, and per kind of file (CRIU's page images, the device dumps) beside
what 64 MiB chunks from each file's start would have added (bench/capture_pair.py).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import drop_caches, table
from bench.capsule_transfer import (
    directory_bytes,
    memory_copy_gbps,
    registry_link,
    registry_link_parallel,
    start_registry,
)
from bench.capture_pair import (
    Fingerprint,
    fingerprint,
    region_rows,
    region_table,
    share_rows,
    share_table,
    worst_table,
)
from bench.cold_read import read_parallel, write_direct
from bench.e2e_restore import IMAGES, RUN, Driver, inspect_capsule
from bench.e2e_serve import (
    build_capsules,
    capture_server,
    images_bytes,
    remove_units,
    serve_and_capture,
    unit_names,
)
from bench.interposer_units import InterposerLayout
from bench.serve_units import MODES, STAGED, cluster, restore_once, serve_layout, start_cold

REFERENCE = "coldsnap/capsule-store:1"
SECOND_REFERENCE = "coldsnap/capsule-store-second:"  # --second-capture: :1 and :2


class PhaseFailed(Exception):
    """A phase of the path failed: its name comes first in the message."""


@dataclass
class StoreLayout(InterposerLayout):
    """The restore units of the store's path: their images come with the pulled capsule (the store's files mounted
    over its stubs by workload-run), so the host's images directory is not mounted over them."""

    def mounts(self) -> list[dict[str, Any]]:
        return [m for m in super().mounts() if m["target"] != IMAGES]


class Disk:
    """The block device under a path: bytes read and written since boot (its /sys counters, 512-byte sectors)."""

    def __init__(self, path: Path) -> None:
        st = os.stat(path)
        self.stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")

    def counters(self) -> tuple[int, int]:
        if not self.stat.exists():
            return 0, 0
        values = self.stat.read_text().split()
        return int(values[2]) * 512, int(values[6]) * 512


class Run:
    """The run's record: each phase's seconds and bytes (rows), the machine's rates, what failed."""

    def __init__(self, disk: Disk) -> None:
        self.disk = disk
        self.rows: list[dict[str, Any]] = []
        self.rates: dict[str, float] = {}
        self.notes: list[str] = []
        self.failed: str | None = None

    async def phase(self, name: str, work: Callable[[], Awaitable[Any]], *, moved: Callable[[Any], int] | None = None
                    ) -> Any:
        """Run one phase, timed, with the disk's bytes read and written during it; a failure names the phase."""
        read, written = self.disk.counters()
        started = time.perf_counter()
        try:
            value = await work()
        except Exception as exc:
            self.failed = f"phase {name!r} failed: {type(exc).__name__}: {exc}"
            raise PhaseFailed(self.failed) from exc
        seconds = time.perf_counter() - started
        now_read, now_written = self.disk.counters()
        row = {"phase": name, "seconds": seconds, "disk_read": now_read - read, "disk_written": now_written - written,
               "bytes": moved(value) if moved else None}
        self.rows.append(row)
        print(f"== {name}: {seconds:.2f} s, disk read {row['disk_read'] / 1e9:.2f} GB, written "
              f"{row['disk_written'] / 1e9:.2f} GB" + (f", {row['bytes'] / 1e9:.2f} GB moved" if moved else ""),
              flush=True)
        return value


def measure_rates(run: Run, args: argparse.Namespace, address: str) -> None:
    """The memory copy, the store's disk with O_DIRECT, the registry link (a `--link-mib` sample on tmpfs)."""
    rates = run.rates
    rates["memory copy"] = memory_copy_gbps()
    probe = Path(args.store).parent / "rate.bin"
    size = args.rate_mib << 20
    rates["disk write, O_DIRECT (1 writer x 8 MiB, fsync)"] = write_direct(probe, size)
    drop_caches()
    rates["disk read, O_DIRECT (1 reader x 8 MiB)"] = read_parallel(probe, threads=1, direct=True)
    drop_caches()
    rates["disk read, O_DIRECT (16 readers x 8 MiB)"] = read_parallel(probe, direct=True)
    drop_caches()
    rates["disk read through the page cache (16 readers x 8 MiB: the hydrator's ring)"] = read_parallel(probe,
                                                                                                      direct=False)
    probe.unlink()
    sample = Path(args.registry_root) / "link-sample.bin"
    with sample.open("wb") as out:
        for _ in range(args.link_mib // 8):
            out.write(os.urandom(8 << 20))
    for kind, rate in registry_link(address, sample).items():
        rates[f"registry link, {kind.split('_')[0]} (one uncompressed blob)"] = rate
    for kind, rate in registry_link_parallel(address, sample).items():
        rates[f"registry link, {kind} (64 MiB blobs, 8 at a time)"] = rate
    sample.unlink()


def store_captures(store: Path) -> set[str]:
    return {"sha256:" + p.name.removesuffix(".json") for p in (store / "captures").glob("*.json")}


async def build_push_remove(d: Driver, run: Run, args: argparse.Namespace, reference: str, images: Path) -> str:
    """image-build (the capture into the store), image-push, image-remove and the capture removed; its id."""
    context = Path(args.context)
    dockerfile = f"FROM {args.capsule}\nCOPY images /images\n".encode()
    before = store_captures(Path(args.store))
    carried = images_bytes(images)["images_bytes"]
    await run.phase("image-build (the capture into the node store)", lambda: d.expect(
        "image-build", "image-build", build={"dockerfile": base64.b64encode(dockerfile).decode(),
                                             "context": str(context), "tag": reference, "pull": False}),
        moved=lambda _: carried)
    new = store_captures(Path(args.store)) - before
    if len(new) != 1:
        raise PhaseFailed(f"phase 'image-build' left {len(new)} new captures in the store, not 1")
    capture = new.pop()
    run.notes.append(f"capture {capture}: {carried / 1e9:.2f} GB of images; the node store holds "
                     f"{directory_bytes(Path(args.store)) / 1e9:.2f} GB for it")
    registry = Path(args.registry_root) / "registry"
    before_push = directory_bytes(registry) if registry.exists() else 0
    await run.phase("image-push (the capture's chunks, then the image)",
                    lambda: d.expect("image-push", "image-push", image=reference),
                    moved=lambda _: directory_bytes(registry) - before_push)

    async def remove() -> None:
        await d.expect("image-remove", "image-remove", image=reference)
        subprocess.run([sys.executable, "-m", "coldsnap_provider", "capture", "rm", "--state-dir", args.state_dir,
                        capture], check=True, capture_output=True, text=True)
        shutil.rmtree(images, ignore_errors=True)  # the capture now lives in the registry alone
        if not drop_caches():
            raise PhaseFailed("the page cache could not be dropped (root needed)")

    await run.phase("image-remove, the capture removed from the node store, page cache dropped", remove)
    if capture in store_captures(Path(args.store)):
        raise PhaseFailed(f"capture {capture} is still in the node store after capture rm")
    return capture


async def pull_and_restore(d: Driver, run: Run, args: argparse.Namespace, reference: str, layout: StoreLayout,
                           capture_id: str, cold_text: str) -> list[dict[str, Any]]:
    """image-pull, then the restores of the pulled capsule, each from a dropped page cache."""
    stored = directory_bytes(Path(args.store))
    await run.phase("image-pull (the image, the chunks the store lacks, the capture's files)",
                    lambda: d.expect("image-pull", "image-pull", image=reference),
                    moved=lambda _: directory_bytes(Path(args.store)) - stored)
    restores = []
    unit = unit_names(args.mode)[1]
    for attempt in range(1, args.restores + 1):
        await d.expect(f"removing {unit}", "workload-remove", name=unit)
        drop_caches()
        restored = await run.phase(
            f"restore {attempt} to the first token, page cache dropped",
            lambda: restore_once(d, reference, layout, unit, capture_id, cluster(args.mode), args.port))
        restored["identical"] = restored["text"] == cold_text
        restored["disk_read"] = run.rows[-1]["disk_read"]
        restores.append(restored)
        if not restored["identical"]:
            raise PhaseFailed(f"restore {attempt}: its completion {restored['text'][:200]!r} is not the cold one "
                              f"{cold_text[:200]!r}")
    await d.expect(f"removing {unit}", "workload-remove", name=unit)
    return restores


def goal_lines(run: Run, restores: list[dict[str, Any]]) -> list[list[str]]:
    """Each restore against the goal: bytes read from the disk / the disk's best read rate + 1.0 s."""
    rate = max(v for k, v in run.rates.items() if k.startswith("disk read"))
    lines = []
    for i, r in enumerate(restores, 1):
        goal = r["disk_read"] / 1e9 / rate + 1.0
        lines.append([f"restore {i}", f"{r['first_token_s']:.2f}", f"{r['disk_read'] / 1e9:.2f}", f"{goal:.2f}",
                      "met" if r["first_token_s"] <= goal else f"missed by {r['first_token_s'] - goal:.2f} s",
                      f"{r['create_start_s']:.2f}", str(r.get("device_staged")),
                      ",".join(map(str, r.get("device_verify") or [])) or "-", str(r["identical"])])
    return lines


def phase_cells(r: dict[str, Any]) -> list[str]:
    moved = r["bytes"]
    return [r["phase"], f"{r['seconds']:.2f}", "-" if moved is None else f"{moved / 1e9:.2f}",
            f"{moved / r['seconds'] / 1e9:.3f}" if moved else "-", f"{r['disk_read'] / 1e9:.2f}",
            f"{r['disk_written'] / 1e9:.2f}"]


def report(run: Run, restores: list[dict[str, Any]], args: argparse.Namespace, result: dict[str, Any] | None = None
           ) -> str:
    """The run's tables (the phases that ran, the rates measured, the restores against the goal) and notes."""
    lines = [f"mode {args.mode}; store {args.store} (disk: {run.disk.stat}); registry storage {args.registry_root} "
             "(tmpfs: the disk cannot hold it beside the store); build context and images on tmpfs"]
    if run.rows:
        lines += ["", table(["phase", "s", "bytes moved GB", "GB/s", "disk read GB", "disk written GB"],
                            [phase_cells(r) for r in run.rows])]
    if run.rates:
        lines += ["", table(["the machine's own rate, same run", "GB/s"],
                            [[k, f"{v:.3f}"] for k, v in run.rates.items()])]
    if restores and run.rates:
        lines += ["", table(["restore", "Docker-to-first-token s", "disk read GB", "goal s (read/best disk rate + 1.0)",
                             "goal", "workload-run s", "device dump staged", "verify", "= cold"],
                            goal_lines(run, restores))]
    lines += second_capture_lines(result or {})
    lines += ["", *run.notes]
    if run.failed:
        lines += ["", f"FAILED: {run.failed}"]
    return "\n".join(lines)


async def build_and_push(d: Driver, run: Run, args: argparse.Namespace, reference: str, n: int,
                         images: Path) -> tuple[str, int, int]:
    """--second-capture: capture `n` built into the node store and pushed: its id, and the bytes the build added to
    the store's directory and the push to the registry's storage."""
    store, registry = Path(args.store), Path(args.registry_root) / "registry"
    before, stored = store_captures(store), directory_bytes(store)
    dockerfile = base64.b64encode(f"FROM {args.capsule}\nCOPY images /images\n".encode()).decode()
    await run.phase(f"capture {n}: image-build (into the node store)", lambda: d.expect(
        "image-build", "image-build", build={"dockerfile": dockerfile, "context": str(args.context), "tag": reference,
                                             "pull": False}), moved=lambda _: images_bytes(images)["images_bytes"])
    new = store_captures(store) - before
    if len(new) != 1:
        raise PhaseFailed(f"phase 'image-build' of capture {n} left {len(new)} new captures in the store, not 1")
    added_store, pushed = directory_bytes(store) - stored, directory_bytes(registry) if registry.exists() else 0
    await run.phase(f"capture {n}: image-push", lambda: d.expect("image-push", "image-push", image=reference),
                    moved=lambda _: directory_bytes(registry) - pushed)
    return new.pop(), added_store, directory_bytes(registry) - pushed


async def capture_again(d: Driver, args: argparse.Namespace, image: str, layout: InterposerLayout,
                        result: dict[str, Any]) -> str:
    """--second-capture: the same model in a new cold server (the first's node hydrator serves it too), captured."""
    serving = unit_names(args.mode)[0]
    result["cold_2"] = await start_cold(d, image, layout, serving, args.port)
    second: dict[str, Any] = result.setdefault("second", {})
    captured = await capture_server(d, args.mode, layout, serving, int(result["cold_2"]["server_pid"]), second)
    await d.expect(f"removing {serving}", "workload-remove", name=serving)
    return captured


async def capture_restored(d: Driver, args: argparse.Namespace, image: str, layout: InterposerLayout,
                           result: dict[str, Any], first: str) -> str:
    """--recapture-restored: the first capture restored (a restore unit, to its first token), then that restored
    server captured again: CRIU gives it the first server's PIDs, addresses, heap and stacks."""
    unit = unit_names(args.mode)[1]
    restored = await restore_once(d, image, layout, unit, first, cluster(args.mode), args.port)
    result["restored"] = {"first_token_s": restored.get("first_token_s"),
                          "identical": restored.get("text") == result["cold"]["text"]}
    print(f"[{args.mode}] the first capture restored: {json.dumps(result['restored'])}", flush=True)
    second: dict[str, Any] = result.setdefault("second", {})
    captured = await capture_server(d, args.mode, layout, unit, int(result["cold"]["server_pid"]), second)
    await d.expect(f"removing {unit}", "workload-remove", name=unit)
    return captured


async def second_capture_path(d: Driver, run: Run, args: argparse.Namespace, address: str, image: str,
                              layout: InterposerLayout, result: dict[str, Any]) -> None:
    """--second-capture: two cold servers of the same model, each captured, built and pushed; the second's new bytes."""
    captures, added = [], []
    first: Fingerprint = ({}, set())
    ids: list[str] = []
    again = (lambda: capture_restored(d, args, image, layout, result, ids[0])) if args.recapture_restored else \
        (lambda: capture_again(d, args, image, layout, result))
    for n, capture in ((1, lambda: serve_and_capture(d, args, args.mode, image, layout, result)), (2, again)):
        what = "the first capture restored to its first token, captured again" if n == 2 and \
            args.recapture_restored else "cold server to the first token, captured by the worker"
        capture_id = await run.phase(f"capture {n}: {what}", capture)
        ids.append(capture_id)
        if n == 2 and args.recapture_restored:  # the restore has read the first's images: the build takes the second's
            shutil.rmtree(layout.images_dir / ids[0])
        images = layout.images_dir / capture_id
        stored, stored_bytes, pushed = await build_and_push(d, run, args, f"{address}/{SECOND_REFERENCE}{n}", n,
                                                            images)
        captures.append(stored)
        added.append({"images": images_bytes(images)["images_bytes"], "node store": stored_bytes,
                      "registry": pushed})
        if n == 1:  # its chunks as 64 MiB from each file's start, for the comparison; then its bytes go (tmpfs)
            first = await anyio.to_thread.run_sync(fingerprint, images, 16)
            if not args.recapture_restored:  # else the restore reads them: they go once it has
                shutil.rmtree(images)
    by_file = await anyio.to_thread.run_sync(share_rows, first, layout.images_dir, Path(args.store),
                                             (captures[0], captures[1]))
    result["second_capture"] = {"captures": captures, "added": added, "by_file": by_file,
                                "regions": region_rows(by_file, layout.images_dir)}


def no_aslr(layout: InterposerLayout) -> str:
    """--aslr-off: an interpreter for the units that turns address-space randomisation off for itself and whatever
    it starts (personality ADDR_NO_RANDOMIZE, inherited through fork and exec), then runs the capsule's own; the
    server is unchanged. It sits in a venv-shaped directory of the run directory whose `lib` is the capsule's venv's,
    so what the layout derives from the interpreter's path (the worker's site-packages) still holds. Its path in
    the units (the run directory's mount)."""
    venv = layout.run_dir / "no-aslr-venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "lib").unlink(missing_ok=True)
    (venv / "lib").symlink_to(Path(layout.python).parent.parent / "lib")  # resolved in the unit
    wrapper = venv / "bin" / "python3"
    wrapper.write_text(f"#!{layout.python} -S\nimport ctypes, os, sys\nlibc = ctypes.CDLL(None)\n"
                       "libc.personality(0x0040000)\n"
                       "if not libc.personality(0xffffffff) & 0x0040000:\n"
                       "    sys.exit('no-aslr: personality(ADDR_NO_RANDOMIZE) did not hold')\n"
                       f"os.execv({layout.python!r}, [{layout.python!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    return f"{RUN}/no-aslr-venv/bin/python3"


def second_capture_lines(result: dict[str, Any]) -> list[str]:
    """The two captures' bytes added to the store and the registry, and the second's by kind of file."""
    second = result.get("second_capture")
    if not second:
        return []
    cells = []
    for n, added in enumerate(second["added"], 1):
        images = added["images"] or 1
        cells.append([f"capture {n}", f"{added['images'] / 1e9:.3f}"] + [
            f"{added[k] / 1e9:.3f} ({100 * added[k] / images:.1f} %)" for k in ("node store", "registry")])
    return ["", table(["bytes added, measured from the storage", "images GB", "node store GB (share of its images)",
                       "registry GB (share of its images)"], cells), "", table(*share_table(second["by_file"])), "",
            table(*worst_table(second["by_file"])), "", table(*region_table(second.get("regions", [])))]


async def run_path(d: Driver, run: Run, args: argparse.Namespace, address: str, result: dict[str, Any]) -> None:
    if not args.second_capture:
        await run.phase("the machine's rates", lambda: anyio.to_thread.run_sync(measure_rates, run, args, address))
    await run.phase("capsule builds", lambda: build_capsules(d, args.build))
    image = str((await inspect_capsule(d, args.capsule))["id"])
    layout = serve_layout(Path(args.work) / args.mode, Path(args.model), args.mode,
                          criu_threads=args.criu_threads)
    layout.images_dir = Path(args.context) / "images"
    shutil.rmtree(layout.images_dir, ignore_errors=True)
    layout.prepare()
    if args.aslr_off:
        layout.python = no_aslr(layout)
    if args.second_capture:
        await second_capture_path(d, run, args, address, image, layout, result)
        return
    capture_id = await run.phase("cold server to the first token, captured by the worker",
                                 lambda: serve_and_capture(d, args, args.mode, image, layout, result))
    run.notes.append(f"cold Docker-to-first-token {result['cold']['first_token_s']:.2f} s: "
                     f"{result['cold']['text'][:100]!r}")
    reference = f"{address}/{REFERENCE}"
    await build_push_remove(d, run, args, reference, layout.images_dir / capture_id)
    restore_layout = StoreLayout(**{f.name: getattr(layout, f.name) for f in fields(layout)})
    result["restores"] = await pull_and_restore(d, run, args, reference, restore_layout, capture_id,
                                                result["cold"]["text"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("--state-dir", "--capsule", "--model", "--work", "--out", "--context", "--store", "--registry-root"):
        parser.add_argument(name, required=True)
    parser.add_argument("--build", action="append", default=[], metavar="CONTEXT=TAG")
    parser.add_argument("--mode", default=STAGED, choices=MODES)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--port", type=int, default=18471)
    parser.add_argument("--rate-mib", type=int, default=4096, help="the disk-rate probe's size")
    parser.add_argument("--link-mib", type=int, default=2048, help="the registry-link probe's size (on tmpfs)")
    parser.add_argument("--criu-threads", type=int, default=0)
    parser.add_argument("--second-capture", action="store_true",
                        help="two captures of the same model built and pushed: what the second adds")
    parser.add_argument("--recapture-restored", action="store_true",
                        help="--second-capture of the first capture restored, not of a second cold server")
    parser.add_argument("--aslr-off", action="store_true",
                        help="the units' processes without address-space randomisation (personality)")
    return parser


async def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.recapture_restored and not args.second_capture:
        parser.error("--recapture-restored goes with --second-capture")
    if args.aslr_off and not args.second_capture:
        parser.error("--aslr-off goes with --second-capture (the restore worker's paths come from the interpreter's)")
    Path(args.registry_root).mkdir(parents=True, exist_ok=True)
    registry, address = start_registry(Path(args.registry_root))
    d = Driver(Path(args.state_dir))
    await d.open()
    run = Run(Disk(Path(args.store).parent))
    result: dict[str, Any] = {"mode": args.mode, "restores": []}
    try:
        await run_path(d, run, args, address, result)
    except Exception as exc:  # a phase's failure names it; anything else (the capsule missing) says what it was
        run.failed = run.failed or f"before any phase: {type(exc).__name__}: {exc}"
        print(f"FAILED: {run.failed}", flush=True)
    finally:
        await remove_units(d, args.mode, result)
        for reference in (REFERENCE, f"{SECOND_REFERENCE}1", f"{SECOND_REFERENCE}2"):
            await d.runtime("image-remove", image=f"{address}/{reference}")
        registry.kill()
        registry.wait()
    text = report(run, result["restores"], args, result)
    print(text, flush=True)
    Path(args.out, "store.json").write_text(json.dumps({"rows": run.rows, "rates_gbps": run.rates, "notes": run.notes,
                                                        "failed": run.failed, "result": result}, indent=1,
                                                       default=str))
    Path(args.out, "store-table.md").write_text(text + "\n")
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))

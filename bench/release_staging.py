"""The interposer's release by copy setting, side by side on a GPU (issue 35 item 3): an unchanged torch process
holding `--gib` GiB (1 GiB tensors of seeded random floats and 512 MiB of zeros) under the preload is released into
tmpfs and hydrated back, once per setting and images mount, in one run:

    python bench/release_staging.py [--gib 16] [--settings staged,staged-512k,staged-256k,staged-256k-24t]
                                    [--repeats 2] [--mounts huge,shm] [--register-gib 2] [--out DIR]

- settings (the target's environment, one process each): `staged` (the defaults: 4 MiB staging buffers, a copy
  thread per CPU up to 16), `staged-<N>m` (COLDSNAP_CUDA_INTERPOSER_STAGING_MIB=N), `staged-<N>k` (a release's
  buffers alone, _DUMP_STAGING_KIB=N: small enough, what the device writes may still be in the cache when the
  digest reads it), `-<N>t` (_THREADS=N);
- mounts: `huge` (a tmpfs mounted here with huge=always) and `shm` (/dev/shm as the host has it);
- first, with no target, what registering a file's pages costs (cuMemHostRegister per window size, on each mount
  and on anonymous memory) and the device's copy rate into them (`register` table): why the release does not copy
  straight into the dump files' pages (docs/interposer.md, "Capture in <= 1 s").

Each release prints its wall seconds (the request to the manifest, as the capture worker waits for it), GB/s and
its copy threads' thread-seconds (device wait, digest, zero check, write, set-up); every release's segment digests
must be the same (the data is seeded: the same bytes, the same dump, whatever the setting), which the run checks
and says. Tables on stdout, JSON in --out (default bench/results). Needs root (the mount), torch and a GPU; about
120 s at 16 GiB.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import table, wait_file
from coldsnap_probe.hydration import DeviceDump, interposer_request, library_path

GIB = 1 << 30
MIB = 1 << 20
HUGE_MOUNT = Path("/tmp/cs-release-huge")

# The unchanged engine: seeded tensors (the same bytes in every process), then idle until killed.
TARGET = r"""
import os, sys, time
import torch
gib = int(sys.argv[2])
torch.manual_seed(35)
held = [torch.randn(1 << 28, device="cuda") for _ in range(gib)]
held.append(torch.zeros(1 << 27, device="cuda"))
torch.cuda.synchronize()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(60)
"""


def setting_env(name: str) -> dict[str, str]:
    """`staged[-<N>m|-<N>k][-<N>t]` as the target's environment (staging MiB, a release's staging KiB, threads)."""
    parts = name.split("-")
    env, knobs = {}, {"m": "COLDSNAP_CUDA_INTERPOSER_STAGING_MIB", "k": "COLDSNAP_CUDA_INTERPOSER_DUMP_STAGING_KIB",
                      "t": "COLDSNAP_CUDA_INTERPOSER_THREADS"}
    for part in parts[1:]:
        if not part[:-1].isdigit() or part[-1] not in knobs or knobs[part[-1]] in env:
            break
        env[knobs[part[-1]]] = part[:-1]
    else:
        if parts[0] == "staged":
            return env
    raise SystemExit(f"--settings: {name} is not staged[-<N>m|-<N>k][-<N>t] (staging MiB or KiB, copy threads)")


def mount_dirs(names: list[str]) -> dict[str, Path]:
    """Each images mount by name, made ready (huge: a tmpfs with huge=always mounted here)."""
    dirs = {}
    for name in names:
        if name == "huge":
            HUGE_MOUNT.mkdir(parents=True, exist_ok=True)
            if subprocess.run(["mountpoint", "-q", str(HUGE_MOUNT)], check=False).returncode != 0:
                subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=80%,mode=0700", "tmpfs",
                                str(HUGE_MOUNT)], check=True)
            dirs[name] = HUGE_MOUNT
        elif name == "shm":
            dirs[name] = Path("/dev/shm/cs-release")
            dirs[name].mkdir(mode=0o700, exist_ok=True)
        else:
            raise SystemExit(f"--mounts: {name} is neither huge nor shm")
    return dirs


# -- registration alone (no interposer): what a window costs -----------------------------------------------------
class Driver:
    """The few driver calls the registration bench makes, through ctypes on libcuda.so.1."""

    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.call("cuInit", 0)
        device, context = ctypes.c_int(), ctypes.c_void_p()
        self.call("cuDeviceGet", ctypes.byref(device), 0)
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        self.call("cuCtxSetCurrent", context)
        self.source = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(self.source), ctypes.c_size_t(GIB))

    def call(self, name: str, *args: Any) -> None:
        rc = getattr(self.cuda, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name}: CUDA error {rc}")

    def window(self, address: int, size: int) -> tuple[float, float, float]:
        """Seconds to register `size` bytes at `address`, copy the device into them, unregister them."""
        t0 = time.perf_counter()
        self.call("cuMemHostRegister_v2", ctypes.c_void_p(address), ctypes.c_size_t(size), 1)
        t1 = time.perf_counter()
        for at in range(0, size, GIB):
            self.call("cuMemcpyDtoH_v2", ctypes.c_void_p(address + at), self.source,
                      ctypes.c_size_t(min(GIB, size - at)))
        t2 = time.perf_counter()
        self.call("cuMemHostUnregister", ctypes.c_void_p(address))
        return t1 - t0, t2 - t1, time.perf_counter() - t2


def register_rows(dirs: dict[str, Path], windows: list[int], total: int) -> list[dict[str, Any]]:
    """`total` bytes of a file on each mount (and anonymous memory) registered, copied into and unregistered one
    window at a time, per window size; the file made anew for each (its pages cleared as in a release)."""
    driver, rows = Driver(), []
    for where in [*dirs, "anonymous"]:
        for window in windows:
            path = dirs[where] / "register.bin" if where in dirs else None
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) if path else -1
            if fd >= 0:
                os.posix_fallocate(fd, 0, total)
            area = mmap.mmap(fd, total, mmap.MAP_SHARED if fd >= 0 else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            anchor = ctypes.c_char.from_buffer(area)  # the mapping's address (released before it is closed)
            spent = [0.0, 0.0, 0.0]
            for at in range(0, total, window):
                for i, s in enumerate(driver.window(ctypes.addressof(anchor) + at, min(window, total - at))):
                    spent[i] += s
            del anchor
            area.close()
            if fd >= 0:
                os.close(fd)
                os.unlink(path)  # type: ignore[arg-type]
            rows.append({"memory": where, "window_mib": window // MIB, "register_gbps": total / spent[0] / 1e9,
                         "copy_gbps": total / spent[1] / 1e9, "unregister_gbps": total / spent[2] / 1e9})
    return rows


# -- releases of a torch process ----------------------------------------------------------------------------------
class Target:
    """The torch process under the preload, with `setting`'s environment."""

    def __init__(self, work: Path, library: Path, gib: int, setting: str) -> None:
        self.socket = str(work / f"{setting}.sock")
        ready = work / f"{setting}.ready"
        env = {**os.environ, "LD_PRELOAD": str(library), "COLDSNAP_CUDA_INTERPOSER_SOCKET": self.socket,
               **setting_env(setting)}
        self.log = work / f"{setting}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", TARGET, str(ready), str(gib)], env=env,
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_file(ready, timeout=90.0)

    def ask(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        return interposer_request(self.socket, message, what, timeout=60.0)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def one_release(target: Target, images: Path, setting: str, mount: str) -> dict[str, Any]:
    """One release into `images` (timed as the worker waits for it), the hydration back, the dump removed."""
    dump_dir = images / f"dump-{setting}"
    shutil.rmtree(dump_dir, ignore_errors=True)
    dump_dir.mkdir(mode=0o700)
    started = time.perf_counter()
    answer = target.ask({"op": "release", "dir": str(dump_dir)}, f"release ({setting}, {mount})")
    wall = time.perf_counter() - started
    dump = DeviceDump.from_json(answer["manifest"], answered=True)
    held = sum((dump_dir / s.file).stat().st_blocks * 512 for s in dump.segments)
    started = time.perf_counter()
    report = target.ask({"op": "hydrate"}, f"hydrate ({setting}, {mount})")["report"]
    hydrate = time.perf_counter() - started
    shutil.rmtree(dump_dir)
    return {"setting": setting, "mount": mount, "release_s": wall, "bytes": dump.bytes, "gbps": dump.gbps,
            "timings_s": dump.timings_s, "held_bytes": held,
            "digests": [s.digest for s in dump.segments], "hydrate_s": hydrate, "hydrate_gbps": report.get("gbps")}


def release_rows(args: argparse.Namespace, dirs: dict[str, Path], work: Path) -> list[dict[str, Any]]:
    library = library_path(work / "lib")
    rows = []
    for setting in args.settings.split(","):
        target = Target(work, library, args.gib, setting)
        try:
            status = target.ask({"op": "status"}, "status")
            print(f"== {setting}: {status.get('staging_bytes')}-byte staging buffers, {status.get('threads')} threads",
                  flush=True)
            for _ in range(args.repeats):
                for mount, images in dirs.items():
                    row = one_release(target, images, setting, mount)
                    print(f"   {mount}: release {row['release_s']:.3f} s ({row['gbps']:.1f} GB/s)", flush=True)
                    rows.append(row)
        finally:
            target.stop()
    return rows


def release_table(rows: list[dict[str, Any]]) -> str:
    def t(row: dict[str, Any], key: str, digits: int = 2) -> str:
        return f"{row['timings_s'].get(key, 0.0):.{digits}f}"

    return table(["setting", "images", "release s", "sync / dump / unmap s", "dump GB/s",
                  "thread-s device / digest / zero / write / set-up", "GB held", "hydrate s"],
                 [[r["setting"], r["mount"], f"{r['release_s']:.3f}",
                   " / ".join(t(r, k, 3) for k in ("synchronize", "dump", "unmap")), f"{r['gbps']:.1f}",
                   " / ".join(t(r, k) for k in ("dump_device_thread_s", "dump_digest_thread_s", "dump_zero_thread_s",
                                                "dump_write_thread_s", "dump_setup_thread_s")),
                   f"{r['held_bytes'] / 1e9:.2f}", f"{r['hydrate_s']:.3f}"] for r in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=int, default=16)
    parser.add_argument("--settings", default="staged,staged-1024k,staged-512k,staged-256k,staged-128k,staged-256k-24t")
    parser.add_argument("--mounts", default="huge,shm")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--register-gib", type=int, default=2, help="bytes registered per mount and window (0: skip)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    for name in args.settings.split(","):
        setting_env(name)  # a typo refused before anything runs
    dirs = mount_dirs(args.mounts.split(","))
    work = Path("/tmp/cs-release-work")
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"gib": args.gib, "mounts": {k: str(v) for k, v in dirs.items()}}
    if args.register_gib:
        result["register"] = register_rows(dirs, [64 * MIB, 256 * MIB, GIB], args.register_gib * GIB)
        print(table(["memory", "window MiB", "register GB/s", "device copy GB/s", "unregister GB/s"],
                    [[r["memory"], r["window_mib"], f"{r['register_gbps']:.1f}", f"{r['copy_gbps']:.1f}",
                      f"{r['unregister_gbps']:.1f}"] for r in result["register"]]), flush=True)
    try:
        result["releases"] = rows = release_rows(args, dirs, work)
    finally:
        if "huge" in dirs:
            subprocess.run(["umount", str(HUGE_MOUNT)], check=False)
    print(release_table(rows))
    same = len({tuple(r["digests"]) for r in rows}) == 1
    print(f"segment digests: {'the same in every release' if same else 'DIFFER between releases'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "release-staging.json").write_text(json.dumps(result | {"same_digests": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

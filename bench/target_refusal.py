"""A restore onto a host that cannot restore the capture is refused before any work (issue 36 item 4).

    python bench/target_refusal.py --criu PATH [--cuda] [--repeat 10] [--out FILE.json]

Captures one target with the worker (a CPU process, n580; with `--cuda` a process holding 256 MiB of device memory
through PyTorch, n610), then restores it `--repeat` times per row, the rows taking turns. Each row is one fact the
target lacks (the capsule image's layers, told in the environment as the provider tells them; the kernel, rewritten in
`capture.json` as another node would have recorded it; with `--cuda` also the GPU model and the device count).
Columns: the worker's `checked_seconds` (from the restore's start to the refusal), the worker process's wall time
(its interpreter start included), and whether anything ran (CRIU's restore log). The last row is the same images
restored for real on this host, its `validated` mark beside the refusals.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import table

IMAGE, OTHER_IMAGE = "sha256:" + "c" * 64, "sha256:" + "d" * 64  # one-layer images' layers
CPU_TARGET = "import sys, time; b = bytearray(64 << 20); open(sys.argv[1], 'w').write('ready'); time.sleep(600)"
CUDA_TARGET = ("import sys, time, torch; x = torch.ones(64 << 20, device='cuda'); torch.cuda.synchronize(); "
               "open(sys.argv[1], 'w').write('ready'); time.sleep(600)")


def worker(*args: str, image: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=300, env={**os.environ, "COLDSNAP_CAPSULE_LAYERS": image})
    return done, time.perf_counter() - started


def capture(work: Path, criu: str, cuda: bool) -> Path:
    ready, images = work / "ready", work / "images"
    target = subprocess.Popen([sys.executable, "-c", CUDA_TARGET if cuda else CPU_TARGET, str(ready)],
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if target.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the target did not start (exit {target.poll()})")
        time.sleep(0.05)
    done, _ = worker("capture", "--pid", str(target.pid), "--images", str(images), "--criu", criu,
                     "--boundary", "n610" if cuda else "n580", image=IMAGE)
    target.wait()
    if done.returncode != 0:
        raise SystemExit(f"capture failed: {done.stderr}")
    return images


def edited(images: Path, facts: dict[str, Any]) -> None:
    record = json.loads((images / "capture.json").read_text())
    record["identity"].update(facts)
    (images / "capture.json").write_text(json.dumps(record))


def rows(cuda: bool) -> dict[str, tuple[dict[str, Any], str]]:
    """label -> (facts rewritten in the record, the capsule image the restore is told)."""
    found = {"capsule image": ({}, OTHER_IMAGE), "kernel": ({"kernel": "2.6.32-754.el6.x86_64"}, IMAGE)}
    if cuda:
        found |= {"GPU model": ({"gpu_name": "NVIDIA GB10"}, IMAGE), "device count": ({"gpu_devices": 8}, IMAGE)}
    return found


def measure(images: Path, work: Path, criu: str, cuda: bool, repeat: int) -> dict[str, list[dict[str, Any]]]:
    original = json.loads((images / "capture.json").read_text())["identity"]
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label in rows(cuda)}
    for attempt in range(repeat):
        for label, (facts, image) in rows(cuda).items():
            edited(images, facts)
            run = work / f"run-{attempt}-{len(samples[label])}-{label.replace(' ', '-')}"
            done, wall = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(run), image=image)
            edited(images, {key: original.get(key) for key in facts})
            answer = json.loads(done.stdout) if done.returncode == 3 else {}
            samples[label].append({"exit": done.returncode, "codes": [m["code"] for m in answer.get("refused", [])],
                                   "checked_s": answer.get("checked_seconds"), "wall_s": wall,
                                   "criu_ran": (run / "restore.log").exists()})
    done, wall = worker("restore", "--images", str(images), "--criu", criu, "--work-dir", str(work / "accepted"),
                        image=IMAGE)
    report = json.loads(done.stdout) if done.returncode == 0 else {}
    marks = {m["name"]: m["since_restore_begin_s"] for m in report.get("timeline", [])}
    if report.get("restored_pid"):
        os.killpg(report["restored_pid"], 9)
    samples["(restored: validated mark)"] = [{"exit": done.returncode, "codes": [], "checked_s": marks.get("validated"),
                                              "wall_s": wall, "criu_ran": True}]
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--criu", default=shutil.which("criu") or "criu")
    parser.add_argument("--cuda", action="store_true", help="an n610 capture of a PyTorch process (GPU host)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="coldsnap-refusal-") as tmp:
        work = Path(tmp)
        samples = measure(capture(work, args.criu, args.cuda), work, args.criu, args.cuda, args.repeat)
    lines = []
    for label, runs in samples.items():
        checked = [r["checked_s"] * 1e3 for r in runs if r["checked_s"] is not None]
        lines.append([label, str(len(runs)), ",".join(sorted({c for r in runs for c in r["codes"]})) or "-",
                      f"{statistics.median(checked):.1f}" if checked else "-",
                      f"{max(checked):.1f}" if checked else "-",
                      f"{statistics.median(r['wall_s'] for r in runs) * 1e3:.0f}",
                      str(sum(r["criu_ran"] for r in runs)), ",".join(sorted({str(r["exit"]) for r in runs}))])
    print(table(["row", "n", "codes", "checked p50 ms", "checked max ms", "worker wall p50 ms", "CRIU ran", "exit"],
                lines))
    if args.out:
        args.out.write_text(json.dumps({"cuda": args.cuda, "samples": samples}, indent=2) + "\n")


if __name__ == "__main__":
    main()

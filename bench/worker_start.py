"""What a restore worker pays before its first checks are done (issue 22): its imports and the host's GPU facts.

    python bench/worker_start.py [--repeat 15] [--out FILE.json] [--before REF --criu PATH]

Each row is timed inside a fresh interpreter (the worker is one: `python -m coldsnap_probe restore`), from just
before the statement to just after it, so the interpreter's own start is not in it; the rows take turns, `--repeat`
rounds, median and minimum in milliseconds. Two columns, each on its own copy of the package: with its bytecode
compiled, and from source (no `__pycache__`, none written: what a read-only copy without bytecode costs each time).

* GPU facts through NVML: `gpu_identity(nvml=True)` (pynvml's import, nvmlInit, the queries, nvmlShutdown).
* GPU facts the restore reads: `gpu_identity()`: the kernel module's procfs where it answers for the selected
  device, else NVML (the `source` column says which answered).
* Imports of the restore subcommand, of the capture subcommand, and of the former eager package (every public
  name of the package and of `hydration`, and `_worker`: what `import coldsnap_probe` loaded before issue 22).

With `--before REF` (and `--criu`, the CRIU the worker asks for its version), a second table, side by side in one
run: the whole `python -S -m coldsnap_probe restore` of images whose capture names another architecture, from
the command to its exit (3, refused by the target check): the interpreter, the imports, the guard, this host's
identity and the checks, everything a restore does before CRIU but CRIU (issue 35 item 2), that ref's worker and
this checkout's taking turns, both compiled; and the imports alone on that path to CRIU (`PATH_TO_CRIU`).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import table

EAGER = ("import coldsnap_probe.__main__, coldsnap_probe._worker, coldsnap_probe._canaries, "
         "coldsnap_probe.hydration as h, coldsnap_probe as p\n"
         "[getattr(m, n) for m in (p, h) for n in m.__all__]")
# What the restore command imports from its start to CRIU's (`__main__._restore`, `_worker`): the imports row of
# `--before`'s table, side by side (issue 35 item 2).
PATH_TO_CRIU = ("import coldsnap_probe._coordinator, coldsnap_probe._phase, coldsnap_probe._report_dir, "
                "coldsnap_probe.errors, coldsnap_probe._worker_guard, coldsnap_probe._criu_kdat, coldsnap_probe._host, "
                "coldsnap_probe._restore, coldsnap_probe.memory")
ROWS = {  # label -> (setup, timed statement, what the row prints as its source)
    "GPU facts through NVML": ("from coldsnap_probe._host import gpu_identity",
                               "found = gpu_identity(nvml=True)", "found['gpu_identity_source']"),
    "GPU facts the restore reads": ("from coldsnap_probe._host import gpu_identity",
                                    "found = gpu_identity()", "found['gpu_identity_source']"),
    "imports: restore subcommand": ("", "import coldsnap_probe.__main__, coldsnap_probe._restore", "'-'"),
    "imports: capture subcommand": ("", "import coldsnap_probe.__main__, coldsnap_probe._capture", "'-'"),
    "imports: the former eager package": ("", EAGER, "'-'"),
}


def once(setup: str, statement: str, source: str, package: Path) -> tuple[float, str]:
    """Milliseconds `statement` took in a fresh interpreter importing the package copy under `package`, and what
    `source` evaluated to there."""
    code = (f"{setup}\nimport json, time\nstarted = time.perf_counter()\n{statement}\n"
            f"print(json.dumps([(time.perf_counter() - started) * 1e3, str({source})]))")
    env = {**os.environ, "PYTHONPATH": str(package), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=package, env=env, capture_output=True, text=True,
                          check=True, timeout=120)
    milliseconds, answered = json.loads(done.stdout.splitlines()[-1])
    return float(milliseconds), answered


def package_copy(parent: Path, bytecode: bool) -> Path:
    """This checkout's coldsnap_probe under `parent`, compiled or not."""
    shutil.copytree(ROOT / "coldsnap_probe", parent / "coldsnap_probe", ignore=shutil.ignore_patterns("__pycache__"))
    if bytecode:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(parent / "coldsnap_probe")], check=True,
                       stdout=subprocess.DEVNULL)
    return parent


def refused(package: Path, images: Path, criu: str) -> float:
    """Milliseconds a restore worker from `package` took to refuse `images` (exit 3), command to exit."""
    env = {**os.environ, "PYTHONPATH": str(package), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-S", "-m", "coldsnap_probe", "restore", "--images", str(images),
                           "--criu", criu], env=env, capture_output=True, text=True, timeout=120)
    elapsed = (time.perf_counter() - started) * 1e3
    if done.returncode != 3:
        raise SystemExit(f"the worker of {package} did not refuse (exit {done.returncode}): {done.stderr[-2000:]}")
    return elapsed


def refusal_table(before: str, criu: str, repeat: int, scratch: Path) -> str:
    """`--before`'s table: that ref's worker and this checkout's, each refusing the same images, taking turns."""
    images = scratch / "images"
    images.mkdir()
    (images / "capture.json").write_text(json.dumps({"format": 1, "boundary": "n580", "root_pid": 300,
                                                     "identity": {"architecture": "not-this-one"}}))
    ref = scratch / "before"
    ref.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", before, "coldsnap_probe"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(ref)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ref)], check=True, stdout=subprocess.DEVNULL)
    sides = {f"before ({before})": ref, "this checkout": package_copy(scratch / "after", True)}
    samples: dict[str, list[float]] = {f"{what}: {label}": [] for what in ("refused", "imports") for label in sides}
    for _ in range(repeat):
        for label, package in sides.items():
            samples[f"refused: {label}"].append(refused(package, images, criu))
            samples[f"imports: {label}"].append(once("import coldsnap_probe.__main__", PATH_TO_CRIU, "'-'", package)[0])
    return table(["a restore refused by the target check, command to exit / the imports on its path to CRIU",
                  "median ms", "p10 ms", "min ms"],
                 [[label, f"{statistics.median(v):.1f}", f"{sorted(v)[len(v) // 10]:.1f}", f"{min(v):.1f}"]
                  for label, v in samples.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--out", type=Path, help="also write the samples here (JSON)")
    parser.add_argument("--before", help="a git ref whose worker refuses the same images, side by side (--criu)")
    parser.add_argument("--criu", default="criu", help="the CRIU whose version the refused workers read")
    args = parser.parse_args()
    if args.before:
        with tempfile.TemporaryDirectory(prefix="worker-refusal-") as scratch:
            print(refusal_table(args.before, args.criu, args.repeat, Path(scratch)))
    samples: dict[tuple[str, bool], list[float]] = {(label, b): [] for label in ROWS for b in (True, False)}
    sources: dict[str, set[str]] = {label: set() for label in ROWS}
    with tempfile.TemporaryDirectory(prefix="worker-start-") as scratch:
        copies = {b: package_copy(Path(scratch) / ("compiled" if b else "source"), b) for b in (True, False)}
        for _ in range(args.repeat):
            for label, row in ROWS.items():
                for bytecode, package in copies.items():
                    milliseconds, answered = once(*row, package)
                    samples[label, bytecode].append(milliseconds)
                    sources[label].add(answered)
    rows = [[label, ", ".join(sorted(sources[label])),
             *(f"{statistics.median(samples[label, b]):.1f} (min {min(samples[label, b]):.1f})" for b in (True, False))]
            for label in ROWS]
    print(table(["what", "source", "bytecode: median ms", "from source: median ms"], rows))
    if args.out:
        args.out.write_text(json.dumps({"repeat": args.repeat, "samples": {
            f"{label} ({'bytecode' if b else 'source'})": v for (label, b), v in samples.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()

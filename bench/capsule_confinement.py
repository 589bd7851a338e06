"""The worker's capture and restore of a CUDA process, run inside one capsule container (issue 37 finding 1).

    python3 bench/capsule_confinement.py LABEL MIB RESTORES OUT_JSON

Run by ``scripts/device confine`` in a container of each confinement side by side (the confined capsule of
today, the grant of before): a target holding MIB MiB of device memory (``tests/probe/_gpu_target.py``, run as
a program) is verified, captured by ``python3 -m coldsnap_probe capture`` and restored RESTORES times by
``python3 -m coldsnap_probe restore``, each restore verified on the device and killed again. Writes the
worker's phase timings (or its error) to OUT_JSON and prints one line per step.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def wait_file(path: Path, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)
    answer: dict[str, Any] = json.loads(path.read_text())
    return answer


def verify(control: Path, n: int) -> bool:
    (control / f"verify-{n}").touch()
    return bool(wait_file(control / f"answer-verify-{n}")["matches"])


def worker(*args: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run([sys.executable, "-m", "coldsnap_probe", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    try:
        report: dict[str, Any] = json.loads(done.stdout) if done.returncode == 0 else {}
    except ValueError:
        report = {}
    return done.returncode, report, done.stderr[-4000:]


def reap(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            if os.waitpid(-1, 0)[0] == pid:
                return
        except ChildProcessError:
            return


def main() -> int:
    label, mib, restores, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: restored trees come back to this process
    work = Path(tempfile.mkdtemp(prefix="confine-"))
    control, images = work / "control", work / "images"
    control.mkdir()
    status = Path("/proc/self/status").read_text()
    result: dict[str, Any] = {"label": label, "mib": mib, "cap_eff": status.split("CapEff:")[1].split()[0],
                              "restores": []}
    started = time.perf_counter()
    target = subprocess.Popen([sys.executable, "-m", "tests.probe._gpu_target", "n610", str(control), str(mib)],
                              cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    wait_file(control / "ready")
    result["target_ready_s"] = time.perf_counter() - started
    result["verified_before"] = verify(control, 0)
    code, report, error = worker("capture", "--pid", str(target.pid), "--images", str(images),
                                 "--criu", shutil.which("criu") or "criu")
    result["capture"] = {"exit": code, "timings_s": report.get("timings_s", {}), "error": error if code else ""}
    print(f"[{label}] capture exit {code} {report.get('timings_s', {})}", flush=True)
    target.wait()
    for attempt in range(1, restores + 1 if code == 0 else 1):
        t0 = time.perf_counter()
        code, report, error = worker("restore", "--images", str(images), "--work-dir", str(work / f"w{attempt}"))
        wall = time.perf_counter() - t0
        same = code == 0 and verify(control, attempt)
        result["restores"].append({"exit": code, "wall_s": wall, "verified": same,
                                   "timeline": report.get("timeline", []), "error": error if code else ""})
        print(f"[{label}] restore {attempt} exit {code} {wall:.2f} s verified {same}", flush=True)
        if code == 0:
            status = Path(f"/proc/{report['restored_pid']}/status").read_text().splitlines()
            result["restores"][-1]["status"] = [line for line in status if line.startswith(("Seccomp", "Speculation"))]
            reap(report["restored_pid"])
        else:
            print(error, flush=True)
    out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    ok = result["capture"]["exit"] == 0 and all(r["verified"] for r in result["restores"])
    return 0 if ok and result["restores"] else 1


if __name__ == "__main__":
    sys.exit(main())

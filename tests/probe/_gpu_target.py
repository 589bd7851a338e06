"""A worker-test target: `n610` holds device memory; `n580` waits, CUDA-free, for a release file.

    python -m tests.probe._gpu_target n610 DIR MIB     python -m tests.probe._gpu_target n580 DIR

It polls DIR for `verify-<n>` requests (n610) or `release` (n580) and answers in files, so it
keeps no descriptor open that CRIU would have to carry.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path


def answer(directory: Path, name: str, value: dict[str, object]) -> None:
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps({**value, "pid": os.getpid()}))
    tmp.rename(directory / name)


def main() -> None:
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "n580":
        answer(directory, "ready", {"cuda": False})
        while not (directory / "release").exists():
            time.sleep(0.05)
    from coldsnap_probe._cuda import Driver, pattern

    size = (int(sys.argv[3]) if mode == "n610" else 8) << 20
    driver = Driver()
    driver.context()
    data = pattern(size)
    dptr = driver.call("cuMemAlloc_v2", size)
    driver.copy_to_device(dptr, data)
    expected = hashlib.sha256(data).hexdigest()
    answer(directory, "ready" if mode == "n610" else "initialized", {"cuda": True, "sha256": expected})
    served: set[str] = set()
    while True:
        for request in directory.glob("verify-*"):
            if request.name not in served:
                served.add(request.name)
                actual = hashlib.sha256(driver.copy_from_device(dptr, size)).hexdigest()
                answer(directory, "answer-" + request.name, {"matches": actual == expected})
        time.sleep(0.05)


if __name__ == "__main__":
    main()

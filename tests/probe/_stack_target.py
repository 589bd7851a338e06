"""A CuPy process, unchanged, for the interposer's stack-limit GPU test (run it under LD_PRELOAD=libcoldsnap_cuda.so).

    python -m tests.probe._stack_target DIR STACK_BYTES DEPTH

It sets its own CUDA stack limit (`cudaDeviceSetLimit(cudaLimitStackSize, STACK_BYTES)`; 0 leaves the driver's),
holds 64 MiB of device memory (a region of the interposer's), compiles with NVRTC a recursive kernel whose stack
the compiler cannot size (so it runs on the limit, not on what the driver grows at launch), runs it DEPTH deep and
writes `ready`: the limit it reads back (`cudaDeviceGetLimit`), the kernel's checksum, the data's sum and the GPU's
resident threads (what the driver reserves the stack for). Then it answers requests left as files in DIR (it keeps
no descriptor CRIU would carry): `check-<n>` -> `answer-check-<n>` (the same read again: after a restore, the limit
the engine sees and whether the deep kernel still runs; a failure is answered as `error`) and `limit-<n>` ->
`answer-limit-<n>` (the limit alone and when the call returned, `returned_unix`: it waits at the interposer's gate
while the device memory is released).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

STACK_LIMIT = 0  # cudaLimitStackSize
KERNEL = r"""
extern "C" __device__ unsigned long long deep(int n, unsigned long long seed)
{
    volatile unsigned long long local[32];  /* a frame of 256 bytes and more, in local memory (the stack) */
    for (int i = 0; i < 32; i++)
        local[i] = seed * 6364136223846793005ULL + (unsigned long long)i;
    if (n == 0)
        return local[seed & 31];
    return deep(n - 1, local[n & 31]) ^ local[(n + 7) & 31];  /* recursion: no size the compiler can know */
}

extern "C" __global__ void run(unsigned long long *out, int depth)
{
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    out[t] = deep(depth, (unsigned long long)t + 1);
}
"""


def answer(directory: Path, name: str, value: dict[str, Any]) -> None:
    tmp = directory / f".{name}.tmp"
    tmp.write_text(json.dumps({**value, "pid": os.getpid()}))
    tmp.rename(directory / name)


def main() -> None:
    import cupy

    directory, stack_bytes, depth = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    runtime = cupy.cuda.runtime
    if stack_bytes:
        runtime.deviceSetLimit(STACK_LIMIT, stack_bytes)
    data = cupy.arange(8 << 20, dtype=cupy.float64)  # 64 MiB: one region
    kernel = cupy.RawKernel(KERNEL, "run")
    out = cupy.zeros(256 * 128, dtype=cupy.uint64)
    properties = runtime.getDeviceProperties(0)

    def read() -> dict[str, Any]:
        try:
            out.fill(0)
            kernel((256,), (128,), (out, cupy.int32(depth)))
            cupy.cuda.Device(0).synchronize()
            return {"limit": runtime.deviceGetLimit(STACK_LIMIT), "kernel": int(out.sum()),
                    "data": float(data.sum())}
        except Exception as exc:  # a stack overflow is a sticky error: say it, the test names it
            return {"error": f"{type(exc).__name__}: {exc}"}

    answer(directory, "ready", {**read(), "resident_threads": properties["multiProcessorCount"]
                                * properties["maxThreadsPerMultiProcessor"]})
    served: set[str] = set()
    while True:
        for request in sorted(directory.glob("*-*")):
            if request.name in served or request.name.startswith(("answer-", ".")):
                continue
            served.add(request.name)
            if request.name.startswith("check-"):
                answer(directory, f"answer-{request.name}", read())
            elif request.name.startswith("limit-"):
                limit = runtime.deviceGetLimit(STACK_LIMIT)
                answer(directory, f"answer-{request.name}", {"limit": limit, "returned_unix": time.time()})
        time.sleep(0.01)


if __name__ == "__main__":
    main()

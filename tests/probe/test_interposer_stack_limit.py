"""The interposer's stack limit (stack_limit.c) without a GPU: the contexts a release finds past its table of 16 are
counted in the release's answer, never left out silently (review 11). A harness built from the interposer's own
sources fills the region table as allocations would and runs the release's lowering with no driver: the answer then
carries the driver's absence as its error, and the contexts it found. tests/probe/test_interposer_gpu_stack.py does
the lowering on the real driver."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from coldsnap_probe._reports import StackLimit
from coldsnap_probe.hydration._interposer import SOURCES
from tests.probe.interposer_harness import UNITY

# Regions in CONTEXTS distinct contexts, each context's regions spread over the table (as allocations on several
# GPUs interleave); each release's answer on a line.
HARNESS = UNITY + r"""
static void no_driver(void) {}

static void lower_in(size_t nr, size_t contexts)
{
    char out[1024];
    regions = calloc(nr, sizeof(*regions));
    for (size_t i = 0; i < nr; i++)
        regions[i] = (struct cscu_region){.address = 0x700000000000ULL + (i << 21), .size = 2 << 20,
                                          .context = (CUcontext)(uintptr_t)(0x1000 + 0x100 * (i % contexts))};
    region_count = region_room = nr;
    cscu_regions_lock();
    cscu_stack_lower(out, sizeof(out));
    cscu_regions_unlock();
    printf("%s\n", out);
    free(regions);
}

int main(void)
{
    pthread_once(&libcuda_once, no_driver);  /* no libcuda.so.1 here, even on a machine that has one */
    lower_in(60, 20);   /* 20 contexts: 16 kept, 4 left */
    lower_in(16, 16);   /* a later release of 16: none left (nothing carried over) */
    lower_in(3, 1);
    return 0;
}
"""


def test_contexts_past_the_table_are_named_in_the_release_answer(tmp_path: Path) -> None:
    (tmp_path / "stack.c").write_text(HARNESS)  # -O0: a count to check, and a second less to build
    built = subprocess.run(["gcc", "-O0", "-std=gnu11", "-Wall", "-Wextra", "-I", str(SOURCES), "-o",
                            str(tmp_path / "stack"), str(tmp_path / "stack.c"), "-ldl", "-lpthread"],
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    done = subprocess.run([str(tmp_path / "stack")], capture_output=True, text=True, timeout=60, check=False,
                          env={k: v for k, v in os.environ.items() if not k.startswith("COLDSNAP_CUDA_INTERPOSER")})
    assert done.returncode == 0, done.stdout + done.stderr
    answers = [StackLimit.from_json(json.loads(line)) for line in done.stdout.splitlines()]
    assert [(a.contexts, a.contexts_left) for a in answers] == [(16, 4), (16, 0), (1, 0)], done.stdout
    assert all(a.error == "the driver has no cuCtxGetLimit/cuCtxSetLimit" and a.set_bytes == 0 for a in answers)
    assert answers[0].to_json()["contexts_left"] == 4

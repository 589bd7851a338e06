"""Regression (issue 22, review): every driver entry point that reads or writes device memory or runs device work
waits at the interposer's readiness gate, whichever ABI version of its name `cuGetProcAddress` hands out.

Without a GPU: a stand-in `libcuda.so.1` (one function per exported name, and a `cuGetProcAddress_v2` that answers
like the driver: the newest ABI a requested version reaches, the per-thread-stream variant under the flag) and a
harness compiled with the interposer's sources: each name must resolve to our wrapper, and a call made while the
gate is closed must reach the driver only once it opens. Where CUDA 13's cuda.h is installed, every wrapper's
prototype is checked against it by the compiler; on a GPU host, every name against the real driver's exports."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from pathlib import Path

import pytest

from coldsnap_probe.hydration._interposer import SOURCES
from tests.probe.interposer_harness import UNITY
from tests.probe.test_interposer import has_driver, library

__all__ = ("library",)  # the module fixture, shared

# (name cuGetProcAddress is asked for, CUDA version its ABI dates from, default-stream export, per-thread export):
# cudaTypedefs.h of CUDA 13.0 (PFN_<name>_v<version>[_ptsz|_ptds]); one name with two ABIs is listed newest first.
GATED = (
    ("cuCtxSynchronize_v2", 13000, "cuCtxSynchronize_v2", None),  # its own name (cuda-python asks for it so)
    ("cuCtxSynchronize", 2000, "cuCtxSynchronize", None),
    ("cuMemcpyAtoA", 3020, "cuMemcpyAtoA_v2", "cuMemcpyAtoA_v2_ptds"),
    ("cuMemcpyAtoD", 3020, "cuMemcpyAtoD_v2", "cuMemcpyAtoD_v2_ptds"),
    ("cuMemcpyAtoH", 3020, "cuMemcpyAtoH_v2", "cuMemcpyAtoH_v2_ptds"),
    ("cuMemcpyDtoA", 3020, "cuMemcpyDtoA_v2", "cuMemcpyDtoA_v2_ptds"),
    ("cuMemcpyHtoA", 3020, "cuMemcpyHtoA_v2", "cuMemcpyHtoA_v2_ptds"),
    ("cuMemcpyAtoHAsync", 3020, "cuMemcpyAtoHAsync_v2", "cuMemcpyAtoHAsync_v2_ptsz"),
    ("cuMemcpyHtoAAsync", 3020, "cuMemcpyHtoAAsync_v2", "cuMemcpyHtoAAsync_v2_ptsz"),
    ("cuMemcpy2DUnaligned", 3020, "cuMemcpy2DUnaligned_v2", "cuMemcpy2DUnaligned_v2_ptds"),
    ("cuMemcpy3DPeer", 4000, "cuMemcpy3DPeer", "cuMemcpy3DPeer_ptds"),
    ("cuMemcpy3DPeerAsync", 4000, "cuMemcpy3DPeerAsync", "cuMemcpy3DPeerAsync_ptsz"),
    ("cuMemcpyBatchAsync", 13000, "cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync_v2_ptsz"),
    ("cuMemcpyBatchAsync", 12080, "cuMemcpyBatchAsync", "cuMemcpyBatchAsync_ptsz"),
    ("cuMemcpy3DBatchAsync", 13000, "cuMemcpy3DBatchAsync_v2", "cuMemcpy3DBatchAsync_v2_ptsz"),
    ("cuMemcpy3DBatchAsync", 12080, "cuMemcpy3DBatchAsync", "cuMemcpy3DBatchAsync_ptsz"),
    ("cuMemsetD2D8", 3020, "cuMemsetD2D8_v2", "cuMemsetD2D8_v2_ptds"),
    ("cuMemsetD2D16", 3020, "cuMemsetD2D16_v2", "cuMemsetD2D16_v2_ptds"),
    ("cuMemsetD2D32", 3020, "cuMemsetD2D32_v2", "cuMemsetD2D32_v2_ptds"),
    ("cuMemsetD2D8Async", 3020, "cuMemsetD2D8Async", "cuMemsetD2D8Async_ptsz"),
    ("cuMemsetD2D16Async", 3020, "cuMemsetD2D16Async", "cuMemsetD2D16Async_ptsz"),
    ("cuMemsetD2D32Async", 3020, "cuMemsetD2D32Async", "cuMemsetD2D32Async_ptsz"),
    ("cuStreamWriteValue32", 11070, "cuStreamWriteValue32_v2", "cuStreamWriteValue32_v2_ptsz"),
    ("cuStreamWriteValue32", 8000, "cuStreamWriteValue32", "cuStreamWriteValue32_ptsz"),
    ("cuStreamWriteValue64", 11070, "cuStreamWriteValue64_v2", "cuStreamWriteValue64_v2_ptsz"),
    ("cuStreamWriteValue64", 9000, "cuStreamWriteValue64", "cuStreamWriteValue64_ptsz"),
    ("cuStreamWaitValue32", 11070, "cuStreamWaitValue32_v2", "cuStreamWaitValue32_v2_ptsz"),
    ("cuStreamWaitValue32", 8000, "cuStreamWaitValue32", "cuStreamWaitValue32_ptsz"),
    ("cuStreamWaitValue64", 11070, "cuStreamWaitValue64_v2", "cuStreamWaitValue64_v2_ptsz"),
    ("cuStreamWaitValue64", 9000, "cuStreamWaitValue64", "cuStreamWaitValue64_ptsz"),
    ("cuStreamBatchMemOp", 11070, "cuStreamBatchMemOp_v2", "cuStreamBatchMemOp_v2_ptsz"),
    ("cuStreamBatchMemOp", 8000, "cuStreamBatchMemOp", "cuStreamBatchMemOp_ptsz"),
    ("cuMemPrefetchAsync", 12020, "cuMemPrefetchAsync_v2", "cuMemPrefetchAsync_v2_ptsz"),
    ("cuMemPrefetchAsync", 8000, "cuMemPrefetchAsync", "cuMemPrefetchAsync_ptsz"),
    ("cuMemPrefetchBatchAsync", 13000, "cuMemPrefetchBatchAsync", "cuMemPrefetchBatchAsync_ptsz"),
    ("cuMemDiscardBatchAsync", 13000, "cuMemDiscardBatchAsync", "cuMemDiscardBatchAsync_ptsz"),
    ("cuMemDiscardAndPrefetchBatchAsync", 13000, "cuMemDiscardAndPrefetchBatchAsync",
     "cuMemDiscardAndPrefetchBatchAsync_ptsz"),
    ("cuMemBatchDecompressAsync", 12060, "cuMemBatchDecompressAsync", "cuMemBatchDecompressAsync_ptsz"),
    ("cuLaunchHostFunc", 10000, "cuLaunchHostFunc", "cuLaunchHostFunc_ptsz"),
    ("cuStreamAddCallback", 5000, "cuStreamAddCallback", "cuStreamAddCallback_ptsz"),
    ("cuGraphUpload", 11010, "cuGraphUpload", "cuGraphUpload_ptsz"),
    ("cuGraphInstantiateWithParams", 12000, "cuGraphInstantiateWithParams", "cuGraphInstantiateWithParams_ptsz"),
    ("cuLaunchCooperativeKernelMultiDevice", 9000, "cuLaunchCooperativeKernelMultiDevice", None),
    ("cuLaunch", 2000, "cuLaunch", None),
    ("cuLaunchGrid", 2000, "cuLaunchGrid", None),
    ("cuLaunchGridAsync", 2000, "cuLaunchGridAsync", None),
    # the engine's own VMM allocations (issue 36): each takes or gives a handle the interposer translates
    ("cuMemMap", 10020, "cuMemMap", None),
    ("cuMemUnmap", 10020, "cuMemUnmap", None),
    ("cuMemSetAccess", 10020, "cuMemSetAccess", None),
    ("cuMemRetainAllocationHandle", 11000, "cuMemRetainAllocationHandle", None),
    ("cuMemGetAllocationPropertiesFromHandle", 10020, "cuMemGetAllocationPropertiesFromHandle", None),
    ("cuMemExportToShareableHandle", 10020, "cuMemExportToShareableHandle", None),
    ("cuMulticastBindMem", 12010, "cuMulticastBindMem", None),
    # gated before this change (kept here so the whole list is pinned)
    ("cuLaunchKernel", 4000, "cuLaunchKernel", "cuLaunchKernel_ptsz"),
    ("cuLaunchKernelEx", 11060, "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"),
    ("cuLaunchCooperativeKernel", 9000, "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz"),
    ("cuGraphLaunch", 10000, "cuGraphLaunch", "cuGraphLaunch_ptsz"),
    ("cuMemcpy", 4000, "cuMemcpy", "cuMemcpy_ptds"),
    ("cuMemcpyAsync", 4000, "cuMemcpyAsync", "cuMemcpyAsync_ptsz"),
    ("cuMemcpyPeer", 4000, "cuMemcpyPeer", "cuMemcpyPeer_ptds"),
    ("cuMemcpyPeerAsync", 4000, "cuMemcpyPeerAsync", "cuMemcpyPeerAsync_ptsz"),
    ("cuMemcpyHtoD", 3020, "cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds"),
    ("cuMemcpyDtoH", 3020, "cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds"),
    ("cuMemcpyDtoD", 3020, "cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds"),
    ("cuMemcpyHtoDAsync", 3020, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz"),
    ("cuMemcpyDtoHAsync", 3020, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz"),
    ("cuMemcpyDtoDAsync", 3020, "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz"),
    ("cuMemcpy2D", 3020, "cuMemcpy2D_v2", "cuMemcpy2D_v2_ptds"),
    ("cuMemcpy2DAsync", 3020, "cuMemcpy2DAsync_v2", "cuMemcpy2DAsync_v2_ptsz"),
    ("cuMemcpy3D", 3020, "cuMemcpy3D_v2", "cuMemcpy3D_v2_ptds"),
    ("cuMemcpy3DAsync", 3020, "cuMemcpy3DAsync_v2", "cuMemcpy3DAsync_v2_ptsz"),
    ("cuMemsetD8", 3020, "cuMemsetD8_v2", "cuMemsetD8_v2_ptds"),
    ("cuMemsetD16", 3020, "cuMemsetD16_v2", "cuMemsetD16_v2_ptds"),
    ("cuMemsetD32", 3020, "cuMemsetD32_v2", "cuMemsetD32_v2_ptds"),
    ("cuMemsetD8Async", 3020, "cuMemsetD8Async", "cuMemsetD8Async_ptsz"),
    ("cuMemsetD16Async", 3020, "cuMemsetD16Async", "cuMemsetD16Async_ptsz"),
    ("cuMemsetD32Async", 3020, "cuMemsetD32Async", "cuMemsetD32Async_ptsz"),
    ("cuStreamSynchronize", 2000, "cuStreamSynchronize", "cuStreamSynchronize_ptsz"),
    ("cuEventSynchronize", 2000, "cuEventSynchronize", None),
    ("cuCtxGetLimit", 3010, "cuCtxGetLimit", None),  # the stack limit a release lowers (stack_limit.c)
    ("cuCtxSetLimit", 3010, "cuCtxSetLimit", None),
)
EXPORTS = tuple(n for _base, _since, *names in GATED for n in names if n)
PER_THREAD = 2  # CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
# The stand-in driver's own version table: GATED, except that its cuMemPrefetchAsync switches to the 5-argument
# ABI at 12.8, not at 12.2 as the interposer's table says (a driver whose table we read wrong, review3).
STANDIN = tuple((base, 12080 if (base, default) == ("cuMemPrefetchAsync", "cuMemPrefetchAsync_v2") else since,
                 default, pt) for base, since, default, pt in GATED)


def standin_driver(folder: Path, table: tuple[tuple[str, int, str, str | None], ...] = GATED) -> Path:
    """A libcuda.so.1 of host code: each exported name records that it ran; cuGetProcAddress_v2 answers as the
    driver does (the first entry of GATED whose version the request reaches, per-thread under the flag)."""
    functions = "".join(f"int {name}(void) {{ __atomic_store_n(&standin_hits, {i + 1}, __ATOMIC_SEQ_CST); "
                        f"return 0; }}\n" for i, name in enumerate(EXPORTS))
    rows = "".join(f'    {{"{base}", {since}, (void *){default}, (void *){per_thread or "0"}}},\n'
                   for base, since, default, per_thread in table)
    source = folder / "standin.c"
    source.write_text(
        "#include <string.h>\nint standin_hits;\n" + functions +
        "static const struct { const char *base; int since; void *fn[2]; } rows[] = {\n" + rows + "};\n"
        "int cuGetProcAddress_v2(const char *s, void **pfn, int version, unsigned long long flags, int *status)\n"
        "{\n    for (unsigned i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)\n"
        "        if (strcmp(rows[i].base, s) == 0 && version >= rows[i].since) {\n"
        f"            *pfn = (flags & {PER_THREAD}) && rows[i].fn[1] ? rows[i].fn[1] : rows[i].fn[0];\n"
        "            if (status) *status = 1;\n            return 0;\n        }\n"
        "    *pfn = 0;\n    return 500;\n}\n")
    target = folder / "libcuda.so.1"
    # -Bsymbolic: its table names its own functions, not the harness's wrappers of the same names (as the driver's)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-Bsymbolic", "-o", str(target), str(source)], check=True,
                   capture_output=True)
    return target


HARNESS = UNITY + r"""

static int *hits;
static void *pending;

static void *call(void *unused)  /* an engine thread: the wrapper, called with no meaningful arguments */
{
    (void)unused;
    ((CUresult (*)(void))pending)();
    return NULL;
}

/* argv: base version per-thread expected-export ... ; prints one line per case: "export wrapped waited ran". */
int main(int argc, char **argv)
{
    void *driver = dlopen("libcuda.so.1", RTLD_NOW);
    hits = driver ? (int *)dlsym(driver, "standin_hits") : NULL;
    if (!hits)
        return 2;
    for (int i = 1; i + 3 < argc; i += 4) {
        void *fn = NULL;
        int status = 0;
        CUresult rc = cuGetProcAddress_v2(argv[i], &fn, atoi(argv[i + 1]), (cuuint64_t)atoi(argv[i + 2]), &status);
        void *ours = dlsym(RTLD_DEFAULT, argv[i + 3]);  /* this executable's own wrapper (-rdynamic) */
        pthread_t thread;
        __atomic_store_n(hits, 0, __ATOMIC_SEQ_CST);
        cscu_gate_close();  /* a release */
        pending = fn;
        pthread_create(&thread, NULL, call, NULL);
        usleep(20000);
        int waited = __atomic_load_n(hits, __ATOMIC_SEQ_CST) == 0;
        cscu_gate_open();  /* the hydration */
        pthread_join(thread, NULL);
        printf("%s %d %d %d\n", argv[i + 3], rc == CUDA_SUCCESS && fn && fn == ours, waited,
               __atomic_load_n(hits, __ATOMIC_SEQ_CST) != 0);
    }
    return 0;
}
"""


def test_every_gated_entry_point_resolves_to_its_wrapper_and_waits_while_released(library: Path,
                                                                                 tmp_path: Path) -> None:
    """Regression (issue 22): cuMemcpyBatchAsync, the stream memory operations, the 2D memsets, the array copies,
    prefetches, host functions and graph uploads ran straight to the driver while the regions were released.
    Regression (review3): CUDA 13.0's cuCtxSynchronize_v2 is a name of its own; taking it for a 13.0 version of
    "cuCtxSynchronize" handed a CUDA 13 caller of the plain name the _v2 wrapper (its slot then held the plain
    function, so a later cuCtxSynchronize_v2(ctx) synchronised the current context instead), and left a lookup of
    "cuCtxSynchronize_v2" itself unwrapped, past the gate. And the wrapper is chosen by the function the driver
    handed out, not by the interposer's reading of the driver's version table: where the two differ (here the
    stand-in's cuMemPrefetchAsync switches ABI at 12.8, ours at 12.2), a 4-argument function got the 5-argument
    wrapper, which read the caller's stream as its 32-bit flags and so handed the driver a truncated stream (an
    ABI bug)."""
    exported = set(subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                                  check=True).stdout.split())
    assert not [n for n in EXPORTS if n not in exported], "gated names the library does not export"
    standin_driver(tmp_path, STANDIN)
    (tmp_path / "gated.c").write_text(HARNESS)
    subprocess.run(["gcc", "-O1", "-std=gnu11", "-rdynamic", "-I", str(SOURCES), "-o", str(tmp_path / "gated"),
                    str(tmp_path / "gated.c"), "-ldl", "-lpthread"], check=True, capture_output=True)
    cases = [(base, since, 0, default) for base, since, default, _pt in STANDIN]
    cases += [(base, since, PER_THREAD, pt) for base, since, _default, pt in STANDIN if pt]
    cases += [("cuCtxSynchronize", 13000, 0, "cuCtxSynchronize")]  # a CUDA 13 caller's version: still argument-less
    # Between the interposer's 12.2 and this driver's 12.8 the driver hands out the 4-argument function: its wrapper
    # is the 4-argument one (chosen by the function, not by the version), not the 5-argument _v2 over it.
    cases += [("cuMemPrefetchAsync", 12050, 0, "cuMemPrefetchAsync"),
              ("cuMemPrefetchAsync", 12050, PER_THREAD, "cuMemPrefetchAsync_ptsz")]
    argv = [str(a) for case in cases for a in case]
    done = subprocess.run([str(tmp_path / "gated"), *argv], capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path),
                                            "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(tmp_path / "unused.sock")})
    assert done.returncode == 0, done.stderr
    results = [(line.split()[0], line.split()[1:]) for line in done.stdout.splitlines()]
    assert [n for n, _ in results] == [c[3] for c in cases]
    assert [n for n, (wrapped, _w, _r) in results if wrapped != "1"] == [], "not resolved to our wrapper"
    assert [n for n, (_wr, waited, _r) in results if waited != "1"] == [], "ran while the gate was closed"
    assert [n for n, (_wr, _w, ran) in results if ran != "1"] == [], "never reached the driver"


CUDA_H = next((p for p in (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include" / "cuda.h",
                           Path("/usr/local/cuda-13.0/include/cuda.h"), Path("/usr/include/cuda.h")) if p.is_file()),
              None)


def wrapper_declarations() -> list[tuple[str, str]]:
    """(exported name, parameter list) of every wrapper interpose.c defines with a macro (GATED, COUNTED, UNTRACKED,
    ROUTED, ORDERED and their one-name forms), read from its macro calls."""
    text = (SOURCES / "interpose.c").read_text()
    found = []
    for match in re.finditer(r"^(?:GATED|COUNTED|UNTRACKED|ROUTED|ORDERED)1?\(", text, re.MULTILINE):
        depth, at, parts, start = 1, match.end(), [], match.end()
        while depth:
            c = text[at]
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            if (c == "," and depth == 1) or depth == 0:
                parts.append(text[start:at].strip())
                start = at + 1
            at += 1
        names, params = (parts[:1], parts[1]) if match.group().endswith("1(") else (parts[:2], parts[2])
        found += [(name, " ".join(params.split())) for name in names]
    return found


MODES = ("", "-DCUDA_API_PER_THREAD_DEFAULT_STREAM", "-D__CUDA_API_VERSION_INTERNAL")  # which names cuda.h declares


def redeclared(folder: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Compile every wrapper's declaration after cuda.h (in `mode`): gcc's result, and the names cuda.h declared
    (-Wredundant-decls names them), so the check cannot pass by declaring nothing."""
    assert CUDA_H is not None
    lines = ["#include <cuda.h>", "typedef unsigned int U;", "typedef size_t Z;",
             "typedef CUmemGenericAllocationHandle H;"]
    lines += [f"#undef {name}\nCUresult {name}{params};" for name, params in wrapper_declarations()]
    (folder / "abi.c").write_text("\n".join(lines) + "\n")
    done = subprocess.run(["gcc", "-c", "-std=gnu11", "-Wredundant-decls", *([mode] if mode else []),
                           "-I", str(CUDA_H.parent), "-o", os.devnull, str(folder / "abi.c")],
                          capture_output=True, text=True, check=False)
    return done, set(re.findall(r"redundant redeclaration of .([A-Za-z0-9_]+).", done.stderr))


@pytest.mark.skipif(CUDA_H is None, reason="no cuda.h (CUDA toolkit) here")
@pytest.mark.parametrize("mode", MODES)
def test_every_gated_wrapper_has_the_prototype_of_cuda_h(tmp_path: Path, mode: str) -> None:
    """Each wrapper redeclared with its own parameter list after cuda.h: gcc refuses a conflicting type (an ABI
    bug such as a 12.8 batch copy called with 13.0's arguments)."""
    assert len(wrapper_declarations()) >= len(EXPORTS)
    done, checked = redeclared(tmp_path, mode)
    assert done.returncode == 0, done.stderr[-4000:]
    assert checked, done.stderr[-2000:]


@pytest.mark.skipif(CUDA_H is None, reason="no cuda.h (CUDA toolkit) here")
def test_cuda_h_declares_every_gated_name_in_one_of_its_modes(tmp_path: Path) -> None:
    checked = set().union(*(redeclared(tmp_path, mode)[1] for mode in MODES))
    assert sorted({name for name, _ in wrapper_declarations()} - checked) == []


@pytest.mark.skipif(not has_driver(), reason="no NVIDIA driver (libcuda.so.1)")
def test_the_real_driver_exports_every_gated_name() -> None:
    driver = ctypes.CDLL("libcuda.so.1")
    assert [n for n in EXPORTS if not hasattr(driver, n)] == []

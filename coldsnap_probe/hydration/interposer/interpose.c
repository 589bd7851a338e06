/* How the engine's driver calls reach us: `dlsym`, `cuGetProcAddress` and the driver's exported names.
 *
 * The CUDA runtime (libcudart, and so torch, cuBLAS, Triton) loads libcuda.so.1 with dlopen and finds
 * cuGetProcAddress with dlsym on that handle, which LD_PRELOAD does not intercept; every other entry point
 * then comes from cuGetProcAddress. So `dlsym` is interposed (a lookup of one of our names on a real handle
 * returns our wrapper; everything else, RTLD_NEXT and RTLD_DEFAULT included, is a tail call to the real one,
 * which therefore sees its caller's return address), and so are cuGetProcAddress (v1 and _v2) and each name
 * below. A name may resolve to two real functions: the legacy default stream one and the per-thread one
 * (`_ptsz`/`_ptds`, chosen by cuGetProcAddress's flags). Each has its own slot and wrapper, picked by the function
 * the driver handed out (the version table below only when that is none of the driver's exports). A slot keeps the
 * first real pointer it saw; a later resolution to a different function (another ABI version) is handed out
 * unwrapped and counted, never mixed up.
 *
 * The wrapped list (keep docs/interposer.md in step):
 *   allocation: cuMemAlloc_v2, cuMemFree_v2, cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemFreeAsync (regions above
 *     the threshold), the engine's VMM (cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap, cuMemSetAccess,
 *     cuMemRetainAllocationHandle, cuMemGetAllocationPropertiesFromHandle, cuMemExportToShareableHandle,
 *     cuMulticastBindMem: its handles translated), and, counted only: cuMemAllocPitch_v2, cuMemAllocManaged, cuMemHostRegister_v2, cuMemHostAlloc,
 *     cuMemAllocHost_v2, cuIpcOpenMemHandle_v2, cuIpcGetMemHandle;
 *   the readiness gate (wait while the regions are released): the allocation calls above, cuLaunchKernel,
 *     cuLaunchKernelEx, cuLaunchCooperativeKernel, cuGraphLaunch, cuMemcpy, cuMemcpyAsync, cuMemcpyPeer,
 *     cuMemcpyPeerAsync, cuMemcpy{HtoD,DtoH,DtoD}{,Async}_v2, cuMemcpy{2D,3D}{,Async}_v2,
 *     cuMemsetD{8,16,32}_v2, cuMemsetD{8,16,32}Async, cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize
 *     (and its CUDA 13 _v2), cuCtx{Get,Set}Limit, the array copies cuMemcpy{AtoA,AtoD,AtoH,DtoA,HtoA}_v2, cuMemcpy{AtoH,HtoA}Async_v2,
 *     cuMemcpy2DUnaligned_v2, cuMemcpy3DPeer{,Async}, cuMemcpyBatchAsync and cuMemcpy3DBatchAsync (12.8 and 13.0
 *     ABIs), cuMemsetD2D{8,16,32}{_v2,Async}, cuStream{Write,Wait}Value{32,64} and cuStreamBatchMemOp (both ABIs),
 *     cuMemPrefetchAsync (both ABIs), cuMemPrefetchBatchAsync, cuMemDiscardBatchAsync,
 *     cuMemDiscardAndPrefetchBatchAsync, cuMemBatchDecompressAsync, cuLaunchHostFunc, cuStreamAddCallback,
 *     cuGraphUpload, cuGraphInstantiateWithParams (it may upload), cuLaunchCooperativeKernelMultiDevice and the
 *     deprecated cuLaunch, cuLaunchGrid, cuLaunchGridAsync; each with its per-thread-stream variant where the
 *     driver has one. tests/probe/test_interposer_gated.py pins the list and checks every prototype against
 *     cuda.h.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cscu.h"

static void *slot(void **place, const char *name)
{
    void *fn = __atomic_load_n(place, __ATOMIC_ACQUIRE);
    if (!fn) {
        void *expected = NULL;
        fn = cscu_real(name);
        if (fn && !__atomic_compare_exchange_n(place, &expected, fn, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            fn = expected;
    }
    return fn;
}

/* --- gated entry points --------------------------------------------------------------------------------------- */
#define BODY(fn, v, name, args)                                                               \
    {                                                                                          \
        __typeof__(&fn) real = (__typeof__(&fn))slot(&fn##_slot[v], name);                     \
        if (!real)                                                                             \
            return CUDA_ERROR_NOT_INITIALIZED;                                                 \
        cscu_gate_enter();                                                                     \
        CUresult rc = real args;                                                               \
        cscu_gate_leave();                                                                     \
        return rc;                                                                             \
    }
#define GATED(fn, pt, params, args)                                                           \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params;                                                            \
    CSCU_EXPORT CUresult pt params;                                                            \
    CUresult fn params BODY(fn, 0, #fn, args)                                                  \
    CUresult pt params BODY(fn, 1, #pt, args)
#define GATED1(fn, params, args)                                                              \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params;                                                            \
    CUresult fn params BODY(fn, 0, #fn, args)

typedef unsigned int U;
GATED(cuLaunchKernel, cuLaunchKernel_ptsz, (CUfunction f, U gx, U gy, U gz, U bx, U by, U bz, U shared,
      CUstream s, void **params, void **extra), (f, gx, gy, gz, bx, by, bz, shared, s, params, extra))
GATED(cuLaunchKernelEx, cuLaunchKernelEx_ptsz, (const CUlaunchConfig *c, CUfunction f, void **params,
      void **extra), (c, f, params, extra))
GATED(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz, (CUfunction f, U gx, U gy, U gz, U bx, U by,
      U bz, U shared, CUstream s, void **params), (f, gx, gy, gz, bx, by, bz, shared, s, params))
GATED(cuGraphLaunch, cuGraphLaunch_ptsz, (CUgraphExec g, CUstream s), (g, s))
GATED(cuMemcpy, cuMemcpy_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
GATED(cuMemcpyAsync, cuMemcpyAsync_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
GATED(cuMemcpyPeer, cuMemcpyPeer_ptds, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n),
      (d, dc, s, sc, n))
GATED(cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc,
      size_t n, CUstream st), (d, dc, s, sc, n, st))
GATED(cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds, (CUdeviceptr d, const void *s, size_t n), (d, s, n))
GATED(cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds, (void *d, CUdeviceptr s, size_t n), (d, s, n))
GATED(cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n))
GATED(cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr d, const void *s, size_t n, CUstream st),
      (d, s, n, st))
GATED(cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz, (void *d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st))
GATED(cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st),
      (d, s, n, st))
GATED(cuMemcpy2D_v2, cuMemcpy2D_v2_ptds, (const CUDA_MEMCPY2D *p), (p))
GATED(cuMemcpy2DAsync_v2, cuMemcpy2DAsync_v2_ptsz, (const CUDA_MEMCPY2D *p, CUstream s), (p, s))
GATED(cuMemcpy3D_v2, cuMemcpy3D_v2_ptds, (const CUDA_MEMCPY3D *p), (p))
GATED(cuMemcpy3DAsync_v2, cuMemcpy3DAsync_v2_ptsz, (const CUDA_MEMCPY3D *p, CUstream s), (p, s))
GATED(cuMemsetD8_v2, cuMemsetD8_v2_ptds, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n))
GATED(cuMemsetD16_v2, cuMemsetD16_v2_ptds, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n))
GATED(cuMemsetD32_v2, cuMemsetD32_v2_ptds, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n))
GATED(cuMemsetD8Async, cuMemsetD8Async_ptsz, (CUdeviceptr d, unsigned char v, size_t n, CUstream s), (d, v, n, s))
GATED(cuMemsetD16Async, cuMemsetD16Async_ptsz, (CUdeviceptr d, unsigned short v, size_t n, CUstream s), (d, v, n, s))
GATED(cuMemsetD32Async, cuMemsetD32Async_ptsz, (CUdeviceptr d, unsigned int v, size_t n, CUstream s), (d, v, n, s))
GATED(cuStreamSynchronize, cuStreamSynchronize_ptsz, (CUstream s), (s))
GATED1(cuEventSynchronize, (CUevent e), (e))
GATED1(cuCtxSynchronize, (void), ())
GATED1(cuCtxSynchronize_v2, (CUcontext c), (c))  /* CUDA 13.0: a name of its own, not a version of the above */
GATED1(cuCtxGetLimit, (size_t *v, CUlimit l), (v, l))  /* never the stack limit a release lowered (stack_limit.c) */
GATED1(cuCtxSetLimit, (CUlimit l, size_t v), (l, v))   /* nor an engine's limit the set-back would override */

/* Every other entry point that reads or writes device memory or runs device work (cuda.h and cudaTypedefs.h of
 * CUDA 13.0; the version a name's ABI dates from is in the table below). */
typedef size_t Z;
GATED(cuMemcpyAtoA_v2, cuMemcpyAtoA_v2_ptds, (CUarray d, Z doff, CUarray s, Z soff, Z n), (d, doff, s, soff, n))
GATED(cuMemcpyAtoD_v2, cuMemcpyAtoD_v2_ptds, (CUdeviceptr d, CUarray s, Z soff, Z n), (d, s, soff, n))
GATED(cuMemcpyAtoH_v2, cuMemcpyAtoH_v2_ptds, (void *d, CUarray s, Z soff, Z n), (d, s, soff, n))
GATED(cuMemcpyDtoA_v2, cuMemcpyDtoA_v2_ptds, (CUarray d, Z doff, CUdeviceptr s, Z n), (d, doff, s, n))
GATED(cuMemcpyHtoA_v2, cuMemcpyHtoA_v2_ptds, (CUarray d, Z doff, const void *s, Z n), (d, doff, s, n))
GATED(cuMemcpyAtoHAsync_v2, cuMemcpyAtoHAsync_v2_ptsz, (void *d, CUarray s, Z soff, Z n, CUstream st),
      (d, s, soff, n, st))
GATED(cuMemcpyHtoAAsync_v2, cuMemcpyHtoAAsync_v2_ptsz, (CUarray d, Z doff, const void *s, Z n, CUstream st),
      (d, doff, s, n, st))
GATED(cuMemcpy2DUnaligned_v2, cuMemcpy2DUnaligned_v2_ptds, (const CUDA_MEMCPY2D *p), (p))
GATED(cuMemcpy3DPeer, cuMemcpy3DPeer_ptds, (const CUDA_MEMCPY3D_PEER *p), (p))
GATED(cuMemcpy3DPeerAsync, cuMemcpy3DPeerAsync_ptsz, (const CUDA_MEMCPY3D_PEER *p, CUstream s), (p, s))
/* The batches: 12.8's ABI reports the failing index, 13.0's (_v2) does not. */
GATED(cuMemcpyBatchAsync, cuMemcpyBatchAsync_ptsz, (CUdeviceptr *d, CUdeviceptr *s, Z *sizes, Z count,
      CUmemcpyAttributes *attrs, Z *attrs_idx, Z attrs_count, Z *fail, CUstream st),
      (d, s, sizes, count, attrs, attrs_idx, attrs_count, fail, st))
GATED(cuMemcpyBatchAsync_v2, cuMemcpyBatchAsync_v2_ptsz, (CUdeviceptr *d, CUdeviceptr *s, Z *sizes, Z count,
      CUmemcpyAttributes *attrs, Z *attrs_idx, Z attrs_count, CUstream st),
      (d, s, sizes, count, attrs, attrs_idx, attrs_count, st))
GATED(cuMemcpy3DBatchAsync, cuMemcpy3DBatchAsync_ptsz, (Z count, CUDA_MEMCPY3D_BATCH_OP *ops, Z *fail,
      unsigned long long flags, CUstream st), (count, ops, fail, flags, st))
GATED(cuMemcpy3DBatchAsync_v2, cuMemcpy3DBatchAsync_v2_ptsz, (Z count, CUDA_MEMCPY3D_BATCH_OP *ops,
      unsigned long long flags, CUstream st), (count, ops, flags, st))
GATED(cuMemsetD2D8_v2, cuMemsetD2D8_v2_ptds, (CUdeviceptr d, Z pitch, unsigned char v, Z w, Z h), (d, pitch, v, w, h))
GATED(cuMemsetD2D16_v2, cuMemsetD2D16_v2_ptds, (CUdeviceptr d, Z pitch, unsigned short v, Z w, Z h),
      (d, pitch, v, w, h))
GATED(cuMemsetD2D32_v2, cuMemsetD2D32_v2_ptds, (CUdeviceptr d, Z pitch, unsigned int v, Z w, Z h), (d, pitch, v, w, h))
GATED(cuMemsetD2D8Async, cuMemsetD2D8Async_ptsz, (CUdeviceptr d, Z pitch, unsigned char v, Z w, Z h, CUstream s),
      (d, pitch, v, w, h, s))
GATED(cuMemsetD2D16Async, cuMemsetD2D16Async_ptsz, (CUdeviceptr d, Z pitch, unsigned short v, Z w, Z h,
      CUstream s), (d, pitch, v, w, h, s))
GATED(cuMemsetD2D32Async, cuMemsetD2D32Async_ptsz, (CUdeviceptr d, Z pitch, unsigned int v, Z w, Z h, CUstream s),
      (d, pitch, v, w, h, s))
/* Stream memory operations: the unsuffixed ABI (CUDA 8.0/9.0) and _v2 (11.7) take the same arguments. */
GATED(cuStreamWriteValue32, cuStreamWriteValue32_ptsz, (CUstream s, CUdeviceptr a, cuuint32_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamWriteValue32_v2, cuStreamWriteValue32_v2_ptsz, (CUstream s, CUdeviceptr a, cuuint32_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamWriteValue64, cuStreamWriteValue64_ptsz, (CUstream s, CUdeviceptr a, cuuint64_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamWriteValue64_v2, cuStreamWriteValue64_v2_ptsz, (CUstream s, CUdeviceptr a, cuuint64_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamWaitValue32, cuStreamWaitValue32_ptsz, (CUstream s, CUdeviceptr a, cuuint32_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamWaitValue32_v2, cuStreamWaitValue32_v2_ptsz, (CUstream s, CUdeviceptr a, cuuint32_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamWaitValue64, cuStreamWaitValue64_ptsz, (CUstream s, CUdeviceptr a, cuuint64_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamWaitValue64_v2, cuStreamWaitValue64_v2_ptsz, (CUstream s, CUdeviceptr a, cuuint64_t v, U flags),
      (s, a, v, flags))
GATED(cuStreamBatchMemOp, cuStreamBatchMemOp_ptsz, (CUstream s, U count, CUstreamBatchMemOpParams *ops, U flags),
      (s, count, ops, flags))
GATED(cuStreamBatchMemOp_v2, cuStreamBatchMemOp_v2_ptsz, (CUstream s, U count, CUstreamBatchMemOpParams *ops,
      U flags), (s, count, ops, flags))
/* Managed memory moved by the driver (its own pages, not our regions, but device work all the same). */
GATED(cuMemPrefetchAsync, cuMemPrefetchAsync_ptsz, (CUdeviceptr p, Z n, CUdevice d, CUstream s), (p, n, d, s))
GATED(cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz, (CUdeviceptr p, Z n, CUmemLocation to, U flags,
      CUstream s), (p, n, to, flags, s))
GATED(cuMemPrefetchBatchAsync, cuMemPrefetchBatchAsync_ptsz, (CUdeviceptr *p, Z *sizes, Z count, CUmemLocation *to,
      Z *to_idx, Z to_count, unsigned long long flags, CUstream s), (p, sizes, count, to, to_idx, to_count, flags, s))
GATED(cuMemDiscardBatchAsync, cuMemDiscardBatchAsync_ptsz, (CUdeviceptr *p, Z *sizes, Z count,
      unsigned long long flags, CUstream s), (p, sizes, count, flags, s))
GATED(cuMemDiscardAndPrefetchBatchAsync, cuMemDiscardAndPrefetchBatchAsync_ptsz, (CUdeviceptr *p, Z *sizes,
      Z count, CUmemLocation *to, Z *to_idx, Z to_count, unsigned long long flags, CUstream s),
      (p, sizes, count, to, to_idx, to_count, flags, s))
GATED(cuMemBatchDecompressAsync, cuMemBatchDecompressAsync_ptsz, (CUmemDecompressParams *params, Z count, U flags,
      Z *fail, CUstream s), (params, count, flags, fail, s))
/* Work enqueued on a stream, and graphs uploaded to the device. */
GATED(cuLaunchHostFunc, cuLaunchHostFunc_ptsz, (CUstream s, CUhostFn fn, void *data), (s, fn, data))
GATED(cuStreamAddCallback, cuStreamAddCallback_ptsz, (CUstream s, CUstreamCallback fn, void *data, U flags),
      (s, fn, data, flags))
GATED(cuGraphUpload, cuGraphUpload_ptsz, (CUgraphExec g, CUstream s), (g, s))
GATED(cuGraphInstantiateWithParams, cuGraphInstantiateWithParams_ptsz, (CUgraphExec *g, CUgraph graph,
      CUDA_GRAPH_INSTANTIATE_PARAMS *params), (g, graph, params))
GATED1(cuLaunchCooperativeKernelMultiDevice, (CUDA_LAUNCH_PARAMS *list, U devices, U flags), (list, devices, flags))
GATED1(cuLaunch, (CUfunction f), (f))  /* the deprecated launches (CUDA 2.0), still exported */
GATED1(cuLaunchGrid, (CUfunction f, int w, int h), (f, w, h))
GATED1(cuLaunchGridAsync, (CUfunction f, int w, int h, CUstream s), (f, w, h, s))

/* --- allocations ------------------------------------------------------------------------------------------ */
/* Counted (and gated: nothing is allocated while the regions are released) but left to the driver. */
#define COUNTED(fn, pt, params, args, kind, ptr, bytes)                                      \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params;                                                            \
    CSCU_EXPORT CUresult pt params;                                                            \
    CUresult fn params COUNTED_BODY(fn, 0, #fn, args, kind, ptr, bytes)                        \
    CUresult pt params COUNTED_BODY(fn, 1, #pt, args, kind, ptr, bytes)
#define COUNTED1(fn, params, args, kind, ptr, bytes)                                          \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params;                                                            \
    CUresult fn params COUNTED_BODY(fn, 0, #fn, args, kind, ptr, bytes)
#define COUNTED_BODY(fn, v, name, args, kind, ptr, bytes)                                     \
    {                                                                                          \
        __typeof__(&fn) real = (__typeof__(&fn))slot(&fn##_slot[v], name);                     \
        if (!real)                                                                             \
            return CUDA_ERROR_NOT_INITIALIZED;                                                 \
        cscu_gate_enter();                                                                     \
        CUresult rc = real args;                                                               \
        if (rc == CUDA_SUCCESS)                                                                \
            cscu_track(kind, (uintptr_t)(ptr), bytes);                                         \
        cscu_gate_leave();                                                                     \
        return rc;                                                                             \
    }

COUNTED1(cuMemAllocPitch_v2, (CUdeviceptr *p, size_t *pitch, size_t w, size_t h, U e), (p, pitch, w, h, e),
         CSCU_PITCH, *p, *pitch * h)
COUNTED1(cuMemAllocManaged, (CUdeviceptr *p, size_t n, U flags), (p, n, flags), CSCU_MANAGED, *p, n)
COUNTED1(cuMemHostRegister_v2, (void *p, size_t n, U flags), (p, n, flags), CSCU_HOST_REGISTERED, p, n)
COUNTED1(cuMemHostAlloc, (void **p, size_t n, U flags), (p, n, flags), CSCU_HOST_ALLOC, *p, n)
COUNTED1(cuMemAllocHost_v2, (void **p, size_t n), (p, n), CSCU_HOST_ALLOC, *p, n)
/* Legacy CUDA IPC, both sides, each allocation once and whole: a capture refuses it first (_cuda_ipc.py). */
COUNTED1(cuIpcOpenMemHandle_v2, (CUdeviceptr *p, CUipcMemHandle h, U flags), (p, h, flags), CSCU_IPC_IMPORTED,
         *p, cscu_allocation(*p, 1))
COUNTED1(cuIpcGetMemHandle, (CUipcMemHandle *h, CUdeviceptr p), (h, p), CSCU_IPC_EXPORTED, cscu_allocation(p, 0),
         cscu_allocation(p, 1))

/* Ends of the counted allocations: their counts follow what is live. */
#define UNTRACKED(fn, pt, params, args, ptr)                                                  \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params;                                                            \
    CSCU_EXPORT CUresult pt params;                                                            \
    CUresult fn params UNTRACKED_BODY(fn, 0, #fn, args, ptr)                                   \
    CUresult pt params UNTRACKED_BODY(fn, 1, #pt, args, ptr)
#define UNTRACKED1(fn, params, args, ptr)                                                     \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params;                                                            \
    CUresult fn params UNTRACKED_BODY(fn, 0, #fn, args, ptr)
#define UNTRACKED_BODY(fn, v, name, args, ptr)                                                \
    {                                                                                          \
        __typeof__(&fn) real = (__typeof__(&fn))slot(&fn##_slot[v], name);                     \
        if (!real)                                                                             \
            return CUDA_ERROR_NOT_INITIALIZED;                                                 \
        CUresult rc = real args;                                                               \
        if (rc == CUDA_SUCCESS)                                                                \
            cscu_untrack((uintptr_t)(ptr));                                                    \
        return rc;                                                                             \
    }
UNTRACKED1(cuMemHostUnregister, (void *p), (p), p)
UNTRACKED1(cuMemFreeHost, (void *p), (p), p)
UNTRACKED1(cuIpcCloseMemHandle, (CUdeviceptr p), (p), p)

/* The engine's own VMM allocations (engine_vmm.c): each call with a handle gets the driver's for the engine's. */
#define UNPAREN(...) __VA_ARGS__
#define ROUTED1(fn, params, args, hook)                                                       \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params                                                             \
    {                                                                                          \
        __typeof__(&fn) real = (__typeof__(&fn))slot(&fn##_slot[0], #fn);                      \
        if (!real)                                                                             \
            return CUDA_ERROR_NOT_INITIALIZED;                                                 \
        cscu_gate_enter();                                                                     \
        CUresult rc = hook(real, UNPAREN args);                                                \
        cscu_gate_leave();                                                                     \
        return rc;                                                                             \
    }
typedef CUmemGenericAllocationHandle H;
ROUTED1(cuMemCreate, (H *h, size_t n, const CUmemAllocationProp *prop, unsigned long long flags),
        (h, n, prop, flags), cscu_vmm_create)
ROUTED1(cuMemRelease, (H h), (h), cscu_vmm_release)
ROUTED1(cuMemMap, (CUdeviceptr p, size_t n, size_t offset, H h, unsigned long long flags), (p, n, offset, h, flags),
        cscu_vmm_map)
ROUTED1(cuMemUnmap, (CUdeviceptr p, size_t n), (p, n), cscu_vmm_unmap)
ROUTED1(cuMemSetAccess, (CUdeviceptr p, size_t n, const CUmemAccessDesc *desc, size_t count), (p, n, desc, count),
        cscu_vmm_set_access)
ROUTED1(cuMemRetainAllocationHandle, (H *h, void *addr), (h, addr), cscu_vmm_retain)
ROUTED1(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *prop, H h), (prop, h), cscu_vmm_properties)
ROUTED1(cuMemExportToShareableHandle, (void *out, H h, U type, unsigned long long flags), (out, h, type, flags),
        cscu_vmm_export)
ROUTED1(cuMulticastBindMem, (H mc, size_t mc_offset, H h, size_t offset, size_t n, unsigned long long flags),
        (mc, mc_offset, h, offset, n, flags), cscu_vmm_bind)  /* NCCL's NVLS buffers */

/* Stream-ordered allocations (stream_ordered.c): `ours` of the threshold or more (regions); the rest go to the
 * driver, and `done` counts them. */
#define ORDERED(fn, pt, params, args, ours, done)                                             \
    static void *fn##_slot[2];                                                                 \
    CSCU_EXPORT CUresult fn params ORDERED_BODY(fn, 0, #fn, args, ours, done)                  \
    CSCU_EXPORT CUresult pt params ORDERED_BODY(fn, 1, #pt, args, ours, done)
#define ORDERED_BODY(fn, v, name, args, ours, done)                                           \
    {                                                                                          \
        __typeof__(&fn) real = (__typeof__(&fn))slot(&fn##_slot[v], name);                     \
        const int per_thread = v;                                                              \
        if (!real)                                                                             \
            return CUDA_ERROR_NOT_INITIALIZED;                                                 \
        cscu_gate_enter();                                                                     \
        CUresult rc = ours;                                                                    \
        if (rc == CUDA_ERROR_NOT_FOUND && (rc = real args) == CUDA_SUCCESS)                    \
            done;                                                                              \
        cscu_gate_leave();                                                                     \
        return rc;                                                                             \
    }
ORDERED(cuMemAllocAsync, cuMemAllocAsync_ptsz, (CUdeviceptr *p, size_t n, CUstream s), (p, n, s),
        cscu_async_alloc(per_thread, p, n, NULL, 0, s), cscu_track(CSCU_ASYNC, (uintptr_t)*p, n))
ORDERED(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr *p, size_t n, CUmemoryPool pool,
        CUstream s), (p, n, pool, s), cscu_async_alloc(per_thread, p, n, pool, 1, s),
        cscu_track(CSCU_ASYNC, (uintptr_t)*p, n))
ORDERED(cuMemFreeAsync, cuMemFreeAsync_ptsz, (CUdeviceptr p, CUstream s), (p, s), cscu_async_free(per_thread, p, s),
        cscu_untrack((uintptr_t)p))

static void *cuMemAlloc_v2_slot[2];
static void *cuMemFree_v2_slot[2];
CSCU_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n);
CSCU_EXPORT CUresult cuMemFree_v2(CUdeviceptr p);

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    __typeof__(&cuMemAlloc_v2) real = (__typeof__(&cuMemAlloc_v2))slot(&cuMemAlloc_v2_slot[0], "cuMemAlloc_v2");
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    cscu_gate_enter();
    enum cscu_kind why = CSCU_FALLBACK;
    CUresult rc = cscu_alloc(p, n, &why, CSCU_FROM_ALLOC);
    if (rc == CUDA_ERROR_NOT_FOUND && (rc = real(p, n)) == CUDA_SUCCESS)
        cscu_track(why, (uintptr_t)*p, n);
    cscu_gate_leave();
    return rc;
}

CUresult cuMemFree_v2(CUdeviceptr p)
{
    __typeof__(&cuMemFree_v2) real = (__typeof__(&cuMemFree_v2))slot(&cuMemFree_v2_slot[0], "cuMemFree_v2");
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    cscu_gate_enter();
    cscu_async_forget(p);  /* freed at once, not after a stream's event */
    CUresult rc = cscu_free(p);
    if (rc == CUDA_ERROR_NOT_FOUND && (rc = real(p)) == CUDA_SUCCESS)
        cscu_untrack((uintptr_t)p);
    cscu_gate_leave();
    return rc;
}

/* --- the table cuGetProcAddress and dlsym consult ------------------------------------------------------------ */
struct entry {
    const char *base;           /* the name cuGetProcAddress is asked for */
    int since;                  /* the CUDA version from which `base` resolves to this ABI */
    const char *name[2];        /* the exported names: default stream, per-thread stream (or NULL) */
    void *wrapper[2];
    void **slots;
};
#define E2(base, since, fn, pt) {base, since, {#fn, #pt}, {(void *)fn, (void *)pt}, fn##_slot}
#define E1(base, since, fn) {base, since, {#fn, NULL}, {(void *)fn, NULL}, fn##_slot}

static const struct entry table[] = {
    E1("cuMemAlloc", 3020, cuMemAlloc_v2), E1("cuMemFree", 3020, cuMemFree_v2),
    E1("cuMemAllocPitch", 3020, cuMemAllocPitch_v2), E1("cuMemAllocManaged", 0, cuMemAllocManaged),
    E2("cuMemAllocAsync", 0, cuMemAllocAsync, cuMemAllocAsync_ptsz),
    E2("cuMemAllocFromPoolAsync", 0, cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync_ptsz),
    E2("cuMemFreeAsync", 0, cuMemFreeAsync, cuMemFreeAsync_ptsz),
    E1("cuMemHostRegister", 6050, cuMemHostRegister_v2), E1("cuMemHostUnregister", 0, cuMemHostUnregister),
    E1("cuMemHostAlloc", 0, cuMemHostAlloc), E1("cuMemAllocHost", 3020, cuMemAllocHost_v2),
    E1("cuMemFreeHost", 0, cuMemFreeHost), E1("cuIpcOpenMemHandle", 11000, cuIpcOpenMemHandle_v2),
    E1("cuIpcCloseMemHandle", 0, cuIpcCloseMemHandle), E1("cuIpcGetMemHandle", 0, cuIpcGetMemHandle),
    E1("cuMemCreate", 0, cuMemCreate),
    E1("cuMemRelease", 0, cuMemRelease), E1("cuMemMap", 0, cuMemMap), E1("cuMemUnmap", 0, cuMemUnmap),
    E1("cuMemSetAccess", 0, cuMemSetAccess), E1("cuMemRetainAllocationHandle", 0, cuMemRetainAllocationHandle),
    E1("cuMemGetAllocationPropertiesFromHandle", 0, cuMemGetAllocationPropertiesFromHandle),
    E1("cuMemExportToShareableHandle", 0, cuMemExportToShareableHandle), E1("cuMulticastBindMem", 0, cuMulticastBindMem),
    E2("cuLaunchKernel", 0, cuLaunchKernel, cuLaunchKernel_ptsz),
    E2("cuLaunchKernelEx", 0, cuLaunchKernelEx, cuLaunchKernelEx_ptsz),
    E2("cuLaunchCooperativeKernel", 0, cuLaunchCooperativeKernel, cuLaunchCooperativeKernel_ptsz),
    E2("cuGraphLaunch", 0, cuGraphLaunch, cuGraphLaunch_ptsz),
    E2("cuMemcpy", 0, cuMemcpy, cuMemcpy_ptds), E2("cuMemcpyAsync", 0, cuMemcpyAsync, cuMemcpyAsync_ptsz),
    E2("cuMemcpyPeer", 0, cuMemcpyPeer, cuMemcpyPeer_ptds),
    E2("cuMemcpyPeerAsync", 0, cuMemcpyPeerAsync, cuMemcpyPeerAsync_ptsz),
    E2("cuMemcpyHtoD", 3020, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds),
    E2("cuMemcpyDtoH", 3020, cuMemcpyDtoH_v2, cuMemcpyDtoH_v2_ptds),
    E2("cuMemcpyDtoD", 3020, cuMemcpyDtoD_v2, cuMemcpyDtoD_v2_ptds),
    E2("cuMemcpyHtoDAsync", 3020, cuMemcpyHtoDAsync_v2, cuMemcpyHtoDAsync_v2_ptsz),
    E2("cuMemcpyDtoHAsync", 3020, cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync_v2_ptsz),
    E2("cuMemcpyDtoDAsync", 3020, cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync_v2_ptsz),
    E2("cuMemcpy2D", 3020, cuMemcpy2D_v2, cuMemcpy2D_v2_ptds),
    E2("cuMemcpy2DAsync", 3020, cuMemcpy2DAsync_v2, cuMemcpy2DAsync_v2_ptsz),
    E2("cuMemcpy3D", 3020, cuMemcpy3D_v2, cuMemcpy3D_v2_ptds),
    E2("cuMemcpy3DAsync", 3020, cuMemcpy3DAsync_v2, cuMemcpy3DAsync_v2_ptsz),
    E2("cuMemsetD8", 3020, cuMemsetD8_v2, cuMemsetD8_v2_ptds),
    E2("cuMemsetD16", 3020, cuMemsetD16_v2, cuMemsetD16_v2_ptds),
    E2("cuMemsetD32", 3020, cuMemsetD32_v2, cuMemsetD32_v2_ptds),
    E2("cuMemsetD8Async", 0, cuMemsetD8Async, cuMemsetD8Async_ptsz),
    E2("cuMemsetD16Async", 0, cuMemsetD16Async, cuMemsetD16Async_ptsz),
    E2("cuMemsetD32Async", 0, cuMemsetD32Async, cuMemsetD32Async_ptsz),
    E2("cuStreamSynchronize", 0, cuStreamSynchronize, cuStreamSynchronize_ptsz),
    E1("cuEventSynchronize", 0, cuEventSynchronize),
    /* Two names, not two ABIs of one: CUDA 13.0 added cuCtxSynchronize_v2 (a context argument) under its own name
     * (cuda-python's bindings ask for "cuCtxSynchronize_v2" at 13000 and "cuCtxSynchronize" at 2000); the plain
     * name keeps its argument-less ABI at every version. */
    E1("cuCtxSynchronize_v2", 13000, cuCtxSynchronize_v2), E1("cuCtxSynchronize", 0, cuCtxSynchronize),
    E1("cuCtxGetLimit", 0, cuCtxGetLimit), E1("cuCtxSetLimit", 0, cuCtxSetLimit),
    E2("cuMemcpyAtoA", 3020, cuMemcpyAtoA_v2, cuMemcpyAtoA_v2_ptds),
    E2("cuMemcpyAtoD", 3020, cuMemcpyAtoD_v2, cuMemcpyAtoD_v2_ptds),
    E2("cuMemcpyAtoH", 3020, cuMemcpyAtoH_v2, cuMemcpyAtoH_v2_ptds),
    E2("cuMemcpyDtoA", 3020, cuMemcpyDtoA_v2, cuMemcpyDtoA_v2_ptds),
    E2("cuMemcpyHtoA", 3020, cuMemcpyHtoA_v2, cuMemcpyHtoA_v2_ptds),
    E2("cuMemcpyAtoHAsync", 3020, cuMemcpyAtoHAsync_v2, cuMemcpyAtoHAsync_v2_ptsz),
    E2("cuMemcpyHtoAAsync", 3020, cuMemcpyHtoAAsync_v2, cuMemcpyHtoAAsync_v2_ptsz),
    E2("cuMemcpy2DUnaligned", 3020, cuMemcpy2DUnaligned_v2, cuMemcpy2DUnaligned_v2_ptds),
    E2("cuMemcpy3DPeer", 0, cuMemcpy3DPeer, cuMemcpy3DPeer_ptds),
    E2("cuMemcpy3DPeerAsync", 0, cuMemcpy3DPeerAsync, cuMemcpy3DPeerAsync_ptsz),
    E2("cuMemcpyBatchAsync", 13000, cuMemcpyBatchAsync_v2, cuMemcpyBatchAsync_v2_ptsz),
    E2("cuMemcpyBatchAsync", 12080, cuMemcpyBatchAsync, cuMemcpyBatchAsync_ptsz),
    E2("cuMemcpy3DBatchAsync", 13000, cuMemcpy3DBatchAsync_v2, cuMemcpy3DBatchAsync_v2_ptsz),
    E2("cuMemcpy3DBatchAsync", 12080, cuMemcpy3DBatchAsync, cuMemcpy3DBatchAsync_ptsz),
    E2("cuMemsetD2D8", 3020, cuMemsetD2D8_v2, cuMemsetD2D8_v2_ptds),
    E2("cuMemsetD2D16", 3020, cuMemsetD2D16_v2, cuMemsetD2D16_v2_ptds),
    E2("cuMemsetD2D32", 3020, cuMemsetD2D32_v2, cuMemsetD2D32_v2_ptds),
    E2("cuMemsetD2D8Async", 0, cuMemsetD2D8Async, cuMemsetD2D8Async_ptsz),
    E2("cuMemsetD2D16Async", 0, cuMemsetD2D16Async, cuMemsetD2D16Async_ptsz),
    E2("cuMemsetD2D32Async", 0, cuMemsetD2D32Async, cuMemsetD2D32Async_ptsz),
    E2("cuStreamWriteValue32", 11070, cuStreamWriteValue32_v2, cuStreamWriteValue32_v2_ptsz),
    E2("cuStreamWriteValue32", 0, cuStreamWriteValue32, cuStreamWriteValue32_ptsz),
    E2("cuStreamWriteValue64", 11070, cuStreamWriteValue64_v2, cuStreamWriteValue64_v2_ptsz),
    E2("cuStreamWriteValue64", 0, cuStreamWriteValue64, cuStreamWriteValue64_ptsz),
    E2("cuStreamWaitValue32", 11070, cuStreamWaitValue32_v2, cuStreamWaitValue32_v2_ptsz),
    E2("cuStreamWaitValue32", 0, cuStreamWaitValue32, cuStreamWaitValue32_ptsz),
    E2("cuStreamWaitValue64", 11070, cuStreamWaitValue64_v2, cuStreamWaitValue64_v2_ptsz),
    E2("cuStreamWaitValue64", 0, cuStreamWaitValue64, cuStreamWaitValue64_ptsz),
    E2("cuStreamBatchMemOp", 11070, cuStreamBatchMemOp_v2, cuStreamBatchMemOp_v2_ptsz),
    E2("cuStreamBatchMemOp", 0, cuStreamBatchMemOp, cuStreamBatchMemOp_ptsz),
    E2("cuMemPrefetchAsync", 12020, cuMemPrefetchAsync_v2, cuMemPrefetchAsync_v2_ptsz),
    E2("cuMemPrefetchAsync", 0, cuMemPrefetchAsync, cuMemPrefetchAsync_ptsz),
    E2("cuMemPrefetchBatchAsync", 0, cuMemPrefetchBatchAsync, cuMemPrefetchBatchAsync_ptsz),
    E2("cuMemDiscardBatchAsync", 0, cuMemDiscardBatchAsync, cuMemDiscardBatchAsync_ptsz),
    E2("cuMemDiscardAndPrefetchBatchAsync", 0, cuMemDiscardAndPrefetchBatchAsync,
       cuMemDiscardAndPrefetchBatchAsync_ptsz),
    E2("cuMemBatchDecompressAsync", 0, cuMemBatchDecompressAsync, cuMemBatchDecompressAsync_ptsz),
    E2("cuLaunchHostFunc", 0, cuLaunchHostFunc, cuLaunchHostFunc_ptsz),
    E2("cuStreamAddCallback", 0, cuStreamAddCallback, cuStreamAddCallback_ptsz),
    E2("cuGraphUpload", 0, cuGraphUpload, cuGraphUpload_ptsz),
    E2("cuGraphInstantiateWithParams", 0, cuGraphInstantiateWithParams, cuGraphInstantiateWithParams_ptsz),
    E1("cuLaunchCooperativeKernelMultiDevice", 0, cuLaunchCooperativeKernelMultiDevice),
    E1("cuLaunch", 0, cuLaunch), E1("cuLaunchGrid", 0, cuLaunchGrid), E1("cuLaunchGridAsync", 0, cuLaunchGridAsync),
};
#define ENTRIES (sizeof(table) / sizeof(table[0]))

/* The names handed out unwrapped (another function than the one their slot holds), for `status`: each such
 * entry point bypasses the gate, so the next GPU run must say which. */
#define UNWRAPPED_NAMES 16
static const char *unwrapped_names[UNWRAPPED_NAMES];
static int unwrapped_count;

static void *unwrapped(const char *name, void *real)
{
    int at = __atomic_fetch_add(&unwrapped_count, 1, __ATOMIC_ACQ_REL);
    if (at < UNWRAPPED_NAMES)
        __atomic_store_n(&unwrapped_names[at], name, __ATOMIC_RELEASE);
    cscu_count(CSCU_UNWRAPPED_ENTRY);  /* another ABI version of the same name: never mixed up */
    return real;
}

size_t cscu_unwrapped_json(char *out, size_t room)
{
    size_t used = 0;
    int count = __atomic_load_n(&unwrapped_count, __ATOMIC_ACQUIRE);
    if (room < 3)
        return 0;
    used += (size_t)snprintf(out, room, "[");
    for (int i = 0; i < count && i < UNWRAPPED_NAMES && used < room; i++) {
        const char *name = __atomic_load_n(&unwrapped_names[i], __ATOMIC_ACQUIRE);
        if (name)
            used += (size_t)snprintf(out + used, room - used, "%s\"%s\"", used > 1 ? "," : "", name);
    }
    if (used < room)
        used += (size_t)snprintf(out + used, room - used, "]");
    return used < room ? used : room - 1;
}

/* Our wrapper for the real function `real` that `e` resolved to (variant by identity), or `real` itself. */
static void *install(const struct entry *e, void *real)
{
    int v = e->name[1] && real == cscu_real(e->name[1]) ? 1 : 0;
    void *expected = NULL;
    if (__atomic_compare_exchange_n(&e->slots[v], &expected, real, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
        || expected == real)
        return e->wrapper[v];
    return unwrapped(e->base, real);
}

size_t cscu_entries_json(char *out, size_t room)
{
    size_t used = 0;
    if (room < 3)
        return 0;
    used += (size_t)snprintf(out, room, "[");
    for (size_t i = 0; i < ENTRIES && used < room; i++)
        for (int v = 0; v < 2 && used < room; v++)
            if (table[i].name[v] && __atomic_load_n(&table[i].slots[v], __ATOMIC_ACQUIRE))
                used += (size_t)snprintf(out + used, room - used, "%s\"%s\"", used > 1 ? "," : "", table[i].name[v]);
    if (used < room)
        used += (size_t)snprintf(out + used, room - used, "]");
    return used < room ? used : room - 1;
}

/* --- cuGetProcAddress -------------------------------------------------------------------------------------- */
typedef int CUdriverProcAddressQueryResult;
static void *gpa_slot[2];
CSCU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags);
CSCU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                                         CUdriverProcAddressQueryResult *status);

static void resolved(const char *symbol, void **pfn, int version)
{
    if (!symbol || !pfn || !*pfn)
        return;
    if (strcmp(symbol, "cuGetProcAddress") == 0) {
        *pfn = version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
        return;
    }
    /* The wrapper of the very function the driver handed out, when it is one of the exports a name of ours starts
     * with: what decides an ABI is the function, not our reading of the driver's version table (a `since` off by
     * a minor version gave a 4-argument function a 5-argument wrapper). Otherwise the newest the version reaches. */
    size_t length = strlen(symbol);
    for (size_t i = 0; i < ENTRIES; i++)
        for (int v = 0; v < 2; v++)
            if (table[i].name[v] && strncmp(table[i].name[v], symbol, length) == 0
                && cscu_real(table[i].name[v]) == *pfn) {
                *pfn = install(&table[i], *pfn);
                return;
            }
    for (size_t i = 0; i < ENTRIES; i++)
        if (strcmp(table[i].base, symbol) == 0 && version >= table[i].since) {
            *pfn = install(&table[i], *pfn);
            return;
        }
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    __typeof__(&cuGetProcAddress) real = (__typeof__(&cuGetProcAddress))slot(&gpa_slot[0], "cuGetProcAddress");
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(symbol, pfn, version, flags);
    if (rc == CUDA_SUCCESS)
        resolved(symbol, pfn, version);
    return rc;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status)
{
    __typeof__(&cuGetProcAddress_v2) real = (__typeof__(&cuGetProcAddress_v2))slot(&gpa_slot[1],
                                                                                    "cuGetProcAddress_v2");
    if (!real)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = real(symbol, pfn, version, flags, status);
    if (rc == CUDA_SUCCESS)
        resolved(symbol, pfn, version);
    return rc;
}

/* --- dlsym ------------------------------------------------------------------------------------------------- */
static __attribute__((noinline)) void *wrapped(dlsym_fn real, void *handle, const char *name)
{
    void *found = real(handle, name);
    if (!found)
        return NULL;
    if (strcmp(name, "cuGetProcAddress") == 0)
        return slot(&gpa_slot[0], name) == found ? (void *)cuGetProcAddress : found;
    if (strcmp(name, "cuGetProcAddress_v2") == 0)
        return slot(&gpa_slot[1], name) == found ? (void *)cuGetProcAddress_v2 : found;
    for (size_t i = 0; i < ENTRIES; i++)
        for (int v = 0; v < 2; v++)
            if (table[i].name[v] && strcmp(table[i].name[v], name) == 0) {
                void *expected = NULL;
                if (found == table[i].wrapper[v])  /* the lookup found us (a global-scope handle): nothing to wrap */
                    return found;
                if (__atomic_compare_exchange_n(&table[i].slots[v], &expected, found, 0, __ATOMIC_ACQ_REL,
                                                __ATOMIC_ACQUIRE) || expected == found)
                    return table[i].wrapper[v];
                return unwrapped(table[i].name[v], found);
            }
    return found;
}

CSCU_EXPORT void *dlsym(void *handle, const char *name);

void *dlsym(void *handle, const char *name)
{
    dlsym_fn real = cscu_real_dlsym();
    /* A tail call: the real dlsym sees our caller's return address (RTLD_NEXT is relative to the caller). */
    if (handle == RTLD_NEXT || handle == RTLD_DEFAULT || name[0] != 'c' || name[1] != 'u')
        return real(handle, name);
    return wrapped(real, handle, name);
}

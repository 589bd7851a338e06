/* libcoldsnap_cuda: internal declarations shared by the interposer's translation units.
 *
 * No CUDA header is needed (none is guaranteed where this is built): the few driver types, enum values and
 * struct layouts used here are declared below from the CUDA 13.0 driver API reference (cuda.h of 13.0, ABI
 * stable since the version noted beside each). Every symbol of our own carries the `cscu_` prefix and is
 * hidden; the exported ones are the driver's own names (interposed) and `dlsym`.
 */
#ifndef CSCU_H
#define CSCU_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "constants.h"

#define CSCU_HIDDEN __attribute__((visibility("hidden")))
#define CSCU_EXPORT __attribute__((visibility("default")))

/* --- CUDA driver API types (cuda.h, CUDA 13.0) ---------------------------------------------------------- */
typedef int CUresult;                       /* CUDA_SUCCESS = 0 */
typedef unsigned long long CUdeviceptr;     /* CUdeviceptr_v2, since CUDA 3.2 */
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUfunc_st *CUfunction;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { unsigned char bytes[16]; } CUuuid;
typedef struct { char reserved[64]; } CUipcMemHandle;   /* CU_IPC_HANDLE_SIZE = 64, passed by value */
typedef struct CUlaunchConfig_st CUlaunchConfig;        /* only passed through */
typedef struct CUDA_MEMCPY2D_st CUDA_MEMCPY2D;          /* only passed through */
typedef struct CUDA_MEMCPY3D_st CUDA_MEMCPY3D;          /* only passed through */
typedef struct CUarray_st *CUarray;
typedef struct CUgraph_st *CUgraph;
typedef void (*CUhostFn)(void *userData);
typedef void (*CUstreamCallback)(CUstream hStream, CUresult status, void *userData);
typedef enum CUlimit_enum { CU_LIMIT_STACK_SIZE = 0 } CUlimit;  /* cuCtxGetLimit/SetLimit's; passed as an int */
typedef uint32_t cuuint32_t;
typedef uint64_t cuuint64_t;
/* Only passed through (pointers to them): */
typedef struct CUDA_MEMCPY3D_PEER_st CUDA_MEMCPY3D_PEER;
typedef struct CUDA_MEMCPY3D_BATCH_OP_st CUDA_MEMCPY3D_BATCH_OP;
typedef struct CUmemcpyAttributes_st CUmemcpyAttributes;
typedef union CUstreamBatchMemOpParams_union CUstreamBatchMemOpParams;
typedef struct CUDA_GRAPH_INSTANTIATE_PARAMS_st CUDA_GRAPH_INSTANTIATE_PARAMS;
typedef struct CUDA_LAUNCH_PARAMS_st CUDA_LAUNCH_PARAMS;
typedef struct CUmemDecompressParams_st CUmemDecompressParams;

/* The layouts the driver ABI fixes (cuda.h), checked where they are declared. */
_Static_assert(sizeof(CUuuid) == 16, "CUuuid is 16 bytes");
_Static_assert(sizeof(CUipcMemHandle) == 64, "CU_IPC_HANDLE_SIZE is 64");

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NOT_FOUND 500

typedef struct {
    int type;                               /* CUmemLocationType: CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;                            /* 8 bytes, passed by value to cuMemPrefetchAsync_v2 */

typedef struct {
    int type;                               /* CUmemAllocationType: CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes;               /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;                      /* 32 bytes, CUDA 10.2 (allocFlags: 11.0) */

typedef struct {
    CUmemLocation location;
    int flags;                              /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation is 8 bytes (passed by value)");
_Static_assert(sizeof(CUmemAllocationProp) == 32 && offsetof(CUmemAllocationProp, location) == 8
               && offsetof(CUmemAllocationProp, win32HandleMetaData) == 16
               && offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp's CUDA 11 layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");

#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0
#define CU_STREAM_NON_BLOCKING 1
#define CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM 2

/* --- the real driver ------------------------------------------------------------------------------------- */
/* Driver entry points the interposer itself calls, resolved from libcuda.so.1 (dlopen at first use). */
struct cscu_driver {
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*ctx_get_device)(CUdevice *);
    CUresult (*ctx_synchronize)(void);
    CUresult (*device_get_uuid)(CUuuid *, CUdevice);
    CUresult (*device_get_name)(char *, int, CUdevice);
    CUresult (*get_error_name)(CUresult, const char **);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*mem_get_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*stream_create)(CUstream *, unsigned int);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*host_alloc)(void **, size_t, unsigned int);
    CUresult (*free_host)(void *);
    CUresult (*memcpy_dtoh_async)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*memcpy_htod_async)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*memcpy_dtoh)(void *, CUdeviceptr, size_t);
};

/* The driver, loaded once; NULL when libcuda.so.1 or one of the entry points above is missing. */
CSCU_HIDDEN const struct cscu_driver *cscu_driver(void);
/* The C library's own dlsym (the next one after ours: never our wrapper). */
typedef void *(*dlsym_fn)(void *, const char *);
CSCU_HIDDEN dlsym_fn cscu_real_dlsym(void);
/* The real `name` in libcuda.so.1 (never one of ours), or NULL. */
CSCU_HIDDEN void *cscu_real(const char *name);
/* CUDA_ERROR_... name of `rc` (static storage). */
CSCU_HIDDEN const char *cscu_error_name(CUresult rc);

/* --- configuration (environment, read once) --------------------------------------------------------------- */
struct cscu_config {
    char socket[256];           /* COLDSNAP_CUDA_INTERPOSER_SOCKET, "%p" replaced by the pid; "" = inert */
    size_t threshold;           /* COLDSNAP_CUDA_INTERPOSER_THRESHOLD bytes (default 2 MiB) */
    int exportable;             /* COLDSNAP_CUDA_INTERPOSER_EXPORTABLE (default 1) */
    int threads;                /* COLDSNAP_CUDA_INTERPOSER_THREADS copy threads (default: usable CPUs, 4-16) */
    size_t staging;             /* COLDSNAP_CUDA_INTERPOSER_STAGING_MIB per pinned buffer (default 4 MiB) */
    size_t dump_staging;        /* COLDSNAP_CUDA_INTERPOSER_DUMP_STAGING_KIB: a release's buffers (default: `staging`;
                                 * 64 KiB to 64 MiB, whole pages): small ones may stay in the cache the device writes */
    int drain_s;                /* COLDSNAP_CUDA_INTERPOSER_DRAIN_S: a release waits this long for calls inside */
    int request_s;              /* COLDSNAP_CUDA_INTERPOSER_REQUEST_S: a peer's whole request line within this */
    int engine_vmm;             /* COLDSNAP_CUDA_INTERPOSER_ENGINE_VMM (default 1): the engine's cuMemCreate moved */
    int stream_ordered;         /* COLDSNAP_CUDA_INTERPOSER_STREAM_ORDERED (default 1): cuMemAllocAsync moved */
    int stack_shrink;           /* COLDSNAP_CUDA_INTERPOSER_SHRINK_STACK (default 1): a release lowers the stack limit */
    size_t stack_bytes;         /* COLDSNAP_CUDA_INTERPOSER_STACK_BYTES (default 16): what it lowers it to */
};
CSCU_HIDDEN const struct cscu_config *cscu_config(void);

/* Appends the JSON list of the entry points the engine resolved through us (a slot filled), for `status`. */
CSCU_HIDDEN size_t cscu_entries_json(char *out, size_t room);
/* Appends the JSON list of the names handed out unwrapped (the first 16), for `status`. */
CSCU_HIDDEN size_t cscu_unwrapped_json(char *out, size_t room);

/* --- the regions (device allocations routed through VMM) --------------------------------------------------- */
struct cscu_vmm;
/* Where a region came from (the capture report's `moved`, per kind). */
enum cscu_source { CSCU_FROM_ALLOC, CSCU_FROM_ASYNC, CSCU_FROM_ENGINE, CSCU_SOURCES };
struct cscu_region {
    CUdeviceptr address;
    size_t size;                /* mapped bytes (a multiple of the granularity) */
    size_t requested;           /* what cuMemAlloc asked for */
    CUcontext context;
    CUdevice device;
    CUmemGenericAllocationHandle handle;    /* 0 while released */
    char uuid[48];              /* GPU-xxxxxxxx-... */
    char name[96];              /* the device's name (cuDeviceGetName) */
    enum cscu_source source;
    struct cscu_vmm *vmm;       /* the engine's own allocation (engine_vmm.c), NULL for ours */
};

/* An allocation the engine made itself with cuMemCreate and mapped with cuMemMap (PyTorch's expandable segments,
 * vLLM's CuMemAllocator), as engine_vmm.c records it: what re-creates it at the same addresses (vmm_backing.c). */
#define CSCU_VMM_MAPS 4         /* mappings of one allocation recorded; more pins it to the checkpoint path */
#define CSCU_VMM_ACCESS 8       /* access descriptors (locations) recorded per mapping */
struct cscu_mapping {
    CUdeviceptr address;
    size_t size, offset;
    int mapped;                 /* backed by the allocation now (0 while released) */
    int accesses;
    CUmemAccessDesc access[CSCU_VMM_ACCESS];    /* the engine's cuMemSetAccess, one per location */
};
struct cscu_vmm {
    CUmemGenericAllocationHandle handle;    /* the value the engine holds (engine_vmm.c hands out its own) */
    CUmemGenericAllocationHandle real;      /* the driver's; 0 while released */
    CUmemAllocationProp prop;
    unsigned long long flags;
    size_t size;
    CUcontext context;          /* a context on the allocation's device, for the copies */
    long refs;                  /* the engine's references: cuMemCreate and each retain, less each cuMemRelease */
    int pinned;                 /* CSCU_PINNED_*: why it stays on the checkpoint path for good (0: movable) */
    int tracked;                /* counted as vmm_by_engine now */
    size_t map_count;
    struct cscu_mapping maps[CSCU_VMM_MAPS];
};
#define CSCU_PINNED_EXPORTED 1  /* exported (another process may hold it) or bound to a multicast object */
#define CSCU_PINNED_MAPS 2      /* mapped more often than recorded, or accessed over part of a mapping */

/* What stayed on the CUDA checkpoint path, per kind (cumulative counts and bytes). */
enum cscu_kind {
    CSCU_SMALL, CSCU_FALLBACK, CSCU_PITCH, CSCU_MANAGED, CSCU_ASYNC, CSCU_HOST_REGISTERED, CSCU_HOST_ALLOC,
    CSCU_IPC_IMPORTED, CSCU_VMM_DIRECT, CSCU_UNWRAPPED_ENTRY, CSCU_IPC_EXPORTED, CSCU_KINDS
};
/* A live allocation of `kind` at `ptr` (stays on the checkpoint path), and its end (any kind it was). */
CSCU_HIDDEN void cscu_track(enum cscu_kind kind, uintptr_t ptr, size_t bytes);
CSCU_HIDDEN void cscu_untrack(uintptr_t ptr);
/* The whole allocation `p` lies in, as the driver knows it: its base (`size` 0) or its bytes (1). */
CSCU_HIDDEN uintptr_t cscu_allocation(CUdeviceptr p, int size);
/* A resolution that could not be wrapped (counted, never tracked). */
CSCU_HIDDEN void cscu_count(enum cscu_kind kind);
/* Appends the counts as a JSON object to `out` (at most `room` bytes); the number of bytes written. */
CSCU_HIDDEN size_t cscu_counts_json(char *out, size_t room);

/* What the first allocation taken starts (the control socket: control.c registers it at load, so that the
 * regions never call up into the socket that drives them): 0 when running, nonzero to leave allocations to the
 * real cuMemAlloc. Without a registered hook no allocation is taken. */
CSCU_HIDDEN void cscu_regions_on_start(int (*start)(void));

/* cuMemAlloc / cuMemFree through VMM. cscu_alloc returns CUDA_ERROR_NOT_FOUND when the allocation is not
 * ours to take (`*why`: CSCU_SMALL under the threshold, CSCU_FALLBACK when inert, without a control socket or
 * when the driver refused a VMM step other than for memory): the caller then uses the real cuMemAlloc. */
CSCU_HIDDEN CUresult cscu_alloc(CUdeviceptr *out, size_t size, enum cscu_kind *why, enum cscu_source source);
/* CUDA_ERROR_NOT_FOUND when `ptr` is no region of ours (cuMemAlloc's or cuMemAllocAsync's). cscu_free waits for
 * the context's work first (as cuMemFree does); cscu_discard does not (the caller knows the work is done). */
CSCU_HIDDEN CUresult cscu_free(CUdeviceptr ptr);
CSCU_HIDDEN CUresult cscu_discard(CUdeviceptr ptr);
/* A copy of the region of ours (not the engine's) starting at `ptr`: 0, or -1 when there is none. */
CSCU_HIDDEN int cscu_region_of(CUdeviceptr ptr, struct cscu_region *out);
/* The allocation granularity learnt for `dev` (0: none yet). */
CSCU_HIDDEN size_t cscu_granularity(CUdevice dev);
/* 0 when the control socket runs (started now if needed): allocations may become regions. */
CSCU_HIDDEN int cscu_regions_start(void);
/* Appends `r` to the table, which the caller holds locked: 0, or -1 out of host memory. */
CSCU_HIDDEN int cscu_regions_append(const struct cscu_region *r);
/* Removes entry `i` of the table, which the caller holds locked (the last entry takes its place). */
CSCU_HIDDEN void cscu_regions_remove(size_t i);
/* Appends per source the regions' count and bytes as a JSON object (the report's `moved`); the caller holds the
 * table. */
CSCU_HIDDEN size_t cscu_moved_json(char *out, size_t room);

/* --- the engine's own VMM allocations (engine_vmm.c; vmm_backing.c re-creates them) ------------------------ */
typedef CUresult (*cscu_create_fn)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                   unsigned long long);
typedef CUresult (*cscu_release_fn)(CUmemGenericAllocationHandle);
typedef CUresult (*cscu_map_fn)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*cscu_unmap_fn)(CUdeviceptr, size_t);
typedef CUresult (*cscu_access_fn)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
typedef CUresult (*cscu_retain_fn)(CUmemGenericAllocationHandle *, void *);
typedef CUresult (*cscu_props_fn)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
typedef CUresult (*cscu_export_fn)(void *, CUmemGenericAllocationHandle, unsigned int, unsigned long long);
typedef CUresult (*cscu_bind_fn)(CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle, size_t, size_t,
                                 unsigned long long);
/* The wrappers' work: each calls `real` with the driver's handle for the engine's, and keeps the records. */
CSCU_HIDDEN CUresult cscu_vmm_create(cscu_create_fn real, CUmemGenericAllocationHandle *h, size_t n,
                                     const CUmemAllocationProp *prop, unsigned long long flags);
CSCU_HIDDEN CUresult cscu_vmm_release(cscu_release_fn real, CUmemGenericAllocationHandle h);
CSCU_HIDDEN CUresult cscu_vmm_map(cscu_map_fn real, CUdeviceptr p, size_t n, size_t offset,
                                  CUmemGenericAllocationHandle h, unsigned long long flags);
CSCU_HIDDEN CUresult cscu_vmm_unmap(cscu_unmap_fn real, CUdeviceptr p, size_t n);
CSCU_HIDDEN CUresult cscu_vmm_set_access(cscu_access_fn real, CUdeviceptr p, size_t n, const CUmemAccessDesc *desc,
                                         size_t count);
CSCU_HIDDEN CUresult cscu_vmm_retain(cscu_retain_fn real, CUmemGenericAllocationHandle *h, void *addr);
CSCU_HIDDEN CUresult cscu_vmm_properties(cscu_props_fn real, CUmemAllocationProp *prop,
                                         CUmemGenericAllocationHandle h);
CSCU_HIDDEN CUresult cscu_vmm_export(cscu_export_fn real, void *out, CUmemGenericAllocationHandle h, unsigned int type,
                                     unsigned long long flags);
/* cuMulticastBindMem: the allocation bound to a multicast object (another device's writes land in it) stays. */
CSCU_HIDDEN CUresult cscu_vmm_bind(cscu_bind_fn real, CUmemGenericAllocationHandle mc, size_t mc_offset,
                                   CUmemGenericAllocationHandle h, size_t offset, size_t n, unsigned long long flags);
/* An engine region's backing: re-created (the engine's properties, every mapping, its access) or unmapped and
 * released (the reservations stay); on failure nothing is left half-done. */
CSCU_HIDDEN CUresult cscu_vmm_back(struct cscu_region *r);
CSCU_HIDDEN CUresult cscu_vmm_unback(struct cscu_region *r);
/* 1 when a node hydrator's staged allocation may stand in for region r (ours, or the engine's with one whole
 * mapping, read-write for its device only, and no property a staged allocation lacks: GPUDirect RDMA included,
 * which no imported allocation has in the importing process). Otherwise a stage is copied from (hydrate.c). */
CSCU_HIDDEN int cscu_vmm_stageable(const struct cscu_region *r);
/* Region r's allocation now lives on r's device, backed by `handle` (re-created or adopted): the record follows
 * (its device, and the access it recorded for the old device, so that the next hydration gives it again). */
CSCU_HIDDEN void cscu_vmm_backed(struct cscu_region *r, CUmemGenericAllocationHandle handle);

/* --- stream-ordered allocations (stream_ordered.c) --------------------------------------------------------- */
/* cuMemAllocAsync / cuMemAllocFromPoolAsync (pool NULL: the device's current pool) of the threshold or more as
 * a region; CUDA_ERROR_NOT_FOUND when the driver's own must serve it (`per_thread`: the _ptsz entry point). */
CSCU_HIDDEN CUresult cscu_async_alloc(int per_thread, CUdeviceptr *p, size_t n, CUmemoryPool pool, int from_pool,
                                      CUstream s);
/* cuMemFreeAsync of a region: released once the work queued on `s` before it is done. NOT_FOUND: not ours. */
CSCU_HIDDEN CUresult cscu_async_free(int per_thread, CUdeviceptr p, CUstream s);
/* A region freed otherwise (cuMemFree) is no longer waited for. */
CSCU_HIDDEN void cscu_async_forget(CUdeviceptr p);
/* Before a release: every deferred free waited for and done, the freed regions kept for reuse released. */
CSCU_HIDDEN void cscu_async_settle(void);

/* The properties of a pinned allocation on `dev` (exportable as a file descriptor unless configured off). */
CSCU_HIDDEN void cscu_device_prop(CUmemAllocationProp *prop, CUdevice dev);
/* The UUID (GPU-...) and name of device `dev`; 0, or -1 when the driver cannot say. */
CSCU_HIDDEN int cscu_device_identity(CUdevice dev, char uuid[48], char name[96]);
/* Forget what was learnt about the devices (a restore may have brought the process to other GPUs). */
CSCU_HIDDEN void cscu_devices_forget(void);
/* New physical memory mapped read-write at r->address (r->handle set); on failure nothing is left behind. */
CSCU_HIDDEN CUresult cscu_map(struct cscu_region *r);
/* Unmap and release r's backing (r->handle = 0); the reservation stays. */
CSCU_HIDDEN CUresult cscu_unmap(struct cscu_region *r);

/* The region table, locked: a release or hydrate (one at a time, on its connection thread) holds it throughout. */
CSCU_HIDDEN void cscu_regions_lock(void);
CSCU_HIDDEN void cscu_regions_unlock(void);
/* 0 when the table is now locked by the caller, nonzero when another thread holds it (pthread_mutex_trylock). */
CSCU_HIDDEN int cscu_regions_trylock(void);
CSCU_HIDDEN struct cscu_region *cscu_regions(size_t *count);

/* --- the readiness gate ------------------------------------------------------------------------------------ */
/* Gated calls enter and leave; while the gate is closed `enter` waits. `close` waits for the calls inside, at
 * most the configured drain time: it returns 0 (closed, nothing inside), or the number of calls still inside
 * when it gave up, the gate open again (a synchronise waiting on work that does not end: nothing is released). */
CSCU_HIDDEN void cscu_gate_enter(void);
CSCU_HIDDEN void cscu_gate_leave(void);
CSCU_HIDDEN long cscu_gate_close(void);
CSCU_HIDDEN void cscu_gate_open(void);
CSCU_HIDDEN int cscu_gate_is_open(void);
/* The calling thread never waits at the gate (the control socket's threads and the copy threads: a driver that
 * reaches one of our gated names from inside the release's or the hydration's own calls must not wait for their
 * end). */
CSCU_HIDDEN void cscu_gate_exempt(void);

/* --- the dump (release) and fill (hydrate) ------------------------------------------------------------------ */
/* Each writes a JSON answer (`{"ok":...}`) into `out`; `dir` is the dump directory, `policy` "same-model" or
 * "same-gpu"; `digests`: 1 checks every segment's digest while filling, 0 only the sampled read-back (the
 * worker's choice when the files are provably the ones written at release). They expect the region table
 * locked and the gate closed. */
CSCU_HIDDEN void cscu_release(const char *dir, char *out, size_t room);
CSCU_HIDDEN void cscu_hydrate(const char *dir, const char *policy, int digests, char *out, size_t room);
/* Hydrate from the allocations a node hydrator filled (`fds`, `n` of them, exported as POSIX descriptors): one per
 * released region (table order), each adoptable, is imported and mapped whole at its region; one per group of
 * them (hydrate.c's stage_groups) is copied from, each region re-created as a fill would; then the sampled
 * read-back against the dump in `dir`. The descriptors stay the caller's; one copied from is closed once imported
 * and set to -1 (its allocation is then freed as soon as its copies are done). */
CSCU_HIDDEN void cscu_hydrate_staged(const char *dir, const char *policy, int *fds, size_t n, char *out,
                                     size_t room);

/* --- digests: SHA-256 (libcrypto when present, our own otherwise) ------------------------------------------- */
typedef struct { uint32_t h[8]; uint64_t length; unsigned char block[64]; size_t used; void *ossl; } cscu_sha256;
CSCU_HIDDEN void cscu_sha256_init(cscu_sha256 *ctx);
CSCU_HIDDEN void cscu_sha256_update(cscu_sha256 *ctx, const void *data, size_t size);
CSCU_HIDDEN void cscu_sha256_final(cscu_sha256 *ctx, unsigned char out[32]);
/* "libcrypto" or "builtin". */
CSCU_HIDDEN const char *cscu_sha256_engine(void);


#endif

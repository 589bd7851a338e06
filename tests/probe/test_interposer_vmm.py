"""Issue 36 item 1 without a GPU: what the interposer asks of the driver for the engine's own VMM allocations and for
stream-ordered ones. A stand-in `libcuda.so.1` records each call (which handle reached cuMemMap, which handles are
still referenced, which mappings hold which access) and a harness compiled with the interposer's sources plays the
engine: PyTorch's expandable segments (one 2 MiB handle per page of one reservation, cuMemSetAccess over several
pages at once), a retain by address, a release and a hydration of the backing as a release and a hydration do them,
an export, a partial access, and a cudaMallocAsync engine (a free deferred to its stream's event, reuse, a capture,
another pool). Then the review's findings: a stale handle of ours (released twice) is refused and never reaches the
driver (#11); a release whose unmap and undo both fail leaves the mapping it never unmapped (#13); RDMA-capable
engine pages are not adopted from a stage but re-created as the engine made them and copied from one staged
allocation per group of pages; the sampled read-back on several threads names the segment that differs.
tests/probe/test_interposer_gpu_allocators.py does it on the real driver with torch."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from coldsnap_probe.hydration._interposer import SOURCES
from tests.probe.interposer_harness import UNITY

STANDIN = r"""
#include <stdlib.h>
#include <string.h>
typedef unsigned long long H, P;
struct handle { H id; long refs; size_t size; int alive, type, handle_types, location_type, location_id; };
struct mapping { P address; size_t size; H handle; int live, flags, device; };
struct handle handles[256];
struct mapping mappings[256];
int handle_count, mapping_count, freed, set_access_calls, events_done, capturing, custom_pool;
int async_by_driver, async_freed_by_driver, unmapped;
H last_mapped, last_props, last_exported;
static struct handle *find(H id)
{
    for (int i = 0; i < handle_count; i++)
        if (handles[i].id == id && handles[i].alive)
            return &handles[i];
    return 0;
}
static void unref(struct handle *h) { if (--h->refs == 0) { h->alive = 0; freed++; } }
int cuCtxGetCurrent(void **c) { *c = (void *)0x1000; return 0; }
int cuCtxSetCurrent(void *c) { (void)c; return 0; }
int cuCtxGetDevice(int *d) { *d = 0; return 0; }
int cuCtxSynchronize(void) { return 0; }
int cuDeviceGetUuid_v2(unsigned char *u, int d) { (void)d; memset(u, 0x11, 16); return 0; }
int cuDeviceGetName(char *n, int len, int d) { (void)d; strncpy(n, "stand-in", (size_t)len); return 0; }
int cuGetErrorName(int rc, const char **s) { *s = rc ? "CUDA_ERROR_STANDIN" : "CUDA_SUCCESS"; return 0; }
int cuMemAlloc_v2(P *p, size_t n) { static P next = 0x500000000000ULL; *p = next; next += n; return 0; }
int cuMemFree_v2(P p) { (void)p; return 0; }
int cuMemGetAddressRange_v2(P *b, size_t *s, P p) { (void)b; (void)s; (void)p; return 0; }
int cuMemGetAllocationGranularity(size_t *g, const void *p, int f) { (void)p; (void)f; *g = 2 << 20; return 0; }
int cuMemAddressReserve(P *p, size_t n, size_t a, P at, unsigned long long f)
{
    static P next = 0x600000000000ULL;
    (void)a; (void)at; (void)f;
    *p = next;
    next += n + (1ULL << 30);
    return 0;
}
int cuMemAddressFree(P p, size_t n) { (void)p; (void)n; return 0; }
int cuMemCreate(H *h, size_t n, const int *prop, unsigned long long f)
{
    struct handle *x = &handles[handle_count++];
    (void)f;
    *x = (struct handle){0x7f1000ULL + 16ULL * (H)handle_count, 1, n, 1, prop[0], prop[1], prop[2], prop[3]};
    *h = x->id;
    return 0;
}
H last_released;
P fail_map_at, fail_unmap_at;  /* the next cuMemMap / cuMemUnmap at this address fails, once */
int cuMemRelease(H h) { struct handle *x = find(h); last_released = h; if (!x) return 1; unref(x); return 0; }
int cuMemMap(P p, size_t n, size_t off, H h, unsigned long long f)
{
    struct handle *x = find(h);
    (void)off; (void)f;
    last_mapped = h;  /* whatever reached the driver */
    if (p == fail_map_at) {
        fail_map_at = 0;
        return 1;
    }
    if (!x)
        return 1;
    x->refs++;
    mappings[mapping_count++] = (struct mapping){p, n, h, 1, 0, -1};
    return 0;
}
int live_at(P p)
{
    for (int i = 0; i < mapping_count; i++)
        if (mappings[i].live && mappings[i].address == p)
            return 1;
    return 0;
}
int cuMemImportFromShareableHandle(H *h, void *fd, int type)
{
    struct handle *x = &handles[handle_count++];
    (void)fd; (void)type;
    *x = (struct handle){0x7f1000ULL + 16ULL * (H)handle_count, 1, 2 << 20, 1, 1, 1, 1, 0};
    *h = x->id;
    return 0;
}
int dtod_calls;
size_t dtod_bytes;
int cuMemcpyDtoD_v2(P d, P s, size_t n) { (void)d; (void)s; dtod_calls++; dtod_bytes += n; return 0; }
int memset_calls;
size_t memset_bytes;
int cuMemsetD8_v2(P d, unsigned char c, size_t n) { (void)d; memset_calls += c == 0; memset_bytes += n; return 0; }
int cuMemUnmap(P p, size_t n)
{
    if (p == fail_unmap_at) {
        fail_unmap_at = 0;
        return 1;
    }
    for (int i = 0; i < mapping_count; i++)
        if (mappings[i].live && mappings[i].address >= p && mappings[i].address < p + n) {
            mappings[i].live = 0;
            unmapped++;
            unref(find(mappings[i].handle));
        }
    return 0;
}
int cuMemSetAccess(P p, size_t n, const int *desc, size_t count)
{
    (void)count;
    set_access_calls++;
    for (int i = 0; i < mapping_count; i++)
        if (mappings[i].live && mappings[i].address >= p && mappings[i].address < p + n)
            mappings[i].device = desc[1], mappings[i].flags = desc[2];
    return 0;
}
int cuMemRetainAllocationHandle(H *h, void *addr)
{
    P a = (P)addr;
    for (int i = 0; i < mapping_count; i++)
        if (mappings[i].live && a >= mappings[i].address && a < mappings[i].address + mappings[i].size) {
            find(mappings[i].handle)->refs++;
            *h = mappings[i].handle;
            return 0;
        }
    return 1;
}
int cuMemGetAllocationPropertiesFromHandle(int *prop, H h)
{
    struct handle *x = find(h);
    last_props = h;
    if (!x)
        return 1;
    prop[0] = x->type, prop[1] = x->handle_types, prop[2] = x->location_type, prop[3] = x->location_id;
    return 0;
}
int cuMemExportToShareableHandle(void *out, H h, unsigned t, unsigned long long f)
{
    (void)t; (void)f;
    last_exported = h;
    *(int *)out = 99;
    return find(h) ? 0 : 1;
}
H last_bound;
int cuMulticastBindMem(H mc, size_t mo, H h, size_t o, size_t n, unsigned long long f)
{
    (void)mc; (void)mo; (void)o; (void)n; (void)f;
    last_bound = h;
    return find(h) ? 0 : 1;
}
int cuStreamCreate(void **s, unsigned f) { (void)f; *s = (void *)0x2000; return 0; }
int cuStreamDestroy_v2(void *s) { (void)s; return 0; }
int cuStreamSynchronize(void *s) { (void)s; return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned f) { (void)f; *p = malloc(n); return 0; }
int cuMemFreeHost(void *p) { free(p); return 0; }
int device_byte;  /* what every device-to-host copy reads */
int dtoh_async;
int cuMemcpyDtoHAsync_v2(void *d, P s, size_t n, void *st) { (void)s; (void)st; dtoh_async++; memset(d, device_byte, n);
    return 0; }
int cuMemcpyHtoDAsync_v2(P d, const void *s, size_t n, void *st) { (void)d; (void)s; (void)n; (void)st; return 0; }
int cuMemcpyDtoH_v2(void *d, P s, size_t n) { (void)s; memset(d, device_byte, n); return 0; }
int cuEventCreate(void **e, unsigned f) { static long n; (void)f; *e = (void *)(0x3000L + ++n); return 0; }
int cuEventRecord(void *e, void *s) { (void)e; (void)s; return 0; }
int cuEventRecord_ptsz(void *e, void *s) { (void)e; (void)s; return 0; }
int cuEventQuery(void *e) { (void)e; return events_done ? 0 : 600; }
int cuEventSynchronize(void *e) { (void)e; return 0; }
int cuEventDestroy_v2(void *e) { (void)e; return 0; }
int cuStreamIsCapturing(void *s, int *status) { (void)s; *status = capturing; return 0; }
int cuStreamIsCapturing_ptsz(void *s, int *status) { (void)s; *status = capturing; return 0; }
int cuStreamGetCtx(void *s, void **c) { (void)s; *c = (void *)0x1000; return 0; }
int cuStreamGetCtx_ptsz(void *s, void **c) { (void)s; *c = (void *)0x1000; return 0; }
int cuDeviceGetDefaultMemPool(void **p, int d) { (void)d; *p = (void *)0x4000; return 0; }
int cuDeviceGetMemPool(void **p, int d) { (void)d; *p = custom_pool ? (void *)0x4444 : (void *)0x4000; return 0; }
int cuMemAllocAsync(P *p, size_t n, void *s) { static P next = 0x900000000000ULL; (void)s; *p = next; next += n;
    async_by_driver++; return 0; }
int cuMemFreeAsync(P p, void *s) { (void)p; (void)s; async_freed_by_driver++; return 0; }
"""

HARNESS = UNITY + r"""

#define MIB ((size_t)1 << 20)
#define CHECK(name, expr) printf("%s %s\n", (expr) ? "ok" : "FAIL", name)
static void *standin;
static int *v(const char *name) { return (int *)dlsym(standin, name); }
static unsigned long long *u(const char *name) { return (unsigned long long *)dlsym(standin, name); }

static size_t from(enum cscu_source source, size_t *bytes)
{
    size_t count, n = 0;
    struct cscu_region *r = cscu_regions(&count);
    *bytes = 0;
    for (size_t i = 0; i < count; i++)
        if (r[i].source == source)
            n++, *bytes += r[i].size;
    return n;
}

static void release_and_hydrate(void)  /* what a release and a hydration do to every region's backing */
{
    size_t count;
    struct cscu_region *r = cscu_regions(&count);
    for (size_t i = 0; i < count; i++)
        cscu_unmap(&r[i]);
    CHECK("released: every region's backing gone", r[0].handle == 0 && r[count - 1].handle == 0);
    for (size_t i = 0; i < count; i++)
        cscu_map(&r[i]);
}

static void expandable(void)
{
    CUmemAllocationProp prop = {0};
    CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle h[3], again, real0;
    CUdeviceptr base;
    size_t bytes;
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED, prop.requestedHandleTypes = 1;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE, prop.location.id = 0;
    cuMemAddressReserve_standin(&base);
    for (int i = 0; i < 3; i++)
        cuMemCreate(&h[i], 2 * MIB, &prop, 0);
    CHECK("create: the engine holds our handles", (h[0] >> 48) == 0xc5c5 && h[1] != h[0]);
    for (int i = 0; i < 3; i++)
        cuMemMap(base + (size_t)i * 2 * MIB, 2 * MIB, 0, h[i], 0);
    CHECK("map: the driver got its own handle", (*u("last_mapped") >> 48) == 0 && *u("last_mapped") != 0);
    CHECK("not a region before its access is set", from(CSCU_FROM_ENGINE, &bytes) == 0);
    cuMemSetAccess(base, 6 * MIB, &rw, 1);  /* one call over three pages, as expandable segments do */
    CHECK("set access over three pages: three regions", from(CSCU_FROM_ENGINE, &bytes) == 3 && bytes == 6 * MIB);
    CHECK("retain by an address inside a page", cuMemRetainAllocationHandle(&again, (void *)(base + 2 * MIB + 64))
          == CUDA_SUCCESS && again == h[1]);
    cuMemRelease(again);
    real0 = records[0]->handle == h[0] ? records[0]->real : 0;
    release_and_hydrate();
    CHECK("released: the driver freed all three", *v("freed") == 3);
    CHECK("hydrated: new driver handles, the same engine handles", records[0]->real && records[0]->real != real0
          && records[0]->handle == h[0]);
    CHECK("hydrated: mapped at the same addresses with the engine's access",
          *v("mapping_count") == 6 && *v("set_access_calls") == 4);
    CUmemAllocationProp seen = {0};
    CHECK("properties of the engine's handle from the new driver handle",
          cuMemGetAllocationPropertiesFromHandle(&seen, h[2]) == CUDA_SUCCESS && *u("last_props") == records[2]->real
          && seen.requestedHandleTypes == 1 && seen.location.type == CU_MEM_LOCATION_TYPE_DEVICE);
    cuMemUnmap(base, 2 * MIB);  /* expandable segments give a page back: unmap, then release */
    CHECK("unmapped page: no longer a region", from(CSCU_FROM_ENGINE, &bytes) == 2);
    CHECK("release of the engine's handle", cuMemRelease(h[0]) == CUDA_SUCCESS && *v("freed") == 4);
    CHECK("a second release is refused", cuMemRelease(h[0]) != CUDA_SUCCESS);
    int fd = 0;
    cuMemExportToShareableHandle(&fd, h[2], 1, 0);
    CHECK("exported: the driver's handle, and it stays on the checkpoint path",
          fd == 99 && (*u("last_exported") >> 48) == 0 && from(CSCU_FROM_ENGINE, &bytes) == 1);
    cuMulticastBindMem(0x77, 0, h[1], 0, 2 * MIB, 0);
    CHECK("bound to a multicast object: the driver's handle, and it stays",
          (*u("last_bound") >> 48) == 0 && *u("last_bound") != 0 && from(CSCU_FROM_ENGINE, &bytes) == 0);
    CUmemAccessDesc peer = {{CU_MEM_LOCATION_TYPE_DEVICE, 1}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    cuMemCreate(&h[0], 2 * MIB, &prop, 0);
    cuMemMap(base + 6 * MIB, 2 * MIB, 0, h[0], 0);
    cuMemSetAccess(base + 6 * MIB, 2 * MIB, &rw, 1);
    CHECK("a fourth page: a region", from(CSCU_FROM_ENGINE, &bytes) == 1);
    cuMemSetAccess(base + 6 * MIB, MIB, &peer, 1);  /* half of a page */
    CHECK("access over part of a mapping pins it", from(CSCU_FROM_ENGINE, &bytes) == 0);
    prop.location.type = 2;  /* host memory: not ours to move */
    cuMemCreate(&again, 4 * MIB, &prop, 0);
    CHECK("host memory keeps the driver's handle", (again >> 48) == 0);
}

static void stream_ordered(void)
{
    CUdeviceptr p, q, r, c;
    size_t bytes;
    int *done = v("events_done"), *capturing = v("capturing"), *pool = v("custom_pool");
    cuMemAllocAsync(&p, 8 * MIB, 0);
    CHECK("cudaMallocAsync of 8 MiB: a region", from(CSCU_FROM_ASYNC, &bytes) == 1 && *v("async_by_driver") == 0);
    cuMemFreeAsync(p, 0);
    CHECK("freed on a stream: kept until its event completes", from(CSCU_FROM_ASYNC, &bytes) == 1
          && *v("async_freed_by_driver") == 0);
    cuMemAllocAsync(&q, 8 * MIB, 0);
    CHECK("its event pending: not reused", q != p && from(CSCU_FROM_ASYNC, &bytes) == 2);
    *done = 1;
    cuMemAllocAsync(&r, 8 * MIB, 0);
    CHECK("its event completed: reused", r == p && from(CSCU_FROM_ASYNC, &bytes) == 2);
    *capturing = 1;
    cuMemAllocAsync(&c, 8 * MIB, 0);
    CHECK("in a capture: the driver's (the graph owns it)", *v("async_by_driver") == 1);
    cuMemFreeAsync(c, 0);
    cuMemFreeAsync(q, 0);
    CHECK("a region freed in a capture is kept",
          *v("async_freed_by_driver") == 1 && from(CSCU_FROM_ASYNC, &bytes) == 2);
    *capturing = 0, *pool = 1;
    cuMemAllocAsync(&c, 8 * MIB, 0);
    CHECK("another pool: the driver's", *v("async_by_driver") == 2);
    *pool = 0, *done = 0;
    int before = *v("unmapped");
    cuMemFreeAsync(r, 0);
    cscu_async_settle();  /* a release begins */
    CHECK("a release waits for the frees and lets every freed region go", *v("unmapped") == before + 1
          && from(CSCU_FROM_ASYNC, &bytes) == 1);
}

static CUdeviceptr reserved(size_t n)
{
    CUdeviceptr base = 0;
    ((CUresult (*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))dlsym(standin,
        "cuMemAddressReserve"))(&base, n, 0, 0, 0);
    return base;
}

static int mapped_at(CUdeviceptr p) { return ((int (*)(CUdeviceptr))dlsym(standin, "live_at"))(p); }

static struct cscu_region *region_of(CUmemGenericAllocationHandle h)
{
    size_t count;
    struct cscu_region *r = cscu_regions(&count);
    for (size_t i = 0; i < count; i++)
        if (r[i].vmm && r[i].vmm->handle == h)
            return &r[i];
    return NULL;
}

static CUmemGenericAllocationHandle engine_page(CUdeviceptr at, int rdma)  /* created, mapped, read-write */
{
    CUmemAllocationProp prop = {0};
    CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle h;
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED, prop.requestedHandleTypes = 1;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE, prop.allocFlags.gpuDirectRDMACapable = (unsigned char)rdma;
    cuMemCreate(&h, 2 * MIB, &prop, 0);
    cuMemMap(at, 2 * MIB, 0, h, 0);
    cuMemSetAccess(at, 2 * MIB, &rw, 1);
    return h;
}

static void stale_handles(void)  /* review finding 11 */
{
    CUdeviceptr base = reserved(8 * MIB);
    CUmemGenericAllocationHandle h = engine_page(base, 0);
    CUmemAllocationProp seen;
    int fd = -1;
    cuMemUnmap(base, 2 * MIB);
    CHECK("unmapped and released: the record is gone", cuMemRelease(h) == CUDA_SUCCESS && !region_of(h));
    *u("last_released") = *u("last_mapped") = *u("last_props") = *u("last_exported") = *u("last_bound") = 0;
    CHECK("a stale handle of ours: release refused, the driver never sees it",
          cuMemRelease(h) == CUDA_ERROR_INVALID_VALUE && *u("last_released") == 0);
    CHECK("a stale handle of ours: map refused, the driver never sees it",
          cuMemMap(base, 2 * MIB, 0, h, 0) == CUDA_ERROR_INVALID_VALUE && *u("last_mapped") == 0);
    CHECK("a stale handle of ours: properties refused, the driver never sees it",
          cuMemGetAllocationPropertiesFromHandle(&seen, h) == CUDA_ERROR_INVALID_VALUE && *u("last_props") == 0);
    CHECK("a stale handle of ours: export and bind refused, the driver never sees them",
          cuMemExportToShareableHandle(&fd, h, 1, 0) == CUDA_ERROR_INVALID_VALUE && *u("last_exported") == 0
          && cuMulticastBindMem(0x77, 0, h, 0, 2 * MIB, 0) == CUDA_ERROR_INVALID_VALUE && *u("last_bound") == 0);
}

static void unback_undoes_only_its_own(void)  /* review finding 13 */
{
    CUdeviceptr base = reserved(16 * MIB);
    CUmemAccessDesc rw = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle h = engine_page(base, 0);
    cuMemMap(base + 8 * MIB, 2 * MIB, 0, h, 0);  /* the same allocation mapped a second time */
    cuMemSetAccess(base + 8 * MIB, 2 * MIB, &rw, 1);
    struct cscu_region *r = region_of(h);
    *u("fail_unmap_at") = base + 8 * MIB;  /* the release's unmap fails at the second mapping, */
    *u("fail_map_at") = base;              /* and mapping the first back fails too */
    CHECK("an unback whose undo fails keeps the mapping it never unmapped",
          r && cscu_unmap(r) != CUDA_SUCCESS && mapped_at(base + 8 * MIB) && r->vmm->real != 0);
}

static void staged_copy(void)  /* RDMA-capable engine pages: re-created as made, copied from a grouped stage */
{
    CUdeviceptr base = reserved(8 * MIB);
    CUmemGenericAllocationHandle h[3];
    struct cscu_region *r[3];
    struct hydration hy;
    char why[256] = "";
    int imported = open("/dev/null", O_RDONLY);  /* stands for the staged allocation's descriptor */
    for (int k = 0; k < 3; k++)
        h[k] = engine_page(base + (size_t)k * 2 * MIB, 1);
    for (int k = 0; k < 3; k++)
        cscu_unmap(r[k] = region_of(h[k]));
    CHECK("an RDMA-capable engine page is not adoptable: three staged for three pages are refused",
          !cscu_vmm_stageable(r[0]) && stage_mode(3, why, sizeof(why)) == 0 && strstr(why, "adoptable: no"));
    CHECK("one staged allocation for the three pages (one group): copied from", stage_mode(1, why, sizeof(why)) == 2);
    memset(&hy, 0, sizeof(hy));
    hy.regions = cscu_regions(&hy.count);
    hy.created = calloc(hy.count + 1, 1);
    static struct segment pages[3];  /* the release's record: one segment a page, the middle one all zeros */
    for (int k = 0; k < 3; k++)
        pages[k] = (struct segment){.region = (size_t)(r[k] - hy.regions), .size = 2 * MIB, .zero = k == 1};
    cscu_segments = pages, cscu_segment_count = 3;
    *v("dtod_calls") = *v("memset_calls") = 0;
    int freed = *v("freed");
    CHECK("each page re-created with the engine's handle kept and copied from the stage on the device",
          copy_all(&hy, &imported, 1) == 0 && *v("dtod_calls") == 2 && *u("dtod_bytes") == 4 * MIB
          && r[0]->handle && r[2]->handle && r[1]->vmm->real == r[1]->handle && r[1]->vmm->handle == h[1]
          && mapped_at(base) && mapped_at(base + 4 * MIB) && hy.restored == 3);
    CHECK("the page of zeros set on the device, not copied; the report's bytes say so",
          *v("memset_calls") == 1 && *u("memset_bytes") == 2 * MIB && hy.moved[0] == 2 * MIB
          && hy.moved[2] == 4 * MIB);
    cscu_segments = NULL, cscu_segment_count = 0;
    CHECK("the staged allocation let go once copied, its descriptor closed",
          *v("freed") == freed + 1 && imported == -1);
    CUmemAllocationProp seen;
    memset(&seen, 0, sizeof(seen));
    CHECK("a page's properties are the engine's, checked by the driver on the page's new handle",
          cuMemGetAllocationPropertiesFromHandle(&seen, h[1]) == CUDA_SUCCESS && *u("last_props") == r[1]->handle
          && seen.allocFlags.gpuDirectRDMACapable == 1 && seen.requestedHandleTypes == 1);
    free(hy.created);
}

static void sampled_read_back(void)  /* many small segments (an engine's pages), read back by several threads */
{
    enum { SEGMENTS = 40 };
    static struct segment segments[SEGMENTS];
    int fds[SEGMENTS];
    char take[SEGMENTS], error[512] = "", *page = malloc(128 << 10);
    memset(page, 0x5a, 128 << 10);
    for (int i = 0; i < SEGMENTS; i++) {
        FILE *f = tmpfile();
        fwrite(page, 1, 128 << 10, f);
        fflush(f);
        fds[i] = dup(fileno(f));  /* the FILE's own descriptor goes with it at exit */
        take[i] = 1;
        segments[i] = (struct segment){.region = 0, .offset = 0, .size = 128 << 10};
        snprintf(segments[i].file, sizeof(segments[i].file), "seg-%d.bin", i);
    }
    cscu_segments = segments, cscu_segment_count = SEGMENTS;
    *v("device_byte") = 0x5a;
    CHECK("every segment's samples equal the device's, read on the threads' own streams",
          verify_samples(fds, take, error, sizeof(error)) == 0 && *v("dtoh_async") == 2 * SEGMENTS);
    memset(page, 0, 64 << 10);
    pwrite(fds[37], page, 64 << 10, 64 << 10);
    CHECK("one segment's last sample differs: refused naming it and where",
          verify_samples(fds, take, error, sizeof(error)) == -1 && strstr(error, "seg-37.bin at +65536") != NULL);
    cscu_segments = NULL, cscu_segment_count = 0;
    free(page);
}

int main(void)
{
    standin = dlopen("libcuda.so.1", RTLD_NOW);
    if (!standin || !cscu_driver())
        return 2;
    expandable();
    stream_ordered();
    stale_handles();
    unback_undoes_only_its_own();
    staged_copy();
    sampled_read_back();
    return 0;
}
"""


def test_engine_vmm_and_stream_ordered_allocations_against_a_recording_driver(tmp_path: Path) -> None:
    (tmp_path / "standin.c").write_text(STANDIN)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wl,-Bsymbolic", "-o", str(tmp_path / "libcuda.so.1"),
                    str(tmp_path / "standin.c")], check=True, capture_output=True)
    # The harness reserves through the stand-in directly (the engine's cuMemAddressReserve is not wrapped).
    harness = HARNESS.replace("cuMemAddressReserve_standin(&base);",
                              "((CUresult (*)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))"
                              "dlsym(standin, \"cuMemAddressReserve\"))(&base, 64 * MIB, 0, 0, 0);")
    (tmp_path / "vmm.c").write_text(harness)
    built = subprocess.run(["gcc", "-O1", "-std=gnu11", "-Wall", "-Wextra", "-I", str(SOURCES), "-o",
                            str(tmp_path / "vmm"), str(tmp_path / "vmm.c"), "-ldl", "-lpthread"],
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    done = subprocess.run([str(tmp_path / "vmm")], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path),
                               "COLDSNAP_CUDA_INTERPOSER_SOCKET": str(tmp_path / "cuda.sock")})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line for line in lines if not line.startswith("ok ")] == [], done.stdout
    assert len(lines) == 27 + 13, done.stdout

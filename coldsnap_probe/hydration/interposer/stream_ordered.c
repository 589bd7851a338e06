/* Stream-ordered allocations (cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemFreeAsync: PyTorch's
 * `backend:cudaMallocAsync`) moved at line rate: one of the threshold or more, on a stream that is not capturing a
 * graph, from the device's default pool, becomes a region (regions.c's, source stream_ordered) at once, which is
 * valid for every stream from then on (more than stream order promises). Its cuMemFreeAsync must not release memory
 * that work already queued on the stream still uses: an event is recorded on the stream and the region is released
 * only once it completed (looked at by the next stream-ordered call, waited for when memory runs out or a release
 * begins). Completed frees are kept mapped for reuse by an allocation of the same size (as the driver's pool keeps
 * its memory), up to CACHED entries and CACHED_BYTES; a release lets them go first, so they are never dumped.
 *
 * Left to the driver (and counted as stream_ordered on the checkpoint path): below the threshold, in a capture (the
 * graph owns that memory), another pool (it may be exportable or shared with peers), a stream of another context.
 * A region freed inside a capture is kept for good (the graph frees it when it runs, which no event can follow).
 * Calls regions.c and the driver.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cscu.h"

#define CUDA_ERROR_NOT_READY 600
#define CU_EVENT_DISABLE_TIMING 2
#define CACHED 32
#define CACHED_BYTES ((size_t)4 << 30)

/* The driver entry points this file needs beyond cscu_driver's: [0] the legacy-stream one, [1] the per-thread. */
static struct {
    CUresult (*event_create)(CUevent *, unsigned int);
    CUresult (*event_record[2])(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_synchronize)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*is_capturing[2])(CUstream, int *);
    CUresult (*stream_ctx[2])(CUstream, CUcontext *);
    CUresult (*default_pool)(CUmemoryPool *, CUdevice);
    CUresult (*current_pool)(CUmemoryPool *, CUdevice);
} fn;
static int fn_ok;
static pthread_once_t fn_once = PTHREAD_ONCE_INIT;

static void fn_load(void)
{
    struct { void **place; const char *name; } need[] = {
        {(void **)&fn.event_create, "cuEventCreate"}, {(void **)&fn.event_record[0], "cuEventRecord"},
        {(void **)&fn.event_record[1], "cuEventRecord_ptsz"}, {(void **)&fn.event_query, "cuEventQuery"},
        {(void **)&fn.event_synchronize, "cuEventSynchronize"}, {(void **)&fn.event_destroy, "cuEventDestroy_v2"},
        {(void **)&fn.is_capturing[0], "cuStreamIsCapturing"}, {(void **)&fn.is_capturing[1], "cuStreamIsCapturing_ptsz"},
        {(void **)&fn.stream_ctx[0], "cuStreamGetCtx"}, {(void **)&fn.stream_ctx[1], "cuStreamGetCtx_ptsz"},
        {(void **)&fn.default_pool, "cuDeviceGetDefaultMemPool"}, {(void **)&fn.current_pool, "cuDeviceGetMemPool"},
    };
    for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++)
        if (!(*need[i].place = cscu_real(need[i].name)) && !strstr(need[i].name, "_ptsz"))
            return;  /* a per-thread variant may be missing: its callers then stay on the driver's path */
    fn_ok = cscu_driver() != NULL;
}

static int ready(void)
{
    if (!cscu_config()->socket[0])
        return 0;
    pthread_once(&fn_once, fn_load);
    return fn_ok;
}

/* A freed region: waiting for its event (event set), or done and kept for reuse (event NULL). */
struct freed { CUdeviceptr address; size_t size; CUcontext context; CUevent event; };
static pthread_mutex_t freed_lock = PTHREAD_MUTEX_INITIALIZER;  /* taken before the region table's, never after */
static struct freed *freed;
static size_t freed_count, freed_room;

static void freed_remove(size_t i)
{
    for (; i + 1 < freed_count; i++)  /* in order: the oldest kept region is the first let go */
        freed[i] = freed[i + 1];
    freed_count--;
}

static int capturing(int pt, CUstream s)
{
    int status = 1;
    return !fn.is_capturing[pt] || fn.is_capturing[pt](s, &status) != CUDA_SUCCESS
           || status != 0;  /* unsure (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT...): as if capturing */
}

/* The NULL, legacy and per-thread default streams (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) are the current
 * context's by definition. */
static int in_context(int pt, CUstream s, CUcontext current)
{
    CUcontext ctx = NULL;
    if ((uintptr_t)s <= 2)
        return 1;
    return fn.stream_ctx[pt] && fn.stream_ctx[pt](s, &ctx) == CUDA_SUCCESS && ctx == current;
}

/* 1 when an allocation on `s` from `pool` (from_pool) or the device's current pool may be a region: not in a
 * capture, the stream in the current context, the pool the device's default one. */
static int plain(int pt, CUstream s, CUmemoryPool pool, int from_pool)
{
    const struct cscu_driver *d = cscu_driver();
    CUcontext current = NULL;
    CUdevice dev;
    CUmemoryPool fallback = NULL, used = pool;
    if (!fn.event_record[pt] || capturing(pt, s) || d->ctx_get_current(&current) != CUDA_SUCCESS || !current
        || !in_context(pt, s, current) || d->ctx_get_device(&dev) != CUDA_SUCCESS
        || fn.default_pool(&fallback, dev) != CUDA_SUCCESS)
        return 0;
    if (!from_pool && fn.current_pool(&used, dev) != CUDA_SUCCESS)
        return 0;
    return used == fallback;
}

/* Every deferred free whose event completed becomes reusable (all of them waited for when `wait`); kept regions
 * beyond the caps (all of them when `wait`) are released. freed_lock is held. */
static void reap(int wait)
{
    size_t kept = 0, bytes = 0;
    for (size_t i = 0; i < freed_count; i++) {
        struct freed *f = &freed[i];
        CUresult rc = !f->event ? CUDA_SUCCESS : wait ? fn.event_synchronize(f->event) : fn.event_query(f->event);
        if (f->event && rc != CUDA_ERROR_NOT_READY) {
            fn.event_destroy(f->event);
            f->event = NULL;  /* an error is the context's (sticky): nothing runs on it any more either */
        }
    }
    for (size_t i = freed_count; i-- > 0;)
        if (!freed[i].event) {
            kept++;
            bytes += freed[i].size;
            if (wait || kept > CACHED || bytes > CACHED_BYTES) {
                cscu_discard(freed[i].address);
                freed_remove(i);
            }
        }
}

/* A kept region of exactly the size an allocation of `n` gets, in the current context: into *p. */
static int reuse(CUdeviceptr *p, size_t n)
{
    const struct cscu_driver *d = cscu_driver();
    CUcontext ctx = NULL;
    CUdevice dev;
    size_t g;
    if (d->ctx_get_current(&ctx) != CUDA_SUCCESS || d->ctx_get_device(&dev) != CUDA_SUCCESS
        || !(g = cscu_granularity(dev)))
        return -1;
    size_t size = (n + g - 1) / g * g;
    for (size_t i = freed_count; i-- > 0;)
        if (!freed[i].event && freed[i].size == size && freed[i].context == ctx) {
            *p = freed[i].address;
            freed_remove(i);
            return 0;
        }
    return -1;
}

CUresult cscu_async_alloc(int per_thread, CUdeviceptr *p, size_t n, CUmemoryPool pool, int from_pool, CUstream s)
{
    enum cscu_kind why;
    int pt = per_thread ? 1 : 0;
    if (!p || n < cscu_config()->threshold || !cscu_config()->stream_ordered || !ready()
        || !plain(pt, s, pool, from_pool))
        return CUDA_ERROR_NOT_FOUND;
    pthread_mutex_lock(&freed_lock);
    reap(0);
    CUresult rc = reuse(p, n) == 0 ? CUDA_SUCCESS : cscu_alloc(p, n, &why, CSCU_FROM_ASYNC);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY) {  /* what waits to be freed, and what is kept, first */
        reap(1);
        rc = cscu_alloc(p, n, &why, CSCU_FROM_ASYNC);
    }
    pthread_mutex_unlock(&freed_lock);
    return rc;
}

CUresult cscu_async_free(int per_thread, CUdeviceptr p, CUstream s)
{
    struct cscu_region r;
    CUevent event = NULL;
    int pt = per_thread ? 1 : 0;
    if (!ready() || cscu_region_of(p, &r) != 0)
        return CUDA_ERROR_NOT_FOUND;
    if (!fn.event_record[pt] || !fn.is_capturing[pt])  /* no per-thread entry points: as cuMemFree */
        return cscu_free(p);
    pthread_mutex_lock(&freed_lock);
    CUresult rc = CUDA_SUCCESS;
    for (size_t i = 0; i < freed_count; i++)
        if (freed[i].address == p)
            rc = CUDA_ERROR_INVALID_VALUE;  /* freed twice */
    if (rc == CUDA_SUCCESS && capturing(pt, s)) {
        fprintf(stderr, "coldsnap-cuda: region %#llx freed inside a stream capture: kept (the graph frees it)\n", p);
    } else if (rc == CUDA_SUCCESS) {
        if (freed_count == freed_room) {
            size_t room = freed_room ? freed_room * 2 : 64;
            struct freed *grown = realloc(freed, room * sizeof(*grown));
            freed = grown ? grown : freed;
            freed_room = grown ? room : freed_room;
        }
        if ((rc = fn.event_create(&event, CU_EVENT_DISABLE_TIMING)) == CUDA_SUCCESS
            && (rc = fn.event_record[pt](event, s)) == CUDA_SUCCESS && freed_count < freed_room)
            freed[freed_count++] = (struct freed){p, r.size, r.context, event};
        else if (event && rc == CUDA_SUCCESS)  /* no room to wait for it: wait now */
            rc = fn.event_synchronize(event) == CUDA_SUCCESS ? cscu_discard(p) : cscu_free(p);
        else
            rc = cscu_free(p);  /* no event: as cuMemFree, after the context's work */
        if (event && (freed_count == 0 || freed[freed_count - 1].event != event))
            fn.event_destroy(event);
    }
    pthread_mutex_unlock(&freed_lock);
    return rc;
}

void cscu_async_forget(CUdeviceptr p)
{
    if (!ready())
        return;
    pthread_mutex_lock(&freed_lock);
    for (size_t i = freed_count; i-- > 0;)
        if (freed[i].address == p) {
            if (freed[i].event)
                fn.event_destroy(freed[i].event);
            freed_remove(i);
        }
    pthread_mutex_unlock(&freed_lock);
}

void cscu_async_settle(void)
{
    if (!ready())
        return;
    pthread_mutex_lock(&freed_lock);
    reap(1);
    pthread_mutex_unlock(&freed_lock);
}

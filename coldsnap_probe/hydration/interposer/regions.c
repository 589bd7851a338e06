/* The regions: device allocations above the threshold, made with cuMemAddressReserve + cuMemCreate + cuMemMap
 * + cuMemSetAccess instead of cuMemAlloc (so their backing can be released and re-created at the same address);
 * the readiness gate; what stayed on the checkpoint path. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cscu.h"

/* --- the readiness gate --------------------------------------------------------------------------------------- */
/* A gated call counts itself in, then looks at the gate; a release closes the gate, then waits for the count to
 * drop to zero. Both are sequentially consistent, so either the call sees the gate closed (and waits outside) or
 * the release sees the call (and waits for it): no launch runs on released memory, and an open gate costs two
 * atomic operations per call. */
static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_changed = PTHREAD_COND_INITIALIZER;
static int gate_closed;     /* Invariant: 1 from a release's start until a hydrate succeeds (or a release fails) */
static long gate_inside;    /* gated calls counted in */
/* A gated call made inside another on the same thread (a library calling the driver's exported names from
 * within a driver call) passes: the outer call already holds the gate, and waiting would deadlock a release. */
static __thread int gate_depth;

static void count_out(void)
{
    if (__atomic_sub_fetch(&gate_inside, 1, __ATOMIC_SEQ_CST) == 0 && __atomic_load_n(&gate_closed, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&gate_lock);
        pthread_cond_broadcast(&gate_changed);
        pthread_mutex_unlock(&gate_lock);
    }
}

void cscu_gate_enter(void)
{
    if (!cscu_config()->socket[0] || gate_depth++ > 0)
        return;  /* inert (no socket): no gate; nested: counted by the outermost call */
    for (;;) {
        __atomic_add_fetch(&gate_inside, 1, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&gate_closed, __ATOMIC_SEQ_CST))
            return;
        count_out();  /* closed: step back out and wait for it to open */
        pthread_mutex_lock(&gate_lock);
        while (__atomic_load_n(&gate_closed, __ATOMIC_SEQ_CST))
            pthread_cond_wait(&gate_changed, &gate_lock);
        pthread_mutex_unlock(&gate_lock);
    }
}

void cscu_gate_exempt(void)
{
    gate_depth = 1;  /* as if inside a gated call for the thread's whole life: enter and leave only nest */
}

void cscu_gate_leave(void)
{
    if (!cscu_config()->socket[0] || --gate_depth > 0)
        return;
    count_out();
}

long cscu_gate_close(void)
{
    struct timespec deadline, give_up, now;
    long inside;
    clock_gettime(CLOCK_MONOTONIC, &give_up);
    give_up.tv_sec += cscu_config()->drain_s;
    pthread_mutex_lock(&gate_lock);
    __atomic_store_n(&gate_closed, 1, __ATOMIC_SEQ_CST);
    while ((inside = __atomic_load_n(&gate_inside, __ATOMIC_SEQ_CST)) > 0) {  /* a synchronise ends when its work does */
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > give_up.tv_sec || (now.tv_sec == give_up.tv_sec && now.tv_nsec >= give_up.tv_nsec)) {
            __atomic_store_n(&gate_closed, 0, __ATOMIC_SEQ_CST);  /* never a frozen engine for a refused release */
            pthread_cond_broadcast(&gate_changed);
            pthread_mutex_unlock(&gate_lock);
            return inside;
        }
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_nsec += 10 * 1000 * 1000;  /* and look again every 10 ms, whatever woke us */
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&gate_changed, &gate_lock, &deadline);
    }
    pthread_mutex_unlock(&gate_lock);
    return 0;
}

void cscu_gate_open(void)
{
    pthread_mutex_lock(&gate_lock);
    __atomic_store_n(&gate_closed, 0, __ATOMIC_SEQ_CST);
    pthread_cond_broadcast(&gate_changed);
    pthread_mutex_unlock(&gate_lock);
}

int cscu_gate_is_open(void)
{
    return !__atomic_load_n(&gate_closed, __ATOMIC_SEQ_CST);
}

/* --- what stayed on the checkpoint path ------------------------------------------------------------------------ */
static const char *kind_names[CSCU_KINDS] = {
    "below_threshold", "vmm_refused", "pitched", "managed", "stream_ordered", "host_registered", "host_pinned",
    "ipc_imported", "vmm_by_engine", "unwrapped_entry_points", "ipc_exported"};
struct tracked { uintptr_t ptr; size_t bytes; enum cscu_kind kind; };
static pthread_mutex_t track_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tracked *live;
static size_t live_count, live_room;
static unsigned long long kind_count[CSCU_KINDS], kind_bytes[CSCU_KINDS];

void cscu_count(enum cscu_kind kind)
{
    pthread_mutex_lock(&track_lock);
    kind_count[kind]++;
    pthread_mutex_unlock(&track_lock);
}

void cscu_track(enum cscu_kind kind, uintptr_t ptr, size_t bytes)
{
    if (!cscu_config()->socket[0])
        return;  /* inert: nobody asks */
    pthread_mutex_lock(&track_lock);
    for (size_t i = 0; i < live_count; i++)
        if (live[i].ptr == ptr && live[i].kind == kind) {  /* one allocation exported again: counted once */
            pthread_mutex_unlock(&track_lock);
            return;
        }
    if (live_count == live_room) {
        size_t room = live_room ? live_room * 2 : 256;
        struct tracked *grown = realloc(live, room * sizeof(*grown));
        if (!grown) {
            pthread_mutex_unlock(&track_lock);
            return;  /* the count is then low; the allocation itself succeeded */
        }
        live = grown;
        live_room = room;
    }
    live[live_count++] = (struct tracked){ptr, bytes, kind};
    kind_count[kind]++;
    kind_bytes[kind] += bytes;
    pthread_mutex_unlock(&track_lock);
}

uintptr_t cscu_allocation(CUdeviceptr p, int size)
{
    const struct cscu_driver *d = cscu_driver();
    CUdeviceptr base = p;
    size_t bytes = 0;
    if (!d || d->mem_get_address_range(&base, &bytes, p) != CUDA_SUCCESS)
        return size ? 0 : (uintptr_t)p;
    return size ? (uintptr_t)bytes : (uintptr_t)base;
}

void cscu_untrack(uintptr_t ptr)
{
    if (!cscu_config()->socket[0])
        return;
    pthread_mutex_lock(&track_lock);
    for (size_t i = live_count; i-- > 0;)
        if (live[i].ptr == ptr) {  /* every kind it was counted as (an allocation also exported) */
            kind_count[live[i].kind]--;
            kind_bytes[live[i].kind] -= live[i].bytes;
            live[i] = live[--live_count];
        }
    pthread_mutex_unlock(&track_lock);
}

size_t cscu_counts_json(char *out, size_t room)
{
    size_t used = 0;
    if (room < 2)
        return 0;
    pthread_mutex_lock(&track_lock);
    used += (size_t)snprintf(out + used, room - used, "{");
    for (int k = 0; k < CSCU_KINDS && used < room; k++)
        used += (size_t)snprintf(out + used, room - used, "%s\"%s\":{\"count\":%llu,\"bytes\":%llu}", k ? "," : "",
                                 kind_names[k], kind_count[k], kind_bytes[k]);
    if (used < room)
        used += (size_t)snprintf(out + used, room - used, "}");
    pthread_mutex_unlock(&track_lock);
    return used < room ? used : room - 1;
}

/* --- the region table ----------------------------------------------------------------------------------------- */
static pthread_mutex_t regions_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cscu_region *regions;
static size_t region_count, region_room;

void cscu_regions_lock(void) { pthread_mutex_lock(&regions_lock); }
void cscu_regions_unlock(void) { pthread_mutex_unlock(&regions_lock); }
int cscu_regions_trylock(void) { return pthread_mutex_trylock(&regions_lock); }

struct cscu_region *cscu_regions(size_t *count)
{
    *count = region_count;
    return regions;
}

#define MAX_DEVICES 64
static void format_uuid(const CUuuid *id, char out[48]);
static struct { size_t granularity; char uuid[48]; char name[96]; } devices[MAX_DEVICES];

static int describe(const struct cscu_driver *d, CUdevice dev, const CUmemAllocationProp *prop)
{
    if (dev < 0 || dev >= MAX_DEVICES)
        return -1;
    if (devices[dev].granularity)
        return 0;
    CUuuid id;
    size_t granularity = 0;
    if (d->granularity(&granularity, prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !granularity
        || d->device_get_uuid(&id, dev) != CUDA_SUCCESS
        || d->device_get_name(devices[dev].name, sizeof(devices[dev].name), dev) != CUDA_SUCCESS)
        return -1;
    format_uuid(&id, devices[dev].uuid);
    __atomic_store_n(&devices[dev].granularity, granularity, __ATOMIC_RELEASE);
    return 0;
}

static void format_uuid(const CUuuid *id, char out[48])
{
    const unsigned char *b = id->bytes;
    snprintf(out, 48, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

void cscu_devices_forget(void)
{
    for (int i = 0; i < MAX_DEVICES; i++)
        __atomic_store_n(&devices[i].granularity, 0, __ATOMIC_RELEASE);
}

int cscu_device_identity(CUdevice dev, char uuid[48], char name[96])
{
    /* Asked afresh, never from the allocation cache: after a restore the ordinal may be another GPU. */
    const struct cscu_driver *d = cscu_driver();
    CUuuid id;
    if (!d || d->device_get_uuid(&id, dev) != CUDA_SUCCESS || d->device_get_name(name, 96, dev) != CUDA_SUCCESS)
        return -1;
    format_uuid(&id, uuid);
    return 0;
}

void cscu_device_prop(CUmemAllocationProp *prop, CUdevice dev)
{
    memset(prop, 0, sizeof(*prop));
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = cscu_config()->exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
}

CUresult cscu_map(struct cscu_region *r)
{
    if (r->vmm)
        return cscu_vmm_back(r);  /* the engine's own: its properties, mappings and access */
    const struct cscu_driver *d = cscu_driver();
    CUmemAllocationProp prop;
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, r->device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle handle = 0;
    cscu_device_prop(&prop, r->device);
    int mapped = 0;
    CUresult rc = d->create(&handle, r->size, &prop, 0);
    if (rc != CUDA_SUCCESS)
        return rc;  /* nothing made yet */
    if ((rc = d->map(r->address, r->size, 0, handle, 0)) != CUDA_SUCCESS)
        goto undo;
    mapped = 1;
    if ((rc = d->set_access(r->address, r->size, &access, 1)) != CUDA_SUCCESS)
        goto undo;
    r->handle = handle;
    return CUDA_SUCCESS;
undo:  /* on failure nothing is left behind */
    if (mapped)
        d->unmap(r->address, r->size);
    d->release(handle);
    return rc;
}

CUresult cscu_unmap(struct cscu_region *r)
{
    if (r->vmm)
        return cscu_vmm_unback(r);
    const struct cscu_driver *d = cscu_driver();
    if (!r->handle)
        return CUDA_SUCCESS;
    CUresult rc = d->unmap(r->address, r->size);
    if (rc == CUDA_SUCCESS && (rc = d->release(r->handle)) == CUDA_SUCCESS)
        r->handle = 0;
    return rc;
}

static int append(const struct cscu_region *r)
{
    if (region_count == region_room) {
        size_t room = region_room ? region_room * 2 : 64;
        struct cscu_region *grown = realloc(regions, room * sizeof(*grown));
        if (!grown)
            return -1;
        regions = grown;
        region_room = room;
    }
    regions[region_count++] = *r;
    return 0;
}

static int (*start_hook)(void);

void cscu_regions_on_start(int (*start)(void))
{
    __atomic_store_n(&start_hook, start, __ATOMIC_RELEASE);
}

static int socket_started(void)
{
    int (*start)(void) = __atomic_load_n(&start_hook, __ATOMIC_ACQUIRE);
    return start && start() == 0;
}

int cscu_regions_start(void)
{
    return socket_started() ? 0 : -1;
}

int cscu_regions_append(const struct cscu_region *r)
{
    return append(r);
}

void cscu_regions_remove(size_t i)
{
    if (i < region_count)
        regions[i] = regions[--region_count];
}

size_t cscu_granularity(CUdevice dev)
{
    return dev >= 0 && dev < MAX_DEVICES ? __atomic_load_n(&devices[dev].granularity, __ATOMIC_ACQUIRE) : 0;
}

size_t cscu_moved_json(char *out, size_t room)
{
    static const char *names[CSCU_SOURCES] = {"alloc", "stream_ordered", "vmm_by_engine"};
    unsigned long long count[CSCU_SOURCES] = {0}, bytes[CSCU_SOURCES] = {0};
    size_t used = 0;
    for (size_t i = 0; i < region_count; i++) {  /* the caller holds the table */
        count[regions[i].source]++;
        bytes[regions[i].source] += regions[i].size;
    }
    for (int k = 0; k < CSCU_SOURCES && used < room; k++)
        used += (size_t)snprintf(out + used, room - used, "%s\"%s\":{\"count\":%llu,\"bytes\":%llu}%s",
                                 k ? "," : "{", names[k], count[k], bytes[k], k + 1 == CSCU_SOURCES ? "}" : "");
    return used < room ? used : (room ? room - 1 : 0);
}

CUresult cscu_alloc(CUdeviceptr *out, size_t size, enum cscu_kind *why, enum cscu_source source)
{
    const struct cscu_config *cfg = cscu_config();
    const struct cscu_driver *d = cscu_driver();
    struct cscu_region r = {0};
    CUmemAllocationProp prop;
    *why = CSCU_FALLBACK;
    if (!cfg->socket[0] || !d || !out)
        return CUDA_ERROR_NOT_FOUND;
    if (size < cfg->threshold) {
        *why = CSCU_SMALL;
        return CUDA_ERROR_NOT_FOUND;
    }
    if (!socket_started() || d->ctx_get_current(&r.context) != CUDA_SUCCESS || !r.context
        || d->ctx_get_device(&r.device) != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_FOUND;
    cscu_device_prop(&prop, r.device);
    if (describe(d, r.device, &prop) != 0)
        return CUDA_ERROR_NOT_FOUND;
    size_t granularity = devices[r.device].granularity;
    r.size = (size + granularity - 1) / granularity * granularity;
    r.requested = size;
    r.source = source;
    memcpy(r.uuid, devices[r.device].uuid, sizeof(r.uuid));
    memcpy(r.name, devices[r.device].name, sizeof(r.name));
    if (d->address_reserve(&r.address, r.size, 0, 0, 0) != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc = cscu_map(&r);
    if (rc == CUDA_SUCCESS) {
        cscu_regions_lock();
        int full = append(&r);
        cscu_regions_unlock();
        if (full == 0) {
            *out = r.address;
            return CUDA_SUCCESS;
        }
        cscu_unmap(&r);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    d->address_free(r.address, r.size);
    /* Out of device memory is the engine's to handle (its allocator frees its cache and retries); any other
     * refusal of a VMM step falls back to the driver's own allocation, on the checkpoint path. */
    return rc == CUDA_ERROR_OUT_OF_MEMORY ? rc : CUDA_ERROR_NOT_FOUND;
}

/* Our region at `ptr` taken out of the table (into `r`): 0, or -1 when there is none. */
static int take_out(CUdeviceptr ptr, struct cscu_region *r)
{
    cscu_regions_lock();
    size_t i = 0;
    while (i < region_count && (regions[i].address != ptr || regions[i].vmm))
        i++;
    int found = i < region_count;
    if (found) {
        *r = regions[i];
        regions[i] = regions[--region_count];
    }
    cscu_regions_unlock();
    return found ? 0 : -1;
}

int cscu_region_of(CUdeviceptr ptr, struct cscu_region *out)
{
    int found = 0;
    cscu_regions_lock();
    for (size_t i = 0; i < region_count && !found; i++)
        if (regions[i].address == ptr && !regions[i].vmm) {
            *out = regions[i];
            found = 1;
        }
    cscu_regions_unlock();
    return found ? 0 : -1;
}

static CUresult drop(CUdeviceptr ptr, int synchronize)
{
    const struct cscu_driver *d = cscu_driver();
    struct cscu_region r;
    if (!d || !cscu_config()->socket[0] || take_out(ptr, &r) != 0)
        return CUDA_ERROR_NOT_FOUND;
    /* cuMemFree waits for the work using the memory; an unmap does not, so synchronise first (a stream-ordered
     * free has waited for its stream's event instead). */
    CUresult rc = synchronize ? d->ctx_synchronize() : CUDA_SUCCESS;
    if (rc == CUDA_SUCCESS)
        rc = cscu_unmap(&r);
    if (rc != CUDA_SUCCESS) {  /* still ours (mapped or reserved): a later free or release finds it */
        cscu_regions_lock();
        if (append(&r) != 0)
            fprintf(stderr, "coldsnap-cuda: region %#llx lost from the table\n", r.address);
        cscu_regions_unlock();
        return rc;
    }
    return d->address_free(r.address, r.size);
}

CUresult cscu_free(CUdeviceptr ptr)
{
    return drop(ptr, 1);
}

CUresult cscu_discard(CUdeviceptr ptr)
{
    return drop(ptr, 0);
}

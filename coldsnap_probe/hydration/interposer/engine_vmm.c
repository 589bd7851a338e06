/* The engine's own VMM allocations (cuMemCreate + cuMemMap + cuMemSetAccess: PyTorch's expandable segments, vLLM's
 * CuMemAllocator) moved at line rate like our regions.
 *
 * A release must free the physical memory behind every mapping the engine made, which takes every reference to the
 * driver's handle, the engine's included; a hydration re-creates it, so the driver's handle changes. The engine keeps
 * its handle and uses it later (cuMemUnmap, cuMemRelease, cuMemRetainAllocationHandle, export, properties), so it
 * holds one of ours instead: a value in a non-canonical address range (0xc5c5...), which no driver handle is (they
 * are host pointers), translated on every call that takes one. We hold exactly one reference to the driver's handle
 * per allocation and count the engine's (create, retain, release) ourselves; the driver's handle is released when
 * the engine holds none and nothing is mapped, as the driver would free it.
 *
 * An allocation is a region (regions.c's table, source vmm_by_engine, `vmm` pointing at its record) while it is
 * movable: on a device, of the threshold or more, with a mapping of the whole allocation that its device may read
 * and write, a context on that device known, never exported and all its mappings recorded. Otherwise it stays on
 * the CUDA checkpoint path, counted as `vmm_by_engine`. Records are kept under the region table's lock (a release
 * or hydration holds it throughout). Calls regions.c and the driver.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cscu.h"

#define HANDLE_BASE 0xc5c5000000000000ull  /* non-canonical on x86-64 and aarch64: never a host pointer */

static struct cscu_vmm **records;
static size_t record_count, record_room;
static unsigned long long handles_made;

static struct cscu_vmm *by_handle(CUmemGenericAllocationHandle h)
{
    if ((h & 0xffff000000000000ull) != HANDLE_BASE)
        return NULL;
    for (size_t i = 0; i < record_count; i++)
        if (records[i]->handle == h)
            return records[i];
    return NULL;
}

/* A value of ours whose record is gone (the engine released it more often than it created and retained it): the
 * driver never sees it (it would take it for a host pointer); the call is refused as the driver refuses a released
 * handle. Under the table's lock. */
static int stale(CUmemGenericAllocationHandle h)
{
    return (h & 0xffff000000000000ull) == HANDLE_BASE && !by_handle(h);
}

/* The record whose recorded mapping holds `p` (any address inside it, as cuMemRetainAllocationHandle takes). */
static struct cscu_vmm *by_address(CUdeviceptr p)
{
    for (size_t i = 0; i < record_count; i++)
        for (size_t k = 0; k < records[i]->map_count; k++)
            if (p >= records[i]->maps[k].address && p - records[i]->maps[k].address < records[i]->maps[k].size)
                return records[i];
    return NULL;
}

static struct cscu_vmm *by_real(CUmemGenericAllocationHandle real)
{
    for (size_t i = 0; i < record_count; i++)
        if (records[i]->real == real)
            return records[i];
    return NULL;
}

/* The mapping of the whole allocation its own device may read and write (the one a release copies), or NULL. */
static const struct cscu_mapping *primary(const struct cscu_vmm *v)
{
    for (size_t k = 0; k < v->map_count; k++) {
        const struct cscu_mapping *m = &v->maps[k];
        if (m->offset != 0 || m->size != v->size || !m->mapped)
            continue;
        for (int a = 0; a < m->accesses; a++)
            if (m->access[a].location.type == CU_MEM_LOCATION_TYPE_DEVICE
                && m->access[a].location.id == v->prop.location.id
                && m->access[a].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                return m;
    }
    return NULL;
}

/* The index of v's region in the table, or -1. */
static long region_index(const struct cscu_vmm *v)
{
    size_t count;
    struct cscu_region *r = cscu_regions(&count);
    for (size_t i = 0; i < count; i++)
        if (r[i].vmm == v)
            return (long)i;
    return -1;
}

/* v's region as the table holds it, from its record and its primary mapping `m`; 0, or -1 when its device cannot
 * be named. */
static int region_for(const struct cscu_vmm *v, const struct cscu_mapping *m, struct cscu_region *r)
{
    memset(r, 0, sizeof(*r));
    r->address = m->address;
    r->size = r->requested = v->size;
    r->context = v->context;
    r->device = v->prop.location.id;
    r->handle = v->real;
    r->source = CSCU_FROM_ENGINE;
    r->vmm = (struct cscu_vmm *)v;
    return cscu_device_identity(r->device, r->uuid, r->name);
}

/* Puts v in the region table when it is movable and takes it out when it no longer is; what is not movable is
 * counted as vmm_by_engine (on the checkpoint path). The table is locked by the caller. */
static void refresh(struct cscu_vmm *v)
{
    const struct cscu_mapping *m = v->pinned || !v->real || !v->context ? NULL : primary(v);
    long at = region_index(v);
    struct cscu_region r;
    if (m && at < 0 && (region_for(v, m, &r) != 0 || cscu_regions_append(&r) != 0))
        m = NULL;
    else if (m && at >= 0)
        cscu_regions(&(size_t){0})[at].address = m->address;  /* the whole mapping a release copies from */
    else if (!m && at >= 0)
        cscu_regions_remove((size_t)at);
    if (!m && !v->tracked) {
        cscu_track(CSCU_VMM_DIRECT, (uintptr_t)v->handle, v->size);
        v->tracked = 1;
    } else if (m && v->tracked) {
        cscu_untrack((uintptr_t)v->handle);
        v->tracked = 0;
    }
}

/* A context on v's device for its copies: the current one when it is on that device (else none yet). */
static void learn_context(struct cscu_vmm *v)
{
    const struct cscu_driver *d = cscu_driver();
    CUcontext ctx = NULL;
    CUdevice dev = -1;
    if (!v->context && d->ctx_get_current(&ctx) == CUDA_SUCCESS && ctx && d->ctx_get_device(&dev) == CUDA_SUCCESS
        && dev == v->prop.location.id)
        v->context = ctx;
}

/* The record forgotten and the driver's handle released (the engine holds no reference and nothing is mapped). */
static CUresult drop_record(struct cscu_vmm *v)
{
    CUresult rc = v->real ? cscu_driver()->release(v->real) : CUDA_SUCCESS;
    long at = region_index(v);
    if (at >= 0)
        cscu_regions_remove((size_t)at);
    if (v->tracked)
        cscu_untrack((uintptr_t)v->handle);
    for (size_t i = 0; i < record_count; i++)
        if (records[i] == v) {
            records[i] = records[--record_count];
            break;
        }
    free(v);
    return rc;
}

static int add_record(struct cscu_vmm *v)
{
    if (record_count == record_room) {
        size_t room = record_room ? record_room * 2 : 256;
        struct cscu_vmm **grown = realloc(records, room * sizeof(*grown));
        if (!grown)
            return -1;
        records = grown;
        record_room = room;
    }
    records[record_count++] = v;
    v->handle = HANDLE_BASE | ++handles_made;
    return 0;
}

/* Whether an allocation of `n` bytes with `prop` may be moved at all: pinned device memory of the threshold or more,
 * with the driver and the control socket there. */
static int routable(const CUmemAllocationProp *prop, size_t n)
{
    return cscu_config()->socket[0] && cscu_config()->engine_vmm && cscu_driver() && prop
           && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED
           && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && n >= cscu_config()->threshold
           && cscu_regions_start() == 0;
}

CUresult cscu_vmm_create(cscu_create_fn real, CUmemGenericAllocationHandle *h, size_t n,
                         const CUmemAllocationProp *prop, unsigned long long flags)
{
    CUresult rc = real(h, n, prop, flags);
    if (rc != CUDA_SUCCESS || !h || !cscu_config()->socket[0] || !cscu_driver())
        return rc;  /* refused, or inert: nothing to keep */
    struct cscu_vmm *v = routable(prop, n) ? calloc(1, sizeof(*v)) : NULL;
    if (!v) {
        cscu_track(CSCU_VMM_DIRECT, (uintptr_t)*h, n);  /* stays the driver's handle, on the checkpoint path */
        return rc;
    }
    v->real = *h;
    v->prop = *prop;
    v->flags = flags;
    v->size = n;
    v->refs = 1;
    learn_context(v);
    cscu_regions_lock();
    if (add_record(v) == 0) {
        *h = v->handle;
        refresh(v);  /* counted as vmm_by_engine until mapped and made accessible */
    } else {
        cscu_track(CSCU_VMM_DIRECT, (uintptr_t)*h, n);
        free(v);
    }
    cscu_regions_unlock();
    return rc;
}

CUresult cscu_vmm_release(cscu_release_fn real, CUmemGenericAllocationHandle h)
{
    CUresult rc = CUDA_SUCCESS;
    cscu_regions_lock();
    struct cscu_vmm *v = by_handle(h);
    if (!v && stale(h)) {
        cscu_regions_unlock();
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!v) {
        cscu_regions_unlock();
        if ((rc = real(h)) == CUDA_SUCCESS)
            cscu_untrack((uintptr_t)h);
        return rc;
    }
    if (v->refs <= 0)
        rc = CUDA_ERROR_INVALID_VALUE;  /* released more often than created and retained */
    else if (--v->refs == 0 && v->map_count == 0)
        rc = drop_record(v);
    cscu_regions_unlock();
    return rc;
}

CUresult cscu_vmm_map(cscu_map_fn real, CUdeviceptr p, size_t n, size_t offset, CUmemGenericAllocationHandle h,
                      unsigned long long flags)
{
    cscu_regions_lock();
    struct cscu_vmm *v = by_handle(h);
    CUmemGenericAllocationHandle use = v ? v->real : h;
    int gone = !v && stale(h);
    cscu_regions_unlock();
    if (gone)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = real(p, n, offset, use, flags);
    if (rc != CUDA_SUCCESS || !v)
        return rc;
    cscu_regions_lock();
    if ((v = by_handle(h)) != NULL) {  /* looked up again: the engine may have released it meanwhile */
        if (v->map_count < CSCU_VMM_MAPS)
            v->maps[v->map_count++] = (struct cscu_mapping){p, n, offset, 1, 0, {{{0, 0}, 0}}};
        else
            v->pinned |= CSCU_PINNED_MAPS;  /* a mapping a hydration could not make again */
        learn_context(v);
        refresh(v);
    }
    cscu_regions_unlock();
    return rc;
}

/* Forgets every recorded mapping inside [p, p + n) (cuMemUnmap unmaps whole mappings only); a record left with no
 * mapping and no reference of the engine's is released as the driver would. */
CUresult cscu_vmm_unmap(cscu_unmap_fn real, CUdeviceptr p, size_t n)
{
    CUresult rc = real(p, n);
    if (rc != CUDA_SUCCESS || !cscu_config()->socket[0])
        return rc;
    cscu_regions_lock();
    for (size_t i = record_count; i-- > 0;) {
        struct cscu_vmm *v = records[i];
        int touched = 0;
        for (size_t k = v->map_count; k-- > 0;)
            if (v->maps[k].address >= p && v->maps[k].address - p < n) {
                memmove(&v->maps[k], &v->maps[k + 1], (v->map_count - k - 1) * sizeof(v->maps[0]));
                v->map_count--;
                touched = 1;
            }
        if (touched && v->refs == 0 && v->map_count == 0)
            drop_record(v);  /* the driver's handle released: its memory is freed now, as the driver does */
        else if (touched)
            refresh(v);
    }
    cscu_regions_unlock();
    return rc;
}

/* desc merged into mapping m's access: one descriptor per location, the latest flags. */
static int merge_access(struct cscu_mapping *m, const CUmemAccessDesc *desc, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        int a = 0;
        while (a < m->accesses && (m->access[a].location.type != desc[i].location.type
                                   || m->access[a].location.id != desc[i].location.id))
            a++;
        if (a == CSCU_VMM_ACCESS)
            return -1;
        m->access[a] = desc[i];
        m->accesses += a == m->accesses;
    }
    return 0;
}

/* cuMemSetAccess may span several mappings (PyTorch's expandable segments set a run of pages at once): each
 * mapping inside the range records it; one the range covers only in part pins its allocation. */
CUresult cscu_vmm_set_access(cscu_access_fn real, CUdeviceptr p, size_t n, const CUmemAccessDesc *desc, size_t count)
{
    CUresult rc = real(p, n, desc, count);
    if (rc != CUDA_SUCCESS || !cscu_config()->socket[0] || !desc)
        return rc;
    cscu_regions_lock();
    for (size_t i = 0; i < record_count; i++) {
        struct cscu_vmm *v = records[i];
        int touched = 0;
        for (size_t k = 0; k < v->map_count; k++) {
            struct cscu_mapping *m = &v->maps[k];
            if (m->address + m->size <= p || m->address >= p + n)
                continue;
            touched = 1;
            if (m->address < p || m->address + m->size > p + n || merge_access(m, desc, count) != 0)
                v->pinned |= CSCU_PINNED_MAPS;
        }
        if (touched) {
            learn_context(v);
            refresh(v);
        }
    }
    cscu_regions_unlock();
    return rc;
}

CUresult cscu_vmm_retain(cscu_retain_fn real, CUmemGenericAllocationHandle *h, void *addr)
{
    cscu_regions_lock();
    struct cscu_vmm *v = h && cscu_config()->socket[0] ? by_address((CUdeviceptr)(uintptr_t)addr) : NULL;
    if (v) {
        v->refs++;
        *h = v->handle;
    }
    cscu_regions_unlock();
    if (v)
        return CUDA_SUCCESS;
    CUresult rc = real(h, addr);
    if (rc != CUDA_SUCCESS || !h || !cscu_config()->socket[0] || !cscu_driver())
        return rc;
    /* A mapping we did not record of an allocation we did: the engine gets our handle, and the driver's extra
     * reference is given back at once (we hold exactly one). */
    cscu_regions_lock();
    if ((v = by_real(*h)) != NULL && cscu_driver()->release(*h) == CUDA_SUCCESS) {
        v->refs++;
        *h = v->handle;
    }
    cscu_regions_unlock();
    return rc;
}

CUresult cscu_vmm_properties(cscu_props_fn real, CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    cscu_regions_lock();
    struct cscu_vmm *v = by_handle(h);
    CUmemGenericAllocationHandle use = v ? v->real : h;
    CUmemAllocationProp made;
    int gone = !v && stale(h);
    if (v)
        made = v->prop;
    cscu_regions_unlock();
    if (gone || (v && !prop))
        return CUDA_ERROR_INVALID_VALUE;
    if (v && !use) {  /* released (only the control thread runs then): the properties it will have */
        *prop = made;
        return CUDA_SUCCESS;
    }
    CUresult rc = real(prop, use);
    /* The engine's own answer as it made it: a staged allocation adopted in its place is exportable and an imported
     * handle may not report its allocation flags. */
    if (rc == CUDA_SUCCESS && v)
        *prop = made;
    return rc;
}

/* The driver's handle for the engine's `h` (h itself when it is none of ours, `*ours` then 0; 0 for a stale one of
 * ours, `*ours` then -1: the caller refuses it). */
static CUmemGenericAllocationHandle translate(CUmemGenericAllocationHandle h, int *ours)
{
    cscu_regions_lock();
    struct cscu_vmm *v = by_handle(h);
    CUmemGenericAllocationHandle use = v ? v->real : h;
    *ours = v ? 1 : stale(h) ? -1 : 0;
    cscu_regions_unlock();
    return *ours < 0 ? 0 : use;
}

/* After a call that let the memory of `h` out of this process's hands: it stays on the checkpoint path for good. */
static void pin(CUmemGenericAllocationHandle h)
{
    cscu_regions_lock();
    struct cscu_vmm *v = by_handle(h);
    if (v) {
        v->pinned |= CSCU_PINNED_EXPORTED;
        refresh(v);
    }
    cscu_regions_unlock();
}

CUresult cscu_vmm_export(cscu_export_fn real, void *out, CUmemGenericAllocationHandle h, unsigned int type,
                         unsigned long long flags)
{
    int ours;
    CUmemGenericAllocationHandle use = translate(h, &ours);
    CUresult rc = ours < 0 ? CUDA_ERROR_INVALID_VALUE : real(out, use, type, flags);
    if (rc == CUDA_SUCCESS && ours)
        pin(h);  /* another process may import it: its memory must stay where it is */
    return rc;
}

CUresult cscu_vmm_bind(cscu_bind_fn real, CUmemGenericAllocationHandle mc, size_t mc_offset,
                       CUmemGenericAllocationHandle h, size_t offset, size_t n, unsigned long long flags)
{
    int ours;
    CUmemGenericAllocationHandle use = translate(h, &ours);
    CUresult rc = ours < 0 ? CUDA_ERROR_INVALID_VALUE : real(mc, mc_offset, use, offset, n, flags);
    if (rc == CUDA_SUCCESS && ours)
        pin(h);  /* a re-created allocation would not be bound */
    return rc;
}

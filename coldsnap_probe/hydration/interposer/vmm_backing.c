/* The backing of an allocation the engine made itself (engine_vmm.c keeps its record): at a release every mapping
 * is unmapped and the driver's handle released (the engine's reservations stay); at a hydration it is re-created
 * with the engine's own properties and flags, mapped at every address and offset it was, and given back the access
 * the engine set, so the engine's handle (ours), pointers and CUDA graphs stay valid. regions.c's cscu_map and
 * cscu_unmap hand engine regions here; this file calls only the driver. */
#include <string.h>

#include "cscu.h"

/* Mapping m's recorded access, the device the allocation lived on (`was`) read as `now`; PROT_NONE entries are left
 * out (a new mapping starts with no access). The number of descriptors written. */
static size_t access_for(const struct cscu_mapping *m, int was, int now, CUmemAccessDesc out[CSCU_VMM_ACCESS])
{
    size_t n = 0;
    for (int i = 0; i < m->accesses && i < CSCU_VMM_ACCESS; i++) {
        if (!m->access[i].flags)
            continue;
        out[n] = m->access[i];
        if (out[n].location.type == CU_MEM_LOCATION_TYPE_DEVICE && out[n].location.id == was)
            out[n].location.id = now;
        n++;
    }
    return n;
}

/* Unmaps every mapping of v still backed, or only those `only` marks when it is not NULL (each one's `mapped`
 * cleared as it goes): the first failure, or success. */
static CUresult unmap_each(struct cscu_vmm *v, const char *only)
{
    const struct cscu_driver *d = cscu_driver();
    CUresult first = CUDA_SUCCESS;
    for (size_t i = 0; i < v->map_count; i++) {
        if (!v->maps[i].mapped || (only && !only[i]))
            continue;
        CUresult rc = d->unmap(v->maps[i].address, v->maps[i].size);
        if (rc == CUDA_SUCCESS)
            v->maps[i].mapped = 0;
        else if (first == CUDA_SUCCESS)
            first = rc;
    }
    return first;
}

/* Maps every mapping of v not mapped yet onto `handle` with its access, on device `now`: success, or the failure
 * with what this call mapped unmapped again (and only that: a mapping that stayed mapped when an unback failed
 * midway is the engine's memory, still in use). */
static CUresult map_each(struct cscu_vmm *v, CUmemGenericAllocationHandle handle, int now)
{
    const struct cscu_driver *d = cscu_driver();
    CUresult rc = CUDA_SUCCESS;
    char made[CSCU_VMM_MAPS] = {0};
    for (size_t i = 0; i < v->map_count && rc == CUDA_SUCCESS; i++) {
        struct cscu_mapping *m = &v->maps[i];
        CUmemAccessDesc access[CSCU_VMM_ACCESS];
        if (m->mapped)
            continue;
        if ((rc = d->map(m->address, m->size, m->offset, handle, 0)) != CUDA_SUCCESS)
            break;
        m->mapped = made[i] = 1;
        size_t n = access_for(m, v->prop.location.id, now, access);
        if (n && (rc = d->set_access(m->address, m->size, access, n)) != CUDA_SUCCESS)
            break;
    }
    if (rc != CUDA_SUCCESS)
        unmap_each(v, made);
    return rc;
}

CUresult cscu_vmm_back(struct cscu_region *r)
{
    const struct cscu_driver *d = cscu_driver();
    struct cscu_vmm *v = r->vmm;
    CUmemAllocationProp prop = v->prop;
    CUmemGenericAllocationHandle handle = 0;
    if (v->real)  /* never released (its unmap failed midway): its mappings come back on the same memory */
        return map_each(v, v->real, v->prop.location.id);
    prop.location.id = r->device;  /* where the region lives now (same-model may have moved it) */
    CUresult rc = d->create(&handle, v->size, &prop, v->flags);
    if (rc != CUDA_SUCCESS)
        return rc;  /* nothing made */
    if ((rc = map_each(v, handle, r->device)) != CUDA_SUCCESS) {
        d->release(handle);
        return rc;
    }
    cscu_vmm_backed(r, handle);
    return CUDA_SUCCESS;
}

void cscu_vmm_backed(struct cscu_region *r, CUmemGenericAllocationHandle handle)
{
    struct cscu_vmm *v = r->vmm;
    for (size_t i = 0; i < v->map_count; i++) {
        struct cscu_mapping *m = &v->maps[i];
        m->mapped = 1;
        for (int a = 0; a < m->accesses && a < CSCU_VMM_ACCESS; a++)
            if (m->access[a].location.type == CU_MEM_LOCATION_TYPE_DEVICE
                && m->access[a].location.id == v->prop.location.id)
                m->access[a].location.id = r->device;
    }
    v->prop.location.id = r->device;
    v->real = r->handle = handle;
}

CUresult cscu_vmm_unback(struct cscu_region *r)
{
    const struct cscu_driver *d = cscu_driver();
    struct cscu_vmm *v = r->vmm;
    if (!v->real)
        return CUDA_SUCCESS;
    CUresult rc = unmap_each(v, NULL);
    if (rc != CUDA_SUCCESS) {
        /* Some mappings could not be unmapped: the ones that were come back on the same memory (its content is
         * still there: the handle was never released), so the region stays whole and mapped. */
        CUresult again = map_each(v, v->real, v->prop.location.id);
        return again == CUDA_SUCCESS ? rc : again;
    }
    if ((rc = d->release(v->real)) != CUDA_SUCCESS) {
        map_each(v, v->real, v->prop.location.id);  /* nothing released: mapped again as it was */
        return rc;
    }
    v->real = r->handle = 0;
    return CUDA_SUCCESS;
}

int cscu_vmm_stageable(const struct cscu_region *r)
{
    const struct cscu_vmm *v = r->vmm;
    if (!v)
        return 1;
    /* No allocation flag at all: GPUDirect RDMA (PyTorch asks for it where the device supports it with VMM) is
     * never what an imported allocation has in the importing process (H200, driver 580: neither its properties nor
     * cuPointerGetAttribute's IS_GPU_DIRECT_RDMA_CAPABLE say so; bench/vmm_pages.py). */
    static const unsigned char none[sizeof(v->prop.allocFlags)];
    const struct cscu_mapping *m = &v->maps[0];
    return v->map_count == 1 && m->offset == 0 && m->size == v->size && m->accesses == 1
           && m->access[0].location.type == CU_MEM_LOCATION_TYPE_DEVICE
           && m->access[0].location.id == v->prop.location.id
           && m->access[0].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE && v->flags == 0
           && (v->prop.requestedHandleTypes & ~CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0
           && memcmp(&v->prop.allocFlags, none, sizeof(none)) == 0;
}

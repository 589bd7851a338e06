/* Hydrate: re-create the released regions at their addresses and fill them from the dump (or map at each the
 * allocation a node hydrator staged and filled for it), verify, and only then let the engine run. A failure (a dump shorter than its
 * manifest, a digest mismatch, another GPU model, out of memory) releases what was created: the regions stay
 * released and the gate closed, nothing half-hydrated runs. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cscu.h"
#include "dump.h"

static void undo(struct cscu_region *regions, const char *created, size_t count)
{
    const struct cscu_driver *d = cscu_driver();
    for (size_t i = 0; i < count; i++)
        if (created[i] && d->ctx_set_current(regions[i].context) == CUDA_SUCCESS)
            cscu_unmap(&regions[i]);
}

/* Every file of a released region is there and holds its segment. */
static int open_dump(int dirfd, const char *dir, int *fds, const char *take, char *error, size_t room)
{
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    for (size_t i = 0; i < cscu_segment_count; i++) {
        struct stat st;
        if (!take[i])
            continue;
        if ((fds[i] = openat(dirfd, cscu_segments[i].file, O_RDONLY | O_NOFOLLOW | O_CLOEXEC)) < 0) {
            snprintf(error, room, "dump file %s/%s: %s", dir, cscu_segments[i].file, strerror(errno));
            return -1;
        }
        if (fstat(fds[i], &st) != 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size < cscu_segments[i].size) {
            snprintf(error, room, "dump file %s/%s holds %lld bytes, its manifest says %zu (region %#llx): the dump "
                     "is shorter than its manifest", dir, cscu_segments[i].file, (long long)st.st_size, cscu_segments[i].size,
                     regions[cscu_segments[i].region].address);
            return -1;
        }
    }
    return 0;
}

/* The GPU each released region comes back on is the model it was dumped on (and the same GPU under same-gpu). */
static int check_devices(const char *policy, char *error, size_t room)
{
    const struct cscu_driver *d = cscu_driver();
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    CUcontext asked = NULL;  /* the last context whose device was read: regions mostly share one (~830 pages) */
    int read = 0;
    char uuid[48], name[96];
    CUdevice dev = -1;
    cscu_devices_forget();
    for (size_t i = 0; i < count; i++) {
        struct cscu_region *r = &regions[i];
        CUresult rc = CUDA_SUCCESS;
        if (r->handle)
            continue;
        if ((!read || r->context != asked)
            && ((rc = d->ctx_set_current(r->context)) != CUDA_SUCCESS || (rc = d->ctx_get_device(&dev)) != CUDA_SUCCESS
                || cscu_device_identity(dev, uuid, name) != 0)) {
            snprintf(error, room, "region %#llx: its context's device cannot be read: %s", r->address,
                     cscu_error_name(rc));
            return -1;
        }
        asked = r->context, read = 1;
        if (strcmp(name, r->name) != 0 || (strcmp(policy, CSCU_POLICY_SAME_GPU) == 0 && strcmp(uuid, r->uuid) != 0)) {
            snprintf(error, room, "region %#llx was dumped on %s (%s), this GPU is %s (%s): policy %s refuses %s",
                     r->address, r->name, r->uuid, name, uuid, policy,
                     strcmp(name, r->name) != 0 ? "another GPU model" : "another GPU");
            return -1;
        }
        r->device = dev;
        memcpy(r->uuid, uuid, sizeof(r->uuid));  /* where it lives from now on (same-model may move it) */
    }
    return 0;
}

/* Sampled read-back, shared by its threads: the next segment to check, and the first mismatch. */
struct samples {
    const int *fds;
    const char *take;
    size_t next;
    int bad;
    pthread_mutex_t lock;
    char *error;
    size_t room;
};

/* A sampling thread's means: a page-locked buffer and a stream of its own in the context it reads from (the
 * driver's synchronous copies into pageable memory go one at a time, however many threads ask: 832 segments took
 * 0.08 s on the H200 either way); a plain buffer and the synchronous copy where those cannot be had. */
struct sampler {
    char *device, *file;
    int pinned;
    CUcontext context;
    CUstream stream;
};

/* `ctx` made current, with the sampler's stream in it; the driver's answer to the first. */
static CUresult sampler_in(struct sampler *sp, CUcontext ctx)
{
    const struct cscu_driver *d = cscu_driver();
    CUresult rc = d->ctx_set_current(ctx);
    if (rc != CUDA_SUCCESS || ctx == sp->context)
        return rc;
    if (sp->stream)
        d->stream_destroy(sp->stream);
    sp->stream = NULL, sp->context = ctx;
    void *locked = NULL;
    if (!sp->pinned && d->host_alloc(&locked, SAMPLE, 0x01 /* CU_MEMHOSTALLOC_PORTABLE */) == CUDA_SUCCESS) {
        free(sp->device);
        sp->device = locked, sp->pinned = 1;
    }
    if (d->stream_create(&sp->stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
        sp->stream = NULL;
    return CUDA_SUCCESS;
}

static void sampler_close(struct sampler *sp)
{
    const struct cscu_driver *d = cscu_driver();
    if (sp->stream)
        d->stream_destroy(sp->stream);
    if (sp->pinned)
        d->free_host(sp->device);
    else
        free(sp->device);
    free(sp->file);
}

/* Segment i's first and last bytes on the device against its file; 0, or -1 with `why` set. */
static int sample_one(size_t i, int fd, struct sampler *sp, char *why, size_t room)
{
    const struct cscu_driver *d = cscu_driver();
    size_t count;
    struct cscu_region *r = &cscu_regions(&count)[cscu_segments[i].region];
    size_t n = cscu_segments[i].size < SAMPLE ? cscu_segments[i].size : SAMPLE;
    size_t starts[2] = {0, cscu_segments[i].size - n};
    for (int k = 0; k < 2; k++) {
        CUdeviceptr from = r->address + cscu_segments[i].offset + starts[k];
        CUresult rc = sampler_in(sp, r->context);
        if (rc == CUDA_SUCCESS && sp->stream && sp->pinned
            && (rc = d->memcpy_dtoh_async(sp->device, from, n, sp->stream)) == CUDA_SUCCESS)
            rc = d->stream_synchronize(sp->stream);
        else if (rc == CUDA_SUCCESS)
            rc = d->memcpy_dtoh(sp->device, from, n);
        if (rc != CUDA_SUCCESS || cscu_full_io(1, fd, sp->file, n, (off_t)starts[k]) != 0
            || memcmp(sp->device, sp->file, n) != 0) {
            snprintf(why, room, "%s at +%zu: the device bytes differ from the dump after the fill (%s)",
                     cscu_segments[i].file, starts[k], cscu_error_name(rc));
            return -1;
        }
    }
    return 0;
}

static void *sample_thread(void *arg)
{
    struct samples *s = arg;
    struct sampler sp = {.device = malloc(SAMPLE), .file = malloc(SAMPLE)};
    char why[512] = "out of host memory";
    cscu_gate_exempt();  /* runs while the gate is closed, like the copy threads */
    for (;;) {
        pthread_mutex_lock(&s->lock);
        size_t i = s->next++;
        int stop = s->bad || i >= cscu_segment_count;
        pthread_mutex_unlock(&s->lock);
        if (stop)
            break;
        if (!s->take[i] || (sp.device && sp.file && sample_one(i, s->fds[i], &sp, why, sizeof(why)) == 0))
            continue;
        pthread_mutex_lock(&s->lock);
        if (!s->bad++)
            snprintf(s->error, s->room, "%s", why);
        pthread_mutex_unlock(&s->lock);
    }
    sampler_close(&sp);
    return NULL;
}

/* Sampled read-back: the first and last bytes of each segment on the device equal the file's. Many small regions
 * (an engine's VMM pages: ~830 at 16 GiB) are sampled by the copy threads at once, not one after another. */
static int verify_samples(const int *fds, const char *take, char *error, size_t room)
{
    struct samples s = {.fds = fds, .take = take, .lock = PTHREAD_MUTEX_INITIALIZER, .error = error, .room = room};
    size_t want = cscu_segment_count / 16 + 1, made = 0;
    pthread_t ids[64];  /* the copy threads at most (driver.c caps COLDSNAP_CUDA_INTERPOSER_THREADS) */
    if (want > (size_t)cscu_config()->threads)
        want = (size_t)cscu_config()->threads;
    while (made + 1 < want && made < 64 && pthread_create(&ids[made], NULL, sample_thread, &s) == 0)
        made++;
    sample_thread(&s);  /* this thread too (exempt already: the control socket's) */
    for (size_t t = 0; t < made; t++)
        pthread_join(ids[t], NULL);
    return s.bad ? -1 : 0;
}

/* `spent`: the copy threads' thread-seconds waiting for the device, reading the files, digesting; `bytes`: set on
 * the device (chunks of zeros), read and copied. */
static int fill_and_check(int *fds, const char *take, int digests, double spent[3], size_t bytes[2], char *error,
                          size_t room)
{
    struct job job = {.lock = PTHREAD_MUTEX_INITIALIZER, .fds = fds, .digests = digests};
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    int rc = cscu_copy(&job, 1, take);
    spent[0] = job.device_s, spent[1] = job.io_s, spent[2] = job.digest_s;
    bytes[0] = job.zeroed, bytes[1] = job.moved;
    if (rc != 0) {
        snprintf(error, room, "%s", job.error);
        goto cleanup;
    }
    for (size_t i = 0; i < cscu_segment_count && rc == 0; i++) {
        char found[CSCU_DIGEST_TEXT];
        if (!take[i] || !digests)
            continue;
        cscu_segment_digest(&job, i, found);
        if (strcmp(found, cscu_segments[i].digest) != 0) {
            snprintf(error, room, "dump file %s (region %#llx, +%zu) does not match its digest: expected %s, found "
                     "%s: a corrupt or foreign dump", cscu_segments[i].file, regions[cscu_segments[i].region].address,
                     cscu_segments[i].offset, cscu_segments[i].digest, found);
            rc = -1;
        }
    }
cleanup:
    free(job.items);
    return rc;
}

/* One hydration, from its checks to its answer: shared by the fill (cscu_hydrate) and the adoption of staged
 * allocations (cscu_hydrate_staged), which differ only in how the released regions get their memory. */
struct hydration {
    struct cscu_region *regions;
    size_t count, bytes, restored, zero;   /* zero: bytes of chunks of zeros the release recorded */
    char *take;                 /* per segment: its region is released (filled or adopted now) */
    char *created;              /* per region: mapped by this hydration (undone on failure) */
    int *fds, dirfd;
    double t0, check_s, place_s, fill_s;    /* place: re-create (fill) or import and map (staged) */
    double spent[3];                        /* the fill's thread-seconds: device, read, digest */
    size_t moved[3];                        /* bytes set on the device, read and copied, copied from a stage */
    const char *phase;
    char error[1024];
};

/* Open the dump and check it and the devices; 0, or -1 with h->error set (finish() answers either way). */
static int begin(struct hydration *h, const char *dir, const char *policy)
{
    memset(h, 0, sizeof(*h));
    h->t0 = cscu_now();
    h->phase = "hydrate";
    h->dirfd = -1;
    h->regions = cscu_regions(&h->count);
    h->take = calloc(cscu_segment_count + 1, 1);
    h->created = calloc(h->count + 1, 1);
    h->fds = malloc((cscu_segment_count + 1) * sizeof(int));
    if (!h->take || !h->created || !h->fds) {
        snprintf(h->error, sizeof(h->error), "out of host memory");
        return -1;
    }
    for (size_t i = 0; i < cscu_segment_count; i++) {
        h->fds[i] = -1;
        h->take[i] = h->regions[cscu_segments[i].region].handle == 0;
        h->bytes += h->take[i] ? cscu_segments[i].size : 0;
        for (size_t at = 0; h->take[i] && at < cscu_segments[i].size; at += CSCU_DIGEST_CHUNK)
            if (cscu_segments[i].zero >> (at / CSCU_DIGEST_CHUNK) & 1)
                h->zero += cscu_segments[i].size - at < CSCU_DIGEST_CHUNK ? cscu_segments[i].size - at : CSCU_DIGEST_CHUNK;
    }
    if ((h->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
        snprintf(h->error, sizeof(h->error), "dump directory %s: %s", dir, strerror(errno));
        return -1;
    }
    if (open_dump(h->dirfd, dir, h->fds, h->take, h->error, sizeof(h->error)) != 0
        || check_devices(policy, h->error, sizeof(h->error)) != 0)
        return -1;
    h->check_s = cscu_now() - h->t0;
    return 0;
}

/* Verify (when `ok`), then answer: the report, or the refusal with everything this hydration mapped undone (the
 * regions stay released, the gate closed). `staged`: 0 filled from the files, 1 staged allocations adopted, 2
 * copied from staged allocations. Frees what begin() took. */
static void finish(struct hydration *h, int ok, const char *policy, int digests, int staged, char *out, size_t room)
{
    double verify_started = cscu_now();
    if (ok) {
        h->phase = "hydrate: verify";
        ok = verify_samples(h->fds, h->take, h->error, sizeof(h->error)) == 0;
    }
    if (!ok && h->created)
        undo(h->regions, h->created, h->count);  /* nothing half-hydrated stays mapped; the gate stays closed */
    if (h->dirfd >= 0)
        cscu_close_files(h->dirfd, h->fds, 0);
    else
        free(h->fds);
    free(h->take);
    free(h->created);
    if (!ok) {
        cscu_refuse(out, room, h->phase, "%s", h->error);
        return;
    }
    double total = cscu_now() - h->t0;
    snprintf(out, room, "{\"ok\":true,\"report\":{\"bytes\":%zu,\"regions\":%zu,\"segments\":%zu,\"seconds\":%.6f,"
             "\"gbps\":%.3f,\"check_s\":%.6f,\"%s\":%.6f,\"fill_s\":%.6f,\"verify_s\":%.6f,\"policy\":\"%s\","
             "\"verify\":\"%s\",\"digest_engine\":\"%s\",\"threads\":%d,\"staged\":%s,\"fill_device_thread_s\":%.6f,"
             "\"fill_read_thread_s\":%.6f,\"fill_digest_thread_s\":%.6f,\"zero_bytes\":%zu,\"zero_set_bytes\":%zu,"
             "\"copied_bytes\":%zu,\"stage_copied_bytes\":%zu}}", h->bytes, h->restored,
             cscu_segment_count, total, h->fill_s > 0 ? (double)h->bytes / h->fill_s / 1e9 : 0.0, h->check_s,
             staged == 2 ? "copy_s" : staged ? "adopt_s" : "create_s", h->place_s, h->fill_s, cscu_now() - verify_started, policy,
             digests ? "digest" : "sampled",
             cscu_digest_engine(cscu_segment_count ? cscu_segments[0].kind : CSCU_KIND_CRC32),
             cscu_config()->threads, staged ? "true" : "false", h->spent[0], h->spent[1], h->spent[2], h->zero,
             h->moved[0], h->moved[1], h->moved[2]);
}

void cscu_hydrate(const char *dir, const char *policy, int digests, char *out, size_t room)
{
    struct hydration h;
    int ok = begin(&h, dir, policy) == 0;
    h.phase = ok ? "hydrate: create" : h.phase;
    for (size_t i = 0; ok && i < h.count; i++) {
        CUresult rc;
        if (h.regions[i].handle)
            continue;
        if ((rc = cscu_driver()->ctx_set_current(h.regions[i].context)) != CUDA_SUCCESS
            || (rc = cscu_map(&h.regions[i])) != CUDA_SUCCESS) {
            snprintf(h.error, sizeof(h.error), "region %#llx (%zu bytes) on %s: %s", h.regions[i].address,
                     h.regions[i].size, h.regions[i].uuid, cscu_error_name(rc));
            ok = 0;
            break;
        }
        h.created[i] = 1;
        h.restored++;
    }
    if (ok) {
        h.place_s = cscu_now() - h.t0 - h.check_s;
        h.phase = "hydrate: fill";
        ok = fill_and_check(h.fds, h.take, digests, h.spent, h.moved, h.error, sizeof(h.error)) == 0;
        h.fill_s = cscu_now() - h.t0 - h.check_s - h.place_s;
    }
    finish(&h, ok, policy, digests, 0, out, room);
}

/* --- hydrate from staged allocations ------------------------------------------------------------------------ */
typedef CUresult (*import_fn)(CUmemGenericAllocationHandle *, void *, int);
typedef CUresult (*props_fn)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
/* Import staged allocation `fd` and map it whole (offset 0: cuMemMap's offset must be zero, and a part of a larger
 * allocation is refused) at region r's address, read-write for r's device. The imported handle is the mapping's
 * own reference (r->handle), so the next release unmaps and releases it like a created one. */
static CUresult adopt_one(struct cscu_region *r, int fd, import_fn import, props_fn props, char *why, size_t room)
{
    const struct cscu_driver *d = cscu_driver();
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, r->device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle held = 0;
    CUmemAllocationProp prop;
    CUresult rc;
    if ((rc = d->ctx_set_current(r->context)) != CUDA_SUCCESS
        || (rc = import(&held, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) != CUDA_SUCCESS)
        return rc;
    memset(&prop, 0, sizeof(prop));
    /* The hydrator stages only on the engine's GPU (by UUID); where the driver can say, check it again here. */
    if (props && props(&prop, held) == CUDA_SUCCESS
        && (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != r->device)) {
        snprintf(why, room, "it lives on device %d, the region on device %d", prop.location.id, r->device);
        d->release(held);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if ((rc = d->map(r->address, r->size, 0, held, 0)) == CUDA_SUCCESS) {
        if ((rc = d->set_access(r->address, r->size, &access, 1)) == CUDA_SUCCESS) {
            r->handle = held;
            if (r->vmm)  /* an engine allocation (one whole mapping, cscu_vmm_stageable): its record follows */
                cscu_vmm_backed(r, held);
            return CUDA_SUCCESS;
        }
        d->unmap(r->address, r->size);
    }
    d->release(held);
    return rc;
}

/* Map staged allocation k onto the k-th released region (table order); 0, or -1 with h->error naming both. */
static int adopt_all(struct hydration *h, const int *staged, size_t n)
{
    import_fn import = (import_fn)cscu_real("cuMemImportFromShareableHandle");
    props_fn props = (props_fn)cscu_real("cuMemGetAllocationPropertiesFromHandle");
    size_t k = 0;
    if (!import) {
        snprintf(h->error, sizeof(h->error), "the driver has no cuMemImportFromShareableHandle");
        return -1;
    }
    k = 0;
    for (size_t i = 0; i < h->count; i++) {
        struct cscu_region *r = &h->regions[i];
        char why[128] = "";
        if (r->handle)
            continue;
        CUresult rc = adopt_one(r, staged[k], import, props, why, sizeof(why));
        if (rc != CUDA_SUCCESS) {
            snprintf(h->error, sizeof(h->error), "region %#llx (%zu bytes), staged allocation %zu of %zu: %s%s%s",
                     r->address, r->size, k, n, cscu_error_name(rc), why[0] ? ": " : "", why);
            return -1;
        }
        h->created[i] = 1;
        h->restored++;
        k++;
    }
    return 0;
}

/* --- hydrate by copying from staged groups ------------------------------------------------------------------ */
typedef CUresult (*dtod_fn)(CUdeviceptr, CUdeviceptr, size_t);
typedef CUresult (*memset_sync_fn)(CUdeviceptr, unsigned char, size_t);

/* Region i from its copy in the staged range at `from`, chunk by chunk: a chunk the release recorded as zeros is
 * set (HBM written once, not read and written), the others copied HBM to HBM. */
static CUresult copy_region(struct hydration *h, size_t i, CUdeviceptr from, dtod_fn dtod)
{
    static memset_sync_fn set;
    struct cscu_region *r = &h->regions[i];
    CUresult rc = CUDA_SUCCESS;
    if (!set)
        set = (memset_sync_fn)cscu_real("cuMemsetD8_v2");
    for (size_t s = 0; s < cscu_segment_count && rc == CUDA_SUCCESS; s++) {
        const struct segment *seg = &cscu_segments[s];
        for (size_t at = 0; seg->region == i && at < seg->size && rc == CUDA_SUCCESS; at += CSCU_DIGEST_CHUNK) {
            size_t n = seg->size - at < CSCU_DIGEST_CHUNK ? seg->size - at : CSCU_DIGEST_CHUNK;
            int zero = set && (seg->zero >> (at / CSCU_DIGEST_CHUNK) & 1);
            rc = zero ? set(r->address + seg->offset + at, 0, n)
                      : dtod(r->address + seg->offset + at, from + seg->offset + at, n);
            h->moved[zero ? 0 : 2] += n;
        }
    }
    return rc;
}

/* The group of each released region (`group[i]`, table order; SIZE_MAX for one not released) and its offset in
 * the group's staged allocation: consecutive regions up to CSCU_STAGE_GROUP bytes, a larger one alone, as the
 * worker asked the node hydrator to stage them (memory/_device_dump.py). The number of groups. */
static size_t stage_groups(const struct cscu_region *regions, size_t count, size_t *group, size_t *offset)
{
    size_t groups = 0, bytes = 0;
    for (size_t i = 0; i < count; i++) {
        group[i] = SIZE_MAX;
        if (regions[i].handle)
            continue;
        if (groups == 0 || bytes + regions[i].size > CSCU_STAGE_GROUP)
            groups++, bytes = 0;
        group[i] = groups - 1, offset[i] = bytes;
        bytes += regions[i].size;
    }
    return groups;
}

/* Group g: its staged allocation (`*fd`, closed and set to -1 once imported) imported and mapped at a range of our own, each of its regions re-created
 * as a fill would (the engine's own with its properties, flags, mappings and access) and copied from it on the
 * device, then the staged allocation let go. 0, or -1 with h->error naming the group. */
static int copy_group(struct hydration *h, const size_t *group, const size_t *offset, size_t g, int *fd,
                      import_fn import, dtod_fn dtod)
{
    const struct cscu_driver *d = cscu_driver();
    size_t bytes = 0, first = SIZE_MAX;
    for (size_t i = 0; i < h->count; i++)
        if (group[i] == g)
            first = first == SIZE_MAX ? i : first, bytes = offset[i] + h->regions[i].size;
    struct cscu_region *lead = &h->regions[first];
    CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, lead->device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemGenericAllocationHandle held = 0;
    CUdeviceptr va = 0;
    int mapped = 0;
    CUresult rc = d->ctx_set_current(lead->context);
    if (rc == CUDA_SUCCESS && (rc = import(&held, (void *)(intptr_t)*fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        == CUDA_SUCCESS) {
        close(*fd);  /* the imported handle holds the allocation now: released below, it is freed */
        *fd = -1;
    }
    if (rc == CUDA_SUCCESS)
        rc = d->address_reserve(&va, bytes, 0, 0, 0);
    if (rc == CUDA_SUCCESS && (rc = d->map(va, bytes, 0, held, 0)) == CUDA_SUCCESS)
        mapped = 1;
    if (rc == CUDA_SUCCESS)
        rc = d->set_access(va, bytes, &access, 1);
    for (size_t i = first; i < h->count && rc == CUDA_SUCCESS; i++) {
        struct cscu_region *r = &h->regions[i];
        if (group[i] != g)
            continue;
        if ((rc = d->ctx_set_current(r->context)) != CUDA_SUCCESS || (rc = cscu_map(r)) != CUDA_SUCCESS)
            break;
        h->created[i] = 1, h->restored++;
        rc = copy_region(h, i, va + offset[i], dtod);
    }
    if (rc == CUDA_SUCCESS)  /* the copies are done before the staged allocation goes */
        rc = d->ctx_synchronize();
    if (rc != CUDA_SUCCESS)
        snprintf(h->error, sizeof(h->error), "staged allocation %zu (%zu bytes, from region %#llx): %s", g, bytes,
                 lead->address, cscu_error_name(rc));
    if (mapped)
        d->unmap(va, bytes);
    if (va)
        d->address_free(va, bytes);
    if (held)
        d->release(held);
    return rc == CUDA_SUCCESS ? 0 : -1;
}

/* Every group copied in turn: a group's staged allocation is let go (its descriptor closed, its handle released)
 * before the next one's regions are made, so a hydration needs at most one group's bytes beyond what the stage
 * holds, once the worker and the hydrator have let go of their descriptors. 0, or -1 with h->error set. */
static int copy_all(struct hydration *h, int *staged, size_t n)
{
    import_fn import = (import_fn)cscu_real("cuMemImportFromShareableHandle");
    dtod_fn dtod = (dtod_fn)cscu_real("cuMemcpyDtoD_v2");
    size_t *group = malloc((h->count + 1) * sizeof(size_t)), *offset = malloc((h->count + 1) * sizeof(size_t));
    int rc = -1;
    if (!group || !offset || !import || !dtod)
        snprintf(h->error, sizeof(h->error), "%s", !import || !dtod ? "the driver has no cuMemImportFromShareableHandle "
                 "or cuMemcpyDtoD_v2" : "out of host memory");
    else if (stage_groups(h->regions, h->count, group, offset) != n)
        snprintf(h->error, sizeof(h->error), "%zu staged allocations for another grouping of the regions", n);
    else
        for (size_t g = rc = 0; g < n && rc == 0; g++)
            rc = copy_group(h, group, offset, g, &staged[g], import, dtod);
    free(group);
    free(offset);
    return rc;
}

/* How the staged allocations stand in for the released regions: 1 adopted, one per region (each adoptable), 2
 * copied from, one per group of them (stage_groups), 0 neither (the refusal in `why`). */
static int stage_mode(size_t n, char *why, size_t room)
{
    size_t count, released = 0;
    struct cscu_region *regions = cscu_regions(&count);
    size_t *group = malloc((count + 1) * sizeof(size_t)), *offset = malloc((count + 1) * sizeof(size_t));
    int stageable = 1, mode = 0;
    for (size_t i = 0; i < count; i++) {
        released += regions[i].handle == 0;
        stageable = stageable && (regions[i].handle || cscu_vmm_stageable(&regions[i]));
    }
    if (stageable && n == released)
        mode = 1;
    else if (group && offset && stage_groups(regions, count, group, offset) == n)
        mode = 2;
    else
        snprintf(why, room, "%zu staged allocations: neither one per released region (%zu, each adoptable: %s) nor "
                 "one per group of them", n, released, stageable ? "yes" : "no");
    free(group);
    free(offset);
    return mode;
}

void cscu_hydrate_staged(const char *dir, const char *policy, int *fds, size_t n, char *out, size_t room)
{
    struct hydration h;
    char why[256];
    int mode = stage_mode(n, why, sizeof(why));
    if (!mode) {  /* before anything is opened or asked of the driver; the worker then fills them itself */
        cscu_refuse(out, room, "hydrate", "%s", why);
        return;
    }
    int ok = begin(&h, dir, policy) == 0;
    if (ok) {
        h.phase = mode == 1 ? "hydrate: adopt" : "hydrate: copy";
        ok = (mode == 1 ? adopt_all(&h, fds, n) : copy_all(&h, fds, n)) == 0;
        h.place_s = cscu_now() - h.t0 - h.check_s;
    }
    finish(&h, ok, policy, 0, mode, out, room);
}

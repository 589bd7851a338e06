/* Hydrate: re-create the released regions at their addresses (or map the parts of an allocation a node hydrator
 * staged), fill them from the dump, verify, and only then let the engine run. A failure (a dump shorter than its
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
    cscu_devices_forget();
    for (size_t i = 0; i < count; i++) {
        struct cscu_region *r = &regions[i];
        char uuid[48], name[96];
        CUdevice dev;
        CUresult rc;
        if (r->handle)
            continue;
        if ((rc = d->ctx_set_current(r->context)) != CUDA_SUCCESS || (rc = d->ctx_get_device(&dev)) != CUDA_SUCCESS
            || cscu_device_identity(dev, uuid, name) != 0) {
            snprintf(error, room, "region %#llx: its context's device cannot be read: %s", r->address,
                     cscu_error_name(rc));
            return -1;
        }
        if (strcmp(name, r->name) != 0 || (strcmp(policy, "same-gpu") == 0 && strcmp(uuid, r->uuid) != 0)) {
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

/* Sampled read-back: the first and last bytes of each segment on the device equal the file's. */
static int verify_samples(const int *fds, const char *take, char *error, size_t room)
{
    const struct cscu_driver *d = cscu_driver();
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    char *device = malloc(SAMPLE), *file = malloc(SAMPLE);
    int bad = !device || !file;
    for (size_t i = 0; i < cscu_segment_count && !bad; i++) {
        struct cscu_region *r = &regions[cscu_segments[i].region];
        size_t n = cscu_segments[i].size < SAMPLE ? cscu_segments[i].size : SAMPLE;
        size_t starts[2] = {0, cscu_segments[i].size - n};
        if (!take[i])
            continue;
        for (int k = 0; k < 2 && !bad; k++) {
            CUresult rc = d->ctx_set_current(r->context);
            if (rc == CUDA_SUCCESS)
                rc = d->memcpy_dtoh(device, r->address + cscu_segments[i].offset + starts[k], n);
            bad = rc != CUDA_SUCCESS || cscu_full_io(1, fds[i], file, n, (off_t)starts[k]) != 0
                  || memcmp(device, file, n) != 0;
            if (bad)
                snprintf(error, room, "%s at +%zu: the device bytes differ from the dump after the fill (%s)",
                         cscu_segments[i].file, starts[k], cscu_error_name(rc));
        }
    }
    free(device);
    free(file);
    return bad ? -1 : 0;
}

static int fill_and_check(int *fds, const char *take, int digests, char *error, size_t room)
{
    struct job job = {.lock = PTHREAD_MUTEX_INITIALIZER, .fds = fds, .digests = digests};
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    if (cscu_copy(&job, 1, take) != 0) {
        snprintf(error, room, "%s", job.error);
        free(job.items);
        return -1;
    }
    for (size_t i = 0; i < cscu_segment_count; i++) {
        char found[80];
        if (!take[i] || !digests)
            continue;
        cscu_segment_digest(&job, i, found);
        if (strcmp(found, cscu_segments[i].digest) != 0) {
            snprintf(error, room, "dump file %s (region %#llx, +%zu) does not match its digest: expected %s, found "
                     "%s: a corrupt or foreign dump", cscu_segments[i].file, regions[cscu_segments[i].region].address,
                     cscu_segments[i].offset, cscu_segments[i].digest, found);
            free(job.items);
            return -1;
        }
    }
    free(job.items);
    return 0;
}

void cscu_hydrate(const char *dir, const char *policy, int digests, char *out, size_t room)
{
    double t0 = cscu_now(), check, create, fill;
    size_t count, bytes = 0, restored = 0;
    struct cscu_region *regions = cscu_regions(&count);
    char error[1024], *take = calloc(cscu_segment_count + 1, 1), *created = calloc(count + 1, 1);
    int *fds = malloc((cscu_segment_count + 1) * sizeof(int));
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const char *phase = "hydrate";
    if (!take || !created || !fds) {
        snprintf(error, sizeof(error), "out of host memory");
        goto failed;
    }
    for (size_t i = 0; i < cscu_segment_count; i++) {
        fds[i] = -1;
        take[i] = regions[cscu_segments[i].region].handle == 0;
        bytes += take[i] ? cscu_segments[i].size : 0;
    }
    if (dirfd < 0) {
        snprintf(error, sizeof(error), "dump directory %s: %s", dir, strerror(errno));
        goto failed;
    }
    if (open_dump(dirfd, dir, fds, take, error, sizeof(error)) != 0
        || check_devices(policy, error, sizeof(error)) != 0)
        goto failed;
    check = cscu_now() - t0;
    phase = "hydrate: create";
    for (size_t i = 0; i < count; i++) {
        CUresult rc;
        if (regions[i].handle)
            continue;
        if ((rc = cscu_driver()->ctx_set_current(regions[i].context)) != CUDA_SUCCESS
            || (rc = cscu_map(&regions[i])) != CUDA_SUCCESS) {
            snprintf(error, sizeof(error), "region %#llx (%zu bytes) on %s: %s", regions[i].address, regions[i].size,
                     regions[i].uuid, cscu_error_name(rc));
            goto failed;
        }
        created[i] = 1;
        restored++;
    }
    create = cscu_now() - t0 - check;
    phase = "hydrate: fill";
    if (fill_and_check(fds, take, digests, error, sizeof(error)) != 0)
        goto failed;
    fill = cscu_now() - t0 - check - create;
    phase = "hydrate: verify";
    if (verify_samples(fds, take, error, sizeof(error)) != 0)
        goto failed;
    cscu_close_files(dirfd, fds, 0);
    free(take);
    free(created);
    double total = cscu_now() - t0;
    snprintf(out, room, "{\"ok\":true,\"report\":{\"bytes\":%zu,\"regions\":%zu,\"segments\":%zu,\"seconds\":%.6f,"
             "\"gbps\":%.3f,\"check_s\":%.6f,\"create_s\":%.6f,\"fill_s\":%.6f,\"verify_s\":%.6f,\"policy\":\"%s\","
             "\"verify\":\"%s\",\"digest_engine\":\"%s\",\"threads\":%d}}", bytes, restored, cscu_segment_count, total,
             fill > 0 ? (double)bytes / fill / 1e9 : 0.0, check, create, fill, total - check - create - fill, policy,
             digests ? "digest" : "sampled", cscu_sha256_engine(), cscu_config()->threads);
    return;
failed:
    if (created)
        undo(regions, created, count);  /* nothing half-hydrated stays mapped; the gate stays closed */
    if (dirfd >= 0)
        cscu_close_files(dirfd, fds, 0);
    else
        free(fds);
    free(take);
    free(created);
    cscu_refuse(out, room, phase, "%s", error);
}

/* --- hydrate from a staged allocation ---------------------------------------------------------------------- */
typedef CUresult (*import_fn)(CUmemGenericAllocationHandle *, void *, int);
typedef CUresult (*retain_fn)(CUmemGenericAllocationHandle *, void *);

/* Map each released region onto its part of `staged` (consecutive, table order); each mapping holds its own
 * reference (cuMemRetainAllocationHandle), so a later release unmaps and releases it like a created one. */
static int adopt_parts(CUmemGenericAllocationHandle staged, char *created, char *error, size_t room)
{
    const struct cscu_driver *d = cscu_driver();
    retain_fn retain = (retain_fn)cscu_real("cuMemRetainAllocationHandle");
    size_t count, at = 0;
    struct cscu_region *regions = cscu_regions(&count);
    for (size_t i = 0; i < count; i++) {
        struct cscu_region *r = &regions[i];
        CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, r->device}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CUmemGenericAllocationHandle held = 0;
        CUresult rc = CUDA_ERROR_NOT_FOUND;
        if (r->handle)
            continue;
        if (retain && (rc = d->ctx_set_current(r->context)) == CUDA_SUCCESS
            && (rc = d->map(r->address, r->size, at, staged, 0)) == CUDA_SUCCESS) {
            if ((rc = d->set_access(r->address, r->size, &access, 1)) == CUDA_SUCCESS
                && (rc = retain(&held, (void *)(uintptr_t)r->address)) == CUDA_SUCCESS) {
                r->handle = held;
                created[i] = 1;
                at += r->size;
                continue;
            }
            d->unmap(r->address, r->size);
        }
        snprintf(error, room, "region %#llx (%zu bytes at +%zu of the staged allocation): %s", r->address, r->size,
                 at, retain ? cscu_error_name(rc) : "cuMemRetainAllocationHandle is missing");
        return -1;
    }
    return 0;
}

void cscu_hydrate_staged(const char *dir, const char *policy, int fd, size_t bytes, char *out, size_t room)
{
    double t0 = cscu_now(), check, adopt;
    size_t count, wanted = 0;
    struct cscu_region *regions = cscu_regions(&count);
    char error[1024], *take = calloc(cscu_segment_count + 1, 1), *created = calloc(count + 1, 1);
    int *fds = malloc((cscu_segment_count + 1) * sizeof(int));
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    import_fn import = (import_fn)cscu_real("cuMemImportFromShareableHandle");
    CUmemGenericAllocationHandle staged = 0;
    const char *phase = "hydrate";
    if (!take || !created || !fds) {
        snprintf(error, sizeof(error), "out of host memory");
        goto failed;
    }
    for (size_t i = 0; i < count; i++)
        wanted += regions[i].handle ? 0 : regions[i].size;
    for (size_t i = 0; i < cscu_segment_count; i++) {
        fds[i] = -1;
        take[i] = regions[cscu_segments[i].region].handle == 0;
    }
    if (dirfd < 0) {
        snprintf(error, sizeof(error), "dump directory %s: %s", dir, strerror(errno));
        goto failed;
    }
    if (bytes != wanted) {
        snprintf(error, sizeof(error), "the staged allocation holds %zu bytes, the released regions %zu", bytes, wanted);
        goto failed;
    }
    if (open_dump(dirfd, dir, fds, take, error, sizeof(error)) != 0
        || check_devices(policy, error, sizeof(error)) != 0)
        goto failed;
    check = cscu_now() - t0;
    phase = "hydrate: adopt";
    CUresult rc = import ? import(&staged, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
                         : CUDA_ERROR_NOT_FOUND;
    if (rc != CUDA_SUCCESS) {
        snprintf(error, sizeof(error), "import the staged allocation: %s", cscu_error_name(rc));
        goto failed;
    }
    if (adopt_parts(staged, created, error, sizeof(error)) != 0)
        goto failed;
    cscu_driver()->release(staged);  /* the mappings hold their own references */
    staged = 0;
    adopt = cscu_now() - t0 - check;
    phase = "hydrate: verify";
    if (verify_samples(fds, take, error, sizeof(error)) != 0)
        goto failed;
    cscu_close_files(dirfd, fds, 0);
    free(take);
    free(created);
    double total = cscu_now() - t0;
    snprintf(out, room, "{\"ok\":true,\"report\":{\"bytes\":%zu,\"segments\":%zu,\"seconds\":%.6f,\"gbps\":0,"
             "\"check_s\":%.6f,\"adopt_s\":%.6f,\"verify_s\":%.6f,\"policy\":\"%s\",\"verify\":\"sampled\","
             "\"staged\":true}}", bytes, cscu_segment_count, total, check, adopt, total - check - adopt, policy);
    return;
failed:
    if (created)
        undo(regions, created, count);  /* nothing half-adopted stays mapped; the gate stays closed */
    if (staged)
        cscu_driver()->release(staged);
    if (dirfd >= 0)
        cscu_close_files(dirfd, fds, 0);
    else
        free(fds);
    free(take);
    free(created);
    cscu_refuse(out, room, phase, "%s", error);
}

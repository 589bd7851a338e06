/* Release (dump every region, then unmap and release its backing, the reservation kept) and hydrate (re-create
 * at the same addresses, fill from the dump, verify, and only then let the engine run).
 *
 * The dump is one file per segment (at most 1 GiB of one region: tmpfs serialises the writes to one file, so
 * several files are written at once), named seg-<n>.bin, 0600, created exclusively in the directory the worker
 * names. Copy threads (COLDSNAP_CUDA_INTERPOSER_THREADS), each with its own two streams and two page-locked
 * staging buffers, take 64 MiB chunks in turn: device to host on one buffer while the other is digested and
 * written (release), read and digested while the other is copied to the device (hydrate). A segment's digest
 * is hydration/_weights.py's `sha256-64m`: SHA-256 over the SHA-256 of each 64 MiB chunk.
 *
 * Failure: a release that fails before unmapping removes its files and changes nothing; a hydrate that fails
 * (a dump shorter than its manifest, a digest mismatch, another GPU model, out of memory) releases what it
 * created, and the regions stay released with the gate closed: nothing half-hydrated runs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cscu.h"

#define SAMPLE ((size_t)64 << 10)

struct segment {
    size_t region, offset, size;    /* a part of region `region` at `offset` */
    char file[32];
    char digest[80];                /* sha256-64m:<hex>, recorded at release */
};
struct item { size_t segment, offset, size; unsigned char digest[32]; };
struct job {
    struct item *items;
    size_t count, next;
    struct segment *segments;
    int *fds;
    int fill;                       /* 0: device to files, 1: files to device */
    int digests;                    /* digest what is copied (always on release; on hydrate unless told not) */
    int failed;
    pthread_mutex_t lock;
    char error[512];
};

/* Invariant: while released, `segments` describes the dump of the current region table (alloc/free wait). */
static struct segment *segments;
static size_t segment_count;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void fail(struct job *job, const char *format, ...)
{
    pthread_mutex_lock(&job->lock);
    if (!job->failed) {
        va_list args;
        va_start(args, format);
        vsnprintf(job->error, sizeof(job->error), format, args);
        va_end(args);
        job->failed = 1;
    }
    pthread_mutex_unlock(&job->lock);
}

static int full_io(int fill, int fd, void *buffer, size_t size, off_t offset)
{
    for (size_t done = 0; done < size;) {
        ssize_t n = fill ? pread(fd, (char *)buffer + done, size - done, offset + (off_t)done)
                         : pwrite(fd, (char *)buffer + done, size - done, offset + (off_t)done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            if (n == 0)
                errno = EIO;  /* a short file: reported as the dump ending early */
            return -1;
        }
        done += (size_t)n;
    }
    return 0;
}

/* One chunk: pieces of the staging size through two buffers and two streams. 0, or -1 with the job failed. */
static int copy_pieces(struct job *job, struct item *it, CUstream s[2], void *buf[2], size_t staging,
                       cscu_sha256 *h)
{
    const struct cscu_driver *d = cscu_driver();
    size_t count;
    struct segment *seg = &job->segments[it->segment];
    struct cscu_region *r = &cscu_regions(&count)[seg->region];
    CUdeviceptr base = r->address + seg->offset + it->offset;
    size_t pieces = (it->size + staging - 1) / staging;
    int fd = job->fds[it->segment];
    CUresult rc = CUDA_SUCCESS;
    if (!job->fill && (rc = d->memcpy_dtoh_async(buf[0], base, it->size < staging ? it->size : staging, s[0])))
        goto device;
    for (size_t k = 0; k < pieces && !job->failed; k++) {
        size_t at = k * staging, n = it->size - at < staging ? it->size - at : staging, next = at + staging;
        int slot = (int)(k % 2);
        if (!job->fill) {  /* the next piece comes off the device while this one is digested and written */
            if (k + 1 < pieces && (rc = d->memcpy_dtoh_async(buf[1 - slot], base + next,
                                                             it->size - next < staging ? it->size - next : staging,
                                                             s[1 - slot])))
                goto device;
            if ((rc = d->stream_synchronize(s[slot])))
                goto device;
            cscu_sha256_update(h, buf[slot], n);
            if (full_io(0, fd, buf[slot], n, (off_t)(it->offset + at)) != 0) {
                fail(job, "write %s: %s", seg->file, strerror(errno));
                return -1;
            }
        } else {  /* the buffer's last copy (this chunk's or the previous one's) is done before it is refilled */
            if ((rc = d->stream_synchronize(s[slot])))
                goto device;
            if (full_io(1, fd, buf[slot], n, (off_t)(it->offset + at)) != 0) {
                fail(job, "read %s at %zu: %s (the dump is shorter than its manifest or unreadable)", seg->file,
                     it->offset + at, errno == EIO ? "it ends early" : strerror(errno));
                return -1;
            }
            if (job->digests)
                cscu_sha256_update(h, buf[slot], n);
            if ((rc = d->memcpy_htod_async(base + at, buf[slot], n, s[slot])))
                goto device;
        }
    }
    return job->failed ? -1 : 0;
device:
    fail(job, "copy %s region %#llx: %s", job->fill ? "to" : "from", r->address, cscu_error_name(rc));
    return -1;
}

static void one_chunk(struct job *job, struct item *it, CUstream s[2], void *buf[2], size_t staging)
{
    cscu_sha256 h;
    cscu_sha256_init(&h);
    copy_pieces(job, it, s, buf, staging, &h);
    cscu_sha256_final(&h, it->digest);  /* also on failure: it frees libcrypto's context */
}

static void *copy_thread(void *arg)
{
    struct job *job = arg;
    const struct cscu_driver *d = cscu_driver();
    const struct cscu_config *cfg = cscu_config();
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    CUstream s[2] = {0, 0};
    void *buf[2] = {0, 0};
    CUcontext current = NULL;
    for (;;) {
        size_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_ACQ_REL);
        if (i >= job->count || __atomic_load_n(&job->failed, __ATOMIC_ACQUIRE))
            break;
        struct item *it = &job->items[i];
        CUcontext ctx = regions[job->segments[it->segment].region].context;
        if (ctx != current) {  /* streams belong to a context; page-locked buffers are portable (flag 1) */
            for (int k = 0; k < 2; k++)
                if (s[k]) {
                    d->stream_synchronize(s[k]);
                    d->stream_destroy(s[k]);
                    s[k] = 0;
                }
            CUresult rc = d->ctx_set_current(ctx);
            for (int k = 0; k < 2 && rc == CUDA_SUCCESS; k++)
                if ((rc = d->stream_create(&s[k], CU_STREAM_NON_BLOCKING)) == CUDA_SUCCESS && !buf[k])
                    rc = d->host_alloc(&buf[k], cfg->staging, 1);
            if (rc != CUDA_SUCCESS) {
                fail(job, "copy thread set-up: %s", cscu_error_name(rc));
                break;
            }
            current = ctx;
        }
        one_chunk(job, it, s, buf, cfg->staging);
    }
    for (int k = 0; k < 2; k++) {
        if (s[k]) {
            CUresult rc = d->stream_synchronize(s[k]);
            if (rc)
                fail(job, "copy: %s", cscu_error_name(rc));
            d->stream_destroy(s[k]);
        }
        if (buf[k])
            d->free_host(buf[k]);
    }
    return NULL;
}

/* Chunks of every segment that `take` marks, interleaved across segments so that the threads write different
 * files at once, copied by the threads. 0, or -1 with `job->error` set. */
static int run(struct job *job, int fill, const char *take)
{
    size_t most = 0, rounds = 0, n = 0;
    for (size_t i = 0; i < segment_count; i++) {
        size_t chunks = (segments[i].size + CSCU_DIGEST_CHUNK - 1) / CSCU_DIGEST_CHUNK;
        most += chunks;
        rounds = chunks > rounds ? chunks : rounds;
    }
    job->items = calloc(most ? most : 1, sizeof(struct item));
    if (!job->items) {
        snprintf(job->error, sizeof(job->error), "out of host memory");
        return -1;
    }
    for (size_t round = 0; round < rounds; round++)
        for (size_t i = 0; i < segment_count; i++) {
            size_t at = round * CSCU_DIGEST_CHUNK;
            if (!take[i] || at >= segments[i].size)
                continue;
            size_t size = segments[i].size - at < CSCU_DIGEST_CHUNK ? segments[i].size - at : CSCU_DIGEST_CHUNK;
            job->items[n++] = (struct item){i, at, size, {0}};
        }
    job->count = n;
    job->segments = segments;
    job->fill = fill;
    int threads = cscu_config()->threads < (int)n ? cscu_config()->threads : (int)n;
    pthread_t ids[64];
    int made = 0;
    for (; made < threads; made++)
        if (pthread_create(&ids[made], NULL, copy_thread, job) != 0)
            break;
    if (made == 0 && n)
        copy_thread(job);
    for (int i = 0; i < made; i++)
        pthread_join(ids[i], NULL);
    return job->failed ? -1 : 0;
}

/* The segment digest from its chunk digests, in chunk order. */
static void segment_digest(const struct job *job, size_t segment, char out[80])
{
    cscu_sha256 h;
    unsigned char digest[32];
    cscu_sha256_init(&h);
    for (size_t round = 0; round * CSCU_DIGEST_CHUNK < segments[segment].size; round++)
        for (size_t i = 0; i < job->count; i++)
            if (job->items[i].segment == segment && job->items[i].offset == round * CSCU_DIGEST_CHUNK)
                cscu_sha256_update(&h, job->items[i].digest, 32);
    cscu_sha256_final(&h, digest);
    int n = snprintf(out, 80, "sha256-64m:");
    for (int i = 0; i < 32; i++)
        n += snprintf(out + n, (size_t)(80 - n), "%02x", digest[i]);
}


/* --- answers ------------------------------------------------------------------------------------------------ */
struct answer { char *out; size_t room, used; };

static void put(struct answer *a, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    int n = vsnprintf(a->out + a->used, a->used < a->room ? a->room - a->used : 0, format, args);
    va_end(args);
    a->used += n > 0 ? (size_t)n : 0;
}

/* `text` as a JSON string body (quotes and backslashes escaped, control characters dropped). */
static void put_text(struct answer *a, const char *text)
{
    for (const char *p = text; *p; p++)
        if (*p == '"' || *p == '\\')
            put(a, "\\%c", *p);
        else if ((unsigned char)*p >= 0x20)
            put(a, "%c", *p);
}

static void refuse(char *out, size_t room, const char *phase, const char *format, ...)
{
    char text[1024];
    struct answer a = {out, room, 0};
    va_list args;
    va_start(args, format);
    vsnprintf(text, sizeof(text), format, args);
    va_end(args);
    put(&a, "{\"ok\":false,\"error\":\"%s: ", phase);
    put_text(&a, text);
    put(&a, "\"}");
}

static void manifest(struct answer *a, const char *dir, double seconds[4], size_t bytes)
{
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    put(a, "{\"ok\":true,\"manifest\":{\"format\":1,\"kind\":\"coldsnap-device-dump\",\"pid\":%d,\"dir\":\"",
        (int)getpid());
    put_text(a, dir);
    put(a, "\",\"digest_engine\":\"%s\",\"segment_bytes\":%zu,\"threshold\":%zu,\"bytes\":%zu,\"regions\":[",
        cscu_sha256_engine(), CSCU_SEGMENT, cscu_config()->threshold, bytes);
    for (size_t i = 0, s = 0; i < count; i++) {
        struct cscu_region *r = &regions[i];
        put(a, "%s{\"address\":%llu,\"size\":%zu,\"requested\":%zu,\"device\":%d,\"device_uuid\":\"%s\","
            "\"device_name\":\"", i ? "," : "", r->address, r->size, r->requested, r->device, r->uuid);
        put_text(a, r->name);
        put(a, "\",\"segments\":[");
        for (int first = 1; s < segment_count && segments[s].region == i; s++, first = 0)
            put(a, "%s{\"file\":\"%s\",\"offset\":0,\"address\":%llu,\"size\":%zu,\"digest\":\"%s\"}", first ? "" : ",",
                segments[s].file, r->address + segments[s].offset, segments[s].size, segments[s].digest);
        put(a, "]}");
    }
    put(a, "],\"uncovered\":");
    if (a->used < a->room)
        a->used += cscu_counts_json(a->out + a->used, a->room - a->used);
    put(a, ",\"timings_s\":{\"synchronize\":%.6f,\"dump\":%.6f,\"unmap\":%.6f},\"gbps\":%.3f}}",
        seconds[1], seconds[2], seconds[3], seconds[2] > 0 ? (double)bytes / seconds[2] / 1e9 : 0.0);
}

/* --- release ------------------------------------------------------------------------------------------------- */
static int plan_segments(struct cscu_region *regions, size_t count)
{
    size_t n = 0;
    for (size_t i = 0; i < count; i++)
        n += (regions[i].size + CSCU_SEGMENT - 1) / CSCU_SEGMENT;
    free(segments);
    segment_count = 0;
    if (!(segments = calloc(n ? n : 1, sizeof(*segments))))
        return -1;
    for (size_t i = 0; i < count; i++)
        for (size_t at = 0; at < regions[i].size; at += CSCU_SEGMENT, segment_count++) {
            struct segment *s = &segments[segment_count];
            s->region = i;
            s->offset = at;
            s->size = regions[i].size - at < CSCU_SEGMENT ? regions[i].size - at : CSCU_SEGMENT;
            snprintf(s->file, sizeof(s->file), "seg-%zu.bin", segment_count);
        }
    return 0;
}

static void close_files(int dirfd, int *fds, int remove)
{
    for (size_t i = 0; fds && i < segment_count; i++)
        if (fds[i] >= 0) {
            close(fds[i]);
            if (remove)
                unlinkat(dirfd, segments[i].file, 0);
        }
    free(fds);
    close(dirfd);
}

static int synchronize_all(struct cscu_region *regions, size_t count, char *error, size_t room)
{
    const struct cscu_driver *d = cscu_driver();
    CUcontext done = NULL;
    for (size_t i = 0; i < count; i++) {
        if (regions[i].context == done)
            continue;
        CUresult rc = d->ctx_set_current(regions[i].context);
        if (rc == CUDA_SUCCESS)
            rc = d->ctx_synchronize();
        if (rc != CUDA_SUCCESS) {
            snprintf(error, room, "synchronise the context of region %#llx: %s", regions[i].address,
                     cscu_error_name(rc));
            return -1;
        }
        done = regions[i].context;
    }
    return 0;
}

void cscu_release(const char *dir, char *out, size_t room)
{
    double t0 = now(), seconds[4] = {0, 0, 0, 0};
    size_t count, bytes = 0;
    struct cscu_region *regions = cscu_regions(&count);
    struct job job = {.lock = PTHREAD_MUTEX_INITIALIZER, .digests = 1};
    struct stat st;
    char error[512];
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dirfd < 0) {
        refuse(out, room, "release", "dump directory %s: %s", dir, strerror(errno));
        return;
    }
    if (fstat(dirfd, &st) != 0 || (st.st_uid != geteuid() && st.st_uid != 0) || (st.st_mode & 022)) {
        close(dirfd);
        refuse(out, room, "release", "dump directory %s must belong to this process's user or root and be writable "
               "by no one else", dir);
        return;
    }
    if (synchronize_all(regions, count, error, sizeof(error)) != 0) {
        close(dirfd);
        refuse(out, room, "release", "%s", error);
        return;
    }
    seconds[1] = now() - t0;
    int *fds = NULL;
    if (plan_segments(regions, count) != 0 || !(fds = malloc((segment_count + 1) * sizeof(int)))) {
        close(dirfd);
        refuse(out, room, "release", "out of host memory");
        return;
    }
    char *take = malloc(segment_count + 1);
    for (size_t i = 0; i < segment_count; i++)
        fds[i] = -1;
    for (size_t i = 0; i < segment_count; i++)
        if ((fds[i] = openat(dirfd, segments[i].file, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                             0600)) < 0) {
            snprintf(error, sizeof(error), "create %s/%s: %s", dir, segments[i].file, strerror(errno));
            close_files(dirfd, fds, 1);
            free(take);
            refuse(out, room, "release", "%s", error);
            return;
        }
    job.fds = fds;
    if (take)
        memset(take, 1, segment_count + 1);
    if (!take || run(&job, 0, take) != 0) {
        close_files(dirfd, fds, 1);  /* nothing was unmapped: the engine runs on as before */
        refuse(out, room, "release", "dump to %s: %s", dir, take ? job.error : "out of host memory");
        free(job.items);
        free(take);
        return;
    }
    for (size_t i = 0; i < segment_count; i++) {
        segment_digest(&job, i, segments[i].digest);
        bytes += segments[i].size;
    }
    free(job.items);
    free(take);
    close_files(dirfd, fds, 0);
    seconds[2] = now() - t0 - seconds[1];
    const struct cscu_driver *d = cscu_driver();
    error[0] = '\0';
    for (size_t i = 0; i < count; i++) {
        CUresult rc = d->ctx_set_current(regions[i].context);
        if (rc == CUDA_SUCCESS)
            rc = cscu_unmap(&regions[i]);
        if (rc != CUDA_SUCCESS && !error[0])
            snprintf(error, sizeof(error), "unmap region %#llx: %s (what was released comes back with a hydrate)",
                     regions[i].address, cscu_error_name(rc));
    }
    seconds[3] = now() - t0 - seconds[1] - seconds[2];
    if (error[0]) {
        refuse(out, room, "release", "%s", error);
        return;
    }
    struct answer a = {out, room, 0};
    manifest(&a, dir, seconds, bytes);
    if (a.used >= room)
        refuse(out, room, "release", "the manifest is longer than %zu bytes", room);
}

/* --- hydrate ------------------------------------------------------------------------------------------------- */
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
    for (size_t i = 0; i < segment_count; i++) {
        struct stat st;
        if (!take[i])
            continue;
        if ((fds[i] = openat(dirfd, segments[i].file, O_RDONLY | O_NOFOLLOW | O_CLOEXEC)) < 0) {
            snprintf(error, room, "dump file %s/%s: %s", dir, segments[i].file, strerror(errno));
            return -1;
        }
        if (fstat(fds[i], &st) != 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size < segments[i].size) {
            snprintf(error, room, "dump file %s/%s holds %lld bytes, its manifest says %zu (region %#llx): the dump "
                     "is shorter than its manifest", dir, segments[i].file, (long long)st.st_size, segments[i].size,
                     regions[segments[i].region].address);
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
    for (size_t i = 0; i < segment_count && !bad; i++) {
        struct cscu_region *r = &regions[segments[i].region];
        size_t n = segments[i].size < SAMPLE ? segments[i].size : SAMPLE;
        size_t starts[2] = {0, segments[i].size - n};
        if (!take[i])
            continue;
        for (int k = 0; k < 2 && !bad; k++) {
            CUresult rc = d->ctx_set_current(r->context);
            if (rc == CUDA_SUCCESS)
                rc = d->memcpy_dtoh(device, r->address + segments[i].offset + starts[k], n);
            bad = rc != CUDA_SUCCESS || full_io(1, fds[i], file, n, (off_t)starts[k]) != 0
                  || memcmp(device, file, n) != 0;
            if (bad)
                snprintf(error, room, "%s at +%zu: the device bytes differ from the dump after the fill (%s)",
                         segments[i].file, starts[k], cscu_error_name(rc));
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
    if (run(&job, 1, take) != 0) {
        snprintf(error, room, "%s", job.error);
        free(job.items);
        return -1;
    }
    for (size_t i = 0; i < segment_count; i++) {
        char found[80];
        if (!take[i] || !digests)
            continue;
        segment_digest(&job, i, found);
        if (strcmp(found, segments[i].digest) != 0) {
            snprintf(error, room, "dump file %s (region %#llx, +%zu) does not match its digest: expected %s, found "
                     "%s: a corrupt or foreign dump", segments[i].file, regions[segments[i].region].address,
                     segments[i].offset, segments[i].digest, found);
            free(job.items);
            return -1;
        }
    }
    free(job.items);
    return 0;
}

void cscu_hydrate(const char *dir, const char *policy, int digests, char *out, size_t room)
{
    double t0 = now(), check, create, fill;
    size_t count, bytes = 0, restored = 0;
    struct cscu_region *regions = cscu_regions(&count);
    char error[1024], *take = calloc(segment_count + 1, 1), *created = calloc(count + 1, 1);
    int *fds = malloc((segment_count + 1) * sizeof(int));
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const char *phase = "hydrate";
    if (!take || !created || !fds) {
        snprintf(error, sizeof(error), "out of host memory");
        goto failed;
    }
    for (size_t i = 0; i < segment_count; i++) {
        fds[i] = -1;
        take[i] = regions[segments[i].region].handle == 0;
        bytes += take[i] ? segments[i].size : 0;
    }
    if (dirfd < 0) {
        snprintf(error, sizeof(error), "dump directory %s: %s", dir, strerror(errno));
        goto failed;
    }
    if (open_dump(dirfd, dir, fds, take, error, sizeof(error)) != 0
        || check_devices(policy, error, sizeof(error)) != 0)
        goto failed;
    check = now() - t0;
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
    create = now() - t0 - check;
    phase = "hydrate: fill";
    if (fill_and_check(fds, take, digests, error, sizeof(error)) != 0)
        goto failed;
    fill = now() - t0 - check - create;
    phase = "hydrate: verify";
    if (verify_samples(fds, take, error, sizeof(error)) != 0)
        goto failed;
    close_files(dirfd, fds, 0);
    free(take);
    free(created);
    double total = now() - t0;
    snprintf(out, room, "{\"ok\":true,\"report\":{\"bytes\":%zu,\"regions\":%zu,\"segments\":%zu,\"seconds\":%.6f,"
             "\"gbps\":%.3f,\"check_s\":%.6f,\"create_s\":%.6f,\"fill_s\":%.6f,\"verify_s\":%.6f,\"policy\":\"%s\","
             "\"verify\":\"%s\",\"digest_engine\":\"%s\",\"threads\":%d}}", bytes, restored, segment_count, total,
             fill > 0 ? (double)bytes / fill / 1e9 : 0.0, check, create, fill, total - check - create - fill, policy,
             digests ? "digest" : "sampled", cscu_sha256_engine(), cscu_config()->threads);
    return;
failed:
    if (created)
        undo(regions, created, count);  /* nothing half-hydrated stays mapped; the gate stays closed */
    if (dirfd >= 0)
        close_files(dirfd, fds, 0);
    else
        free(fds);
    free(take);
    free(created);
    refuse(out, room, phase, "%s", error);
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
    double t0 = now(), check, adopt;
    size_t count, wanted = 0;
    struct cscu_region *regions = cscu_regions(&count);
    char error[1024], *take = calloc(segment_count + 1, 1), *created = calloc(count + 1, 1);
    int *fds = malloc((segment_count + 1) * sizeof(int));
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
    for (size_t i = 0; i < segment_count; i++) {
        fds[i] = -1;
        take[i] = regions[segments[i].region].handle == 0;
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
    check = now() - t0;
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
    adopt = now() - t0 - check;
    phase = "hydrate: verify";
    if (verify_samples(fds, take, error, sizeof(error)) != 0)
        goto failed;
    close_files(dirfd, fds, 0);
    free(take);
    free(created);
    double total = now() - t0;
    snprintf(out, room, "{\"ok\":true,\"report\":{\"bytes\":%zu,\"segments\":%zu,\"seconds\":%.6f,\"gbps\":0,"
             "\"check_s\":%.6f,\"adopt_s\":%.6f,\"verify_s\":%.6f,\"policy\":\"%s\",\"verify\":\"sampled\","
             "\"staged\":true}}", bytes, segment_count, total, check, adopt, total - check - adopt, policy);
    return;
failed:
    if (created)
        undo(regions, created, count);  /* nothing half-adopted stays mapped; the gate stays closed */
    if (staged)
        cscu_driver()->release(staged);
    if (dirfd >= 0)
        close_files(dirfd, fds, 0);
    else
        free(fds);
    free(take);
    free(created);
    refuse(out, room, phase, "%s", error);
}

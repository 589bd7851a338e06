/* The copy engine, and release: dump every region, then unmap and release its backing, the reservation kept
 * (hydrate.c brings them back: re-create at the same addresses, fill from the dump, verify, then let the engine run).
 *
 * The dump is one file per segment (at most 1 GiB of one region: tmpfs serialises the writes to one file, so
 * several files are written at once), named seg-<n>.bin, 0600, created exclusively in the directory the worker
 * names. Copy threads (COLDSNAP_CUDA_INTERPOSER_THREADS), each with its own two streams and two page-locked
 * staging buffers, take 64 MiB chunks in turn: device to host on one buffer while the other is digested and
 * written (release), read and digested while the other is copied to the device (hydrate). A segment's digest
 * is per 64 MiB chunk (digest.h): `crc32-64m` by default, `sha256-64m` when COLDSNAP_CUDA_INTERPOSER_DIGEST says so
 * (hydration/_digests.py computes both). A block of zeros is not written: the file is created at its full size, so
 * the hole reads as zeros, and a chunk of zeros is recorded as such (the hydration sets it on the device).
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
#include "dump.h"

struct segment *cscu_segments;  /* see dump.h */
size_t cscu_segment_count;

double cscu_now(void)
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

int cscu_full_io(int fill, int fd, void *buffer, size_t size, off_t offset)
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

/* Where one copy thread's time went (thread-seconds), added to the job's when the thread ends. */
struct spent { double device, digest, io, zero; size_t zeroed, moved; };

/* Bytes digested then written at once: small enough to stay in the core's cache between the two passes. */
#define BLOCK ((size_t)256 << 10)

static int all_zero(const unsigned char *p, size_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0);  /* memcmp stops at the first byte that is not */
}

/* `n` bytes of chunk `it` at `at`, in `buf`: digested and written block by block (each block read once from
 * memory), a block of zeros not written (the file's hole reads as zeros); `it->zero` cleared by any other. */
static int digest_and_write(struct job *job, struct item *it, const unsigned char *buf, size_t n, size_t at,
                            struct cscu_chunk_digest *h, struct spent *t)
{
    int fd = job->fds[it->segment];
    for (size_t done = 0; done < n; done += BLOCK) {
        size_t k = n - done < BLOCK ? n - done : BLOCK;
        double t0 = cscu_now();
        cscu_chunk_update(h, buf + done, k);
        double t1 = cscu_now();
        int zero = all_zero(buf + done, k);
        double t2 = cscu_now();
        if (!zero && cscu_full_io(0, fd, (void *)(buf + done), k, (off_t)(it->offset + at + done)) != 0) {
            fail(job, "write %s: %s", job->segments[it->segment].file, strerror(errno));
            return -1;
        }
        it->zero &= zero;
        t->digest += t1 - t0, t->zero += t2 - t1, t->io += cscu_now() - t2;
    }
    return 0;
}

/* Release, one chunk: pieces of the staging size come off the device into one buffer while the other is
 * digested and written. 0, or -1 with the job failed. */
static int dump_pieces(struct job *job, struct item *it, CUstream s[2], void *buf[2], size_t staging,
                       struct cscu_chunk_digest *h, struct spent *t)
{
    const struct cscu_driver *d = cscu_driver();
    size_t count;
    struct cscu_region *r = &cscu_regions(&count)[job->segments[it->segment].region];
    CUdeviceptr base = r->address + job->segments[it->segment].offset + it->offset;
    size_t pieces = (it->size + staging - 1) / staging;
    CUresult rc = d->memcpy_dtoh_async(buf[0], base, it->size < staging ? it->size : staging, s[0]);
    it->zero = 1;
    for (size_t k = 0; k < pieces && rc == CUDA_SUCCESS && !job->failed; k++) {
        size_t at = k * staging, n = it->size - at < staging ? it->size - at : staging, next = at + staging;
        int slot = (int)(k % 2);
        double t0 = cscu_now();
        if (k + 1 < pieces && (rc = d->memcpy_dtoh_async(buf[1 - slot], base + next,
                                                         it->size - next < staging ? it->size - next : staging,
                                                         s[1 - slot])))
            break;
        if ((rc = d->stream_synchronize(s[slot])))
            break;
        t->device += cscu_now() - t0;
        if (digest_and_write(job, it, buf[slot], n, at, h, t) != 0)
            return -1;
    }
    if (rc != CUDA_SUCCESS)
        fail(job, "copy from region %#llx: %s", r->address, cscu_error_name(rc));
    return job->failed ? -1 : 0;
}

typedef CUresult (*memset_fn)(CUdeviceptr, unsigned char, size_t, CUstream);

/* Hydrate, one chunk: each buffer's last copy is done before it is refilled from the file, digested (when asked)
 * and copied to the device. A chunk the release recorded as zeros (the manifest's mask, which its digest binds;
 * never a hole found in the file) is set on the device instead, never read: with digests asked, one_chunk checks
 * it as the zeros it is. 0, or -1 with the job failed. */
static int fill_pieces(struct job *job, struct item *it, CUstream s[2], void *buf[2], size_t staging,
                       struct cscu_chunk_digest *h, struct spent *t)
{
    static memset_fn memset_async;
    const struct cscu_driver *d = cscu_driver();
    size_t count;
    struct segment *seg = &job->segments[it->segment];
    struct cscu_region *r = &cscu_regions(&count)[seg->region];
    CUdeviceptr base = r->address + seg->offset + it->offset;
    size_t pieces = (it->size + staging - 1) / staging;
    CUresult rc = CUDA_SUCCESS;
    if (!memset_async)
        memset_async = (memset_fn)cscu_real("cuMemsetD8Async");
    it->zero = it->zero && memset_async != NULL;  /* without the driver's memset it is read like any other */
    if (it->zero) {
        double t0 = cscu_now();
        rc = memset_async(base, 0, it->size, s[0]);
        t->device += cscu_now() - t0;
        t->zeroed += it->size;
        pieces = 0;
    } else {
        t->moved += it->size;
    }
    for (size_t k = 0; k < pieces && rc == CUDA_SUCCESS && !job->failed; k++) {
        size_t at = k * staging, n = it->size - at < staging ? it->size - at : staging;
        int slot = (int)(k % 2);
        double t0 = cscu_now(), t1, t2;
        if ((rc = d->stream_synchronize(s[slot])))
            break;
        t1 = cscu_now();
        if (cscu_full_io(1, job->fds[it->segment], buf[slot], n, (off_t)(it->offset + at)) != 0) {
            fail(job, "read %s at %zu: %s (the dump is shorter than its manifest or unreadable)", seg->file,
                 it->offset + at, errno == EIO ? "it ends early" : strerror(errno));
            return -1;
        }
        t2 = cscu_now();
        if (job->digests)
            cscu_chunk_update(h, buf[slot], n);
        rc = d->memcpy_htod_async(base + at, buf[slot], n, s[slot]);
        t->device += t1 - t0, t->io += t2 - t1, t->digest += cscu_now() - t2;
    }
    if (rc != CUDA_SUCCESS)
        fail(job, "copy to region %#llx: %s", r->address, cscu_error_name(rc));
    return job->failed ? -1 : 0;
}

static void one_chunk(struct job *job, struct item *it, CUstream s[2], void *buf[2], size_t staging,
                      struct spent *t)
{
    struct cscu_chunk_digest h;
    cscu_chunk_init(&h, job->segments[it->segment].kind);
    if (job->fill)
        fill_pieces(job, it, s, buf, staging, &h, t);
    else
        dump_pieces(job, it, s, buf, staging, &h, t);
    cscu_chunk_final(&h, it->digest);  /* also on failure: it frees libcrypto's context */
    if (job->fill && job->digests && it->zero) {  /* set, not read: its digest is that of the zeros it is */
        double t0 = cscu_now();
        cscu_zeros_digest(job->segments[it->segment].kind, it->size, it->digest);
        t->digest += cscu_now() - t0;
    }
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
    struct spent t = {0, 0, 0, 0, 0, 0};
    double setup = 0;  /* streams and page-locked buffers: the driver pins them one caller at a time */
    size_t staging = job->fill ? cfg->staging : cfg->dump_staging;
    cscu_gate_exempt();  /* the release's own copies run while the gate is closed */
    for (;;) {
        size_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_ACQ_REL);
        if (i >= job->count || __atomic_load_n(&job->failed, __ATOMIC_ACQUIRE))
            break;
        struct item *it = &job->items[i];
        CUcontext ctx = regions[job->segments[it->segment].region].context;
        if (ctx != current) {  /* streams belong to a context; page-locked buffers are portable (flag 1) */
            double t0 = cscu_now();
            for (int k = 0; k < 2; k++)
                if (s[k]) {
                    d->stream_synchronize(s[k]);
                    d->stream_destroy(s[k]);
                    s[k] = 0;
                }
            CUresult rc = d->ctx_set_current(ctx);
            for (int k = 0; k < 2 && rc == CUDA_SUCCESS; k++)
                if ((rc = d->stream_create(&s[k], CU_STREAM_NON_BLOCKING)) == CUDA_SUCCESS && !buf[k])
                    rc = d->host_alloc(&buf[k], staging, 1);
            if (rc != CUDA_SUCCESS) {
                fail(job, "copy thread set-up: %s", cscu_error_name(rc));
                break;
            }
            current = ctx;
            setup += cscu_now() - t0;
        }
        one_chunk(job, it, s, buf, staging, &t);
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
    pthread_mutex_lock(&job->lock);
    job->device_s += t.device, job->digest_s += t.digest, job->io_s += t.io, job->zero_s += t.zero;
    job->zeroed += t.zeroed, job->moved += t.moved, job->setup_s += setup;
    pthread_mutex_unlock(&job->lock);
    return NULL;
}

/* Chunks of every segment that `take` marks, interleaved across cscu_segments so that the threads write different
 * files at once, copied by the threads. 0, or -1 with `job->error` set. */
int cscu_copy(struct job *job, int fill, const char *take)
{
    size_t most = 0, rounds = 0, n = 0;
    for (size_t i = 0; i < cscu_segment_count; i++) {
        size_t chunks = (cscu_segments[i].size + CSCU_DIGEST_CHUNK - 1) / CSCU_DIGEST_CHUNK;
        most += chunks;
        rounds = chunks > rounds ? chunks : rounds;
    }
    job->items = calloc(most ? most : 1, sizeof(struct item));
    if (!job->items) {
        snprintf(job->error, sizeof(job->error), "out of host memory");
        return -1;
    }
    for (size_t round = 0; round < rounds; round++)
        for (size_t i = 0; i < cscu_segment_count; i++) {
            size_t at = round * CSCU_DIGEST_CHUNK;
            if (!take[i] || at >= cscu_segments[i].size)
                continue;
            size_t size = cscu_segments[i].size - at < CSCU_DIGEST_CHUNK ? cscu_segments[i].size - at : CSCU_DIGEST_CHUNK;
            int zero = fill && (cscu_segments[i].zero >> (at / CSCU_DIGEST_CHUNK) & 1);
            job->items[n++] = (struct item){i, at, size, {0}, zero};
        }
    job->count = n;
    job->segments = cscu_segments;
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
void cscu_segment_digest(const struct job *job, size_t segment, char out[CSCU_DIGEST_TEXT])
{
    unsigned char chunks[CSCU_SEGMENT_CHUNKS][32];
    size_t n = 0;
    for (size_t round = 0; round * CSCU_DIGEST_CHUNK < cscu_segments[segment].size && n < CSCU_SEGMENT_CHUNKS; round++)
        for (size_t i = 0; i < job->count; i++)
            if (job->items[i].segment == segment && job->items[i].offset == round * CSCU_DIGEST_CHUNK)
                memcpy(chunks[n++], job->items[i].digest, 32);
    cscu_digest_text(cscu_segments[segment].kind, (const unsigned char (*)[32])chunks, n, out);
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

void cscu_refuse(char *out, size_t room, const char *phase, const char *format, ...)
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

/* `seconds`: 0 unused, 1 synchronize, 2 dump, 3 unmap, then the copy threads' thread-seconds: 4 waiting for
 * the device, 5 digesting, 6 writing, 7 looking for zeros, 8 making their streams and staging buffers. A segment
 * with chunks of zeros says which ("zero": a mask of its chunks), and only then (the manifests before zero chunks
 * stay the same text). */
static void manifest(struct answer *a, const char *dir, double seconds[9], size_t bytes, int kind)
{
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    put(a, "{\"ok\":true,\"manifest\":{\"format\":1,\"kind\":\"" CSCU_DUMP_KIND "\",\"pid\":%d,\"dir\":\"",
        (int)getpid());
    put_text(a, dir);
    put(a, "\",\"digest_engine\":\"%s\",\"segment_bytes\":%zu,\"threshold\":%zu,\"bytes\":%zu,\"regions\":[",
        cscu_digest_engine(kind), CSCU_SEGMENT, cscu_config()->threshold, bytes);
    for (size_t i = 0, s = 0; i < count; i++) {
        struct cscu_region *r = &regions[i];
        put(a, "%s{\"address\":%llu,\"size\":%zu,\"requested\":%zu,\"device\":%d,\"device_uuid\":\"%s\","
            "\"device_name\":\"", i ? "," : "", r->address, r->size, r->requested, r->device, r->uuid);
        put_text(a, r->name);
        put(a, "\",\"segments\":[");
        for (int first = 1; s < cscu_segment_count && cscu_segments[s].region == i; s++, first = 0) {
            put(a, "%s{\"file\":\"%s\",\"offset\":0,\"address\":%llu,\"size\":%zu,\"digest\":\"%s\"", first ? "" : ",",
                cscu_segments[s].file, r->address + cscu_segments[s].offset, cscu_segments[s].size, cscu_segments[s].digest);
            put(a, cscu_segments[s].zero ? ",\"zero\":%u}" : "}", (unsigned)cscu_segments[s].zero);
        }
        put(a, "]}");
    }
    put(a, "],\"uncovered\":");
    if (a->used < a->room)
        a->used += cscu_counts_json(a->out + a->used, a->room - a->used);
    put(a, ",\"moved\":");  /* per source: what this release moves at line rate */
    if (a->used < a->room)
        a->used += cscu_moved_json(a->out + a->used, a->room - a->used);
    put(a, ",\"timings_s\":{\"synchronize\":%.6f,\"dump\":%.6f,\"unmap\":%.6f,\"dump_device_thread_s\":%.6f,"
        "\"dump_digest_thread_s\":%.6f,\"dump_write_thread_s\":%.6f,\"dump_zero_thread_s\":%.6f,"
        "\"dump_setup_thread_s\":%.6f},\"gbps\":%.3f}}",
        seconds[1], seconds[2], seconds[3], seconds[4], seconds[5], seconds[6], seconds[7], seconds[8],
        seconds[2] > 0 ? (double)bytes / seconds[2] / 1e9 : 0.0);
}

/* --- release ------------------------------------------------------------------------------------------------- */
static int plan_segments(struct cscu_region *regions, size_t count, int kind)
{
    size_t n = 0;
    for (size_t i = 0; i < count; i++)
        n += (regions[i].size + CSCU_SEGMENT - 1) / CSCU_SEGMENT;
    free(cscu_segments);
    cscu_segment_count = 0;
    if (!(cscu_segments = calloc(n ? n : 1, sizeof(*cscu_segments))))
        return -1;
    for (size_t i = 0; i < count; i++)
        for (size_t at = 0; at < regions[i].size; at += CSCU_SEGMENT, cscu_segment_count++) {
            struct segment *s = &cscu_segments[cscu_segment_count];
            s->region = i;
            s->offset = at;
            s->size = regions[i].size - at < CSCU_SEGMENT ? regions[i].size - at : CSCU_SEGMENT;
            s->kind = kind;
            snprintf(s->file, sizeof(s->file), CSCU_SEGMENT_FILE, cscu_segment_count);
        }
    return 0;
}

void cscu_close_files(int dirfd, int *fds, int remove)
{
    for (size_t i = 0; fds && i < cscu_segment_count; i++)
        if (fds[i] >= 0) {
            close(fds[i]);
            if (remove)
                unlinkat(dirfd, cscu_segments[i].file, 0);
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

/* The dump directory, opened: belonging to this process's user or root and writable by no one else. The
 * descriptor, or -1 with `error` set. */
static int open_dump_dir(const char *dir, char *error, size_t room)
{
    struct stat st;
    int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dirfd < 0) {
        snprintf(error, room, "dump directory %s: %s", dir, strerror(errno));
        return -1;
    }
    if (fstat(dirfd, &st) != 0 || (st.st_uid != geteuid() && st.st_uid != 0) || (st.st_mode & 022)) {
        close(dirfd);
        snprintf(error, room, "dump directory %s must belong to this process's user or root and be writable by no "
                 "one else", dir);
        return -1;
    }
    return dirfd;
}

/* Every region copied into new segment files of `dirfd` (closed here, as are the files), their digests recorded
 * in cscu_segments: 0, or -1 with `error` set and every file made removed (nothing was unmapped). */
static int dump_all(int dirfd, const char *dir, struct cscu_region *regions, size_t count, struct job *job,
                    int kind, char *error, size_t room)
{
    int *fds = NULL, rc = -1;
    char *take = NULL;
    /* `take` first: the cleanup closes `fds`, so `fds` exists only with every entry set. */
    if (plan_segments(regions, count, kind) != 0 || !(take = malloc(cscu_segment_count + 1))
        || !(fds = malloc((cscu_segment_count + 1) * sizeof(int)))) {
        snprintf(error, room, "out of host memory");
        goto cleanup;
    }
    for (size_t i = 0; i < cscu_segment_count; i++)
        fds[i] = -1;
    for (size_t i = 0; i < cscu_segment_count; i++)
        if ((fds[i] = openat(dirfd, cscu_segments[i].file, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                             0600)) < 0 || ftruncate(fds[i], (off_t)cscu_segments[i].size) != 0) {  /* holes: zeros */
            snprintf(error, room, "create %s/%s: %s", dir, cscu_segments[i].file, strerror(errno));
            goto cleanup;
        }
    job->fds = fds;
    memset(take, 1, cscu_segment_count + 1);
    if (cscu_copy(job, 0, take) != 0) {
        snprintf(error, room, "dump to %s: %s", dir, job->error);
        goto cleanup;
    }
    for (size_t i = 0; i < job->count; i++)
        cscu_segments[job->items[i].segment].zero |= (uint32_t)job->items[i].zero
                                                     << (job->items[i].offset / CSCU_DIGEST_CHUNK);
    for (size_t i = 0; i < cscu_segment_count; i++)
        cscu_segment_digest(job, i, cscu_segments[i].digest);
    rc = 0;
cleanup:
    cscu_close_files(dirfd, fds, rc != 0);  /* also closes dirfd (fds may be NULL) */
    free(job->items);
    free(take);
    return rc;
}

/* Every region's backing unmapped and released (the reservations stay): 0, or -1 with the first failure in
 * `error` (the others are still tried). */
static int unmap_all(struct cscu_region *regions, size_t count, char *error, size_t room)
{
    const struct cscu_driver *d = cscu_driver();
    error[0] = '\0';
    for (size_t i = 0; i < count; i++) {
        CUresult rc = d->ctx_set_current(regions[i].context);
        if (rc == CUDA_SUCCESS)
            rc = cscu_unmap(&regions[i]);
        if (rc != CUDA_SUCCESS && !error[0])
            snprintf(error, room, "unmap region %#llx: %s (what was released comes back with a hydrate)",
                     regions[i].address, cscu_error_name(rc));
    }
    return error[0] ? -1 : 0;
}

void cscu_release(const char *dir, char *out, size_t room)
{
    double t0 = cscu_now(), seconds[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
    int kind = cscu_digest_configured();
    size_t count, bytes = 0;
    struct cscu_region *regions = cscu_regions(&count);
    struct job job = {.lock = PTHREAD_MUTEX_INITIALIZER, .digests = 1};
    char error[1024];  /* a job's error and a path */
    if (kind < 0) {
        cscu_refuse(out, room, "release", "%s=%s names no digest: %.*s or %.*s", CSCU_ENV_DIGEST,
                    getenv(CSCU_ENV_DIGEST), (int)strlen(CSCU_CRC_PREFIX) - 1, CSCU_CRC_PREFIX,
                    (int)strlen(CSCU_DIGEST_PREFIX) - 1, CSCU_DIGEST_PREFIX);
        return;
    }
    int dirfd = open_dump_dir(dir, error, sizeof(error));
    if (dirfd < 0)
        goto refused;
    if (synchronize_all(regions, count, error, sizeof(error)) != 0) {
        close(dirfd);
        goto refused;
    }
    seconds[1] = cscu_now() - t0;
    if (dump_all(dirfd, dir, regions, count, &job, kind, error, sizeof(error)) != 0)
        goto refused;  /* nothing was unmapped: the engine runs on as before */
    for (size_t i = 0; i < cscu_segment_count; i++)
        bytes += cscu_segments[i].size;
    seconds[2] = cscu_now() - t0 - seconds[1];
    seconds[4] = job.device_s, seconds[5] = job.digest_s, seconds[6] = job.io_s, seconds[7] = job.zero_s;
    seconds[8] = job.setup_s;
    int unmapped = unmap_all(regions, count, error, sizeof(error));
    seconds[3] = cscu_now() - t0 - seconds[1] - seconds[2];
    if (unmapped != 0)
        goto refused;
    struct answer a = {out, room, 0};
    manifest(&a, dir, seconds, bytes, kind);
    if (a.used >= room)
        cscu_refuse(out, room, "release", "the manifest is longer than %zu bytes", room);
    return;
refused:
    cscu_refuse(out, room, "release", "%s", error);
}

/* The direct dump (issue 35 item 3): the device copies straight into the dump files' own pages. Each copy thread
 * takes a window of one file (COLDSNAP_CUDA_INTERPOSER_WINDOW_MIB, whole 64 MiB chunks), sizes it on the file
 * (fallocate: a full filesystem fails before the copy), maps it shared, page-locks it with cuMemHostRegister and
 * has the device write into it; while that copy runs it digests the window before (read from the pages the device
 * wrote: the only time the CPU touches the bytes), then unregisters and unmaps it, punching the chunks of zeros
 * out (holes, as the staged path leaves them). Two windows in flight a thread, on two streams. Against the staged
 * path (dump.c: the device into a staging buffer, the digest, a copy into the file) each byte crosses memory
 * twice fewer: the kernel's clearing of the new page, the device's write and the digest's read remain.
 *
 * Only on tmpfs: its pages are memory, pinned by the driver while it writes them; a disk filesystem's page cache
 * would be written behind the kernel's back (no dirty tracking under a pin), so a dump there goes staged. A window
 * that cannot be mapped or registered (the driver refusing file pages, say) is marked `staged`, and so is every
 * window after it (no more tries); the staged path copies them after; what failed first is the manifest's
 * `dump_path`. The files are byte for byte the staged
 * path's: hydrate.c, the node hydrator and hydration/_digests.py read them unchanged.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "cscu.h"
#include "dump.h"

#define DIRECT_TMPFS_MAGIC 0x01021994UL  /* linux/magic.h's TMPFS_MAGIC */
#define DIRECT_PORTABLE 0x01             /* CU_MEMHOSTREGISTER_PORTABLE: any context's stream may copy into it */

typedef CUresult (*direct_register_fn)(void *, size_t, unsigned int);
typedef CUresult (*direct_unregister_fn)(void *);
static direct_register_fn direct_register;
static direct_unregister_fn direct_unregister;
static pthread_once_t direct_once = PTHREAD_ONCE_INIT;

static void direct_resolve(void)
{
    direct_register = (direct_register_fn)cscu_real("cuMemHostRegister_v2");
    direct_unregister = (direct_unregister_fn)cscu_real("cuMemHostUnregister");
}

/* The `huge=` of the tmpfs mounted at `st_dev` (its super options in /proc/self/mountinfo: "never" when it has
 * none; the kernel's `force` or `deny` for every tmpfs, /sys/kernel/mm/transparent_hugepage/shmem_enabled, first)
 * into `huge`. */
static void direct_huge(dev_t dev, char *huge, size_t room)
{
    char line[4096], *at;
    snprintf(huge, room, "never");
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "re");
    if (f && fgets(line, sizeof(line), f) && (strstr(line, "[force]") || strstr(line, "[deny]")))
        snprintf(huge, room, "%s", strstr(line, "[force]") ? "force" : "deny");
    if (f)
        fclose(f);
    if (strcmp(huge, "never") != 0 || !(f = fopen("/proc/self/mountinfo", "re")))
        return;
    while (fgets(line, sizeof(line), f)) {
        unsigned major_id, minor_id;
        if (sscanf(line, "%*s %*s %u:%u", &major_id, &minor_id) != 2 || major_id != major(dev)
            || minor_id != minor(dev) || !(at = strstr(line, " - ")))
            continue;
        if ((at = strstr(at, "huge=")))
            snprintf(huge, room, "%.*s", (int)strcspn(at + 5, ", \n"), at + 5);
        break;
    }
    fclose(f);
}

/* The direct path's filesystem rule: tmpfs, and with COLDSNAP_CUDA_INTERPOSER_DIRECT=huge one whose files get huge
 * pages (registering 4 KiB pages costs per page). 1, or 0 with `why` said. */
static int direct_filesystem(int dirfd, const struct statfs *fs, char *why, size_t room)
{
    struct stat st;
    char huge[32];
    if ((unsigned long)fs->f_type != DIRECT_TMPFS_MAGIC) {
        snprintf(why, room, "the dump directory is on a filesystem of type %#lx, not tmpfs (a disk file's pages "
                 "are not pinned for the device to write)", (unsigned long)fs->f_type);
        return 0;
    }
    if (cscu_config()->direct != CSCU_DIRECT_HUGE || fstat(dirfd, &st) != 0)
        return 1;
    direct_huge(st.st_dev, huge, sizeof(huge));
    if (strcmp(huge, "never") == 0 || strcmp(huge, "deny") == 0) {
        snprintf(why, room, "the dump directory's tmpfs gives 4 KiB pages (huge=%s) and "
                 "COLDSNAP_CUDA_INTERPOSER_DIRECT=huge takes only huge pages", huge);
        return 0;
    }
    return 1;
}

int cscu_direct_plan(int dirfd, size_t bytes, char *why, size_t room)
{
    struct statfs fs;
    pthread_once(&direct_once, direct_resolve);
    int stated = fstatfs(dirfd, &fs) == 0;
    size_t free_bytes = stated ? (size_t)fs.f_bavail * (size_t)fs.f_bsize : 0;
    if (cscu_config()->direct == CSCU_DIRECT_OFF)
        snprintf(why, room, "COLDSNAP_CUDA_INTERPOSER_DIRECT=0");
    else if (!stated)
        snprintf(why, room, "statfs of the dump directory: %s", strerror(errno));
    else if (!direct_filesystem(dirfd, &fs, why, room))
        return 0;
    else if (fs.f_blocks != 0 && free_bytes < bytes)  /* f_blocks 0: a tmpfs without a size limit */
        snprintf(why, room, "the dump directory's tmpfs has %zu bytes free, the regions %zu (staged, chunks of "
                 "zeros take none)", free_bytes, bytes);
    else if (!direct_register || !direct_unregister)
        snprintf(why, room, "the driver has no cuMemHostRegister_v2 or cuMemHostUnregister");
    else
        return 1;
    return 0;
}

static size_t span_bytes(const struct item *it, size_t n)
{
    return it[n - 1].offset + it[n - 1].size - it[0].offset;
}

unsigned char *cscu_direct_map(int fd, const struct item *it, size_t n, int *space, char *why, size_t room)
{
    size_t len = span_bytes(it, n);
    *space = 0;
    if (fallocate(fd, 0, (off_t)it[0].offset, (off_t)len) != 0) {
        *space = errno == ENOSPC;
        snprintf(why, room, "fallocate %zu bytes at %zu: %s", len, it[0].offset, strerror(errno));
        return NULL;
    }
    void *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)it[0].offset);
    if (map == MAP_FAILED) {
        snprintf(why, room, "mmap %zu bytes at %zu: %s", len, it[0].offset, strerror(errno));
        return NULL;
    }
    madvise(map, len, MADV_HUGEPAGE);  /* a tmpfs mounted huge=advise; huge=always needs no advice */
    return map;
}

void cscu_direct_scan(struct item *it, size_t n, const unsigned char *map, int kind, struct spent *t)
{
    for (size_t c = 0, at = 0; c < n; at += it[c].size, c++) {
        struct cscu_chunk_digest h;
        cscu_chunk_init(&h, kind);
        it[c].zero = 1;
        for (size_t done = 0; done < it[c].size; done += CSCU_BLOCK) {
            size_t k = it[c].size - done < CSCU_BLOCK ? it[c].size - done : CSCU_BLOCK;
            double t0 = cscu_now();
            cscu_chunk_update(&h, map + at + done, k);  /* the block from memory, then from the cache: */
            double t1 = cscu_now();
            it[c].zero &= cscu_all_zero(map + at + done, k);
            t->digest += t1 - t0, t->zero += cscu_now() - t1;
        }
        cscu_chunk_final(&h, it[c].digest);
    }
}

int cscu_direct_unmap(int fd, const struct item *it, size_t n, unsigned char *map)
{
    int rc = munmap(map, span_bytes(it, n));
    for (size_t c = 0; c < n; c++)
        if (it[c].zero && fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)it[c].offset,
                                    (off_t)it[c].size) != 0)
            rc = -1;
    return rc;
}

/* --- the copy threads (CUDA) ------------------------------------------------------------------------------ */
struct direct_window { struct item *it; size_t n; unsigned char *map; int live, pinned; };
struct direct_lane {
    struct job *job;
    CUstream s[2];
    CUcontext current;
    struct direct_window w[2];
    struct spent t;
};

static void direct_staged(struct job *job, struct item *it, size_t n, const char *file, const char *why)
{
    for (size_t c = 0; c < n; c++)
        it[c].staged = 1;
    pthread_mutex_lock(&job->lock);
    if (!job->why[0])
        snprintf(job->why, sizeof(job->why), "%s: %s", file, why);
    pthread_mutex_unlock(&job->lock);
}

/* Window `k`'s copy started: mapped, registered and the device's copy into it queued on stream k; or its chunks
 * marked staged (nothing mapped), or the job failed (its file has no room, a copy refused). */
static void direct_open(struct direct_lane *l, int k, const struct span *sp)
{
    struct job *job = l->job;
    struct direct_window *w = &l->w[k];
    struct item *it = &job->items[sp->first];
    const char *file = job->segments[it->segment].file;
    int fd = job->fds[it->segment], space;
    char why[200];
    *w = (struct direct_window){it, sp->n, NULL, 0, 0};
    if (__atomic_load_n(&job->why[0], __ATOMIC_ACQUIRE)) {  /* a window was refused: the rest goes staged at once */
        direct_staged(job, it, sp->n, file, "");
        return;
    }
    double t0 = cscu_now();
    w->map = cscu_direct_map(fd, it, sp->n, &space, why, sizeof(why));
    double t1 = cscu_now();
    l->t.map += t1 - t0;
    if (!w->map) {
        if (space)
            cscu_job_fail(job, "write %s: %s", file, why);
        else
            direct_staged(job, it, sp->n, file, why);
        return;
    }
    w->live = 1;
    CUresult rc = direct_register(w->map, span_bytes(it, sp->n), DIRECT_PORTABLE);
    l->t.pin += cscu_now() - t1;
    if (rc != CUDA_SUCCESS) {
        snprintf(why, sizeof(why), "cuMemHostRegister of %zu bytes of its pages: %s", span_bytes(it, sp->n),
                 cscu_error_name(rc));
        direct_staged(job, it, sp->n, file, why);
        return;
    }
    w->pinned = 1;
    size_t count;
    struct segment *seg = &job->segments[it->segment];
    CUdeviceptr from = cscu_regions(&count)[seg->region].address + seg->offset + it->offset;
    if ((rc = cscu_driver()->memcpy_dtoh_async(w->map, from, span_bytes(it, sp->n), l->s[k])) != CUDA_SUCCESS)
        cscu_job_fail(job, "copy from region %#llx into %s: %s", from, file, cscu_error_name(rc));
}

/* Window `k` done: its copy waited for, digested, unregistered, unmapped (chunks of zeros punched out). Also
 * after a failure, so that nothing stays mapped or registered. */
static void direct_finish(struct direct_lane *l, int k)
{
    struct job *job = l->job;
    struct direct_window *w = &l->w[k];
    if (!w->live)
        return;
    const char *file = job->segments[w->it->segment].file;
    double t0 = cscu_now();
    CUresult rc = w->pinned ? cscu_driver()->stream_synchronize(l->s[k]) : CUDA_SUCCESS;
    l->t.device += cscu_now() - t0;
    if (rc != CUDA_SUCCESS)
        cscu_job_fail(job, "copy into %s: %s", file, cscu_error_name(rc));
    else if (w->pinned && !__atomic_load_n(&job->failed, __ATOMIC_ACQUIRE))
        cscu_direct_scan(w->it, w->n, w->map, job->segments[w->it->segment].kind, &l->t);
    double t1 = cscu_now();
    if (w->pinned && (rc = direct_unregister(w->map)) != CUDA_SUCCESS)
        cscu_job_fail(job, "cuMemHostUnregister of %s's pages: %s", file, cscu_error_name(rc));
    if (cscu_direct_unmap(job->fds[w->it->segment], w->it, w->n, w->map) != 0)
        cscu_job_fail(job, "unmap %s: %s", file, strerror(errno));
    if (w->pinned)
        l->t.moved += span_bytes(w->it, w->n);
    l->t.unpin += cscu_now() - t1;
    w->live = 0;
}

/* The lane's streams on `ctx` (made current), both windows finished first when it had others: 0, or -1 with the
 * job failed. */
static int direct_context(struct direct_lane *l, CUcontext ctx)
{
    const struct cscu_driver *d = cscu_driver();
    if (ctx == l->current)
        return 0;
    direct_finish(l, 0);
    direct_finish(l, 1);
    CUresult rc = CUDA_SUCCESS;
    for (int k = 0; k < 2; k++)
        if (l->s[k]) {
            d->stream_destroy(l->s[k]);
            l->s[k] = 0;
        }
    rc = d->ctx_set_current(ctx);
    for (int k = 0; k < 2 && rc == CUDA_SUCCESS; k++)
        rc = d->stream_create(&l->s[k], CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) {
        cscu_job_fail(l->job, "copy thread set-up: %s", cscu_error_name(rc));
        return -1;
    }
    l->current = ctx;
    return 0;
}

void *cscu_direct_thread(void *arg)
{
    struct direct_lane l = {.job = arg};
    struct job *job = l.job;
    size_t count;
    struct cscu_region *regions = cscu_regions(&count);
    cscu_gate_exempt();  /* the release's own copies run while the gate is closed */
    for (int k = 0;; k ^= 1) {
        size_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_ACQ_REL);
        if (i >= job->span_count || __atomic_load_n(&job->failed, __ATOMIC_ACQUIRE))
            break;
        const struct span *sp = &job->spans[i];
        if (direct_context(&l, regions[job->segments[job->items[sp->first].segment].region].context) != 0)
            break;
        direct_open(&l, k, sp);
        direct_finish(&l, k ^ 1);  /* the window before, while the device writes this one */
    }
    direct_finish(&l, 0);
    direct_finish(&l, 1);
    for (int k = 0; k < 2; k++)
        if (l.s[k])
            cscu_driver()->stream_destroy(l.s[k]);
    pthread_mutex_lock(&job->lock);
    job->device_s += l.t.device, job->digest_s += l.t.digest, job->zero_s += l.t.zero;
    job->map_s += l.t.map, job->pin_s += l.t.pin, job->unpin_s += l.t.unpin, job->direct_bytes += l.t.moved;
    pthread_mutex_unlock(&job->lock);
    return NULL;
}

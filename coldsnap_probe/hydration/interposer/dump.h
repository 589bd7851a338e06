/* The dump engine shared by release (dump.c) and hydrate (hydrate.c): the segments of the last release, the
 * copy threads, digests and answers. Internal to libcoldsnap_cuda (every symbol hidden). */
#ifndef CSCU_DUMP_H
#define CSCU_DUMP_H

#include <pthread.h>
#include <sys/types.h>

#include "cscu.h"
#include "digest.h"

#define SAMPLE ((size_t)64 << 10)

struct segment {
    size_t region, offset, size;    /* a part of region `region` at `offset` */
    char file[32];
    char digest[CSCU_DIGEST_TEXT];  /* sha256-64m:<hex> or crc32-64m:<hex>, recorded at release */
    int kind;                       /* the digest's kind (digest.h), the release's choice */
    uint32_t zero;                  /* bit c: chunk c is all zeros (never written: a hole; hydrate may memset it) */
};
_Static_assert(sizeof(((struct segment *)0)->digest) == CSCU_DIGEST_TEXT, "a digest's text, its NUL included");
/* One 64 MiB chunk (or a segment's shorter last one); `zero`: all zeros (found at release; at hydrate set on the
 * device, never read: cleared when it had to be read after all). */
struct item { size_t segment, offset, size; unsigned char digest[32]; int zero, staged; };
/* Where one copy thread's time went (thread-seconds), added to the job's when the thread ends; `map` and `pin`:
 * the direct path's (dump_direct.c) sizing and mapping of the files' windows, and registering them with the
 * driver; `unpin`: unregistering, punching the chunks of zeros out and unmapping. */
struct spent { double device, digest, io, zero; size_t zeroed, moved; double map, pin, unpin; };
/* Bytes digested, checked for zeros and written at once: small enough to stay in the core's cache between the
 * passes. */
#define CSCU_BLOCK ((size_t)256 << 10)
/* Consecutive chunks of one file, `n` from items[first]: what a direct copy thread maps and registers at once. */
struct span { size_t first, n; };
struct job {
    struct item *items;
    struct span *spans;             /* release: the files' windows (one chunk each on the staged path) */
    size_t span_count;
    size_t count, next;
    struct segment *segments;
    int *fds;
    int fill;                       /* 0: device to files, 1: files to device */
    int digests;                    /* digest what is copied (always on release; on hydrate unless told not) */
    int failed;
    /* Release: the device copies straight into the files' mapped, page-locked pages (dump_direct.c), each file
     * `window` chunks at a time; a chunk it cannot map or register is marked `staged` and copied through the
     * staging buffers after it (dump.c), `why` saying what failed first. */
    int direct;
    size_t window;
    char why[256];
    pthread_mutex_t lock;
    char error[512];
    /* Thread-seconds summed over the copy threads (under `lock`): waiting for the device's copies, digesting,
     * and the file I/O (writes on release, reads on hydrate): what bounds a dump or a fill. */
    double device_s, digest_s, io_s, zero_s;  /* zero_s: looking for all-zero blocks (release) */
    double map_s, pin_s, unpin_s;   /* release, direct: see struct spent */
    size_t direct_bytes, staged_bytes;  /* release: bytes copied each way */
    size_t zeroed, moved;           /* hydrate: bytes set on the device (chunks of zeros), bytes read and copied */
};

/* Invariant: while released, the segments describe the dump of the current region table (alloc/free wait). */
CSCU_HIDDEN extern struct segment *cscu_segments;
CSCU_HIDDEN extern size_t cscu_segment_count;

/* job.c: seconds on the monotonic clock; the job's first failure recorded (later ones dropped); all of `size`
 * bytes read (fill) or written at `offset` (0, or -1 with errno, EIO: the file ended early); 1 when `n` bytes
 * are all zeros. */
CSCU_HIDDEN double cscu_now(void);
CSCU_HIDDEN void cscu_job_fail(struct job *job, const char *format, ...) __attribute__((format(printf, 2, 3)));
CSCU_HIDDEN int cscu_full_io(int fill, int fd, void *buffer, size_t size, off_t offset);
CSCU_HIDDEN int cscu_all_zero(const unsigned char *p, size_t n);

/* dump_direct.c. Whether a release into `dirfd` of `bytes` goes direct: 1, or 0 with `why` said (switched off,
 * a driver without cuMemHostRegister, a filesystem other than tmpfs, less room than the regions). */
CSCU_HIDDEN int cscu_direct_plan(int dirfd, size_t bytes, char *why, size_t room);
/* A direct job's copy thread (pthread's signature): takes windows until none is left or the job failed. */
CSCU_HIDDEN void *cscu_direct_thread(void *job);
/* Chunks `it[0..n)` (consecutive, of one file `fd`) sized on the file (fallocate: no room fails here) and mapped
 * shared: the mapping, or NULL with `why` set (0 from `*space`: mapping refused, copy them staged) or, when
 * `*space` is set to 1, the file has no room (the job fails). */
CSCU_HIDDEN unsigned char *cscu_direct_map(int fd, const struct item *it, size_t n, int *space, char *why,
                                           size_t room);
/* The mapped chunks' digests (of `kind`) and zero marks, block by block, from the pages the device wrote: their
 * thread-seconds into `t`. */
CSCU_HIDDEN void cscu_direct_scan(struct item *it, size_t n, const unsigned char *map, int kind, struct spent *t);
/* The mapping undone and each chunk of zeros punched out of the file (a hole, as the staged path leaves it): 0,
 * or -1 with errno. */
CSCU_HIDDEN int cscu_direct_unmap(int fd, const struct item *it, size_t n, unsigned char *map);
/* The chunks of every segment `take` marks, copied by the threads (fill: files to device); 0, or -1 with
 * job->error set. The caller frees job->items. */
CSCU_HIDDEN int cscu_copy(struct job *job, int fill, const char *take);
/* A segment's digest text from its chunks' digests, of the segment's kind (after cscu_copy). */
CSCU_HIDDEN void cscu_segment_digest(const struct job *job, size_t segment, char out[CSCU_DIGEST_TEXT]);
/* {"ok":false,"error":"<phase>: <message>"} into out. */
CSCU_HIDDEN void cscu_refuse(char *out, size_t room, const char *phase, const char *format, ...)
    __attribute__((format(printf, 4, 5)));
/* Close the segment files (and remove them when `remove`), free `fds`, close the directory. */
CSCU_HIDDEN void cscu_close_files(int dirfd, int *fds, int remove);

#endif

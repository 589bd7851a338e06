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
struct item { size_t segment, offset, size; unsigned char digest[32]; int zero; };
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
    /* Thread-seconds summed over the copy threads (under `lock`): waiting for the device's copies, digesting,
     * and the file I/O (writes on release, reads on hydrate): what bounds a dump or a fill. */
    double device_s, digest_s, io_s, zero_s;  /* zero_s: looking for all-zero blocks (release) */
    double setup_s;                 /* the threads' streams and page-locked staging buffers made */
    size_t zeroed, moved;           /* hydrate: bytes set on the device (chunks of zeros), bytes read and copied */
};

/* Invariant: while released, the segments describe the dump of the current region table (alloc/free wait). */
CSCU_HIDDEN extern struct segment *cscu_segments;
CSCU_HIDDEN extern size_t cscu_segment_count;

/* Seconds on the monotonic clock. */
CSCU_HIDDEN double cscu_now(void);
/* All of `size` bytes read (fill) or written at `offset`; 0, or -1 with errno (EIO: the file ended early). */
CSCU_HIDDEN int cscu_full_io(int fill, int fd, void *buffer, size_t size, off_t offset);
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

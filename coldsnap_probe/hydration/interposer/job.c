/* The copy job's small shared parts, below both ways of dumping (dump.c's staging buffers and dump_direct.c's
 * mapped files) and the fill: the clock, a job's first failure, whole reads and writes, the zero check. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dump.h"

double cscu_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

void cscu_job_fail(struct job *job, const char *format, ...)
{
    pthread_mutex_lock(&job->lock);
    if (!job->failed) {
        va_list args;
        va_start(args, format);
        vsnprintf(job->error, sizeof(job->error), format, args);
        va_end(args);
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELEASE);
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

int cscu_all_zero(const unsigned char *p, size_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0);  /* memcmp stops at the first byte that is not */
}

/* LD_PRELOAD for a server's unit: io_uring is unavailable, so libuv (uvloop) keeps to epoll and the server can be
 * captured. libuv 1.45 and later keeps an io_uring ring to batch epoll_ctl calls whatever UV_USE_IO_URING says
 * (that variable governs only its file-operation ring), and CRIU cannot dump an io_uring instance. libuv makes
 * the ring through libc's syscall(2) wrapper and falls back to plain epoll when io_uring_setup fails, exactly
 * as on a kernel without io_uring: this wrapper answers ENOSYS for io_uring_setup and passes every other call
 * on unchanged. Only that entry point is covered: a program that issues the system call another way still gets
 * a ring, and the capture then refuses it by name (coldsnap_probe/_quiesce.py).
 * Built by scripts/_capsule_rootfs.py (--worker) into /opt/coldsnap/lib/libcoldsnap_no_io_uring.so. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

typedef long (*syscall_fn)(long, ...);

long syscall(long number, ...)
{
    static syscall_fn real;
    long arg[6];
    va_list ap;

    if (number == SYS_io_uring_setup) {
        errno = ENOSYS;
        return -1;
    }
    if (!real)
        real = (syscall_fn)dlsym(RTLD_NEXT, "syscall");
    /* A system call takes at most six arguments; reading all six is how libc's own wrapper reads them. */
    va_start(ap, number);
    for (int i = 0; i < 6; i++)
        arg[i] = va_arg(ap, long);
    va_end(ap);
    return real(number, arg[0], arg[1], arg[2], arg[3], arg[4], arg[5]);
}

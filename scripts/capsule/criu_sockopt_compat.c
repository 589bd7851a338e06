/* LD_PRELOAD for the capsule's CRIU 4.1.1 on kernels that refuse SO_PASSCRED / SO_PASSSEC outside
 * AF_UNIX, AF_NETLINK and AF_BLUETOOTH (Linux 6.16 and later answer EOPNOTSUPP; the H200 machine runs 6.18).
 * CRIU 4.1.1 reads both options from every socket it dumps and fails the dump of any TCP socket ("Can't get
 * 1:16 opt: Operation not supported"); on restore it writes them back. On such a socket the options cannot
 * be on, so reading them as 0 and skipping a write of 0 is exact. Any other failure is returned unchanged.
 * Built by scripts/_capsule_rootfs.py (--criu-compat) with the host's gcc; loaded only by CRIU's wrapper. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#ifndef SO_PASSSEC
#define SO_PASSSEC 34
#endif

typedef int (*getsockopt_fn)(int, int, int, void *, socklen_t *);
typedef int (*setsockopt_fn)(int, int, int, const void *, socklen_t);

static int refused_pass_option(int result, int level, int name)
{
    return result < 0 && errno == EOPNOTSUPP && level == SOL_SOCKET && (name == SO_PASSCRED || name == SO_PASSSEC);
}

int getsockopt(int fd, int level, int name, void *value, socklen_t *length)
{
    static getsockopt_fn real;
    if (!real)
        real = (getsockopt_fn)dlsym(RTLD_NEXT, "getsockopt");
    int result = real(fd, level, name, value, length);
    if (refused_pass_option(result, level, name) && value && length && *length >= sizeof(int)) {
        memset(value, 0, sizeof(int));
        *length = sizeof(int);
        return 0;
    }
    return result;
}

int setsockopt(int fd, int level, int name, const void *value, socklen_t length)
{
    static setsockopt_fn real;
    if (!real)
        real = (setsockopt_fn)dlsym(RTLD_NEXT, "setsockopt");
    int result = real(fd, level, name, value, length);
    if (refused_pass_option(result, level, name) && value && length >= sizeof(int) && *(const int *)value == 0)
        return 0;
    return result;
}

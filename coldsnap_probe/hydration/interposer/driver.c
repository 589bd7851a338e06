/* The real driver and the configuration: libcuda.so.1 opened beside the engine's own (the real `dlsym` finds its
 * entry points, never our wrappers), the driver entry points the interposer itself calls, and the environment,
 * read once. Calls nothing of the interposer's other files (everyone else's root). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cscu.h"

/* --- libcuda.so.1 ------------------------------------------------------------------------------------------ */
static dlsym_fn real_dlsym_ptr;

dlsym_fn cscu_real_dlsym(void)
{
    dlsym_fn fn = __atomic_load_n(&real_dlsym_ptr, __ATOMIC_ACQUIRE);
    if (!fn) {
        fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!fn)
            fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        __atomic_store_n(&real_dlsym_ptr, fn, __ATOMIC_RELEASE);
    }
    return fn;
}

static void *libcuda;
static pthread_once_t libcuda_once = PTHREAD_ONCE_INIT;

static void libcuda_open(void)
{
    libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  /* the global scope stays as the engine made it */
}

void *cscu_real(const char *name)
{
    pthread_once(&libcuda_once, libcuda_open);
    return libcuda ? cscu_real_dlsym()(libcuda, name) : NULL;
}

/* --- configuration ----------------------------------------------------------------------------------------- */
static struct cscu_config config;
static pthread_once_t config_once = PTHREAD_ONCE_INIT;

/* $name in `unit`s, or `fallback` (also in `unit`s: the default staging is 4 MiB, not 4 bytes). strtoull takes
 * "-1" as its maximum, and a product past SIZE_MAX would wrap (to 0: a staging of 0 bytes divides by it): a sign is
 * refused, a value too large for its unit is SIZE_MAX, which each caller bounds. */
static size_t env_size(const char *name, size_t fallback, size_t unit)
{
    const char *text = getenv(name);
    char *end = NULL;
    if (!text || !*text)
        return fallback * unit;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || *end || value == 0 || strchr(text, '-')) {
        fprintf(stderr, "coldsnap-cuda: %s=%s is not a positive integer, using %zu\n", name, text, fallback);
        return fallback * unit;
    }
    return value > SIZE_MAX / unit ? SIZE_MAX : (size_t)value * unit;
}

/* $name as a switch: unset, empty or 1 is on, 0 off; anything else is said on stderr and taken as on (the
 * default: an engine's mistyped knob must not change what a capture does). */
static int env_switch(const char *name)
{
    const char *text = getenv(name);
    if (!text || !*text || strcmp(text, "1") == 0)
        return 1;
    if (strcmp(text, "0") == 0)
        return 0;
    fprintf(stderr, "coldsnap-cuda: %s=%s must be 0 or 1, using 1\n", name, text);
    return 1;
}

static void config_read(void)
{
    const char *socket = getenv(CSCU_ENV_SOCKET);
    config.threshold = env_size("COLDSNAP_CUDA_INTERPOSER_THRESHOLD", (size_t)2 << 20, 1);
    cpu_set_t cpus;
    int usable = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 8;
    /* Default: one copy thread per CPU the process may use (digesting bounds the rate), 4 to 16. */
    size_t threads = env_size("COLDSNAP_CUDA_INTERPOSER_THREADS", (size_t)(usable < 4 ? 4 : usable > 16 ? 16 : usable),
                              1);
    config.threads = threads > 64 ? 64 : (int)threads;
    config.staging = env_size("COLDSNAP_CUDA_INTERPOSER_STAGING_MIB", 4, (size_t)1 << 20);
    size_t drain = env_size("COLDSNAP_CUDA_INTERPOSER_DRAIN_S", 10, 1);
    config.drain_s = drain > 3600 ? 3600 : (int)drain;
    size_t request = env_size("COLDSNAP_CUDA_INTERPOSER_REQUEST_S", 10, 1);
    config.request_s = request > 600 ? 600 : (int)request;
    if (config.staging > CSCU_DIGEST_CHUNK)
        config.staging = CSCU_DIGEST_CHUNK;
    config.dump_staging = env_size("COLDSNAP_CUDA_INTERPOSER_DUMP_STAGING_KIB", config.staging >> 10, 1024)
                          & ~(size_t)4095;  /* whole pages */
    config.dump_staging = config.dump_staging < ((size_t)64 << 10) ? (size_t)64 << 10
                          : config.dump_staging > CSCU_DIGEST_CHUNK ? CSCU_DIGEST_CHUNK : config.dump_staging;
    const char *exportable = getenv("COLDSNAP_CUDA_INTERPOSER_EXPORTABLE");
    config.exportable = !(exportable && strcmp(exportable, "0") == 0);
    const char *engine_vmm = getenv("COLDSNAP_CUDA_INTERPOSER_ENGINE_VMM"), *ordered =
        getenv("COLDSNAP_CUDA_INTERPOSER_STREAM_ORDERED");
    config.engine_vmm = !(engine_vmm && strcmp(engine_vmm, "0") == 0);  /* 0: left on the checkpoint path */
    config.stream_ordered = !(ordered && strcmp(ordered, "0") == 0);
    config.stack_shrink = env_switch("COLDSNAP_CUDA_INTERPOSER_SHRINK_STACK");
    config.stack_bytes = env_size("COLDSNAP_CUDA_INTERPOSER_STACK_BYTES", 16, 1);
    if (!socket || !*socket)
        return;
    /* "%p" becomes the pid, so that every CUDA process of a tree gets its own socket. */
    char *out = config.socket, *limit = config.socket + sizeof(config.socket) - 1;
    for (const char *p = socket; *p; p++) {
        if (p[0] == '%' && p[1] == 'p') {
            out += snprintf(out, (size_t)(limit - out) + 1, "%d", (int)getpid());
            if (out > limit) break;
            p++;
        } else if (out < limit) {
            *out++ = *p;
        } else {
            out = limit + 1;
            break;
        }
    }
    if (out > limit || socket[0] != '/') {
        fprintf(stderr, "coldsnap-cuda: COLDSNAP_CUDA_INTERPOSER_SOCKET must be an absolute path under %zu "
                        "bytes: inert\n", sizeof(config.socket));
        config.socket[0] = '\0';
    } else {
        *out = '\0';
    }
}

const struct cscu_config *cscu_config(void)
{
    pthread_once(&config_once, config_read);
    return &config;
}

/* --- the real driver ---------------------------------------------------------------------------------------- */
static struct cscu_driver driver;
static int driver_ok;
static pthread_once_t driver_once = PTHREAD_ONCE_INIT;

static void driver_load(void)
{
    struct { void **place; const char *name; } need[] = {
        {(void **)&driver.ctx_get_current, "cuCtxGetCurrent"}, {(void **)&driver.ctx_set_current, "cuCtxSetCurrent"},
        {(void **)&driver.ctx_get_device, "cuCtxGetDevice"}, {(void **)&driver.ctx_synchronize, "cuCtxSynchronize"},
        {(void **)&driver.device_get_uuid, "cuDeviceGetUuid_v2"}, {(void **)&driver.device_get_name, "cuDeviceGetName"},
        {(void **)&driver.get_error_name, "cuGetErrorName"}, {(void **)&driver.mem_alloc, "cuMemAlloc_v2"},
        {(void **)&driver.mem_free, "cuMemFree_v2"}, {(void **)&driver.mem_get_address_range, "cuMemGetAddressRange_v2"},
        {(void **)&driver.granularity, "cuMemGetAllocationGranularity"},
        {(void **)&driver.address_reserve, "cuMemAddressReserve"}, {(void **)&driver.address_free, "cuMemAddressFree"},
        {(void **)&driver.create, "cuMemCreate"}, {(void **)&driver.release, "cuMemRelease"},
        {(void **)&driver.map, "cuMemMap"}, {(void **)&driver.unmap, "cuMemUnmap"},
        {(void **)&driver.set_access, "cuMemSetAccess"}, {(void **)&driver.stream_create, "cuStreamCreate"},
        {(void **)&driver.stream_destroy, "cuStreamDestroy_v2"}, {(void **)&driver.stream_synchronize, "cuStreamSynchronize"},
        {(void **)&driver.host_alloc, "cuMemHostAlloc"}, {(void **)&driver.free_host, "cuMemFreeHost"},
        {(void **)&driver.memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2"},
        {(void **)&driver.memcpy_htod_async, "cuMemcpyHtoDAsync_v2"}, {(void **)&driver.memcpy_dtoh, "cuMemcpyDtoH_v2"},
    };
    for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++)
        if (!(*need[i].place = cscu_real(need[i].name)))
            return;
    driver_ok = 1;
}

const struct cscu_driver *cscu_driver(void)
{
    pthread_once(&driver_once, driver_load);
    return driver_ok ? &driver : NULL;
}

const char *cscu_error_name(CUresult rc)
{
    const char *name = NULL;
    const struct cscu_driver *d = cscu_driver();
    if (d && d->get_error_name(rc, &name) == CUDA_SUCCESS && name)
        return name;
    return "CUDA_ERROR_UNKNOWN";
}


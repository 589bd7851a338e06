/* The control socket: where the restore worker asks for `status`, `release` and `hydrate` (connection.c serves
 * one connection, operations.c answers it).
 *
 * The socket is created 0600 (mode set before bind). Each connection has its own thread (at most CONNECTIONS
 * at once; more wait in the listen backlog until one ends, at most the request deadline), so a silent or slow
 * peer never holds up `status` or the worker's requests. The socket starts with the first allocation the
 * regions take (a hook registered at load: regions.c never calls up into this file), or at load when asked.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "control.h"
#include "dump.h"

static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static int started;     /* 0: not tried, 1: listening, -1: could not (pass-through for this process's life) */
static int listener = -1;
static pid_t listening_pid;  /* the process that bound the socket: a forked child inherits `started`, not the socket */

/* --- connections: a thread each, at most CONNECTIONS at once, each within its request deadline ------------- */
#define CONNECTIONS 8

/* Invariant: a used slot's fd is open and owned by its connection thread; it is closed only under conn_lock, so
 * the reaper never shuts down a descriptor number the process has reused for something else. */
static pthread_mutex_t conn_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { int used, fd, cut; double since; } conns[CONNECTIONS];

static int conn_take(int fd)
{
    int slot = -1;
    pthread_mutex_lock(&conn_lock);
    for (int i = 0; i < CONNECTIONS && slot < 0; i++)
        if (!conns[i].used) {
            conns[i].used = 1, conns[i].fd = fd, conns[i].cut = 0, conns[i].since = cscu_now();
            slot = i;
        }
    pthread_mutex_unlock(&conn_lock);
    return slot;
}

static void conn_close(int slot)
{
    pthread_mutex_lock(&conn_lock);
    close(conns[slot].fd);
    conns[slot].used = 0;
    pthread_mutex_unlock(&conn_lock);
}

/* A connection older than the request deadline has its reading side shut: a silent or trickling peer's read ends
 * (refused as not one line). An operation already read goes on: only what the peer might still send is cut. */
static void conn_reap(void)
{
    double now = cscu_now();
    pthread_mutex_lock(&conn_lock);
    for (int i = 0; i < CONNECTIONS; i++)
        if (conns[i].used && !conns[i].cut && now - conns[i].since > cscu_config()->request_s) {
            shutdown(conns[i].fd, SHUT_RD);
            conns[i].cut = 1;
        }
    pthread_mutex_unlock(&conn_lock);
}

static void *connection(void *arg)
{
    int slot = (int)(intptr_t)arg;
    cscu_gate_exempt();  /* a release closes the gate from this thread: its own driver calls pass */
    cscu_serve_connection(conns[slot].fd);  /* the slot is this thread's until conn_close */
    conn_close(slot);
    return NULL;
}

static int conn_room(void)
{
    int room = 0;
    pthread_mutex_lock(&conn_lock);
    for (int i = 0; i < CONNECTIONS; i++)
        room += !conns[i].used;
    pthread_mutex_unlock(&conn_lock);
    return room;
}

/* A thread for `conn`; if none can be started, it is served on this one (as before threads: it still ends at its
 * deadline, only the others wait meanwhile). */
static void spawn(int conn)
{
    pthread_t thread;
    pthread_attr_t attr;
    int slot = conn_take(conn);  /* there is room: only this thread takes slots */
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (slot < 0 || pthread_create(&thread, &attr, connection, (void *)(intptr_t)slot) != 0) {
        cscu_serve_connection(conn);
        if (slot >= 0)
            conn_close(slot);
        else
            close(conn);
    }
    pthread_attr_destroy(&attr);
}

/* While every slot is taken, new connections wait in the backlog (64) rather than being refused: a slot frees
 * within the request deadline, since the reaper cuts every peer that has not sent its line by then. */
static void *serve(void *unused)
{
    (void)unused;
    cscu_gate_exempt();  /* only when no thread could be started does a release run here */
    for (;;) {
        struct pollfd ready = {conn_room() ? listener : -1, POLLIN, 0};
        int events = poll(&ready, 1, 250);  /* a quarter second: the request deadline's granularity */
        conn_reap();
        if (events <= 0)
            continue;
        int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EAGAIN)
                continue;
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                usleep(100000);  /* out of descriptors: the asker retries */
                continue;
            }
            fprintf(stderr, "coldsnap-cuda: control socket closed: %s\n", strerror(errno));
            return NULL;
        }
        spawn(conn);
    }
}

/* Bind `path` 0600; a live socket there (another process of the tree) is not replaced. */
static int bind_socket(const char *path)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    struct stat st;
    if (strlen(path) >= sizeof(addr.sun_path))
        return -1;
    strcpy(addr.sun_path, path);
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode))
            return -1;
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int live = probe >= 0 && connect(probe, (struct sockaddr *)&addr, sizeof(addr)) == 0;
        if (probe >= 0)
            close(probe);
        if (live || unlink(path) != 0)
            return -1;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (fchmod(fd, 0600) != 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(fd, 64) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The thread that accepts connections, on `listener`: 0, or -1 (nothing left behind). */
static int listen_thread(const char *path)
{
    pthread_t thread;
    pthread_attr_t attr;
    int rc = -1;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&thread, &attr, serve, NULL) != 0) {
        close(listener);
        unlink(path);
        goto cleanup;
    }
    pthread_setname_np(thread, "coldsnap-cuda");
    rc = 0;
cleanup:
    pthread_attr_destroy(&attr);
    return rc;
}

/* Starts the control thread once (the regions' start hook): 0 when it listens, -1 when it cannot (the process
 * then stays pass-through). */
static int control_start(void)
{
    pthread_mutex_lock(&start_lock);
    if (started)
        goto done;
    const char *path = cscu_config()->socket;
    started = -1;
    if ((listener = bind_socket(path)) < 0) {
        fprintf(stderr, "coldsnap-cuda: cannot listen on %s (%s): this process's allocations stay on the "
                        "CUDA checkpoint path\n", path, errno ? strerror(errno) : "a live socket is there");
        goto done;
    }
    if (listen_thread(path) == 0) {
        listening_pid = getpid();
        started = 1;
    }
done:;
    int result = started == 1 ? 0 : -1;
    pthread_mutex_unlock(&start_lock);
    return result;
}

/* COLDSNAP_CUDA_INTERPOSER_LISTEN=load: listen from the start (a worker may then ask a process that has not
 * allocated yet; without a GPU it is the only way the socket exists). Otherwise the first allocation above the
 * threshold starts it (the hook registered here): a process that never allocates through us has no socket. */
__attribute__((constructor)) static void cscu_loaded(void)
{
    const char *listen_at = getenv("COLDSNAP_CUDA_INTERPOSER_LISTEN");
    cscu_regions_on_start(control_start);
    if (listen_at && strcmp(listen_at, "load") == 0 && cscu_config()->socket[0])
        control_start();
}

/* A process that exits normally removes its socket (one killed leaves it; the next bind replaces it). Only the
 * process that bound it: a child forked without exec (a prefork server's worker) inherits `started` and the path,
 * and its normal exit removed its parent's socket, so the worker could no longer release or hydrate it. */
__attribute__((destructor)) static void cscu_unloaded(void)
{
    if (started == 1 && getpid() == listening_pid)
        unlink(cscu_config()->socket);
}

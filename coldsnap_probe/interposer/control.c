/* The control socket: the restore worker's `status`, `release` and `hydrate`, one JSON line per connection
 * (coldsnap_probe/jsonline.py's protocol: one request line, one answer line, then the server closes).
 *
 * The socket is created 0600 (mode set before bind) and answers only root and this process's uid
 * (SO_PEERCRED); anyone else gets {"ok":false,...}. A request is one flat JSON object of at most 64 KiB,
 * read within COLDSNAP_CUDA_INTERPOSER_REQUEST_S (10 s) from the connection, however slowly it trickles in;
 * unknown keys, wrong types and unknown operations are refused and change nothing (request.c parses it).
 * Each connection has its own thread (at most CONNECTIONS at once; more wait in the listen backlog until one
 * ends, at most that deadline), so a silent or slow peer never holds up `status` or the worker's requests.
 * Releases and hydrations are serialised: a second release while one runs (or hydrate while one runs) is refused
 * naming it, a hydrate waits for a release to end (and the reverse); `status` answers meanwhile.
 *
 * Descriptors (SCM_RIGHTS) ride only with a `hydrate` that announces them (`allocations`: the allocations a node
 * hydrator staged, one per released region, in region order): they come with the request line and after it in
 * pages, each one byte with at most PAGE_FDS descriptors (a larger page is refused: the kernel closes what does
 * not fit), until as many as announced arrived, within the request's deadline. Every descriptor received is
 * closed before the answer, whatever happened: one over the announced count, a page cut short, a peer that stops
 * sending or leaves midway; descriptors sent after the announced count are never received (the kernel drops
 * them with the connection).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "cscu.h"
#include "dump.h"
#include "request.h"

#define MAX_LINE 65536
#define FIELD CSCU_REQUEST_FIELD
#define PAGE_FDS 16     /* descriptors one page may carry (the worker's INTERPOSER_PAGE) */
#define STAGED_MAX 4096 /* descriptors one request may bring: the node hydrator's STAGE_ALLOCATIONS */

static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;
static int started;     /* 0: not tried, 1: listening, -1: could not (pass-through for this process's life) */
static int listener = -1;
static pid_t listening_pid;  /* the process that bound the socket: a forked child inherits `started`, not the socket */
static int released;    /* Invariant: 1 between a release that unmapped anything and the hydrate that succeeds */
static char released_dir[FIELD];

/* The one mutating operation (release or hydrate) running, and the region table's totals last seen, so that
 * `status` answers while that operation holds the table. Guarded by op_lock, which is only ever held briefly
 * (never while waiting for the region table). */
struct totals { size_t count, bytes, mapped, segments; };
static pthread_mutex_t op_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t op_done = PTHREAD_COND_INITIALIZER;
static const char *operation;   /* "release", "hydrate" or NULL */
static double operation_since;
static struct totals last_totals;

/* The descriptors a connection brought, in arrival order. Invariant: every one is in `fds` (closed by `forget`)
 * or was closed on arrival (`dropped`: beyond STAGED_MAX, or when `fds` could not grow). */
struct received { int *fds; size_t count, room, dropped; int truncated; };

/* --- operations ------------------------------------------------------------------------------------------- */
static double monotonic(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void refuse(char *out, size_t room, const char *phase, const char *why);

/* Claims the one mutating operation for `op`: 0, or -1 with the refusal naming the one in progress in `out`.
 * The same operation twice at once is refused (a second release while one runs is a mistake); the other one
 * waits for it to end (a capture's rollback `hydrate` after its asker gave up on a slow `release` must still
 * bring the memory back, as it did when connections were served one at a time). */
static int op_begin(const char *op, char *out, size_t room)
{
    char why[160];
    pthread_mutex_lock(&op_lock);
    while (operation && strcmp(operation, op) != 0)
        pthread_cond_wait(&op_done, &op_lock);
    const char *running = operation;
    double for_s = monotonic() - operation_since;
    if (!running) {
        operation = op;
        operation_since = monotonic();
    }
    pthread_mutex_unlock(&op_lock);
    if (!running)
        return 0;
    snprintf(why, sizeof(why), "a %s is in progress (for %.1f s): one release or hydrate at a time", running, for_s);
    refuse(out, room, op, why);
    return -1;
}

static void op_end(void)
{
    pthread_mutex_lock(&op_lock);
    operation = NULL;
    pthread_cond_broadcast(&op_done);
    pthread_mutex_unlock(&op_lock);
}

/* The region table's totals, counted under its lock; while a release or hydration holds it, the last counted. */
static struct totals tally(void)
{
    struct totals t = {0, 0, 0, 0};
    while (cscu_regions_trylock() != 0) {
        pthread_mutex_lock(&op_lock);
        int busy = operation != NULL;
        t = last_totals;
        pthread_mutex_unlock(&op_lock);
        if (busy)
            return t;
        usleep(1000);  /* an allocation, a free or another status holds it for a moment */
    }
    struct cscu_region *r = cscu_regions(&t.count);
    for (size_t i = 0; i < t.count; i++) {
        t.bytes += r[i].size;
        t.mapped += r[i].handle ? r[i].size : 0;
        t.segments += r[i].size / CSCU_SEGMENT + 1;
    }
    cscu_regions_unlock();
    pthread_mutex_lock(&op_lock);
    last_totals = t;
    pthread_mutex_unlock(&op_lock);
    return t;
}

static void status(char *out, size_t room)
{
    struct totals t = tally();
    pthread_mutex_lock(&op_lock);
    const char *running = operation;
    pthread_mutex_unlock(&op_lock);
    size_t used = (size_t)snprintf(out, room, "{\"ok\":true,\"pid\":%d,\"regions\":%zu,\"bytes\":%zu,"
                                   "\"mapped_bytes\":%zu,\"released\":%s,\"operation\":%s%s%s,\"gate\":\"%s\","
                                   "\"threshold\":%zu,\"threads\":%d,\"staging_bytes\":%zu,\"drain_s\":%d,"
                                   "\"request_s\":%d,\"digest_engine\":\"%s\",\"driver\":%s,"
                                   "\"uncovered\":", (int)getpid(), t.count, t.bytes, t.mapped,
                                   __atomic_load_n(&released, __ATOMIC_ACQUIRE) ? "true" : "false",
                                   running ? "\"" : "", running ? running : "null", running ? "\"" : "",
                                   cscu_gate_is_open() ? "open" : "closed",
                                   cscu_config()->threshold, cscu_config()->threads, cscu_config()->staging,
                                   cscu_config()->drain_s, cscu_config()->request_s, cscu_sha256_engine(),
                                   cscu_driver() ? "true" : "false");
    used += cscu_counts_json(out + used, room - used);
    used += (size_t)snprintf(out + used, room - used, ",\"wrapped\":");
    if (used < room)
        used += cscu_entries_json(out + used, room - used);
    if (used < room)
        used += (size_t)snprintf(out + used, room - used, ",\"unwrapped\":");
    if (used < room)
        used += cscu_unwrapped_json(out + used, room - used);
    if (used < room)
        snprintf(out + used, room - used, "}");
}

static void refuse(char *out, size_t room, const char *phase, const char *why)
{
    char quoted[1024];
    size_t n = 0;
    for (const char *p = why; *p && n + 2 < sizeof(quoted); p++) {
        if (*p == '"' || *p == '\\')
            quoted[n++] = '\\';
        quoted[n++] = (unsigned char)*p < 0x20 ? ' ' : *p;
    }
    quoted[n] = '\0';
    snprintf(out, room, "{\"ok\":false,\"error\":\"%s: %s\"}", phase, quoted);
}

/* A release or hydration says on the engine's stderr when it starts and how it ended (one line each): a slow or
 * stuck one is visible in the engine's log even when its asker has given up. */
static double note(const char *op, const char *dir, const char *out, double since)
{
    double now = monotonic();
    if (!out)
        fprintf(stderr, "coldsnap-cuda: %s (%s): started, %d copy threads, %zu-byte staging buffers\n", op,
                dir[0] ? dir : "the released dump", cscu_config()->threads, cscu_config()->staging);
    else
        fprintf(stderr, "coldsnap-cuda: %s: %s after %.3f s%s%.300s\n", op,
                strncmp(out, "{\"ok\":true", 10) == 0 ? "done" : "refused", now - since,
                strncmp(out, "{\"ok\":true", 10) == 0 ? "" : ": ", strncmp(out, "{\"ok\":true", 10) == 0 ? "" : out);
    return now;
}

static void dispatch(const struct cscu_request *req, const struct received *got, char *out, size_t room)
{
    size_t arrived = got->count + got->dropped;
    if ((arrived || req->allocations[0]) && strcmp(req->op, "hydrate") != 0) {
        refuse(out, room, "request", "only a hydrate request may carry descriptors (staged allocations)");
        return;
    }
    if (arrived && !req->allocations[0]) {
        refuse(out, room, "hydrate", "staged allocations come with their count (`allocations`, decimal)");
        return;
    }
    if (strcmp(req->op, "status") == 0) {
        status(out, room);
    } else if (strcmp(req->op, "release") == 0) {
        if (released) {
            refuse(out, room, "release", "the regions are released already (hydrate them first)");
            return;
        }
        if (!req->has_dir || req->dir[0] != '/') {
            refuse(out, room, "release", "`dir` must be the absolute path of the dump directory");
            return;
        }
        long inside = cscu_gate_close();  /* new launches wait; those running end first */
        if (inside) {
            char why[256];
            snprintf(why, sizeof(why), "%ld engine call(s) stayed inside the driver for %d s (a synchronise on "
                     "work that does not end?): nothing was released, the engine runs on", inside,
                     cscu_config()->drain_s);
            refuse(out, room, "release", why);
            return;
        }
        cscu_regions_lock();
        cscu_release(req->dir, out, room);
        size_t count;
        struct cscu_region *r = cscu_regions(&count);
        for (size_t i = 0; i < count; i++)
            released |= !r[i].handle;
        cscu_regions_unlock();
        if (released)
            snprintf(released_dir, sizeof(released_dir), "%s", req->dir);
        else
            cscu_gate_open();  /* nothing was released: the engine keeps running as before */
    } else if (strcmp(req->op, "hydrate") == 0) {
        const char *policy = req->policy[0] ? req->policy : "same-model";
        const char *verify = req->verify[0] ? req->verify : "digest";
        if (strcmp(verify, "digest") != 0 && strcmp(verify, "sampled") != 0) {
            refuse(out, room, "hydrate", "`verify` must be digest or sampled");
            return;
        }
        if (strcmp(policy, "same-model") != 0 && strcmp(policy, "same-gpu") != 0) {
            refuse(out, room, "hydrate", "`policy` must be same-model or same-gpu");
            return;
        }
        if (req->has_dir && req->dir[0] != '/') {
            refuse(out, room, "hydrate", "`dir` must be an absolute path");
            return;
        }
        if (!released) {
            refuse(out, room, "hydrate", "nothing is released");
            return;
        }
        cscu_regions_lock();
        if (got->count)  /* a node hydrator filled one allocation per region while the process was restored */
            cscu_hydrate_staged(req->has_dir ? req->dir : released_dir, policy, got->fds, got->count, out, room);
        else
            cscu_hydrate(req->has_dir ? req->dir : released_dir, policy, strcmp(verify, "digest") == 0, out, room);
        size_t count;
        struct cscu_region *r = cscu_regions(&count);
        int all = 1;
        for (size_t i = 0; i < count; i++)
            all &= r[i].handle != 0;
        cscu_regions_unlock();
        if (all && strncmp(out, "{\"ok\":true", 10) == 0) {
            released = 0;
            cscu_gate_open();  /* every region is back and verified: the engine's threads go on */
        }
    } else {
        refuse(out, room, "request", "unknown `op` (status, release or hydrate)");
    }
}

/* --- the socket --------------------------------------------------------------------------------------------- */
static size_t answer_room(void)
{
    struct totals t = tally();
    return CSCU_ANSWER + t.count * 512 + t.segments * 256;  /* a region's manifest entry, a segment's */
}

/* Descriptors held by every connection together. Invariant: at most STAGED_MAX (one hydrate's worth: a second one
 * at once would be refused anyway), so that peers crowding the socket with descriptors, each within its own
 * request's cap, cannot take the engine's descriptor table (its own opens would fail with EMFILE). */
static long held_fds;

static void keep(struct received *got, int fd)
{
    if (__atomic_add_fetch(&held_fds, 1, __ATOMIC_ACQ_REL) > STAGED_MAX) {
        __atomic_sub_fetch(&held_fds, 1, __ATOMIC_ACQ_REL);
        close(fd);
        got->dropped++;
        return;
    }
    if (got->count == got->room && got->room < STAGED_MAX) {  /* grown as they come: 16, 32, ... STAGED_MAX */
        size_t room = got->room ? got->room * 2 : PAGE_FDS;
        int *grown = realloc(got->fds, room * sizeof(int));
        if (grown) {
            got->fds = grown;
            got->room = room;
        }
    }
    if (got->count < got->room) {
        got->fds[got->count++] = fd;
    } else {
        close(fd);
        __atomic_sub_fetch(&held_fds, 1, __ATOMIC_ACQ_REL);
        got->dropped++;
    }
}

static void forget(struct received *got)
{
    for (size_t i = 0; i < got->count; i++)
        close(got->fds[i]);
    __atomic_sub_fetch(&held_fds, (long)got->count, __ATOMIC_ACQ_REL);
    got->count = 0;
}

/* recv, also taking the descriptors that ride with the bytes (SCM_RIGHTS, at most PAGE_FDS a message) into `got`;
 * a message that carried more is marked truncated (the kernel closed the ones that did not fit). */
static ssize_t receive(int conn, char *buffer, size_t size, struct received *got)
{
    union { struct cmsghdr align; char space[CMSG_SPACE(sizeof(int) * PAGE_FDS)]; } control;
    struct iovec iov = {buffer, size};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.space,
                         .msg_controllen = sizeof(control.space)};
    ssize_t got_bytes = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    if (got_bytes < 0)
        return got_bytes;
    got->truncated |= (msg.msg_flags & MSG_CTRUNC) != 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            keep(got, fd);
        }
    }
    return got_bytes;
}

/* Wait at most until `deadline` (and at least 10 ms) for the next receive. */
static void receive_by(int conn, double deadline)
{
    double left = deadline - cscu_now();
    struct timeval timeout = {(time_t)left, (suseconds_t)((left - (double)(time_t)left) * 1e6)};
    if (left < 0.01)
        timeout = (struct timeval){0, 10000};
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
}

/* After the request line (`pages` page bytes came with it): the pages until `want` descriptors arrived, by
 * `deadline`. 0, or -1 with `error` saying what the peer did (its descriptors stay in `got`, for `forget`). */
static int read_pages(int conn, size_t want, size_t pages, struct received *got, double deadline, char *error,
                      size_t room)
{
    char marks[PAGE_FDS];
    while (got->count + got->dropped < want && !got->truncated) {
        if (pages > want) {
            snprintf(error, room, "%zu pages brought %zu descriptors: a page carries 1 to %d", pages,
                     got->count + got->dropped, PAGE_FDS);
            return -1;
        }
        if (cscu_now() >= deadline) {
            snprintf(error, room, "%zu of the %zu announced descriptors arrived within %d s", got->count + got->dropped,
                     want, cscu_config()->request_s);
            return -1;
        }
        receive_by(conn, deadline);
        ssize_t n = receive(conn, marks, sizeof(marks), got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            snprintf(error, room, "%zu of the %zu announced descriptors arrived before the peer %s",
                     got->count + got->dropped, want, n == 0 ? "stopped sending" : "went silent");
            return -1;
        }
        pages += (size_t)n;
    }
    if (got->truncated)
        snprintf(error, room, "a page carried more than %d descriptors", PAGE_FDS);
    else if (got->count + got->dropped > want)
        snprintf(error, room, "%zu descriptors arrived, %zu were announced", got->count + got->dropped, want);
    return got->truncated || got->count + got->dropped > want ? -1 : 0;
}

/* The request line (descriptors riding with it go to `got`), NUL-terminated in place of its newline: its length,
 * -1 when the peer sent no newline by the deadline, -2 when not within MAX_LINE bytes, -3 when more than a page
 * of descriptors rode with it (an asker sends them with the line's first bytes or in pages after it: one that
 * trickles the line with a page on every byte is stopped there, not at STAGED_MAX). `*after`: the bytes read past
 * the newline (the first pages). */
static long read_line(int conn, char *line, struct received *got, double deadline, size_t *after)
{
    size_t n = 0;
    ssize_t got_bytes = 0;
    char *end;
    while (n < MAX_LINE && !memchr(line, '\n', n) && cscu_now() < deadline) {
        receive_by(conn, deadline);
        if ((got_bytes = receive(conn, line + n, MAX_LINE - n, got)) <= 0)
            break;
        n += (size_t)got_bytes;
        if (got->count + got->dropped > PAGE_FDS)
            return -3;
    }
    if (!(end = memchr(line, '\n', n)))
        return n >= MAX_LINE ? -2 : -1;
    *end = '\0';
    *after = n - (size_t)(end - line) - 1;
    return end - line;
}

/* Read, check and answer one request into `out`; every descriptor it brought is closed on return. */
static void answer_one(int conn, char *line, char *out, size_t room, struct received *got)
{
    char error[512];
    struct cscu_request req;
    size_t after = 0;
    double deadline = cscu_now() + cscu_config()->request_s;
    long want, length = read_line(conn, line, got, deadline, &after);
    if (length < 0) {
        refuse(out, room, "request", length == -2 ? "longer than 65536 bytes" : length == -3 ? "more than 16 "
               "descriptors came with the request line (send them in pages after it)"
               : "not one newline-terminated line");
    } else if (cscu_request_parse(line, &req, error, sizeof(error)) != 0) {
        refuse(out, room, "request", error);
    } else if ((want = cscu_request_allocations(&req, STAGED_MAX)) < 0) {
        snprintf(error, sizeof(error), "`allocations` must count the staged allocations in decimal, 1 to %d",
                 STAGED_MAX);
        refuse(out, room, "hydrate", error);
    } else if (want > 0 && strcmp(req.op, "hydrate") == 0
               && read_pages(conn, (size_t)want, after, got, deadline, error, sizeof(error)) != 0) {
        refuse(out, room, "hydrate", error);
    } else if (got->dropped) {
        snprintf(error, sizeof(error), "%zu descriptor(s) could not be kept (at most %d a request, and held by all "
                 "connections at once)", got->dropped, STAGED_MAX);
        refuse(out, room, "request", error);
    } else if (strcmp(req.op, "release") == 0 || strcmp(req.op, "hydrate") == 0) {
        if (op_begin(req.op, out, room) == 0) {
            double since = note(req.op, req.dir, NULL, 0);
            dispatch(&req, got, out, room);
            note(req.op, req.dir, out, since);
            op_end();
        }
    } else {
        dispatch(&req, got, out, room);
    }
    forget(got);  /* a staged allocation stays alive through its mapping, not through its descriptor */
}

static void serve_one(int conn)
{
    size_t room = answer_room();
    char *line = calloc(1, MAX_LINE + 1), *out = calloc(1, room), error[512];
    struct received got = {NULL, 0, 0, 0, 0};
    struct ucred peer;
    socklen_t length = sizeof(peer);
    struct timeval timeout = {cscu_config()->request_s, 0};
    if (!line || !out) {
        free(line);
        free(out);
        return;
    }
    setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0) {
        refuse(out, room, "request", "the peer's credentials cannot be read");
    } else if (peer.uid != 0 && peer.uid != geteuid()) {
        snprintf(error, sizeof(error), "peer uid %u gid %u is not allowed on this socket", peer.uid, peer.gid);
        refuse(out, room, "request", error);
    } else {
        answer_one(conn, line, out, room, &got);
    }
    size_t size = strlen(out);
    out[size] = '\n';
    for (size_t sent = 0; sent <= size;) {
        ssize_t w = send(conn, out + sent, size + 1 - sent, MSG_NOSIGNAL);
        if (w <= 0)
            break;
        sent += (size_t)w;
    }
    shutdown(conn, SHUT_WR);
    timeout.tv_sec = 1;
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    /* Closing with unread input would reset the answer; recv without a control buffer never installs a
     * descriptor (the kernel drops what rides with these bytes). */
    while (recv(conn, line, MAX_LINE, 0) > 0) {}
    free(line);
    free(out);
    free(got.fds);
}

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
            conns[i].used = 1, conns[i].fd = fd, conns[i].cut = 0, conns[i].since = monotonic();
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
    double now = monotonic();
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
    serve_one(conns[slot].fd);  /* the slot is this thread's until conn_close */
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
        serve_one(conn);
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

int cscu_control_start(void)
{
    pthread_mutex_lock(&start_lock);
    if (!started) {
        const char *path = cscu_config()->socket;
        pthread_t thread;
        pthread_attr_t attr;
        started = -1;
        if ((listener = bind_socket(path)) < 0) {
            fprintf(stderr, "coldsnap-cuda: cannot listen on %s (%s): this process's allocations stay on the "
                            "CUDA checkpoint path\n", path, errno ? strerror(errno) : "a live socket is there");
        } else {
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            if (pthread_create(&thread, &attr, serve, NULL) == 0) {
                pthread_setname_np(thread, "coldsnap-cuda");
                listening_pid = getpid();
                started = 1;
            } else {
                close(listener);
                unlink(path);
            }
            pthread_attr_destroy(&attr);
        }
    }
    int result = started == 1 ? 0 : -1;
    pthread_mutex_unlock(&start_lock);
    return result;
}

/* COLDSNAP_CUDA_INTERPOSER_LISTEN=load: listen from the start (a worker may then ask a process that has not
 * allocated yet; without a GPU it is the only way the socket exists). Otherwise the first allocation above the
 * threshold starts it: a process that never allocates through us has no socket. */
__attribute__((constructor)) static void cscu_loaded(void)
{
    const char *listen_at = getenv("COLDSNAP_CUDA_INTERPOSER_LISTEN");
    if (listen_at && strcmp(listen_at, "load") == 0 && cscu_config()->socket[0])
        cscu_control_start();
}

/* A process that exits normally removes its socket (one killed leaves it; the next bind replaces it). Only the
 * process that bound it: a child forked without exec (a prefork server's worker) inherits `started` and the path,
 * and its normal exit removed its parent's socket, so the worker could no longer release or hydrate it. */
__attribute__((destructor)) static void cscu_unloaded(void)
{
    if (started == 1 && getpid() == listening_pid)
        unlink(cscu_config()->socket);
}

/* One connection of the control socket: the peer's credentials, its request line and the descriptors that ride
 * with it, the answer (coldsnap_probe/jsonline.py's protocol: one request line, one answer line, then the
 * server closes).
 *
 * Only root and this process's uid are answered (SO_PEERCRED); anyone else gets {"ok":false,...}. A request is
 * one flat JSON object of at most 64 KiB, read within COLDSNAP_CUDA_INTERPOSER_REQUEST_S (10 s) from the
 * connection, however slowly it trickles in; unknown keys, wrong types and unknown operations are refused and
 * change nothing (request.c parses it, operations.c answers it).
 *
 * Descriptors (SCM_RIGHTS) ride only with a `hydrate` that announces them (`allocations`: the allocations a node
 * hydrator staged, one per released region, in region order): they come with the request line and after it in
 * pages, each one byte with at most CSCU_PAGE_FDS descriptors (a larger page is refused: the kernel closes what
 * does not fit), until as many as announced arrived, within the request's deadline. Every descriptor received is
 * closed before the answer, whatever happened: one over the announced count, a page cut short, a peer that stops
 * sending or leaves midway; descriptors sent after the announced count are never received (the kernel drops
 * them with the connection).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "control.h"
#include "dump.h"

/* The descriptors a connection brought, in arrival order. Invariant: every one is in `fds` (closed by `forget`)
 * or was closed on arrival (`dropped`: beyond CSCU_STAGED_MAX, or when `fds` could not grow). */
struct received { int *fds; size_t count, room, dropped; int truncated; };

/* Descriptors held by every connection together. Invariant: at most CSCU_STAGED_MAX (one hydrate's worth: a second one
 * at once would be refused anyway), so that peers crowding the socket with descriptors, each within its own
 * request's cap, cannot take the engine's descriptor table (its own opens would fail with EMFILE). */
static long held_fds;

static void keep(struct received *got, int fd)
{
    if (__atomic_add_fetch(&held_fds, 1, __ATOMIC_ACQ_REL) > CSCU_STAGED_MAX) {
        __atomic_sub_fetch(&held_fds, 1, __ATOMIC_ACQ_REL);
        close(fd);
        got->dropped++;
        return;
    }
    if (got->count == got->room && got->room < CSCU_STAGED_MAX) {  /* grown as they come: 16, 32, ... CSCU_STAGED_MAX */
        size_t room = got->room ? got->room * 2 : CSCU_PAGE_FDS;
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
        if (got->fds[i] >= 0)  /* -1: closed by the hydration that was done with it */
            close(got->fds[i]);
    __atomic_sub_fetch(&held_fds, (long)got->count, __ATOMIC_ACQ_REL);
    got->count = 0;
}

/* recv, also taking the descriptors that ride with the bytes (SCM_RIGHTS, at most CSCU_PAGE_FDS a message) into `got`;
 * a message that carried more is marked truncated (the kernel closed the ones that did not fit). */
static ssize_t receive(int conn, char *buffer, size_t size, struct received *got)
{
    union { struct cmsghdr align; char space[CMSG_SPACE(sizeof(int) * CSCU_PAGE_FDS)]; } control;
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
    char marks[CSCU_PAGE_FDS];
    while (got->count + got->dropped < want && !got->truncated) {
        if (pages > want) {
            snprintf(error, room, "%zu pages brought %zu descriptors: a page carries 1 to %d", pages,
                     got->count + got->dropped, CSCU_PAGE_FDS);
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
        snprintf(error, room, "a page carried more than %d descriptors", CSCU_PAGE_FDS);
    else if (got->count + got->dropped > want)
        snprintf(error, room, "%zu descriptors arrived, %zu were announced", got->count + got->dropped, want);
    return got->truncated || got->count + got->dropped > want ? -1 : 0;
}

/* The request line (descriptors riding with it go to `got`), NUL-terminated in place of its newline: its length,
 * -1 when the peer sent no newline by the deadline, -2 when not within CSCU_REQUEST_LINE bytes, -3 when more than
 * a page of descriptors rode with it (an asker sends them with the line's first bytes or in pages after it: one
 * that trickles the line with a page on every byte is stopped there, not at CSCU_STAGED_MAX). `*after`: the bytes
 * read past the newline (the first pages). */
static long read_line(int conn, char *line, struct received *got, double deadline, size_t *after)
{
    size_t n = 0;
    ssize_t got_bytes = 0;
    char *end;
    while (n < CSCU_REQUEST_LINE && !memchr(line, '\n', n) && cscu_now() < deadline) {
        receive_by(conn, deadline);
        if ((got_bytes = receive(conn, line + n, CSCU_REQUEST_LINE - n, got)) <= 0)
            break;
        n += (size_t)got_bytes;
        if (got->count + got->dropped > CSCU_PAGE_FDS)
            return -3;
    }
    if (!(end = memchr(line, '\n', n)))
        return n >= CSCU_REQUEST_LINE ? -2 : -1;
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
        if (length == -2)
            cscu_refuse(out, room, "request", "longer than %d bytes", CSCU_REQUEST_LINE);
        else if (length == -3)
            cscu_refuse(out, room, "request", "more than %d descriptors came with the request line (send them in "
                        "pages after it)", CSCU_PAGE_FDS);
        else
            cscu_refuse(out, room, "request", "not one newline-terminated line");
    } else if (cscu_request_parse(line, &req, error, sizeof(error)) != 0) {
        cscu_refuse(out, room, "request", "%s", error);
    } else if ((want = cscu_request_allocations(&req, CSCU_STAGED_MAX)) < 0) {
        cscu_refuse(out, room, "hydrate", "`allocations` must count the staged allocations in decimal, 1 to %d",
                    CSCU_STAGED_MAX);
    } else if (want > 0 && strcmp(req.op, "hydrate") == 0
               && read_pages(conn, (size_t)want, after, got, deadline, error, sizeof(error)) != 0) {
        cscu_refuse(out, room, "hydrate", "%s", error);
    } else if (got->dropped) {
        cscu_refuse(out, room, "request", "%zu descriptor(s) could not be kept (at most %d a request, and held by "
                    "all connections at once)", got->dropped, CSCU_STAGED_MAX);
    } else {
        cscu_operate(&req, got->fds, got->count, got->count + got->dropped, out, room);
    }
    forget(got);  /* a staged allocation stays alive through its mapping, not through its descriptor */
}

/* The peer may ask: root or this process's uid. 0, or -1 with the refusal in `out`. */
static int peer_allowed(int conn, char *out, size_t room)
{
    struct ucred peer;
    socklen_t length = sizeof(peer);
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0) {
        cscu_refuse(out, room, "request", "the peer's credentials cannot be read");
        return -1;
    }
    if (peer.uid != 0 && peer.uid != geteuid()) {
        cscu_refuse(out, room, "request", "peer uid %u gid %u is not allowed on this socket", peer.uid, peer.gid);
        return -1;
    }
    return 0;
}

/* The answer and its newline, then the connection drained: closing with unread input would reset the answer;
 * recv without a control buffer never installs a descriptor (the kernel drops what rides with these bytes). */
static void send_answer(int conn, char *out, char *scratch)
{
    struct timeval timeout = {1, 0};
    size_t size = strlen(out);
    out[size] = '\n';
    for (size_t sent = 0; sent <= size;) {
        ssize_t w = send(conn, out + sent, size + 1 - sent, MSG_NOSIGNAL);
        if (w <= 0)
            break;
        sent += (size_t)w;
    }
    shutdown(conn, SHUT_WR);
    setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    while (recv(conn, scratch, CSCU_REQUEST_LINE, 0) > 0) {}
}

void cscu_serve_connection(int conn)
{
    size_t room = cscu_answer_room();
    char *line = calloc(1, CSCU_REQUEST_LINE + 1), *out = calloc(1, room);
    struct received got = {NULL, 0, 0, 0, 0};
    struct timeval timeout = {cscu_config()->request_s, 0};
    if (!line || !out)
        goto cleanup;
    setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    if (peer_allowed(conn, out, room) == 0)
        answer_one(conn, line, out, room, &got);
    send_answer(conn, out, line);
cleanup:
    free(line);
    free(out);
    free(got.fds);
}

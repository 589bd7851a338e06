/* The control socket's operations: `status`, `release` and `hydrate`, each answered as one JSON object.
 *
 * Releases and hydrations are serialised: a second release while one runs (or hydrate while one runs) is refused
 * naming it, a hydrate waits for a release to end (and the reverse); `status` answers meanwhile, from the region
 * table's totals last counted when an operation holds the table. connection.c reads and checks the request;
 * this file decides what it does to the regions and the gate.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "control.h"
#include "dump.h"
#include "stack_limit.h"

/* Invariant: `released` is 1 between a release that unmapped anything and the hydrate that succeeds. */
static int released;
static char released_dir[CSCU_REQUEST_FIELD];

/* The one mutating operation (release or hydrate) running, and the region table's totals last seen, so that
 * `status` answers while that operation holds the table. Guarded by op_lock, which is only ever held briefly
 * (never while waiting for the region table). */
struct totals { size_t count, bytes, mapped, segments; };
static pthread_mutex_t op_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t op_done = PTHREAD_COND_INITIALIZER;
static const char *operation;   /* "release", "hydrate" or NULL */
static double operation_since;
static struct totals last_totals;

/* Claims the one mutating operation for `op`: 0, or -1 with the refusal naming the one in progress in `out`.
 * The same operation twice at once is refused (a second release while one runs is a mistake); the other one
 * waits for it to end (a capture's rollback `hydrate` after its asker gave up on a slow `release` must still
 * bring the memory back, as it did when connections were served one at a time). */
static int op_begin(const char *op, char *out, size_t room)
{
    pthread_mutex_lock(&op_lock);
    while (operation && strcmp(operation, op) != 0)
        pthread_cond_wait(&op_done, &op_lock);
    const char *running = operation;
    double for_s = cscu_now() - operation_since;
    if (!running) {
        operation = op;
        operation_since = cscu_now();
    }
    pthread_mutex_unlock(&op_lock);
    if (!running)
        return 0;
    cscu_refuse(out, room, op, "a %s is in progress (for %.1f s): one release or hydrate at a time", running, for_s);
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

size_t cscu_answer_room(void)
{
    struct totals t = tally();
    return CSCU_ANSWER + t.count * 512 + t.segments * 256;  /* a region's manifest entry, a segment's */
}

/* `,"moved":{...}` from the table (null while a release or hydration holds it). */
static size_t moved(char *out, size_t room)
{
    size_t used = (size_t)snprintf(out, room, ",\"moved\":");
    if (used >= room)
        return room ? room - 1 : 0;
    for (int tries = 0; tries < 100; tries++) {
        if (cscu_regions_trylock() == 0) {
            used += cscu_moved_json(out + used, room - used);
            cscu_regions_unlock();
            return used;
        }
        pthread_mutex_lock(&op_lock);
        int busy = operation != NULL;
        pthread_mutex_unlock(&op_lock);
        if (busy)
            break;
        usleep(1000);
    }
    return used + (size_t)snprintf(out + used, room - used, "null");
}

static void status(char *out, size_t room)
{
    struct totals t = tally();
    const struct cscu_config *cfg = cscu_config();
    pthread_mutex_lock(&op_lock);
    const char *running = operation;
    pthread_mutex_unlock(&op_lock);
    size_t used = (size_t)snprintf(out, room, "{\"ok\":true,\"pid\":%d,\"regions\":%zu,\"bytes\":%zu,"
                                   "\"mapped_bytes\":%zu,\"released\":%s,\"operation\":%s%s%s,\"gate\":\"%s\","
                                   "\"threshold\":%zu,\"threads\":%d,\"staging_bytes\":%zu,\"dump_staging_bytes\":%zu,"
                                   "\"drain_s\":%d,"
                                   "\"request_s\":%d,\"engine_vmm\":%s,\"stream_ordered\":%s,\"shrink_stack\":%s,"
                                   "\"stack_bytes\":%zu,\"stack_lowered\":%zu,\"digest_engine\":\"%s\",\"driver\":%s,"
                                   "\"uncovered\":", (int)getpid(), t.count, t.bytes, t.mapped,
                                   __atomic_load_n(&released, __ATOMIC_ACQUIRE) ? "true" : "false",
                                   running ? "\"" : "", running ? running : "null", running ? "\"" : "",
                                   cscu_gate_is_open() ? "open" : "closed", cfg->threshold, cfg->threads,
                                   cfg->staging, cfg->dump_staging, cfg->drain_s, cfg->request_s,
                                   cfg->engine_vmm ? "true" : "false",
                                   cfg->stream_ordered ? "true" : "false", cfg->stack_shrink ? "true" : "false",
                                   cfg->stack_bytes, cscu_stack_lowered(), cscu_sha256_engine(),
                                   cscu_driver() ? "true" : "false");
    used += cscu_counts_json(out + used, room - used);
    used += moved(out + used, room - used);
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

/* A release or hydration says on the engine's stderr when it starts and how it ended (one line each): a slow or
 * stuck one is visible in the engine's log even when its asker has given up. */
static double note(const char *op, const char *dir, const char *out, double since)
{
    double now = cscu_now();
    int ok = out && strncmp(out, "{\"ok\":true", 10) == 0;
    if (!out)
        fprintf(stderr, "coldsnap-cuda: %s (%s): started, %d copy threads, %zu-byte staging buffers\n", op,
                dir[0] ? dir : "the released dump", cscu_config()->threads,
                strcmp(op, "release") == 0 ? cscu_config()->dump_staging : cscu_config()->staging);
    else
        fprintf(stderr, "coldsnap-cuda: %s: %s after %.3f s%s%.300s\n", op, ok ? "done" : "refused", now - since,
                ok ? "" : ": ", ok ? "" : out);
    return now;
}

/* `key` and what `value` writes, put inside the JSON object that ends `out` (a release's answer). */
static void answer_append(char *out, size_t room, const char *key, size_t (*value)(char *, size_t))
{
    size_t used = strlen(out), n = strlen(key);
    if (used < 1 || used + n + 2 >= room)
        return;
    memcpy(out + used - 1, key, n + 1);
    used += n - 1;
    used += value(out + used, room - used - 1);
    snprintf(out + used, room - used, "}");
}

/* 1 when every region of the table has its backing (`all`), or when any has none (`!all`). */
static int regions_mapped(int all)
{
    size_t count;
    int found = all;
    struct cscu_region *r = cscu_regions(&count);
    for (size_t i = 0; i < count; i++)
        found = all ? found && r[i].handle != 0 : found || !r[i].handle;
    return found;
}

static void release(const struct cscu_request *req, char *out, size_t room)
{
    if (released) {
        cscu_refuse(out, room, "release", "the regions are released already (hydrate them first)");
        return;
    }
    if (!req->has_dir || req->dir[0] != '/') {
        cscu_refuse(out, room, "release", "`dir` must be the absolute path of the dump directory");
        return;
    }
    long inside = cscu_gate_close();  /* new launches wait; those running end first */
    if (inside) {
        cscu_refuse(out, room, "release", "%ld engine call(s) stayed inside the driver for %d s (a synchronise on "
                    "work that does not end?): nothing was released, the engine runs on", inside,
                    cscu_config()->drain_s);
        return;
    }
    cscu_async_settle();  /* stream-ordered frees done, the freed regions kept for reuse let go: none is dumped */
    cscu_regions_lock();
    cscu_release(req->dir, out, room);
    released = regions_mapped(0);
    if (released && strncmp(out, "{\"ok\":true", 10) == 0)  /* the gate stays closed until the set-back */
        answer_append(out, room, ",\"stack_limit\":", cscu_stack_lower);
    cscu_regions_unlock();
    if (released)
        snprintf(released_dir, sizeof(released_dir), "%s", req->dir);
    else
        cscu_gate_open();  /* nothing was released: the engine keeps running as before */
}

/* The refusal of a hydrate request's fields, or NULL when it may go on. */
static const char *hydrate_refusal(const struct cscu_request *req, const char *policy, const char *verify)
{
    if (strcmp(verify, CSCU_VERIFY_DIGEST) != 0 && strcmp(verify, CSCU_VERIFY_SAMPLED) != 0)
        return "`verify` must be digest or sampled";
    if (strcmp(policy, CSCU_POLICY_SAME_MODEL) != 0 && strcmp(policy, CSCU_POLICY_SAME_GPU) != 0)
        return "`policy` must be same-model or same-gpu";
    if (req->has_dir && req->dir[0] != '/')
        return "`dir` must be an absolute path";
    return released ? NULL : "nothing is released";
}

static void hydrate(const struct cscu_request *req, int *fds, size_t count, char *out, size_t room)
{
    const char *policy = req->policy[0] ? req->policy : CSCU_POLICY_SAME_MODEL;
    const char *verify = req->verify[0] ? req->verify : CSCU_VERIFY_DIGEST;
    const char *dir = req->has_dir ? req->dir : released_dir;
    const char *why = hydrate_refusal(req, policy, verify);
    if (why) {
        cscu_refuse(out, room, "hydrate", "%s", why);
        return;
    }
    cscu_regions_lock();
    /* The engine's stack limit first: it only reserves (no copy), and a restore that cannot give the engine back its
     * own limit must not run it (a recursive kernel would overflow the lowered stack), so it fails before any fill. */
    double stack_s = 0;
    char error[256];
    if (cscu_stack_restore(&stack_s, error, sizeof(error)) != 0) {
        cscu_regions_unlock();
        cscu_refuse(out, room, "hydrate: stack limit", "%s; the regions stay released, the gate closed", error);
        return;
    }
    if (count)  /* a node hydrator filled one allocation per region while the process was restored */
        cscu_hydrate_staged(dir, policy, fds, count, out, room);
    else
        cscu_hydrate(dir, policy, strcmp(verify, CSCU_VERIFY_DIGEST) == 0, out, room);
    int all = regions_mapped(1);
    cscu_regions_unlock();
    size_t used = strlen(out);
    if (used > 2 && strncmp(out, "{\"ok\":true,\"report\":", 20) == 0)  /* inside the report: its last key */
        snprintf(out + used - 2, room - used + 2, ",\"stack_restore_s\":%.6f}}", stack_s);
    if (all && strncmp(out, "{\"ok\":true", 10) == 0) {
        released = 0;
        cscu_gate_open();  /* every region is back and verified: the engine's threads go on */
    }
}

void cscu_operate(const struct cscu_request *req, int *fds, size_t count, size_t arrived, char *out,
                  size_t room)
{
    int mutating = strcmp(req->op, "release") == 0 || strcmp(req->op, "hydrate") == 0;
    if ((arrived || req->allocations[0]) && strcmp(req->op, "hydrate") != 0) {
        cscu_refuse(out, room, "request", "only a hydrate request may carry descriptors (staged allocations)");
    } else if (arrived && !req->allocations[0]) {
        cscu_refuse(out, room, "hydrate", "staged allocations come with their count (`allocations`, decimal)");
    } else if (strcmp(req->op, "status") == 0) {
        status(out, room);
    } else if (!mutating) {
        cscu_refuse(out, room, "request", "unknown `op` (status, release or hydrate)");
    } else if (op_begin(req->op, out, room) == 0) {
        double since = note(req->op, req->dir, NULL, 0);
        if (req->op[0] == 'r')
            release(req, out, room);
        else
            hydrate(req, fds, count, out, room);
        note(req->op, req->dir, out, since);
        op_end();
    }
}

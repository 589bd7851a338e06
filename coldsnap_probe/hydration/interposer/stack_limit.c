/* The contexts' stack reservation, made small for the CUDA checkpoint and given back before the engine runs again.
 *
 * The driver reserves CU_LIMIT_STACK_SIZE bytes of device memory for every thread the GPU can hold resident (132
 * SMs x 2048 threads on an H200: 277 MB at the 1 KiB default), and the CUDA checkpoint copies that reservation into
 * host memory, which CRIU then dumps and restores and the driver copies back. A release lowers the limit of every
 * context holding a region to COLDSNAP_CUDA_INTERPOSER_STACK_BYTES, after recording the engine's own value; the
 * hydration sets each back to exactly that value before the gate opens. It is safe there because nothing of the
 * engine's can run on the device meanwhile: the release holds the gate closed (every launch, copy and synchronise
 * waits), every call inside the driver has ended and every context is synchronised before it; the engine's own
 * cuCtxGetLimit/cuCtxSetLimit wait at the gate too (interpose.c), so it never sees nor overrides the lowered value.
 * A kernel whose frames the compiler sizes is never at risk (the driver grows the reservation at its launch); a
 * recursive one relies on the limit, which is why a restore whose set-back fails is refused (operations.c).
 * The callers hold the region table. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dump.h"
#include "stack_limit.h"

#define STACK_CONTEXTS 16       /* contexts one process holds regions in (one per GPU in practice) */

typedef CUresult (*get_limit_fn)(size_t *, CUlimit);
typedef CUresult (*set_limit_fn)(CUlimit, size_t);

/* Invariant: `lowered` is set from the lowering that succeeded until the set-back that succeeded; `engine` is the
 * value the engine's context had when the release found it. */
static struct { CUcontext context; size_t engine; int lowered; } stack_found[STACK_CONTEXTS];
static size_t stack_found_count;
static size_t stack_left;       /* region contexts beyond the table at the last release: left at their own limit */

static int limit_calls(get_limit_fn *get, set_limit_fn *set)
{
    *get = (get_limit_fn)cscu_real("cuCtxGetLimit");
    *set = (set_limit_fn)cscu_real("cuCtxSetLimit");
    return *get && *set && cscu_driver() ? 0 : -1;
}

/* The distinct contexts of the region table, in `stack_found`: records of an earlier release forgotten, but for a
 * context still lowered (its set-back failed), whose recorded value is the engine's and must not be read again.
 * Those beyond the table are counted in `stack_left` (the release's answer names them: never silently). */
static void stack_contexts(void)
{
    size_t count, kept = 0;
    struct cscu_region *r = cscu_regions(&count);
    for (size_t k = 0; k < stack_found_count; k++)
        if (stack_found[k].lowered)
            stack_found[kept++] = stack_found[k];
    stack_found_count = kept;
    stack_left = 0;
    for (size_t i = 0; i < count; i++) {
        size_t k = 0, j = 0;
        while (k < stack_found_count && stack_found[k].context != r[i].context)
            k++;
        if (k == stack_found_count && stack_found_count < STACK_CONTEXTS)
            stack_found[stack_found_count++] = (typeof(stack_found[0])){r[i].context, 0, 0};
        else if (k == stack_found_count) {  /* the table is full: each such context counted at its first region */
            while (j < i && r[j].context != r[i].context)
                j++;
            stack_left += j == i;
        }
    }
}

/* Lower context k to `target` (never raise it), its own value recorded first; `why` set when a call failed. */
static void lower_one(size_t k, size_t target, get_limit_fn get, set_limit_fn set, size_t *now, char *why,
                     size_t room)
{
    CUresult rc = cscu_driver()->ctx_set_current(stack_found[k].context);
    const char *step = "cuCtxSetCurrent";
    size_t *read = stack_found[k].lowered ? now : &stack_found[k].engine;  /* still lowered: keep the engine's */
    if (rc == CUDA_SUCCESS && (rc = get(read, CU_LIMIT_STACK_SIZE)) != CUDA_SUCCESS)
        step = "cuCtxGetLimit(CU_LIMIT_STACK_SIZE)";
    *now = *read;
    if (rc == CUDA_SUCCESS && stack_found[k].engine > target) {
        if ((rc = set(CU_LIMIT_STACK_SIZE, target)) != CUDA_SUCCESS)
            step = "cuCtxSetLimit(CU_LIMIT_STACK_SIZE)";
        else
            stack_found[k].lowered = 1;
        if (rc == CUDA_SUCCESS && (rc = get(now, CU_LIMIT_STACK_SIZE)) != CUDA_SUCCESS)
            step = "cuCtxGetLimit(CU_LIMIT_STACK_SIZE)";
    }
    if (rc != CUDA_SUCCESS)
        snprintf(why, room, "context %p: %s: %s", (void *)stack_found[k].context, step, cscu_error_name(rc));
}

size_t cscu_stack_lower(char *out, size_t room)
{
    double t0 = cscu_now();
    const struct cscu_config *cfg = cscu_config();
    size_t engine = 0, set = 0, now = 0;
    char why[256] = "";
    get_limit_fn get;
    set_limit_fn lower;
    stack_contexts();
    if (limit_calls(&get, &lower) != 0)
        snprintf(why, sizeof(why), "the driver has no cuCtxGetLimit/cuCtxSetLimit");
    for (size_t k = 0; !why[0] && k < stack_found_count; k++) {  /* a failure stops here, its values counted */
        lower_one(k, cfg->stack_shrink ? cfg->stack_bytes : (size_t)-1, get, lower, &now, why, sizeof(why));
        engine = stack_found[k].engine > engine ? stack_found[k].engine : engine;
        set = now > set ? now : set;
    }
    if (why[0])  /* the checkpoint goes on with what the driver has now: the engine's value, or a lowered one */
        set = engine > set ? engine : set;
    int n = snprintf(out, room, "{\"enabled\":%s,\"engine_bytes\":%zu,\"set_bytes\":%zu,\"contexts\":%zu,"
                     "\"contexts_left\":%zu,\"seconds\":%.6f%s", cfg->stack_shrink ? "true" : "false", engine, set,
                     stack_found_count, stack_left, cscu_now() - t0, why[0] ? ",\"error\":\"" : "}");
    if (why[0] && n >= 0 && (size_t)n < room)
        n += snprintf(out + n, room - (size_t)n, "%s\"}", why);  /* `why` holds no quote: a pointer and names */
    return n < 0 ? 0 : (size_t)n < room ? (size_t)n : room - 1;
}

int cscu_stack_restore(double *seconds, char *error, size_t room)
{
    double t0 = cscu_now();
    get_limit_fn get;
    set_limit_fn set;
    error[0] = '\0';
    for (size_t k = 0; k < stack_found_count; k++) {
        if (!stack_found[k].lowered)
            continue;
        size_t now = 0;
        CUresult rc = limit_calls(&get, &set) != 0 ? CUDA_ERROR_NOT_FOUND
                      : cscu_driver()->ctx_set_current(stack_found[k].context);
        if (rc == CUDA_SUCCESS && (rc = set(CU_LIMIT_STACK_SIZE, stack_found[k].engine)) == CUDA_SUCCESS)
            rc = get(&now, CU_LIMIT_STACK_SIZE);
        if (rc == CUDA_SUCCESS && now == stack_found[k].engine)
            stack_found[k].lowered = 0;
        else if (!error[0] && rc == CUDA_SUCCESS)
            snprintf(error, room, "context %p: set back to the engine's %zu bytes, the driver answers %zu",
                     (void *)stack_found[k].context, stack_found[k].engine, now);
        else if (!error[0])
            snprintf(error, room, "context %p: cuCtxSetLimit(CU_LIMIT_STACK_SIZE, %zu), the engine's: %s",
                     (void *)stack_found[k].context, stack_found[k].engine, cscu_error_name(rc));
    }
    *seconds = cscu_now() - t0;
    return error[0] ? -1 : 0;
}

size_t cscu_stack_lowered(void)
{
    size_t n = 0;
    for (size_t k = 0; k < stack_found_count; k++)
        n += (size_t)stack_found[k].lowered;
    return n;
}

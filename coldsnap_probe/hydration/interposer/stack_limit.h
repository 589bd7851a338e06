/* The contexts' stack reservation around the CUDA checkpoint (stack_limit.c; internal to libcoldsnap_cuda, every
 * symbol hidden). Both expect the region table locked and the gate closed. */
#ifndef CSCU_STACK_LIMIT_H
#define CSCU_STACK_LIMIT_H

#include <stddef.h>

#include "cscu.h"

/* Release: record each region context's CU_LIMIT_STACK_SIZE and lower it to the configured bytes (when on and
 * lower than the engine's). Writes a JSON object into `out` (enabled, engine_bytes, set_bytes, contexts,
 * contexts_left: those beyond its table of 16, left at their own limit, seconds, and `error` when a driver call
 * failed: the checkpoint then copies what the driver has) and returns its length.
 * Never fails the release. */
CSCU_HIDDEN size_t cscu_stack_lower(char *out, size_t room);
/* Hydrate: every lowered context set back to the engine's own value, read back to be sure; 0, or -1 with the
 * first failure in `error` (the others are still tried). Idempotent: a context set back is not touched again.
 * `seconds`: what it took. */
CSCU_HIDDEN int cscu_stack_restore(double *seconds, char *error, size_t room);
/* The contexts whose limit is lowered now (`status`; read without the table's lock: a count for people). */
CSCU_HIDDEN size_t cscu_stack_lowered(void);

#endif

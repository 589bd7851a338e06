/* The control socket's request, parsed (request.c): one flat JSON object of string values, each key once.
 * No I/O, no CUDA, no global state: control.c reads the line and answers it; tests/probe/fuzz_interposer_request.c
 * feeds this parser mutated lines under AddressSanitizer and UndefinedBehaviorSanitizer.
 * Internal to libcoldsnap_cuda (every symbol hidden). */
#ifndef CSCU_REQUEST_H
#define CSCU_REQUEST_H

#include <stddef.h>

#include "constants.h"

struct cscu_request {
    char op[32];
    char dir[CSCU_REQUEST_FIELD];
    char policy[32];
    char verify[32];
    char allocations[24];
    int has_dir;                /* 1 when the request named `dir` (an empty one included) */
};

_Static_assert(sizeof(((struct cscu_request *)0)->policy) > sizeof(CSCU_POLICY_SAME_MODEL)
               && sizeof(((struct cscu_request *)0)->verify) > sizeof(CSCU_VERIFY_SAMPLED), "the values fit");

/* Parse `line` (NUL-terminated) as {"op": ..., "dir": ..., "policy": ..., "verify": ..., "allocations": ...},
 * every key optional, each at most once and within its field: 0 with `req` filled (absent keys empty), or -1
 * with `error` (`room` bytes, always NUL-terminated) naming the key and the rule. Reads nothing past the NUL. */
int cscu_request_parse(const char *line, struct cscu_request *req, char *error, size_t room);

/* The staged allocations a request announced (`allocations`: decimal digits, 1 to `most`): 0 when absent, -1
 * when malformed or out of range. */
long cscu_request_allocations(const struct cscu_request *req, size_t most);

#endif

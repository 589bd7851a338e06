/* The control socket's three parts (internal to libcoldsnap_cuda, every symbol hidden), each calling only down:
 * control.c (the listening socket and a thread per connection) → connection.c (one connection: the peer's
 * credentials, its request line and descriptors, the answer) → operations.c (status, release, hydrate). */
#ifndef CSCU_CONTROL_H
#define CSCU_CONTROL_H

#include <stddef.h>

#include "cscu.h"
#include "request.h"


/* Serve connection `conn` (a request, its answer); the descriptor stays the caller's. */
CSCU_HIDDEN void cscu_serve_connection(int conn);

/* Bytes enough for any answer about the current region table (a release's manifest included). */
CSCU_HIDDEN size_t cscu_answer_room(void);
/* Answer the parsed request `req` into `out`: `fds` are the `count` staged allocations kept of the `arrived`
 * that came with it (the descriptors stay the caller's, but one a hydration is done with may be closed and set to
 * -1: a staged allocation copied from is freed once nothing holds it). */
CSCU_HIDDEN void cscu_operate(const struct cscu_request *req, int *fds, size_t count, size_t arrived,
                              char *out, size_t room);

#endif

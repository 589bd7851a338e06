/* The dump's digest kinds (digest.c): a segment's digest is computed per 64 MiB chunk, by the kind the release
 * chose (COLDSNAP_CUDA_INTERPOSER_DIGEST) and the hydration reads back from the digest's text. Internal. */
#ifndef CSCU_DIGEST_H
#define CSCU_DIGEST_H

#include <stddef.h>
#include <stdint.h>

#include "constants.h"
#include "cscu.h"

enum cscu_digest_kind { CSCU_KIND_SHA256 = 0, CSCU_KIND_CRC32 = 1 };

/* One chunk's digest in the making. */
struct cscu_chunk_digest { int kind; uint32_t crc; cscu_sha256 sha; };

/* The kind a release writes: COLDSNAP_CUDA_INTERPOSER_DIGEST (crc32-64m by default, sha256-64m for a content
 * address), or -1 when it names neither (the release refuses). */
CSCU_HIDDEN int cscu_digest_configured(void);
/* The kind a segment digest's text names by its prefix, or -1. */
CSCU_HIDDEN int cscu_digest_kind_of(const char *text);
/* What computes `kind` here: "libcrypto"/"builtin" (SHA-256), "vpclmul"/"pclmul"/"tables" (CRC-32). */
CSCU_HIDDEN const char *cscu_digest_engine(int kind);
CSCU_HIDDEN void cscu_chunk_init(struct cscu_chunk_digest *h, int kind);
CSCU_HIDDEN void cscu_chunk_update(struct cscu_chunk_digest *h, const void *data, size_t size);
/* The chunk's digest into `out` (32 bytes for SHA-256, the first 4 for CRC-32, big-endian); frees what init took. */
CSCU_HIDDEN void cscu_chunk_final(struct cscu_chunk_digest *h, unsigned char out[32]);
/* The digest of `n` zero bytes into `out` (as cscu_chunk_final): a chunk the release recorded as zeros is set on the
 * device, never read, and checked against the manifest as the zeros it is. A whole chunk's is computed once a kind. */
CSCU_HIDDEN void cscu_zeros_digest(int kind, size_t n, unsigned char out[32]);
/* A segment's digest text from its chunks' digests in order: sha256-64m:<SHA-256 of the chunk digests> or
 * crc32-64m:<each chunk's CRC, 8 hex digits>. */
CSCU_HIDDEN void cscu_digest_text(int kind, const unsigned char (*chunks)[32], size_t n, char out[CSCU_DIGEST_TEXT]);

#endif

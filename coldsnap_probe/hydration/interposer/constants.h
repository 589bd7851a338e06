/* The constants the interposer and its Python clients must agree on, in one place. Each names its Python twin;
 * tests/probe/test_interposer_constants.py compiles this header, prints every value and checks it against the
 * Python one (a change on one side only fails there). Plain C, no other header: request.c's fuzzer includes it.
 */
#ifndef CSCU_CONSTANTS_H
#define CSCU_CONSTANTS_H

/* The device dump's manifest and files (hydration/_interposer.py: DUMP_KIND, _SEGMENT_FILE). */
#define CSCU_DUMP_KIND "coldsnap-device-dump"
#define CSCU_SEGMENT_FILE "seg-%zu.bin"             /* a dump file's name, numbered from 0 */
#define CSCU_SEGMENT ((size_t)1 << 30)              /* bytes of one dump file (tmpfs serialises writes per file) */

/* The dump's digests, per 64 MiB chunk (hydration/_digests.py: DIGEST_PREFIX, CRC_PREFIX, DIGEST_CHUNK,
 * region_digest, crc_digest): sha256-64m, SHA-256 over the SHA-256 of each chunk (a content address); crc32-64m,
 * each chunk's CRC-32 (zlib's), 8 hex digits a chunk: the release's default (hydration/_interposer.py:
 * ENV_DIGEST names the other). */
#define CSCU_DIGEST_PREFIX "sha256-64m:"
#define CSCU_CRC_PREFIX "crc32-64m:"
#define CSCU_ENV_DIGEST "COLDSNAP_CUDA_INTERPOSER_DIGEST"
#define CSCU_DIGEST_CHUNK ((size_t)64 << 20)
#define CSCU_SEGMENT_CHUNKS (CSCU_SEGMENT / CSCU_DIGEST_CHUNK)  /* chunks of a full dump file (16) */
#define CSCU_DIGEST_TEXT (sizeof(CSCU_CRC_PREFIX) + 8 * CSCU_SEGMENT_CHUNKS)  /* the longer of the two, NUL */

/* The control socket (hydration/_interposer.py: ENV_SOCKET, POLICIES; _device_memory.py: INTERPOSER_PAGE;
 * hydration/_peer_files.py: STAGE_ALLOCATIONS). */
#define CSCU_ENV_SOCKET "COLDSNAP_CUDA_INTERPOSER_SOCKET"
#define CSCU_POLICY_SAME_MODEL "same-model"         /* the default */
#define CSCU_POLICY_SAME_GPU "same-gpu"
#define CSCU_VERIFY_DIGEST "digest"                 /* the default */
#define CSCU_VERIFY_SAMPLED "sampled"               /* hydration/_interposer.py: verification() */
#define CSCU_PAGE_FDS 16                            /* descriptors one page may carry */
#define CSCU_STAGED_MAX 4096                        /* descriptors one request may bring: one per region */
/* A dump staged to be copied from (memory/_device_dump.py: STAGE_GROUP): one staged allocation backs consecutive
 * released regions (table order) up to this many bytes, a larger region alone. */
#define CSCU_STAGE_GROUP ((size_t)1 << 30)
#define CSCU_REQUEST_LINE 65536                     /* bytes of a request line */
#define CSCU_REQUEST_FIELD 4096                     /* bytes of a `dir` value, its NUL included */
#define CSCU_ANSWER 65536                           /* bytes of a control answer beyond the manifest */

_Static_assert(CSCU_SEGMENT % CSCU_DIGEST_CHUNK == 0, "a dump file holds whole digest chunks");
_Static_assert(CSCU_DIGEST_TEXT >= sizeof(CSCU_DIGEST_PREFIX) + 64, "a sha256-64m digest fits too");
_Static_assert(CSCU_SEGMENT_CHUNKS <= 32, "a segment's zero chunks are one 32-bit mask");
_Static_assert(CSCU_PAGE_FDS <= CSCU_STAGED_MAX, "a page carries at most one request's descriptors");
_Static_assert(CSCU_REQUEST_FIELD < CSCU_REQUEST_LINE, "a `dir` fits in a request line");

#endif

/* CRC-32 (zlib's: ISO-HDLC), the `crc32-64m` digest's per-chunk function (crc32.c). Internal to libcoldsnap_cuda. */
#ifndef CSCU_CRC32_H
#define CSCU_CRC32_H

#include <stddef.h>
#include <stdint.h>

#ifndef CSCU_HIDDEN
#define CSCU_HIDDEN __attribute__((visibility("hidden")))
#endif

/* zlib's crc32(crc, data, size): 0 starts, the previous answer continues. */
CSCU_HIDDEN uint32_t cscu_crc32(uint32_t crc, const void *data, size_t size);
/* "pclmul" (carry-less multiplication folds) or "tables" (slicing-by-8). */
CSCU_HIDDEN const char *cscu_crc32_engine(void);

#endif

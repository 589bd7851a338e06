/* The dump's digest kinds, per 64 MiB chunk (constants.h): `sha256-64m`, SHA-256 over each chunk's SHA-256 (the
 * weights' digest, a content address), and `crc32-64m`, each chunk's CRC-32 (crc32.c: several times faster, for
 * the release's and the hydration's critical path). hydration/_digests.py computes both in Python. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32.h"
#include "digest.h"

int cscu_digest_configured(void)
{
    const char *named = getenv(CSCU_ENV_DIGEST);
    if (!named || !*named)
        return CSCU_KIND_CRC32;
    char prefix[32];
    snprintf(prefix, sizeof(prefix), "%s:", named);
    return cscu_digest_kind_of(prefix);
}

int cscu_digest_kind_of(const char *text)
{
    if (strncmp(text, CSCU_DIGEST_PREFIX, strlen(CSCU_DIGEST_PREFIX)) == 0)
        return CSCU_KIND_SHA256;
    if (strncmp(text, CSCU_CRC_PREFIX, strlen(CSCU_CRC_PREFIX)) == 0)
        return CSCU_KIND_CRC32;
    return -1;
}

const char *cscu_digest_engine(int kind)
{
    return kind == CSCU_KIND_CRC32 ? cscu_crc32_engine() : cscu_sha256_engine();
}

void cscu_chunk_init(struct cscu_chunk_digest *h, int kind)
{
    h->kind = kind;
    h->crc = 0;
    if (kind == CSCU_KIND_SHA256)
        cscu_sha256_init(&h->sha);
}

void cscu_chunk_update(struct cscu_chunk_digest *h, const void *data, size_t size)
{
    if (h->kind == CSCU_KIND_CRC32)
        h->crc = cscu_crc32(h->crc, data, size);
    else
        cscu_sha256_update(&h->sha, data, size);
}

void cscu_chunk_final(struct cscu_chunk_digest *h, unsigned char out[32])
{
    if (h->kind == CSCU_KIND_SHA256) {
        cscu_sha256_final(&h->sha, out);
        return;
    }
    memset(out, 0, 32);
    for (int i = 0; i < 4; i++)
        out[i] = (unsigned char)(h->crc >> (24 - 8 * i));
}

void cscu_digest_text(int kind, const unsigned char (*chunks)[32], size_t n, char out[CSCU_DIGEST_TEXT])
{
    int used;
    if (kind == CSCU_KIND_CRC32) {
        used = snprintf(out, CSCU_DIGEST_TEXT, CSCU_CRC_PREFIX);
        for (size_t c = 0; c < n; c++)
            for (int i = 0; i < 4 && used + 3 <= (int)CSCU_DIGEST_TEXT; i++)
                used += snprintf(out + used, CSCU_DIGEST_TEXT - (size_t)used, "%02x", chunks[c][i]);
        return;
    }
    cscu_sha256 h;
    unsigned char digest[32];
    cscu_sha256_init(&h);
    for (size_t c = 0; c < n; c++)
        cscu_sha256_update(&h, chunks[c], 32);
    cscu_sha256_final(&h, digest);
    used = snprintf(out, CSCU_DIGEST_TEXT, CSCU_DIGEST_PREFIX);
    for (int i = 0; i < 32; i++)
        used += snprintf(out + used, CSCU_DIGEST_TEXT - (size_t)used, "%02x", digest[i]);
}

void cscu_zeros_digest(int kind, size_t n, unsigned char out[32])
{
    static const unsigned char zeros[(size_t)256 << 10];
    static unsigned char whole[2][32];
    static int known[2];
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    int cache = n == CSCU_DIGEST_CHUNK && (kind == CSCU_KIND_SHA256 || kind == CSCU_KIND_CRC32);
    struct cscu_chunk_digest h;
    memset(out, 0, 32);
    if (cache) {  /* the copy threads ask at once: one computes, the others wait for its answer */
        pthread_mutex_lock(&lock);
        if (known[kind]) {
            memcpy(out, whole[kind], 32);
            pthread_mutex_unlock(&lock);
            return;
        }
    }
    cscu_chunk_init(&h, kind);
    for (size_t done = 0; done < n; done += sizeof(zeros))
        cscu_chunk_update(&h, zeros, n - done < sizeof(zeros) ? n - done : sizeof(zeros));
    cscu_chunk_final(&h, out);
    if (cache) {
        memcpy(whole[kind], out, 32);
        known[kind] = 1;
        pthread_mutex_unlock(&lock);
    }
}

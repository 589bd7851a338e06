/* SHA-256 for the dump's digests (FIPS 180-4). libcrypto's (found at run time, SHA extensions where the CPU has
 * them: several GB/s per thread) when it loads, this portable one otherwise. Same digests either way. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cscu.h"

typedef int (*ossl_init_fn)(void *);
typedef int (*ossl_update_fn)(void *, const void *, size_t);
typedef int (*ossl_final_fn)(unsigned char *, void *);

static struct { ossl_init_fn init; ossl_update_fn update; ossl_final_fn final; } ossl;
static pthread_once_t ossl_once = PTHREAD_ONCE_INIT;
#define OSSL_CTX_BYTES 256  /* SHA256_CTX is 112 bytes in OpenSSL 1.1 and 3 */

static void ossl_load(void)
{
    static const char *names[] = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        void *handle = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!handle)
            continue;
        ossl.init = (ossl_init_fn)dlsym(handle, "SHA256_Init");
        ossl.update = (ossl_update_fn)dlsym(handle, "SHA256_Update");
        ossl.final = (ossl_final_fn)dlsym(handle, "SHA256_Final");
        if (ossl.init && ossl.update && ossl.final)
            return;
        memset(&ossl, 0, sizeof(ossl));
        dlclose(handle);
    }
}

const char *cscu_sha256_engine(void)
{
    pthread_once(&ossl_once, ossl_load);
    return ossl.init ? "libcrypto" : "builtin";
}

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void compress(uint32_t h[8], const unsigned char *p)
{
    uint32_t w[64], a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
        uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

void cscu_sha256_init(cscu_sha256 *ctx)
{
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    pthread_once(&ossl_once, ossl_load);
    memcpy(ctx->h, iv, sizeof(iv));
    ctx->length = 0;
    ctx->used = 0;
    ctx->ossl = NULL;
    if (ossl.init && (ctx->ossl = malloc(OSSL_CTX_BYTES)) != NULL && ossl.init(ctx->ossl) != 1) {
        free(ctx->ossl);
        ctx->ossl = NULL;
    }
}

void cscu_sha256_update(cscu_sha256 *ctx, const void *data, size_t size)
{
    const unsigned char *p = data;
    if (ctx->ossl) {
        ossl.update(ctx->ossl, data, size);
        return;
    }
    ctx->length += size;
    if (ctx->used) {
        size_t take = 64 - ctx->used < size ? 64 - ctx->used : size;
        memcpy(ctx->block + ctx->used, p, take);
        ctx->used += take;
        p += take;
        size -= take;
        if (ctx->used < 64)
            return;
        compress(ctx->h, ctx->block);
        ctx->used = 0;
    }
    for (; size >= 64; p += 64, size -= 64)
        compress(ctx->h, p);
    memcpy(ctx->block, p, size);
    ctx->used = size;
}

void cscu_sha256_final(cscu_sha256 *ctx, unsigned char out[32])
{
    if (ctx->ossl) {
        ossl.final(out, ctx->ossl);
        free(ctx->ossl);
        ctx->ossl = NULL;
        return;
    }
    uint64_t bits = ctx->length * 8;
    ctx->block[ctx->used++] = 0x80;
    if (ctx->used > 56) {
        memset(ctx->block + ctx->used, 0, 64 - ctx->used);
        compress(ctx->h, ctx->block);
        ctx->used = 0;
    }
    memset(ctx->block + ctx->used, 0, 56 - ctx->used);
    for (int i = 0; i < 8; i++)
        ctx->block[56 + i] = (unsigned char)(bits >> (56 - 8 * i));
    compress(ctx->h, ctx->block);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(ctx->h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(ctx->h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(ctx->h[i] >> 8);
        out[4 * i + 3] = (unsigned char)ctx->h[i];
    }
}

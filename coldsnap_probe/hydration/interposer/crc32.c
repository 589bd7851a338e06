/* CRC-32 for the dump's fast digest (`crc32-64m`): the ISO-HDLC CRC that zlib's crc32 computes (polynomial
 * 0x04C11DB7, reflected, initial and final value 0xFFFFFFFF), so Python's `zlib.crc32` is its twin byte for byte.
 * Chosen over SHA-256 on the release's critical path (not a content address: it finds corruption, the copy
 * engine's or the disk's, and every 1- and 2-bit error and burst of up to 32 bits at 64 MiB) and over CRC32C or
 * XXH64, which the Python standard library cannot compute at more than a few MB/s.
 *
 * Where the CPU has PCLMULQDQ it folds four 128-bit lanes by carry-less multiplication (Intel's "Fast CRC
 * Computation for Generic Polynomials Using PCLMULQDQ", the constants x^n mod P computed below from the
 * polynomial, not copied); the rest of a buffer and other CPUs go through slicing-by-8 tables. Same answer.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "crc32.h"

#define POLY 0xEDB88320u  /* 0x04C11DB7 reflected */

static uint32_t crc_table[8][256];
/* Fold constants (reflected, shifted by 1): by 2048 bits (x^2080, x^2016), 512 (x^544, x^480), 128 (x^160, x^96). */
static uint64_t crc_fold[6];
static int crc_have_pclmul, crc_have_wide;  /* PCLMULQDQ; VPCLMULQDQ with AVX-512 */
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

/* x^n mod P, bit-reflected (bit 31 is x^0), shifted left by one: what the reflected fold multiplies by. */
static uint64_t crc_xpow(unsigned n)
{
    uint32_t v = 0x80000000u;  /* x^0 */
    for (unsigned i = 0; i < n; i++)
        v = (v >> 1) ^ (v & 1 ? POLY : 0);
    return (uint64_t)v << 1;
}

static void crc_setup(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (c & 1 ? POLY : 0);
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xff];
    crc_fold[0] = crc_xpow(4 * 128 + 32), crc_fold[1] = crc_xpow(4 * 128 - 32);
    crc_fold[2] = crc_xpow(128 + 32), crc_fold[3] = crc_xpow(128 - 32);
    crc_fold[4] = crc_xpow(16 * 128 + 32), crc_fold[5] = crc_xpow(16 * 128 - 32);
#if defined(__x86_64__)
    __builtin_cpu_init();
    crc_have_pclmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    crc_have_wide = crc_have_pclmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
#endif
}

/* The register (not inverted) after `size` bytes, eight at a time through the tables. */
static uint32_t crc_tables(uint32_t c, const unsigned char *p, size_t size)
{
    for (; size >= 8; p += 8, size -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);  /* little-endian: x86-64 and aarch64 */
        w ^= c;
        c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff]
            ^ crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff]
            ^ crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
    }
    for (; size; p++, size--)
        c = (c >> 8) ^ crc_table[0][(c ^ *p) & 0xff];
    return c;
}

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("pclmul,sse4.1"))) static inline __m128i crc_fold_by(__m128i x, __m128i k, __m128i data)
{
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

/* The register after the first `*done` bytes (a multiple of 16, at least 64; the caller does the rest): the
 * register is folded into the first four bytes, 64 bytes folded per step, the four lanes folded into one, whose
 * 16 bytes then go through the tables from a zero register (folding keeps the message's value mod P). */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_folded(uint32_t c, const unsigned char *p, size_t size, size_t *done)
{
    const __m128i *q = (const __m128i *)p;
    __m128i x0 = _mm_xor_si128(_mm_loadu_si128(q), _mm_cvtsi32_si128((int)c)), x1 = _mm_loadu_si128(q + 1);
    __m128i x2 = _mm_loadu_si128(q + 2), x3 = _mm_loadu_si128(q + 3);
    __m128i k4 = _mm_set_epi64x((long long)crc_fold[1], (long long)crc_fold[0]);
    __m128i k1 = _mm_set_epi64x((long long)crc_fold[3], (long long)crc_fold[2]);
    size_t at = 64;
    for (; at + 64 <= size; at += 64) {
        q = (const __m128i *)(p + at);
        x0 = crc_fold_by(x0, k4, _mm_loadu_si128(q));
        x1 = crc_fold_by(x1, k4, _mm_loadu_si128(q + 1));
        x2 = crc_fold_by(x2, k4, _mm_loadu_si128(q + 2));
        x3 = crc_fold_by(x3, k4, _mm_loadu_si128(q + 3));
    }
    x0 = crc_fold_by(crc_fold_by(crc_fold_by(x0, k1, x1), k1, x2), k1, x3);
    for (; at + 16 <= size; at += 16)
        x0 = crc_fold_by(x0, k1, _mm_loadu_si128((const __m128i *)(p + at)));
    unsigned char last[16];
    _mm_storeu_si128((__m128i *)last, x0);
    *done = at;
    return crc_tables(0, last, 16);
}

/* The same with sixteen lanes in four 512-bit registers (256 bytes a step, for the cores that have VPCLMULQDQ):
 * the lanes are stored as 256 bytes whose CRC from a zero register is the register after the first `*done`. */
__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
static uint32_t crc_wide(uint32_t c, const unsigned char *p, size_t size, size_t *done)
{
    long long lo = (long long)crc_fold[4], hi = (long long)crc_fold[5];
    __m512i z[4], k = _mm512_set4_epi64(hi, lo, hi, lo);
    for (int i = 0; i < 4; i++)
        z[i] = _mm512_loadu_si512(p + 64 * i);
    z[0] = _mm512_xor_si512(z[0], _mm512_castsi128_si512(_mm_cvtsi32_si128((int)c)));
    size_t at = 256;
    for (; at + 256 <= size; at += 256)
        for (int i = 0; i < 4; i++)  /* 0x96: a ^ b ^ c */
            z[i] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(z[i], k, 0x00),
                                             _mm512_clmulepi64_epi128(z[i], k, 0x11),
                                             _mm512_loadu_si512(p + at + 64 * i), 0x96);
    unsigned char lanes[256];
    for (int i = 0; i < 4; i++)
        _mm512_storeu_si512(lanes + 64 * i, z[i]);
    size_t all;
    c = crc_folded(0, lanes, sizeof(lanes), &all);
    *done = at;
    return c;
}
#endif

uint32_t cscu_crc32(uint32_t crc, const void *data, size_t size)
{
    const unsigned char *p = data;
    uint32_t c = ~crc;
    pthread_once(&crc_once, crc_setup);
#if defined(__x86_64__)
    if (crc_have_wide && size >= 512) {
        size_t done;
        c = crc_wide(c, p, size, &done);
        p += done, size -= done;
    }
    if (crc_have_pclmul && size >= 64) {
        size_t done;
        c = crc_folded(c, p, size, &done);
        p += done, size -= done;
    }
#endif
    return ~crc_tables(c, p, size);
}

const char *cscu_crc32_engine(void)
{
    pthread_once(&crc_once, crc_setup);
    return crc_have_wide ? "vpclmul" : crc_have_pclmul ? "pclmul" : "tables";
}

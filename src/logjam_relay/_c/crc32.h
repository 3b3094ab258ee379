/* CRC-32 of the spool records (zlib's crc32: the same value as zlib.crc32), the one copy
 * for every C file that writes or checks a record (_c/record_crc.h: spool/_segenc.c, the ingest
 * pass in io/_zmqfast.c, the readers spool/_segscan.c and spool/_tailread.c).
 *
 * On x86-64 with PCLMULQDQ and SSE4.1 (checked once at run time with cpuid) the bulk is
 * folded with carry-less multiplies, 64 bytes a step (the algorithm and constants of
 * Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", bit-reflected
 * for the zlib polynomial, as in Chromium's zlib crc32_simd.c); the tail (under 16
 * bytes) and short buffers go through a byte table, long buffers on other CPUs through
 * zlib's crc32().  On a record of ~360 bytes
 * zlib's table walk was ~8 % of the relay's ingest CPU.  tests/test_segenc.py compares
 * the result with zlib.crc32 for every length up to a few KiB and at every alignment.
 */
#ifndef LOGJAM_RELAY_CRC32_H
#define LOGJAM_RELAY_CRC32_H

#include <stddef.h>
#include <stdint.h>
#include <zlib.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

#define LJ_CRC_SIMD_MIN 64

__attribute__((target("pclmul,sse4.1")))
static uint32_t lj_crc32_fold(const unsigned char *buf, size_t len, uint32_t crc) {
    /* len >= 64 and a multiple of 16; crc is the inverted running value */
    static const uint64_t k1k2[2] __attribute__((aligned(16))) = {0x0154442bd4, 0x01c6e41596};
    static const uint64_t k3k4[2] __attribute__((aligned(16))) = {0x01751997d0, 0x00ccaa009e};
    static const uint64_t k5k0[2] __attribute__((aligned(16))) = {0x0163cd6124, 0x0000000000};
    static const uint64_t poly[2] __attribute__((aligned(16))) = {0x01db710641, 0x01f7011641};
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = _mm_load_si128((const __m128i *)k1k2);
    buf += 64;
    len -= 64;
    while (len >= 64) {            /* four lanes folded in parallel */
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }
    /* the four lanes into one */
    x0 = _mm_load_si128((const __m128i *)k3k4);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 -> 64 bits */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = _mm_loadl_epi64((const __m128i *)k5k0);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    /* Barrett reduction to 32 bits */
    x0 = _mm_load_si128((const __m128i *)poly);
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

static int lj_crc_simd = -1;       /* -1: not checked yet */

static int lj_crc_simd_ok(void) {
    if (lj_crc_simd < 0) {
        unsigned a, b, c, d;
        lj_crc_simd = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_PCLMUL) && (c & bit_SSE4_1);
    }
    return lj_crc_simd;
}
#endif

/* The byte-at-a-time table of the zlib polynomial, for the tails of under 16 bytes left
 * by the folding: a call into zlib's crc32() for each was ~1.5 % of an output worker's
 * CPU (crc32_z in perf, one per record).  Filled once (the same values by any thread). */
#define LJ_CRC_TAIL_MAX 64
static uint32_t lj_crc_table[256];
static int lj_crc_table_ready;

static const uint32_t *lj_crc_tab(void) {
    if (!__atomic_load_n(&lj_crc_table_ready, __ATOMIC_ACQUIRE)) {
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t c = n;
            for (int k = 0; k < 8; k++) c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
            lj_crc_table[n] = c;
        }
        __atomic_store_n(&lj_crc_table_ready, 1, __ATOMIC_RELEASE);
    }
    return lj_crc_table;
}

/* zlib's crc32 of buf[0:len] (starting value 0) */
static uint32_t lj_crc32(const unsigned char *buf, size_t len) {
    uLong c = 0;                    /* crc32(0L, Z_NULL, 0) */
#ifdef LJ_CRC_SIMD_MIN
    if (len >= LJ_CRC_SIMD_MIN && lj_crc_simd_ok()) {
        size_t bulk = len & ~(size_t)15;
        c = ~lj_crc32_fold(buf, bulk, ~(uint32_t)c) & 0xffffffffu;
        buf += bulk;
        len -= bulk;
    }
#endif
    if (len <= LJ_CRC_TAIL_MAX) {
        const uint32_t *t = lj_crc_tab();
        uint32_t x = ~(uint32_t)c;
        while (len--) x = t[(x ^ *buf++) & 0xff] ^ (x >> 8);
        return ~x;
    }
    while (len > 0) {               /* crc32() takes a uInt length */
        uInt step = len > 0x40000000u ? 0x40000000u : (uInt)len;
        c = crc32(c, buf, step);
        buf += step;
        len -= step;
    }
    return (uint32_t)c;
}

#endif

/*
 * The fast zlib path of both readers: libdeflate (loaded with dlopen, when the machine has
 * it) behind a guard that admits only streams on which libdeflate and zlib agree.
 *
 * zlib (java.util.zip.Inflater, Python's zlib.decompress) is what decides whether a body
 * decompresses; libdeflate decodes the same DEFLATE streams in about 3/4 of zlib's time on
 * bodies of a few hundred bytes, but it is more lenient in its block headers than zlib:
 * it takes 287-288 literal/length and 31-32 distance codes (zlib: "too many length or
 * distance symbols"), a code-length repeat that runs past the end (zlib: "invalid bit
 * length repeat"), incomplete codes of one codeword (which zlib decodes only half of), and
 * the static block's symbols 286-287 and 30-31 (zlib: "invalid ... code").  So the guard
 * below reads the zlib header and the first block's header with zlib's own rules
 * (inflate.c, inftrees.c) and admits the stream only when
 *   - the zlib header is one zlib accepts with a 32 KiB window and no preset dictionary,
 *   - the first block is the final block and a dynamic Huffman block,
 *   - at most 286 literal/length and 30 distance codes, repeats within the lengths,
 *   - the three codes (code lengths, literal/length, distance) are complete (neither
 *     over-subscribed nor incomplete) and the end-of-block symbol has a code.
 * What zlib's deflate writes for a body of up to some 16 KiB is exactly that.  On such a
 * stream every symbol either decoder can read is valid for both, both refuse a distance
 * beyond the output and a wrong Adler-32, and both ignore what follows the stream.
 * Anything the guard refuses, and anything libdeflate refuses (truncated, corrupt, output
 * beyond the buffer), is given back to the caller (-1), who asks zlib: zlib's verdict
 * stays the only one.  tests/test_pipeline_jinflate.py compares the two on valid,
 * mutated, truncated and crafted streams.
 *
 *
 * Included by _jinflate.c (the JVM reader, through JNI) and _bodies.c (the Python
 * decoder): everything here is static, each extension has its own copy.
 */
#ifndef LJR_FASTINFLATE_H
#define LJR_FASTINFLATE_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

typedef void *(*fi_alloc_fn)(void);
typedef void (*fi_free_fn)(void *);
typedef int (*fi_zlib_fn)(void *, const void *, size_t, void *, size_t, size_t *, size_t *);

static fi_alloc_fn fi_d_alloc;
static fi_free_fn fi_d_free;
static fi_zlib_fn fi_d_zlib;
static int fi_loaded;                       /* 0 not tried, 1 ready, -1 unavailable */

/* 1 when libdeflate could be loaded (idempotent; the JVM calls it from one thread first,
 * _bodies.c at its module init, with the GIL) */
static int fi_available(void) {
    if (fi_loaded == 0) {
        void *h = dlopen("libdeflate.so.0", RTLD_NOW | RTLD_LOCAL);
        if (h == NULL) h = dlopen("libdeflate.so", RTLD_NOW | RTLD_LOCAL);
        if (h != NULL) {
            fi_d_alloc = (fi_alloc_fn)dlsym(h, "libdeflate_alloc_decompressor");
            fi_d_free = (fi_free_fn)dlsym(h, "libdeflate_free_decompressor");
            fi_d_zlib = (fi_zlib_fn)dlsym(h, "libdeflate_zlib_decompress_ex");
        }
        fi_loaded = (fi_d_alloc && fi_d_free && fi_d_zlib) ? 1 : -1;
    }
    return fi_loaded == 1;
}

static void *fi_open(void) {
    return fi_available() ? fi_d_alloc() : NULL;
}

static void fi_close(void *d) {
    if (d != NULL && fi_loaded == 1) fi_d_free(d);
}

/* zlib's inftrees.c verdict on a code, reduced to "complete": the codeword length
 * counts count[1..15] fill the code space exactly (not over-subscribed, not incomplete) */
static int fi_complete(const unsigned *count) {
    int left = 1;
    for (unsigned len = 1; len <= 15; len++) {
        left <<= 1;
        left -= (int)count[len];
        if (left < 0) return 0;
    }
    return left == 0;
}

static inline uint64_t fi_load64le(const uint8_t *p) {
    uint64_t v;
    __builtin_memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* 1 when zlib and libdeflate agree on the stream in[0, n) (see above), else 0 */
static int fi_guard(const uint8_t *in, size_t n) {
    static const uint8_t order[19] = {16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13,
                                      2, 14, 1, 15};
    if (n < 2 + 3 + 4) return 0;
    unsigned cmf = in[0], flg = in[1];
    if (((cmf << 8) | flg) % 31 != 0) return 0;        /* incorrect header check */
    if ((cmf & 15) != 8) return 0;                     /* unknown compression method */
    if ((cmf >> 4) > 7) return 0;                      /* invalid window size */
    if (flg & 0x20) return 0;                          /* preset dictionary */
    const uint8_t *p = in + 2, *end = in + n;
    uint64_t bits = 0;
    unsigned have = 0;
    /* at least k (<= 56) bits in `bits`: 8 bytes at a time while 8 are left, else one */
#define NEED(k) do { if (have < (k)) { \
        if (end - p >= 8) { bits |= fi_load64le(p) << have; p += (63 - have) >> 3; \
                            have |= 56; } \
        else { while (have < (k)) { if (p == end) return 0; \
                                    bits |= (uint64_t)*p++ << have; have += 8; } } \
    } } while (0)
#define DROP(k) do { bits >>= (k); have -= (k); } while (0)
    NEED(17);
    unsigned head = (unsigned)bits;
    DROP(17);
    /* BFINAL 1 and BTYPE 2 (dynamic); HLIT <= 29, HDIST <= 29 (zlib: at most 286 and 30) */
    if ((head & 7) != 5) return 0;
    unsigned nlen = ((head >> 3) & 31) + 257, ndist = ((head >> 8) & 31) + 1;
    unsigned ncode = ((head >> 13) & 15) + 4;
    if (nlen > 286 || ndist > 30) return 0;
    uint8_t pre[19] = {0};
    unsigned pc[16] = {0};
    for (unsigned i = 0; i < ncode; i++) {
        NEED(3);
        unsigned v = (unsigned)bits & 7;
        DROP(3);
        pre[order[i]] = (uint8_t)v;
        pc[v]++;
    }
    pc[0] = 0;
    if (!fi_complete(pc)) return 0;
    /* the code-length code as a 7-bit lookup table (canonical codes, read LSB first):
     * entry = symbol << 3 | length */
    uint8_t table[128];
    {
        unsigned next[8], code = 0;
        for (unsigned len = 1; len <= 7; len++) {
            code = (code + pc[len - 1]) << 1;
            next[len] = code;
        }
        for (unsigned s = 0; s < 19; s++) {
            unsigned len = pre[s];
            if (len == 0) continue;
            unsigned c = next[len]++;
            unsigned r = 0;
            for (unsigned b = 0; b < len; b++) r = (r << 1) | ((c >> b) & 1);
            uint8_t e = (uint8_t)(s << 3 | len);
            for (unsigned k = r; k < 128; k += 1u << len) table[k] = e;
        }
    }
    /* the code lengths; each code's Kraft sum (2^(15 - length) per codeword) as they are
     * read: a code is complete (zlib's inftrees.c: neither over-subscribed nor incomplete)
     * when its sum is exactly 2^15.  A repeat may cross from the literal/length lengths
     * into the distance lengths, as zlib allows. */
    static const uint32_t kraft[16] = {0, 1u << 14, 1u << 13, 1u << 12, 1u << 11, 1u << 10,
                                       1u << 9, 1u << 8, 1u << 7, 1u << 6, 1u << 5, 1u << 4,
                                       1u << 3, 1u << 2, 1u << 1, 1u};
    uint8_t lens[286 + 30 + 138];
    uint32_t sum[2] = {0, 0};
    unsigned total = nlen + ndist, i = 0;
    while (i < total) {
        NEED(14);             /* the longest code-length codeword plus the longest repeat */
        unsigned e = table[bits & 127], sym = e >> 3;
        DROP(e & 7);
        if (sym < 16) {
            lens[i] = (uint8_t)sym;
            sum[i >= nlen] += kraft[sym];
            i++;
            continue;
        }
        unsigned copy, val = 0;
        if (sym == 16) {
            if (i == 0) return 0;                      /* invalid bit length repeat */
            val = lens[i - 1];
            copy = 3 + (unsigned)(bits & 3); DROP(2);
        } else if (sym == 17) {
            copy = 3 + (unsigned)(bits & 7); DROP(3);
        } else {
            copy = 11 + (unsigned)(bits & 127); DROP(7);
        }
        if (i + copy > total) return 0;                /* invalid bit length repeat */
        __builtin_memset(lens + i, (int)val, copy);
        if (val) {
            unsigned inl = i < nlen ? (i + copy <= nlen ? copy : nlen - i) : 0;
            sum[0] += inl * kraft[val];
            sum[1] += (copy - inl) * kraft[val];
        }
        i += copy;
    }
#undef NEED
#undef DROP
    if (lens[256] == 0) return 0;                      /* missing end-of-block */
    return sum[0] == 1u << 15 && sum[1] == 1u << 15;
}

/* in[0, n) inflated into out[0, cap): its length, or -1 (refused by the guard, by
 * libdeflate, or longer than cap): ask zlib */
static int32_t fi_inflate(void *d, const uint8_t *in, int32_t n, uint8_t *out, int32_t cap) {
    if (d == NULL || n <= 0 || cap <= 0 || !fi_guard(in, (size_t)n)) return -1;
    size_t used = 0, got = 0;
    if (fi_d_zlib(d, in, (size_t)n, out, (size_t)cap, &used, &got) != 0) return -1;
    return (int32_t)got;
}

#endif

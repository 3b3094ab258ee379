/* The Courier mapping's JSON check (RFC 8259, as Python's json with NaN/Infinity
 * rejected), for _courierenc.c: json_valid(s, n) -> 1 valid, 0 invalid, -1 unsure (too
 * deep: Python decides).  UTF-8 and string runs are scanned 16 bytes at a time with SSE2
 * (the x86-64 baseline), else 8 (SWAR).  Header-only: included by _courierenc.c alone. */
#ifndef LOGJAM_RELAY_JSONVALID_H
#define LOGJAM_RELAY_JSONVALID_H

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>           /* x86-64 baseline: the JSON scans 16 bytes at a time */
#define HAVE_SSE2_SCAN 1
#endif

#undef isdigit
#undef isxdigit
#define isdigit(c) ((c) >= '0' && (c) <= '9')
#define isxdigit(c) (isdigit(c) || ((c) >= 'a' && (c) <= 'f') || ((c) >= 'A' && (c) <= 'F'))

#define MAX_DEPTH 500      /* deeper documents are left to Python (it decides by its recursion limit) */

typedef struct { const unsigned char *p, *end; int depth; int unsure; } js_t;

static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
#ifdef HAVE_SSE2_SCAN
        while (n - i >= 16 &&          /* ASCII runs, 16 bytes at a time */
               !_mm_movemask_epi8(_mm_loadu_si128((const __m128i *)(s + i))))
            i += 16;
        if (i >= n) break;
#endif
        if (n - i >= 8) {               /* ASCII runs, 8 bytes at a time */
            uint64_t v;
            memcpy(&v, s + i, 8);
            if (!(v & 0x8080808080808080ULL)) { i += 8; continue; }
        }
        unsigned char c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t need;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lo = 0xA0; }
        else if (c >= 0xE1 && c <= 0xEC) need = 2;
        else if (c == 0xED) { need = 2; hi = 0x9F; }
        else if (c >= 0xEE && c <= 0xEF) need = 2;
        else if (c == 0xF0) { need = 3; lo = 0x90; }
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else if (c == 0xF4) { need = 3; hi = 0x8F; }
        else return 0;
        if (n - i <= need) return 0;
        if (s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (size_t k = 2; k <= need; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) return 0;
        i += need + 1;
    }
    return 1;
}

static inline void ws(js_t *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int value(js_t *j);

/* 8 bytes at a time (SWAR): whether any byte of v is '"', '\\' or a control character
 * (< 0x20); bytes >= 0x80 are left to utf8_valid, which has already passed */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
static inline int special8(uint64_t v) {
    uint64_t q = v ^ (ONES * '"'), b = v ^ (ONES * '\\');
    return (((q - ONES) & ~q) | ((b - ONES) & ~b) | ((v - ONES * 0x20) & ~v)) & HIGHS ? 1 : 0;
}

static int string(js_t *j) {          /* at '"' */
    j->p++;
    while (j->p < j->end) {
#ifdef HAVE_SSE2_SCAN
        /* plain runs, 16 bytes at a time, up to the first '"', '\\' or control byte
         * (string() was ~10 % of a Courier worker's CPU with 8-byte steps alone) */
        const __m128i dq = _mm_set1_epi8('"'), bs = _mm_set1_epi8('\\'), c1f = _mm_set1_epi8(0x1f);
        while (j->end - j->p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)j->p);
            __m128i hit = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(v, dq), _mm_cmpeq_epi8(v, bs)),
                                       _mm_cmpeq_epi8(_mm_max_epu8(v, c1f), c1f));
            int m = _mm_movemask_epi8(hit);
            if (m) { j->p += __builtin_ctz((unsigned)m); break; }
            j->p += 16;
        }
#endif
        while (j->end - j->p >= 8) {   /* skip plain runs */
            uint64_t v;
            memcpy(&v, j->p, 8);
            if (special8(v)) break;
            j->p += 8;
        }
        if (j->p >= j->end) break;
        unsigned char c = *j->p++;
        if (c == '"') return 1;
        if (c < 0x20) return 0;
        if (c == '\\') {
            if (j->p >= j->end) return 0;
            c = *j->p++;
            if (c == 'u') {
                for (int k = 0; k < 4; k++, j->p++)
                    if (j->p >= j->end || !isxdigit(*j->p)) return 0;
            } else if (!strchr("\"\\/bfnrt", c) || c == 0) {
                return 0;
            }
        }
    }
    return 0;
}

static int number(js_t *j) {
    if (j->p < j->end && *j->p == '-') j->p++;
    if (j->p >= j->end) return 0;
    if (*j->p == '0') j->p++;
    else if (*j->p >= '1' && *j->p <= '9') { while (j->p < j->end && isdigit(*j->p)) j->p++; }
    else return 0;
    if (j->p < j->end && *j->p == '.') {
        j->p++;
        if (j->p >= j->end || !isdigit(*j->p)) return 0;
        while (j->p < j->end && isdigit(*j->p)) j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        const unsigned char *save = j->p;
        j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-')) j->p++;
        if (j->p >= j->end || !isdigit(*j->p)) { j->p = save; return 1; }  /* "1e" = 1 then junk */
        while (j->p < j->end && isdigit(*j->p)) j->p++;
    }
    return 1;
}

static int literal(js_t *j, const char *w) {
    size_t n = strlen(w);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, w, n) != 0) return 0;
    j->p += n;
    return 1;
}

static int value(js_t *j) {
    if (j->p >= j->end) return 0;
    unsigned char c = *j->p;
    if (c == '{' || c == '[') {
        if (++j->depth > MAX_DEPTH) { j->unsure = 1; return 0; }
        unsigned char close = c == '{' ? '}' : ']';
        j->p++;
        ws(j);
        if (j->p < j->end && *j->p == close) { j->p++; j->depth--; return 1; }
        for (;;) {
            if (c == '{') {
                if (j->p >= j->end || *j->p != '"' || !string(j)) return 0;
                ws(j);
                if (j->p >= j->end || *j->p != ':') return 0;
                j->p++;
                ws(j);
            }
            if (!value(j)) return 0;
            ws(j);
            if (j->p >= j->end) return 0;
            if (*j->p == close) { j->p++; j->depth--; return 1; }
            if (*j->p != ',') return 0;
            j->p++;
            ws(j);
        }
    }
    if (c == '"') return string(j);
    if (c == '-' || isdigit(c)) return number(j);
    return literal(j, "true") || literal(j, "false") || literal(j, "null");
}

/* 1 valid, 0 invalid, -1 unsure (too deep: let Python decide) */
static int json_valid(const unsigned char *s, size_t n) {
    if (!utf8_valid(s, n)) return 0;
    js_t j = {s, s + n, 0, 0};
    ws(&j);
    int ok = value(&j);
    if (j.unsure) return -1;
    if (!ok) return 0;
    ws(&j);
    return j.p == j.end;
}

#endif

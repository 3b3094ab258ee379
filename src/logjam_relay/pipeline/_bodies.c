/* The bodies of one batch of logjam records, decompressed and UTF-8 checked in C straight
 * into the buffers of an Arrow string column (the C twin of the Python loop in
 * logjam_relay.pipeline.decode; tests/test_pipeline_bodies.py compares them).
 *
 * bodies(buf, rows, first, count, limit) -> (offsets, data, status)
 *   buf     the whole segment file; rows = spool._segscan.scan's int64[n][5] rows
 *           (pair, code, meta_off, body_off, body_len); rows first .. first+count-1
 *   limit   the most a body may inflate to (MAX_DECOMPRESSED)
 *   offsets int32[count+1] into data (empty for rows that are not ok)
 *   status  uint8[count]: 0 ok, 1 bad meta frame, 2 not 4 frames, 3 does not decompress,
 *           4 not UTF-8, 5 undecided here (the caller decompresses it in Python)
 * Compression codes: 0 none, 1 zlib (zlib.h), 2 snappy raw block, 3 lz4 block with a
 * 4-byte big-endian length (decoders below, bounds-checked on every read and write).
 * A body never gets more memory than its declared size (snappy, lz4: after a check that
 * the input can produce that much at all) or the limit (zlib, growing as it inflates).
 * Decisions follow the Python libraries: zlib.decompress (trailing bytes after the stream
 * are ignored; libdeflate inflates the streams on which it and zlib agree, the rest goes to
 * zlib: _fastinflate.h, shared with the JVM reader's _jinflate.c), cramjam/snap's raw decoder, LZ4_decompress_safe plus the exact-length
 * check.  Where LZ4's end-of-block rules or snap's varint reading could decide otherwise
 * than the plain format (blocks no compressor writes), the row is left undecided (5).
 * ValueError when a batch holds more than 2 GiB of text (as the Python path).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <strings.h>
#include <zlib.h>

#include "_fastinflate.h"

enum { S_OK = 0, S_META = 1, S_FRAMES = 2, S_DECOMP = 3, S_UTF8 = 4, S_PY = 5 };

typedef struct { unsigned char *p; size_t len, cap; } out_t;

static int reserve(out_t *o, size_t extra) {
    if (o->len + extra <= o->cap) return 0;
    size_t nc = o->cap ? o->cap : 1 << 20;
    while (nc < o->len + extra) nc *= 2;
    unsigned char *np_ = PyMem_RawRealloc(o->p, nc);
    if (!np_) return -1;
    o->p = np_;
    o->cap = nc;
    return 0;
}

/* ------------------------------------------------------------------ UTF-8 (strict) */

static int utf8_ok(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ULL)) { i += 8; continue; }
        }
        unsigned char c = s[i];
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n) return 0;
            unsigned char c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && c1 < 0xA0) return 0;          /* overlong */
            if (c == 0xED && c1 > 0x9F) return 0;          /* surrogates */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n) return 0;
            unsigned char c1 = s[i + 1];
            if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && c1 < 0x90) return 0;          /* overlong */
            if (c == 0xF4 && c1 > 0x8F) return 0;          /* > U+10FFFF */
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

/* ------------------------------------------------------------------ zlib */

#define FAST_CAP 65536u
static int use_fast;                    /* libdeflate found at import, not turned off */
static unsigned long long fast_answered; /* bodies the fast path inflated (tests) */

/* inflate src into o (within limit) with the batch's stream *zp (initialised on first
 * use, reset for every body); S_OK or S_DECOMP, -1 out of memory */
static int do_zlib(const unsigned char *src, size_t n, size_t limit, out_t *o, z_stream *zp,
                   int *zinit, void *fast) {
    /* the fast path (_fastinflate.h): at most 64 KiB in and out, an answer only where zlib
     * would give the same; otherwise (-1) zlib below decides */
    if (fast != NULL && n > 0 && n <= FAST_CAP) {
        size_t cap = limit < FAST_CAP ? limit : FAST_CAP;
        if (reserve(o, cap) < 0) return -1;
        int32_t got = fi_inflate(fast, src, (int32_t)n, o->p + o->len, (int32_t)cap);
        if (got >= 0) {
            o->len += (size_t)got;
            __atomic_fetch_add(&fast_answered, 1, __ATOMIC_RELAXED);
            return S_OK;
        }
    }
    if (!*zinit) {
        memset(zp, 0, sizeof *zp);
        if (inflateInit(zp) != Z_OK) return -1;
        *zinit = 1;
    } else if (inflateReset(zp) != Z_OK) {
        return -1;
    }
    size_t start = o->len, want = n * 4 + 256;
    if (want > limit) want = limit;
    int st = S_DECOMP;
    zp->next_in = (unsigned char *)src;
    for (;;) {
        size_t have = o->len - start;
        if (reserve(o, want - have) < 0) { st = -1; break; }
        /* n may exceed uInt: feed it in pieces */
        size_t in_left = n - (size_t)(zp->next_in - src);
        zp->avail_in = in_left > 0x40000000u ? 0x40000000u : (uInt)in_left;
        size_t room = want - have;
        zp->next_out = o->p + o->len;
        zp->avail_out = room > 0x40000000u ? 0x40000000u : (uInt)room;
        int r = inflate(zp, Z_NO_FLUSH);
        o->len = (size_t)(zp->next_out - o->p);
        if (r == Z_STREAM_END) { st = S_OK; break; }
        if (r != Z_OK && r != Z_BUF_ERROR) break;            /* data or memory error */
        if (o->len - start == want) {                        /* output full: grow */
            if (want >= limit) break;                        /* over the limit */
            want = want * 2 > limit ? limit : want * 2;
            continue;
        }
        if (zp->avail_out == 0) continue;                    /* a 1 GiB piece is full */
        if ((size_t)(zp->next_in - src) >= n) break;           /* input exhausted: truncated */
    }
    if (st != S_OK) o->len = start;
    return st;
}

/* ------------------------------------------------------------------ snappy (raw) */

/* the snap crate's raw Decoder::decompress_vec; S_PY for varints snap reads but the
 * canonical form does not have (more than 5 bytes) */
static int do_snappy(const unsigned char *src, size_t n, size_t limit, out_t *o) {
    if (n == 0) return S_DECOMP;
    uint64_t len = 0;
    size_t h = 0;
    unsigned shift = 0;
    for (;;) {
        if (h >= n || shift > 63) return S_DECOMP;
        unsigned char b = src[h++];
        len |= (uint64_t)(b & 0x7F) << shift;
        if (b < 0x80) break;
        shift += 7;
    }
    if (h > 5) return S_PY;
    if (len > limit) return S_DECOMP;
    /* at most 64 bytes out of every 3 in (copy with a 2-byte offset) */
    if (len > (uint64_t)(n - h) * 22 + 64) return S_DECOMP;
    if (reserve(o, (size_t)len) < 0) return -1;
    unsigned char *dst = o->p + o->len;
    size_t d = 0, s = h, dlen = (size_t)len;
    while (s < n) {
        unsigned char tag = src[s++];
        if ((tag & 3) == 0) {                                /* literal */
            size_t l = (size_t)(tag >> 2) + 1;
            if (l >= 61) {
                size_t k = l - 60;
                if (s + 4 > n) return S_DECOMP;              /* snap wants 4 readable bytes */
                uint32_t v = (uint32_t)src[s] | ((uint32_t)src[s + 1] << 8) |
                             ((uint32_t)src[s + 2] << 16) | ((uint32_t)src[s + 3] << 24);
                if (k < 4) v &= (1u << (8 * k)) - 1;
                l = (size_t)v + 1;
                s += k;
            }
            if (n - s < l || dlen - d < l) return S_DECOMP;
            memcpy(dst + d, src + s, l);
            s += l;
            d += l;
            continue;
        }
        size_t l, off;
        if ((tag & 3) == 1) {
            if (s >= n) return S_DECOMP;
            l = 4 + ((tag >> 2) & 7);
            off = ((size_t)(tag >> 5) << 8) | src[s];
            s += 1;
        } else if ((tag & 3) == 2) {
            if (s + 2 > n) return S_DECOMP;
            l = (size_t)(tag >> 2) + 1;
            off = (size_t)src[s] | ((size_t)src[s + 1] << 8);
            s += 2;
        } else {
            if (s + 4 > n) return S_DECOMP;
            l = (size_t)(tag >> 2) + 1;
            off = (size_t)src[s] | ((size_t)src[s + 1] << 8) | ((size_t)src[s + 2] << 16) |
                  ((size_t)src[s + 3] << 24);
            s += 4;
        }
        if (off == 0 || off > d) return S_DECOMP;
        if (dlen - d < l) return S_DECOMP;
        if (off >= l) {
            memcpy(dst + d, dst + d - off, l);
            d += l;
        } else {
            for (size_t i = 0; i < l; i++, d++) dst[d] = dst[d - off];
        }
    }
    if (d != dlen) return S_DECOMP;
    o->len += dlen;
    return S_OK;
}

/* ------------------------------------------------------------------ lz4 (block) */

/* LZ4_decompress_safe(src, dst, n, m) == m, decoded structurally; blocks that break the
 * end-of-block rules (last 5 bytes literals, last match 12 bytes before the end, input
 * margins) or use offset 0 are left to the library (S_PY): it accepts some of them */
static int do_lz4(const unsigned char *src, size_t n, size_t limit, out_t *o) {
    if (n < 4) return S_DECOMP;
    size_t m = ((size_t)src[0] << 24) | ((size_t)src[1] << 16) | ((size_t)src[2] << 8) | src[3];
    if (m > limit) return S_DECOMP;
    src += 4;
    n -= 4;
    if (m == 0) return (n == 1 && src[0] == 0) ? S_OK : S_DECOMP;
    if (n == 0) return S_DECOMP;
    if (m > n * 255 + 16) return S_DECOMP;                 /* cannot produce that much */
    if (reserve(o, m) < 0) return -1;
    unsigned char *dst = o->p + o->len;
    size_t ip = 0, op = 0;
    int strict = 1;                                          /* within the library's rules */
    for (;;) {
        if (ip >= n) return S_DECOMP;
        unsigned token = src[ip++];
        size_t l = token >> 4;
        if (l == 15) {
            unsigned char b;
            do {
                if (ip >= n) return S_DECOMP;
                b = src[ip++];
                l += b;
            } while (b == 255);
        }
        if (l > n - ip || l > m - op) return S_DECOMP;
        memcpy(dst + op, src + ip, l);
        ip += l;
        op += l;
        if (ip == n) break;                                  /* the last sequence */
        if (op > m - (m < 12 ? m : 12) || ip > n - (n < 8 ? n : 8) || m < 12 || n < 8)
            strict = 0;                                      /* must have been the last */
        if (n - ip < 2) return S_DECOMP;
        size_t off = (size_t)src[ip] | ((size_t)src[ip + 1] << 8);
        ip += 2;
        size_t ml = token & 15;
        if (ml == 15) {
            unsigned char b;
            do {
                if (ip >= n) return S_DECOMP;
                b = src[ip++];
                ml += b;
            } while (b == 255);
            if (ip + 4 > n) strict = 0;
        }
        ml += 4;
        if (off > op) return S_DECOMP;
        if (ml > m - op) return S_DECOMP;
        if (op + ml > m - (m < 5 ? m : 5) || m < 5) strict = 0;
        if (off == 0) {
            strict = 0;
            memset(dst + op, 0, ml);
            op += ml;
        } else if (off >= ml) {
            memcpy(dst + op, dst + op - off, ml);
            op += ml;
        } else {
            for (size_t i = 0; i < ml; i++, op++) dst[op] = dst[op - off];
        }
        if (ip >= n) return S_DECOMP;                        /* a match cannot end a block */
    }
    if (op != m) return S_DECOMP;
    if (!strict) return S_PY;
    o->len += m;
    return S_OK;
}

/* ------------------------------------------------------------------ the batch */

static PyObject *bodies(PyObject *self, PyObject *args) {
    Py_buffer vb, vr;
    Py_ssize_t first, count;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "y*y*nnK", &vb, &vr, &first, &count, &limit)) return NULL;
    PyObject *result = NULL, *o_offs = NULL, *o_status = NULL;
    out_t o = {0};
    const unsigned char *buf = vb.buf;
    const Py_ssize_t size = vb.len;
    const int64_t *rows = vr.buf;
    Py_ssize_t nrows = vr.len / (Py_ssize_t)(5 * sizeof(int64_t));
    if (first < 0 || count < 0 || first > nrows || count > nrows - first) {
        PyErr_SetString(PyExc_ValueError, "row range out of bounds");
        goto out;
    }
    o_offs = PyBytes_FromStringAndSize(NULL, (count + 1) * 4);
    o_status = PyBytes_FromStringAndSize(NULL, count);
    if (!o_offs || !o_status) goto out;
    int32_t *offs = (int32_t *)PyBytes_AS_STRING(o_offs);
    uint8_t *status = (uint8_t *)PyBytes_AS_STRING(o_status);
    int err = 0;                                             /* 1 no memory, 2 too large */
    z_stream zs;
    int zinit = 0;
    void *fast = use_fast ? fi_open() : NULL;              /* NULL: zlib alone */
    Py_BEGIN_ALLOW_THREADS
    offs[0] = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const int64_t *row = rows + 5 * (first + i);
        int64_t code = row[1], r = row[3], lb = row[4];
        size_t mark = o.len;
        int st;
        if (code == -1) st = S_META;
        else if (code < 0) st = S_FRAMES;
        else if (r < 0 || lb < 0 || r > size || lb > size - r) st = S_DECOMP;
        else if (code == 0) {
            if (reserve(&o, (size_t)lb) < 0) st = -1;
            else {
                memcpy(o.p + o.len, buf + r, (size_t)lb);
                o.len += (size_t)lb;
                st = S_OK;
            }
        }
        else if (code == 1) st = do_zlib(buf + r, (size_t)lb, (size_t)limit, &o, &zs, &zinit, fast);
        else if (code == 2) st = do_snappy(buf + r, (size_t)lb, (size_t)limit, &o);
        else if (code == 3) st = do_lz4(buf + r, (size_t)lb, (size_t)limit, &o);
        else st = S_DECOMP;
        if (st < 0) { err = 1; break; }
        if (st == S_OK && !utf8_ok(o.p + mark, o.len - mark)) st = S_UTF8;
        if (st != S_OK) o.len = mark;
        if (o.len > INT32_MAX - 1) { err = 2; break; }
        status[i] = (uint8_t)st;
        offs[i + 1] = (int32_t)o.len;
    }
    if (zinit) inflateEnd(&zs);
    Py_END_ALLOW_THREADS
    fi_close(fast);
    if (err == 1) { PyErr_NoMemory(); goto out; }
    if (err == 2) { PyErr_SetString(PyExc_ValueError, "batch too large for a string column"); goto out; }
    PyObject *data = PyBytes_FromStringAndSize(o.p ? (const char *)o.p : "", (Py_ssize_t)o.len);
    if (!data) goto out;
    result = Py_BuildValue("(OOO)", o_offs, data, o_status);
    Py_DECREF(data);
out:
    Py_XDECREF(o_offs);
    Py_XDECREF(o_status);
    PyMem_RawFree(o.p);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&vr);
    return result;
}

/* fast_zlib(on=None) -> (whether zlib bodies go through libdeflate where it and zlib agree
 * (libdeflate was found at import), how many bodies it has inflated in this process);
 * on=False/True turns it off/on (tests, benchmarks) */
static PyObject *fast_zlib(PyObject *self, PyObject *args) {
    PyObject *on = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &on)) return NULL;
    if (on != Py_None) {
        int v = PyObject_IsTrue(on);
        if (v < 0) return NULL;
        use_fast = v && fi_available();
    }
    return Py_BuildValue("(OK)", use_fast ? Py_True : Py_False,
                         __atomic_load_n(&fast_answered, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"bodies", bodies, METH_VARARGS,
     "bodies(buf, rows, first, count, limit) -> (offsets, data, status)"},
    {"fast_zlib", fast_zlib, METH_VARARGS,
     "fast_zlib(on=None) -> (libdeflate in use where zlib agrees, bodies it inflated)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bodies", "Batch body decompression and UTF-8 check, in C.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__bodies(void) {
    /* dlopen once, here, with the GIL; LOGJAM_RELAY_NATIVE_INFLATE=0 keeps zlib alone (as
     * the JVM's -Dlogjamrelay.nativeInflate=false) */
    const char *env = getenv("LOGJAM_RELAY_NATIVE_INFLATE");
    int off = env != NULL && (strcmp(env, "0") == 0 || strcasecmp(env, "false") == 0
                              || strcasecmp(env, "no") == 0 || strcasecmp(env, "off") == 0);
    use_fast = !off && fi_available();
    return PyModule_Create(&module);
}

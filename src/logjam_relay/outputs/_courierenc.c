/* The Courier output's event mapping in C, for the common case.
 *
 * event(frames, prefix, decompress) -> bytes | None
 *
 * For a logjam message with an acceptable meta frame (24 bytes, tag CABD or BDCA,
 * version 1), a body that is plain or that ``decompress(body, comp)`` decodes, valid
 * UTF-8 and valid JSON (RFC 8259, as Python's json with NaN/Infinity rejected), and a
 * creation time up to year 9999, it returns exactly what courier.record_to_event_py
 * returns.  In every other case it returns None and the caller uses the Python mapping,
 * which tags the event; so both paths give the same bytes for every record.
 * ``prefix`` is the cached ``,"app":..,"env":..,"topic":..,"host":..,`` part.
 *
 * events(records, kind_logjam, prefix, decompress, limit[, heartbeats])
 *     -> (events, clean, total, longest)
 *
 * event() for a whole payload's records in one call (heartbeats are not events unless
 * ``heartbeats`` is true: then they are mapped like any message) (see events() below): what the
 * Courier output's mapping loop did per record in Python (kind and heartbeat checks, the
 * body limit, the prefix lookup, the call) is done here; whatever it does not map is
 * marked for the Python mapping, so the bytes are the same either way.  ``records`` may
 * be a RecordBlock (spool/_recblock.h: an output worker's reads): read from its buffer.
 *
 * adler32(data[, value]) -> int
 *
 * zlib's Adler-32 (``zlib.adler32``, the reference), with SSSE3 where the CPU has it: a
 * zlib stream ends with the Adler-32 of what was compressed, and zlib's own (scalar) one
 * was ~7 % of a Courier worker's CPU (perf); ``protocols.courier.zlib_compress`` deflates
 * raw and appends this one instead, byte for byte what ``zlib.compress`` gives.
 *
 * frame_events(events) -> bytes | None
 *
 * The uncompressed Courier payload body, ``[u32 big-endian length][json]`` back to back
 * (``protocols.courier.encode_events_py``, the reference): one allocation, no per-event
 * objects.  None when an item is not ``bytes`` or longer than 2**32-1 (the Python twin
 * then decides: it accepts other buffers, and raises for a length it cannot pack).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_SSSE3_ADLER 1
#endif

#include "../_c/meta.h"            /* the meta frame's check and fields */
#include "../spool/_recblock.h"    /* RecordBlock: a worker's spool reads as one buffer */
#include "_decimal.h"            /* u64dec() */

static PyTypeObject *block_type;    /* NULL without spool/_tailread: no blocks then */

#include "_jsonvalid.h"         /* json_valid(): the JSON check */

typedef struct { int64_t secs; char text[24]; } tscache_t;   /* text: 19 chars + NUL;
                                                               secs -1: empty */

/* the event of one record: its meta frame ``m`` (``mlen`` bytes) and body (``body``,
 * ``blen`` bytes; ``body_obj`` the same bytes as an object, or NULL: made here if
 * ``decompress`` needs one): a new reference to the event bytes, Py_None (new
 * reference) when Python must map it, or NULL with an exception set */
static PyObject *event_core(const unsigned char *m, Py_ssize_t mlen, const unsigned char *body,
                            Py_ssize_t body_len, PyObject *body_obj, PyObject *prefix,
                            PyObject *decompress, tscache_t *tc) {
    if (!lj_meta_plain(m, (size_t)mlen)) Py_RETURN_NONE;
    uint64_t created = lj_meta_created(m);
    if (created / 1000 > 253402300799ULL) Py_RETURN_NONE;       /* past year 9999 */
    PyObject *raw = NULL;           /* the inflated body (new reference), if compressed */
    const unsigned char *b = body;
    size_t blen = (size_t)body_len;
    if (m[2] != 0) {
        if (body_obj) {
            raw = PyObject_CallFunction(decompress, "Oi", body_obj, (int)m[2]);
        } else {
            PyObject *bo = PyBytes_FromStringAndSize((const char *)body, body_len);
            if (!bo) return NULL;
            raw = PyObject_CallFunction(decompress, "Oi", bo, (int)m[2]);
            Py_DECREF(bo);
        }
        if (!raw) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (!PyBytes_Check(raw)) { Py_XDECREF(raw); Py_RETURN_NONE; }
        b = (const unsigned char *)PyBytes_AS_STRING(raw);
        blen = (size_t)PyBytes_GET_SIZE(raw);
    }
    if (json_valid(b, blen) != 1) { Py_XDECREF(raw); Py_RETURN_NONE; }
    int64_t secs = (int64_t)(created / 1000);
    if (tc->secs != secs) {
        time_t t = (time_t)secs;
        struct tm tm;
        if (!gmtime_r(&t, &tm)) { Py_XDECREF(raw); Py_RETURN_NONE; }
        snprintf(tc->text, sizeof tc->text, "%04d-%02d-%02dT%02d:%02d:%02d",
                 tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
        tc->secs = secs;
    }
    /* {"@timestamp":"<text>.mmmZ" and "logjam":{"device":D,"sequence":S,"created_ms":C},"payload":
     * without snprintf (it was ~8 % of a Courier worker's CPU) */
    char head[64];
    int hl = 0;
    memcpy(head, "{\"@timestamp\":\"", 15); hl = 15;
    size_t tlen = strnlen(tc->text, 23);
    memcpy(head + hl, tc->text, tlen); hl += (int)tlen;
    unsigned ms = (unsigned)(created % 1000);
    head[hl++] = '.';
    head[hl++] = (char)('0' + ms / 100); head[hl++] = (char)('0' + ms / 10 % 10);
    head[hl++] = (char)('0' + ms % 10);
    head[hl++] = 'Z'; head[hl++] = '"';
    char tail[160];
    int tl = 0;
#define PUTS(lit) (memcpy(tail + tl, lit, sizeof(lit) - 1), tl += (int)sizeof(lit) - 1)
    PUTS("\"logjam\":{\"device\":");
    tl += u64dec(tail + tl, lj_meta_device(m));
    PUTS(",\"sequence\":");
    tl += u64dec(tail + tl, lj_meta_sequence(m));
    PUTS(",\"created_ms\":");
    tl += u64dec(tail + tl, created);
    PUTS("},\"payload\":");
#undef PUTS
    Py_ssize_t plen = PyBytes_GET_SIZE(prefix);
    PyObject *out = PyBytes_FromStringAndSize(NULL, hl + plen + tl + (Py_ssize_t)blen + 1);
    if (!out) { Py_XDECREF(raw); return NULL; }
    char *o = PyBytes_AS_STRING(out);
    memcpy(o, head, (size_t)hl); o += hl;
    memcpy(o, PyBytes_AS_STRING(prefix), (size_t)plen); o += plen;
    memcpy(o, tail, (size_t)tl); o += tl;
    memcpy(o, b, blen); o += blen;
    *o = '}';
    Py_XDECREF(raw);
    return out;
}

static PyObject *event_one(PyObject **fr, PyObject *prefix, PyObject *decompress, tscache_t *tc) {
    if (!PyBytes_CheckExact(fr[2]) || !PyBytes_CheckExact(fr[3]) || PyBytes_GET_SIZE(fr[3]) != 24)
        Py_RETURN_NONE;
    return event_core((const unsigned char *)PyBytes_AS_STRING(fr[3]), 24,
                      (const unsigned char *)PyBytes_AS_STRING(fr[2]), PyBytes_GET_SIZE(fr[2]),
                      fr[2], prefix, decompress, tc);
}

static PyObject *event(PyObject *self, PyObject *args) {
    PyObject *frames, *prefix, *decompress;
    if (!PyArg_ParseTuple(args, "OSO", &frames, &prefix, &decompress)) return NULL;
    if (!PyList_Check(frames) && !PyTuple_Check(frames)) Py_RETURN_NONE;
    if (PySequence_Fast_GET_SIZE(frames) < 4) Py_RETURN_NONE;
    tscache_t tc = {-1, ""};
    return event_one(PySequence_Fast_ITEMS(frames), prefix, decompress, &tc);
}

static int same_bytes(PyObject *a, PyObject *b) {
    return a == b || (PyBytes_GET_SIZE(a) == PyBytes_GET_SIZE(b) &&
                      memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)PyBytes_GET_SIZE(a)) == 0);
}

static int same_mem(PyObject *a, const unsigned char *p, Py_ssize_t n) {
    return PyBytes_GET_SIZE(a) == n && memcmp(PyBytes_AS_STRING(a), p, (size_t)n) == 0;
}

/* events() of a RecordBlock: from its buffer, no Python object per record but the event */
static PyObject *events_block(RecordBlock *blk, int kind_logjam, PyObject *prefix_fn,
                              PyObject *decompress, Py_ssize_t limit, int heartbeats) {
    Py_ssize_t n = blk->n, total = 0, longest = 0;
    int clean = 1;
    PyObject *out = PyList_New(n), *k0 = NULL, *k1 = NULL, *prefix = NULL;
    tscache_t tc = {-1, ""};
    rb_view v;
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ev, *mark;
        rb_frames(blk, i, &v);
        if ((long)v.kind != kind_logjam || v.nf < 4) { mark = Py_None; goto marked; }
        if (!heartbeats && v.len[0] == 9 && memcmp(v.f[0], "heartbeat", 9) == 0) {
            mark = Py_None;
            goto marked;
        }
        if (v.len[2] > limit) { mark = Py_False; goto marked; }
        if (!prefix || !same_mem(k0, v.f[0], v.len[0]) || !same_mem(k1, v.f[1], v.len[1])) {
            PyObject *a = PyBytes_FromStringAndSize((const char *)v.f[0], v.len[0]);
            PyObject *t = a ? PyBytes_FromStringAndSize((const char *)v.f[1], v.len[1]) : NULL;
            PyObject *p = t ? PyObject_CallFunctionObjArgs(prefix_fn, a, t, NULL) : NULL;
            if (!p) { Py_XDECREF(a); Py_XDECREF(t); goto fail; }
            if (!PyBytes_Check(p)) {
                Py_DECREF(p); Py_DECREF(a); Py_DECREF(t);
                PyErr_SetString(PyExc_TypeError, "prefix must return bytes");
                goto fail;
            }
            Py_XSETREF(prefix, p);
            Py_XSETREF(k0, a);
            Py_XSETREF(k1, t);
        }
        ev = event_core(v.f[3], v.len[3], v.f[2], v.len[2], NULL, prefix, decompress, &tc);
        if (!ev) goto fail;
        if (ev == Py_None) { Py_DECREF(ev); mark = Py_False; goto marked; }
        total += PyBytes_GET_SIZE(ev);
        if (PyBytes_GET_SIZE(ev) > longest) longest = PyBytes_GET_SIZE(ev);
        PyList_SET_ITEM(out, i, ev);
        continue;
    marked:
        clean = 0;
        Py_INCREF(mark);
        PyList_SET_ITEM(out, i, mark);
    }
    Py_XDECREF(k0); Py_XDECREF(k1); Py_XDECREF(prefix);
    return Py_BuildValue("(Ninn)", out, clean, total, longest);
fail:
    Py_DECREF(out);
    Py_XDECREF(k0); Py_XDECREF(k1); Py_XDECREF(prefix);
    return NULL;
}

/* events(records, kind_logjam, prefix, decompress, limit[, heartbeats])
 *     -> (events, clean, total, longest)
 * One entry per record: the event bytes (what event() gives), None for a record that is
 * not an event (another kind, fewer than 4 frames, a heartbeat unless ``heartbeats``:
 * record_to_event's None),
 * or False when the Python mapping must decide (anything event() leaves to it, a body
 * over ``limit``, a record that is not a (position, kind, frames) tuple of bytes).
 * ``prefix(app_env, topic) -> bytes`` is called when the pair changes; ``clean``: every
 * entry is bytes; ``total``/``longest``: their summed and largest length. */
static PyObject *events(PyObject *self, PyObject *args) {
    PyObject *records, *prefix_fn, *decompress;
    int kind_logjam, heartbeats = 0;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OiOOn|p", &records, &kind_logjam, &prefix_fn, &decompress,
                          &limit, &heartbeats))
        return NULL;
    if (block_type && Py_TYPE(records) == block_type)
        return events_block((RecordBlock *)records, kind_logjam, prefix_fn, decompress, limit,
                            heartbeats);
    PyObject *seq = PySequence_Fast(records, "records must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0, longest = 0;
    int clean = 1;
    PyObject *out = PyList_New(n), *k0 = NULL, *k1 = NULL, *prefix = NULL;
    tscache_t tc = {-1, ""};
    if (!out) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PySequence_Fast_GET_ITEM(seq, i), *ev = NULL;
        if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) < 3 || !PyLong_CheckExact(PyTuple_GET_ITEM(rec, 1)))
            goto python;
        int overflow = 0;
        long kind = PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(rec, 1), &overflow);
        PyObject *frames = PyTuple_GET_ITEM(rec, 2);
        if (overflow || (!PyList_CheckExact(frames) && !PyTuple_CheckExact(frames))) goto python;
        Py_ssize_t nf = PySequence_Fast_GET_SIZE(frames);
        if (kind != kind_logjam || nf < 4) goto skip;
        PyObject **fr = PySequence_Fast_ITEMS(frames);
        if (!PyBytes_CheckExact(fr[0]) || !PyBytes_CheckExact(fr[1]) || !PyBytes_CheckExact(fr[2]))
            goto python;
        if (!heartbeats && PyBytes_GET_SIZE(fr[0]) == 9 &&
                memcmp(PyBytes_AS_STRING(fr[0]), "heartbeat", 9) == 0)
            goto skip;
        if (PyBytes_GET_SIZE(fr[2]) > limit) goto python;
        if (!prefix || !same_bytes(fr[0], k0) || !same_bytes(fr[1], k1)) {
            PyObject *p = PyObject_CallFunctionObjArgs(prefix_fn, fr[0], fr[1], NULL);
            if (!p) goto fail;
            if (!PyBytes_Check(p)) {
                Py_DECREF(p);
                PyErr_SetString(PyExc_TypeError, "prefix must return bytes");
                goto fail;
            }
            Py_XSETREF(prefix, p);
            Py_INCREF(fr[0]); Py_XSETREF(k0, fr[0]);
            Py_INCREF(fr[1]); Py_XSETREF(k1, fr[1]);
        }
        ev = event_one(fr, prefix, decompress, &tc);
        if (!ev) goto fail;
        if (ev == Py_None) { Py_DECREF(ev); goto python; }
        total += PyBytes_GET_SIZE(ev);
        if (PyBytes_GET_SIZE(ev) > longest) longest = PyBytes_GET_SIZE(ev);
        PyList_SET_ITEM(out, i, ev);
        continue;
    skip:
        clean = 0;
        Py_INCREF(Py_None);
        PyList_SET_ITEM(out, i, Py_None);
        continue;
    python:
        clean = 0;
        Py_INCREF(Py_False);
        PyList_SET_ITEM(out, i, Py_False);
    }
    Py_DECREF(seq);
    Py_XDECREF(k0); Py_XDECREF(k1); Py_XDECREF(prefix);
    return Py_BuildValue("(Ninn)", out, clean, total, longest);
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    Py_XDECREF(k0); Py_XDECREF(k1); Py_XDECREF(prefix);
    return NULL;
}

#define ADLER_BASE 65521u
#define ADLER_NMAX 5552     /* largest n with 255n(n+1)/2 + (n+1)(BASE-1) <= 2^32-1 */

static uint32_t adler32_scalar(uint32_t adler, const unsigned char *p, size_t len) {
    uint32_t a = (adler & 0xffff) % ADLER_BASE, b = (adler >> 16) % ADLER_BASE;
    while (len) {
        size_t n = len < ADLER_NMAX ? len : ADLER_NMAX;
        len -= n;
        while (n--) { a += *p++; b += a; }
        a %= ADLER_BASE;
        b %= ADLER_BASE;
    }
    return a | (b << 16);
}

#ifdef HAVE_SSSE3_ADLER
/* 32 bytes per step: s1 from byte sums (psadbw), s2 from weighted sums (pmaddubsw with
 * weights 32..1) plus 32 x the s1 before each step; reduced mod BASE every NMAX bytes. */
__attribute__((target("ssse3")))
static uint32_t adler32_ssse3(uint32_t adler, const unsigned char *p, size_t len) {
    uint32_t s1 = (adler & 0xffff) % ADLER_BASE, s2 = (adler >> 16) % ADLER_BASE;
    const __m128i tap1 = _mm_setr_epi8(32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17);
    const __m128i tap2 = _mm_setr_epi8(16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1);
    const __m128i zero = _mm_setzero_si128();
    const __m128i ones = _mm_set1_epi16(1);
    while (len >= 32) {
        size_t blocks = len / 32;
        if (blocks > ADLER_NMAX / 32) blocks = ADLER_NMAX / 32;
        len -= blocks * 32;
        __m128i v_ps = _mm_setr_epi32(0, 0, 0, (int)(s1 * (uint32_t)blocks));
        __m128i v_s2 = _mm_setr_epi32(0, 0, 0, (int)s2);
        __m128i v_s1 = zero;
        for (size_t k = 0; k < blocks; k++) {
            __m128i b1 = _mm_loadu_si128((const __m128i *)p);
            __m128i b2 = _mm_loadu_si128((const __m128i *)(p + 16));
            v_ps = _mm_add_epi32(v_ps, v_s1);
            v_s1 = _mm_add_epi32(v_s1, _mm_sad_epu8(b1, zero));
            v_s2 = _mm_add_epi32(v_s2, _mm_madd_epi16(_mm_maddubs_epi16(b1, tap1), ones));
            v_s1 = _mm_add_epi32(v_s1, _mm_sad_epu8(b2, zero));
            v_s2 = _mm_add_epi32(v_s2, _mm_madd_epi16(_mm_maddubs_epi16(b2, tap2), ones));
            p += 32;
        }
        v_s2 = _mm_add_epi32(v_s2, _mm_slli_epi32(v_ps, 5));
        uint32_t t1[4], t2[4];
        _mm_storeu_si128((__m128i *)t1, v_s1);
        _mm_storeu_si128((__m128i *)t2, v_s2);
        s1 += t1[0] + t1[1] + t1[2] + t1[3];
        s2 = t2[0] + t2[1] + t2[2] + t2[3];
        s1 %= ADLER_BASE;
        s2 %= ADLER_BASE;
    }
    return adler32_scalar(s1 | (s2 << 16), p, len);
}
#endif

static uint32_t (*adler32_impl)(uint32_t, const unsigned char *, size_t) = adler32_scalar;

static PyObject *adler32(PyObject *self, PyObject *args) {
    Py_buffer v;
    unsigned int value = 1;
    if (!PyArg_ParseTuple(args, "y*|I", &v, &value)) return NULL;
    uint32_t r;
    if (v.len >= 4096) {
        Py_BEGIN_ALLOW_THREADS
        r = adler32_impl(value, v.buf, (size_t)v.len);
        Py_END_ALLOW_THREADS
    } else {
        r = adler32_impl(value, v.buf, (size_t)v.len);
    }
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *adler32_scalar_py(PyObject *self, PyObject *args) {
    Py_buffer v;
    unsigned int value = 1;
    if (!PyArg_ParseTuple(args, "y*|I", &v, &value)) return NULL;
    uint32_t r = adler32_scalar(value, v.buf, (size_t)v.len);
    PyBuffer_Release(&v);
    return PyLong_FromUnsignedLong(r);
}

static PyObject *frame_events(PyObject *self, PyObject *arg) {
    PyObject *seq = PySequence_Fast(arg, "frame_events() needs a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = items[i];
        if (!PyBytes_CheckExact(e) || (uint64_t)PyBytes_GET_SIZE(e) > 0xFFFFFFFFULL) {
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
        total += 4 + (size_t)PyBytes_GET_SIZE(e);
    }
    if (total > (size_t)PY_SSIZE_T_MAX) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!out) { Py_DECREF(seq); return NULL; }
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = items[i];
        size_t len = (size_t)PyBytes_GET_SIZE(e);
        w[0] = (unsigned char)(len >> 24); w[1] = (unsigned char)(len >> 16);
        w[2] = (unsigned char)(len >> 8); w[3] = (unsigned char)len;
        memcpy(w + 4, PyBytes_AS_STRING(e), len);
        w += 4 + len;
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *is_json(PyObject *self, PyObject *args) {
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v)) return NULL;
    int r = json_valid(v.buf, (size_t)v.len);
    PyBuffer_Release(&v);
    if (r < 0) Py_RETURN_NONE;
    return PyBool_FromLong(r);
}

static PyMethodDef methods[] = {
    {"event", event, METH_VARARGS, "event(frames, prefix, decompress) -> bytes or None"},
    {"events", events, METH_VARARGS,
     "events(records, kind_logjam, prefix, decompress, limit[, heartbeats])"
     " -> (events, clean, total, longest)"},
    {"adler32", adler32, METH_VARARGS, "adler32(data[, value]) -> zlib.adler32(data, value)"},
    {"adler32_scalar", adler32_scalar_py, METH_VARARGS,
     "adler32 without SIMD (tests compare both with zlib.adler32)"},
    {"frame_events", frame_events, METH_O,
     "frame_events(events) -> the [u32 len][json] payload body, or None (use the Python twin)"},
    {"is_json", is_json, METH_VARARGS, "is_json(bytes) -> True, False, or None (too deep to say)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_courierenc", "Courier event mapping in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__courierenc(void) {
#ifdef HAVE_SSSE3_ADLER
    __builtin_cpu_init();
    if (__builtin_cpu_supports("ssse3")) adler32_impl = adler32_ssse3;
#endif
    return rb_module_create(&module, &block_type);
}

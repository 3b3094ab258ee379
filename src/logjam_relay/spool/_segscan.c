/* Walk a spool segment in C: CRC check, frame lengths and (app_env, topic) interning for
 * every logjam record, so the Spark data source's Python code only decompresses bodies
 * and builds Arrow columns.  Optional: logjam_relay.pipeline.datasource has the same
 * walk in Python and tests compare the two (tests/test_segscan.py).
 *
 * scan(buf, pos, start, stop) -> (rows, pairs, pos, idx, status, skipped_kinds)
 *   buf    the whole segment file (bytes-like); pos = offset of the first record
 *   rows   bytes: int64[nrows][5] = pair, code, meta_off, body_off, body_len, for the
 *          logjam records with index in [start, stop); code: 0..255 = compression from a
 *          valid meta frame, -1 = bad meta frame, -2 = not 4 frames (pair = first frame)
 *   pairs  [(app_env_offset, app_env_len, topic_len)] in order of first appearance
 *          (for code -2: (first_frame_offset, first_frame_len, 0))
 *   pos    where the walk stopped; idx = index of the record there
 *   status "stop" (idx reached stop), "seal", or a corrupt reason:
 *          "torn", "no_seal", "bad_length", "crc", "frame_lengths"
 *
 * scan_meta(fd, pos, size[, chunk]) -> (device, sequence, created_ms, bad, pos, idx, status,
 *                                      skipped_kinds)
 *   the same walk over a whole segment file (start 0, no stop) for the loss table
 *   (pipeline/loss.py), reading the open file ``fd`` itself from offset ``pos`` (the
 *   first record) to ``size`` (its length) with pread, ``chunk`` bytes at a time (default
 *   1 MiB) into one small buffer that stays in cache (no copy of the whole file, no
 *   Python object per record); only the meta frames are decoded.  device, sequence,
 *   created_ms: bytes, int64[n] each (native order), of the logjam records with a valid
 *   meta frame (code >= 0 above), in record order, the meta's big-endian fields as
 *   pipeline/decode.py reads them (unsigned, cast to int64); bad = logjam records without
 *   a valid meta frame (codes -1 and -2: idx = n + bad); pos, idx, status, skipped_kinds
 *   as for scan (status never "stop").  A read error raises OSError.
 *   The reference is pipeline/decode.py's meta_arrays_py (tests/test_segscan.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <zlib.h>

#include "../_c/meta.h"        /* lj_meta_plain, the meta fields */
#include "_walk.h"              /* the readers' walk (and ../_c/record_crc.h: the checks) */

/* the status of a failed lj_record_head in scan and scan_meta (a record cut short: "torn") */
static inline const char *walk_reason(int rc) {
    return rc == LJ_REC_BAD_LENGTH ? "bad_length" : rc == LJ_REC_CRC ? "crc" : "torn";
}

typedef struct { int64_t off; uint32_t la, lt; uint64_t hash; } pair_t;

typedef struct {
    pair_t *pairs; Py_ssize_t npairs, cap;
    int32_t *slots; Py_ssize_t nslots;      /* open addressing: index+1, 0 = empty */
} table_t;

static uint64_t fnv(const unsigned char *p, size_t n, uint32_t la) {
    uint64_t h = 1469598103934665603ULL ^ la;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ULL; }
    return h;
}

static int grow(table_t *t) {
    Py_ssize_t ns = t->nslots ? t->nslots * 2 : 1024;
    int32_t *slots = PyMem_RawCalloc((size_t)ns, sizeof(int32_t));
    if (!slots) return -1;
    for (Py_ssize_t i = 0; i < t->npairs; i++) {
        Py_ssize_t j = (Py_ssize_t)(t->pairs[i].hash & (uint64_t)(ns - 1));
        while (slots[j]) j = (j + 1) & (ns - 1);
        slots[j] = (int32_t)(i + 1);
    }
    PyMem_RawFree(t->slots);
    t->slots = slots;
    t->nslots = ns;
    return 0;
}

static Py_ssize_t intern(table_t *t, const unsigned char *buf, int64_t off, uint32_t la, uint32_t lt) {
    const unsigned char *key = buf + off;
    size_t n = (size_t)la + lt;
    uint64_t h = fnv(key, n, la);
    if (t->npairs * 2 >= t->nslots && grow(t) < 0) return -1;
    Py_ssize_t j = (Py_ssize_t)(h & (uint64_t)(t->nslots - 1));
    while (t->slots[j]) {
        pair_t *p = &t->pairs[t->slots[j] - 1];
        if (p->hash == h && p->la == la && p->lt == lt && memcmp(buf + p->off, key, n) == 0)
            return t->slots[j] - 1;
        j = (j + 1) & (t->nslots - 1);
    }
    if (t->npairs == t->cap) {
        Py_ssize_t nc = t->cap ? t->cap * 2 : 64;
        pair_t *np_ = PyMem_RawRealloc(t->pairs, (size_t)nc * sizeof(pair_t));
        if (!np_) return -1;
        t->pairs = np_;
        t->cap = nc;
    }
    t->pairs[t->npairs] = (pair_t){off, la, lt, h};
    t->slots[j] = (int32_t)(t->npairs + 1);
    return t->npairs++;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, start, stop;
    if (!PyArg_ParseTuple(args, "y*nnn", &view, &pos, &start, &stop)) return NULL;
    const unsigned char *buf = view.buf;
    const Py_ssize_t size = view.len;
    table_t t = {0};
    int64_t *rows = NULL;
    Py_ssize_t nrows = 0, rcap = 0, idx = 0, skipped = 0;
    const char *status = "stop";
    PyObject *result = NULL;

    Py_BEGIN_ALLOW_THREADS
    while (idx < stop) {
        if (size - pos < HEADER_MIN) { status = pos != size ? "torn" : "no_seal"; break; }
        lj_record rec;
        int rc = lj_record_head(buf + pos, (uint64_t)(size - pos), &rec);
        if (rc != LJ_REC_OK) { status = walk_reason(rc); break; }
        Py_ssize_t rend = pos + (Py_ssize_t)rec.size;
        if (rec.kind != KIND_LOGJAM) {
            if (rec.kind == KIND_SEAL) { status = "seal"; break; }
            skipped++;
            pos = rend;
            continue;
        }
        if (!lj_record_frames_ok(buf + pos, &rec)) { status = "frame_lengths"; break; }
        const uint32_t n = rec.n;
        const unsigned char *lens = buf + pos + HEADER_MIN;
        Py_ssize_t p = pos + HEADER_MIN + 4 * (Py_ssize_t)n;
        if (idx < start) { idx++; pos = rend; continue; }       /* checked first, too */
        if (nrows == rcap) {
            Py_ssize_t nc = rcap ? rcap * 2 : 4096;
            int64_t *nr = PyMem_RawRealloc(rows, (size_t)nc * 5 * sizeof(int64_t));
            if (!nr) { status = NULL; break; }
            rows = nr;
            rcap = nc;
        }
        int64_t *row = rows + 5 * nrows;
        Py_ssize_t k;
        if (n == 4) {
            uint32_t la = rd32(lens), lt = rd32(lens + 4), lb = rd32(lens + 8), lm = rd32(lens + 12);
            Py_ssize_t r = p + la + lt, s = r + lb;
            k = intern(&t, buf, p, la, lt);
            int64_t code = lj_meta_plain(buf + s, lm) ? buf[s + 2] : -1;
            row[2] = code == -1 ? 0 : s;
            row[3] = r;
            row[4] = lb;
            row[1] = code;
        } else {
            uint32_t l0 = n ? rd32(lens) : 0;
            k = intern(&t, buf, p, l0, 0);
            row[1] = -2;
            row[2] = 0;
            row[3] = 0;
            row[4] = 0;
        }
        if (k < 0) { status = NULL; break; }
        row[0] = k;
        nrows++;
        idx++;
        pos = rend;
    }
    Py_END_ALLOW_THREADS

    if (status == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    PyObject *pairs = PyList_New(t.npairs);
    if (!pairs) goto out;
    for (Py_ssize_t i = 0; i < t.npairs; i++) {
        PyObject *tup = Py_BuildValue("(LII)", (long long)t.pairs[i].off, t.pairs[i].la, t.pairs[i].lt);
        if (!tup) { Py_DECREF(pairs); goto out; }
        PyList_SET_ITEM(pairs, i, tup);
    }
    PyObject *rb = PyBytes_FromStringAndSize((const char *)rows, nrows * 5 * (Py_ssize_t)sizeof(int64_t));
    if (!rb) { Py_DECREF(pairs); goto out; }
    result = Py_BuildValue("(NNnnsn)", rb, pairs, pos, idx, status, skipped);
out:
    PyMem_RawFree(rows);
    PyMem_RawFree(t.pairs);
    PyMem_RawFree(t.slots);
    PyBuffer_Release(&view);
    return result;
}

/* scan_meta's window on the file: bytes [base, base + have) of it in buf */
typedef struct {
    int fd;
    unsigned char *buf;
    Py_ssize_t cap, have, chunk;
    int64_t base, size;         /* size: where the walk ends (the file's, as read) */
    int err;                    /* errno of a failed read, or -1: out of memory */
} window_t;

/* Make the window hold [off, off + need) (off + need <= size), reading at least a chunk
 * from off: 0, or -1 (w->err).  A file that ends early (truncated meanwhile) lowers
 * w->size to its end: the caller checks again. */
static int window_fill(window_t *w, int64_t off, Py_ssize_t need) {
    if (off >= w->base && off + need <= w->base + w->have) return 0;
    Py_ssize_t keep = 0;
    if (off >= w->base && off < w->base + w->have) {
        keep = (Py_ssize_t)(w->base + w->have - off);
        memmove(w->buf, w->buf + (off - w->base), (size_t)keep);
    }
    w->base = off;
    w->have = keep;
    Py_ssize_t want = need > w->chunk ? need : w->chunk;
    if (want > w->size - off) want = (Py_ssize_t)(w->size - off);
    if (want > w->cap) {
        unsigned char *nb = PyMem_RawRealloc(w->buf, (size_t)want);
        if (!nb) { w->err = -1; return -1; }
        w->buf = nb;
        w->cap = want;
    }
    while (w->have < want) {
        ssize_t r = pread(w->fd, w->buf + w->have, (size_t)(want - w->have), (off_t)(off + w->have));
        if (r < 0) {
            if (errno == EINTR) continue;
            w->err = errno;
            return -1;
        }
        if (r == 0) { w->size = off + w->have; break; }
        w->have += r;
    }
    return 0;
}

static PyObject *scan_meta(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t pos, size, chunk = 1 << 20;
    if (!PyArg_ParseTuple(args, "inn|n", &fd, &pos, &size, &chunk)) return NULL;
    if (chunk < HEADER_MIN) chunk = HEADER_MIN;
    window_t w = {fd, NULL, 0, 0, chunk, pos, size, 0};
    int64_t *dev = NULL, *seq = NULL, *cre = NULL;
    Py_ssize_t n = 0, cap = 0, idx = 0, bad = 0, skipped = 0;
    const char *status = "seal";
    PyObject *result = NULL;

    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (w.size - pos < HEADER_MIN) { status = pos != w.size ? "torn" : "no_seal"; break; }
        if (window_fill(&w, pos, HEADER_MIN) < 0) { status = NULL; break; }
        if (w.size - pos < HEADER_MIN) continue;                /* ended early */
        const unsigned char *h = w.buf + (pos - w.base);
        lj_record rec;
        if (lj_record_fields(h, &rec) != LJ_REC_OK) { status = "bad_length"; break; }
        int64_t rend = pos + (int64_t)rec.size;
        if (rend > w.size) { status = "torn"; break; }
        if (window_fill(&w, pos, (Py_ssize_t)rec.size) < 0) { status = NULL; break; }
        if (rend > w.size) continue;                            /* ended early */
        h = w.buf + (pos - w.base);
        if (!lj_record_crc_ok(h, &rec)) { status = "crc"; break; }
        if (rec.kind != KIND_LOGJAM) {
            if (rec.kind == KIND_SEAL) { status = "seal"; break; }
            skipped++;
            pos = rend;
            continue;
        }
        if (!lj_record_frames_ok(h, &rec)) { status = "frame_lengths"; break; }
        idx++;
        pos = rend;
        const unsigned char *lens = h + HEADER_MIN, *s = NULL;
        if (rec.n == 4) {
            s = h + LJ_HEAD4 + rd32(lens) + rd32(lens + 4) + rd32(lens + 8);
            if (!lj_meta_plain(s, rd32(lens + 12))) s = NULL;
        }
        if (!s) { bad++; continue; }
        if (n == cap) {
            Py_ssize_t nc = cap ? cap * 2 : 16384;
            int64_t *a = PyMem_RawRealloc(dev, (size_t)nc * sizeof(int64_t));
            if (a) dev = a;
            int64_t *b = a ? PyMem_RawRealloc(seq, (size_t)nc * sizeof(int64_t)) : NULL;
            if (b) seq = b;
            int64_t *c = b ? PyMem_RawRealloc(cre, (size_t)nc * sizeof(int64_t)) : NULL;
            if (!c) { w.err = -1; status = NULL; break; }
            cre = c;
            cap = nc;
        }
        dev[n] = (int64_t)lj_meta_device(s);
        cre[n] = (int64_t)lj_meta_created(s);
        seq[n] = (int64_t)lj_meta_sequence(s);
        n++;
    }
    Py_END_ALLOW_THREADS

    if (status == NULL) {
        if (w.err == -1) PyErr_NoMemory();
        else { errno = w.err; PyErr_SetFromErrno(PyExc_OSError); }
        goto out;
    }
    const Py_ssize_t nb = n * (Py_ssize_t)sizeof(int64_t);
    PyObject *d = PyBytes_FromStringAndSize((const char *)dev, nb);
    PyObject *q = d ? PyBytes_FromStringAndSize((const char *)seq, nb) : NULL;
    PyObject *c = q ? PyBytes_FromStringAndSize((const char *)cre, nb) : NULL;
    if (!c) { Py_XDECREF(d); Py_XDECREF(q); goto out; }
    result = Py_BuildValue("(NNNnLnsn)", d, q, c, bad, (long long)pos, idx, status, skipped);
out:
    PyMem_RawFree(w.buf);
    PyMem_RawFree(dev);
    PyMem_RawFree(seq);
    PyMem_RawFree(cre);
    return result;
}

/* parse_records(buf, pos, end, max_records, base) -> (records, pos, status): exactly
 * segment.parse_records_py: records are (file_offset, kind, seq, [frames], record_end)
 * with verified CRCs; status None, "partial", "seal" or (reason, message, file_offset)
 * for a corrupt record (the caller raises SegmentCorrupt from it).  The walk: _walk.h. */
typedef struct {
    PyObject *out;
    Py_ssize_t base;
} parse_ctx;

static int parse_visit(void *ctx, const unsigned char *buf, Py_ssize_t pos, const lj_record *r) {
    parse_ctx *c = ctx;
    PyObject *frames = lj_frame_list(buf + pos, r, NULL);
    if (!frames) return -1;
    PyObject *rec = Py_BuildValue("(nIKNn)", c->base + pos, r->kind, (unsigned long long)r->seq,
                                  frames, c->base + pos + (Py_ssize_t)r->size);
    if (!rec || PyList_Append(c->out, rec) < 0) { Py_XDECREF(rec); return -1; }
    Py_DECREF(rec);
    return 0;
}

static PyObject *parse_records(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, end, max_records, base;
    if (!PyArg_ParseTuple(args, "y*nnnn", &view, &pos, &end, &max_records, &base)) return NULL;
    PyObject *result = NULL;
    parse_ctx c = {PyList_New(0), base};
    lj_walk w = {pos, 0, -1, NULL};
    if (end > view.len) end = view.len;
    if (c.out && lj_walk_records(view.buf, end, base, max_records, 0, &w, parse_visit, &c) == 0) {
        if (!w.status) { w.status = Py_None; Py_INCREF(w.status); }
        result = Py_BuildValue("(OnN)", c.out, w.pos, w.status);
    }
    Py_XDECREF(c.out);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "scan(buf, pos, start, stop) -> (rows, pairs, pos, idx, status, skipped_kinds)"},
    {"scan_meta", scan_meta, METH_VARARGS,
     "scan_meta(fd, pos, size[, chunk]) -> (device, sequence, created_ms, bad, pos, idx, status, skipped_kinds)"},
    {"parse_records", parse_records, METH_VARARGS,
     "parse_records(buf, pos, end, max_records, base) -> (records, pos, status)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_segscan", "C walk of spool segment records.", -1, methods,
};

PyMODINIT_FUNC PyInit__segscan(void) { return PyModule_Create(&module); }

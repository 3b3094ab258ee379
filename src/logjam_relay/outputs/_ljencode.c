/* The Lumberjack output's event mapping in C: logjam records -> consecutive 1D frames.
 *
 * encode(records, kind_logjam, tail, cache, stream_pairs, decompress, fallback[, heartbeats])
 *     -> (bytes, n)
 *
 * Exactly EventEncoder.encode_py for every record it handles itself: a logjam record
 * (kind == kind_logjam, first frame != b"heartbeat" unless ``heartbeats`` is true: then
 * heartbeats are mapped like any message) with 4 frames, a 24-byte meta frame
 * and a body that is plain or that ``decompress(body, comp)`` decodes.  Anything else
 * (wrong frame count, bad meta, a body that does not decompress) is handed to
 * ``fallback(frames, seq) -> bytes`` (the Python mapping, which also counts the decode
 * error), so both paths give byte-identical frames.  ``cache`` maps (app_env, topic) to
 * the encoded app/env/topic pairs; on a miss ``stream_pairs(app_env, topic)`` builds them.
 *
 * encode_block(block, kind_logjam, tail, cache, stream_pairs, limit[, heartbeats])
 *     -> (bytes, n) | None
 *     encode() of a RecordBlock (spool/_recblock.h: an output worker's reads), from its
 *     buffer: no Python object per record.  Only for the common case, without side
 *     effects otherwise: None (the caller encodes ``block.tolist()``) when a logjam
 *     record that is not a heartbeat would go to ``decompress`` or ``fallback`` (not 4
 *     frames, a meta frame that is not 24 bytes, a compressed body) or has a body over
 *     ``limit`` bytes (``limit`` < 0: no limit).  Same bytes as encode() otherwise.
 *
 * scan(records, inline_body_max) -> (body_bytes, heavy) | None
 *     The outputs' look at a batch before mapping it (poison.scan_py), in one pass
 *     (a list of records, or a RecordBlock).
 *
 * window_start(frames, count, level, fd) -> WindowJob
 *     The compressed window of protocols.lumberjack.encode_window(frames, count, level)
 *     (``1W count`` + one ``1C`` frame, zlib at ``level``; byte-identical: the same
 *     deflateInit parameters and the same Z_NO_FLUSH then Z_FINISH calls as zlib's
 *     compressobj) made by a thread of its own that never takes the GIL: it writes into
 *     a bytes object allocated here, then adds 1 to the eventfd ``fd``.  The event loop
 *     waits for ``fd`` to be readable and calls ``job.finish() -> bytes``.
 *     (trio.to_thread + zlib: the thread needs the GIL to start, to come back from
 *     deflate and to hand the result over; with ingest keeping the GIL busy on the loop
 *     it waited up to the switch interval each time, and inline Lumberjack starved.)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "../_c/meta.h"            /* the meta frame's fields */
#include "../spool/_recblock.h"    /* RecordBlock: a worker's spool reads as one buffer */
#include "_decimal.h"            /* u64dec() */

static PyTypeObject *block_type;    /* NULL without spool/_tailread: no blocks then */

typedef struct { char *p; size_t len, cap; } buf_t;

static int reserve(buf_t *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t nc = b->cap ? b->cap : 1 << 16;
    while (nc < b->len + more) nc *= 2;
    char *np_ = PyMem_Realloc(b->p, nc);
    if (!np_) { PyErr_NoMemory(); return -1; }
    b->p = np_;
    b->cap = nc;
    return 0;
}

static inline void put(buf_t *b, const void *src, size_t n) { memcpy(b->p + b->len, src, n); b->len += n; }
static inline void put32(buf_t *b, uint32_t v) {
    unsigned char x[4] = {v >> 24, v >> 16, v >> 8, v};
    put(b, x, 4);
}
static inline void putkv(buf_t *b, const char *key, size_t klen, const char *val, size_t vlen) {
    put32(b, (uint32_t)klen); put(b, key, klen); put32(b, (uint32_t)vlen); put(b, val, vlen);
}

static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *records, *tail, *cache, *stream_pairs, *decompress, *fallback;
    int kind_logjam, heartbeats = 0;
    if (!PyArg_ParseTuple(args, "OiSO!OOO|p", &records, &kind_logjam, &tail, &PyDict_Type,
                          &cache, &stream_pairs, &decompress, &fallback, &heartbeats))
        return NULL;
    PyObject *seq_ = PySequence_Fast(records, "records must be a sequence");
    if (!seq_) return NULL;
    Py_ssize_t nrec = PySequence_Fast_GET_SIZE(seq_);
    buf_t b = {0};
    uint32_t seq = 0;
    /* the (app_env, topic) pairs of the last record: records read from one segment share
     * those frame objects (spool/_tailread.c), so the cache is not even looked up */
    PyObject *last0 = NULL, *last1 = NULL, *last_pairs = NULL;
    const char *tailp = PyBytes_AS_STRING(tail);
    size_t taillen = (size_t)PyBytes_GET_SIZE(tail);
    for (Py_ssize_t i = 0; i < nrec; i++) {
        PyObject *rec = PySequence_Fast_GET_ITEM(seq_, i);
        if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) < 3) {
            PyErr_SetString(PyExc_TypeError, "records must be (position, kind, frames) tuples");
            goto fail;
        }
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(rec, 1));
        if (kind == -1 && PyErr_Occurred()) goto fail;
        PyObject *frames = PyTuple_GET_ITEM(rec, 2);
        if (kind != kind_logjam) continue;
        if (!PyList_Check(frames) && !PyTuple_Check(frames)) {
            PyErr_SetString(PyExc_TypeError, "frames must be a list");
            goto fail;
        }
        PyObject **fr = PySequence_Fast_ITEMS(frames);
        Py_ssize_t nf = PySequence_Fast_GET_SIZE(frames);
        if (!heartbeats && nf > 0 && PyBytes_Check(fr[0]) && PyBytes_GET_SIZE(fr[0]) == 9 &&
                memcmp(PyBytes_AS_STRING(fr[0]), "heartbeat", 9) == 0)
            continue;                       /* heartbeats are spooled for the archive only */
        seq++;
        int clean = nf == 4 && PyBytes_CheckExact(fr[0]) && PyBytes_CheckExact(fr[1]) &&
                    PyBytes_CheckExact(fr[2]) && PyBytes_CheckExact(fr[3]) &&
                    PyBytes_GET_SIZE(fr[3]) == 24;
        PyObject *body = NULL;              /* new reference when set */
        const unsigned char *meta = NULL;
        if (clean) {
            meta = (const unsigned char *)PyBytes_AS_STRING(fr[3]);
            if (meta[2] == 0) {
                body = fr[2];
                Py_INCREF(body);
            } else {
                body = PyObject_CallFunction(decompress, "Oi", fr[2], (int)meta[2]);
                if (!body || !PyBytes_Check(body)) {
                    if (!body && !PyErr_ExceptionMatches(PyExc_Exception)) goto fail;
                    PyErr_Clear();
                    Py_XDECREF(body);
                    body = NULL;
                    clean = 0;
                }
            }
        }
        if (!clean) {
            PyObject *one = PyObject_CallFunction(fallback, "OI", frames, seq);
            if (!one) goto fail;
            if (!PyBytes_Check(one)) {
                Py_DECREF(one);
                PyErr_SetString(PyExc_TypeError, "fallback must return bytes");
                goto fail;
            }
            if (reserve(&b, (size_t)PyBytes_GET_SIZE(one)) < 0) { Py_DECREF(one); goto fail; }
            put(&b, PyBytes_AS_STRING(one), (size_t)PyBytes_GET_SIZE(one));
            Py_DECREF(one);
            continue;
        }
        PyObject *pairs;
        if (last_pairs && fr[0] == last0 && fr[1] == last1) {
            pairs = last_pairs;                 /* the same frame objects as the last record */
            Py_INCREF(pairs);
        } else {
            PyObject *key = PyTuple_Pack(2, fr[0], fr[1]);
            if (!key) { Py_DECREF(body); goto fail; }
            pairs = PyDict_GetItemWithError(cache, key);     /* borrowed */
            if (pairs) {
                Py_INCREF(pairs);
            } else if (PyErr_Occurred()) {
                Py_DECREF(key); Py_DECREF(body); goto fail;
            } else {
                pairs = PyObject_CallFunctionObjArgs(stream_pairs, fr[0], fr[1], NULL);
                if (!pairs || !PyBytes_Check(pairs)) {
                    Py_XDECREF(pairs);
                    Py_DECREF(key); Py_DECREF(body);
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "stream_pairs must return bytes");
                    goto fail;
                }
            }
            Py_DECREF(key);
            Py_INCREF(pairs); Py_XSETREF(last_pairs, pairs);
            Py_INCREF(fr[0]); Py_XSETREF(last0, fr[0]);
            Py_INCREF(fr[1]); Py_XSETREF(last1, fr[1]);
        }
        char d[24], s[24], c[24];
        int dl = u64dec(d, lj_meta_device(meta));
        int cl = u64dec(c, lj_meta_created(meta));
        int sl = u64dec(s, lj_meta_sequence(meta));
        size_t blen = (size_t)PyBytes_GET_SIZE(body), plen = (size_t)PyBytes_GET_SIZE(pairs);
        if (reserve(&b, 10 + 8 + 4 + blen + plen + 3 * 22 + dl + sl + cl + taillen) < 0) {
            Py_DECREF(body); Py_DECREF(pairs); goto fail;
        }
        put(&b, "1D", 2);
        put32(&b, seq);
        put32(&b, 9);
        putkv(&b, "line", 4, PyBytes_AS_STRING(body), blen);
        put(&b, PyBytes_AS_STRING(pairs), plen);
        putkv(&b, "device", 6, d, (size_t)dl);
        putkv(&b, "sequence", 8, s, (size_t)sl);
        putkv(&b, "created_ms", 10, c, (size_t)cl);
        put(&b, tailp, taillen);
        Py_DECREF(body);
        Py_DECREF(pairs);
    }
    Py_DECREF(seq_);
    Py_XDECREF(last0); Py_XDECREF(last1); Py_XDECREF(last_pairs);
    PyObject *out = PyBytes_FromStringAndSize(b.p ? b.p : "", (Py_ssize_t)b.len);
    PyMem_Free(b.p);
    if (!out) return NULL;
    return Py_BuildValue("(NI)", out, seq);
fail:
    Py_DECREF(seq_);
    Py_XDECREF(last0); Py_XDECREF(last1); Py_XDECREF(last_pairs);
    PyMem_Free(b.p);
    return NULL;
}

/* room for ``more`` bytes after ``len`` in the bytes object *o (capacity *cap): grown by
 * doubling with _PyBytes_Resize (*o is NULL after a failure, with the exception set) */
static int reserve_bytes(PyObject **o, size_t *cap, size_t len, size_t more) {
    if (len + more <= *cap) return 0;
    size_t nc = *cap ? *cap : 1 << 16;
    while (nc < len + more) nc *= 2;
    if (nc > (size_t)PY_SSIZE_T_MAX) { Py_CLEAR(*o); PyErr_NoMemory(); return -1; }
    if (_PyBytes_Resize(o, (Py_ssize_t)nc) < 0) return -1;
    *cap = nc;
    return 0;
}

static PyObject *encode_block(PyObject *self, PyObject *args) {
    PyObject *blk_obj, *tail, *cache, *stream_pairs;
    int kind_logjam, heartbeats = 0;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OiSO!On|p", &blk_obj, &kind_logjam, &tail, &PyDict_Type, &cache,
                          &stream_pairs, &limit, &heartbeats))
        return NULL;
    if (!block_type || Py_TYPE(blk_obj) != block_type) {
        PyErr_SetString(PyExc_TypeError, "encode_block() needs a RecordBlock");
        return NULL;
    }
    RecordBlock *blk = (RecordBlock *)blk_obj;
    rb_view v;
    const char *tailp = PyBytes_AS_STRING(tail);
    size_t taillen = (size_t)PyBytes_GET_SIZE(tail);
    /* the common case only: decided before anything is written or called; and the
     * frames' size but for the stream pairs (at most 3 bytes per byte of app_env and
     * topic, each non-UTF-8 byte becoming U+FFFD, plus keys and lengths) */
    size_t cap = 64;
    for (Py_ssize_t i = 0; i < blk->n; i++) {
        rb_frames(blk, i, &v);
        if ((long)v.kind != kind_logjam) continue;
        if (!heartbeats && v.nf > 0 && v.len[0] == 9 && memcmp(v.f[0], "heartbeat", 9) == 0)
            continue;
        if (v.nf != 4 || v.len[3] != 24 || v.f[3][2] != 0 || (limit >= 0 && v.len[2] > limit))
            Py_RETURN_NONE;
        cap += 10 + 8 + (size_t)v.len[2] + 3 * 30 + taillen + 64 + 3 * (size_t)(v.len[0] + v.len[1]);
    }
    /* the frames go straight into the bytes object returned (shrunk at the end): no copy
     * of the window's frames afterwards */
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
    if (!out) return NULL;
    size_t len = 0;
    uint32_t seq = 0;
    const unsigned char *l0 = NULL, *l1 = NULL;     /* the last (app_env, topic) */
    Py_ssize_t l0len = 0, l1len = 0;
    PyObject *last_pairs = NULL;
    for (Py_ssize_t i = 0; i < blk->n; i++) {
        rb_frames(blk, i, &v);
        if ((long)v.kind != kind_logjam) continue;
        if (!heartbeats && v.nf > 0 && v.len[0] == 9 && memcmp(v.f[0], "heartbeat", 9) == 0)
            continue;
        seq++;
        if (!last_pairs || v.len[0] != l0len || v.len[1] != l1len ||
                memcmp(v.f[0], l0, (size_t)l0len) != 0 || memcmp(v.f[1], l1, (size_t)l1len) != 0) {
            PyObject *key = Py_BuildValue("(y#y#)", v.f[0], v.len[0], v.f[1], v.len[1]);
            if (!key) goto fail;
            PyObject *pairs = PyDict_GetItemWithError(cache, key);     /* borrowed */
            if (pairs) {
                Py_INCREF(pairs);
            } else if (PyErr_Occurred()) {
                Py_DECREF(key); goto fail;
            } else {
                pairs = PyObject_CallObject(stream_pairs, key);
                if (!pairs || !PyBytes_Check(pairs)) {
                    Py_XDECREF(pairs);
                    Py_DECREF(key);
                    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "stream_pairs must return bytes");
                    goto fail;
                }
            }
            Py_DECREF(key);
            Py_XSETREF(last_pairs, pairs);
            l0 = v.f[0]; l0len = v.len[0];
            l1 = v.f[1]; l1len = v.len[1];
        }
        const unsigned char *meta = v.f[3];
        char d[24], s[24], c[24];
        int dl = u64dec(d, lj_meta_device(meta));
        int cl = u64dec(c, lj_meta_created(meta));
        int sl = u64dec(s, lj_meta_sequence(meta));
        size_t blen = (size_t)v.len[2], plen = (size_t)PyBytes_GET_SIZE(last_pairs);
        size_t need = 10 + 8 + 4 + blen + plen + 3 * 22 + dl + sl + cl + taillen;
        if (reserve_bytes(&out, &cap, len, need) < 0) goto fail;
        buf_t b = {PyBytes_AS_STRING(out), len, cap};
        put(&b, "1D", 2);
        put32(&b, seq);
        put32(&b, 9);
        putkv(&b, "line", 4, (const char *)v.f[2], blen);
        put(&b, PyBytes_AS_STRING(last_pairs), plen);
        putkv(&b, "device", 6, d, (size_t)dl);
        putkv(&b, "sequence", 8, s, (size_t)sl);
        putkv(&b, "created_ms", 10, c, (size_t)cl);
        put(&b, tailp, taillen);
        len = b.len;
    }
    Py_XDECREF(last_pairs);
    if (_PyBytes_Resize(&out, (Py_ssize_t)len) < 0) return NULL;
    return Py_BuildValue("(NI)", out, seq);
fail:
    Py_XDECREF(last_pairs);
    Py_XDECREF(out);
    return NULL;
}

/* scan(records, inline_body_max) -> (body_bytes, heavy) | None
 * What the outputs ask of a batch before mapping it, in one pass (poison.scan_py):
 * body_bytes = the summed length of frame 2 of the records with more than 2 frames,
 * heavy = a record with more than 3 frames has a body over inline_body_max or a 24-byte
 * meta frame whose byte 2 (compression) is not 0.  None when a record is not a tuple of
 * (position, kind, list/tuple of bytes): the Python scan decides. */
static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *records;
    Py_ssize_t inline_max;
    if (!PyArg_ParseTuple(args, "On", &records, &inline_max)) return NULL;
    if (block_type && Py_TYPE(records) == block_type) {
        RecordBlock *blk = (RecordBlock *)records;
        Py_ssize_t total = 0;
        int heavy = 0;
        rb_view v;
        for (Py_ssize_t i = 0; i < blk->n; i++) {
            rb_frames(blk, i, &v);
            if (v.nf <= 2) continue;
            total += v.len[2];
            if (v.nf > 3 && !heavy &&
                    (v.len[2] > inline_max || (v.len[3] == 24 && v.f[3][2] != 0)))
                heavy = 1;
        }
        return Py_BuildValue("(nO)", total, heavy ? Py_True : Py_False);
    }
    if (!PyList_CheckExact(records)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(records), total = 0;
    int heavy = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) < 3) Py_RETURN_NONE;
        PyObject *frames = PyTuple_GET_ITEM(rec, 2);
        if (!PyList_CheckExact(frames) && !PyTuple_CheckExact(frames)) Py_RETURN_NONE;
        Py_ssize_t nf = PySequence_Fast_GET_SIZE(frames);
        if (nf <= 2) continue;
        PyObject **fr = PySequence_Fast_ITEMS(frames);
        if (!PyBytes_CheckExact(fr[2])) Py_RETURN_NONE;
        Py_ssize_t blen = PyBytes_GET_SIZE(fr[2]);
        total += blen;
        if (nf > 3 && !heavy) {
            if (!PyBytes_CheckExact(fr[3])) Py_RETURN_NONE;
            if (blen > inline_max ||
                    (PyBytes_GET_SIZE(fr[3]) == 24 && PyBytes_AS_STRING(fr[3])[2] != 0))
                heavy = 1;
        }
    }
    return Py_BuildValue("(nO)", total, heavy ? Py_True : Py_False);
}

/* ------------------------------------------------------------- window compression */

typedef struct {
    PyObject_HEAD
    PyObject *src;            /* bytes: the 1D frames (kept alive while the thread runs) */
    PyObject *dst;            /* bytes: 1W + 1C header + payload, resized by finish() */
    const unsigned char *in;
    size_t inlen;
    unsigned char *out;
    size_t outcap;
    size_t outlen;            /* payload bytes, set by the thread */
    uint32_t count;
    int level, fd, err, started, joined;
    volatile int done;
    pthread_t th;
} WindowJob;

static void put32at(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = (unsigned char)v;
}

static void *window_thread(void *arg) {
    WindowJob *j = arg;               /* no Python API in here: the GIL is never taken */
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    int rc = deflateInit(&zs, j->level);
    if (rc == Z_OK) {
        zs.next_out = j->out + 12;
        zs.avail_out = (uInt)(j->outcap - 12);
        const unsigned char *in = j->in;
        size_t left = j->inlen;
        while (rc == Z_OK && left) {                  /* compressobj.compress(): Z_NO_FLUSH */
            uInt chunk = left > 0x40000000u ? 0x40000000u : (uInt)left;
            zs.next_in = (Bytef *)in;
            zs.avail_in = chunk;
            rc = deflate(&zs, Z_NO_FLUSH);
            in += chunk - zs.avail_in;
            left -= chunk - zs.avail_in;
            if (rc == Z_BUF_ERROR) rc = Z_OK;
        }
        if (rc == Z_OK) rc = deflate(&zs, Z_FINISH);  /* compressobj.flush() */
        j->outlen = zs.total_out;
        deflateEnd(&zs);
    }
    j->err = rc == Z_STREAM_END ? 0 : (rc == Z_OK ? Z_BUF_ERROR : rc);
    if (!j->err) {
        memcpy(j->out, "1W", 2);
        put32at(j->out + 2, j->count);
        memcpy(j->out + 6, "1C", 2);
        put32at(j->out + 8, (uint32_t)j->outlen);
    }
    __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
    uint64_t one = 1;
    while (write(j->fd, &one, sizeof one) < 0 && errno == EINTR) {}
    return NULL;
}

static void job_join(WindowJob *j) {
    if (j->started && !j->joined) {
        Py_BEGIN_ALLOW_THREADS
        pthread_join(j->th, NULL);
        Py_END_ALLOW_THREADS
        j->joined = 1;
    }
}

static void job_dealloc(WindowJob *j) {
    job_join(j);                      /* an abandoned job: its thread still uses the buffers */
    Py_XDECREF(j->src);
    Py_XDECREF(j->dst);
    Py_TYPE(j)->tp_free((PyObject *)j);
}

static PyObject *job_done(WindowJob *j, PyObject *unused) {
    return PyBool_FromLong(__atomic_load_n(&j->done, __ATOMIC_ACQUIRE));
}

static PyObject *job_join_py(WindowJob *j, PyObject *unused) {
    job_join(j);
    Py_RETURN_NONE;
}

static PyObject *job_finish(WindowJob *j, PyObject *unused) {
    if (!j->dst) { PyErr_SetString(PyExc_RuntimeError, "finish() called twice"); return NULL; }
    job_join(j);
    if (j->err) return PyErr_Format(PyExc_RuntimeError, "zlib deflate failed (%d)", j->err);
    PyObject *out = j->dst;
    j->dst = NULL;
    if (_PyBytes_Resize(&out, (Py_ssize_t)(12 + j->outlen)) < 0) return NULL;
    return out;
}

static PyMethodDef job_methods[] = {
    {"done", (PyCFunction)job_done, METH_NOARGS, "whether the thread has finished"},
    {"finish", (PyCFunction)job_finish, METH_NOARGS, "finish() -> the window's bytes"},
    {"join", (PyCFunction)job_join_py, METH_NOARGS, "wait for the thread (GIL released)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WindowJobType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "logjam_relay.outputs._ljencode.WindowJob",
    .tp_basicsize = sizeof(WindowJob),
    .tp_dealloc = (destructor)job_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_methods = job_methods,
};

static PyObject *window_start(PyObject *self, PyObject *args) {
    PyObject *src;
    unsigned long count;
    int level, fd;
    if (!PyArg_ParseTuple(args, "Skii", &src, &count, &level, &fd)) return NULL;
    if (count < 1 || count > 0xFFFFFFFFul)
        return PyErr_Format(PyExc_ValueError, "window of %lu events", count);
    if (level < 1 || level > 9) return PyErr_Format(PyExc_ValueError, "zlib level %d", level);
    size_t inlen = (size_t)PyBytes_GET_SIZE(src);
    if (inlen > 0x7FFF0000u) return PyErr_Format(PyExc_ValueError, "window too large");
    WindowJob *j = PyObject_New(WindowJob, &WindowJobType);
    if (!j) return NULL;
    j->src = NULL; j->dst = NULL; j->started = j->joined = 0; j->done = 0; j->err = 0;
    j->outcap = 12 + (size_t)compressBound((uLong)inlen) + 64;
    j->dst = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)j->outcap);
    if (!j->dst) { Py_DECREF(j); return NULL; }
    Py_INCREF(src);
    j->src = src;
    j->in = (const unsigned char *)PyBytes_AS_STRING(src);
    j->inlen = inlen;
    j->out = (unsigned char *)PyBytes_AS_STRING(j->dst);
    j->outlen = 0;
    j->count = (uint32_t)count;
    j->level = level;
    j->fd = fd;
    int rc = pthread_create(&j->th, NULL, window_thread, j);
    if (rc) {
        Py_DECREF(j);
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    j->started = 1;
    return (PyObject *)j;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(records, kind_logjam, tail, cache, stream_pairs, decompress, fallback[, heartbeats])"
     " -> (bytes, n)"},
    {"encode_block", encode_block, METH_VARARGS,
     "encode_block(block, kind_logjam, tail, cache, stream_pairs, limit[, heartbeats])"
     " -> (bytes, n) or None"},
    {"scan", scan, METH_VARARGS,
     "scan(records, inline_body_max) -> (body_bytes, heavy) or None (Python decides)"},
    {"window_start", window_start, METH_VARARGS,
     "window_start(frames, count, level, eventfd) -> WindowJob (compressed window, no GIL)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ljencode", "Lumberjack event mapping in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__ljencode(void) {
    if (PyType_Ready(&WindowJobType) < 0) return NULL;
    return rb_module_create(&module, &block_type);
}

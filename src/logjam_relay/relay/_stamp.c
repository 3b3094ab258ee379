/* The relay's PULL hot loop in C: validate (fast path), stamp, build the records; and
 * the two halves of it for -x (prepare_pull, commit: compression runs in between).
 *
 * stamp_pull(batch, start, good_streams, good_topics, device, seq, now8)
 *     -> (records, seq, stop, nbytes, maxb)
 *
 * Walks batch[start:] (lists of frames as drained) while every message takes the fast
 * path of Pipeline.prepare_pull (4 frames, stream and topic already known good, a
 * 24-byte meta frame with tag CABD/BDCA and version 1) and builds, for each, the record
 * Pipeline.commit builds: (app_env, topic, body, meta) with meta = CA BD <compression>
 * 01 <device u32> <created ms, or now8 when it is zero> <sequence u64>, sequences
 * counting up from seq + 1.  Stops at the first message that is not on the fast path
 * (stop = its index, len(batch) when none): Python classifies it (Pipeline._slow) and
 * calls again after it, so the order of sequence numbers is the order of the batch.
 * Returns the last sequence used, the body bytes and the largest body of the records.
 *
 * The Python loops in stamping.py are the reference (tests/test_stamp.py compares the
 * two on random batches) and the fallback (LOGJAM_RELAY_PURE_PYTHON=1, no compiler).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_c/meta.h"         /* lj_meta_plain, lj_stamp: shared with io/_zmqfast.c */

/* 1: a message the fast paths take as is (24-byte meta frame, tag 0xcabd either byte
 * order, version 1, known stream and topic, bytes body); 0: not (the slow path decides);
 * -1: error (set lookup) */
static inline int plain_message(PyObject *a, PyObject *t, PyObject *b, PyObject *m,
                                PyObject *gs, PyObject *gt) {
    if (!PyBytes_CheckExact(m) ||
            !lj_meta_plain((const unsigned char *)PyBytes_AS_STRING(m), (size_t)PyBytes_GET_SIZE(m)))
        return 0;
    int r = PySet_Contains(gs, a);
    if (r <= 0) return r;
    r = PySet_Contains(gt, t);
    if (r <= 0) return r;
    return PyBytes_CheckExact(b) ? 1 : 0;
}

static PyObject *stamp_pull(PyObject *self, PyObject *args) {
    PyObject *batch, *gs, *gt, *now8;
    Py_ssize_t start;
    unsigned long device;
    unsigned long long seq;
    if (!PyArg_ParseTuple(args, "O!nO!O!kKS", &PyList_Type, &batch, &start, &PySet_Type, &gs,
                          &PySet_Type, &gt, &device, &seq, &now8))
        return NULL;
    if (PyBytes_GET_SIZE(now8) != 8) {
        PyErr_SetString(PyExc_ValueError, "now8 must be 8 bytes");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(batch);
    if (start < 0) start = 0;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    long long nbytes = 0;
    Py_ssize_t maxb = 0;
    const unsigned char *now = (const unsigned char *)PyBytes_AS_STRING(now8);
    Py_ssize_t i = start;
    for (; i < n; i++) {
        PyObject *frames = PyList_GET_ITEM(batch, i);
        if (!PyList_CheckExact(frames) || PyList_GET_SIZE(frames) != 4) break;
        PyObject *a = PyList_GET_ITEM(frames, 0), *t = PyList_GET_ITEM(frames, 1);
        PyObject *b = PyList_GET_ITEM(frames, 2), *m = PyList_GET_ITEM(frames, 3);
        int r = plain_message(a, t, b, m, gs, gt);
        if (r < 0) goto fail;
        if (!r) break;
        const unsigned char *mp = (const unsigned char *)PyBytes_AS_STRING(m);
        seq++;
        PyObject *meta = PyBytes_FromStringAndSize(NULL, LJ_META_LEN);
        if (!meta) goto fail;
        lj_stamp((unsigned char *)PyBytes_AS_STRING(meta), mp[2], (uint32_t)device, mp + 8,
                 now, seq);
        PyObject *rec = PyTuple_New(4);
        if (!rec) {
            Py_DECREF(meta);
            goto fail;
        }
        Py_INCREF(a); Py_INCREF(t); Py_INCREF(b);
        PyTuple_SET_ITEM(rec, 0, a);
        PyTuple_SET_ITEM(rec, 1, t);
        PyTuple_SET_ITEM(rec, 2, b);
        PyTuple_SET_ITEM(rec, 3, meta);
        if (PyList_Append(out, rec) < 0) {
            Py_DECREF(rec);
            goto fail;
        }
        Py_DECREF(rec);
        Py_ssize_t lb = PyBytes_GET_SIZE(b);
        nbytes += lb;
        if (lb > maxb) maxb = lb;
    }
    return Py_BuildValue("(NKnLn)", out, seq, i, nbytes, maxb);
fail:
    Py_DECREF(out);
    return NULL;
}

/* prepare_pull(batch, start, good_streams, good_topics[, replies, accepted])
 *     -> (acc, stop, nbytes, maxb)
 *
 * The fast path of Pipeline.prepare_pull (for -x, where compression runs between
 * prepare and commit): the same checks as stamp_pull, and for each message the tuple
 * (app_env, topic, body, compression, created_ms_8) prepare_pull makes; stops at the
 * first message off the fast path (stop = its index) for Python to classify.
 * With `replies` (a list) the batch is a ROUTER's, as Pipeline.prepare_router takes it:
 * id, app, topic, body, meta (async) or id, "", app, topic, body, meta (a request, whose
 * reply [id, app, accepted] is appended to replies). */
static PyObject *prepare_pull(PyObject *self, PyObject *args) {
    PyObject *batch, *gs, *gt, *replies = NULL, *accepted = NULL;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "O!nO!O!|O!S", &PyList_Type, &batch, &start, &PySet_Type, &gs,
                          &PySet_Type, &gt, &PyList_Type, &replies, &accepted))
        return NULL;
    if (replies && !accepted) {
        PyErr_SetString(PyExc_TypeError, "replies needs accepted");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(batch);
    if (start < 0) start = 0;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    long long nbytes = 0;
    Py_ssize_t maxb = 0;
    Py_ssize_t i = start;
    for (; i < n; i++) {
        PyObject *frames = PyList_GET_ITEM(batch, i);
        if (!PyList_CheckExact(frames)) break;
        Py_ssize_t nf = PyList_GET_SIZE(frames), base = 0;
        if (!replies) {
            if (nf != 4) break;
        } else if (nf == 5) {
            base = 1;
        } else if (nf == 6) {
            PyObject *e = PyList_GET_ITEM(frames, 1);
            if (!PyBytes_CheckExact(e) || PyBytes_GET_SIZE(e) != 0) break;
            base = 2;
        } else {
            break;
        }
        PyObject *a = PyList_GET_ITEM(frames, base), *t = PyList_GET_ITEM(frames, base + 1);
        PyObject *b = PyList_GET_ITEM(frames, base + 2), *m = PyList_GET_ITEM(frames, base + 3);
        int r = plain_message(a, t, b, m, gs, gt);
        if (r < 0) goto fail;
        if (!r) break;
        const unsigned char *mp = (const unsigned char *)PyBytes_AS_STRING(m);
        PyObject *rec = Py_BuildValue("(OOOiy#)", a, t, b, (int)mp[2], (const char *)mp + 8,
                                      (Py_ssize_t)8);
        if (!rec) goto fail;
        if (PyList_Append(out, rec) < 0) {
            Py_DECREF(rec);
            goto fail;
        }
        Py_DECREF(rec);
        if (base == 2) {
            PyObject *rep = Py_BuildValue("[OOO]", PyList_GET_ITEM(frames, 0), a, accepted);
            if (!rep || PyList_Append(replies, rep) < 0) {
                Py_XDECREF(rep);
                goto fail;
            }
            Py_DECREF(rep);
        }
        Py_ssize_t lb = PyBytes_GET_SIZE(b);
        nbytes += lb;
        if (lb > maxb) maxb = lb;
    }
    return Py_BuildValue("(NnLn)", out, i, nbytes, maxb);
fail:
    Py_DECREF(out);
    return NULL;
}

/* commit(acc, device, seq, now8) -> (records, seq) | None
 *
 * Pipeline.commit's stamp: for each (app_env, topic, body, compression, created_ms_8)
 * the record (app_env, topic, body, CA BD <compression> 01 <device u32> <created, or now8
 * when it is zero> <seq u64>), seq counting up from seq + 1.  None (nothing built) when
 * acc is not plain (a list of 5-tuples of bytes, bytes, bytes, int 0..255, 8 bytes):
 * Python's commit then gives its own result or exception. */
static PyObject *commit(PyObject *self, PyObject *args) {
    PyObject *acc, *now8;
    unsigned long device;
    unsigned long long seq;
    if (!PyArg_ParseTuple(args, "OkKS", &acc, &device, &seq, &now8)) return NULL;
    if (!PyList_CheckExact(acc) || PyBytes_GET_SIZE(now8) != 8) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(acc);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(acc, i);
        if (!PyTuple_CheckExact(x) || PyTuple_GET_SIZE(x) != 5) Py_RETURN_NONE;
        for (int k = 0; k < 3; k++)
            if (!PyBytes_CheckExact(PyTuple_GET_ITEM(x, k))) Py_RETURN_NONE;
        PyObject *comp = PyTuple_GET_ITEM(x, 3), *cr = PyTuple_GET_ITEM(x, 4);
        if (!PyLong_CheckExact(comp) || !PyBytes_CheckExact(cr) || PyBytes_GET_SIZE(cr) != 8)
            Py_RETURN_NONE;
        long c = PyLong_AsLong(comp);
        if (c < 0 || c > 255) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    if (n > 0 && (unsigned long long)n > UINT64_MAX - seq) Py_RETURN_NONE;
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    const unsigned char *now = (const unsigned char *)PyBytes_AS_STRING(now8);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(acc, i);
        PyObject *cr = PyTuple_GET_ITEM(x, 4);
        seq++;
        PyObject *meta = PyBytes_FromStringAndSize(NULL, LJ_META_LEN);
        if (!meta) goto fail;
        lj_stamp((unsigned char *)PyBytes_AS_STRING(meta),
                 (unsigned)PyLong_AsLong(PyTuple_GET_ITEM(x, 3)), (uint32_t)device,
                 (const unsigned char *)PyBytes_AS_STRING(cr), now, seq);
        PyObject *rec = PyTuple_New(4);
        if (!rec) {
            Py_DECREF(meta);
            goto fail;
        }
        for (int k = 0; k < 3; k++) {
            PyObject *f = PyTuple_GET_ITEM(x, k);
            Py_INCREF(f);
            PyTuple_SET_ITEM(rec, k, f);
        }
        PyTuple_SET_ITEM(rec, 3, meta);
        PyList_SET_ITEM(out, i, rec);
    }
    return Py_BuildValue("(NK)", out, seq);
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"prepare_pull", prepare_pull, METH_VARARGS,
     "prepare_pull(batch, start, good_streams, good_topics[, replies, accepted]) -> "
     "(acc, stop, nbytes, maxb)"},
    {"commit", commit, METH_VARARGS,
     "commit(acc, device, seq, now8) -> (records, seq), or None when acc is not plain"},
    {"stamp_pull", stamp_pull, METH_VARARGS,
     "stamp_pull(batch, start, good_streams, good_topics, device, seq, now8) -> "
     "(records, seq, stop, nbytes, maxb)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stamp", "The relay's PULL validate+stamp loop.", -1, methods,
};

PyMODINIT_FUNC PyInit__stamp(void) { return PyModule_Create(&module); }

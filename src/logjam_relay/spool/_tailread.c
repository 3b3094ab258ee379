/* An output worker's spool reads in C (spool/tail.py, output_isolation = "process").
 *
 * read(buf, pos, end, max_records, base, segno, skip, Record, Position)
 *     -> (records, pos, next_seq, status, parsed)
 *
 * Exactly tail.read_block_py: the records of buf[pos:end] parsed and CRC-checked as
 * segment.parse_records does (same checks, same order, same status: None, "partial",
 * "seal" or (reason, message, file_offset)), at most ``max_records`` of them, but given
 * back as the reader's ``Record(Position(segno, file_offset), kind, frames)`` tuples in
 * one call: no intermediate 5-tuples, no Python loop to rebuild them.  ``skip``: the
 * first parsed record is checked but not returned (a rewind to the last acknowledged
 * record).  ``pos`` is the buffer offset after the last parsed record, ``next_seq`` its
 * sequence + 1 (-1 when none was parsed), ``parsed`` how many were (returned or skipped).
 * A frame equal to the same frame of the previous record (app-env, topic: the same for
 * long runs of records) is shared, not copied; bytes objects are immutable, so sharing
 * is invisible to the reader.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "_record.h"            /* record framing check, lj_crc32, rd32/rd16 */

#define SHARED 2               /* frames 0 and 1 may be shared with the previous record */

/* Records hold only bytes, ints and each other: they cannot be part of a reference
 * cycle, so the cyclic collector need not track them (CPython itself untracks tuples
 * and dicts of atomic values).  A worker reads a few hundred thousand records a second;
 * tracked, each (Record, Position, frames list) was walked by the young collections
 * and by the older ones while its window was in flight (~5 % of the worker's CPU). */
static inline void untrack(PyObject *o) {
    if (PyObject_GC_IsTracked(o)) PyObject_GC_UnTrack(o);
}

/* a new instance of the tuple subclass ``type`` (a NamedTuple) holding ``n`` new references */
static PyObject *new_tuple(PyTypeObject *type, PyObject **items, Py_ssize_t n) {
    PyObject *t = type->tp_alloc(type, n);
    if (!t) {
        for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(items[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, items[i]);
    untrack(t);
    return t;
}

static PyObject *tail_read(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, end, max_records, base;
    PyObject *segno_obj;
    int skip;
    PyTypeObject *rec_type, *pos_type;
    if (!PyArg_ParseTuple(args, "y*nnnnO!pO!O!", &view, &pos, &end, &max_records, &base,
                          &PyLong_Type, &segno_obj, &skip, &PyType_Type, &rec_type,
                          &PyType_Type, &pos_type))
        return NULL;
    if (!PyType_IsSubtype(rec_type, &PyTuple_Type) || !PyType_IsSubtype(pos_type, &PyTuple_Type)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "Record and Position must be tuple types");
        return NULL;
    }
    const unsigned char *buf = view.buf;
    PyObject *out = PyList_New(0), *status = NULL, *result = NULL;
    PyObject *prev[SHARED] = {NULL, NULL};
    long long next_seq = -1;
    Py_ssize_t parsed = 0;
    if (!out) goto done;
    if (pos < 0) pos = 0;
    if (end > view.len) end = view.len;
    while (pos < end && parsed < max_records) {
        lj_record r;
        int rc = lj_record_check(buf, pos, end, &r);
        if (rc != LJ_REC_OK) { status = lj_record_status(rc, &r, base + pos); break; }
        unsigned kind = r.kind;
        uint32_t n = r.n;
        uint64_t seq = r.seq;
        Py_ssize_t rend = r.rend;
        const unsigned char *lens = buf + pos + 20;
        Py_ssize_t p = pos + 20 + 4 * (Py_ssize_t)n;
        if (kind == KIND_SEAL) { status = PyUnicode_FromString("seal"); break; }
        parsed++;
        next_seq = (long long)(seq + 1);
        if (skip && parsed == 1) { pos = rend; continue; }
        PyObject *frames = PyList_New(n);
        if (!frames) goto fail;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t ln = rd32(lens + 4 * i);
            PyObject *f = NULL;
            if (i < SHARED && prev[i] && PyBytes_GET_SIZE(prev[i]) == (Py_ssize_t)ln &&
                    memcmp(PyBytes_AS_STRING(prev[i]), buf + p, ln) == 0) {
                f = prev[i];
                Py_INCREF(f);
            } else {
                f = PyBytes_FromStringAndSize((const char *)buf + p, ln);
                if (!f) { Py_DECREF(frames); goto fail; }
                if (i < SHARED) { Py_XSETREF(prev[i], f); Py_INCREF(f); }
            }
            PyList_SET_ITEM(frames, i, f);
            p += ln;
        }
        untrack(frames);
        PyObject *pitems[2] = {segno_obj, PyLong_FromSsize_t(base + pos)};
        Py_INCREF(segno_obj);
        if (!pitems[1]) { Py_DECREF(segno_obj); Py_DECREF(frames); goto fail; }
        PyObject *position = new_tuple(pos_type, pitems, 2);
        if (!position) { Py_DECREF(frames); goto fail; }
        PyObject *ritems[3] = {position, PyLong_FromUnsignedLong(kind), frames};
        if (!ritems[1]) { Py_DECREF(position); Py_DECREF(frames); goto fail; }
        PyObject *rec = new_tuple(rec_type, ritems, 3);
        if (!rec) goto fail;
        if (PyList_Append(out, rec) < 0) { Py_DECREF(rec); goto fail; }
        Py_DECREF(rec);
        pos = rend;
    }
    if (!status) {
        if (PyErr_Occurred()) goto fail;
        status = Py_None;
        Py_INCREF(status);
    }
    result = Py_BuildValue("(NnLNn)", out, pos, next_seq, status, parsed);
    out = NULL;
    goto done;
fail:
    Py_XDECREF(status);
done:
    Py_XDECREF(out);
    Py_XDECREF(prev[0]);
    Py_XDECREF(prev[1]);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"read", tail_read, METH_VARARGS,
     "read(buf, pos, end, max_records, base, segno, skip, Record, Position) -> "
     "(records, pos, next_seq, status, parsed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tailread", "An output worker's spool reads in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__tailread(void) { return PyModule_Create(&module); }

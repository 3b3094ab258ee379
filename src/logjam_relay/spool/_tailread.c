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

#include "_crc32.h"             /* lj_crc32: zlib's CRC-32, folded with PCLMULQDQ on x86-64 */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "little-endian hosts only (the pure-Python reader is used elsewhere)"
#endif

#define HEADER_MIN 20          /* PREFIX (8) + RECHEAD (12): a record with no frames */
#define MAX_BODY (1u << 30)
#define KIND_SEAL 255
#define SHARED 2               /* frames 0 and 1 may be shared with the previous record */

static inline uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint16_t rd16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

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
        if (end - pos < HEADER_MIN) { status = PyUnicode_FromString("partial"); break; }
        uint32_t body_len = rd32(buf + pos), crc = rd32(buf + pos + 4);
        unsigned kind = buf[pos + 8];
        uint32_t n = rd16(buf + pos + 10);
        uint64_t seq;
        memcpy(&seq, buf + pos + 12, 8);
        if (body_len < 12 + 4 * n || body_len > MAX_BODY) {
            status = Py_BuildValue("(sNn)", "bad_length",
                                   PyUnicode_FromFormat("bad record length %u", body_len),
                                   base + pos);
            break;
        }
        Py_ssize_t rend = pos + 8 + (Py_ssize_t)body_len;
        if (rend > end) { status = PyUnicode_FromString("partial"); break; }
        if (lj_crc32(buf + pos + 8, body_len) != crc) {
            status = Py_BuildValue("(s, s, n)", "crc", "record CRC mismatch", base + pos);
            break;
        }
        const unsigned char *lens = buf + pos + 20;
        Py_ssize_t p = pos + 20 + 4 * (Py_ssize_t)n, total = 0;
        for (uint32_t i = 0; i < n; i++) total += rd32(lens + 4 * i);
        if (p + total != rend) {
            status = Py_BuildValue("(s, s, n)", "frame_lengths", "frame lengths do not add up",
                                   base + pos);
            break;
        }
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

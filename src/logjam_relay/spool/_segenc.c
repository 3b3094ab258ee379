/* The spool's write side in C: encode_logjam_batch (spool/segment.py) without a Python
 * object per record.
 *
 * encode_logjam_batch(batch, first_seq) -> bytes | None
 *
 * Same bytes as segment.encode_logjam_batch_py: for each message (app_env, topic, body,
 * meta) one record
 *
 *     u32 body_len, u32 crc32(body), u8 kind 0, u8 flags 0, u16 4, u64 seq,
 *     u32 len(app_env), u32 len(topic), u32 len(body), u32 len(meta), the four frames
 *
 * (little-endian, seq counting up from first_seq), all records in one bytes object, the
 * CRC zlib's crc32 (the value zlib.crc32 gives; _c/crc32.h: PCLMULQDQ where the CPU has
 * it).  The encoding itself is _c/record_crc.h's lj_record4_put, which the relay's ingest
 * pass (io/_zmqfast.c) uses too.  Returns None, without raising, when the batch
 * is anything but the plain shape: not a list, an item that is not a tuple or list of
 * exactly 4 bytes objects, first_seq not in 0..2^64-1 (or the last seq past it), a frame
 * or record too long for its u32 field.  The caller then runs the Python encoder, which
 * gives the same bytes or the same exception, so malformed input behaves exactly as it
 * does without this module (tests/test_segenc.py compares the two, fuzzed).
 *
 * The records are filled (memcpy + crc32) with the GIL released: the frames are bytes
 * objects (immutable) kept alive by references taken before.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "../_c/record_crc.h"   /* the record's encoding (lj_record4_put), lj_crc32 */

/* crc32(data) -> int: the checksum the encoders use (for the tests: zlib.crc32's value) */
static PyObject *crc(PyObject *self, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    uint32_t c;
    Py_BEGIN_ALLOW_THREADS
    c = lj_crc32(view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *batch, *first;
    if (!PyArg_ParseTuple(args, "OO", &batch, &first)) return NULL;
    if (!PyList_CheckExact(batch) || !PyLong_CheckExact(first)) Py_RETURN_NONE;
    unsigned long long seq0 = PyLong_AsUnsignedLongLong(first);
    if (seq0 == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();              /* negative or too large: Python says what */
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(batch);
    if (n > 0 && (unsigned long long)(n - 1) > UINT64_MAX - seq0) Py_RETURN_NONE;
    /* first pass: shape and size; the frames, referenced, into one array */
    PyObject **fr = PyMem_Malloc(sizeof(PyObject *) * 4 * (size_t)(n ? n : 1));
    if (!fr) return PyErr_NoMemory();
    Py_ssize_t taken = 0;
    size_t total = 0;
    int plain = 1;
    for (Py_ssize_t i = 0; i < n && plain; i++) {
        PyObject *rec = PyList_GET_ITEM(batch, i);
        PyObject **items;
        if (PyTuple_CheckExact(rec) && PyTuple_GET_SIZE(rec) == 4)
            items = &PyTuple_GET_ITEM(rec, 0);
        else if (PyList_CheckExact(rec) && PyList_GET_SIZE(rec) == 4)
            items = ((PyListObject *)rec)->ob_item;
        else
            items = NULL;
        if (!items) {
            plain = 0;
            break;
        }
        size_t body = lj_record4_body(0, 0, 0, 0);
        for (int k = 0; k < 4; k++) {
            PyObject *f = items[k];
            if (!PyBytes_CheckExact(f) || (size_t)PyBytes_GET_SIZE(f) > UINT32_MAX) {
                plain = 0;
                break;
            }
            body += (size_t)PyBytes_GET_SIZE(f);
        }
        if (!plain) break;
        if (body > UINT32_MAX) {
            plain = 0;
            break;
        }
        for (int k = 0; k < 4; k++) {
            Py_INCREF(items[k]);
            fr[taken++] = items[k];
        }
        total += LJ_PREFIX + body;
        if (total > (size_t)PY_SSIZE_T_MAX) plain = 0;
    }
    PyObject *out = NULL;
    if (plain) out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out) {
        unsigned char *o = (unsigned char *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        uint64_t seq = seq0;
        for (Py_ssize_t i = 0; i < taken; i += 4, seq++) {
            PyObject **f = fr + i;
#define FRAME(k) PyBytes_AS_STRING(f[k]), (uint32_t)PyBytes_GET_SIZE(f[k])
            o = lj_record4_put(o, seq, FRAME(0), FRAME(1), FRAME(2), FRAME(3));
#undef FRAME
        }
        Py_END_ALLOW_THREADS
    }
    for (Py_ssize_t i = 0; i < taken; i++) Py_DECREF(fr[i]);
    PyMem_Free(fr);
    if (!plain) Py_RETURN_NONE;
    return out;                     /* NULL: MemoryError set */
}

static PyMethodDef methods[] = {
    {"encode_logjam_batch", encode, METH_VARARGS,
     "encode_logjam_batch(batch, first_seq) -> bytes, or None when the batch is not plain "
     "(list of 4-tuples/lists of bytes): then use the Python encoder"},
    {"crc32", crc, METH_VARARGS, "crc32(data) -> the records' CRC (zlib.crc32's value)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_segenc", "The spool's logjam record encoder.", -1, methods,
};

PyMODINIT_FUNC PyInit__segenc(void) { return PyModule_Create(&module); }

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
 *
 * read_into(block, buf, pos, end, max_records, base, segno, skip)
 *     -> (added, pos, next_seq, status, parsed)
 *
 * The same parse and checks, but the records are appended to ``block`` (a RecordBlock,
 * see _recblock.h): an index entry each, no Python object per record.  A ``bytes`` buffer
 * is kept by the block, the records stay where they are; any other buffer (mutable) is
 * copied, once for all the records of the call.  ``added`` is how many were appended;
 * the rest as read().
 *
 * RecordBlock(Record, Position): an empty block; to Python a read-only sequence of
 * ``Record(Position(segno, offset), kind, frames)`` (built on access, equal to the ones
 * read() gives; a slice is a list), equal to a list of the same records; ``+`` with a
 * list or a block gives a list.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

#include "_walk.h"              /* the readers' walk (and ../_c/record_crc.h: the checks) */
#include "_recblock.h"          /* RecordBlock: the records as one buffer plus an index */

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

typedef struct {
    PyObject *out, *segno;
    PyTypeObject *rec_type, *pos_type;
    Py_ssize_t base;
    PyObject *prev[LJ_SHARED];  /* the previous record's first frames (lj_frame_list) */
} read_ctx;

static int read_visit(void *ctx, const unsigned char *buf, Py_ssize_t pos, const lj_record *r) {
    read_ctx *c = ctx;
    PyObject *frames = lj_frame_list(buf + pos, r, c->prev);
    if (!frames) return -1;
    untrack(frames);
    PyObject *pitems[2] = {c->segno, PyLong_FromSsize_t(c->base + pos)};
    Py_INCREF(c->segno);
    if (!pitems[1]) { Py_DECREF(c->segno); Py_DECREF(frames); return -1; }
    PyObject *position = new_tuple(c->pos_type, pitems, 2);
    if (!position) { Py_DECREF(frames); return -1; }
    PyObject *ritems[3] = {position, PyLong_FromUnsignedLong(r->kind), frames};
    if (!ritems[1]) { Py_DECREF(position); Py_DECREF(frames); return -1; }
    PyObject *rec = new_tuple(c->rec_type, ritems, 3);
    if (!rec) return -1;
    if (PyList_Append(c->out, rec) < 0) { Py_DECREF(rec); return -1; }
    Py_DECREF(rec);
    return 0;
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
    PyObject *result = NULL;
    read_ctx c = {PyList_New(0), segno_obj, rec_type, pos_type, base, {NULL, NULL}};
    lj_walk w = {pos < 0 ? 0 : pos, 0, -1, NULL};
    if (end > view.len) end = view.len;
    if (c.out && lj_walk_records(view.buf, end, base, max_records, skip, &w, read_visit, &c) == 0) {
        if (!w.status) { w.status = Py_None; Py_INCREF(w.status); }
        result = Py_BuildValue("(OnLNn)", c.out, w.pos, w.next_seq, w.status, w.parsed);
    }
    Py_XDECREF(c.out);
    Py_XDECREF(c.prev[0]);
    Py_XDECREF(c.prev[1]);
    PyBuffer_Release(&view);
    return result;
}


/* ------------------------------------------------------------------- RecordBlock */

static PyTypeObject RecordBlockType;

static void block_dealloc(RecordBlock *b) {
    for (Py_ssize_t k = 0; k < b->nown; k++) Py_DECREF(b->owners[k]);
    PyMem_Free(b->owners);
    PyMem_Free(b->recs);
    Py_XDECREF(b->rec_type);
    Py_XDECREF(b->pos_type);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *block_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyTypeObject *rec_type, *pos_type;
    if (kw && PyDict_GET_SIZE(kw)) {
        PyErr_SetString(PyExc_TypeError, "RecordBlock() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &rec_type, &PyType_Type, &pos_type))
        return NULL;
    if (!PyType_IsSubtype(rec_type, &PyTuple_Type) || !PyType_IsSubtype(pos_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "Record and Position must be tuple types");
        return NULL;
    }
    RecordBlock *b = (RecordBlock *)type->tp_alloc(type, 0);
    if (!b) return NULL;
    b->recs = NULL; b->n = b->cap = 0;
    b->owners = NULL; b->nown = b->capown = 0;
    b->nbytes = 0;
    Py_INCREF(rec_type); b->rec_type = (PyObject *)rec_type;
    Py_INCREF(pos_type); b->pos_type = (PyObject *)pos_type;
    return (PyObject *)b;
}

static Py_ssize_t block_len(RecordBlock *b) { return b->n; }

/* record i as Record(Position(segno, offset), kind, [frames]) (0 <= i < n) */
static PyObject *block_record(RecordBlock *b, Py_ssize_t i) {
    const unsigned char *r = b->recs[i].p;
    lj_record rec;
    lj_record_fields(r, &rec);      /* checked when it was read */
    PyObject *frames = lj_frame_list(r, &rec, NULL);
    if (!frames) return NULL;
    untrack(frames);
    PyObject *pitems[2] = {PyLong_FromLongLong(b->recs[i].segno),
                           PyLong_FromLongLong(b->recs[i].offset)};
    if (!pitems[0] || !pitems[1]) {
        Py_XDECREF(pitems[0]); Py_XDECREF(pitems[1]); Py_DECREF(frames);
        return NULL;
    }
    PyObject *position = new_tuple((PyTypeObject *)b->pos_type, pitems, 2);
    if (!position) { Py_DECREF(frames); return NULL; }
    PyObject *ritems[3] = {position, PyLong_FromUnsignedLong(r[8]), frames};
    if (!ritems[1]) { Py_DECREF(position); Py_DECREF(frames); return NULL; }
    return new_tuple((PyTypeObject *)b->rec_type, ritems, 3);
}

static PyObject *block_item(RecordBlock *b, Py_ssize_t i) {
    if (i < 0 || i >= b->n) {
        PyErr_SetString(PyExc_IndexError, "RecordBlock index out of range");
        return NULL;
    }
    return block_record(b, i);
}

static PyObject *block_list(RecordBlock *b, Py_ssize_t start, Py_ssize_t step, Py_ssize_t len) {
    PyObject *out = PyList_New(len);
    if (!out) return NULL;
    for (Py_ssize_t k = 0, i = start; k < len; k++, i += step) {
        PyObject *r = block_record(b, i);
        if (!r) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, k, r);
    }
    return out;
}

static PyObject *block_subscript(RecordBlock *b, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0) i += b->n;
        return block_item(b, i);
    }
    if (PySlice_Check(key)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(key, &start, &stop, &step) < 0) return NULL;
        Py_ssize_t len = PySlice_AdjustIndices(b->n, &start, &stop, step);
        return block_list(b, start, step, len);
    }
    return PyErr_Format(PyExc_TypeError, "RecordBlock indices must be integers or slices, "
                        "not %.200s", Py_TYPE(key)->tp_name);
}

static PyObject *block_tolist(RecordBlock *b, PyObject *unused) {
    return block_list(b, 0, 1, b->n);
}

static PyObject *block_richcompare(PyObject *a, PyObject *o, int op) {
    if (op != Py_EQ && op != Py_NE) Py_RETURN_NOTIMPLEMENTED;
    PyObject *la = NULL, *lo = NULL, *res = NULL;
    la = PyObject_TypeCheck(a, &RecordBlockType) ? block_tolist((RecordBlock *)a, NULL) : (Py_INCREF(a), a);
    if (!la) return NULL;
    lo = PyObject_TypeCheck(o, &RecordBlockType) ? block_tolist((RecordBlock *)o, NULL) : (Py_INCREF(o), o);
    if (!lo) { Py_DECREF(la); return NULL; }
    if (PyList_Check(la) && PyList_Check(lo)) res = PyObject_RichCompare(la, lo, op);
    else { res = Py_NotImplemented; Py_INCREF(res); }
    Py_DECREF(la); Py_DECREF(lo);
    return res;
}

/* block + list, list + block, block + block: a list (as for two lists) */
static PyObject *block_add(PyObject *a, PyObject *o) {
    PyObject *la, *lo, *res;
    if (PyObject_TypeCheck(a, &RecordBlockType)) la = block_tolist((RecordBlock *)a, NULL);
    else if (PyList_Check(a)) { la = a; Py_INCREF(la); }
    else Py_RETURN_NOTIMPLEMENTED;
    if (!la) return NULL;
    if (PyObject_TypeCheck(o, &RecordBlockType)) lo = block_tolist((RecordBlock *)o, NULL);
    else if (PyList_Check(o)) { lo = o; Py_INCREF(lo); }
    else { Py_DECREF(la); Py_RETURN_NOTIMPLEMENTED; }
    if (!lo) { Py_DECREF(la); return NULL; }
    res = PySequence_Concat(la, lo);
    Py_DECREF(la); Py_DECREF(lo);
    return res;
}

static PyNumberMethods block_as_number = {
    .nb_add = block_add,
};

static PyObject *block_repr(RecordBlock *b) {
    return PyUnicode_FromFormat("<RecordBlock of %zd records, %zd bytes>", b->n, b->nbytes);
}

static PyObject *block_nbytes(RecordBlock *b, void *unused) {
    return PyLong_FromSsize_t(b->nbytes);
}

static PyMethodDef block_methods[] = {
    {"tolist", (PyCFunction)block_tolist, METH_NOARGS, "the records as a list"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef block_getset[] = {
    {"nbytes", (getter)block_nbytes, NULL, "bytes of the records (framing included)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods block_as_sequence = {
    .sq_length = (lenfunc)block_len,
    .sq_item = (ssizeargfunc)block_item,
};

static PyMappingMethods block_as_mapping = {
    .mp_length = (lenfunc)block_len,
    .mp_subscript = (binaryfunc)block_subscript,
};

static PyTypeObject RecordBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "logjam_relay.spool._tailread.RecordBlock",
    .tp_basicsize = sizeof(RecordBlock),
    .tp_dealloc = (destructor)block_dealloc,
    .tp_repr = (reprfunc)block_repr,
    .tp_as_number = &block_as_number,
    .tp_as_sequence = &block_as_sequence,
    .tp_as_mapping = &block_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_SEQUENCE,
    .tp_doc = "RecordBlock(Record, Position): spool records as one buffer (read-only sequence)",
    .tp_richcompare = block_richcompare,
    .tp_methods = block_methods,
    .tp_getset = block_getset,
    .tp_new = block_new,
};

static int block_grow(RecordBlock *b, Py_ssize_t recs) {
    if (b->n + recs > b->cap) {
        Py_ssize_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + recs) nc *= 2;
        rb_rec *p = PyMem_Realloc(b->recs, (size_t)nc * sizeof(rb_rec));
        if (!p) { PyErr_NoMemory(); return -1; }
        b->recs = p;
        b->cap = nc;
    }
    return 0;
}

/* keep ``o`` (a new reference, stolen) alive as long as the block */
static int block_own(RecordBlock *b, PyObject *o) {
    if (b->nown == b->capown) {
        Py_ssize_t nc = b->capown ? b->capown * 2 : 4;
        PyObject **p = PyMem_Realloc(b->owners, (size_t)nc * sizeof(PyObject *));
        if (!p) { Py_DECREF(o); PyErr_NoMemory(); return -1; }
        b->owners = p;
        b->capown = nc;
    }
    b->owners[b->nown++] = o;
    return 0;
}

typedef struct {
    RecordBlock *blk;
    int64_t segno, base;
    Py_ssize_t first;           /* buffer offset of the first record appended, -1: none yet */
} into_ctx;

static int into_visit(void *ctx, const unsigned char *buf, Py_ssize_t pos, const lj_record *r) {
    into_ctx *c = ctx;
    if (c->first < 0) c->first = pos;
    if (block_grow(c->blk, 1) < 0) return -1;
    rb_rec *e = &c->blk->recs[c->blk->n++];
    e->segno = c->segno;
    e->offset = c->base + pos;
    e->p = buf + pos;
    return 0;
}

static PyObject *tail_read_into(PyObject *self, PyObject *args) {
    RecordBlock *blk;
    PyObject *bufobj;
    Py_buffer view;
    Py_ssize_t pos, end, max_records, base;
    long long segno;
    int skip;
    if (!PyArg_ParseTuple(args, "O!OnnnnLp", &RecordBlockType, &blk, &bufobj, &pos, &end,
                          &max_records, &base, &segno, &skip))
        return NULL;
    if (PyObject_GetBuffer(bufobj, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *buf = view.buf;
    PyObject *result = NULL;
    const Py_ssize_t n0 = blk->n;
    into_ctx c = {blk, segno, base, -1};
    lj_walk w = {pos < 0 ? 0 : pos, 0, -1, NULL};
    if (end > view.len) end = view.len;
    /* check the records and index them (pointers into buf for now) */
    if (lj_walk_records(buf, end, base, max_records, skip, &w, into_visit, &c) < 0) goto fail;
    Py_ssize_t added = blk->n - n0;
    if (added) {
        Py_ssize_t bytes = w.pos - c.first;
        if (PyBytes_CheckExact(bufobj)) {
            /* immutable: the records stay in it */
            if (!(blk->nown && blk->owners[blk->nown - 1] == bufobj)) {
                Py_INCREF(bufobj);
                if (block_own(blk, bufobj) < 0) goto fail;
            }
        } else {
            /* a buffer that may change (a reused chunk): the records are copied */
            PyObject *copy = PyBytes_FromStringAndSize((const char *)buf + c.first, bytes);
            if (!copy || block_own(blk, copy) < 0) goto fail;
            const unsigned char *at = (const unsigned char *)PyBytes_AS_STRING(copy) - c.first;
            for (Py_ssize_t k = n0; k < blk->n; k++)
                blk->recs[k].p = at + (blk->recs[k].p - buf);
        }
        blk->nbytes += bytes;
    }
    if (!w.status) {
        w.status = Py_None;
        Py_INCREF(w.status);
    }
    result = Py_BuildValue("(nnLNn)", added, w.pos, w.next_seq, w.status, w.parsed);
    PyBuffer_Release(&view);
    return result;
fail:
    blk->n = n0;                    /* nothing appended */
    Py_XDECREF(w.status);
    PyBuffer_Release(&view);
    return NULL;
}

static rb_api block_api = {&RecordBlockType};

static PyMethodDef methods[] = {
    {"read", tail_read, METH_VARARGS,
     "read(buf, pos, end, max_records, base, segno, skip, Record, Position) -> "
     "(records, pos, next_seq, status, parsed)"},
    {"read_into", tail_read_into, METH_VARARGS,
     "read_into(block, buf, pos, end, max_records, base, segno, skip) -> "
     "(added, pos, next_seq, status, parsed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tailread", "An output worker's spool reads in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__tailread(void) {
    if (PyType_Ready(&RecordBlockType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "RecordBlock", (PyObject *)&RecordBlockType) < 0) goto fail;
    PyObject *cap = PyCapsule_New(&block_api, RB_CAPSULE, NULL);
    if (!cap) goto fail;
    if (PyModule_AddObject(m, "_RECBLOCK_API", cap) < 0) { Py_DECREF(cap); goto fail; }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

/* A block of spool records as one buffer plus an index (spool/_tailread.c RecordBlock).
 *
 * An output worker's reads (spool/tail.py SegmentTail.read) hand the outputs a
 * RecordBlock: per record its segment, file offset and where its bytes are, in the
 * segment chunk it was read from (a bytes object the block keeps alive: no copy), or in
 * a copy the block owns when the chunk was a mutable buffer.  To Python it is a read-only
 * sequence of ``Record(Position(segno, offset), kind, frames)`` built on access (a slice
 * is a list of them); the C mappings (_ljencode.encode_block/scan, _courierenc.events)
 * read the frames straight from the buffer, so the common path builds no Python object
 * per record (the per-record Record, Position, list and bytes objects, and freeing them,
 * were ~25 % of a worker's CPU: list_dealloc, tupledealloc, _PyObject_Malloc in perf).
 *
 * The consumers find the type through the capsule ``RB_CAPSULE`` (rb_import()); without
 * _tailread there are no blocks, and they never see one.
 */
#ifndef LOGJAM_RELAY_RECBLOCK_H
#define LOGJAM_RELAY_RECBLOCK_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../_c/record.h"       /* the record's layout: rd32, rd16, HEADER_MIN */

#define RB_CAPSULE "logjam_relay.spool._tailread._RECBLOCK_API"
#define RB_MAX_FRAMES 8             /* rb_frames() looks at no more frames than this */

typedef struct {
    int64_t segno, offset;          /* the record's spool position */
    const unsigned char *p;         /* its prefix, framed as in the segment file */
} rb_rec;

typedef struct {
    PyObject_HEAD
    rb_rec *recs;
    Py_ssize_t n, cap;
    PyObject **owners;              /* the bytes objects the records are in */
    Py_ssize_t nown, capown;
    Py_ssize_t nbytes;              /* the records' bytes (framing included) */
    PyObject *rec_type, *pos_type;  /* Record, Position (tuple subclasses) */
} RecordBlock;

typedef struct {
    PyTypeObject *type;             /* RecordBlock */
} rb_api;

/* One record's header and frames (pointers into the block's buffer; they live as long
 * as the block).  ``nf`` is the record's frame count; at most RB_MAX_FRAMES are filled. */
typedef struct {
    unsigned kind;
    uint32_t nf;
    const unsigned char *f[RB_MAX_FRAMES];
    Py_ssize_t len[RB_MAX_FRAMES];
} rb_view;

/* the frames of record ``i`` (0 <= i < n): the framing was checked when it was read */
static inline void rb_frames(const RecordBlock *b, Py_ssize_t i, rb_view *v) {
    const unsigned char *r = b->recs[i].p;
    v->kind = r[8];
    v->nf = rd16(r + 10);
    const unsigned char *lens = r + HEADER_MIN, *p = lens + 4 * (Py_ssize_t)v->nf;
    uint32_t k = v->nf < RB_MAX_FRAMES ? v->nf : RB_MAX_FRAMES;
    for (uint32_t j = 0; j < k; j++) {
        uint32_t ln = rd32(lens + 4 * j);
        v->f[j] = p;
        v->len[j] = (Py_ssize_t)ln;
        p += ln;
    }
}

/* The RecordBlock type, or NULL (no _tailread: no blocks exist).  Never raises.  (Not
 * PyCapsule_Import: before 3.12 it imports only the top package and then looks up the
 * submodules as attributes, which fails until something else imported them.) */
static inline PyTypeObject *rb_import(void) {
    PyObject *m = PyImport_ImportModule("logjam_relay.spool._tailread");
    PyObject *cap = m ? PyObject_GetAttrString(m, "_RECBLOCK_API") : NULL;
    rb_api *api = cap ? (rb_api *)PyCapsule_GetPointer(cap, RB_CAPSULE) : NULL;
    Py_XDECREF(cap);
    Py_XDECREF(m);
    if (!api) {
        PyErr_Clear();
        return NULL;
    }
    return api->type;
}

/* A consumer's module, created with ``BLOCKS`` (True when RecordBlocks are mapped from
 * their buffer: the tests check it) and the RecordBlock type in *type (or NULL). */
static inline PyObject *rb_module_create(PyModuleDef *def, PyTypeObject **type) {
    *type = rb_import();
    PyObject *m = PyModule_Create(def);
    if (m && PyModule_AddObjectRef(m, "BLOCKS", *type ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#endif

/* The spool readers' record walk in C, the one copy for spool/_segscan.c parse_records
 * (the spool reader's parser, segment.parse_records) and spool/_tailread.c read and
 * read_into (an output worker's reads, tail.read_block): the records of buf[pos:end)
 * checked one by one (_c/record.h), each data record handed to the caller's ``visit``,
 * the walk's end told as the Python reference (segment.parse_records_py) tells it.
 * tests/test_segscan.py and tests/test_tailread.py compare both users with it.
 *
 * (_segscan.c's scan and scan_meta, the Spark data source's and the loss table's walks,
 * take the same checks from _c/record.h in another order and with other statuses: they
 * pass over records of other kinds and end at the seal, as pipeline/datasource.py does.)
 */
#ifndef LOGJAM_RELAY_SPOOL_WALK_H
#define LOGJAM_RELAY_SPOOL_WALK_H

#include <Python.h>

#include "../_c/record_crc.h"   /* the record: layout, checks, lj_crc32 */

/* The Python status of a failed check at file offset ``at``: "partial" or
 * (reason, message, offset); NULL with an exception set when it cannot be built. */
static PyObject *lj_record_status(int code, const lj_record *r, Py_ssize_t at) {
    switch (code) {
    case LJ_REC_BAD_LENGTH:
        return Py_BuildValue("(sNn)", "bad_length",
                             PyUnicode_FromFormat("bad record length %u", r->body_len), at);
    case LJ_REC_CRC:
        return Py_BuildValue("(s, s, n)", "crc", "record CRC mismatch", at);
    case LJ_REC_FRAME_LENGTHS:
        return Py_BuildValue("(s, s, n)", "frame_lengths", "frame lengths do not add up", at);
    default:
        return PyUnicode_FromString("partial");
    }
}

#define LJ_SHARED 2             /* lj_frame_list: frames 0 and 1 (app-env, topic) may be shared */

/* The frames of the checked record at h as a new list of bytes objects, or NULL with an
 * exception set.  With ``prev`` (LJ_SHARED slots, NULL or a reference each, kept by the
 * caller): a frame 0 or 1 equal to the one in its slot is that object again, not a copy
 * (the same for long runs of records; bytes are immutable, so sharing is invisible), and
 * a new one takes the slot. */
static inline PyObject *lj_frame_list(const unsigned char *h, const lj_record *r, PyObject **prev) {
    PyObject *frames = PyList_New(r->n);
    if (!frames) return NULL;
    lj_frames it = lj_frames_of(h, r);
    while (lj_frame_next(&it)) {
        uint32_t i = it.i - 1;
        PyObject *f, *p = prev && i < LJ_SHARED ? prev[i] : NULL;
        if (p && PyBytes_GET_SIZE(p) == (Py_ssize_t)it.len &&
                memcmp(PyBytes_AS_STRING(p), it.data, it.len) == 0) {
            f = p;
            Py_INCREF(f);
        } else {
            f = PyBytes_FromStringAndSize((const char *)it.data, it.len);
            if (!f) { Py_DECREF(frames); return NULL; }
            if (prev && i < LJ_SHARED) { Py_XSETREF(prev[i], f); Py_INCREF(f); }
        }
        PyList_SET_ITEM(frames, i, f);
    }
    return frames;
}

typedef struct {
    Py_ssize_t pos;             /* in: where the walk starts in buf; out: past the last record parsed */
    Py_ssize_t parsed;          /* records parsed: visited, or passed over by ``skip`` */
    long long next_seq;         /* the last parsed record's seq + 1; -1 when none was */
    PyObject *status;           /* NULL (end or max_records reached), else a new reference:
                                 * "seal", "partial" or (reason, message, file offset) */
} lj_walk;

/* visit(ctx, buf, pos, &r): the data record at buf[pos:pos + r.size), checked; 0, or -1
 * with an exception set (the walk stops, the record is not counted as visited past) */
typedef int (*lj_visit)(void *ctx, const unsigned char *buf, Py_ssize_t pos, const lj_record *r);

/* Walk buf[w->pos:end) (buf[0] is at file offset ``base``): at most max_records records,
 * the first of them checked but not visited when ``skip``; a seal record or a failed
 * check ends the walk with its status.  0, or -1 with an exception set (w->status then
 * NULL).  Inlined where it is used, so ``visit`` (a constant there) is inlined too. */
static inline __attribute__((always_inline)) int
lj_walk_records(const unsigned char *buf, Py_ssize_t end, Py_ssize_t base,
                Py_ssize_t max_records, int skip, lj_walk *w, lj_visit visit, void *ctx) {
    Py_ssize_t pos = w->pos;
    while (pos < end && w->parsed < max_records) {
        lj_record r;
        int rc = lj_record_check(buf + pos, (uint64_t)(end - pos), &r);
        if (rc != LJ_REC_OK || r.kind == KIND_SEAL) {
            w->status = rc != LJ_REC_OK ? lj_record_status(rc, &r, base + pos)
                                        : PyUnicode_FromString("seal");
            w->pos = pos;
            return w->status ? 0 : -1;
        }
        w->parsed++;
        w->next_seq = (long long)(r.seq + 1);
        if (!(skip && w->parsed == 1) && visit(ctx, buf, pos, &r) < 0) {
            w->pos = pos;
            return -1;
        }
        pos += (Py_ssize_t)r.size;
    }
    w->pos = pos;
    return 0;
}

#endif

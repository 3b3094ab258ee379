/* The spool's record framing, shared by the C readers (_segscan.c parse_records, the
 * spool reader's parser, and _tailread.c, the output workers' reader): constants, the
 * little-endian field reads, and the check of one record's prefix, CRC and frame lengths
 * (docs/spool-format.md).  Header-only: each extension includes its own copy. */
#ifndef LOGJAM_RELAY_RECORD_H
#define LOGJAM_RELAY_RECORD_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_crc32.h"             /* lj_crc32: zlib's CRC-32, folded with PCLMULQDQ on x86-64 */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "little-endian hosts only (the pure-Python reader is used elsewhere)"
#endif

#define HEADER_MIN 20          /* PREFIX (8) + RECHEAD (12): a record with no frames */
#define MAX_BODY (1u << 30)
#define KIND_SEAL 255

static inline uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint16_t rd16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

enum { LJ_REC_OK, LJ_REC_PARTIAL, LJ_REC_BAD_LENGTH, LJ_REC_CRC, LJ_REC_FRAME_LENGTHS };

typedef struct {
    uint32_t body_len, n;       /* body length, frame count */
    unsigned kind;
    uint64_t seq;
    Py_ssize_t rend;            /* offset just past the record */
} lj_record;

/* Check the record at buf[pos:end): LJ_REC_OK (and *r filled) or why it is not one. */
static int lj_record_check(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end,
                           lj_record *r) {
    if (end - pos < HEADER_MIN) return LJ_REC_PARTIAL;
    uint32_t body_len = rd32(buf + pos), crc = rd32(buf + pos + 4);
    r->body_len = body_len;
    r->kind = buf[pos + 8];
    r->n = rd16(buf + pos + 10);
    memcpy(&r->seq, buf + pos + 12, 8);
    if (body_len < 12 + 4 * r->n || body_len > MAX_BODY) return LJ_REC_BAD_LENGTH;
    r->rend = pos + 8 + (Py_ssize_t)body_len;
    if (r->rend > end) return LJ_REC_PARTIAL;
    if (lj_crc32(buf + pos + 8, body_len) != crc) return LJ_REC_CRC;
    const unsigned char *lens = buf + pos + 20;
    Py_ssize_t total = 0;
    for (uint32_t i = 0; i < r->n; i++) total += rd32(lens + 4 * i);
    if (pos + 20 + 4 * (Py_ssize_t)r->n + total != r->rend) return LJ_REC_FRAME_LENGTHS;
    return LJ_REC_OK;
}

/* The Python status of a failed check at file offset ``at``: "partial" or
 * (reason, message, offset). */
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

/* One step of a reader's walk: 1 with *r filled for a data record at buf[pos:end); 0 at
 * the end of what can be read, with *status set: "seal", "partial" or (reason, message,
 * offset) -- ``base`` is the file offset of buf[0]. */
static inline int lj_record_next(const unsigned char *buf, Py_ssize_t pos, Py_ssize_t end,
                                 Py_ssize_t base, lj_record *r, PyObject **status) {
    int rc = lj_record_check(buf, pos, end, r);
    if (rc != LJ_REC_OK) {
        *status = lj_record_status(rc, r, base + pos);
        return 0;
    }
    if (r->kind == KIND_SEAL) {
        *status = PyUnicode_FromString("seal");
        return 0;
    }
    return 1;
}

#endif

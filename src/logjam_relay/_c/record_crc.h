/* What the spool record needs its checksum for, in C: the encoding of a logjam record
 * and the checks of a record read back (record.h has the layout).  Users: spool/_segenc.c
 * and io/_zmqfast.c (the encoding), spool/_walk.h and spool/_segscan.c (the checks).
 */
#ifndef LOGJAM_RELAY_C_RECORD_CRC_H
#define LOGJAM_RELAY_C_RECORD_CRC_H

#include "crc32.h"              /* lj_crc32: zlib's CRC-32, folded with PCLMULQDQ on x86-64 */
#include "record.h"

/* ------------------------------------------------------------------ encoding */

/* body_len of a logjam record (kind 0, 4 frames) with these frame lengths: 28 + their
 * sum, as a size_t (the caller checks it against UINT32_MAX) */
static inline size_t lj_record4_body(size_t l0, size_t l1, size_t l2, size_t l3) {
    return (LJ_HEAD4 - LJ_PREFIX) + l0 + l1 + l2 + l3;
}

/* Write the logjam record of the frames f0..f3 (l0..l3 bytes) with spool sequence ``seq``
 * at r, CRC included; r has room for LJ_PREFIX + lj_record4_body(l0, l1, l2, l3) bytes,
 * and that body is at most UINT32_MAX (the caller checked).  Returns the record's end.
 * (Scalars: inlined into the encoders' loops, they stay in registers.) */
static inline unsigned char *lj_record4_put(unsigned char *r, uint64_t seq,
                                            const void *f0, uint32_t l0,
                                            const void *f1, uint32_t l1,
                                            const void *f2, uint32_t l2,
                                            const void *f3, uint32_t l3) {
    size_t body = lj_record4_body(l0, l1, l2, l3);
    lj_put32(r, (uint32_t)body);
    r[8] = KIND_LOGJAM; r[9] = 0; r[10] = 4; r[11] = 0;      /* kind, flags, n (u16) */
    lj_put64(r + 12, seq);
    lj_put32(r + 20, l0); lj_put32(r + 24, l1); lj_put32(r + 28, l2); lj_put32(r + 32, l3);
    unsigned char *p = r + LJ_HEAD4;
    memcpy(p, f0, l0); p += l0;
    memcpy(p, f1, l1); p += l1;
    memcpy(p, f2, l2); p += l2;
    memcpy(p, f3, l3); p += l3;
    lj_put32(r + 4, lj_crc32(r + LJ_PREFIX, body));
    return p;
}

/* ------------------------------------------------------------------ checks */

/* the body of the whole record at h (r->size bytes there) has the CRC of its prefix */
static inline int lj_record_crc_ok(const unsigned char *h, const lj_record *r) {
    return lj_crc32(h + LJ_PREFIX, r->body_len) == r->crc;
}

/* The record at h, ``avail`` bytes readable from h: its header (LJ_REC_PARTIAL when
 * avail holds no header or not the whole record), then its CRC.  The frame lengths are
 * the next check (lj_record_frames_ok): a reader that passes over records of other kinds
 * checks them only on the records whose frames it reads. */
static inline int lj_record_head(const unsigned char *h, uint64_t avail, lj_record *r) {
    if (avail < HEADER_MIN) return LJ_REC_PARTIAL;
    int rc = lj_record_fields(h, r);
    if (rc != LJ_REC_OK) return rc;
    if (r->size > avail) return LJ_REC_PARTIAL;
    return lj_record_crc_ok(h, r) ? LJ_REC_OK : LJ_REC_CRC;
}

/* lj_record_head, then the frame lengths: LJ_REC_OK for a whole, sound record of any kind */
static inline int lj_record_check(const unsigned char *h, uint64_t avail, lj_record *r) {
    int rc = lj_record_head(h, avail, r);
    if (rc != LJ_REC_OK) return rc;
    return lj_record_frames_ok(h, r) ? LJ_REC_OK : LJ_REC_FRAME_LENGTHS;
}

#endif

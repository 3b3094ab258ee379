/* The spool's record, in C: its layout and the reading of a record's fields and frames
 * (docs/spool-format.md, "Record"); record_crc.h adds what needs the checksum, the
 * encoding and the checks.  The one copy for every C file: the encoders (spool/_segenc.c
 * encode_logjam_batch, the ingest pass of io/_zmqfast.c), the readers (spool/_segscan.c,
 * spool/_tailread.c, through spool/_walk.h) and a worker's RecordBlock (spool/_recblock.h,
 * read by outputs/_ljencode.c and _courierenc.c, which link no zlib: this file needs none).
 *
 *     u32 body_len, u32 crc32(body), u8 kind, u8 flags 0, u16 n, u64 seq,
 *     u32 len[n], the n frames                  (little-endian; the body: from kind on)
 *
 * Header-only and static inline: each extension compiles its own copy, inlined into the
 * loops that call it.  No Python here: _c/ is the lowest floor (docs/architecture.md,
 * "Layers"); what these give back as Python objects is said by the file that includes
 * them.  The Python twin is spool/segment.py (encode_logjam_batch_py, parse_records_py):
 * tests/test_segenc.py, test_ingestpass.py, test_segscan.py, test_tailread.py and
 * test_recblock.py compare every C user with it, byte for byte.
 */
#ifndef LOGJAM_RELAY_C_RECORD_H
#define LOGJAM_RELAY_C_RECORD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "little-endian hosts only (the pure-Python code is used elsewhere)"
#endif

#define LJ_PREFIX 8             /* body_len, crc */
#define HEADER_MIN 20           /* LJ_PREFIX + kind, flags, n, seq: a record without frames */
#define LJ_HEAD4 36             /* HEADER_MIN + 4 lengths: where a logjam record's frames start */
#define MAX_BODY (1u << 30)
#define KIND_LOGJAM 0
#define KIND_SEAL 255

static inline uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint16_t rd16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* little-endian stores (the host is, above): one move each; written byte by byte, four
 * of them side by side became ~60 shifts and ors in the encoders' loops (gcc -O2) */
static inline void lj_put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void lj_put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

/* ------------------------------------------------------------------ reading */

enum { LJ_REC_OK, LJ_REC_PARTIAL, LJ_REC_BAD_LENGTH, LJ_REC_CRC, LJ_REC_FRAME_LENGTHS };

typedef struct {
    uint32_t body_len, crc, n;  /* body length, the CRC the prefix gives, frame count */
    unsigned kind;
    uint64_t seq;
    uint64_t size;              /* LJ_PREFIX + body_len: the whole record */
} lj_record;

/* The fields of the record header at h (HEADER_MIN bytes there): LJ_REC_OK, or
 * LJ_REC_BAD_LENGTH when body_len cannot hold the frame lengths or is over MAX_BODY. */
static inline int lj_record_fields(const unsigned char *h, lj_record *r) {
    r->body_len = rd32(h);
    r->crc = rd32(h + 4);
    r->kind = h[8];
    r->n = rd16(h + 10);
    memcpy(&r->seq, h + 12, 8);
    r->size = LJ_PREFIX + (uint64_t)r->body_len;
    if (r->body_len < 12 + 4 * r->n || r->body_len > MAX_BODY) return LJ_REC_BAD_LENGTH;
    return LJ_REC_OK;
}

/* the frame lengths of the whole record at h add up to its body_len */
static inline int lj_record_frames_ok(const unsigned char *h, const lj_record *r) {
    const unsigned char *lens = h + HEADER_MIN;
    uint64_t total = 0;
    for (uint32_t i = 0; i < r->n; i++) total += rd32(lens + 4 * i);
    return HEADER_MIN + 4 * (uint64_t)r->n + total == r->size;
}

/* The frames of a checked record, in order:
 *
 *     lj_frames it = lj_frames_of(h, &r);
 *     while (lj_frame_next(&it)) use(it.data, it.len);     (frame it.i - 1)
 */
typedef struct {
    const unsigned char *lens;  /* the frame lengths */
    const unsigned char *data;  /* the current frame (after lj_frame_next) */
    uint32_t i, n, len;         /* frames passed, frame count, the current frame's length */
} lj_frames;

static inline lj_frames lj_frames_of(const unsigned char *h, const lj_record *r) {
    lj_frames it = {h + HEADER_MIN, h + HEADER_MIN + 4 * (size_t)r->n, 0, r->n, 0};
    return it;
}

static inline int lj_frame_next(lj_frames *it) {
    if (it->i == it->n) return 0;
    it->data += it->len;
    it->len = rd32(it->lens + 4 * (size_t)it->i++);
    return 1;
}

#endif

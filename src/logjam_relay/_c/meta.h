/* The logjam meta frame, in C: the check the fast paths make and the stamp the relay
 * writes (protocols/logjam.py has the format; relay/stamping.py the Python twin).  The
 * one copy for relay/_stamp.c (stamp_pull, prepare_pull, commit), the ingest pass of
 * io/_zmqfast.c and the meta reads of spool/_segscan.c.
 *
 *     u16 tag 0xCABD, u8 compression, u8 version 1, u32 device, u64 created_ms, u64 sequence
 *
 * (big-endian; a tag that arrives as BD CA is taken and written back as CA BD).
 * tests/test_stamp.py and tests/test_ingestpass.py compare the C users with the Python
 * steps; tests/test_segscan.py the meta reads.  Header-only, static inline, no Python
 * (_c/ is the lowest floor, docs/architecture.md).
 */
#ifndef LOGJAM_RELAY_C_META_H
#define LOGJAM_RELAY_C_META_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define LJ_META_LEN 24

/* 1: a meta frame the fast paths take as is (24 bytes, tag CA BD either byte order,
 * version 1); 0: not (the slow path, or the reader, decides what it is) */
static inline int lj_meta_plain(const unsigned char *m, size_t len) {
    return len == LJ_META_LEN && m[3] == 1 &&
           ((m[0] == 0xca && m[1] == 0xbd) || (m[0] == 0xbd && m[1] == 0xca));
}

/* Pipeline.commit's stamp into o (24 bytes): CA BD <compression> 01 <device u32>
 * <created, or now when created is zero> <seq u64>; ``created`` and ``now`` are the 8
 * big-endian bytes of a time in ms. */
static inline void lj_stamp(unsigned char *o, unsigned compression, uint32_t device,
                            const unsigned char *created, const unsigned char *now,
                            uint64_t seq) {
    static const unsigned char zero8[8] = {0};
    o[0] = 0xca; o[1] = 0xbd; o[2] = (unsigned char)compression; o[3] = 1;
    o[4] = (unsigned char)(device >> 24); o[5] = (unsigned char)(device >> 16);
    o[6] = (unsigned char)(device >> 8); o[7] = (unsigned char)device;
    memcpy(o + 8, memcmp(created, zero8, 8) == 0 ? now : created, 8);
    for (int k = 0; k < 8; k++) o[16 + k] = (unsigned char)(seq >> (56 - 8 * k));
}

static inline uint64_t lj_meta_be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

/* the fields of a plain meta frame */
static inline uint32_t lj_meta_device(const unsigned char *m) {
    return ((uint32_t)m[4] << 24) | ((uint32_t)m[5] << 16) | ((uint32_t)m[6] << 8) | m[7];
}
static inline uint64_t lj_meta_created(const unsigned char *m) { return lj_meta_be64(m + 8); }
static inline uint64_t lj_meta_sequence(const unsigned char *m) { return lj_meta_be64(m + 16); }

#endif

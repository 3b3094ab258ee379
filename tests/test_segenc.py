"""The spool's C record encoder (spool/_segenc.c) against encode_logjam_batch_py.

Same bytes (record layout, sequence numbers, CRC32) for ordinary batches, and for
anything malformed the same result or the same exception as the Python encoder: the C
encoder declines what is not a plain list of 4-tuples/lists of bytes and the Python one
runs.  Fuzzed with random shapes and values.
"""

import os
import random
import struct
import zlib

import pytest

from conftest import require_native
from logjam_relay.spool import segment as fmt


def meta(seq: int) -> bytes:
    return struct.pack(">HBBIQQ", 0xCABD, 0, 1, 7, 1_700_000_000_000, seq)


def outcome(fn, batch, first_seq):
    try:
        return ("ok", fn(batch, first_seq))
    except Exception as e:          # the type and message must match
        return ("raise", type(e), str(e))


def both(batch, first_seq):
    require_native(fmt._encode_c, "logjam_relay.spool._segenc")
    ref = outcome(fmt.encode_logjam_batch_py, batch, first_seq)
    got = outcome(fmt._encode_logjam_batch, batch, first_seq)
    assert got == ref, (batch[:3] if isinstance(batch, list) else batch, first_seq)
    return ref


def test_encoder_in_use():
    require_native(fmt._encode_c, "logjam_relay.spool._segenc")
    assert fmt.encode_logjam_batch is fmt._encode_logjam_batch


@pytest.mark.parametrize("seed", range(6))
def test_same_bytes_and_crc_on_ordinary_batches(seed):
    rnd = random.Random(seed)
    for _ in range(20):
        n = rnd.randint(0, 400)
        batch = []
        for i in range(n):
            rec = (bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 40))),
                   b"logs.x" * rnd.randint(0, 3), rnd.randbytes(rnd.randint(0, 3000)), meta(i))
            batch.append(rec if rnd.random() < 0.7 else list(rec))
        first = rnd.choice((0, 1, rnd.getrandbits(40), (1 << 64) - 1 - n))
        kind, data = both(batch, first)
        assert kind == "ok"
        # every record parses back, its CRC (zlib.crc32 of the body) checked
        recs, pos, status = fmt.parse_records(data, 0, len(data), 1 << 30)
        assert status is None and pos == len(data)
        assert [r[3] for r in recs] == [list(m) for m in batch]
        assert [r[2] for r in recs] == list(range(first, first + n))
        if recs:
            blen, crc = fmt.PREFIX.unpack_from(data, 0)
            assert crc == zlib.crc32(data[8:8 + blen])


def test_large_frames():
    big = [(b"a" * 70_000, b"t", b"\x00" * 1_000_000, meta(1)), (b"", b"", b"", b"")]
    assert both(big, 3)[0] == "ok"


MALFORMED = [
    ([(b"a", b"t", b"b")], 0),                              # 3 frames
    ([(b"a", b"t", b"b", b"m", b"x")], 0),                  # 5 frames
    ([[b"a", b"t", "str", b"m"]], 0),                       # not bytes
    ([(b"a", b"t", bytearray(b"b"), b"m")], 0),             # bytes-like: Python takes it
    ([(b"a", b"t", memoryview(b"body"), b"m")], 0),
    ([(b"a", b"t", None, b"m")], 0),
    ([None], 0),
    ([b"abcd"], 0),                                         # a bytes object of 4
    (((b"a", b"t", b"b", b"m"),), 0),                       # a tuple batch
    ([(b"a", b"t", b"b", b"m")], -1),                       # seq out of range
    ([(b"a", b"t", b"b", b"m")], 1 << 64),
    ([(b"a", b"t", b"b", b"m")] * 2, (1 << 64) - 1),        # the second seq overflows
    ([(b"a", b"t", b"b", b"m")], (1 << 64) - 1),            # the last one that fits
    ([(b"a", b"t", b"b", b"m")], True),
    ([(b"a", b"t", b"b", b"m")], 2.0),
    ([(b"a", b"t", b"b", b"m")], "1"),
    ([], -5),
    ([], None),
]


@pytest.mark.parametrize("batch,first", MALFORMED)
def test_malformed_same_as_python(batch, first):
    both(batch, first)


def test_generator_batch():
    recs = [(b"a", b"t", b"b", meta(1))] * 3
    require_native(fmt._encode_c, "logjam_relay.spool._segenc")
    assert fmt._encode_logjam_batch(iter(recs), 0) == fmt.encode_logjam_batch_py(recs, 0)


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_random_shapes(seed):
    rnd = random.Random(1000 + seed)
    values = [b"", b"x", b"abc" * 50, "s", None, 3, bytearray(b"q"), (b"a",), [b"a"]]
    for _ in range(300):
        batch = []
        for _ in range(rnd.randint(0, 6)):
            r = rnd.random()
            if r < 0.6:
                rec = [rnd.choice(values[:3]) for _ in range(4)]
                if rnd.random() < 0.3:
                    rec[rnd.randrange(4)] = rnd.choice(values)
            elif r < 0.8:
                rec = [rnd.choice(values) for _ in range(rnd.randint(0, 6))]
            else:
                rec = rnd.choice(values)
            batch.append(tuple(rec) if isinstance(rec, list) and rnd.random() < 0.5 else rec)
        both(batch, rnd.choice((0, 5, -1, (1 << 64) - 2, 1 << 70)))


def test_crc32_is_zlibs_at_every_length_and_alignment():
    """_c/crc32.h (PCLMULQDQ folding where the CPU has it, zlib's crc32 otherwise) gives
    zlib.crc32's value: lengths 0..2100 (the folding starts at 64 bytes, in 64- and
    16-byte steps, with a zlib tail), every alignment of a 16-byte vector, and 1 MiB."""
    segenc = require_native(fmt._segenc, "logjam_relay.spool._segenc")
    rnd = random.Random(5)
    data = rnd.randbytes(2200)
    for n in range(2100):
        off = n % 16
        chunk = data[off:off + n]
        assert segenc.crc32(chunk) == zlib.crc32(chunk), n
    for fill in (b"\x00", b"\xff"):
        assert segenc.crc32(fill * 4096) == zlib.crc32(fill * 4096)
    big = rnd.randbytes(1 << 20)
    assert segenc.crc32(big) == zlib.crc32(big)
    assert segenc.crc32(memoryview(big)[3:-5]) == zlib.crc32(memoryview(big)[3:-5])


def test_append_encoded_refuses_records_numbered_from_another_seq(tmp_path):
    """Spool.append_encoded takes records the relay's C pass encoded from a spool seq that
    the part in front of the spool gave (relay/batchpath.py); if the spool moved on since
    (something else appended), that part numbered them wrong: refused, nothing appended,
    never renumbered (one part numbers the sequence).  Numbered right, they go in gapless."""
    from spool_helpers import drain, msg, open_spool
    sp = open_spool(tmp_path / "s", readers=["a"])
    first = [msg(i) for i in range(3)]
    sp.append_batch(first)
    later = [msg(i) for i in range(3, 8)]
    stale = fmt.encode_logjam_batch(later, sp.next_seq)       # numbered now...
    hb = msg(99)
    sp.append_batch([hb])                                     # ...then the spool moves on
    with pytest.raises(ValueError, match="numbered from 3"):
        sp.append_encoded(stale, len(later), 3, later[-1][3])
    assert sp.next_seq == 4
    data = fmt.encode_logjam_batch(later, sp.next_seq)
    sp.append_encoded(data, len(later), sp.next_seq, later[-1][3])
    recs = drain(sp.reader("a"))
    assert [r.frames for r in recs] == first + [hb] + later
    seqs = []
    for name in sorted(os.listdir(tmp_path / "s")):
        if fmt.parse_segment_name(name):
            buf = (tmp_path / "s" / name).read_bytes()
            seqs += [r[2] for r in fmt.parse_records(buf, fmt.HEADER_LEN, len(buf), 1 << 20)[0]]
    assert seqs == list(range(len(recs)))                     # gapless, in order
    assert sp.last_meta() is not None and sp._last_meta == later[-1][3]
    sp.close()

"""The C reads of an output worker (spool/_tailread.c) give exactly the records, positions,
statuses and counts of the Python reference (tail.read_block_py over
segment.parse_records_py), on ordinary, malformed, truncated and random input."""

import random

import pytest

from conftest import require_native
from logjam_relay.spool import segment as fmt
from logjam_relay.spool import tail
from logjam_relay.spool.api import Position, Record


def _c(buf, pos, end, n, base, segno, skip):
    require_native(tail._tailread, "logjam_relay.spool._tailread")
    return tail._read_block_c(buf, pos, end, n, base, segno, skip)


def _py(buf, pos, end, n, base, segno, skip):
    return tail.read_block_py(buf, pos, end, n, base, segno, skip, parse=fmt.parse_records_py)


def _norm(res):
    recs, pos, next_seq, status, parsed = res
    if isinstance(status, fmt.SegmentCorrupt):
        status = ("corrupt", status.reason, str(status), status.offset)
    for r in recs:
        assert type(r) is Record and type(r.position) is Position
        assert all(type(f) is bytes for f in r.frames) and type(r.frames) is list
    return [(tuple(r.position), r.kind, r.frames) for r in recs], pos, next_seq, status, parsed


def same(buf, pos, end, n, base=0, segno=7, skip=False):
    """C == Python for ``end`` within the buffer (the callers' contract); past it, the C
    reads stop at the buffer's end (checked against the Python reads up to there)."""
    if end > len(buf):
        assert _norm(_c(buf, pos, end, n, base, segno, skip)) == same(buf, pos, len(buf), n,
                                                                      base, segno, skip)
    a = _norm(_c(buf, pos, end, n, base, segno, skip))
    b = _norm(_py(buf, pos, min(end, len(buf)), n, base, segno, skip))
    assert a == b
    return a


META = bytes.fromhex("cabd0001") + bytes(20)


def _records(n, seed=1):
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.random()
        if k < 0.7:      # ordinary logjam messages, runs of the same app-env and topic
            out.append((0, [b"shop-prod" if i % 50 < 40 else b"other-env", b"logs.x",
                            rnd.randbytes(rnd.randrange(0, 400)), META]))
        elif k < 0.8:
            out.append((1, [b"b1", b"120", b"publish"]))
        elif k < 0.9:
            out.append((0, [rnd.randbytes(rnd.randrange(0, 5)) for _ in range(rnd.randrange(0, 7))]))
        else:
            out.append((0, [b"", b"", b"", b""]))
    return out


@pytest.fixture(scope="module")
def data():
    recs = _records(600)
    return fmt.encode_records(recs, first_seq=1000) + fmt.encode_seal(1600, 600, 0, 0), recs


def test_ordinary_records_and_slices(data):
    buf, recs = data
    got, pos, next_seq, status, parsed = same(buf, 0, len(buf), 10_000, base=40, segno=3)
    assert status == "seal" and parsed == len(recs) == len(got)
    assert next_seq == 1600
    assert [(k, f) for _, k, f in got] == [(k, list(f)) for k, f in recs]
    assert got[0][0] == (3, 40)
    # every start/end/max/skip combination over a prefix of the buffer
    ends = [0]
    p = 0
    for _ in range(40):
        p += fmt.PREFIX.unpack_from(buf, p)[0] + fmt.PREFIX_LEN
        ends.append(p)
    for i in range(0, 40, 3):
        for e in (ends[i] + 1, ends[min(i + 5, 40)], ends[min(i + 5, 40)] - 1, len(buf)):
            for n in (0, 1, 2, 7, 1000):
                for skip in (False, True):
                    same(buf, ends[i], e, n, skip=skip)


def test_skip_passes_over_the_first_record(data):
    buf, _ = data
    a = same(buf, 0, len(buf), 3)
    b = same(buf, 0, len(buf), 3, skip=True)
    assert b[0] == a[0][1:] and b[4] == 3 and b[1] == a[1] and b[2] == a[2]
    one = same(buf, 0, len(buf), 1, skip=True)
    assert one[0] == [] and one[4] == 1 and one[1] > 0


def test_malformed_records(data):
    buf, _ = data
    first_end = fmt.PREFIX.unpack_from(buf, 0)[0] + fmt.PREFIX_LEN
    bad_crc = bytearray(buf)
    bad_crc[first_end + 30] ^= 0xFF
    assert same(bytes(bad_crc), 0, len(buf), 100)[3][1] == "crc"
    bad_len = bytearray(buf)
    bad_len[first_end:first_end + 4] = (3).to_bytes(4, "little")
    assert same(bytes(bad_len), 0, len(buf), 100)[3][1] == "bad_length"
    huge = bytearray(buf)
    huge[first_end:first_end + 4] = (0xFFFFFFFF).to_bytes(4, "little")
    assert same(bytes(huge), 0, len(buf), 100)[3][1] == "bad_length"
    # frame lengths that do not add up, with a valid CRC
    body = fmt.RECHEAD.pack(0, 0, 2, 5) + (3).to_bytes(4, "little") + (9).to_bytes(4, "little") + b"abcdef"
    rec = fmt.PREFIX.pack(len(body), fmt.crc32(body)) + body
    assert same(rec + buf, 0, len(rec) + len(buf), 100, base=100)[3][1] == "frame_lengths"
    # a frame count whose length table does not fit the body
    body = fmt.RECHEAD.pack(0, 0, 60000, 5)
    rec = fmt.PREFIX.pack(len(body), fmt.crc32(body)) + body
    assert same(rec, 0, len(rec), 10)[3][1] == "bad_length"


def test_truncated_and_offsets(data):
    buf, _ = data
    for cut in range(0, 700, 7):
        same(buf[:cut], 0, len(buf), 1000)
        same(buf, 0, cut, 1000, skip=True)
    same(buf, len(buf) + 10, len(buf) + 20, 5)
    same(buf, 0, len(buf) * 2, 5)
    same(b"", 0, 0, 5)


def test_random_input_never_crashes(data):
    buf, _ = data
    rnd = random.Random(14)
    for _ in range(400):
        b = bytearray(buf[:rnd.randrange(0, 3000)])
        for _ in range(rnd.randrange(0, 6)):
            if b:
                b[rnd.randrange(len(b))] = rnd.randrange(256)
        same(bytes(b), rnd.randrange(0, 40), rnd.randrange(0, 3100), rnd.randrange(0, 30),
             skip=rnd.random() < 0.3)
        junk = rnd.randbytes(rnd.randrange(0, 200))
        same(junk, 0, len(junk), 50)


def test_bad_arguments_raise():
    mod = require_native(tail._tailread, "logjam_relay.spool._tailread")
    with pytest.raises(TypeError):
        mod.read(b"", 0, 0, 1, 0, 1, False, int, Position)
    with pytest.raises(TypeError):
        mod.read("text", 0, 0, 1, 0, 1, False, Record, Position)


def test_segment_tail_reads_records_larger_than_its_chunk(tmp_path):
    """Records larger than the worker's read chunk (and small ones around them), read a
    few at a time: the chunk buffer the C reads reuse grows for them, and every record
    comes back whole and in order, its frames bytes that outlive the buffer's reuse."""
    from logjam_relay.spool.spool import Spool
    from logjam_relay.spool.tail import SegmentTail, snapshot
    sp = Spool(tmp_path / "sp", readers=["t"], segment_bytes=64 << 20, fsync="never")
    sizes = [10, 3_000_000, 5, 1_500_000, 7, 7, 2_100_000] + [100] * 50
    bodies = [bytes([65 + i % 26]) * n for i, n in enumerate(sizes)]
    for b in bodies:
        sp.append_records([(0, [b"app", b"topic", b, b"m" * 24])])
    r = sp.reader("t")
    tail = SegmentTail("t", r._ack_pos, r._ack_seq, lambda p, known: None, lambda *d: None)
    tail.CHUNK = 64 * 1024
    tail.update(snapshot(sp.ledger, 0))
    got = []
    while recs := tail.read(3):
        got += recs
    assert [rec.frames[2] for rec in got] == bodies
    assert all(type(f) is bytes for rec in got for f in rec.frames)
    assert tail.reports == 0
    sp.close()

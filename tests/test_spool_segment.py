"""The spool segment format: encoding, fast reader, scanner, torn/corrupt detection."""

import io
import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import require_native
from logjam_relay.spool import segment as fmt
from logjam_relay.spool.api import KIND_LOGJAM, KIND_SAMWISE


def meta(seq: int) -> bytes:
    return struct.pack(">HBBIQQ", 0xCABD, 1, 1, 7, 1_700_000_000_000 + seq, seq)


def msg(i: int, size: int = 300) -> list[bytes]:
    return [b"myapp-production", b"logs.web", bytes([i % 251]) * size, meta(i)]


def write_segment(path, batch, *, segno=3, first_seq=10, sealed=False, created_ms=1234):
    data = fmt.encode_header(segno, created_ms, first_seq) + fmt.encode_logjam_batch(batch,
                                                                                    first_seq)
    if sealed:
        data += fmt.encode_seal(first_seq + len(batch), len(batch), len(data), 99)
    path.write_bytes(data)
    return data


def record_offsets(data: bytes) -> list[int]:
    offs, pos = [], fmt.HEADER_LEN
    while pos < len(data):
        offs.append(pos)
        pos += fmt.PREFIX_LEN + fmt.PREFIX.unpack_from(data, pos)[0]
    return offs


def test_header_round_trip_and_validation():
    h = fmt.encode_header(42, 1_700_000_000_123, 777)
    assert len(h) == fmt.HEADER_LEN == 40
    got = fmt.decode_header(h)
    assert (got.segno, got.created_ms, got.first_seq, got.version) == (42, 1_700_000_000_123,
                                                                       777, 1)
    with pytest.raises(fmt.SegmentTruncated):
        fmt.decode_header(h[:39])
    with pytest.raises(fmt.SegmentCorrupt) as e:
        fmt.decode_header(b"X" + h[1:])
    assert e.value.reason == "bad_magic"
    bad = bytearray(h)
    bad[25] ^= 1
    with pytest.raises(fmt.SegmentCorrupt) as e:
        fmt.decode_header(bytes(bad))
    assert e.value.reason == "header_crc"


def test_names():
    assert fmt.segment_name(42, False) == "00000000000000000042.open"
    assert fmt.segment_name(42, True) == "00000000000000000042.seg"
    assert fmt.parse_segment_name("00000000000000000042.seg") == (42, True)
    assert fmt.parse_segment_name("00000000000000000042.open") == (42, False)
    assert fmt.parse_segment_name("42.seg") is None
    assert fmt.parse_segment_name("00000000000000000042.seg.tmp") is None


def test_logjam_batch_round_trip(tmp_path):
    batch = [msg(i) for i in range(50)]
    data = write_segment(tmp_path / "s", batch)
    got = list(fmt.iter_records(tmp_path / "s"))
    assert [f for _, _, f in got] == batch
    assert all(k == KIND_LOGJAM for _, k, _ in got)
    assert [o for o, _, _ in got] == record_offsets(data)
    # record layout: 8-byte prefix + 12-byte head + 4 lengths + frames
    assert fmt.PREFIX.unpack_from(data, fmt.HEADER_LEN)[0] == 12 + 16 + sum(map(len, batch[0]))
    # generic encoder produces identical bytes for 4-frame logjam records
    assert fmt.encode_records([(KIND_LOGJAM, m) for m in batch], 10) == \
        fmt.encode_logjam_batch(batch, 10)


def test_generic_records_any_frames(tmp_path):
    recs = [(KIND_SAMWISE, []), (KIND_SAMWISE, [b""]), (KIND_LOGJAM, [b"a", b"", b"c"]),
            (KIND_SAMWISE, [bytes([i]) * i for i in range(9)]), (7, [b"x" * 100_000])]
    path = tmp_path / "g"
    path.write_bytes(fmt.encode_header(0, 0, 0) + fmt.encode_records(recs, 0))
    assert [(k, f) for _, k, f in fmt.iter_records(path)] == [(k, list(f)) for k, f in recs]
    with pytest.raises(ValueError):
        fmt.encode_records([(255, [b"x"])], 0)


def test_parse_records_reports_seq_and_end():
    batch = [msg(i) for i in range(5)]
    buf = fmt.encode_logjam_batch(batch, 100)
    recs, pos, status = fmt.parse_records(buf, 0, len(buf), 3, 1000)
    assert len(recs) == 3 and status is None
    assert [r[2] for r in recs] == [100, 101, 102]
    assert recs[0][0] == 1000 and recs[0][4] == recs[1][0]
    assert pos == recs[2][4] - 1000
    recs2, pos2, status2 = fmt.parse_records(buf, pos, len(buf), 10, 1000)
    assert [r[2] for r in recs2] == [103, 104] and pos2 == len(buf) and status2 is None


def test_iter_records_start_offset_and_file_object(tmp_path):
    batch = [msg(i) for i in range(20)]
    data = write_segment(tmp_path / "s", batch)
    offs = record_offsets(data)
    got = list(fmt.iter_records(tmp_path / "s", offs[7]))
    assert [f for _, _, f in got] == batch[7:]
    got = list(fmt.iter_records(io.BytesIO(data)))
    assert [f for _, _, f in got] == batch


def test_small_chunks_and_records_larger_than_chunk(tmp_path):
    batch = [msg(i, size=(i * 997) % 5000) for i in range(40)]
    write_segment(tmp_path / "s", batch, sealed=True)
    for chunk in (64, 100, 1000, 4096):
        assert [f for _, _, f in fmt.iter_records(tmp_path / "s", chunk=chunk)] == batch
        res = fmt.scan_segment(tmp_path / "s", chunk=chunk)
        assert res.sealed and res.records == 40 and res.error is None


def test_sealed_segment(tmp_path):
    batch = [msg(i) for i in range(10)]
    data = write_segment(tmp_path / "s", batch, sealed=True)
    assert [f for _, _, f in fmt.iter_records(tmp_path / "s")] == batch   # stops at the seal
    count, data_end, sealed_ms = fmt.read_seal(tmp_path / "s")
    assert (count, data_end + fmt.SEAL_RECORD_LEN, sealed_ms) == (10, len(data), 99)
    res = fmt.scan_segment(tmp_path / "s")
    assert res.sealed and res.records == 10 and res.next_seq == 20 and res.cut_bytes == 0
    assert res.valid_end == data_end
    assert res.last_logjam_meta == meta(9)
    # an unsealed segment is not sealed
    write_segment(tmp_path / "o", batch)
    assert fmt.read_seal(tmp_path / "o") is None
    assert not fmt.scan_segment(tmp_path / "o").sealed


def test_torn_tail_at_every_byte_of_last_record(tmp_path):
    batch = [msg(i, size=40) for i in range(4)]
    data = write_segment(tmp_path / "full", batch)
    last = record_offsets(data)[-1]
    p = tmp_path / "cut"
    for cut in range(last + 1, len(data)):
        p.write_bytes(data[:cut])
        res = fmt.scan_segment(p)
        assert (res.valid_end, res.records, res.cut_bytes, res.sealed) == (last, 3, cut - last,
                                                                           False), cut
        assert res.error is not None
        with pytest.raises(fmt.SegmentTruncated):
            list(fmt.iter_records(p))
        assert [f for _, _, f in fmt.iter_records(p, allow_torn_tail=True)] == batch[:3]
    p.write_bytes(data[:last])
    res = fmt.scan_segment(p)
    assert (res.valid_end, res.records, res.cut_bytes, res.error) == (last, 3, 0, None)


def test_every_corrupted_byte_of_a_middle_record_is_detected(tmp_path):
    batch = [msg(i, size=30) for i in range(5)]
    data = write_segment(tmp_path / "full", batch)
    offs = record_offsets(data)
    p = tmp_path / "bad"
    for i in range(offs[2], offs[3]):
        bad = bytearray(data)
        bad[i] ^= 0x40
        p.write_bytes(bytes(bad))
        res = fmt.scan_segment(p)
        assert res.valid_end == offs[2] and res.records == 2 and not res.sealed, i
        assert res.cut_bytes == len(data) - offs[2]
        got = []
        with pytest.raises(fmt.SegmentError):
            for _off, _, frames in fmt.iter_records(p):
                got.append(frames)
        assert got == batch[:2]           # records after the corrupt one are never yielded


def test_zero_filled_tail_is_cut(tmp_path):
    batch = [msg(i) for i in range(3)]
    data = write_segment(tmp_path / "s", batch)
    (tmp_path / "s").write_bytes(data + b"\0" * 4096)
    res = fmt.scan_segment(tmp_path / "s")
    assert res.valid_end == len(data) and res.records == 3 and res.cut_bytes == 4096
    assert res.error == "bad_length"


def test_bad_header_segment_scan(tmp_path):
    (tmp_path / "s").write_bytes(b"garbage" * 10)
    res = fmt.scan_segment(tmp_path / "s")
    assert res.header is None and res.error == "bad_magic" and res.records == 0
    (tmp_path / "t").write_bytes(fmt.encode_header(0, 0, 0)[:20])
    res = fmt.scan_segment(tmp_path / "t")
    assert res.header is None and res.error == "short_header"


def test_data_after_seal_is_not_a_valid_seal(tmp_path):
    batch = [msg(i) for i in range(3)]
    data = write_segment(tmp_path / "s", batch, sealed=True)
    (tmp_path / "s").write_bytes(data + fmt.encode_logjam_batch([msg(9)], 13))
    res = fmt.scan_segment(tmp_path / "s")
    assert not res.sealed and res.error == "bad_seal" and res.records == 3
    assert fmt.read_seal(tmp_path / "s") is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([KIND_LOGJAM, KIND_SAMWISE]),
                          st.lists(st.binary(max_size=64), max_size=6)), max_size=30))
def test_round_trip_property(records):
    data = fmt.encode_header(1, 2, 3) + fmt.encode_records(records, 3)
    got = [(k, f) for _, k, f in fmt.iter_records(io.BytesIO(data), chunk=97)]
    assert got == [(k, list(f)) for k, f in records]
    res_records, _, status = fmt.parse_records(data, fmt.HEADER_LEN, len(data), 1 << 30)
    assert status is None and [r[2] for r in res_records] == list(range(3, 3 + len(records)))


def test_reader_does_not_slurp_file(tmp_path):
    """iter_records reads in chunks: memory bounded by the chunk, not the file."""
    import tracemalloc
    batch = [msg(i, size=1000) for i in range(3000)]     # ~3 MB
    write_segment(tmp_path / "s", batch)
    del batch
    tracemalloc.start()
    try:
        n = 0
        for _ in fmt.iter_records(tmp_path / "s", chunk=256 * 1024):
            n += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 3000
    assert peak < 1_500_000, peak
    assert os.path.getsize(tmp_path / "s") > 3_000_000


# ----------------------------------------------- the C record walk (spool/_segscan.c)

def _c_parse_or_skip():
    require_native(fmt._parse_records_c, "logjam_relay.spool._segscan")
    return fmt._parse_records


def _same(a, b):
    (ra, pa_, sa), (rb, pb, sb) = a, b
    assert ra == rb and pa_ == pb
    if isinstance(sa, fmt.SegmentCorrupt) or isinstance(sb, fmt.SegmentCorrupt):
        assert type(sa) is type(sb)
        assert (sa.reason, sa.offset, str(sa)) == (sb.reason, sb.offset, str(sb))
    else:
        assert sa == sb


def _mixed_segment() -> bytes:
    recs = [(KIND_LOGJAM, msg(i, size=17 * i)) for i in range(40)]
    recs[7] = (KIND_SAMWISE, [b"b1,b2", b"120", b"publish", b""])
    recs[9] = (KIND_LOGJAM, [])
    recs[11] = (KIND_LOGJAM, [b"x"] * 9)
    data = fmt.encode_header(3, 1234, 10) + fmt.encode_records(recs, 10)
    return data + fmt.encode_seal(50, 40, len(data), 99)


@pytest.mark.parametrize("max_records", [1, 3, 1000])
def test_c_parse_records_equals_python_on_a_mixed_segment(max_records):
    c_parse = _c_parse_or_skip()
    data = _mixed_segment()
    pos = fmt.HEADER_LEN
    for base in (0, 4096):
        p = pos
        while True:
            a = c_parse(data, p, len(data), max_records, base)
            _same(a, fmt.parse_records_py(data, p, len(data), max_records, base))
            if not a[0]:
                assert a[2] == "seal"
                break
            p = a[1]


def test_c_parse_records_equals_python_on_every_truncation_and_bit_flip():
    c_parse = _c_parse_or_skip()
    data = _mixed_segment()
    start = fmt.HEADER_LEN
    for end in range(start, len(data) + 1, 7):
        _same(c_parse(data, start, end, 1 << 30, 0),
              fmt.parse_records_py(data, start, end, 1 << 30, 0))
    for i in range(start, len(data), 5):
        b = bytearray(data)
        b[i] ^= 0x10
        b = bytes(b)
        _same(c_parse(b, start, len(b), 1 << 30, 0), fmt.parse_records_py(b, start, len(b), 1 << 30, 0))


def test_c_parse_records_equals_python_on_frame_lengths_that_do_not_add_up():
    """A frame length one off with the CRC fixed (the CRC alone does not find it), in a
    record of every kind, the seal's too."""
    c_parse = _c_parse_or_skip()
    data = _mixed_segment()
    offsets = [r[0] for r in fmt.parse_records_py(data, fmt.HEADER_LEN, len(data), 1 << 30)[0]]
    offsets.append(len(data) - fmt.SEAL_RECORD_LEN)
    reasons = set()
    for off in offsets:
        b = bytearray(data)
        body_len, _, _, _, n, _ = fmt.FULL_HEAD.unpack_from(b, off)
        if not n:
            continue
        first = int.from_bytes(b[off + 20:off + 24], "little")
        for delta in (1, -1):
            if first + delta < 0:
                continue
            b[off + 20:off + 24] = (first + delta).to_bytes(4, "little")
            b[off + 4:off + 8] = fmt.crc32(bytes(b[off + 8:off + 8 + body_len])).to_bytes(
                4, "little")
            got = c_parse(bytes(b), fmt.HEADER_LEN, len(b), 1 << 30, 0)
            _same(got, fmt.parse_records_py(bytes(b), fmt.HEADER_LEN, len(b), 1 << 30, 0))
            reasons.add(getattr(got[2], "reason", got[2]))
    assert reasons == {"frame_lengths"}, reasons


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_c_parse_records_equals_python_on_random_bytes(blob):
    c_parse = _c_parse_or_skip()
    _same(c_parse(blob, 0, len(blob), 100, 0), fmt.parse_records_py(blob, 0, len(blob), 100, 0))

"""An output worker's reads as one buffer (spool/_recblock.h, ``_tailread.RecordBlock``).

The block is the same sequence of records as the Python reads give (tail.read_block_py),
and the C mappings that read it straight from its buffer (``_ljencode.encode_block`` and
``scan``, ``_courierenc.events``) give the same bytes as the mappings of the same records
as a list, the Python ones included; whatever the block path does not map itself goes the
list way, with the same result."""

import random
import zlib

import pytest

from conftest import require_native
from logjam_relay.outputs import courier_encode as ce
from logjam_relay.outputs import lumberjack_encode as le
from logjam_relay.outputs import poison
from logjam_relay.protocols.logjam import encode_meta
from logjam_relay.spool import segment as fmt
from logjam_relay.spool import tail
from logjam_relay.spool.api import KIND_LOGJAM, Position, Record
from test_ljencode_shared import clear_cache_while_encoding


def _native():
    require_native(tail._tailread, "logjam_relay.spool._tailread")
    require_native(le._ljencode, "logjam_relay.outputs._ljencode")
    require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    assert tail.RecordBlock is not None
    # the C mappings found the type (whatever was imported first)
    assert le._ljencode.BLOCKS and ce._courierenc.BLOCKS
    assert le._RecordBlock is tail.RecordBlock is ce.RecordBlock


def _block(buf, pos=0, end=None, n=10**9, base=0, segno=7, skip=False, block=None):
    block = tail.RecordBlock(Record, Position) if block is None else block
    res = tail._read_into_c(block, buf, pos, len(buf) if end is None else end, n, base,
                            segno, skip)
    return block, res


def _py(buf, pos=0, end=None, n=10**9, base=0, segno=7, skip=False):
    return tail.read_block_py(buf, pos, len(buf) if end is None else end, n, base, segno, skip,
                              parse=fmt.parse_records_py)


def _status(st):
    if isinstance(st, fmt.SegmentCorrupt):
        return ("corrupt", st.reason, str(st), st.offset)
    return st


def _ok_meta(rnd, comp=0):
    return encode_meta(comp, rnd.choice((0, 1, 9, 2**32 - 1)), rnd.choice((0, 1700000000123, 10**15)),
                       rnd.choice((0, 10, 2**64 - 1)))


def _records(n, seed=1, odd=True):
    """(kind, frames): mostly ordinary logjam messages in runs of the same stream, and
    (``odd``) heartbeats, other kinds, wrong frame counts, bad and compressed bodies."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        k = rnd.random() if odd else 0.0
        app = b"shop-prod" if i % 50 < 40 else b"other-env"
        topic = b"logs.x" if i % 7 else b"logs.y"
        if k < 0.7:
            out.append((KIND_LOGJAM, [app, topic, b'{"i":%d,"s":"%s"}' % (i, b"x" * rnd.randrange(300)),
                                      _ok_meta(rnd)]))
        elif k < 0.75:
            out.append((KIND_LOGJAM, [b"heartbeat", b"", b"", _ok_meta(rnd)]))
        elif k < 0.8:
            out.append((1, [b"b1", b"120", b"publish"]))
        elif k < 0.85:
            out.append((KIND_LOGJAM, [rnd.randbytes(rnd.randrange(0, 5))
                                      for _ in range(rnd.randrange(0, 7))]))
        elif k < 0.9:
            out.append((KIND_LOGJAM, [app, topic, zlib.compress(b'{"z":%d}' % i), _ok_meta(rnd, 1)]))
        elif k < 0.95:
            out.append((KIND_LOGJAM, [app, topic, b"not json \xff", _ok_meta(rnd)]))
        else:
            out.append((KIND_LOGJAM, [app, topic, b"{}", b"short meta"]))
    return out


@pytest.fixture(scope="module")
def data():
    recs = _records(500)
    return fmt.encode_records(recs, first_seq=100) + fmt.encode_seal(600, 500, 0, 0), recs


# ------------------------------------------------------------------ the block itself


def test_block_reads_equal_the_python_reads(data):
    _native()
    buf, recs = data
    rnd = random.Random(3)
    starts = [0]
    for _kind, _fr in recs[:60]:
        starts.append(fmt.parse_records_py(buf, starts[-1], len(buf), 1, 0)[0][0][4])
    for _ in range(300):
        pos = rnd.choice(starts)
        end = rnd.choice((len(buf), pos + rnd.randrange(0, 3000), rnd.choice(starts)))
        n = rnd.choice((1, 2, 5, 1000))
        skip = rnd.random() < 0.3
        base = rnd.choice((0, 40))
        block, (added, bpos, next_seq, st, parsed) = _block(buf, pos, end, n, base, 3, skip)
        precs, ppos, pseq, pst, pparsed = _py(buf, pos, end, n, base, 3, skip)
        assert (added, bpos, next_seq, _status(st), parsed) == \
            (len(precs), ppos, pseq, _status(pst), pparsed)
        assert block.tolist() == precs and block == precs and list(block) == precs
        assert len(block) == len(precs)
        for r in block:
            assert type(r) is Record and type(r.position) is Position
            assert type(r.frames) is list and all(type(f) is bytes for f in r.frames)


def test_block_reads_of_garbage_equal_the_python_reads(data):
    """Bad input: flipped bytes, cut and random buffers give the Python statuses, never a
    crash, and only the records before the damage."""
    _native()
    buf, _recs = data
    rnd = random.Random(11)
    for _ in range(300):
        k = rnd.random()
        if k < 0.4:
            b = bytearray(buf[:rnd.randrange(len(buf))])
            for _ in range(rnd.randrange(1, 4)):
                if b:
                    b[rnd.randrange(len(b))] = rnd.randrange(256)
            b = bytes(b)
        elif k < 0.7:
            b = buf[rnd.randrange(len(buf)):]
        else:
            b = rnd.randbytes(rnd.randrange(0, 200))
        n = rnd.choice((1, 50, 10**6))
        block, (added, bpos, next_seq, st, parsed) = _block(b, n=n)
        precs, ppos, pseq, pst, pparsed = _py(b, n=n)
        assert (added, bpos, next_seq, _status(st), parsed) == \
            (len(precs), ppos, pseq, _status(pst), pparsed)
        assert block == precs


def test_block_sequence_behaviour(data):
    _native()
    buf, recs = data
    block, _ = _block(buf, n=40, base=100, segno=9)
    lst = block.tolist()
    assert len(lst) == 40 and bool(block)
    assert block[0] == lst[0] and block[-1] == lst[-1] and block[-40] == lst[0]
    assert block[3:17] == lst[3:17] and block[::-3] == lst[::-3] and type(block[1:2]) is list
    assert block[-1].position == Position(9, lst[-1].position.offset)
    with pytest.raises(IndexError):
        block[40]
    with pytest.raises(IndexError):
        block[-41]
    with pytest.raises(TypeError):
        block["x"]
    assert block + [1] == lst + [1] and [1] + block == [1] + lst and block + block == lst + lst
    acc = [0]
    acc += block
    assert acc == [0] + lst
    assert block != lst[:-1] and block != []
    empty = tail.RecordBlock(Record, Position)
    assert not empty and empty == [] and len(empty) == 0
    with pytest.raises(TypeError):
        tail.RecordBlock(tuple, int)
    with pytest.raises(TypeError):
        hash(block)


def test_reads_append_to_one_block(data):
    """Two reads (two segments, or both sides of a chunk) in one block: the records of
    both, in order, each with its own position."""
    _native()
    buf, recs = data
    block, (a1, p1, *_r) = _block(buf, n=30, segno=4, base=16)
    _, (a2, *_r) = _block(buf, pos=p1, n=25, segno=4, base=16, block=block)
    _, (a3, *_r) = _block(buf, n=10, segno=5, base=0, block=block)
    want = (_py(buf, n=30, segno=4, base=16)[0] + _py(buf, pos=p1, n=25, segno=4, base=16)[0]
            + _py(buf, n=10, segno=5)[0])
    assert (a1, a2, a3) == (30, 25, 10) and block == want


def test_a_damaged_record_appends_nothing_after_it(data):
    _native()
    buf, recs = data
    bad = bytearray(buf)
    first = fmt.parse_records_py(buf, 0, len(buf), 3, 0)[0]
    bad[first[2][4] - 1] ^= 0xFF                 # the third record's last byte: CRC
    block, (added, pos, _seq, st, parsed) = _block(bytes(bad), n=100)
    assert added == parsed == 2 and pos == first[1][4] and st.reason == "crc"
    assert block == _py(bytes(bad), n=100)[0]


# -------------------------------------------------------------- the mappings on it


def test_lumberjack_mapping_of_a_block_equals_the_list_and_python_mappings(data):
    _native()
    buf, recs = data
    for odd in (False, True):
        b = fmt.encode_records(_records(400, seed=7, odd=odd), first_seq=1)
        for n in (1, 3, 50, 400):
            block, _ = _block(b, n=n)
            lst = block.tolist()
            assert poison.scan(block) == poison.scan_py(lst)
            c, py = le.EventEncoder("relay"), le.EventEncoder("relay")
            assert c.encode(block) == py.encode_py(lst)
            assert c.decode_errors == py.decode_errors
            c2, l2 = le.EventEncoder("relay", 40), le.EventEncoder("relay", 40)
            got, want = c2.encode_checked(block), l2.encode_checked(lst)
            assert got[:2] == want[:2] and list(got[2]) == want[2] and got[3] == want[3]
            got, want = c2.encode_checked(block, prescan=True), \
                l2.encode_checked(lst, prescan=True)
            assert got[:2] == want[:2] and list(got[2]) == want[2] and got[3] == want[3]
    # the common case is mapped from the buffer, the rest is not (no side effects)
    ok, _ = _block(fmt.encode_records(_records(50, odd=False), first_seq=1))
    assert le._ljencode.encode_block(ok, KIND_LOGJAM, b"", {}, lambda a, t: a + t, -1) is not None
    assert le._ljencode.encode_block(ok, KIND_LOGJAM, b"", {}, lambda a, t: a + t, 10) is None
    for kind, frames in _records(40, seed=2)[20:]:
        one, _ = _block(fmt.encode_records([(kind, frames)], first_seq=1))
        r = le._ljencode.encode_block(one, KIND_LOGJAM, b"", {}, lambda a, t: a + t, -1)
        plain = kind != KIND_LOGJAM or (frames and frames[0] == b"heartbeat") or \
            (len(frames) == 4 and len(frames[3]) == 24 and frames[3][2] == 0)
        assert (r is not None) == bool(plain)


def test_lumberjack_pairs_cache_on_blocks():
    _native()
    rnd = random.Random(4)
    recs = [(KIND_LOGJAM, [rnd.choice((b"a-b", b"c-d", b"a-b-c")), rnd.choice((b"t1", b"t2")),
                           b"{}", _ok_meta(rnd)]) for _ in range(300)]
    block, _ = _block(fmt.encode_records(recs, first_seq=1))
    c, py = le.EventEncoder("h"), le.EventEncoder("h")
    clear_cache_while_encoding(c)
    assert c.encode(block) == py.encode_py(block.tolist())


def test_courier_mapping_of_a_block_equals_the_list_mapping(data):
    _native()
    buf, recs = data
    for limit in (10**7, 60):
        for n in (1, 7, 500):
            block, _ = _block(buf, n=n)
            lst = block.tolist()
            got = ce.record_events(block, "relay-host", limit)
            assert got == ce.record_events(lst, "relay-host", limit)
            for ev, rec in zip(got[0], lst, strict=True):
                if ev is not False:
                    try:
                        want = ce.record_to_event_py(rec, "relay-host", limit)
                    except ce.EventTooLarge:
                        continue
                    assert ev == want


def test_segment_tail_reads_blocks_equal_to_list_reads(tmp_path):
    """SegmentTail.read gives RecordBlocks with the C reads: the same records as its list
    reads, also across chunk boundaries."""
    _native()
    from logjam_relay.spool.spool import Spool

    sp = Spool(tmp_path / "sp", readers=["a", "b"], segment_bytes=64 * 1024, fsync="never")
    rnd = random.Random(9)
    sp.append_records([(KIND_LOGJAM, [b"app-env", b"logs.t", b'{"n":%d,"p":"%s"}' % (
        i, b"y" * rnd.randrange(200)), _ok_meta(rnd)]) for i in range(3000)])
    r1, r2 = sp.reader("a"), sp.reader("b")
    tails = []
    for r, blocks in ((r1, True), (r2, False)):
        t = tail.SegmentTail(r.name, r._ack_pos, r._ack_seq, lambda *a: None, lambda *a: None)
        t.CHUNK = 5000                  # many chunk boundaries
        t._blocks = blocks
        t.update(tail.snapshot(sp.ledger, 0))
        tails.append(t)
    got = [[], []]
    sizes = (1, 999, 37, 1000, 250)
    k = 0
    while True:
        a, b = tails[0].read(sizes[k % 5]), tails[1].read(sizes[k % 5])
        k += 1
        assert type(b) is list and (type(a) is tail.RecordBlock or a == [])
        assert a == b
        if not b:
            break
        got[0] += a
        got[1] += b
    assert len(got[0]) == 3000 and got[0] == got[1]
    sp.close()


def test_lumberjack_block_mapping_grows_past_its_estimate():
    """The frames are written into a bytes object sized from the block; stream pairs far
    longer than any real ones make it grow (and the bytes are still the Python ones)."""
    _native()
    rnd = random.Random(6)
    recs = [(KIND_LOGJAM, [b"a-%d" % (i % 3), b"t", b"{}", _ok_meta(rnd)]) for i in range(200)]
    block, _ = _block(fmt.encode_records(recs, first_seq=1))
    c, py = le.EventEncoder("h"), le.EventEncoder("h")
    for enc in (c, py):
        enc._stream_pairs = lambda a, t: b"p" * 70_000 + a + t
    assert c.encode(block) == py.encode_py(block.tolist())


def test_a_block_keeps_bytes_and_copies_mutable_buffers(data):
    """Records read from ``bytes`` stay in it (the block keeps it); from a mutable buffer
    (a reused chunk) they are copied: changing or dropping the buffer afterwards does not
    change the block."""
    _native()
    buf, recs = data
    want = _py(buf, n=50)[0]
    chunk = bytearray(buf)
    block, _ = _block(chunk, n=20)
    _block(memoryview(chunk), pos=_py(buf, n=20)[1], n=30, block=block)
    chunk[:] = bytes(len(chunk))                    # the chunk is reused
    assert block == want
    own = bytes(buf)
    block2, _ = _block(own, n=50)
    del own
    assert block2 == want and block2.nbytes == _py(buf, n=50)[1]

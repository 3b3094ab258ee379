"""The decision on a record a chunk holds only in part (spool/chunkread.py), the one copy
that the relay's SpoolReader and a worker's SegmentTail both use: its cases one by one,
and a worker on a segment file cut below its committed end inside a record larger than
its chunk (which it once read again and again without end)."""

import os
import threading

from logjam_relay.spool import segment as fmt
from logjam_relay.spool.chunkread import after_partial, read_size

REC = fmt.encode_records([(0, [b"app", b"topic", b"x" * 100, b"m" * 24])], first_seq=5)
NEED = len(REC)                       # prefix + body_len: the whole record


def test_read_size_is_a_chunk_or_the_need_never_past_the_committed_end():
    assert read_size(1000, 0, 40, 10_000) == 1000
    assert read_size(1000, 5000, 40, 10_000) == 5000
    assert read_size(1000, 5000, 40, 2040) == 2000


def test_a_record_crossing_the_committed_end_is_torn():
    # read from the record's offset, everything up to the committed end is there
    err, need = after_partial(REC[:50], 40, 40, 50, 90, short=False)
    assert isinstance(err, fmt.SegmentTruncated) and err.reason == "torn"
    assert err.offset == 40 and need == NEED and str(err) == "record crosses the committed end"


def test_a_file_shorter_than_asked_for_is_short_file():
    err, need = after_partial(REC[:50], 40, 40, 50, 40 + NEED, short=True)
    assert err.reason == "short_file" and err.offset == 40 and need == NEED
    assert str(err) == "segment file shorter than expected"


def test_a_whole_chunk_that_ends_inside_the_record_reads_again_for_the_whole_record():
    err, need = after_partial(REC[:50], 40, 40, 50, 40 + NEED + 1000, short=False)
    assert err is None and need == NEED


def test_a_chunk_read_from_an_earlier_record_reads_again_from_this_one():
    buf = REC + REC[:30]
    off = 40 + len(REC)
    # even when that read was short, or everything up to the committed end is there:
    # the decision waits for a read from the record's own offset
    for short in (False, True):
        err, need = after_partial(buf, 40, off, len(buf), off + 30, short)
        assert err is None and need == NEED


def test_without_the_prefix_it_reads_at_least_the_prefix():
    err, need = after_partial(REC[:5], 40, 40, 5, 40 + 1000, short=False)
    assert err is None and need == fmt.PREFIX_LEN
    err, _ = after_partial(REC[:5], 40, 40, 5, 45, short=False)
    assert err.reason == "torn"
    # a hole (``stop``) before the prefix's end: the prefix is not read from the buffer
    err, need = after_partial(REC, 40, 40, 5, 40 + 1000, short=False)
    assert need == fmt.PREFIX_LEN


def test_a_worker_on_a_file_cut_inside_a_record_larger_than_its_chunk_reports_it(tmp_path):
    """The committed end says the record is whole, the file was cut inside it, past one
    chunk: the worker reports ``short_file`` at the record and serves what came before."""
    from logjam_relay.spool.spool import Spool
    from logjam_relay.spool.tail import SegmentTail, snapshot
    sp = Spool(tmp_path / "sp", readers=["t"], segment_bytes=64 << 20, fsync="never")
    sp.append_records([(0, [b"app", b"topic", b"small", b"m" * 24])])
    sp.append_records([(0, [b"app", b"topic", b"B" * 1_000_000, b"m" * 24])])
    r = sp.reader("t")
    reports = []
    tail = SegmentTail("t", r.acknowledged, r.acknowledged_seq, lambda p, known: None,
                       lambda *d: reports.append(d))
    tail.CHUNK = 64 * 1024
    tail.update(snapshot(sp.ledger, 0))
    seg = sp.ledger.segs[r.acknowledged.segment]
    big_at = fmt.HEADER_LEN + fmt.MIN_RECORD + 16 + len(b"apptopicsmall") + 24
    os.truncate(seg.path, big_at + 200_000)        # more than a chunk of the record is left
    got = []

    def read():
        while recs := tail.read(10):
            got.extend(recs)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the worker reads the cut record again and again"
    assert [rec.frames[2] for rec in got] == [b"small"]
    assert len(reports) == 1
    segno, off, _seq, reason, message = reports[0]
    assert (segno, off, reason) == (seg.segno, big_at, "short_file"), reports[0]
    sp.close()

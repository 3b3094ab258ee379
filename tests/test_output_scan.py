"""The outputs' one-pass look at a batch (poison.scan: body bytes, whether to map it in a
thread) in C (_ljencode.scan) equals the Python reference, on ordinary, odd and random
records; what the C scan does not take is left to Python (None)."""

import random

from conftest import require_native
from logjam_relay.outputs import poison
from logjam_relay.protocols.logjam import encode_meta
from logjam_relay.spool.api import KIND_LOGJAM, Position, Record


def _rec(frames, i=0, kind=KIND_LOGJAM):
    return Record(Position(0, i), kind, frames)


def _c(records):
    require_native(poison._scan_c, "logjam_relay.outputs._ljencode")
    return poison._scan_c(records, poison.INLINE_BODY_MAX)


def test_ordinary_and_edge_records():
    plain = encode_meta(0, 1, 1, 1)
    cases = [
        [],
        [_rec([b"a-b", b"t", b"{}", plain])],
        [_rec([b"a-b", b"t", b"x" * 10, plain])] * 5,
        [_rec([b"a-b", b"t", b"x" * (poison.INLINE_BODY_MAX + 1), plain])],
        [_rec([b"a-b", b"t", b"x" * poison.INLINE_BODY_MAX, plain])],
        [_rec([b"a-b", b"t", b"zz", encode_meta(1, 1, 1, 1)])],
        [_rec([b"a-b", b"t", b"zz", b"\x00\x00\x01" + bytes(20)])],          # 23 bytes: not meta
        [_rec([b"a-b", b"t", b"zz"])],                                          # 3 frames
        [_rec([b"a-b", b"t"]), _rec([]), _rec([b"b1", b"1", b"p"], kind=1)],
        [_rec((b"a-b", b"t", b"body", plain, b"extra"))],
    ]
    for recs in cases:
        assert _c(recs) == poison.scan_py(recs), recs
        assert poison.scan(recs) == poison.scan_py(recs)
        assert poison.needs_worker(recs) is poison.scan_py(recs)[1]


def test_what_c_does_not_take_goes_to_python():
    plain = encode_meta(0, 1, 1, 1)
    odd = [
        [_rec([b"a-b", b"t", memoryview(b"body"), plain])],
        [_rec([b"a-b", b"t", b"body", bytearray(plain)])],
        [(Position(0, 0), 0)],
        [5],
        [_rec(iter([b"x"]))],
    ]
    for recs in odd:
        assert _c(recs) is None
    assert _c(tuple(odd[0])) is None                  # not a list
    for recs in odd[:2]:
        assert poison.scan(recs) == poison.scan_py(recs)


def test_random_records():
    rnd = random.Random(3)
    for _ in range(300):
        recs = []
        for i in range(rnd.randrange(0, 30)):
            nf = rnd.choice((0, 1, 2, 3, 4, 4, 4, 5))
            frames = [rnd.randbytes(rnd.choice((0, 3, 24, 70_000 if rnd.random() < 0.05 else 9)))
                      for _ in range(nf)]
            recs.append(_rec(frames, i, rnd.choice((0, 0, 1))))
        assert _c(recs) == poison.scan_py(recs)

"""The Courier output's batch mapping in C (_courierenc.events): the same events, skips,
rejections and payload groups as the per-record Python mapping, on ordinary, malformed
and random records."""

import dataclasses
import random
import zlib

import pytest

from conftest import require_native
from logjam_relay.outputs import courier as co
from logjam_relay.outputs import courier_encode as ce
from logjam_relay.protocols.logjam import encode_meta
from logjam_relay.spool.api import KIND_LOGJAM, KIND_SAMWISE, Position, Record

BODY = b'{"action":"a#b","code":200}'


def _records():
    frames = [
        [b"app-prod", b"logs.x", BODY, encode_meta(0, 7, 1_700_000_000_123, 5)],
        [b"app-prod", b"logs.x", BODY, encode_meta(0, 7, 1_700_000_000_999, 6)],
        [b"app-prod", b"logs.x", BODY, encode_meta(0, 7, 1_700_000_001_000, 7)],
        [b"other-env", b"logs.y", BODY, encode_meta(0, 7, 1_700_000_001_000, 7)],
        [b"app-prod", b"logs.x", zlib.compress(BODY), encode_meta(1, 7, 1, 1)],
        [b"app-prod", b"logs.x", b"not json", encode_meta(0, 7, 1, 1)],
        [b"app-prod", b"logs.x", b"xx", encode_meta(1, 7, 1, 1)],             # bad zlib
        [b"app-prod", b"logs.x", BODY, b"short"],
        [b"app-prod", b"logs.x", BODY, encode_meta(0, 7, 2**64 - 1, 1)],      # year > 9999
        [b"app-prod", b"logs.x", memoryview(BODY), encode_meta(0, 7, 1, 1)],
        [b"heartbeat", b"tcp://h:1", b"{}", encode_meta(0, 7, 1, 1)],
        [b"a-b", b"t", b"{}"],
        [b"app-prod", b"logs.x", b'{"x":"' + b"y" * 300 + b'"}', encode_meta(0, 7, 1, 1)],
        [b"app-prod", b"logs.x", BODY, encode_meta(0, 7, 1, 1), b"extra frame"],
        (b"app-prod", b"logs.x", BODY, encode_meta(0, 7, 1, 1)),
    ]
    recs = [Record(Position(0, i), KIND_LOGJAM, f) for i, f in enumerate(frames)]
    recs.append(Record(Position(0, 99), KIND_SAMWISE, [b"b1", b"120", b"publish"]))
    return recs


def _output(limit=200, payload_bytes=4 << 20):
    cfg = dataclasses.replace(co.parse_url("courier://127.0.0.1:1?tls=off"),
                              max_event_bytes=limit, max_payload_bytes=payload_bytes,
                              hostname="relay\u00e9")
    return co.CourierOutput(cfg, None)


def _both(out, records, monkeypatch):
    got_c = out._map_records(records)
    with monkeypatch.context() as m:
        m.setattr(co, "record_events", lambda *a: None)
        got_py = out._map_records(records)
    assert got_c == got_py
    return got_c


def test_every_entry_is_what_record_to_event_gives():
    require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    recs = _records()
    evs, clean, total, longest = ce.record_events(recs, "relay\u00e9", 200)
    assert not clean and len(evs) == len(recs)
    mapped = 0
    for rec, ev in zip(recs, evs, strict=True):
        if ev is False:
            continue
        mapped += 1
        assert ev == ce.record_to_event_py(rec, "relay\u00e9", 200), rec
    assert mapped >= 6
    assert evs[10] is None and evs[11] is None and evs[-1] is None     # not events
    assert evs[12] is False                                             # body over the limit
    good = [e for e in evs if type(e) is bytes]
    assert total == sum(map(len, good)) and longest == max(map(len, good))


@pytest.mark.parametrize("limit,payload", [(200, 4 << 20), (10_000, 4 << 20), (10_000, 300),
                                           (60, 4 << 20)])
def test_groups_rejections_and_skips_match_python(limit, payload, monkeypatch):
    require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    out = _output(limit, payload)
    recs = _records()
    _both(out, recs, monkeypatch)
    clean = [r for r in recs if ce.record_to_event_py(r, "x") is not None
             and type(r.frames[2]) is bytes and len(r.frames[2]) < 100][:4] * 50
    groups, rejected, skipped = _both(out, clean, monkeypatch)
    if limit >= 10_000:                 # all events: one payload, or cut by the byte cap
        assert not rejected and not skipped
        assert len(groups) == 1 if payload > 100_000 else len(groups) > 1
        assert sum(len(g[1]) for g in groups) == len(clean)


def test_random_records(monkeypatch):
    require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    rnd = random.Random(14)
    out = _output(300, 2000)
    for _ in range(100):
        recs = []
        for i in range(rnd.randrange(1, 40)):
            meta = encode_meta(rnd.choice((0, 0, 1, 7)), rnd.randrange(2**32),
                               rnd.randrange(2**45), rnd.randrange(2**64))
            if rnd.random() < 0.2:
                meta = rnd.randbytes(rnd.choice((0, 23, 24, 25)))
            body = rnd.choice((BODY, b"[1,2]", rnd.randbytes(rnd.randrange(0, 30)),
                               b'"' + b"z" * rnd.randrange(0, 400) + b'"'))
            frames = [rnd.choice((b"app-prod", b"b-c", b"heartbeat", b"")),
                      rnd.choice((b"logs.x", b"\xff")), body, meta]
            frames = frames[:rnd.choice((4, 4, 4, 3, 5))] + ([b"x"] if rnd.random() < 0.1 else [])
            recs.append(Record(Position(1, i), rnd.choice((KIND_LOGJAM,) * 5 + (KIND_SAMWISE,)),
                               frames))
        _both(out, recs, monkeypatch)


def test_bad_input_raises_or_is_left_to_python():
    mod = require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    inflate = ce._inflater(100)
    evs, clean, _, _ = mod.events([1, (1,), (Position(0, 0), "k", []),
                                   (Position(0, 0), 2**70, []), (Position(0, 0), 0, 5)],
                                  KIND_LOGJAM, lambda a, t: b",", inflate, 100)
    assert evs == [False] * 5 and not clean
    with pytest.raises(TypeError):
        mod.events(5, KIND_LOGJAM, lambda a, t: b",", inflate, 100)
    rec = Record(Position(0, 0), KIND_LOGJAM, [b"a-b", b"t", BODY, encode_meta(0, 1, 1, 1)])
    with pytest.raises(TypeError):
        mod.events([rec], KIND_LOGJAM, lambda a, t: "not bytes", inflate, 100)
    with pytest.raises(ZeroDivisionError):
        mod.events([rec], KIND_LOGJAM, lambda a, t: 1 / 0, inflate, 100)


def _py_is_json(b: bytes) -> bool:
    try:
        ce._json_check(b.decode("utf-8"))
        return True
    except (ValueError, RecursionError):
        return False


def test_json_check_on_long_strings_with_specials_at_every_offset():
    """The C check skips plain runs of strings and ASCII 8 bytes at a time: a quote, a
    backslash escape, a control character or a UTF-8 sequence at any offset of a long
    string is still seen (compared with Python's json)."""
    mod = require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    specials = [b'"', b'\\"', b"\\\\", b"\\u00e9", b"\\x", b"\\", b"\x00", b"\x1f", b"\x7f",
                b"\xc3\xa9", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\xc3", b"\xff", b" ", b"\t"]
    checked = 0
    for sp in specials:
        for off in range(0, 20):
            for tail in (0, 1, 7, 8, 9, 17):
                s = b"a" * off + sp + b"b" * tail
                for doc in (b'"' + s + b'"', b'{"k":"' + s + b'","n":1}', b'["' + s + b'"]',
                            b'"' + s):
                    assert mod.is_json(doc) == _py_is_json(doc), doc
                    checked += 1
    assert checked > 5000


# ------------------------------------------- payload framing in C (_courierenc.frame_events)

def test_frame_events_is_the_python_framing_byte_for_byte():
    from logjam_relay.protocols import courier as cp
    mod = require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    rng = random.Random(14)
    cases = [[], [b""], [b"{}"], [BODY] * 1000, [b"x" * 70000, b"", b"y"],
             [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 600)))
              for _ in range(200)]]
    for events in cases:
        want = cp.encode_events_py(events)
        assert mod.frame_events(events) == want
        assert mod.frame_events(tuple(events)) == want
        assert cp.encode_events(events) == want
        assert cp.encode_events(iter(events)) == want          # any iterable, as before
        assert zlib.decompress(cp.encode_payload(b"n" * 16, events)[24:]) == want


def test_frame_events_leaves_other_items_to_python():
    from logjam_relay.protocols import courier as cp
    mod = require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    # not bytes: the C twin declines (None); encode_events gives what Python gives
    for events in ([bytearray(b"ab"), b"c"], [b"a", memoryview(b"bc")]):
        assert mod.frame_events(events) is None
        assert cp.encode_events(events) == cp.encode_events_py(events)
    # malformed input never crashes: a non-sequence raises TypeError, junk items decline
    with pytest.raises(TypeError):
        mod.frame_events(42)
    assert mod.frame_events([b"a", None, 3]) is None
    with pytest.raises(TypeError):
        cp.encode_events([b"a", None])          # as the Python framing does


# ------------------------------- the payload's Adler-32 in C (_courierenc.adler32, SSSE3)

def test_adler32_is_zlibs_on_every_length_and_start_value():
    """SIMD and scalar versions against zlib.adler32: lengths around the 32-byte steps
    and the NMAX reduction interval, bytes that maximise the sums (0xFF), start values
    that are not reduced modulo 65521."""
    mod = require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    rng = random.Random(32)
    lengths = list(range(0, 100)) + [5551, 5552, 5553, 11104, 11105, 65536, 300_001, 3 << 20]
    for n in lengths:
        for data in (rng.randbytes(n), b"\xff" * n, bytes(n)):
            for start in (1, 0, 0xFFFFFFFF, 0xFFF0FFF0, rng.randrange(1 << 32)):
                want = zlib.adler32(data, start)
                assert mod.adler32(data, start) == want, (n, start)
                assert mod.adler32_scalar(data, start) == want, (n, start)
    assert mod.adler32(memoryview(b"abc")) == zlib.adler32(b"abc")
    with pytest.raises(TypeError):
        mod.adler32("text")
    assert mod.adler32(b"x", -1) == zlib.adler32(b"x", -1)    # wraps, as zlib's does


def test_zlib_compress_is_zlib_compress_byte_for_byte():
    """protocols.courier.zlib_compress (raw deflate + zlib's header + the C Adler-32)
    gives exactly zlib.compress's bytes, at every level, for payload-like and random
    data; encode_payload's output inflates to the framed events."""
    from logjam_relay.protocols import courier as cp
    require_native(ce._courierenc, "logjam_relay.outputs._courierenc")
    rng = random.Random(7)
    samples = [b"", b"x", BODY * 3000, rng.randbytes(70_000),
               cp.encode_events([BODY + b"%d" % i for i in range(1000)])]
    for level in range(-1, 10):
        for data in samples:
            assert cp.zlib_compress(data, level) == zlib.compress(data, level), level
    msg = cp.encode_payload(b"n" * 16, [BODY] * 10, level=3)
    assert zlib.decompress(msg[24:]) == cp.encode_events_py([BODY] * 10)

"""The C extraction of request fields (pipeline/_extract.c) against the Python definitions
(pipeline/extract.py, json.loads semantics), on crafted edge cases and random bodies; and
column pruning in the decoder.  No Spark needed."""

import json
import random

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")

from conftest import require_native  # noqa: E402
from logjam_relay.pipeline import extract as ex  # noqa: E402

CASES = [
    b'{"action":"Orders#index","started_ms":1700006220000,"total_time":12.5,"code":200,'
    b'"severity":1,"exceptions":["A::B","C"]}',
    b'{"action":"a","started_at":"2023-11-14T23:57:00.123+02:00","total_time":3}',
    b'{"started_at":"2023-11-14T23:57:00Z"}', b'{"started_at":"2023-11-14 23:57:00"}',
    b'{"started_at":"2023-11-14T23:57:00.123456"}', b'{"started_at":"2023-11-14"}',
    b'{"started_at":"not a date"}', b'{"started_at":"2023-02-30T00:00:00"}',
    b'{"started_at":5, "started_ms":"x"}', b'{"started_ms":1.5,"started_at":"2023-11-14T00:00:00"}',
    b'{"started_ms":true}', b'{"started_ms":99999999999999999999999}',
    b'{"code":2147483648,"severity":-2147483649}', b'{"code":200.0,"severity":"1"}',
    b'{"code":true,"total_time":false}', b'{"total_time":1e400}', b'{"total_time":-0}',
    b'{"total_time":123456789012345678901234567890}',
    b'{"action":"caf\\u00e9"}', b'{"action":"a\\"b"}', b'{"act\\u0069on":"x"}',
    b'{"action":1}', b'{"action":null}', b'{"action":"x","action":"y"}',
    b'{"exceptions":"X"}', b'{"exceptions":["a",1,null,["b"],"c"]}',
    b'{"exceptions":["a"],"exceptions":null}', b'{"exceptions":[]}',
    b'{"exceptions":["x\\ny"]}', b'{"exceptions":[{"a":[1,2,{"b":"c"}]}]}',
    b'{}', b'[]', b'[1,2]', b'"str"', b'123', b'null', b'', b'   ', b'{', b'{"a":1,}',
    b'{"a":1} x', b'{"a":1}  \n', b' \t{"a" : 1 }\r\n', b'{"a":01}', b'{"a":1.}',
    b'{"a":1e}', b'{"a":-}', b'{"a":NaN}', b'{"a":Infinity}', b'{"a":-Infinity}',
    b'{"a":"tab\there"}', b'{"a":"\\x"}', b'{"a":"\\u12"}', b'{"a":tru}', b'{"a":nul}',
    b'\xef\xbb\xbf{"action":"bom"}', b'{"a":' + b'[' * 600 + b']' * 600 + b'}',
    b'{"a":' + b'[' * 20 + b']' * 20 + b'}', b'{"a":"\xc3\xa9"}', b'{"action":"\xc3\xa9"}',
    b'{"total_time":1E+2,"code":-0,"severity":5}', b'{"total_time":0.1e-2}',
]


def column(bodies):
    return pa.array([b.decode("utf-8") for b in bodies], pa.string())


def both(bodies, rows=None):
    col = column(bodies)
    rows = np.ones(len(bodies), dtype=bool) if rows is None else rows
    c = pa.table(ex.extract_c(col, rows))
    p = pa.table(ex.extract_py(col, rows))
    return c, p


def assert_same(bodies, rows=None):
    c, p = both(bodies, rows)
    for name in p.column_names:
        a, b = c[name].to_pylist(), p[name].to_pylist()
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x == y or (x != x and y != y), (name, bodies[i], x, y)


def test_c_matches_python_on_edge_cases():
    require_native(ex._extract_c, "logjam_relay.pipeline._extract")
    assert_same(CASES)
    # the definitions themselves, on a few cases
    c, _ = both(CASES[:3])
    assert c["action"].to_pylist() == ["Orders#index", "a", None]
    assert c["started_ms"].to_pylist()[:3] == [1700006220000, 1699999020123, 1700006220000]
    assert c["exceptions"].to_pylist()[0] == ["A::B", "C"]
    _, p = both([b"[]", b"{"])
    assert p["bad_json"].to_pylist() == [True, True]


def test_rows_not_asked_are_null():
    require_native(ex._extract_c, "logjam_relay.pipeline._extract")
    rows = np.array([i % 2 == 0 for i in range(len(CASES))])
    assert_same(CASES, rows)
    c, _ = both(CASES, rows)
    assert c["action"].to_pylist()[1] is None and not any(c["bad_json"].to_pylist()[1::2])


def _random_body(rng: random.Random) -> bytes:
    vals = [1, -7, 2**31, 2**63, 1.25, "x", "Orders#show", "2023-11-14T23:57:00.5Z",
            "2023-11-14T23:57:00+01:00", True, None, [], ["E1", 2, "E\u00e9"], {"k": [1]},
            1e300, "a\\b"]
    keys = ["action", "started_ms", "started_at", "total_time", "code", "severity",
            "exceptions", "other"]
    d = {rng.choice(keys): rng.choice(vals) for _ in range(rng.randint(0, 7))}
    s = json.dumps(d, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.2:                      # damage it
        i = rng.randrange(len(s) + 1)
        s = s[:i] + rng.choice(['"', "}", ",", "\\", " ", "]", "1", "\t"]) + s[i + 1:]
    return s.encode()


def test_c_matches_python_on_random_bodies():
    require_native(ex._extract_c, "logjam_relay.pipeline._extract")
    rng = random.Random(5)
    bodies = [_random_body(rng) for _ in range(5000)]
    assert_same(bodies)


def test_column_pruning_skips_decompression(tmp_path):
    """A meta-only selection gives the same meta columns without decoding bodies (a body
    that cannot be decompressed yields no error row there)."""
    from logjam_relay.pipeline import decode, sample
    msgs = sample.make_messages(300, seed=3)
    sample.write_archive(tmp_path / "spool", tmp_path / "archive", msgs)
    (segno, path), = decode.list_segments(str(tmp_path / "archive"))
    cols = ("device", "sequence", "record")
    for fn in (decode._decode_segment_c, decode.decode_segment_py):
        if fn is decode._decode_segment_c and decode._segscan is None:
            continue
        full = pa.Table.from_batches(list(fn(path, segno, 0, None, 64, None)))
        st = decode.DecodeStats()
        pruned = pa.Table.from_batches(list(fn(path, segno, 0, None, 64, st, cols)))
        assert pruned.column_names == list(cols)
        assert pruned.equals(full.select(list(cols)))
        assert st.bad_records == 0 and full.column("error").null_count < full.num_rows
        both_ = pa.Table.from_batches(list(fn(path, segno, 0, None, 64, None,
                                              ("error", "action", "bad_json"))))
        assert both_["error"].equals(full["error"])


def test_plan_slices_cover_every_record_once_in_balanced_pieces(tmp_path):
    from logjam_relay.pipeline import decode, partial, sample
    sample.write_archive(tmp_path / "spool", tmp_path / "archive",
                         sample.make_messages(3000, seed=5), segment_bytes=256 << 10)
    arch = str(tmp_path / "archive")
    segs = decode.list_segments(arch)
    counts = {s: decode.record_count(p) for s, p in segs}
    assert len(segs) >= 3
    for cores, min_records in ((1, 1), (2, 100), (8, 1), (2, 1 << 20)):
        sl = partial.plan_slices(arch, cores, min_records=min_records)
        per_seg: dict = {}
        for _path, segno, a, z in sl:
            per_seg.setdefault(segno, []).append((a, z))
        for segno, parts in per_seg.items():      # contiguous, in order, all records
            parts.sort()
            assert parts[0][0] == 0 and parts[-1][1] == counts[segno]
            assert all(x[1] == y[0] for x, y in zip(parts, parts[1:], strict=False))
        assert set(per_seg) == set(counts)
        sizes = [z - a for _, _, a, z in sl]
        if min_records == 1 << 20:                # never cut below min_records
            assert len(sl) == len(segs)
        else:
            target = max(min_records, -(-sum(counts.values()) // (4 * cores)))
            assert max(sizes) <= 1.5 * target + 1
    # the partial rows of all slices hold every record exactly once (the summary count)
    sl = partial.plan_slices(arch, 2, min_records=100)
    rows = sum(b.column("rows").to_numpy().sum()
               for b in partial.read_slices(sl, range(len(sl)), 500.0))
    assert rows == sum(counts.values())

"""The JVM engines of ``pipeline stats``: the JVM reader extracts the request fields
(Extract.java, IsoTime.java); the ``jvm`` engine aggregates them per partition on the JVM
(Partials.java: the partial rows of partial.py) and Spark merges them as the python
engine's; the ``sql`` engine makes the tables in one Spark SQL aggregation.

* the extracted columns equal the Python data source's (json.loads semantics) on every row
  the JVM decides, on bodies chosen to break a JSON walk; the rows it leaves to Python are
  exactly the expected ones;
* the tables of both equal the ``python`` engine's (mapInArrow + partial aggregation)
  figure for figure, exact percentiles included, also with the JVM's partial rows cut in
  small slices and batches (groups split across partitions);
* an archive with a body only Python decides runs the ``python`` engine.
Real Spark local mode, one session, small archives.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from conftest import local_spark_session  # noqa: E402
from logjam_relay.pipeline import jvmreader, sample, stats  # noqa: E402
from logjam_relay.pipeline.decode import list_segments  # noqa: E402
from logjam_relay.pipeline.partial import PARTIAL_DDL  # noqa: E402
from logjam_relay.protocols.logjam import compress  # noqa: E402

CREATED = 1_700_006_280_000

#: (body, decided by the JVM?) -- every one also goes through the Python source
TRICKY = [
    (b'{"action":"A#b","started_ms":1700006270123,"total_time":12.5,"code":200,'
     b'"severity":1}', True),
    (b' \t\r\n{"action" : "A#b" , "total_time" : 1e3 , "code" : 404 }  \n', True),
    (b'{"action":"A#b","action":"C#d","total_time":1,"total_time":2.25}', True),   # last wins
    (b'{"total_time":true,"code":false,"severity":null,"action":1}', True),
    (b'{"total_time":"12","code":"200","action":["x"]}', True),
    (b'{"code":2147483648,"severity":-2147483648,"total_time":-0.0}', True),
    (b'{"code":9223372036854775807,"started_ms":-9223372036854775808}', True),
    (b'{"total_time":1E-7,"code":0,"severity":-0}', True),
    (b'{"total_time":123456789012345678,"started_ms":0}', True),
    (b'{"total_time":1.7976931348623157e308}', True),
    (b'{"total_time":2.5e400}', True),                                  # inf, as Python
    (b'{"exceptions":["A::B",1,null,"C",{"x":"y"},["D"]],"action":"X#y"}', True),
    (b'{"exceptions":[],"exceptions":["E"]}', True),
    (b'{"exceptions":["E"],"exceptions":"no list"}', True),
    (b'{"exceptions":["E"],"exceptions":null}', True),
    (b'{"exceptions":{"a":"b"}}', True),
    (b'{"started_at":"2023-11-14T23:58:01.5+02:00","started_ms":"x"}', True),
    (b'{"started_at":"2023-11-14T23:58:01Z"}', True),
    (b'{"started_at":"2023-11-14 23:58:01.123"}', True),
    (b'{"started_at":"2023-11-14T23:58:01.12-05:30"}', True),
    (b'{"started_at":"2024-02-29T00:00:00.000+00:00"}', True),
    (b'{"started_at":17}', True),
    (b'{"started_ms":1.5e12,"started_at":"2023-11-14T23:58:01Z"}', True),
    (b'{"lines":[[1,2,"quoted \\"text\\" \\u00e9 \\n"]],"action":"Q#r",'
     b'"x":{"y":[{}, [], {"z":[1,2,{"w":null}]}]}}', True),
    ('{"action":"Bestellungen#übersicht","exceptions":["Fehler::Ä"]}'.encode(), True),
    (b'{}', True),
    (b'[]', True),                                     # not an object: bad_json
    (b'"text"', True),
    (b'17', True),
    (b'{"action":"A#b"', True),                        # truncated
    (b'{"action":"A#b"} x', True),                     # extra data
    (b'{"action":"A#b",}', True),                      # trailing comma
    (b'{"total_time":1.}', True),
    (b'{"total_time":01}', True),
    (b'{"total_time":.5}', True),
    (b'{"action":"tab\tinside"}', True),                # control character in a string
    (b'{"a":"\\x"}', True),                            # bad escape
    (b'', True),
    (b'   ', True),
    (b'{"action":"esc\\"aped"}', False),               # escapes in a string it returns
    (b'{"exceptions":["\\u00c4rger"]}', False),
    (b'{"act\\u0069on":"A#b"}', False),                # escapes in a key
    (b'{"started_at":"2023-11-14T23:58:01.123456"}', False),   # another ISO form
    (b'{"started_at":"20231114T235801"}', False),
    (b'{"total_time":NaN}', False),
    (b'{"total_time":-Infinity}', False),
    (b'{"code":123456789012345678901234567890}', False),
    (b'\xef\xbb\xbf{"action":"bom"}', False),
    (b'{"x":' + b'[' * 600 + b']' * 600 + b'}', False),         # very deep
    # floats: Extract's fast path (<= 15 digits, power of ten <= 22) and beyond it
    (b'{"total_time":0.1,"x":[1.5e22,1e23,1.0000000000000002,4.35]}', True),
    (b'{"total_time":123456789012345.6}', True),                 # 16 digits: the parser
    (b'{"total_time":999999999999999e22}', True),
    (b'{"total_time":9007199254740993.0}', True),
    (b'{"total_time":0.000000000000000000001}', True),           # 1e-21 in 22 digits
    (b'{"total_time":5e-324}', True),
    (b'{"total_time":-0.0e+00}', True),
    (b'{"total_time":1.5E+3}', True),
    (b'{"total_time":72.123e-1}', True),
    (b'{"total_time":1e-22}', True),
    (b'{"total_time":3.14159265358979}', True),
    (b'{"total_time":1e0000000000000000000001}', True),
    # integers around the 18 digits Extract sums without an overflow check
    # (started_ms not among them: beyond Spark's timestamp range, see the engines' test)
    (b'{"code":999999999999999999,"severity":1000000000000000000,"x":-999999999999999999,'
     b'"total_time":-1000000000000000001}', True),
    (b'{"severity":-999999999999999999,"code":-1000000000000000000}', True),
    (b'{"code":12', True),                             # truncated inside a number
    # whitespace JSON does not have (ws() stops at the first byte above ' ')
    (b'{"code":200,\x0b"severity":1}', True),
    (b'{"code":200,\x0c"severity":1}', True),
    (b'{"action":"del\x7f and \x1f"}', True),          # 0x7F is a string byte; 0x1F is not
    (b'{"action":"del\x7f","code":1}', True),
]


@pytest.fixture(scope="module")
def spark():
    s = local_spark_session("logjam-relay-sql-tests")
    if not jvmreader.loaded(s):
        s.stop()
        pytest.fail("the JVM reader did not load: the sql engine cannot be tested")
    yield s
    s.stop()


def _archive(d, bodies, *, extra=(), segment_bytes=1 << 20):
    """An archive with the ``bodies`` as logs records (all four compressions), plus
    ``extra`` messages."""
    msgs = []
    for i, b in enumerate(bodies):
        c = i % 4
        msgs.append(sample.Msg(b"shop-production", b"logs.shop.production", b, c,
                               compress(b, c), 1 + i % 2, CREATED + 997 * i, i + 1))
    msgs.extend(extra)
    sample.write_archive(d / "spool", d / "archive", msgs, segment_bytes=segment_bytes,
                         batch=50)
    return str(d / "archive")


@pytest.fixture(scope="module")
def tricky(tmp_path_factory):
    return _archive(tmp_path_factory.mktemp("sql_tricky"), [b for b, _ in TRICKY])


def _rows(df, cols):
    return sorted((tuple(r[c] for c in cols) for r in df.collect()),
                  key=lambda t: (t[0], t[1]))


FIELDS = ["action", "started_ms", "total_time", "code", "severity", "exceptions", "bad_json"]
FIELDS_DDL = ("segment long, record int, action string, started_ms long, total_time double, "
              "code int, severity int, exceptions array<string>, bad_json boolean")


def _undecided_else_equal(spark, archive, bodies) -> tuple[list[bytes], list[tuple]]:
    """Read ``archive`` (the logs records of ``bodies``, in order) with the JVM reader and
    with the Python source; assert that every field the JVM decided equals Python's (type,
    NaN and the sign of zero too) and that it decided nothing of the rest; return the bodies
    it left undecided, and the Python source's rows."""
    jvm_df = spark.read.format("logjam").schema(FIELDS_DDL + ", undecided boolean").load(archive)
    assert "JVM reader" in jvm_df._jdf.queryExecution().executedPlan().toString()
    jvm = _rows(jvm_df, ["segment", "record", *FIELDS, "undecided"])
    py = _rows(spark.read.format("logjam_python").schema(FIELDS_DDL).load(archive),
               ["segment", "record", *FIELDS])
    assert len(jvm) == len(py) == len(bodies)
    undecided = []
    for body, j, p in zip(bodies, jvm, py, strict=True):
        assert j[:2] == p[:2]
        if j[-1]:
            undecided.append(body)
            assert j[2:-1] == (None,) * 6 + (False,), body   # nothing half-decided
            continue
        for name, a, b in zip(FIELDS, j[2:-1], p[2:], strict=True):
            same = (a == b or (isinstance(a, float) and isinstance(b, float)
                               and math.isnan(a) and math.isnan(b)))
            assert same and (type(a) is type(b)), (body, name, a, b)
            if isinstance(a, float) and a == 0:
                assert math.copysign(1, a) == math.copysign(1, b), (body, name)
    return undecided, py


def test_extracted_fields_equal_python(spark, tricky):
    undecided, py = _undecided_else_equal(spark, tricky, [b for b, _ in TRICKY])
    assert undecided == [b for b, d in TRICKY if not d]
    # the Python source decides them all
    assert sum(1 for r in py if r[-1]) == sum(1 for b, _ in TRICKY if not _is_object(b))


def _is_object(body: bytes) -> bool:
    import json
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


def _table(df, key):
    rows = {}
    for r in df.collect():
        d = r.asDict()
        rows[tuple(d[k] for k in key)] = d
    return rows


KEYS = {"request_stats": ("minute", "app", "env", "action"),
        "exceptions": ("minute", "app", "env", "action", "exception"),
        "topics": ("minute", "app", "env", "topic"), "loss": ("minute", "device")}
#: float sums and averages: the summation order differs between the engines (Spark's
#: hash aggregation against per-batch partial sums); everything else exactly equal
ROUNDED = ("total_time_sum", "total_time_avg")


def assert_same_tables(a: dict, b: dict):
    for name, key in KEYS.items():
        ta, tb = _table(a[name], key), _table(b[name], key)
        assert ta.keys() == tb.keys(), (name, sorted(ta.keys() ^ tb.keys())[:3])
        assert ta, name
        for k, ra in ta.items():
            rb = tb[k]
            assert ra.keys() == rb.keys()
            for c, x in ra.items():
                y = rb[c]
                if c in ROUNDED and x is not None and y is not None:
                    assert math.isclose(x, y, rel_tol=1e-12), (name, k, c, x, y)
                else:
                    assert x == y, (name, k, c, x, y)


def test_jvm_and_sql_engines_equal_python_engine(spark, tmp_path):
    # sample traffic (malformed records, gaps, four app-envs, other topics, started_at)
    # plus the tricky bodies the JVM decides, over several segments
    # and times beyond the calendar (created_ms, started_ms: the first/last minute)
    from test_pipeline import _hostile_time_messages
    extra = sample.make_messages(4000, seed=11, malformed=True, gaps=True,
                                 base_ms=CREATED - 3 * 60_000) + _hostile_time_messages(1)
    archive = _archive(tmp_path, [b for b, d in TRICKY if d], extra=extra,
                       segment_bytes=256 << 10)
    assert len(list_segments(archive)) > 2
    assert stats.choose_engine(spark, archive) == ("jvm", "JVM reader")
    py_t, py_s, py_agg = stats.compute_tables(spark, archive, 300.0, "python")
    aggs = [py_agg]
    try:
        assert py_s["engine"] == "python"
        assert py_s["bad_json"] > 10 and py_s["bad_records"] > 3
        for engine in ("jvm", "sql"):
            t, s, agg = stats.compute_tables(spark, archive, 300.0, engine)
            aggs.append(agg)
            assert s == {**py_s, "engine": engine}
            assert_same_tables(t, py_t)
        # the jvm engine's partial rows are one per group and partition: its merge runs
        # without Spark's pre-shuffle partial aggregation (which would reduce nothing);
        # the python engine's (one row per group and Arrow batch) and the sql engine's
        # (one row per record) keep it, and the session's setting is left as it was
        plans = [a._jdf.queryExecution().executedPlan().toString() for a in aggs]
        assert ["partial_" in p for p in plans] == [True, False, True]
        assert "collect_list" in plans[1]
        assert {k: spark.conf.get(k, None) for k in stats.JVM_MERGE_CONF} == \
            dict.fromkeys(stats.JVM_MERGE_CONF)
        # the data has several values per group: the exact percentiles mean something
        big = [r for r in _table(py_t["request_stats"], KEYS["request_stats"]).values()
               if r["count"] >= 5 and r["total_time_p50"] != r["total_time_p95"]]
        assert len(big) > 20
        # the times out of range: at minute 0 (and the last day's minute), in every table
        for name, want in (("request_stats", {1970, 9999}), ("topics", {1970}),
                           ("loss", {1970})):
            years = {k[0].year for k in _table(py_t[name], KEYS[name])}
            assert want <= years, (name, years)
        # the JVM's partial rows: the schema of partial.py's; groups cut across many small
        # partitions and output batches merge to the same tables
        whole = stats.jvm_partial_frame(spark, archive, 300.0)
        assert whole.schema == stats.partial_frame(spark, archive).schema
        # values declared free of nulls: the merge's sort_array sorts a double[]
        assert whole.schema["tt_values"].dataType.containsNull is False
        sliced = spark.read.format("logjam").schema(PARTIAL_DDL) \
            .option("aggregate", "requests").option("apdexMs", "300") \
            .option("recordsPerPartition", "97").option("batchRows", "5").load(archive)
        assert sliced.rdd.getNumPartitions() > 40
        merged = stats.merge_partials(sliced)
        tables = stats.split_merged(merged)
        tables["loss"] = py_t["loss"]
        assert_same_tables(tables, py_t)
        # (the summary's loss and origin figures come from the origin walk, not the merge)
        walk = ("engine", "duplicates_left_out", "origins", "collisions", "shared_devices")
        assert stats.summary_of_merged(merged, undecided=True) == {
            **{k: v for k, v in py_s.items() if k not in walk}, "undecided": 0,
            "counts": {k: v for k, v in py_s["counts"].items()
                       if k not in ("loss", "origin_loss")}}
    finally:
        for a in aggs:
            a.unpersist()


#: UTF-8 in and around the JSON of logs bodies: Extract checks the strings' UTF-8 as it
#: walks them and the jvm engine checks a body whole only when the walk refuses it
UTF8_BODIES = [
    '{"action":"Bestellung#\u00e4","exceptions":["Fehler::\u20ac","\U0001f600"],"\u00fc\U0010ffff":"\uffff"}'.encode(),
    '{"action":"A#\u0800\ud7ff\ue000","x":{"\u07ff":["\U00010000"]},"total_time":3.5}'.encode(),
    b'{"action":"A#\x80"}',
] + [b'{"action":"A#b","total_time":1.25,"lines":[[1,"x%sy"]]}' % bad for bad in (
    b"\x80", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xed\xa0\x80",
    b"\xf0\x80\x80\x80", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff",
    b"\xe2\x82", b"\xf0\x9f\x98", b"\xc3")] + [
    b'{"action":"A#\xe2\x82',                      # ends inside a sequence (and the JSON)
    b'{"action":"A#b"}\xff',                        # after the object
    b'\xff{"action":"A#b"}',
    b'{"action":"A#b",\x80"code":200}',             # between members
    b'{"action":"A#b","code":2\xc3\xa4}',           # valid UTF-8 in a number: bad_json
    b'{"total_time":NaN,"x":"\xff"}',                # would be undecided: utf8 first
    b'{"act\\u0069on":"\xc3\x28"}',
    b'{"action":"\xff"',                            # bad UTF-8 and bad JSON
    b'\xef\xbb\xbf{"action":"\xff"}',                # BOM, then bad UTF-8
    b'[1,"\xe2\x82\xac"]',                         # valid, not an object: bad_json
]


def _mutated_utf8_bodies(n: int, seed: int = 5) -> list[bytes]:
    """Logs bodies with bytes over 0x7F put in (valid sequences, stray and truncated
    ones, overlongs, surrogates) anywhere but the first byte: no escapes and no started_at
    (another ISO form would be undecided), so nothing becomes undecided."""
    import random
    rng = random.Random(seed)
    base = [b'{"action":"Orders#show","started_ms":1700006270123,"total_time":12.5,'
            b'"code":200,"severity":1,"request_info":{"url":"/o/1","headers":{"Accept":'
            b'"text/html"}},"lines":[[1,1700000000000,"Started GET /o/1"]]}',
            '{"action":"Käse#zeigen","total_time":0.75,"exceptions":["Fehler::Ä"],'
            '"code":500}'.encode(),
            b'{"action":"Api#ping","total_time":3,"exceptions":["Timeout::Error","E"]}']
    pieces = [b"\xc3\xa4", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80", b"\xf4\x8f\xbf\xbf",
              b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xed\xa0\x80", b"\xc0\xaf",
              b"\xe0\x9f\xbf", b"\xf4\x90\x80\x80", b"\xbf", b"\x80\x80"]
    out = []
    for _ in range(n):
        b = bytearray(rng.choice(base))
        for _k in range(rng.randint(1, 3)):
            i = rng.randrange(1, len(b))
            piece = rng.choice(pieces) if rng.random() < 0.8 else bytes([rng.randrange(0x80, 0x100)])
            if rng.random() < 0.5:
                b[i:i] = piece
            else:
                b[i:i + len(piece)] = piece
        out.append(bytes(b))
    return out


def test_jvm_engine_utf8_equals_python_engine(spark, tmp_path):
    # a body that is not valid UTF-8 is a bad record (error utf8), one that is but is not
    # valid JSON is bad_json, exactly as in the python engine (the reference), wherever
    # the bytes are: in strings, keys, numbers, between members, after the object
    extra = sample.make_messages(400, seed=12, malformed=True, gaps=True,
                                 base_ms=CREATED - 3 * 60_000)
    bodies = UTF8_BODIES + _mutated_utf8_bodies(1500)
    archive = _archive(tmp_path, bodies, extra=extra, segment_bytes=128 << 10)
    py_t, py_s, py_agg = stats.compute_tables(spark, archive, 300.0, "python")
    aggs = [py_agg]
    try:
        assert py_s["engine"] == "python"
        t, s, agg = stats.compute_tables(spark, archive, 300.0, "jvm")
        aggs.append(agg)
        assert s == {**py_s, "engine": "jvm"}
        assert_same_tables(t, py_t)
        # the bodies cover all three outcomes (bad UTF-8, bad JSON, good requests)
        assert py_s["bad_records"] > 300 and py_s["bad_json"] > 50, py_s
        assert py_s["counts"]["request_stats"] > 3
    finally:
        for a in aggs:
            a.unpersist()


def _mutated_json_bodies(n: int, seed: int = 9) -> list[bytes]:
    """Logs bodies of the bench's kind with their structure damaged: bytes deleted,
    replaced or put in (brackets, quotes, commas, colons, escapes, digits, signs, letters of
    the literals, control and non-ASCII bytes), cut short, or nested 1-700 deep."""
    import random
    rng = random.Random(seed)
    base = [b'{"action":"Orders#show","started_at":"2023-11-14T23:58:01.123+01:00",'
            b'"started_ms":1700006270123,"total_time":12.5,"code":200,"severity":1,'
            b'"request_id":"a6b2","db_time":2.077,"process_id":36409,"user_id":-3846,'
            b'"request_info":{"method":"GET","url":"/o/1?page=4","headers":{"Accept":'
            b'"text/html","Cookie":"_s=f11c"},"query_parameters":{"page":"2"}},'
            b'"lines":[[2,1700000000000,"Started GET \\"/o/607\\" for 10.0.8.7"],'
            b'[3,1700000000001,"Processing by O#show as HTML"]],"ok":true,"no":null}',
            b'{"action":"Api#ping","total_time":3,"exceptions":["Timeout::Error","E"],'
            b'"x":[1.5e3,-0.0,{"y":[{}, [], {"z":[1,2,{"w":false}]}]}]}']
    chars = b'{}[],:"\\ \t\n0123456789-+.eEtrufalsnNI\x00\x1f\x7f\xc3\xa9'
    out = []
    for _ in range(n):
        b = bytearray(rng.choice(base))
        for _k in range(rng.choice((1, 1, 2, 3))):
            i = rng.randrange(len(b) + 1)
            r = rng.random()
            if r < 0.3 and b:
                del b[i % len(b)]
            elif r < 0.6:
                b.insert(i, rng.choice(chars))
            elif r < 0.85 and b:
                b[i % len(b)] = rng.choice(chars)
            elif r < 0.92:
                del b[i:]
            else:
                k = rng.randrange(1, 700)
                o = rng.choice((b"[", b'{"a":'))
                b[i:i] = o * k + (b"]" if o == b"[" else b"}") * k
        out.append(bytes(b))
    return out


def test_extracted_fields_equal_python_on_damaged_json(spark, tmp_path):
    # the JVM's walk (Extract.java) decides what Python's json decides, or leaves it
    bodies = _mutated_json_bodies(2500)
    undecided, py = _undecided_else_equal(spark, _archive(tmp_path, bodies), bodies)
    assert len(undecided) < len(bodies) // 5, len(undecided)
    # all outcomes are there: requests decided, bodies that are not JSON, undecided ones
    bad = sum(1 for r in py if r[-1])
    assert len(bodies) // 5 < bad < len(bodies) * 4 // 5 and undecided, (bad, len(undecided))


def test_undecided_body_runs_the_python_engine(spark, tmp_path, caplog):
    bodies = [b'{"action":"A#b","total_time":%d}' % i for i in range(30)]
    bodies.append(b'{"action":"A#b","total_time":NaN}')
    archive = _archive(tmp_path, bodies)
    # the jvm engine's partial rows count it (and only it)
    merged = stats.merge_partials(stats.jvm_partial_frame(spark, archive))
    assert stats.summary_of_merged(merged, undecided=True)["undecided"] == 1
    tables, summary, agg = stats.compute_tables(spark, archive)
    try:
        assert summary["engine"] == "python"
        assert "need Python's JSON rules" in caplog.text
        (row,) = tables["request_stats"].collect()
        assert row["count"] == 31
    finally:
        agg.unpersist()


def test_engine_choice(spark, tmp_path, monkeypatch, capsys):
    from logjam_relay.pipeline.cli import C1_ONLY, C2_LATE, local_batch_jvm_options
    archive = _archive(tmp_path, [b'{"action":"A#b"}'])
    assert stats.choose_engine(spark, archive)[0] == "jvm"
    # the driver JVM's JIT settings follow the engine auto will choose
    assert local_batch_jvm_options("auto", archive) == C2_LATE
    assert local_batch_jvm_options("python", archive) == C1_ONLY
    assert local_batch_jvm_options("auto", str(tmp_path / "nothing")) == C2_LATE

    def no_jar(cache_dir=None):
        raise jvmreader.BuildError("no Janino")
    with monkeypatch.context() as m:
        m.setattr(jvmreader, "build_jar", no_jar)
        assert local_batch_jvm_options("auto", archive) == C1_ONLY
        assert local_batch_jvm_options("jvm", archive) == C2_LATE
    with pytest.raises(Exception, match="option aggregate must be 'requests'"):
        spark.read.format("logjam").option("aggregate", "sums").load(archive)
    with pytest.raises(Exception, match="option aggregate: the schema is"):
        spark.read.format("logjam").schema("app string").option("aggregate", "requests") \
            .load(archive).collect()
    monkeypatch.setattr(jvmreader, "MAX_SEGMENT_BYTES", 100)
    engine, why = stats.choose_engine(spark, archive)
    assert engine == "python" and "too big" in why
    assert local_batch_jvm_options("auto", archive) == C1_ONLY
    for asked in ("jvm", "sql"):
        with pytest.raises(ValueError, match=f"engine {asked}: .*too big"):
            stats.compute_tables(spark, archive, engine=asked)
    # the command: one line naming the option and why, status 2, no traceback
    from logjam_relay.pipeline import cli
    monkeypatch.setattr(cli, "make_session", lambda *a, **k: spark)
    monkeypatch.setattr(spark, "stop", lambda: None)
    capsys.readouterr()
    rc = cli.main(["stats", "--input", archive, "--output", str(tmp_path / "o"),
                   "--master", "local[2]", "--engine", "jvm", "-q", "--jvm-cache", "off"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("logjam-relay pipeline: --engine jvm: ") and "too big" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "o")
    assert os.path.isdir(archive)


def _loss_rows(state_or_df):
    if hasattr(state_or_df, "devices"):
        rows = state_or_df.table().to_pylist()
        return {(r["device"], r["minute_ms"]): tuple(r[c] for c in LOSS_COLS) for r in rows}
    return {(r["device"], r["minute_ms"]): tuple(r[c] for c in LOSS_COLS)
            for r in state_or_df.withColumn(
                "minute_ms", (state_or_df["minute"].cast("long") * 1000)).collect()}


LOSS_COLS = ("received", "missing", "duplicates", "out_of_order", "first_sequence",
             "last_sequence")


def test_jvm_engine_loss_from_the_scans_runs(spark, tmp_path, caplog):
    """The jvm engine's loss table (from the origin walk, pipeline/origin.py) and the runs
    a scan gathers with option lossKey (LossRuns.java) equal the loss walk's over damaged
    segments (torn, a flipped bit, a bad header), duplicates, numbers out of order and
    five devices; a segment whose records make too many runs, and slices that stop short
    of a segment's end, are read again by the walk, with the same result."""
    import logging

    from logjam_relay.pipeline import decode as ds
    from logjam_relay.pipeline.loss import LossState
    from spool_helpers import damage_segments
    msgs = sample.make_messages(6000, seed=21, devices=(1, 2, 3, 4, 5),
                                base_ms=CREATED - 2 * 60_000)
    msgs += [msgs[i] for i in range(4000, 4300, 7)]                  # late duplicates
    late = set(range(2000, 2100, 5))                                 # out of order
    msgs = [m for i, m in enumerate(msgs) if i not in late] + [msgs[i] for i in sorted(late)]
    arch = tmp_path / "a"
    sample.write_archive(tmp_path / "spool", arch, msgs, segment_bytes=64 << 10)
    segs = ds.list_segments(str(arch))
    assert len(segs) >= 8
    damage_segments(segs)
    walk = LossState()
    walk.add_archive(str(arch))
    want = _loss_rows(walk)
    assert any(v[2] for v in want.values()) and any(v[3] for v in want.values())
    assert any(v[1] for v in want.values())

    caplog.set_level(logging.INFO, logger="logjam_relay.pipeline.stats")
    t, s, agg = stats.compute_tables(spark, str(arch), 300.0, "jvm")
    try:
        assert s["engine"] == "jvm"
        assert _loss_rows(t["loss"]) == want
    finally:
        agg.unpersist()
    key = "test-whole"
    spark.read.format("logjam").schema(PARTIAL_DDL).option("aggregate", "requests") \
        .option("lossKey", key).load(str(arch)).write.format("noop").mode("overwrite").save()
    st = LossState()
    assert st.add_archive_runs(str(arch), stats.take_loss_runs(spark, key)) == \
        {"segments": len(segs), "walked": 0}
    assert _loss_rows(st) == want

    # slices (recordsPerPartition): the last slice of a segment stops at its record
    # count, short of the seal, so those segments are read again; the rest join up
    key = "test-slices"
    sliced = spark.read.format("logjam").schema(PARTIAL_DDL) \
        .option("aggregate", "requests").option("lossKey", key) \
        .option("recordsPerPartition", "53").load(str(arch))
    assert sliced.rdd.getNumPartitions() > len(segs)
    sliced.write.format("noop").mode("overwrite").save()
    st = LossState()
    got = st.add_archive_runs(str(arch), stats.take_loss_runs(spark, key))
    assert _loss_rows(st) == want
    assert got["segments"] + got["walked"] == len(segs) and got["walked"] >= 1
    assert stats.take_loss_runs(spark, key) == b"\0" * 8        # taken: gone

    # every record a gap: more runs than a quarter of the records -> read again
    many = [sample.Msg(b"shop-production", b"topic", b"{}", 0, b"{}", 7,
                       CREATED + i, 3 * i + 1) for i in range(20_000)]
    arch2 = tmp_path / "b"
    sample.write_archive(tmp_path / "spool2", arch2, many, segment_bytes=8 << 20)
    assert len(ds.list_segments(str(arch2))) == 1
    walk2 = LossState()
    walk2.add_archive(str(arch2))
    caplog.clear()
    t, s, agg = stats.compute_tables(spark, str(arch2), 300.0, "jvm")
    try:
        assert _loss_rows(t["loss"]) == _loss_rows(walk2)
        assert _loss_rows(walk2)[(7, CREATED - CREATED % 60000)][1] > 10_000   # missing
    finally:
        agg.unpersist()
    key = "test-gaps"
    spark.read.format("logjam").schema(PARTIAL_DDL).option("aggregate", "requests") \
        .option("lossKey", key).load(str(arch2)).write.format("noop").mode("overwrite").save()
    st = LossState()
    assert st.add_archive_runs(str(arch2), stats.take_loss_runs(spark, key)) == \
        {"segments": 0, "walked": 1}
    assert _loss_rows(st) == _loss_rows(walk2)

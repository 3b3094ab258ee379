"""Each event counted once and loss per origin device (pipeline/origin.py), on archives
made the way a fleet's central relays write them; the Spark engines on the same archives."""

import json

import pytest

np = pytest.importorskip("numpy")
pa = pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

from logjam_relay.inputs.mapping import MappingOptions, lumberjack_v1  # noqa: E402
from logjam_relay.pipeline import origin, originindex, sample, stats  # noqa: E402
from logjam_relay.pipeline.loss import DeviceLoss  # noqa: E402

# ------------------------------------------------------------------ parsing

def test_origin_columns_parse_what_the_inputs_write():
    # the head inputs/mapping.py writes for an event of a logjam-relay output
    fields = {"type": "logjam", "line": '{"action":"A#b","n":1}', "app": "shop",
              "env": "production", "topic": "logs.shop.production", "device": "7",
              "sequence": "42", "created_ms": "1700000000123", "host": 'edge "1"'}
    app_env, _topic, body, _c, _cr = lumberjack_v1(fields, "lj", "1.2.3.4:5", MappingOptions())
    m = sample.forwarded(sample.Msg(b"shop-production", b"logs.shop.production",
                                    b'{"action":"A#b","n":1}', 0, b"", 7, 1700000000123, 42),
                         'edge "1"', 100, 5)
    assert m.body == body                       # sample.forwarded is the mapping's twin
    bodies = [body,
              b'{"logjam_origin":{"host":"1.2.3.4:5","input":"lj"},"message":"x"}',
              b'{"action":"A"}', b"not json",
              b'{"logjam_origin":{"device":99999999999999999999,"sequence":1,"created_ms":1,'
              b'"host":"h","input":"i"}}',
              b'{"logjam_origin":{"device":8,"sequence":5,"created_ms":1,"host":"h",'
              b'"input":"i"},"restart":{"skipped_from":3,"skipped_to":9}}',
              b'{"restart":{"skipped_from":10,"skipped_to":20}}',
              b'{"restart":{"skipped_from":10,"skipped_to":20}}', None]
    apps = ["shop", "x", "x", "x", "x", "heartbeat", "heartbeat", "notaheartbeat", "x"]
    envs = ["production", "y", "y", "y", "y", "", "", "", "y"]
    got = origin.origin_columns(pa.array(apps), pa.array(envs),
                                pa.array([None if b is None else b.decode() for b in bodies],
                                         pa.string()))
    assert got["origin_host"].to_pylist() == ['edge "1"', None, None, None, None, "h", None,
                                              None, None]
    assert got["origin_device"].to_pylist() == [7, None, None, None, None, 8, None, None, None]
    assert got["origin_sequence"].to_pylist() == [42, None, None, None, None, 5, None, None,
                                                  None]
    assert got["skipped_from"].to_pylist() == [None] * 5 + [3, 10, None, None]
    assert got["skipped_to"].to_pylist() == [None] * 5 + [9, 20, None, None]


def test_exclusion_option_round_trip_and_malformed():
    recs = np.array([0, 1, 2, 5, 7, 8, 100], dtype=np.int64)
    assert origin.encode_ranges(recs) == "0-2,5,7-8,100"
    got = origin.parse_exclusions("3:0-2,5,7-8,100;4:9")
    assert got[3].tolist() == recs.tolist() and got[4].tolist() == [9]
    for bad in ("3:5-2", "x:1", "3:a", "3:-1"):
        with pytest.raises(ValueError, match="option exclude is malformed"):
            origin.parse_exclusions(bad)


def test_declare_joins_the_runs_and_counts_only_what_is_new():
    d = DeviceLoss()
    d.update(np.array([1, 2, 3, 10, 11], dtype=np.int64), np.zeros(5, dtype=np.int64), False)
    assert d.missing() == {0: 6}
    assert d.declare(5, 12, 60_000) == 6            # 5..9 and 12 (10, 11 were seen)
    assert d.gaps()[0].tolist() == [4] and d.gaps()[1].tolist() == [4]
    assert d.missing() == {0: 1}
    assert d.rows[60_000][5] == 6
    assert d.declare(1, 3, 0) == 0                  # all seen: nothing skipped


# ------------------------------------------------------------------ a fleet's archives

CREATED = 1_700_006_220_000


def fleet(tmp_path):
    """Two central archives (devices 100 and 101) of what three edges forwarded:

    * edge-a (device 7): crashed once (a restart marker skipping 1,000 numbers), and after
      its failover from central 100 to 101 resent its last 40 events (copies in both
      archives); heartbeats forwarded;
    * edge-b (device 8): 25 events in a row lost at the edge (a deleted spool segment); a
      window of 30 resent into the same archive; heartbeats forwarded;
    * edge-c and edge-d both use device 9 (a collision): kept apart.
    Returns (archive dirs, the unique events delivered, what was lost)."""
    a = sample.edge_stream(600, 7, host="edge-a", seed=1, heartbeat_every=40)
    last = a[-1].sequence
    a.append(sample.restart_marker(7, CREATED + 300_000, last + 1001, last + 1, last + 1000,
                                   "edge-a"))
    a += sample.edge_stream(200, 7, host="edge-a", seed=2, heartbeat_every=40,
                            first=last + 1002, base_ms=CREATED + 300_000)
    b = sample.edge_stream(500, 8, host="edge-b", seed=3, heartbeat_every=30)
    lost_b = b[200:225]
    b_sent = b[:200] + b[225:]
    c = sample.edge_stream(100, 9, host="edge-c", seed=4, heartbeat_every=0)
    d = sample.edge_stream(100, 9, host="edge-d", seed=5, heartbeat_every=0)
    seqs = {100: 0, 101: 0}

    def central(dev, msgs, host):
        out = []
        for m in msgs:
            seqs[dev] += 1
            out.append(sample.forwarded(m, host, dev, seqs[dev], comp=(seqs[dev] % 4)))
        return out
    c100 = central(100, a[:500], "edge-a") + central(100, b_sent[:300], "edge-b") \
        + central(100, b_sent[270:300], "edge-b") + central(100, b_sent[300:], "edge-b") \
        + central(100, c, "edge-c")
    c101 = central(101, a[460:], "edge-a") + central(101, d, "edge-d")
    dirs = []
    for name, msgs in (("c100", c100), ("c101", c101)):
        sample.write_archive(tmp_path / f"spool-{name}", tmp_path / name, msgs,
                             segment_bytes=64 << 10, batch=97)
        dirs.append(str(tmp_path / name))
    unique = c100[:500] + c100[500:800] + c100[830:] + c101[40:]
    return dirs, unique, (a, b, lost_b), (len(c100), len(c101))


def reference(msgs):
    return stats.reference_tables([{"app_env": m.app_env.decode(), "topic": m.topic.decode(),
                                    "body": m.payload, "device": m.device,
                                    "sequence": m.sequence, "created_ms": m.created_ms}
                                   for m in msgs])


def test_origin_index_of_a_fleet(tmp_path):
    dirs, unique, (a, b, lost_b), sizes = fleet(tmp_path)
    idx = originindex.OriginIndex().add_archives(dirs)
    assert idx.records == sum(sizes)
    assert idx.excluded == 40 + 30
    assert sum(len(v) for v in idx.exclude.values()) == 70
    assert idx.collisions == {9: ["edge-c", "edge-d"]}
    assert idx.shared_devices == {}
    rows = idx.origin_table().to_pylist()
    by = {}
    for r in rows:
        k = (r["host"], r["device"])
        t = by.setdefault(k, dict.fromkeys(("received", "missing", "duplicates",
                                            "out_of_order", "skipped"), 0))
        for c in t:
            t[c] += r[c]
    assert by[("edge-a", 7)] == {"received": len(a) + 40, "missing": 0, "duplicates": 40,
                                 "out_of_order": 0, "skipped": 1000}
    assert by[("edge-b", 8)] == {"received": len(b) - 25 + 30, "missing": 25,
                                 "duplicates": 30, "out_of_order": 0, "skipped": 0}
    assert by[("edge-c", 9)]["missing"] == by[("edge-d", 9)]["missing"] == 0
    assert by[("edge-c", 9)]["duplicates"] == by[("edge-d", 9)]["duplicates"] == 0
    gaps = idx.gaps_table().to_pylist()
    assert [(g["hop"], g["host"], g["device"], g["first_missing"], g["last_missing"],
             g["count"]) for g in gaps] == \
        [("origin", "edge-b", 8, lost_b[0].sequence, lost_b[-1].sequence, 25)]
    last = {r["device"]: r for r in idx.last.table().to_pylist()}
    assert set(last) == {100, 101}
    assert sum(r["missing"] for r in idx.last.table().to_pylist()) == 0


# ------------------------------------------------------------------ Spark

@pytest.fixture(scope="module")
def spark():
    from conftest import local_spark_session
    from logjam_relay.pipeline import jvmreader
    s = local_spark_session("logjam-relay-origin-tests")
    if not jvmreader.loaded(s):
        s.stop()
        pytest.fail("the JVM reader did not load")
    yield s
    s.stop()


def _rows(df, cols):
    return sorted(tuple(r[c] for c in cols) for r in df.collect())


def _viewfs(spark, dirs, name):
    """``dirs`` as ``viewfs://NAME/aK`` URIs: Hadoop's view file system, mounted on the
    local directories by Spark's Hadoop configuration only (no Python reader knows the
    scheme: what reads them reads through Hadoop)."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    out = []
    for k, d in enumerate(dirs):
        conf.set(f"fs.viewfs.mounttable.{name}.link./a{k}", f"file://{d}")
        out.append(f"viewfs://{name}/a{k}")
    return out


@pytest.mark.parametrize("engine,where", [("jvm", "path"), ("sql", "path"),
                                          ("python", "path"), ("jvm", "file"),
                                          ("sql", "file"), ("python", "file"),
                                          ("jvm", "viewfs")])
def test_every_engine_counts_each_origin_once(spark, tmp_path, engine, where):
    """... from plain paths, from file:// URIs (the JVM reader and the walk read through
    Hadoop; the python engine reads their paths) and from a Hadoop-only scheme."""
    dirs, unique, (_a, _b, lost_b), _sizes = fleet(tmp_path)
    if where == "file":
        dirs = [f"file://{d}" for d in dirs]
    elif where == "viewfs":
        dirs = _viewfs(spark, dirs, f"engines{engine}")
    ref = reference(unique)
    tables, summary, agg = stats.compute_tables(spark, dirs, 300.0, engine)
    try:
        assert summary["engine"] == engine
        assert summary["duplicates_left_out"] == 70
        assert summary["collisions"] == {9: ["edge-c", "edge-d"]}
        req = tables["request_stats"]
        assert sum(r["count"] for r in req.collect()) == \
            sum(r["count"] for r in ref["request_stats"])
        cols = ("minute", "app", "env", "action", "count", "total_time_sum", "http_5xx")
        want = sorted((r["minute_ms"], r["app"], r["env"], r["action"], r["count"],
                       r["total_time_sum"], r["http_5xx"]) for r in ref["request_stats"])
        got = [(int(m.timestamp() * 1000),) + t[1:] for (m, *rest) in _rows(req, cols)
               for t in [(m, *rest)]]
        assert [g[:5] + (round(g[5], 6), g[6]) for g in sorted(got)] == \
            [w[:5] + (round(w[5], 6), w[6]) for w in want]
        assert sum(r["count"] for r in tables["exceptions"].collect()) == \
            sum(r["count"] for r in ref["exceptions"])
        assert sum(r["count"] for r in tables["topics"].collect()) == \
            sum(r["count"] for r in ref["topics"])
        gaps = [(r["hop"], r["host"], r["device"], r["first_missing"], r["last_missing"])
                for r in tables["gaps"].collect()]
        assert gaps == [("origin", "edge-b", 8, lost_b[0].sequence, lost_b[-1].sequence)]
        ol = tables["origin_loss"].collect()
        assert sum(r["missing"] for r in ol if r["device"] == 8) == 25
        assert sum(r["missing"] for r in ol if r["device"] != 8) == 0
        assert sum(r["skipped"] for r in ol if r["device"] == 7) == 1000
    finally:
        agg.unpersist()


def test_the_walk_through_spark_equals_the_walk_here(spark, tmp_path):
    """An archive given as a URI is walked by a Spark job (the executors read through
    Hadoop); everything the walk gives equals the driver's own walk of the same files."""
    dirs, _unique, _x, _sizes = fleet(tmp_path)
    here = originindex.OriginIndex().add_archives(dirs)
    for uris in ([f"file://{d}" for d in dirs], _viewfs(spark, dirs, "walk"),
                 [dirs[0], f"file://{dirs[1]}"]):
        there = originindex.OriginIndex().add_archives(uris, spark=spark)
        assert (there.records, there.segments, there.excluded) == \
            (here.records, here.segments, here.excluded), uris
        assert there.excluded == 70
        for u, d in zip(uris, dirs, strict=True):
            assert there.exclusions_of(u) == here.exclusions_of(d) != "", u
        assert there.origin_table().equals(here.origin_table())
        assert there.gaps_table().equals(here.gaps_table())
        assert there.last.table().equals(here.last.table())
        assert (there.collisions, there.shared_devices) == \
            (here.collisions, here.shared_devices)
    with pytest.raises(ValueError, match="a URI is read by a Spark job"):
        originindex.OriginIndex().add_archives([f"file://{dirs[0]}"])


def test_a_scheme_hadoop_lacks_or_the_python_engine_says_so_in_one_line(spark, tmp_path):
    dirs, _unique, _x, _sizes = fleet(tmp_path)
    with pytest.raises(Exception, match="cannot be read through Hadoop: "
                       "UnsupportedFileSystemException"):
        stats.compute_tables(spark, ["nosuchfs://x/archive"], 300.0, "jvm")
    uris = _viewfs(spark, dirs, "python")
    with pytest.raises(stats.EngineUnavailable,
                       match="the python engine reads local archives only .* not viewfs://"):
        stats.compute_tables(spark, uris, 300.0, "python")
    with pytest.raises(Exception, match="is not a directory"):
        stats.compute_tables(spark, [f"file://{tmp_path}/none"], 300.0, "jvm")


def test_data_source_origin_columns_and_exclude(spark, tmp_path):
    dirs, _unique, _x, _sizes = fleet(tmp_path)
    df = spark.read.format("logjam").schema(
        "device long, sequence long, segment long, record int, " + origin.ORIGIN_DDL) \
        .load(dirs[0])
    rows = df.collect()
    assert all(r["origin_device"] in (7, 8, 9) for r in rows)
    idx = originindex.OriginIndex().add_archives(dirs)
    ex = idx.exclusions_of(dirs[0])
    assert ex
    for fmt_name in ("logjam", "logjam_python"):
        kept = spark.read.format(fmt_name).option("exclude", ex).load(dirs[0]).count()
        assert kept == len(rows) - 30, fmt_name
    with pytest.raises(Exception, match="option exclude is malformed"):
        spark.read.format("logjam").option("exclude", "1:x").load(dirs[0]).count()


def test_run_batch_writes_the_origin_tables(spark, tmp_path):
    dirs, _unique, (_a, _b, lost_b), _sizes = fleet(tmp_path)
    out = tmp_path / "out"
    lines = []
    summary = stats.run_batch(spark, dirs, str(out), 300.0, log=lines.append)
    for t in stats.TABLES:
        assert (out / t).is_dir(), t
    text = "\n".join(map(str, lines))
    assert "70 copies of events that arrived more than once left out" in text
    assert "warning: device 9 is used by more than one origin host ('edge-c', 'edge-d')" \
        in text
    assert summary["tables"]["gaps"] == 1
    json.dumps(summary)
    # the report shows the origin devices first, with their exact missing numbers
    from logjam_relay.pipeline.report import write_report
    r = write_report(str(out), str(tmp_path / "r.html"))
    html = (tmp_path / "r.html").read_text()
    assert html.index('data-table="origin_devices"') < html.index('data-table="devices"')
    gaps = html[html.index('data-table="origin_gaps"'):]
    gaps = gaps[:gaps.index("</table>")]
    assert gaps.count("<tr>") == 2                  # the head and one gap
    assert f'data-from="{lost_b[0].sequence}" data-to="{lost_b[-1].sequence}"' in gaps
    assert r["missing"] == 25 and r["origins"] == 4          # edge-a, edge-b, edge-c, edge-d


def test_streaming_counts_each_origin_once(spark, tmp_path):
    """--stream over two archives (one stream each): the same tables as a batch run."""
    import pyarrow.dataset as pads
    dirs, unique, (_a, _b, lost_b), _sizes = fleet(tmp_path)
    ref = reference(unique)
    out = tmp_path / "out"
    stats.run_stream(spark, dirs, str(out), str(tmp_path / "ckpt"), 300.0,
                     available_now=True, max_records_per_trigger=900, log=lambda *_: None)

    def table(name):
        return pads.dataset(str(out / name), partitioning="hive").to_table().to_pylist()
    assert sum(r["count"] for r in table("request_stats")) == \
        sum(r["count"] for r in ref["request_stats"])
    assert sum(r["count"] for r in table("topics")) == sum(r["count"] for r in ref["topics"])
    assert sum(r["count"] for r in table("exceptions")) == \
        sum(r["count"] for r in ref["exceptions"])
    assert [(g["hop"], g["host"], g["device"], g["first_missing"], g["last_missing"])
            for g in table("gaps")] == \
        [("origin", "edge-b", 8, lost_b[0].sequence, lost_b[-1].sequence)]
    ol = table("origin_loss")
    assert sum(r["missing"] for r in ol if r["device"] == 8) == 25
    assert sum(r["duplicates"] for r in ol) == 70
    assert sum(r["skipped"] for r in ol if r["device"] == 7) == 1000

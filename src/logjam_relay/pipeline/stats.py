"""The stats pipeline: four Parquet tables from archived logjam records.

* ``request_stats`` -- per date, minute, app, env, action (``logs*`` topics): count,
  total_time sum/avg/max/p50/p95/p99 (exact percentiles, linear interpolation), apdex,
  http_2xx..http_5xx, severity_0..severity_5
* ``exceptions`` -- per date, minute, app, env, action, exception: count
* ``loss`` -- per date, minute, device: received, missing, duplicates, out_of_order
* ``topics`` -- per date, minute, app, env, topic for the non-``logs`` topics: count
* ``origin_loss`` -- per date, minute, origin host, origin device (events that came through
  relays: :mod:`.origin`): received, missing, duplicates, out_of_order, skipped
* ``gaps`` -- the missing sequence numbers as ranges, per origin device and per last-hop
  device (``hop``)

Every event counts once: a copy of an event seen before (the same origin host, device and
sequence, :mod:`.origin`) is left out of request_stats, exceptions and topics.

Definitions (identical in the DataFrame code and in :func:`reference_tables`, the plain
Python implementation the tests compare against) are in ``docs/pipeline.md``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import time
from urllib.parse import unquote, urlsplit

from .minutes import minute_col, minutes_of, request_time_col

TABLES = ("request_stats", "exceptions", "loss", "topics", "origin_loss", "gaps")
RECORDS_DIR = "_records"
DEFAULT_APDEX_MS = 500.0

#: the batch scan: every column the three request/topic tables and the summary need, the
#: request fields extracted by the data source (no body column, no JSON parsing in Spark)
SCAN_DDL = ("app string, env string, topic string, created_ms long, error string, "
            "action string, started_ms long, total_time double, code int, severity int, "
            "exceptions array<string>, bad_json boolean")
#: the batch scan of the SQL engine (the JVM reader extracts the request fields; rows it
#: leaves to the Python definitions are flagged ``undecided``)
JVM_SCAN_DDL = SCAN_DDL + ", undecided boolean"
#: the loss scan: meta frames only (bodies are not even decompressed)
LOSS_DDL = "device long, sequence long, created_ms long, segment long, record int"
#: what the streaming mode keeps in OUT/_records: both of the above
RECORD_DDL = ("app string, env string, topic string, device long, sequence long, "
              "created_ms long, error string, segment long, record int, action string, "
              "started_ms long, total_time double, code int, severity int, "
              "exceptions array<string>, bad_json boolean")

# kinds of the combined aggregation's keys (one numbering with the partial rows)
from .partial import K_EXCEPTION, K_OTHER, K_REQUEST, K_TOPIC, K_UNDECIDED  # noqa: E402,F401

# --------------------------------------------------------------------- Spark side


def _with_minute(df, ms_col: str):
    from pyspark.sql import functions as F
    ts = F.timestamp_millis(F.col(ms_col))
    return df.withColumn("minute", ts).withColumn("date", F.to_date(ts))


def aggregate(df, apdex_ms: float = DEFAULT_APDEX_MS, undecided: bool = False):
    """One pass over scanned rows (:data:`SCAN_DDL` columns) -> one small DataFrame holding
    the groups of request_stats and topics (each row is exactly one item: a request, a
    topic count, or "other" for the summary), with the exception names of each request
    group collected, and the input summary counters: a single hash aggregation.
    ``undecided``: the rows have the JVM reader's ``undecided`` column (:data:`JVM_SCAN_DDL`),
    counted in ``_undecided``."""
    from pyspark.sql import functions as F
    is_logs = F.coalesce(F.col("topic").startswith("logs"), F.lit(False))
    valid = is_logs & F.col("error").isNull() & ~F.coalesce(F.col("bad_json"), F.lit(False))
    is_topic = F.col("topic").isNotNull() & ~is_logs & F.col("created_ms").isNotNull() & \
        ~((F.col("app") == "heartbeat") & (F.col("env") == ""))
    kind = F.when(valid, K_REQUEST).when(is_topic, K_TOPIC).otherwise(K_OTHER)
    keyed = F.when(valid, 1).when(is_topic, 1)
    x = df.select(
        kind.alias("kind"),
        F.when(valid, minute_col(request_time_col(F.col("started_ms"), F.col("created_ms"))))
         .when(is_topic, minute_col(F.col("created_ms"))).alias("minute_ms"),
        F.when(keyed.isNotNull(), F.col("app")).alias("app"),
        F.when(keyed.isNotNull(), F.col("env")).alias("env"),
        F.when(valid, F.coalesce(F.col("action"), F.lit("unknown")))
         .when(is_topic, F.col("topic")).alias("name"),
        F.when(valid, F.col("total_time")).alias("tt"),
        F.when(valid, F.col("code")).alias("code"),
        F.when(valid, F.col("severity")).alias("severity"),
        F.when(valid, F.array_compact(F.col("exceptions"))).alias("exceptions"),
        F.col("error"),
        F.coalesce(F.col("bad_json"), F.lit(False)).alias("bad_json"),
        *([F.col("undecided")] if undecided else []))
    tt = F.col("tt")
    t = float(apdex_ms)

    def count_if(c):
        return F.count(F.when(c, 1))

    code = F.col("code")
    aggs = [
        F.count(F.lit(1)).alias("count"),
        F.sum(tt).alias("total_time_sum"),
        F.avg(tt).alias("total_time_avg"),
        F.max(tt).alias("total_time_max"),
        F.percentile(tt, F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99))).alias("_pct"),
        F.try_divide(count_if(tt <= t) + 0.5 * count_if((tt > t) & (tt <= 4 * t)),
                     F.count(tt)).alias("apdex"),
        *(count_if((code >= k * 100) & (code < k * 100 + 100)).alias(f"http_{k}xx")
          for k in (2, 3, 4, 5)),
        *(count_if(F.col("severity") == k).alias(f"severity_{k}") for k in range(6)),
        F.flatten(F.collect_list("exceptions")).alias("_exceptions"),
        F.count(F.lit(1)).alias("_rows"),
        count_if(F.col("error").isNotNull()).alias("_bad"),
        count_if(F.coalesce(F.col("error").startswith("corrupt"), F.lit(False)))
        .alias("_corrupt"),
        count_if(F.col("bad_json")).alias("_bad_json"),
        *([count_if(F.col("undecided")).alias("_undecided")] if undecided else []),
    ]
    return x.groupBy("kind", "minute_ms", "app", "env", "name").agg(*aggs)


REQUEST_COLUMNS = ["date", "minute", "app", "env", "action", "count", "total_time_sum",
                   "total_time_avg", "total_time_max", "total_time_p50", "total_time_p95",
                   "total_time_p99", "apdex", *(f"http_{k}xx" for k in (2, 3, 4, 5)),
                   *(f"severity_{k}" for k in range(6))]


def _request_table(a):
    from pyspark.sql import functions as F
    return a.where(F.col("kind") == K_REQUEST).withColumnRenamed("name", "action") \
        .withColumn("total_time_p50", F.col("_pct")[0]) \
        .withColumn("total_time_p95", F.col("_pct")[1]) \
        .withColumn("total_time_p99", F.col("_pct")[2]).select(*REQUEST_COLUMNS)


def _topic_table(a):
    from pyspark.sql import functions as F
    return a.where(F.col("kind") == K_TOPIC).select(
        "date", "minute", "app", "env", F.col("name").alias("topic"), "count")


def split(agg) -> dict:
    """The three tables from :func:`aggregate`'s result."""
    from pyspark.sql import functions as F
    a = _with_minute(agg, "minute_ms")
    exc = a.where(F.col("kind") == K_REQUEST).select(
        "date", "minute", "app", "env", F.col("name").alias("action"),
        F.explode("_exceptions").alias("exception")) \
        .groupBy("date", "minute", "app", "env", "action", "exception") \
        .agg(F.count(F.lit(1)).alias("count"))
    return {"request_stats": _request_table(a), "exceptions": exc, "topics": _topic_table(a)}


LOSS_COLUMNS = ["date", "minute", "device", "received", "missing", "duplicates",
                "out_of_order", "first_sequence", "last_sequence", "skipped"]
ORIGIN_LOSS_COLUMNS = ["date", "minute", "host", "device", "received", "missing",
                       "duplicates", "out_of_order", "first_sequence", "last_sequence",
                       "skipped"]
GAPS_COLUMNS = ["date", "minute", "hop", "host", "device", "first_missing", "last_missing",
                "count"]


def _frame(spark, table, columns):
    """A small DataFrame of an Arrow table with ``minute_ms`` (an empty one keeps its
    schema: createDataFrame of an empty Arrow table infers none)."""
    if table.num_rows == 0:
        from pyspark.sql.pandas.types import from_arrow_schema
        df = spark.createDataFrame([], from_arrow_schema(table.schema))
    else:
        df = spark.createDataFrame(table)
    return _with_minute(df, "minute_ms").select(*columns)


def loss_table(spark, state, minutes_by_device=None):
    """The loss table (a small DataFrame) from a :class:`.loss.LossState`."""
    return _frame(spark, state.table(minutes_by_device), LOSS_COLUMNS)


def origin_tables(spark, index) -> dict:
    """The origin_loss and gaps tables from an :class:`.originindex.OriginIndex`."""
    return {"origin_loss": _frame(spark, index.origin_table(), ORIGIN_LOSS_COLUMNS),
            "gaps": _frame(spark, index.gaps_table(), GAPS_COLUMNS)}


PCT_QS = (0.5, 0.95, 0.99)


def _with_percentiles_of_sorted(df, v: str = "_v"):
    """``df`` plus ``_pct``: Spark's exact ``percentile`` (linear interpolation) at
    :data:`PCT_QS` of the ascending array column ``v``, with the same double arithmetic
    as ``PercentileBase.getPercentile`` (Spark 4.x) and ``reference._percentile``: position
    (n-1)*q, lower/higher = floor/ceil, and ``v[lower] + (pos - lower) * (v[higher] -
    v[lower])`` unless they coincide (the sql engine's ``percentile`` gives the same bits;
    ``tests/test_pipeline_sql.py`` compares them).

    Built in stacked projections (positions, then the two elements -- only of a non-empty
    array: ``element_at(v, 0)`` is an error --, then the value), each value named once:
    Spark does not merge a projection into the next when that would repeat an expression
    that is not cheap (``CollapseProject``), so the generated code stays small.  Written as one expression, every ``element_at`` and ``floor`` was
    repeated per use: a 250 kB method that cost HotSpot's C2 compiler 3.4 CPU-s per run
    at 10M records."""
    from pyspark.sql import functions as F
    n = F.col("_n")
    df = df.withColumn("_n", F.size(v))
    df = df.select("*", *(((n - F.lit(1)).cast("double") * F.lit(q)).alias(f"_pos{i}")
                          for i, q in enumerate(PCT_QS)))
    df = df.select("*", *(c for i in range(len(PCT_QS)) for c in (
        F.floor(f"_pos{i}").alias(f"_lo{i}"), F.ceil(f"_pos{i}").alias(f"_hi{i}"))))
    df = df.select("*", *(c for i in range(len(PCT_QS)) for c in (
        F.when(n > 0, F.element_at(v, (F.col(f"_lo{i}") + 1).cast("int"))).alias(f"_a{i}"),
        F.when(n > 0, F.element_at(v, (F.col(f"_hi{i}") + 1).cast("int"))).alias(f"_b{i}"))))

    def value(i):
        pos, lo, hi, a, b = (F.col(f"_{x}{i}") for x in ("pos", "lo", "hi", "a", "b"))
        return F.when(n == 0, F.lit(None).cast("double")) \
            .when((lo == hi) | (a == b), a) \
            .otherwise(a + (pos - lo.cast("double")) * (b - a))
    return df.withColumn("_pct", F.array(*(value(i) for i in range(len(PCT_QS)))))


def merge_partials(partial):
    """Spark's half of the aggregate pushdown: merge the reader's partial rows
    (:mod:`.partial`, one per group and batch) into one row per group, with the columns
    :func:`aggregate` gives (the request metrics, ``_rows``/``_bad``/... summary counters)
    plus ``exception`` (the K_EXCEPTION rows' key)."""
    from pyspark.sql import functions as F
    counts = ("apdex_s", "apdex_t", *(f"http_{k}xx" for k in (2, 3, 4, 5)),
              *(f"severity_{k}" for k in range(6)))
    g = partial.groupBy("kind", "minute_ms", "app", "env", "name", "exception").agg(
        F.sum("count").alias("count"), F.sum("tt_n").alias("_tt_n"),
        F.sum("tt_sum").alias("total_time_sum"), F.max("tt_max").alias("total_time_max"),
        F.sort_array(F.flatten(F.collect_list("tt_values"))).alias("_v"),
        *(F.sum(c).alias(c) for c in counts),
        *(F.sum(c).alias(f"_{c}") for c in ("rows", "bad", "corrupt", "bad_json")))
    n = F.col("_tt_n")
    return _with_percentiles_of_sorted(g).select(
        "kind", "minute_ms", "app", "env", "name", "exception", "count", "total_time_sum",
        F.when(n > 0, F.col("total_time_sum") / n.cast("double")).alias("total_time_avg"),
        "total_time_max", "_pct",
        F.try_divide(F.col("apdex_s") + 0.5 * F.col("apdex_t"), n).alias("apdex"),
        *(f"http_{k}xx" for k in (2, 3, 4, 5)), *(f"severity_{k}" for k in range(6)),
        "_rows", "_bad", "_corrupt", "_bad_json")


def split_merged(agg) -> dict:
    """The three tables from :func:`merge_partials`' result."""
    from pyspark.sql import functions as F
    a = _with_minute(agg, "minute_ms")
    exc = a.where(F.col("kind") == K_EXCEPTION).select(
        "date", "minute", "app", "env", F.col("name").alias("action"), "exception", "count")
    return {"request_stats": _request_table(a), "exceptions": exc, "topics": _topic_table(a)}


def summary_of_merged(agg, undecided: bool = False) -> dict:
    """The input summary and the row count of each table, in one (small) job;
    ``undecided``: also the count of the JVM reader's K_UNDECIDED rows (``undecided``)."""
    from pyspark.sql import functions as F
    und = [F.sum(F.when(F.col("kind") == K_UNDECIDED, F.col("count"))).alias("undecided")] \
        if undecided else []
    r = agg.agg(*(F.sum(c).alias(c) for c in ("_rows", "_bad", "_corrupt", "_bad_json")),
                *(F.count(F.when(F.col("kind") == k, 1)).alias(n) for k, n in (
                    (K_REQUEST, "request_stats"), (K_EXCEPTION, "exceptions"),
                    (K_TOPIC, "topics"))), *und).collect()[0]
    out = {"rows_in": r["_rows"] or 0, "bad_records": r["_bad"] or 0,
           "corrupt_segments": r["_corrupt"] or 0, "bad_json": r["_bad_json"] or 0,
           "counts": {n: r[n] for n in ("request_stats", "exceptions", "topics")}}
    if undecided:
        out["undecided"] = r["undecided"] or 0
    return out


def archive_dirs(input_dir) -> list[str]:
    """The archive directories of ``input_dir``: one path, or a list of them (the archives
    of several relays, read as one: a fleet's central relays, ``docs/fleet.md``)."""
    return [input_dir] if isinstance(input_dir, (str, os.PathLike)) else list(input_dir)


def partial_frame(spark, input_dir, apdex_ms: float = DEFAULT_APDEX_MS, index=None):
    """The reader's partial aggregates (:mod:`.partial`) of an archive as a DataFrame: one
    Spark task per few slices of the segments, each decoding its slices in a Python worker
    (``mapInArrow``) and grouping every batch before anything goes to the JVM.
    ``index``: an :class:`.originindex.OriginIndex` whose copies are left out."""
    from .partial import cut_slices, partial_schema, plan_segments, read_slices
    slices = cut_slices([s for d in archive_dirs(input_dir) for s in plan_segments(d)],
                        spark.sparkContext.defaultParallelism)
    exclude = dict(index.exclude) if index is not None and index.excluded else None
    t = float(apdex_ms)

    def read(batches):
        for b in batches:
            yield from read_slices(slices, b.column(0).to_pylist(), t, exclude=exclude)

    n = max(1, len(slices))
    return spark.range(0, len(slices), 1, numPartitions=n).mapInArrow(read, partial_schema())


ENGINES = ("jvm", "sql", "python")


class EngineUnavailable(ValueError):
    """The engine asked for by name cannot read this archive in this session (the JVM
    reader did not load, or a segment is too big for it): ``why``."""

    def __init__(self, engine: str, why: str):
        super().__init__(f"engine {engine}: {why}")
        self.engine, self.why = engine, why


def choose_engine(spark, input_dir) -> tuple[str, str]:
    """(engine, why) of a batch run -- the one place that picks it.

    * ``jvm`` (the default when the reader loads): the JVM reader (:mod:`.jvmreader`)
      decodes each partition's records, extracts the request fields and aggregates them
      itself (``option("aggregate", "requests")``: the partial rows of :mod:`.partial`, one
      per group and partition); Spark merges them as the python engine's
      (:func:`merge_partials`): no row per record, no Python worker.
    * ``sql`` (only when asked for): the JVM reader extracts the request fields into
      columnar batches, one Spark SQL aggregation (:func:`aggregate`) makes the tables.
    * ``python``: Python tasks (``mapInArrow``) decode slices and pre-aggregate each batch
      (:mod:`.partial`); Spark merges the partial rows.  Used when the session's JVM cannot
      load the reader (no jar, Spark Connect) or a segment is too big for it."""
    from .jvmreader import loaded
    if not loaded(spark):
        return "python", "the JVM reader is not loaded in this session"
    for d in archive_dirs(input_dir):
        big = too_big_for_the_jvm(d)
        if big:
            return "python", f"{big} is too big for the JVM reader"
    return "jvm", "JVM reader"


def too_big_for_the_jvm(input_dir: str) -> str | None:
    """The first segment of the archive the JVM reader cannot read (one Java array per
    file), or None."""
    from .archives import local_path
    from .decode import list_segments
    from .jvmreader import MAX_SEGMENT_BYTES
    input_dir = local_path(input_dir)
    if input_dir is None:               # another file system: the JVM reader checks it
        return None
    for _segno, path in list_segments(input_dir):
        try:
            if os.path.getsize(path) > MAX_SEGMENT_BYTES:
                return path
        except OSError:
            pass                        # the reader reports it as a row
    return None


def finish_tables(spark, tables: dict, summary: dict, index) -> None:
    tables["loss"] = loss_table(spark, index.last)
    tables.update(origin_tables(spark, index))
    summary["counts"]["loss"] = sum(len(d.rows) for d in index.last.devices.values())
    summary["counts"]["origin_loss"] = sum(len(d.rows) for d in index.origin.values())
    summary["duplicates_left_out"] = index.excluded
    summary["origins"] = len(index.origin)
    summary["collisions"] = index.collisions
    summary["shared_devices"] = index.shared_devices


def compute_tables(spark, input_dir, apdex_ms: float = DEFAULT_APDEX_MS,
                   engine: str | None = None):
    """(tables, summary, agg) of an archive directory, or of several (a list);
    ``summary["engine"]`` names the engine that made them (:func:`choose_engine` when
    ``engine`` is None).  First the driver walks the archives in arrival order
    (:mod:`.originindex`): the loss tables, and the copies of events that arrived more
    than once, which the engine then leaves out, so that every event counts once."""
    dirs = archive_dirs(input_dir)
    if engine is None:
        engine, _why = choose_engine(spark, dirs)
    elif engine in ("jvm", "sql"):
        can, why = choose_engine(spark, dirs)
        if can != "jvm":
            raise EngineUnavailable(engine, why)
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: one of {', '.join(ENGINES)}")
    if engine == "python":
        from .archives import local_only
        try:
            local_only(dirs, "the python engine")
        except ValueError as e:
            raise EngineUnavailable("python", str(e)) from None
    # the walk first (its threads read ahead), then one run of the engine that leaves
    # the copies out: a walk beside the engine would need a second run whenever an event
    # arrived twice, which in a fleet is every restart of an edge
    from .originindex import OriginIndex
    index = OriginIndex().add_archives(dirs, spark=spark)
    if index.excluded:
        import logging
        logging.getLogger("logjam_relay.pipeline.stats").info(
            "%d copies of events that arrived more than once: left out", index.excluded)
    got = _run_engine(spark, dirs, apdex_ms, engine, index)
    tables, summary, agg = got
    finish_tables(spark, tables, summary, index)
    return tables, summary, agg


def _run_engine(spark, dirs: list[str], apdex_ms: float, engine: str, index):
    """(tables, summary, agg) of one engine; the ``jvm`` and ``sql`` engines fall back to
    ``python`` when some bodies need Python's JSON rules (they return None)."""
    if engine in ("jvm", "sql"):
        run = compute_tables_jvm if engine == "jvm" else compute_tables_sql
        got = run(spark, dirs, apdex_ms, index)
        if got is not None:
            return got
    from .archives import local_only
    try:
        local = local_only(dirs, "the python engine")
    except ValueError as e:
        raise EngineUnavailable("python", str(e)) from None
    return compute_tables_python(spark, local, apdex_ms, index)


def summary_of_agg(agg) -> dict:
    """:func:`summary_of_merged` for :func:`aggregate`'s result (with ``_undecided``): the
    exceptions table's rows are the distinct exception names of each request group."""
    from pyspark.sql import functions as F
    req = F.col("kind") == K_REQUEST
    r = agg.agg(*(F.sum(c).alias(c) for c in ("_rows", "_bad", "_corrupt", "_bad_json",
                                               "_undecided")),
                F.count(F.when(req, 1)).alias("request_stats"),
                F.sum(F.when(req, F.size(F.array_distinct("_exceptions")))).alias("exceptions"),
                F.count(F.when(F.col("kind") == K_TOPIC, 1)).alias("topics")).collect()[0]
    return {"rows_in": r["_rows"] or 0, "bad_records": r["_bad"] or 0,
            "corrupt_segments": r["_corrupt"] or 0, "bad_json": r["_bad_json"] or 0,
            "undecided": r["_undecided"] or 0,
            "counts": {n: r[n] or 0 for n in ("request_stats", "exceptions", "topics")}}


def _union(frames):
    import functools
    return functools.reduce(lambda a, b: a.unionByName(b), frames)


def _excluding(reader, input_dir: str, index):
    """``reader`` with the ``exclude`` option of ``input_dir`` (:mod:`.origin`)."""
    if index is not None and index.excluded:
        ex = index.exclusions_of(input_dir)
        if ex:
            return reader.option("exclude", ex)
    return reader


def sql_frame(spark, input_dir, index=None):
    """The JVM reader's scan of the SQL engine (:data:`JVM_SCAN_DDL`); ``index``: an
    :class:`.originindex.OriginIndex` whose copies are left out."""
    return _union([_excluding(spark.read.format("logjam").schema(JVM_SCAN_DDL), d, index)
                   .load(d) for d in archive_dirs(input_dir)])


def compute_tables_sql(spark, input_dir, apdex_ms: float = DEFAULT_APDEX_MS, index=None):
    """The ``sql`` engine: the JVM reader's columnar batches (request fields extracted on
    the JVM, :data:`JVM_SCAN_DDL`) into :func:`aggregate`, one hash aggregation, then
    :func:`split`.  None when some ``logs`` bodies need the Python definitions of the
    fields (``undecided``: escapes in the strings kept, another ISO form of
    ``started_at``, NaN, integers beyond 64 bits, very deep nesting): the caller then runs
    the ``python`` engine, which decides every body.  No loss tables (:func:`compute_tables`
    adds them)."""
    import logging
    agg = aggregate(sql_frame(spark, input_dir, index), apdex_ms, undecided=True).persist()
    try:
        summary = summary_of_agg(agg)     # runs the Spark job
    except BaseException:
        agg.unpersist()
        raise
    n = summary.pop("undecided")
    if n:
        agg.unpersist()
        logging.getLogger("logjam_relay.pipeline.stats").warning(
            "%d logs bodies need Python's JSON rules; the Python engine reads the archive", n)
        return None
    summary["engine"] = "sql"
    return split(agg), summary, agg


def compute_tables_python(spark, input_dir, apdex_ms: float = DEFAULT_APDEX_MS, index=None):
    """The ``python`` engine: the Python tasks decode slices of the segments and group
    every decoded batch themselves (aggregate pushdown, :mod:`.partial`: the request fields
    extracted in C, grouped by Arrow, no body, one row per group to the JVM); Spark merges
    the partial rows into the request, exception and topic tables in one small
    aggregation."""
    return _merged_tables(spark, partial_frame(spark, input_dir, apdex_ms, index), "python")


def jvm_partial_frame(spark, input_dir, apdex_ms: float = DEFAULT_APDEX_MS,
                      loss_key: str | None = None, index=None):
    """The JVM reader's partial aggregates (the rows of :mod:`.partial`, plus a K_UNDECIDED
    row counting the logs bodies it leaves to Python's JSON rules): one Spark task per
    segment, each decoding, extracting and grouping its records on the JVM.  ``loss_key``:
    the tasks also gather the loss table's runs under that key (``LossRuns.java``; read
    them with :func:`take_loss_runs` after the job).  ``index``: an
    :class:`.originindex.OriginIndex` whose copies are left out."""
    from .partial import partial_schema

    def one(d):
        r = spark.read.format("logjam").schema(partial_schema()) \
            .option("aggregate", "requests").option("apdexMs", repr(float(apdex_ms)))
        if loss_key:
            r = r.option("lossKey", loss_key)
        return _excluding(r, d, index).load(d)
    return _union([one(d) for d in archive_dirs(input_dir)])


def compute_tables_jvm(spark, input_dir, apdex_ms: float = DEFAULT_APDEX_MS, index=None):
    """The ``jvm`` engine: the JVM reader aggregates each partition
    (:func:`jvm_partial_frame`), Spark merges the partial rows as the python engine's
    (:func:`merge_partials`).  None when some ``logs`` bodies need the Python definitions
    of the fields (see :func:`compute_tables_sql`): the caller then runs the ``python``
    engine."""
    return _merged_tables(spark, jvm_partial_frame(spark, input_dir, apdex_ms, index=index),
                          "jvm")


def take_loss_runs(spark, key: str) -> bytes:
    """The loss runs the JVM reader's tasks gathered under ``key`` (``LossRuns.take``)."""
    from .jvmcache import driver_jvm
    return bytes(driver_jvm(spark).logjamrelay.spark.LossRuns.take(key))


#: Spark 4.3's switch for aggregations whose partial step reduces nothing: "skips the
#: pre-shuffle partial aggregation and runs a single Complete-mode aggregation after the
#: shuffle"
BYPASS_PARTIAL_AGGREGATION = "spark.sql.execution.bypassPartialAggregation"


#: the merged groups are cached for the summary and the four writes: building the cache
#: without compressing its columns cost about 1.2 CPU-s less per run (the merge stage at
#: 1M records 5.5-5.7 -> 4.4 CPU-s); the cache is small beside the input (one row per
#: group) and spills to disk as any other
CACHE_COMPRESSED = "spark.sql.inMemoryColumnarStorage.compressed"
#: the jvm engine's merge settings (:func:`_merged_tables`)
JVM_MERGE_CONF = {BYPASS_PARTIAL_AGGREGATION: "true", CACHE_COMPRESSED: "false"}


@contextlib.contextmanager
def _session_conf(spark, conf: dict):
    """``with _session_conf(spark, {key: value}):`` -- runtime settings of the session for
    the plans made and run inside, restored (or unset) after."""
    before = {k: spark.conf.get(k, None) for k in conf}
    for k, v in conf.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def _merged_tables(spark, src, engine: str):
    """(tables, summary, agg) from partial rows ``src`` (:func:`merge_partials`); None
    when ``src`` counted undecided bodies (engine jvm).  No loss tables
    (:func:`compute_tables` adds them)."""
    import logging
    # the jvm engine's partial rows are one per group and partition by construction
    # (Partials.java): Spark's pre-shuffle partial aggregation would reduce nothing and
    # cost about a tenth of stage 0 (collect_list's buffers built and serialised per row),
    # so its merge runs once, after the shuffle -- set until the merge has run, as
    # adaptive execution plans its stages again when they run
    scope = _session_conf(spark, JVM_MERGE_CONF) if engine == "jvm" \
        else contextlib.nullcontext()
    with scope:
        agg = merge_partials(src).persist()
        try:
            summary = summary_of_merged(agg, undecided=engine == "jvm")    # the Spark job
        except BaseException:
            agg.unpersist()
            raise
    n = summary.pop("undecided", 0)
    if n:
        agg.unpersist()
        logging.getLogger("logjam_relay.pipeline.stats").warning(
            "%d logs bodies need Python's JSON rules; the Python engine reads the archive", n)
        return None
    summary["engine"] = engine
    return split_merged(agg), summary, agg


def configure(spark, datasource: bool = True) -> None:
    """Session settings of the pipeline; ``datasource``: register the ``logjam`` format
    too (the batch run does not read through it, and registering starts a Python process
    that looks up data sources)."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    if datasource:
        from .datasource import register
        register(spark)


def _date_literals(isos) -> list:
    """Spark date literals of ISO dates, by their text: PySpark's conversion of a Python
    date fails on the year 1 (IllegalArgumentException), the first minute's date."""
    from pyspark.sql import functions as F
    return [F.lit(x).cast("date") for x in sorted(isos)]


def _write_tables(tables: dict, output: str, dates=None, log=print,
                  counts: dict | None = None) -> dict[str, int]:
    """Write small aggregated tables (one task each, dynamic partition overwrite), all at
    once: each write is a short Spark job whose fixed costs (planning, committing) would
    otherwise add up one after the other; ``counts``: their row counts when known (else
    counted here)."""
    from concurrent.futures import ThreadPoolExecutor

    from pyspark.sql import functions as F

    def write(name: str, df) -> int:
        if dates is not None:
            df = df.where(F.col("date").isin(_date_literals(dates)))
        df = df.coalesce(1)
        path = os.path.join(output, name)
        if counts is not None and name in counts:
            df.write.mode("overwrite").partitionBy("date").parquet(path)
            return counts[name]
        df = df.persist()
        try:
            n = df.count()
            df.write.mode("overwrite").partitionBy("date").parquet(path)
        finally:
            df.unpersist()
        return n

    if len(tables) == 1:
        done = {name: write(name, df) for name, df in tables.items()}
    else:
        with ThreadPoolExecutor(max_workers=len(tables), thread_name_prefix="write") as ex:
            futures = {name: ex.submit(write, name, df) for name, df in tables.items()}
            done = {name: f.result() for name, f in futures.items()}
    for name, n in done.items():
        log(f"  {name}: {n} rows")
    return done


def _log_origins(summary: dict, log) -> None:
    """The origin walk's lines of the summary (:mod:`.origin`)."""
    if summary.get("origins") or summary.get("duplicates_left_out"):
        log(f"{summary.get('origins', 0)} origin devices; "
            f"{summary.get('duplicates_left_out', 0)} copies of events that arrived more "
            "than once left out (each event counts once)")
    for dev, hosts in (summary.get("collisions") or {}).items():
        log(f"warning: device {dev} is used by more than one origin host "
            f"({', '.join(map(repr, hosts))}): kept apart in origin_loss; give each relay "
            "its own device number")
    for dev, archives in (summary.get("shared_devices") or {}).items():
        log(f"warning: device {dev} wrote into more than one of the archives read "
            f"(inputs {', '.join(str(a + 1) for a in archives)}): its loss rows mix "
            "two relays; give each relay its own device number")


def run_batch(spark, input_dir, output: str, apdex_ms: float = DEFAULT_APDEX_MS,
              log=print, engine: str | None = None, compute=None) -> dict:
    """Read the archive, write the four tables (dynamic partition overwrite by date);
    ``engine``: :data:`ENGINES` (default: :func:`choose_engine`).  ``compute``: what
    makes (tables, summary, agg) instead of :func:`compute_tables` (Spark Connect:
    :func:`.connect.compute_tables`)."""
    t0 = time.perf_counter()
    configure(spark, datasource=False)
    if compute is not None:
        tables, summary, agg = compute(spark, input_dir, apdex_ms)
    else:
        if engine is None:
            engine, why = choose_engine(spark, input_dir)
            log(f"engine {engine} ({why})")
        tables, summary, agg = compute_tables(spark, input_dir, apdex_ms, engine)
    log(f"read {summary['rows_in']} records ({summary['bad_records']} undecodable, "
        f"{summary['corrupt_segments']} corrupt segment regions, {summary['bad_json']} "
        f"logs bodies not JSON) and aggregated them in {time.perf_counter() - t0:.1f} s")
    _log_origins(summary, log)
    if compute is None and summary.get("engine") in ("jvm", "sql"):
        from .jvmreader import zlib_path_line
        line = zlib_path_line(spark)
        if line:
            log(line)
    counts = summary.pop("counts")
    rows = _write_tables(tables, output, log=log, counts=counts)
    agg.unpersist()
    summary.update(rows_out=sum(rows.values()), tables=rows,
                   seconds=round(time.perf_counter() - t0, 3))
    return summary


# --------------------------------------------------------------------- streaming

def _batch_files(meta_dir: str, batch: int) -> list[str] | None:
    """Paths of the files the file sink committed in ``batch`` (None: unknown)."""
    for name in (str(batch), f"{batch}.compact"):
        path = os.path.join(meta_dir, name)
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        files = []
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("action", "add") == "add" and "path" in e:
                p = e["path"]
                if p.startswith("file:"):
                    p = "/" + unquote(urlsplit(p).path).lstrip("/")
                files.append(p)
        return files
    return None


def _dates_of(files) -> set[str]:
    dates = set()
    for f in files:
        for part in f.split("/"):
            if part.startswith("date=") and part[5:] != "__HIVE_DEFAULT_PARTITION__":
                dates.add(part[5:])
    return dates


def _last_batch(meta_dir: str) -> int:
    best = -1
    try:
        for name in os.listdir(meta_dir):
            stem = name.split(".")[0]
            if stem.isdigit():
                best = max(best, int(stem))
    except FileNotFoundError:
        pass
    return best


def _date_of_ms(ms: int) -> str:
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC).date().isoformat()


def recompute(spark, output: str, dates: set[str], apdex_ms: float, log=print) -> dict:
    """Recompute request_stats/exceptions/topics for ``dates`` (reading the neighbouring
    days too) from the committed ``_records``."""
    from pyspark.sql import functions as F
    rec = spark.read.option("mergeSchema", "true").parquet(os.path.join(output, RECORDS_DIR))
    around = set()
    for d in dates:
        day = _dt.date.fromisoformat(d)
        around.add(day)
        # (records an older version filed under their created date: context of a day)
        for step in (-1, 1):
            with contextlib.suppress(OverflowError):        # the calendar's first/last day
                around.add(day + _dt.timedelta(days=step))
    rec = rec.where(F.col("date").isin(_date_literals(d.isoformat() for d in around)))
    agg = aggregate(once_per_origin(rec), apdex_ms).persist()
    try:
        return _write_tables(split(agg), output, dates, log=log)
    finally:
        agg.unpersist()


def once_per_origin(rec):
    """The streaming run's records with every origin once (:mod:`.origin`): of the records
    that carry the same origin host, device and sequence, one is kept (they are copies of
    one event: same body, so the same date partition); records without an origin are kept
    as they are."""
    from pyspark.sql import functions as F
    if "origin_device" not in rec.columns:          # records of an older version
        return rec
    has = F.col("origin_device").isNotNull()
    return rec.where(has).dropDuplicates(["origin_host", "origin_device", "origin_sequence"]) \
        .unionByName(rec.where(~has))


#: the streaming records' columns the loss states read
_STATE_COLUMNS = ["archive", "device", "sequence", "segment", "record", "created_ms", "app",
                  "env", "origin_host", "origin_device", "origin_sequence", "skipped_from",
                  "skipped_to"]


def _read_new(files: list[str]):
    import pyarrow.parquet as pq
    parts = []
    for f in files:
        have = set(pq.read_schema(f).names)
        parts.append(pq.read_table(f, columns=[c for c in _STATE_COLUMNS if c in have]))
    return pa_concat(parts) if parts else None


def update_origin(spark, output: str, files: list[str], origin_state, log=print) -> dict:
    """Feed the records of newly committed sink files to the origin state (an
    :class:`.originindex.OriginIndex`) and rewrite the origin_loss and gaps tables (small: one
    row per origin and minute, one per gap)."""
    t = _read_new(files)
    if t is None or "origin_device" not in t.column_names:
        return {}
    origin_state.add_rows(t.filter(pc_valid(t)))
    o = origin_tables(spark, origin_state)
    written = _write_tables({"origin_loss": o["origin_loss"]}, output, log=log)
    # gaps that are filled later must go: the whole table, every date replaced
    with _session_conf(spark, {"spark.sql.sources.partitionOverwriteMode": "static"}):
        written.update(_write_tables({"gaps": o["gaps"]}, output, log=log))
    return written


def update_loss(spark, output: str, files: list[str], state, log=print) -> dict:
    """Feed the records of newly committed sink files to the loss state and rewrite the
    loss table's dates whose rows changed (the table is never rebuilt whole)."""
    import numpy as np
    t = _read_new(files)
    if t is None:
        return {}
    t = t.filter(pc_valid(t))
    created = t["created_ms"].to_numpy()
    # arrival order over several archives: archive, then segment, then record
    seg = t["segment"].to_numpy().astype(np.int64)
    if "archive" in t.column_names:
        seg = seg + (t["archive"].to_numpy().astype(np.int64) << 44)
    changed = state.update(t["device"].to_numpy(), t["sequence"].to_numpy(),
                           seg, t["record"].to_numpy(), minutes_of(created))
    written: dict[str, int] = {}
    if "skipped_from" in t.column_names:
        import pyarrow.compute as pc

        from .loss import DeviceLoss
        # the archiving relay's own restart markers: a declared range and no origin
        own = t.filter(pc.and_(pc.and_(pc.is_valid(t["skipped_from"]),
                                       pc.is_valid(t["skipped_to"])),
                               pc.is_null(t["origin_device"])))
        for r in own.to_pylist():
            m = int(minutes_of(np.array([r["created_ms"]]))[0])
            state.devices.setdefault(r["device"], DeviceLoss()).declare(
                r["skipped_from"], r["skipped_to"], m)
            changed.setdefault(r["device"], set()).add(m)
    dates = {_date_of_ms(m) for ms in changed.values() for m in ms}
    if not dates:
        return {}
    # all minutes of the changed dates (a dynamic overwrite replaces whole date partitions)
    keep = {dev: {m for m in d.rows if _date_of_ms(m) in dates}
            for dev, d in state.devices.items()}
    written.update(_write_tables({"loss": loss_table(spark, state, keep)}, output, dates,
                                 log=log))
    return written


def pa_concat(parts):
    import pyarrow as pa
    return pa.concat_tables(parts, promote_options="permissive")


def pc_valid(t):
    import pyarrow.compute as pc
    return pc.and_(pc.is_valid(t["device"]),
                   pc.and_(pc.is_valid(t["sequence"]), pc.is_valid(t["created_ms"])))


def run_stream(spark, input_dir, output: str, checkpoint: str,
               apdex_ms: float = DEFAULT_APDEX_MS, available_now: bool = False,
               interval: str = "10 seconds", max_records_per_trigger: int = 0,
               poll_s: float = 1.0, log=print) -> dict:
    """Streaming: decoded rows go exactly-once into ``OUTPUT/_records`` (Parquet file sink
    with ``checkpoint``); after every committed micro-batch the request/exception/topic
    tables of the dates it touched are recomputed from ``_records`` (idempotent, every
    origin once: :func:`once_per_origin`) and the loss states (``OUTPUT/_loss_state.npz``,
    the origins' ``OUTPUT/_origin_state.npz``) take in that batch's records only.
    ``input_dir``: one archive or a list (one stream each, unioned)."""
    from pyspark.sql import functions as F

    from .loss import LossState
    from .origin import ORIGIN_DDL
    from .originindex import OriginIndex
    t0 = time.perf_counter()
    configure(spark)
    records = os.path.join(output, RECORDS_DIR)
    meta_dir = os.path.join(records, "_spark_metadata")
    state_path = os.path.join(output, "_recomputed.json")
    loss_path = os.path.join(output, "_loss_state.npz")
    try:
        with open(state_path) as fh:
            done = int(json.load(fh)["batch"])
    except (OSError, ValueError, KeyError):
        done = -1
    loss_state, loss_done = LossState.load(loss_path)
    origin_path = os.path.join(output, "_origin_state.npz")
    origin_state, origin_done = OriginIndex.load(origin_path)

    def stream(k, d):
        reader = spark.readStream.format("logjam").schema(RECORD_DDL + ", " + ORIGIN_DDL)
        if max_records_per_trigger:
            reader = reader.option("maxRecordsPerTrigger", str(max_records_per_trigger))
        return reader.load(d).withColumn("archive", F.lit(k))
    sdf = _union([stream(k, d) for k, d in enumerate(archive_dirs(input_dir))])
    # each record under the date it counts at (a request: its started time, else created;
    # anything else: created), so that recomputing a date reads every record it holds
    sdf = sdf.withColumn("date", F.to_date(F.timestamp_millis(
        minute_col(request_time_col(F.col("started_ms"), F.col("created_ms"))))))
    w = sdf.writeStream.format("parquet").option("checkpointLocation", checkpoint) \
        .partitionBy("date").outputMode("append")
    w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime=interval)
    q = w.start(records)
    rows_in = 0
    tables: dict[str, int] = {}
    seen_progress = set()
    try:
        while True:
            finished = q.awaitTermination(poll_s)
            for prog in q.recentProgress:
                if prog["batchId"] not in seen_progress:
                    seen_progress.add(prog["batchId"])
                    n = prog.get("numInputRows", 0)
                    rows_in += n
                    if n:
                        log(f"batch {prog['batchId']}: {n} records "
                            f"({prog.get('processedRowsPerSecond', 0):.0f}/s)")
            last = _last_batch(meta_dir)
            if last > min(done, loss_done, origin_done):
                dates: set[str] = set()
                new_files: list[str] = []
                origin_files: list[str] = []
                for b in range(min(done, loss_done, origin_done) + 1, last + 1):
                    fs = _batch_files(meta_dir, b) or []
                    if b > done:
                        dates |= _dates_of(fs)
                    if b > loss_done:
                        new_files += fs
                    if b > origin_done:
                        origin_files += fs
                if dates:
                    log(f"recomputing {', '.join(sorted(dates))}")
                    tables.update(recompute(spark, output, dates, apdex_ms, log=log))
                if last > origin_done:
                    tables.update(update_origin(spark, output, origin_files, origin_state,
                                                log=log))
                    origin_state.save(origin_path, last)
                    origin_done = last
                if last > loss_done:
                    tables.update(update_loss(spark, output, new_files, loss_state, log=log))
                    loss_state.save(loss_path, last)
                    loss_done = last
                done = last
                tmp = state_path + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump({"batch": done}, fh)
                os.replace(tmp, state_path)
            if finished:
                break
    except KeyboardInterrupt:
        log("stopping")
    finally:
        if q.isActive:
            q.stop()
    return {"rows_in": rows_in, "rows_out": sum(tables.values()), "tables": tables,
            "seconds": round(time.perf_counter() - t0, 3)}


# --------------------------------------------------------------------- reference

from .reference import reference_tables  # noqa: E402,F401

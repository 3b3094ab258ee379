"""The stats pipeline: four Parquet tables from archived logjam records.

* ``request_stats`` -- per date, minute, app, env, action (``logs*`` topics): count,
  total_time sum/avg/max/p50/p95/p99 (exact percentiles, linear interpolation), apdex,
  http_2xx..http_5xx, severity_0..severity_5
* ``exceptions`` -- per date, minute, app, env, action, exception: count
* ``loss`` -- per date, minute, device: received, missing, duplicates, out_of_order
* ``topics`` -- per date, minute, app, env, topic for the non-``logs`` topics: count

Definitions (identical in the DataFrame code and in :func:`reference_tables`, the plain
Python implementation the tests compare against) are in ``docs/pipeline.md``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from collections import defaultdict

TABLES = ("request_stats", "exceptions", "loss", "topics")
RECORDS_DIR = "_records"
DEFAULT_APDEX_MS = 500.0

LOGS_JSON_SCHEMA = ("action string, started_ms long, started_at string, total_time double, "
                    "code int, severity int, exceptions array<string>, _corrupt string")

# --------------------------------------------------------------------- Spark side


def prepare(df):
    """Decoded rows (data source schema) -> compact rows with the parsed ``logs`` fields
    and the minutes the tables group by.  No body column in the result."""
    from pyspark.sql import functions as F

    is_logs = F.col("topic").startswith("logs")
    parsed = F.from_json(F.col("body"), LOGS_JSON_SCHEMA,
                         {"columnNameOfCorruptRecord": "_corrupt", "mode": "PERMISSIVE"})
    d = df.withColumn("_is_logs", F.coalesce(is_logs, F.lit(False))) \
          .withColumn("j", F.when(F.col("_is_logs") & F.col("body").isNotNull(), parsed))
    bad_json = F.col("_is_logs") & F.col("body").isNotNull() & \
        (F.col("j").isNull() | F.col("j._corrupt").isNotNull())
    started = F.coalesce(
        F.col("j.started_ms"),
        F.unix_millis(F.to_timestamp(F.col("j.started_at"))),
        F.col("created_ms"))

    def minute_of(c):
        return c - F.pmod(c, F.lit(60000))

    return d.select(
        "app", "env", "topic", "device", "sequence", "created_ms", "error", "segment",
        "record", "_is_logs",
        bad_json.alias("bad_json"),
        F.col("j.action").alias("action"),
        F.col("j.total_time").alias("total_time"),
        F.col("j.code").alias("code"),
        F.col("j.severity").alias("severity"),
        F.col("j.exceptions").alias("exceptions"),
        minute_of(started).alias("req_minute_ms"),
        minute_of(F.col("created_ms")).alias("minute_ms"),
    ).withColumn("date", F.to_date(F.timestamp_millis(F.col("minute_ms"))))


def _with_minute(df, ms_col: str):
    from pyspark.sql import functions as F
    ts = F.timestamp_millis(F.col(ms_col))
    return df.withColumn("minute", ts).withColumn("date", F.to_date(ts))


def request_stats(p, apdex_ms: float = DEFAULT_APDEX_MS):
    from pyspark.sql import functions as F
    logs = p.where(F.col("_is_logs") & ~F.col("bad_json") & F.col("error").isNull())
    logs = _with_minute(logs, "req_minute_ms").withColumn(
        "action", F.coalesce(F.col("action"), F.lit("unknown")))
    tt = F.col("total_time")
    t = float(apdex_ms)
    pct = F.percentile(tt, F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99)))
    aggs = [
        F.count(F.lit(1)).alias("count"),
        F.sum(tt).alias("total_time_sum"),
        F.avg(tt).alias("total_time_avg"),
        F.max(tt).alias("total_time_max"),
        pct.alias("_pct"),
        ((F.sum(F.when(tt <= t, 1).otherwise(0))
          + 0.5 * F.sum(F.when((tt > t) & (tt <= 4 * t), 1).otherwise(0)))
         / F.count(tt)).alias("apdex"),
    ]
    for k in (2, 3, 4, 5):
        aggs.append(F.sum(F.when((F.col("code") >= k * 100) & (F.col("code") < k * 100 + 100),
                                 1).otherwise(0)).cast("long").alias(f"http_{k}xx"))
    for k in range(6):
        aggs.append(F.sum(F.when(F.col("severity") == k, 1).otherwise(0)).cast("long")
                    .alias(f"severity_{k}"))
    g = logs.groupBy("date", "minute", "app", "env", "action").agg(*aggs)
    g = g.withColumn("total_time_p50", F.col("_pct")[0]) \
         .withColumn("total_time_p95", F.col("_pct")[1]) \
         .withColumn("total_time_p99", F.col("_pct")[2]).drop("_pct")
    cols = ["date", "minute", "app", "env", "action", "count", "total_time_sum",
            "total_time_avg", "total_time_max", "total_time_p50", "total_time_p95",
            "total_time_p99", "apdex", *(f"http_{k}xx" for k in (2, 3, 4, 5)),
            *(f"severity_{k}" for k in range(6))]
    return g.select(*cols)


def exceptions(p):
    from pyspark.sql import functions as F
    logs = p.where(F.col("_is_logs") & ~F.col("bad_json") & F.col("error").isNull()
                   & F.col("exceptions").isNotNull())
    logs = _with_minute(logs, "req_minute_ms").withColumn(
        "action", F.coalesce(F.col("action"), F.lit("unknown")))
    ex = logs.select("date", "minute", "app", "env", "action",
                     F.explode("exceptions").alias("exception")).where(
        F.col("exception").isNotNull())
    return ex.groupBy("date", "minute", "app", "env", "action", "exception") \
             .agg(F.count(F.lit(1)).alias("count"))


def topics(p):
    from pyspark.sql import functions as F
    # heartbeats (app-env "heartbeat") are in the archive for the loss report only
    other = p.where(F.col("topic").isNotNull() & ~F.col("_is_logs")
                    & F.col("created_ms").isNotNull()
                    & ~((F.col("app") == "heartbeat") & (F.col("env") == "")))
    other = _with_minute(other, "minute_ms")
    return other.groupBy("date", "minute", "app", "env", "topic") \
                .agg(F.count(F.lit(1)).alias("count"))


def loss(p):
    """Per device and minute (of created_ms), in arrival order (segment, record)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F
    d = p.where(F.col("device").isNotNull() & F.col("sequence").isNotNull()) \
         .select("device", "sequence", "segment", "record", "minute_ms")
    by_seq = Window.partitionBy("device", "sequence").orderBy("segment", "record")
    arrival = Window.partitionBy("device").orderBy("segment", "record") \
                    .rowsBetween(Window.unboundedPreceding, -1)
    d = d.withColumn("_dup", F.row_number().over(by_seq) > 1) \
         .withColumn("_prev_max", F.max("sequence").over(arrival))
    d = d.withColumn("_ooo", ~F.col("_dup") & F.col("_prev_max").isNotNull()
                     & (F.col("sequence") < F.col("_prev_max")))
    # a gap after sequence a (up to the next distinct number) counts at the minute of a's
    # first arrival; among equal numbers only the last in order sees the next number
    d = d.withColumn("_first_minute", F.first("minute_ms").over(by_seq))
    in_seq = Window.partitionBy("device").orderBy("sequence", "segment", "record")
    d = d.withColumn("_gap", F.greatest(
        F.coalesce(F.lead("sequence").over(in_seq) - F.col("sequence") - 1, F.lit(0)),
        F.lit(0)))
    gaps = d.groupBy("device", F.col("_first_minute").alias("minute_ms")).agg(
        F.sum("_gap").cast("long").alias("missing"))
    g = d.groupBy("device", "minute_ms").agg(
        F.count(F.lit(1)).alias("received"),
        F.sum(F.col("_dup").cast("long")).alias("duplicates"),
        F.sum(F.col("_ooo").cast("long")).alias("out_of_order"),
        F.min("sequence").alias("first_sequence"),
        F.max("sequence").alias("last_sequence"))
    g = g.join(gaps, ["device", "minute_ms"], "left") \
         .withColumn("missing", F.coalesce(F.col("missing"), F.lit(0)).cast("long"))
    g = _with_minute(g, "minute_ms")
    return g.select("date", "minute", "device", "received", "missing", "duplicates",
                    "out_of_order", "first_sequence", "last_sequence")


def compute_tables(p, apdex_ms: float = DEFAULT_APDEX_MS) -> dict:
    return {"request_stats": request_stats(p, apdex_ms), "exceptions": exceptions(p),
            "loss": loss(p), "topics": topics(p)}


def configure(spark) -> None:
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    spark.conf.set("spark.sql.sources.partitionOverwriteMode", "dynamic")
    from .datasource import register
    register(spark)


def _write_tables(tables: dict, output: str, dates=None, log=print) -> dict[str, int]:
    from pyspark.sql import functions as F
    out = {}
    for name, df in tables.items():
        if dates is not None:
            df = df.where(F.col("date").isin([_dt.date.fromisoformat(x) for x in dates]))
        df = df.persist()
        n = df.count()
        df.write.mode("overwrite").partitionBy("date").parquet(os.path.join(output, name))
        df.unpersist()
        out[name] = n
        log(f"  {name}: {n} rows")
    return out


def input_summary(p) -> dict:
    from pyspark.sql import functions as F
    r = p.agg(F.count(F.lit(1)).alias("rows"),
              F.sum(F.col("error").isNotNull().cast("long")).alias("bad"),
              F.sum(F.coalesce(F.col("error").startswith("corrupt"), F.lit(False))
                    .cast("long")).alias("corrupt"),
              F.sum(F.col("bad_json").cast("long")).alias("bad_json")).collect()[0]
    return {"rows_in": r["rows"], "bad_records": r["bad"] or 0,
            "corrupt_segments": r["corrupt"] or 0, "bad_json": r["bad_json"] or 0}


def run_batch(spark, input_dir: str, output: str, apdex_ms: float = DEFAULT_APDEX_MS,
              log=print) -> dict:
    """Read the archive, write the four tables (dynamic partition overwrite by date)."""
    t0 = time.perf_counter()
    configure(spark)
    p = prepare(spark.read.format("logjam").load(input_dir)).persist()
    summary = input_summary(p)
    log(f"read {summary['rows_in']} records ({summary['bad_records']} undecodable, "
        f"{summary['corrupt_segments']} corrupt segment regions, {summary['bad_json']} "
        f"logs bodies not JSON) in {time.perf_counter() - t0:.1f} s")
    rows = _write_tables(compute_tables(p, apdex_ms), output, log=log)
    p.unpersist()
    summary.update(rows_out=sum(rows.values()), tables=rows,
                   seconds=round(time.perf_counter() - t0, 3))
    return summary


# --------------------------------------------------------------------- streaming

def _batch_dates(meta_dir: str, batch: int) -> set[str] | None:
    """Dates of the files the file sink committed in ``batch`` (None: unknown)."""
    for name in (str(batch), f"{batch}.compact"):
        path = os.path.join(meta_dir, name)
        try:
            with open(path, encoding="utf-8") as fh:
                lines = fh.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        dates = set()
        for line in lines:
            try:
                fpath = json.loads(line)["path"]
            except (ValueError, KeyError):
                continue
            for part in fpath.split("/"):
                if part.startswith("date="):
                    dates.add(part[5:])
        return dates
    return None


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


def recompute(spark, output: str, dates: set[str], apdex_ms: float, log=print) -> dict:
    """Recompute request_stats/exceptions/topics for ``dates`` (reading the neighbouring
    days too) and the whole loss table from the committed ``_records``."""
    from pyspark.sql import functions as F
    rec = spark.read.parquet(os.path.join(output, RECORDS_DIR))
    around = set()
    for d in dates:
        day = _dt.date.fromisoformat(d)
        around.update({day - _dt.timedelta(days=1), day, day + _dt.timedelta(days=1)})
    part = rec.where(F.col("date").isin(sorted(around)))
    t = compute_tables(part, apdex_ms)
    rows = _write_tables({k: t[k] for k in ("request_stats", "exceptions", "topics")},
                         output, dates, log=log)
    rows.update(_write_tables({"loss": loss(rec)}, output, log=log))
    return rows


def run_stream(spark, input_dir: str, output: str, checkpoint: str,
               apdex_ms: float = DEFAULT_APDEX_MS, available_now: bool = False,
               interval: str = "10 seconds", max_records_per_trigger: int = 0,
               poll_s: float = 1.0, log=print) -> dict:
    """Streaming: decoded rows go exactly-once into ``OUTPUT/_records`` (Parquet file sink
    with ``checkpoint``); after every committed micro-batch the tables for the dates it
    touched are recomputed from ``_records`` (idempotent, so a crash anywhere only means
    recomputing again)."""
    t0 = time.perf_counter()
    configure(spark)
    records = os.path.join(output, RECORDS_DIR)
    meta_dir = os.path.join(records, "_spark_metadata")
    state_path = os.path.join(output, "_recomputed.json")
    try:
        with open(state_path) as fh:
            done = int(json.load(fh)["batch"])
    except (OSError, ValueError, KeyError):
        done = -1
    reader = spark.readStream.format("logjam")
    if max_records_per_trigger:
        reader = reader.option("maxRecordsPerTrigger", str(max_records_per_trigger))
    sdf = prepare(reader.load(input_dir))
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
            if last > done:
                dates: set[str] = set()
                for b in range(done + 1, last + 1):
                    ds = _batch_dates(meta_dir, b)
                    dates |= ds if ds is not None else set()
                if dates:
                    log(f"recomputing {', '.join(sorted(dates))}")
                    tables = recompute(spark, output, dates, apdex_ms, log=log)
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

def _minute(ms: int) -> int:
    return ms - ms % 60000


def _iso_ms(s) -> int | None:
    if not isinstance(s, str):
        return None
    try:
        t = _dt.datetime.fromisoformat(s)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    return int(round(t.timestamp() * 1000))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _percentile(sorted_vals: list[float], p: float) -> float:
    pos = (len(sorted_vals) - 1) * p
    lo = math.floor(pos)
    hi = math.ceil(pos)
    if lo == hi:
        return sorted_vals[lo]
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _date(minute_ms: int) -> str:
    return _dt.datetime.fromtimestamp(minute_ms / 1000, _dt.UTC).date().isoformat()


def reference_tables(records, apdex_ms: float = DEFAULT_APDEX_MS) -> dict[str, list[dict]]:
    """Plain Python over decoded records in arrival order: dicts with ``app_env`` (str),
    ``topic`` (str), ``body`` (decompressed bytes or None when it could not be decoded),
    ``device``, ``sequence``, ``created_ms`` (None for a broken meta frame).
    Rows use ``minute_ms`` (epoch ms) and ``date`` (ISO string)."""
    req = defaultdict(list)
    exc = defaultdict(int)
    top = defaultdict(int)
    loss_rows: dict = defaultdict(lambda: {"received": 0, "missing": 0, "duplicates": 0,
                                           "out_of_order": 0, "seqs": []})
    seen: dict[int, set] = defaultdict(set)
    maxseq: dict[int, int] = {}
    first_minute: dict[tuple[int, int], int] = {}
    for r in records:
        dev, seq, created = r["device"], r["sequence"], r["created_ms"]
        if dev is not None:
            m = _minute(created)
            lr = loss_rows[(dev, m)]
            lr["received"] += 1
            lr["seqs"].append(seq)
            if seq in seen[dev]:
                lr["duplicates"] += 1
            else:
                seen[dev].add(seq)
                first_minute[(dev, seq)] = m
                if dev in maxseq and seq < maxseq[dev]:
                    lr["out_of_order"] += 1
            maxseq[dev] = max(maxseq.get(dev, seq), seq)
        topic = r["topic"]
        if topic is None or dev is None:
            if topic is not None and not topic.startswith("logs"):
                pass
            if topic is None:
                continue
        if r["app_env"] == "heartbeat":
            continue             # counted in the loss report above, nowhere else
        app, sep, env = r["app_env"].rpartition("-")
        if not sep:
            app, env = r["app_env"], ""
        if not topic.startswith("logs"):
            if created is None:
                continue         # broken meta: no time (the Spark side drops it the same way)
            top[(_minute(created), app, env, topic)] += 1
            continue
        body = r["body"]
        if body is None:
            continue
        try:
            j = json.loads(body)
        except ValueError:
            continue
        if not isinstance(j, dict):
            continue
        started = j.get("started_ms")
        sm = started if _is_int(started) else _iso_ms(j.get("started_at"))
        if sm is None:
            sm = created
        m = _minute(sm)
        action = j.get("action") if isinstance(j.get("action"), str) else None
        action = "unknown" if action is None else action
        tt = j.get("total_time")
        tt = float(tt) if (_is_int(tt) or isinstance(tt, float)) else None
        code = j.get("code") if _is_int(j.get("code")) else None
        sev = j.get("severity") if _is_int(j.get("severity")) else None
        req[(m, app, env, action)].append((tt, code, sev))
        exs = j.get("exceptions")
        if isinstance(exs, list):
            for e in exs:
                if isinstance(e, str):
                    exc[(m, app, env, action, e)] += 1
    # gaps: between consecutive distinct sequence numbers, counted at the lower one's minute
    for dev, seqs in seen.items():
        s = sorted(seqs)
        for a, b in zip(s, s[1:], strict=False):
            if b - a > 1:
                loss_rows[(dev, first_minute[(dev, a)])]["missing"] += b - a - 1
    t = float(apdex_ms)
    out_req = []
    for (m, app, env, action), vals in req.items():
        tts = sorted(v[0] for v in vals if v[0] is not None)
        row = {"date": _date(m), "minute_ms": m, "app": app, "env": env, "action": action,
               "count": len(vals),
               "total_time_sum": sum(tts) if tts else None,
               "total_time_avg": sum(tts) / len(tts) if tts else None,
               "total_time_max": max(tts) if tts else None,
               "total_time_p50": _percentile(tts, 0.5) if tts else None,
               "total_time_p95": _percentile(tts, 0.95) if tts else None,
               "total_time_p99": _percentile(tts, 0.99) if tts else None,
               "apdex": ((sum(1 for x in tts if x <= t)
                          + 0.5 * sum(1 for x in tts if t < x <= 4 * t)) / len(tts))
               if tts else None}
        for k in (2, 3, 4, 5):
            row[f"http_{k}xx"] = sum(1 for v in vals if v[1] is not None
                                     and k * 100 <= v[1] < k * 100 + 100)
        for k in range(6):
            row[f"severity_{k}"] = sum(1 for v in vals if v[2] == k)
        out_req.append(row)
    out_exc = [{"date": _date(m), "minute_ms": m, "app": app, "env": env, "action": action,
                "exception": e, "count": n} for (m, app, env, action, e), n in exc.items()]
    out_top = [{"date": _date(m), "minute_ms": m, "app": app, "env": env, "topic": tp,
                "count": n} for (m, app, env, tp), n in top.items()]
    out_loss = [{"date": _date(m), "minute_ms": m, "device": dev, "received": v["received"],
                 "missing": v["missing"], "duplicates": v["duplicates"],
                 "out_of_order": v["out_of_order"], "first_sequence": min(v["seqs"]),
                 "last_sequence": max(v["seqs"])}
                for (dev, m), v in loss_rows.items()]
    return {"request_stats": out_req, "exceptions": out_exc, "loss": out_loss,
            "topics": out_top}

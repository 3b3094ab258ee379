"""``pipeline stats`` against the plain PySpark job a user would write instead, and the
data source scan against Spark's Parquet scan, at several sizes in one run.

    python bench/bench_pipeline.py [--records 1000000 10000000] [--master local[2]]
                                   [--data DIR] [--dir /tmp] [--engine auto|jvm|sql|python]
                                   [--no-scan | --scan-only] [--repeat N] [--repeat-jobs N]

1. For each size, realistic records (``bench/pipeline_data.py``: 7 apps in 13 app-envs, the
   logjam agents' body fields, bodies of ~300 B-3.4 KB, mixed compressions, 4 devices with
   gaps, other topics and heartbeats; deterministic) are archived (64 MiB segments) and
   written as JSON lines (app, env, topic, device, sequence, created_ms and the body as a
   nested object), the input of the plain job.  ``--data DIR`` keeps them in DIR/N for
   later runs (10M records: 7 GB archive, 9 GB JSON lines, ~45 min to write on a loaded
   2-core machine).
2. Whole process against whole process, same master, same records (best of
   ``--repeat-jobs``, interleaved):
   * ``logjam-relay pipeline stats --input ARCHIVE --output OUT --master M --engine E``
   * the plain job (:func:`plain_job`, ~60 lines of PySpark: JSON reader with an explicit
     schema, groupBy, exact ``percentile``, the same apdex/code/severity sums, exceptions
     exploded, a per-device/minute sequence count for loss, topic counts; parsed input
     cached because it feeds four tables) run as ``python bench_pipeline.py --plain-job``.
   Each job's input is read once right before its run, so both start with it in the page
   cache (the other job's run may have evicted part of it: the figures measure the work,
   not which job ran before).
   The tables are compared: request_stats, exceptions and topics must be equal figure by
   figure, loss in the columns the plain job has (received, first/last sequence).  The
   first run of the command writes a class-data archive of its driver JVM
   (``pipeline/jvmcache.py``): it is run once before the measured pairs, with its own line.
   The CPU seconds of each whole process tree (driver, JVM, Python workers; sampled from
   /proc) are printed too: other load on a shared machine disturbs them far less than the
   wall times.  Then, over the sizes: the ratio at each size and the fitted cost of each
   side (intercept + slope per record, wall and CPU); targets: >= 2.5x at 10M, the
   pipeline's marginal cost per record <= 1/3 of the plain job's.
3. Scans (``write.format("noop")``, all columns materialised, best of ``--repeat``,
   interleaved) in one session made by ``make_session``, at each size: Parquet (the
   decoded rows written once by Spark) against ``format("logjam")``, the JVM reader there
   (``pipeline/jvmreader.py``).  Target: >= 0.9x of Parquet at 10M.  For context (smallest
   size), the Python data source (the fallback) and a Python source replaying decoded
   batches from memory (the ceiling of Spark's Python data source path).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import proctree

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

PLAIN_SCHEMA = ("app string, env string, topic string, device long, sequence long, "
                "created_ms long, segment long, record long, body struct<action string, "
                "started_ms long, started_at string, total_time double, code int, "
                "severity int, exceptions array<string>>")


def plain_job(json_dir: str, out: str, master: str, apdex_ms: float = 500.0) -> None:
    """The baseline: what a user would write with plain PySpark over JSON lines."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F
    spark = (SparkSession.builder.master(master).appName("plain-job")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.shuffle.partitions", "8")
             # 4g: with 2g the exact percentiles' buffers of the realistic 10M records
             # ran out of heap (java.lang.OutOfMemoryError; the pipeline keeps its 2g)
             .config("spark.driver.memory", "4g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.read.schema(PLAIN_SCHEMA).json(json_dir).cache()

    def minute(c):
        return F.timestamp_millis(c - F.pmod(c, F.lit(60000)))

    logs = df.where(F.col("topic").startswith("logs") & F.col("body").isNotNull()) \
        .withColumn("minute", minute(F.coalesce(
            F.col("body.started_ms"), F.unix_millis(F.to_timestamp("body.started_at")),
            F.col("created_ms")))) \
        .withColumn("date", F.to_date("minute")) \
        .withColumn("action", F.coalesce(F.col("body.action"), F.lit("unknown")))
    tt, code, sev, t = (F.col("body.total_time"), F.col("body.code"),
                        F.col("body.severity"), apdex_ms)
    req = logs.groupBy("date", "minute", "app", "env", "action").agg(
        F.count(F.lit(1)).alias("count"), F.sum(tt).alias("total_time_sum"),
        F.avg(tt).alias("total_time_avg"), F.max(tt).alias("total_time_max"),
        F.percentile(tt, F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99))).alias("p"),
        F.try_divide(F.count(F.when(tt <= t, 1)) + 0.5 * F.count(F.when((tt > t) & (tt <= 4 * t), 1)),
                     F.count(tt)).alias("apdex"),
        *[F.count(F.when((code >= k * 100) & (code < k * 100 + 100), 1)).alias(f"http_{k}xx")
          for k in (2, 3, 4, 5)],
        *[F.count(F.when(sev == k, 1)).alias(f"severity_{k}") for k in range(6)])
    req = req.select("*", *[F.col("p")[i].alias(f"total_time_p{q}")
                            for i, q in enumerate((50, 95, 99))]).drop("p")
    exc = logs.select("date", "minute", "app", "env", "action",
                      F.explode("body.exceptions").alias("exception")) \
        .groupBy("date", "minute", "app", "env", "action", "exception").count()
    other = df.where(~F.col("topic").startswith("logs")) \
        .where(~((F.col("app") == "heartbeat") & (F.col("env") == ""))) \
        .withColumn("minute", minute(F.col("created_ms"))).withColumn("date", F.to_date("minute"))
    top = other.groupBy("date", "minute", "app", "env", "topic").count()
    loss = df.withColumn("minute", minute(F.col("created_ms"))) \
        .withColumn("date", F.to_date("minute")) \
        .groupBy("date", "minute", "device").agg(
            F.count(F.lit(1)).alias("received"),
            F.count_distinct("sequence").alias("distinct"),
            F.min("sequence").alias("first_sequence"), F.max("sequence").alias("last_sequence"))
    for name, t_ in (("request_stats", req), ("exceptions", exc), ("loss", loss),
                     ("topics", top)):
        t_.write.mode("overwrite").partitionBy("date").parquet(os.path.join(out, name))
    spark.stop()


def _replay_source():
    """A Python data source with the archive's schema that decodes each segment once per
    Python worker and then replays the same Arrow batches from memory: what Spark's Python
    data source path itself costs (Arrow to the JVM, rows) with no decoding at all -- the
    ceiling any Python data source reaches in this session.  Defined here (pickled by
    value), its cache lives in the worker process between scans."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class Part(InputPartition):
        def __init__(self, path, segno):
            self.path, self.segno = path, segno

    class Reader(DataSourceReader):
        def __init__(self, path):
            self.path = path

        def partitions(self):
            from logjam_relay.pipeline.decode import list_segments
            return [Part(p, s) for s, p in list_segments(self.path)]

        def read(self, part):
            cache = sys.__dict__.setdefault("_bench_replay_cache", {})
            key = (part.path, part.segno)
            if key not in cache:
                from logjam_relay.pipeline.decode import decode_segment
                cache[key] = list(decode_segment(part.path, part.segno))
            return iter(cache[key])

    class Replay(DataSource):
        @classmethod
        def name(cls):
            return "bench_replay"

        def schema(self):
            from logjam_relay.pipeline.decode import SCHEMA_DDL
            return SCHEMA_DDL

        def reader(self, schema):
            return Reader(self.options["path"])

    return Replay


def read_table(out: str, name: str) -> list[dict]:
    import pyarrow.parquet as pq
    return pq.read_table(os.path.join(out, name)).to_pylist()


def compare(ours: str, plain: str) -> list[str]:
    """Differences between the two outputs (empty: they agree)."""
    problems = []
    keys = {"request_stats": ("minute", "app", "env", "action"),
            "exceptions": ("minute", "app", "env", "action", "exception"),
            "topics": ("minute", "app", "env", "topic"), "loss": ("minute", "device")}
    for name, key in keys.items():
        a = {tuple(r[k] for k in key): r for r in read_table(ours, name)}
        b = {tuple(r[k] for k in key): r for r in read_table(plain, name)}
        if set(a) != set(b):
            problems.append(f"{name}: keys differ ({len(set(a) ^ set(b))})")
            continue
        cols = ("received", "first_sequence", "last_sequence") if name == "loss" else None
        for k, ra in a.items():
            rb = b[k]
            for c in cols or [c for c in ra if c not in ("date", "minute")]:
                x, y = ra[c], rb[c]
                same = (math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
                        if isinstance(x, float) and isinstance(y, float) else x == y)
                if not same:
                    problems.append(f"{name} {k} {c}: {x} != {y}")
                    break
    return problems


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _tree_cpu(root: int, seen: dict) -> None:
    """CPU seconds (user + system) of every process under ``root``, into ``seen`` by pid."""
    kids, cpu = proctree.scan()
    for c in proctree.descendants(root, kids):
        seen[c] = cpu[c]


def _pid_cpu(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            f = fh.read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None


def warm(directory: str) -> float:
    """Read every file of ``directory`` once (into the page cache); the seconds it took."""
    t = time.perf_counter()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb", buffering=0) as fh:
                while fh.read(1 << 22):
                    pass
    return time.perf_counter() - t


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds until the command exits, CPU seconds of its whole process tree: the
    driver, its JVM and the Python workers -- the figure a loaded machine disturbs least).
    Each process's own user + system time is sampled from /proc every 0.1 s (children's
    times are not added in: a reaped child would count twice), and processes that outlive
    the command (a JVM still shutting down) are followed until they exit."""
    import threading
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict[int, float] = {}
    out: list[bytes] = []
    th = threading.Thread(target=lambda: out.append(p.stdout.read()), daemon=True)
    th.start()
    while p.poll() is None:
        if os.path.isdir("/proc"):
            _tree_cpu(p.pid, seen)
            c = _pid_cpu(p.pid)
            if c is not None:
                seen[p.pid] = c
        time.sleep(0.1)
    dt = time.perf_counter() - t
    live = [q for q in seen if q != p.pid]
    deadline = time.monotonic() + 30
    while live and time.monotonic() < deadline:
        for q in list(live):
            c = _pid_cpu(q)
            if c is None:
                live.remove(q)
            else:
                seen[q] = max(seen[q], c)
        time.sleep(0.1)
    th.join()
    if p.returncode != 0:
        sys.stdout.write(b"".join(out).decode(errors="replace")[-4000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return dt, sum(seen.values())


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept s, slope s per record) of a least-squares line through (n, seconds)."""
    k = len(points)
    mx = sum(n for n, _ in points) / k
    my = sum(t for _, t in points) / k
    sxx = sum((n - mx) ** 2 for n, _ in points)
    slope = sum((n - mx) * (t - my) for n, t in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def native_zlib_path() -> str:
    """What the pipeline's JVM reader inflates zlib bodies with (NativeInflate.status's
    words), as far as this process can tell: the _jinflate extension and libdeflate."""
    from logjam_relay.pipeline import jvmreader
    for var in ("JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS"):
        if "-Dlogjamrelay.nativeInflate=false" in os.environ.get(var, ""):
            return f"java.util.zip.Inflater (turned off in {var})"
    if jvmreader.native_library() is None:
        return "java.util.zip.Inflater (_jinflate not built)"
    if not jvmreader.native_inflate_ready():
        return "java.util.zip.Inflater (no libdeflate on this machine)"
    return "libdeflate (zlib's rules), Inflater for the rest"


def prepare(n: int, base: str, data: str | None) -> str:
    """The data directory of ``n`` records (bench/pipeline_data.py): ``data``/N when it was
    written before with the same figures, else written there (or under ``base``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import pipeline_data
    d = os.path.join(data or base, f"{n}")
    try:
        with open(os.path.join(d, "data.json")) as fh:
            info = json.load(fh)
        if info.get("generator") == pipeline_data.VERSION and info.get("requested") == n:
            return d
    except (OSError, ValueError):
        pass
    shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    pipeline_data.write(n, d)
    print(f"  (data written in {time.perf_counter() - t0:.1f} s)", flush=True)
    return d


def jobs(n: int, d: str, base: str, a, first: bool) -> dict:
    """Whole process against whole process at one size; the figures of the best runs."""
    archive, json_dir = os.path.join(d, "archive"), os.path.join(d, "json")
    nseg = len([f for f in os.listdir(archive) if f.endswith(".seg")])
    size = sum(os.path.getsize(os.path.join(archive, f)) for f in os.listdir(archive))
    jsize = sum(os.path.getsize(os.path.join(json_dir, f)) for f in os.listdir(json_dir))
    with open(os.path.join(d, "data.json")) as fh:
        info = json.load(fh)
    print(f"records: {n}  segments: {nseg}  archive: {size / 1e6:.1f} MB  JSON lines: "
          f"{jsize / 1e6:.1f} MB  (bodies {info['body_bytes'] / info['records']:.0f} B on "
          f"average, logs bodies {info['logs_body_min']}-{info['logs_body_max']} B)",
          flush=True)
    env = dict(os.environ)
    exe = os.path.join(os.path.dirname(sys.executable), "logjam-relay")
    out = os.path.join(base, f"ours-{n}")
    ours_cmd = ([exe] if os.path.exists(exe) else
                [sys.executable, "-m", "logjam_relay.cli"]) + [
        "pipeline", "stats", "--input", archive, "--output", out, "--master", a.master,
        "-q", "--engine", a.engine]
    plain_out = os.path.join(base, f"plain-{n}")
    plain_cmd = [sys.executable, os.path.abspath(__file__), "--master", a.master,
                 "--plain-job", json_dir, plain_out]
    t_ours, t_plain, c_ours, c_plain = [], [], [], []
    load0 = os.getloadavg()[0]
    # the command keeps a class-data archive of its driver JVM (pipeline/jvmcache.py):
    # the first run on a machine writes it; measure that run apart, then the usual ones
    env["XDG_CACHE_HOME"] = os.path.join(base, "cache")
    if first:
        w1, c1 = timed(ours_cmd, env)
        print(f"pipeline stats, first run     : {w1:7.2f} s  (writes the JVM class archive; "
              f"CPU s: {c1:.1f})", flush=True)
    warm_s: dict[str, list[float]] = {"JSON lines": [], "archive": []}
    for _ in range(a.repeat_jobs):          # interleaved: same machine conditions
        for cmd, ts, cs, src, what in ((plain_cmd, t_plain, c_plain, json_dir, "JSON lines"),
                                       (ours_cmd, t_ours, c_ours, archive, "archive")):
            # each job's input read once right before it (both in the page cache): the
            # other job's run may have evicted part of it, which would make the figures
            # depend on which ran before, not on the work
            warm_s[what].append(warm(src))
            w, c = timed(cmd, env)
            ts.append(w)
            cs.append(c)
    tp, to = min(t_plain), min(t_ours)
    print(f"load average (1 min) before / after the jobs: {load0:.2f} / "
          f"{os.getloadavg()[0]:.2f}; inputs read into the page cache before each run "
          f"({', '.join(f'{k} {max(v):.1f} s' for k, v in warm_s.items())} at most)")
    print(f"plain PySpark job (JSON lines): {tp:7.2f} s  {n / tp:12,.0f} rec/s  "
          f"(runs: {', '.join(f'{x:.2f}' for x in t_plain)}; CPU s: "
          f"{', '.join(f'{x:.1f}' for x in c_plain)})")
    print(f"pipeline stats (archive)      : {to:7.2f} s  {n / to:12,.0f} rec/s  "
          f"(runs: {', '.join(f'{x:.2f}' for x in t_ours)}; CPU s: "
          f"{', '.join(f'{x:.1f}' for x in c_ours)})")
    print(f"speed-up pipeline / plain job : {tp / to:.2f}x wall, "
          f"{min(c_plain) / min(c_ours):.2f}x CPU time (whole process trees; less "
          f"disturbed by other load than wall time)")
    problems = compare(out, plain_out)
    print("tables agree with the plain job" if not problems else
          "TABLES DIFFER: " + "; ".join(problems[:5]), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(plain_out, ignore_errors=True)
    return {"n": n, "wall_plain": tp, "wall_ours": to, "cpu_plain": min(c_plain),
            "cpu_ours": min(c_ours), "problems": problems, "archive": archive, "nseg": nseg}


def scans(r: dict, base: str, a, spark, context: bool) -> float:
    """Scan only: the JVM reader against Parquet (the same rows written by Spark);
    returns the ratio (logjam rec/s / Parquet rec/s)."""
    n, archive, nseg = r["n"], r["archive"], r["nseg"]
    pq = os.path.join(base, f"parquet-{n}")
    spark.read.format("logjam").load(archive).repartition(nseg) \
        .write.mode("overwrite").parquet(pq)

    def scan(df) -> float:
        t = time.perf_counter()
        df.write.format("noop").mode("overwrite").save()
        return time.perf_counter() - t

    from logjam_relay.pipeline.jvmreader import loaded
    reader = "JVM reader" if loaded(spark) else "Python data source (no JVM reader!)"
    scan(spark.read.parquet(pq))                          # warm up JVM + Python workers
    scan(spark.read.format("logjam").load(archive))
    # interleaved repetitions (same machine conditions), best of each
    t_pq, t_ds = [], []
    for _ in range(a.repeat):
        t_pq.append(scan(spark.read.parquet(pq)))
        t_ds.append(scan(spark.read.format("logjam").load(archive)))
    t_pq, t_ds = min(t_pq), min(t_ds)
    r_pq, r_ds = n / t_pq, n / t_ds
    print(f"scan, {n} records, {spark.sparkContext.defaultParallelism} cores ({a.master}):")
    print(f"  parquet scan      : {t_pq:7.3f} s  {r_pq:12,.0f} rec/s")
    print(f"  logjam data source: {t_ds:7.3f} s  {r_ds:12,.0f} rec/s  (format(\"logjam\"): "
          f"{reader})")
    print(f"  scan ratio logjam / parquet at {n}: {r_ds / r_pq:.3f}x  (target >= 0.9x)",
          flush=True)
    if context and loaded(spark):
        scan(spark.read.format("logjam_python").load(archive))
        t_py = min(scan(spark.read.format("logjam_python").load(archive))
                   for _ in range(a.repeat))
        print(f"  context: the Python data source (what reads when the JVM reader cannot "
              f"be built): {t_py:.3f} s, {t_pq / t_py:.3f}x parquet")
    if context:
        spark.dataSource.register(_replay_source())
        scan(spark.read.format("bench_replay").load(archive))     # decodes, fills the cache
        t_rp = min(scan(spark.read.format("bench_replay").load(archive))
                   for _ in range(a.repeat))
        print(f"  context: a Python data source replaying decoded batches from memory (no "
              f"decoding): {t_rp:.3f} s, {t_pq / t_rp:.3f}x parquet -- the ceiling of "
              f"Spark's Python data source path here")
    shutil.rmtree(pq, ignore_errors=True)
    return r_ds / r_pq


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, nargs="+", default=[1_000_000, 10_000_000],
                    help="sizes (the per-record costs are fitted over them)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--data", default=None,
                    help="keep the generated data here (DATA/N) and reuse it in later runs")
    ap.add_argument("--engine", default="auto", choices=("auto", "jvm", "sql", "python"),
                    help="pipeline stats --engine")
    ap.add_argument("--repeat", type=int, default=3, help="scan repetitions")
    ap.add_argument("--repeat-jobs", type=int, default=2, help="whole-process repetitions")
    ap.add_argument("--no-scan", action="store_true", help="whole processes only")
    ap.add_argument("--scan-only", action="store_true", help="the scans only")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--plain-job", nargs=2, metavar=("JSON_DIR", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plain_job:
        plain_job(a.plain_job[0], a.plain_job[1], a.master)
        return 0

    base = tempfile.mkdtemp(prefix="bench_pipeline_", dir=a.dir)
    print(f"the JVM reader's zlib path: {native_zlib_path()}", flush=True)
    try:
        results = []
        for k, n in enumerate(sorted(set(a.records))):
            d = prepare(n, base, a.data)
            if a.scan_only:
                archive = os.path.join(d, "archive")
                results.append({"n": n, "archive": archive, "problems": [], "nseg": len(
                    [f for f in os.listdir(archive) if f.endswith(".seg")])})
                continue
            results.append(jobs(n, d, base, a, first=k == 0))
        print()
        for r in results if not a.scan_only else ():
            print(f"at {r['n']:>10,} records: pipeline {r['wall_ours']:7.2f} s, plain job "
                  f"{r['wall_plain']:7.2f} s: plain / pipeline {r['wall_plain'] / r['wall_ours']:.2f}x"
                  f" wall, {r['cpu_plain'] / r['cpu_ours']:.2f}x CPU  (target >= 2.5x at 10M)")
        if len(results) > 1 and not a.scan_only:
            for what in ("wall", "cpu"):
                fo = fit([(r["n"], r[f"{what}_ours"]) for r in results])
                fp = fit([(r["n"], r[f"{what}_plain"]) for r in results])
                print(f"fitted {what:4}: pipeline {fo[0]:6.2f} s + {fo[1] * 1e6:5.2f} us/record;"
                      f" plain job {fp[0]:6.2f} s + {fp[1] * 1e6:5.2f} us/record; marginal "
                      f"cost pipeline / plain {fo[1] / fp[1]:.2f} (target <= 0.33)")
        problems = [p for r in results for p in r["problems"]]
        if not a.no_scan:
            from logjam_relay.pipeline.cli import make_session
            # (no console progress bar: the scans' lines are what is pasted)
            spark = make_session(a.master, "bench_pipeline",
                                 extra_conf={"spark.ui.showConsoleProgress": "false"})
            for k, r in enumerate(results):
                scans(r, base, a, spark, context=k == 0)
            spark.stop()
        return 0 if not problems else 1
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print("kept", base)


if __name__ == "__main__":
    sys.exit(main())

"""Spark data source decode throughput against Spark's own Parquet scan (same run), and the
full stats pipeline's records/s.

    python bench/bench_pipeline.py [--records 1000000] [--master local[2]] [--dir /tmp]

1. ``--records`` synthetic logjam messages (80 % logs, all four compression methods in
   turn, 2 devices) are appended to a spool as the relay does and archived (64 MiB
   segments).
2. Baseline: the decoded rows are written once to Parquet by Spark (snappy, as many
   files as there are segments); then both are scanned with ``write.format("noop")``
   (all columns materialised, nothing written):
   * Parquet: ``spark.read.parquet(p)``
   * data source: ``spark.read.format("logjam").load(archive)``
   Each scan runs ``--repeat`` times; the best time counts.  Both use the same cores, so
   the ratio of rates is the ratio per core.  Target: data source >= 0.25x Parquet.
3. The whole ``pipeline stats`` (batch: decode, JSON parsing, the four tables, Parquet
   output) on the same archive: records/s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()

    from logjam_relay.pipeline import sample
    from logjam_relay.pipeline.cli import make_session
    from logjam_relay.pipeline.stats import run_batch

    base = tempfile.mkdtemp(prefix="bench_pipeline_", dir=a.dir)
    try:
        t0 = time.perf_counter()
        msgs = sample.make_messages(a.records, malformed=False, gaps=True)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        archive = os.path.join(base, "archive")
        sample.write_archive(os.path.join(base, "spool"), archive, msgs,
                             segment_bytes=64 << 20, batch=1000)
        del msgs
        t_arch = time.perf_counter() - t0
        nseg = len([f for f in os.listdir(archive) if f.endswith(".seg")])
        size = sum(os.path.getsize(os.path.join(archive, f)) for f in os.listdir(archive))
        print(f"records: {a.records}  segments: {nseg}  archive: {size / 1e6:.1f} MB  "
              f"(generated in {t_gen:.1f} s, spooled+archived in {t_arch:.1f} s)")

        spark = make_session(a.master, "bench_pipeline")
        cores = spark.sparkContext.defaultParallelism
        ds = spark.read.format("logjam").load(archive)
        pq = os.path.join(base, "parquet")
        ds.repartition(nseg).write.mode("overwrite").parquet(pq)

        def scan(df) -> float:
            t = time.perf_counter()
            df.write.format("noop").mode("overwrite").save()
            return time.perf_counter() - t

        scan(spark.read.parquet(pq))                          # warm up JVM + Python workers
        scan(spark.read.format("logjam").load(archive))
        t_pq = min(scan(spark.read.parquet(pq)) for _ in range(a.repeat))
        t_ds = min(scan(spark.read.format("logjam").load(archive)) for _ in range(a.repeat))
        n = a.records
        r_pq, r_ds = n / t_pq, n / t_ds
        print(f"cores: {cores} ({a.master})")
        print(f"parquet scan      : {t_pq:7.3f} s  {r_pq:12,.0f} rec/s  "
              f"{r_pq / cores:12,.0f} rec/s/core")
        print(f"logjam data source: {t_ds:7.3f} s  {r_ds:12,.0f} rec/s  "
              f"{r_ds / cores:12,.0f} rec/s/core")
        print(f"ratio data source / parquet: {r_ds / r_pq:.3f}x  (target >= 0.25x)")

        out = os.path.join(base, "out")
        t = time.perf_counter()
        summary = run_batch(spark, archive, out)
        t_pipe = time.perf_counter() - t
        print(f"pipeline stats (batch): {t_pipe:7.3f} s  {n / t_pipe:12,.0f} rec/s  "
              f"rows out: {summary['rows_out']}")
        spark.stop()
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print("kept", base)
    return 0


if __name__ == "__main__":
    sys.exit(main())

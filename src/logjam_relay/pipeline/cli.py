"""``logjam-relay pipeline stats ...``: the stats pipeline on the command line.

    logjam-relay pipeline stats --input ARCHIVE --output OUT [--master local[*]]
    logjam-relay pipeline stats --input ARCHIVE --output OUT --stream --checkpoint CKPT
                                [--available-now] [--trigger-interval 10s]

Also runnable as ``spark-submit -m``-style module: ``python -m logjam_relay.pipeline.cli
stats ...`` or ``spark-submit src/logjam_relay/pipeline/cli.py stats ...`` (``--master`` is
then left to spark-submit unless given).  Tables: ``OUT/request_stats``, ``OUT/exceptions``,
``OUT/loss``, ``OUT/topics`` (Parquet, partitioned by ``date``).  See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..config import duration


def make_session(master: str | None = "local[*]", app_name: str = "logjam-relay-pipeline",
                 extra_conf: dict | None = None):
    """A SparkSession set up for the pipeline (UTC, dynamic partition overwrite, the
    ``logjam`` data source registered)."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from .stats import configure
    b = SparkSession.builder.appName(app_name)
    if master:
        b = b.master(master)
    conf = {"spark.ui.enabled": "false", "spark.sql.session.timeZone": "UTC",
            "spark.sql.shuffle.partitions": "8",
            "spark.sql.sources.partitionOverwriteMode": "dynamic",
            "spark.driver.memory": "2g"}
    conf.update(extra_conf or {})
    for k, v in conf.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    configure(spark)
    return spark


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="logjam-relay pipeline",
                                 description="Spark pipelines over the relay's archive")
    sub = ap.add_subparsers(dest="command", required=True)
    st = sub.add_parser("stats", help="request stats, exceptions, loss report, topic counts")
    st.add_argument("--input", required=True, metavar="DIR", help="archive directory")
    st.add_argument("--output", required=True, metavar="DIR", help="output directory")
    st.add_argument("--master", default=None, metavar="URL",
                    help="Spark master (default local[*]; under spark-submit: its own)")
    st.add_argument("--stream", action="store_true", help="run as a streaming query")
    st.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (--stream)")
    st.add_argument("--available-now", action="store_true",
                    help="--stream: process what is archived now, then exit")
    st.add_argument("--trigger-interval", default="10s", metavar="DURATION",
                    help="--stream: micro-batch interval (default 10s)")
    st.add_argument("--max-records-per-trigger", type=int, default=0, metavar="N",
                    help="--stream: at most N records per micro-batch (0 = all)")
    st.add_argument("--apdex-ms", type=float, default=500.0, metavar="MS",
                    help="apdex threshold T in ms (default 500)")
    st.add_argument("-q", "--quiet", action="store_true", help="only the summary")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    a = ap.parse_args(argv)
    if a.stream and not a.checkpoint:
        ap.error("--stream needs --checkpoint DIR")
    if not os.path.isdir(a.input):
        print(f"logjam-relay pipeline: input {a.input} is not a directory", file=sys.stderr)
        return 2
    try:
        interval = duration(a.trigger_interval)
    except ValueError as e:
        ap.error(f"--trigger-interval: {e}")
    master = a.master
    if master is None and "SPARK_SUBMIT_OPTS" not in os.environ and \
            not os.environ.get("PYSPARK_GATEWAY_PORT"):
        master = "local[*]"

    def log(msg: str) -> None:
        if not a.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    t0 = time.perf_counter()
    log(f"starting Spark ({master or 'from spark-submit'})")
    spark = make_session(master)
    from .stats import run_batch, run_stream
    try:
        if a.stream:
            s = run_stream(spark, a.input, a.output, a.checkpoint, a.apdex_ms,
                           available_now=a.available_now,
                           interval=f"{max(interval, 0.1)} seconds",
                           max_records_per_trigger=a.max_records_per_trigger, log=log)
        else:
            s = run_batch(spark, a.input, a.output, a.apdex_ms, log=log)
    finally:
        spark.stop()
    dt = time.perf_counter() - t0
    parts = ", ".join(f"{k} {v}" for k, v in s.get("tables", {}).items())
    extra = ""
    if "bad_records" in s:
        extra = (f" ({s['bad_records']} undecodable, {s['corrupt_segments']} corrupt regions,"
                 f" {s['bad_json']} not JSON)")
    print(f"summary: rows in {s['rows_in']}{extra}, rows out {s['rows_out']} [{parts}], "
          f"time {dt:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

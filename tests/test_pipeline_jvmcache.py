"""The driver JVM's class-data archive of ``pipeline stats`` (pipeline/jvmcache.py): written
by a first run, used by the next, and a damaged one is detected and written again instead
of crashing the JVM -- through the real console script, called by path without the venv on
PATH (as systemd and cron call it)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("pyspark")

from logjam_relay.pipeline import jvmcache, sample  # noqa: E402
from logjam_relay.pipeline.java import ensure_java  # noqa: E402

EXE = os.path.join(os.path.dirname(sys.executable), "logjam-relay")


def test_key_follows_class_path_settings(tmp_path):
    a = jvmcache.ClassArchive(str(tmp_path), {})
    b = jvmcache.ClassArchive(str(tmp_path), {"spark.jars": "/x/extra.jar"})
    assert a.key != b.key and a.key == jvmcache.ClassArchive(str(tmp_path), {}).key


def test_options_write_then_use_and_size_is_checked(tmp_path):
    os.environ.update(ensure_java())
    a = jvmcache.ClassArchive(str(tmp_path / "c"), {})
    opts = a.java_options()
    assert a.writing and f"-XX:ArchiveClassesAtExit={a.tmp}" in opts and "-Xlog:cds=off" in opts
    # an archive recorded with another size (truncated, replaced) is not used
    with open(a.path, "wb") as fh:
        fh.write(b"x" * 100)
    with open(a.meta, "w") as fh:
        json.dump({"size": 200}, fh)
    assert not a.usable()
    # ... so it is not mapped (a truncated archive would crash the JVM with SIGBUS): the
    # run writes a new one instead
    c = jvmcache.ClassArchive(str(tmp_path / "c"), {})
    opts = c.java_options()
    assert "SharedArchiveFile" not in opts and c.writing
    assert f"-XX:ArchiveClassesAtExit={c.tmp}" in opts
    with open(a.meta, "w") as fh:
        json.dump({"size": 100}, fh)
    b = jvmcache.ClassArchive(str(tmp_path / "c"), {})
    assert b.usable() and b.java_options().startswith(f"-XX:SharedArchiveFile={b.path} ")
    assert not b.writing


def test_unwritable_cache_costs_only_the_speed_up(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        a = jvmcache.ClassArchive(str(d / "sub"), {})
        if os.geteuid() != 0:       # root writes anyway
            assert a.java_options() == "" and not a.writing
    finally:
        d.chmod(0o700)


MESSAGES = sample.make_messages(2000, seed=3)


@pytest.fixture(scope="module")
def small_archive(tmp_path_factory):
    d = tmp_path_factory.mktemp("jvmc")
    sample.write_archive(d / "spool", d / "archive", MESSAGES, segment_bytes=256 << 10)
    return str(d / "archive")


def _run(archive, out, cache, env=None):
    env = dict(env or os.environ, XDG_CACHE_HOME=str(cache))
    r = subprocess.run([EXE, "pipeline", "stats", "--input", archive, "--output", str(out),
                        "--master", "local[2]"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "SIGBUS" not in r.stderr and "fatal error" not in r.stderr
    return r.stdout


def test_the_wait_for_the_driver_jvm_lasts_while_it_works(monkeypatch):
    """The driver JVM writes its class archive when it exits: on a busy machine that takes
    longer than any fixed timeout (the real command's first run then said nothing of the
    archive and left none).  The wait lasts while the process uses CPU, and ends after
    ``timeout`` seconds without any."""
    from types import SimpleNamespace

    from pyspark import SparkContext

    def child(code):
        return subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.read()\n"
                                 + code], stdin=subprocess.PIPE)
    busy = child("t = time.process_time()\nwhile time.process_time() - t < 3: pass")
    idle = child("time.sleep(120)")
    try:
        for proc, exited in ((busy, True), (idle, False)):
            gw = SimpleNamespace(proc=proc, jvm=SimpleNamespace(
                System=SimpleNamespace(getProperty=lambda k: "the-class-path")))
            monkeypatch.setattr(SparkContext, "_gateway", gw)
            assert jvmcache.wait_for_jvm_exit(timeout=1.0) == "the-class-path"
            # 3 CPU-seconds of work outlast the 1 s the wait gives a process doing nothing
            assert (proc.poll() is not None) is exited, proc.args
        assert busy.returncode == 0
    finally:
        idle.kill()
        idle.wait()


def test_first_run_writes_next_uses_damaged_is_rewritten(small_archive, tmp_path):
    """Two runs of the real command: the first writes the archive, the second maps it.
    A damaged archive is rewritten rather than mapped: the size check that decides it is
    test_options_write_then_use_and_size_is_checked (a third run here, writing again, cost
    a minute and proved nothing the first run does not)."""
    cache = tmp_path / "cache"
    jdir = cache / "logjam-relay" / "jvm"
    # The first run is also the console script called by absolute path with a PATH that has
    # no venv and whose `python3` is useless (exits 1), as systemd and cron call it: Spark's
    # workers must be started with the interpreter running the command (PYSPARK_PYTHON
    # defaults to it), and the tables must be right.  (This was a run of its own in
    # test_pipeline_cluster.py.)
    from test_pipeline_cluster import assert_same, base_env, reference, tables
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("python3", "python"):
        (fake / name).write_text("#!/bin/sh\necho 'not the venv python' >&2\nexit 1\n")
        (fake / name).chmod(0o755)
    env = base_env(PATH=f"{fake}:/usr/bin:/bin")
    env.pop("VIRTUAL_ENV", None)
    assert subprocess.run(["python3", "-c", "1"], env=env).returncode == 1
    out1 = _run(small_archive, tmp_path / "o1", cache, env)
    assert f"summary: rows in {len(MESSAGES)}" in out1
    assert_same(tables(str(tmp_path / "o1")), reference(MESSAGES))
    assert "JVM class archive: writing" in out1 and "JVM class archive written" in out1, out1
    jsa = [p for p in os.listdir(jdir) if p.endswith(".jsa")]
    assert len(jsa) == 1 and not [p for p in os.listdir(jdir) if p.endswith(".tmp")]
    path = jdir / jsa[0]
    size = path.stat().st_size
    assert size > 10 << 20 and json.loads((jdir / (jsa[0] + ".json")).read_text())["size"] == size

    out2 = _run(small_archive, tmp_path / "o2", cache, env)
    assert f"JVM class archive: using {path}" in out2
    summary = [ln for ln in out1.splitlines() if ln.startswith("summary:")][0]
    assert summary.split(", time")[0] == \
        [ln for ln in out2.splitlines() if ln.startswith("summary:")][0].split(", time")[0]

    # truncated (a full disk, a copy cut short): the archive the real command wrote is no
    # longer usable, and the next run would write it again rather than map it
    path.chmod(0o600)
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    os.environ.update(ensure_java())            # the command's Java: part of the key
    again = jvmcache.ClassArchive(str(jdir), {})
    assert again.path == str(path), "the test's archive is the one the command keys"
    assert not again.usable() and "SharedArchiveFile" not in again.java_options()
    assert again.writing


def test_a_build_keeps_jars_in_use_and_removes_what_dead_runs_left(tmp_path):
    """Two installed versions share the user's cache: building one's reader jar must not
    remove the other's while it may be in use (a session opens its jar by path whenever it
    looks a data source up: a removed jar fails the other version's job), only a jar
    unused for OLD_JAR_SECONDS.  What killed runs left half-written goes (an archive part
    is about 170 MB)."""
    from logjam_relay.pipeline import jvmreader
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getpid()
    recent = tmp_path / "logjam-reader-0000000000000001.jar"
    stale = tmp_path / "logjam-reader-0000000000000002.jar"
    for p in (recent, stale):
        p.write_bytes(b"PK")
    old = os.path.getmtime(stale) - jvmreader.OLD_JAR_SECONDS - 60
    os.utime(stale, (old, old))
    parts = {name: tmp_path / name for name in (
        f".logjam-reader-0000000000000003.jar.{dead.pid}",
        f".logjam-reader-0000000000000003.jar.{os.getppid()}")}
    for p in parts.values():
        p.write_bytes(b"x")
    path = jvmreader.build_jar(str(tmp_path))
    left = sorted(os.listdir(tmp_path))
    assert os.path.basename(path) in left and recent.name in left, left
    assert stale.name not in left, left
    assert f".logjam-reader-0000000000000003.jar.{dead.pid}" not in left, left
    assert f".logjam-reader-0000000000000003.jar.{os.getppid()}" in left, left
    # the archive's parts: a dead writer's goes, a live one's (this process) stays
    archive_dir = tmp_path / "jsa"
    archive_dir.mkdir()
    (archive_dir / f"spark-abc.{dead.pid}.tmp").write_bytes(b"x")
    (archive_dir / f"spark-abc.{live}.tmp").write_bytes(b"x")
    jvmcache.remove_stale_parts(str(archive_dir), "spark-*.*.tmp")
    assert os.listdir(archive_dir) == [f"spark-abc.{live}.tmp"]


def test_no_archive_with_a_configuration_directory_on_the_classpath(tmp_path, monkeypatch):
    """Spark's launcher puts SPARK_CONF_DIR (or $SPARK_HOME/conf), HADOOP_CONF_DIR and
    YARN_CONF_DIR on the driver's classpath, and the JVM writes no class archive with a
    non-empty directory there: it printed "Error occurred during initialization of VM"
    into the command's output at the end of every run.  No archive is tried; one line says
    why.  An empty or missing directory is no obstacle."""
    from logjam_relay.pipeline.cli import _class_archive
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    for k in ("SPARK_CONF_DIR", "HADOOP_CONF_DIR", "YARN_CONF_DIR"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SPARK_HOME", str(tmp_path / "no-spark-home"))
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    lines: list[str] = []
    conf: dict = {}
    assert jvmcache.classpath_blockers() == []
    archive = _class_archive(str(tmp_path / "cache"), conf, True, lines.append)
    assert archive is not None and "ArchiveClassesAtExit" in conf["spark.driver.extraJavaOptions"]
    (conf_dir / "spark-defaults.conf").write_text("spark.ui.enabled false\n")
    for env in ({"SPARK_CONF_DIR": str(conf_dir)},
                {"SPARK_CONF_DIR": str(tmp_path / "missing"), "HADOOP_CONF_DIR": str(conf_dir)}):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        lines.clear()
        conf = {}
        assert jvmcache.classpath_blockers() == [str(conf_dir)]
        assert _class_archive(str(tmp_path / "cache"), conf, True, lines.append) is None
        assert conf == {} and len(lines) == 1 and str(conf_dir) in lines[0], lines


def test_a_java_that_compiles_nothing_and_a_damaged_cached_jar(tmp_path, monkeypatch):
    """A `java` stub that exits 0 (test_deploy's fake Java 8, found first by an earlier
    `pipeline stats`) built a jar of no classes into the cache, which then served it to
    every later run: the reader never loaded, and registering the Python source under its
    name failed (DATA_SOURCE_ALREADY_EXISTS).  Such a build is a BuildError now, and a
    cached jar that is damaged -- no classes, cut short, empty, not a zip, a bad entry --
    is built again."""
    import zipfile

    from logjam_relay.pipeline import jvmreader
    for k, v in ensure_java().items():
        monkeypatch.setenv(k, v)
    stub = tmp_path / "bin" / "java"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    with pytest.raises(jvmreader.BuildError, match="made no class for"):
        jvmreader.build(str(tmp_path / "x.jar"), java=str(stub))
    assert not (tmp_path / "x.jar").exists()
    cache = tmp_path / "cache"
    good = jvmreader.build_jar(str(cache))
    assert jvmreader.jar_problem(good) is None
    data, want = open(good, "rb").read(), entries(good)
    services_only = tmp_path / "services-only.jar"
    with zipfile.ZipFile(services_only, "w") as z:
        z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
        z.writestr(jvmreader.SERVICES, "logjamrelay.spark.LogjamProvider\n")
    flipped = bytearray(data)
    flipped[200] ^= 0xFF                                # inside the first entry's data
    for damage in (services_only.read_bytes(), data[:len(data) // 2], b"", b"not a zip",
                   bytes(flipped)):
        with open(good, "wb") as fh:
            fh.write(damage)
        assert jvmreader.jar_problem(good) is not None
        assert jvmreader.build_jar(str(cache)) == good
        assert jvmreader.jar_problem(good) is None and entries(good) == want


def entries(jar: str) -> dict[str, bytes]:
    import zipfile
    with zipfile.ZipFile(jar) as z:
        return {n: z.read(n) for n in z.namelist()}

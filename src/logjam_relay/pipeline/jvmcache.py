"""A class-data archive (JDK AppCDS) for the driver JVM of ``pipeline stats``.

A batch run is mostly a JVM starting cold: loading and verifying some 15,000 classes of
Spark, Hadoop and Scala from the jars takes about half of the JVM's start-up CPU.  The JDK
can map classes it loaded before from a *class-data sharing* archive instead.  The first
run writes such an archive at JVM exit (``-XX:ArchiveClassesAtExit``); later runs map it
(``-XX:SharedArchiveFile``), which halves the driver JVM's start-up.

* Where: ``$XDG_CACHE_HOME/logjam-relay/jvm`` (default ``~/.cache/logjam-relay/jvm``), or
  ``--jvm-cache DIR``; ``--jvm-cache off`` turns it off.  One archive is kept (about
  120-200 MB); it is keyed by the Java binary, the Spark jars and the class-path settings,
  so an upgrade of either writes a new one and removes the old.
* Safety: the JVM writes the archive to a temporary name; the command waits for the JVM to
  exit, has a separate ``java -Xshare:on -XX:+VerifySharedSpaces`` check it (with the
  class path the driver had), and only then renames it into place, recording its size.  A
  later run uses it only if the size still matches (a truncated archive would crash the
  JVM); anything unusable is removed and written again.  The JVM ignores an archive whose
  class path does not match (``-Xshare:auto``), with its CDS log lines off.
* Anything going wrong here (no home directory, read-only cache, a JVM without CDS) only
  costs the speed-up: the run itself goes on without an archive.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import hashlib
import json
import os
import shutil
import subprocess
import time

#: JVM options that keep the JDK's CDS messages off stderr (an archive that does not
#: match is ignored silently: it only costs the speed-up)
QUIET = "-Xshare:auto -Xlog:cds=off -Xlog:cds+dynamic=off"
#: Spark settings that change the driver's class path (part of the archive's key)
CLASSPATH_CONF = ("spark.jars", "spark.jars.packages", "spark.driver.extraClassPath")


def default_dir(environ=None) -> str | None:
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or (
        os.path.join(env["HOME"], ".cache") if env.get("HOME") else None)
    return os.path.join(base, "logjam-relay", "jvm") if base else None


def find_java(environ=None) -> str | None:
    env = os.environ if environ is None else environ
    home = env.get("JAVA_HOME")
    if home and os.path.exists(os.path.join(home, "bin", "java")):
        return os.path.join(home, "bin", "java")
    return shutil.which("java", path=env.get("PATH", os.defpath))


def spark_jars() -> list[str]:
    import pyspark
    home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
    return sorted(glob.glob(os.path.join(home, "jars", "*.jar")))


class ClassArchive:
    """The archive of one (Java, Spark jars, class path settings) combination."""

    def __init__(self, cache_dir: str, conf: dict | None = None, environ=None):
        self.dir = cache_dir
        self.java = find_java(environ)
        h = hashlib.sha256()
        for part in self._key_parts(conf or {}):
            h.update(part.encode() + b"\0")
        self.key = h.hexdigest()[:20]
        self.path = os.path.join(cache_dir, f"spark-{self.key}.jsa")
        self.meta = self.path + ".json"
        self.tmp = os.path.join(cache_dir, f"spark-{self.key}.{os.getpid()}.tmp")
        self.writing = False

    def _key_parts(self, conf: dict):
        if self.java is None:
            return
        real = os.path.realpath(self.java)
        st = os.stat(real)
        yield f"{real} {st.st_size} {st.st_mtime_ns}"
        for j in spark_jars():
            s = os.stat(j)
            yield f"{os.path.basename(j)} {s.st_size}"
        for k in CLASSPATH_CONF:
            yield f"{k}={conf.get(k, '')}"

    def usable(self) -> bool:
        """The archive exists, was checked when it was written, and has its size still."""
        try:
            with open(self.meta, encoding="utf-8") as fh:
                size = int(json.load(fh)["size"])
            return os.path.getsize(self.path) == size
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def java_options(self) -> str:
        """JVM options for this run: map the archive, or write one at exit, or nothing."""
        if self.java is None:
            return ""
        if self.usable():
            return f"-XX:SharedArchiveFile={self.path} {QUIET}"
        try:
            os.makedirs(self.dir, exist_ok=True)
            if not os.access(self.dir, os.W_OK):
                return ""
        except OSError:
            return ""
        remove_stale_parts(self.dir, "spark-*.*.tmp")
        self.writing = True
        return f"-XX:ArchiveClassesAtExit={self.tmp} {QUIET}"

    def finish(self, classpath: str | None, timeout: float = 60.0) -> bool:
        """After the JVM has exited: check the archive it wrote and put it into place
        (True), or remove it (False).  Only when this run was writing one."""
        if not self.writing:
            return False
        ok = False
        try:
            if classpath and os.path.getsize(self.tmp) > 0:
                with subprocess.Popen(
                        [self.java, "-cp", classpath, f"-XX:SharedArchiveFile={self.tmp}",
                         "-Xshare:on", "-XX:+VerifySharedSpaces", "-version"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as check:
                    if not wait_while_busy(check, idle_s=timeout):
                        check.kill()
                    ok = check.wait() == 0
            if ok:
                size = os.path.getsize(self.tmp)
                for old in glob.glob(os.path.join(self.dir, "spark-*.jsa*")):
                    if not old.startswith(self.path):
                        _remove(old)
                os.replace(self.tmp, self.path)
                tmp_meta = self.meta + f".{os.getpid()}"
                with open(tmp_meta, "w", encoding="utf-8") as fh:
                    json.dump({"size": size, "java": self.java}, fh)
                os.replace(tmp_meta, self.meta)
        except (OSError, subprocess.SubprocessError):
            ok = False
        finally:
            _remove(self.tmp)
        return ok


def classpath_blockers(env: dict | None = None) -> list[str]:
    """The non-empty directories Spark's launcher puts on the driver's classpath (its
    configuration directory, ``HADOOP_CONF_DIR``, ``YARN_CONF_DIR``): the JVM refuses to
    write or map a class archive with one of them there ("Cannot have non-empty directory
    in paths"), so none is tried."""
    env = os.environ if env is None else env
    conf = env.get("SPARK_CONF_DIR")
    if not conf:
        home = env.get("SPARK_HOME")
        if not home:
            try:
                from pyspark.find_spark_home import _find_spark_home
                home = _find_spark_home()
            except Exception:
                home = None
        conf = os.path.join(home, "conf") if home else None
    out = []
    for d in (conf, env.get("HADOOP_CONF_DIR"), env.get("YARN_CONF_DIR")):
        try:
            if d and os.path.isdir(d) and os.listdir(d):
                out.append(d)
        except OSError:
            pass
    return out


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def remove_stale_parts(directory: str, pattern: str) -> None:
    """Remove the files ``pattern`` matches in ``directory`` whose writer is gone: their
    last all-digit dot-separated part is the writing process's pid (an archive or a jar
    being written; a killed run leaves its part behind, 170 MB for an archive)."""
    for p in glob.glob(os.path.join(directory, pattern)):
        pids = [int(x) for x in os.path.basename(p).split(".") if x.isdigit()]
        if not pids:
            continue
        pid = pids[-1]
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _remove(p)
        except OSError:
            pass


def _quiet_py4j(gw) -> None:
    """Before the JVM is made to exit: send Py4J's pending "memory delete"s of collected
    proxies now, then mark its client disconnected.  Py4J sends them from a worker thread
    that wakes once a second; one sent while the JVM exits fails, and Py4J prints that with a
    traceback on the root logger, after the command's last line (seen in a job that failed:
    its exception's frames held proxies).  A disconnected client skips them: the JVM that
    would free the objects is about to be gone anyway."""
    client = getattr(gw, "_gateway_client", None)
    pending = getattr(client, "finalizer_deque", None)
    if client is None:
        return
    gc.collect()
    while pending:
        try:
            task = pending.pop()
        except IndexError:              # the worker took the last one
            break
        if not isinstance(task, tuple):             # the worker's stop: leave it
            pending.append(task)
            break
        with contextlib.suppress(Exception):
            client.garbage_collect_object(task[1], False)
    client.is_connected = False


def driver_jvm(spark):
    """The py4j view of the JVM of ``spark`` (a classic session) when its context is the
    active one (pyspark keeps the view on the class); None otherwise (Spark Connect,
    anything else)."""
    from pyspark import SparkContext
    try:
        sc = spark.sparkContext
    except Exception:               # noqa: BLE001  (Spark Connect raises its own error)
        return None
    if sc is None or sc is not SparkContext._active_spark_context:
        return None
    return SparkContext._jvm


def _cpu_ticks(pid: int) -> int | None:
    """utime + stime of a process (clock ticks, /proc), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def wait_while_busy(proc, idle_s: float = 60.0, limit_s: float = 1800.0) -> bool:
    """Wait for ``proc`` to exit for as long as it keeps using CPU: give up (False) once it
    has used none for ``idle_s``, or after ``limit_s`` in all.  A JVM that writes its class
    archive at exit links and dumps every loaded class (100-200 MB): a few seconds on an idle
    machine, minutes on a busy one; a wall-clock timeout would cut that dump short there and
    leave no archive, a stuck JVM still ends the wait."""
    t0 = last = time.monotonic()
    ticks = _cpu_ticks(proc.pid)
    while True:
        try:
            proc.wait(timeout=1.0)
            return True
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        t = _cpu_ticks(proc.pid)
        if t is None or t != ticks:
            ticks, last = t, now
        if now - last > idle_s or now - t0 > limit_s:
            return False


def wait_for_jvm_exit(timeout: float = 60.0) -> str | None:
    """Close the Spark driver JVM's stdin (it exits on EOF, writing a class archive if
    asked to) and wait for it while it works (:func:`wait_while_busy`, ``timeout`` without
    using CPU ends the wait); returns the class path it had, or None."""
    from pyspark import SparkContext
    gw = SparkContext._gateway
    proc = getattr(gw, "proc", None) if gw is not None else None
    classpath = None
    if gw is not None:
        try:
            classpath = gw.jvm.System.getProperty("java.class.path")
        except Exception:       # noqa: BLE001  (a JVM already gone: nothing to wait for)
            classpath = None
    if proc is None:
        return classpath
    _quiet_py4j(gw)
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        wait_while_busy(proc, idle_s=timeout)
    except OSError:
        pass
    SparkContext._gateway = None
    SparkContext._jvm = None
    return classpath

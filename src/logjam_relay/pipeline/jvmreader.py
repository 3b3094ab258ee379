"""The JVM reader of the ``logjam`` format: batch scans without a Python worker.

Spark's Python data sources hand every Arrow batch to the JVM, which turns it into rows one
by one; that path alone caps a scan at 0.5-0.8x of Spark's Parquet scan on these
machines, before any decoding.  ``pipeline/jvm/logjamrelay/spark/*.java`` decodes archived
segments on the JVM straight into columnar batches instead (the JVM twin of
:mod:`.decode`, as the C twins are of the Python walk; ``tests/test_pipeline_jvm.py``
compares the rows on whole, sliced and damaged segments).

* It is compiled on first use with Janino, the Java compiler Spark itself ships (its jars
  are on every Spark class path), run by the same ``java`` Spark runs on: no JDK needed.
  The jar is kept in ``$XDG_CACHE_HOME/logjam-relay/jvm`` (default
  ``~/.cache/logjam-relay/jvm``), keyed by the sources and the Spark jars; a build takes
  about 2 s.
* :func:`logjam_relay.pipeline.cli.make_session` adds it with ``spark.jars`` (so a cluster's
  executors get it too) and registers the Python data source under ``logjam_python``; the
  JVM provider (short name ``logjam``) reads batch scans of the default columns or any
  subset itself and hands everything else -- streaming, the request fields extracted from
  bodies -- to the Python source.  ``spark-submit --jars JAR`` does the same for a job of
  your own (``logjam-relay pipeline jar`` prints the path).
* When the jar cannot be built or loaded (no writable cache and no temporary directory, a
  Spark without Janino, a session that was already running), the Python data source is
  registered as ``logjam`` and reads everything, with one log line saying why.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import subprocess
import tempfile
import time
import zipfile
import zlib

from .jvmcache import default_dir, driver_jvm, find_java, remove_stale_parts, spark_jars

log = logging.getLogger("logjam_relay.pipeline.jvmreader")

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jvm")
PROVIDER = "logjamrelay.spark.LogjamProvider"
OLD_JAR_SECONDS = 7 * 86400     # another version's jar unused this long is removed
SERVICES = "META-INF/services/org.apache.spark.sql.sources.DataSourceRegister"
#: the largest segment file the JVM reader reads (Constants.MAX_ARRAY: one Java array)
MAX_SEGMENT_BYTES = (1 << 31) - 1 - 64
_COMPILER = "org.codehaus.commons.compiler.samples.CompilerDemo"


class BuildError(RuntimeError):
    pass


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(SOURCE_DIR, "logjamrelay", "spark", "*.java")))


#: where the jar holds the native zlib path (NativeInflate.RESOURCE)
NATIVE_RESOURCE = "logjamrelay/spark/native/libjinflate.so"


def native_library() -> str | None:
    """The built ``_jinflate`` extension (the JVM reader's fast zlib path, see
    ``_jinflate.c``), or None when it was not built (the reader then inflates with
    ``java.util.zip.Inflater`` alone)."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "_jinflate*.so")))
    return found[0] if found else None


def native_inflate_ready() -> bool:
    """Whether the JVM reader's fast zlib path can work here: the extension was built and
    this machine has libdeflate (what ``NativeInflate.status`` will say, less a JVM that
    turns it off)."""
    import ctypes
    lib = native_library()
    try:
        return lib is not None and ctypes.CDLL(lib).ljr_inflate_available() == 1
    except OSError:
        return False


def zlib_path(spark) -> tuple[str, int] | None:
    """What the JVM reader inflates zlib bodies with (``NativeInflate.status``: "libdeflate
    (zlib's rules)" or "java.util.zip.Inflater (why)") and how many bodies the native
    path has inflated in that JVM; None when it cannot be asked (no reader, Spark
    Connect).  Local masters: the driver's JVM, which runs the tasks; others: one
    executor's, asked by a one-task job."""
    cls = "logjamrelay.spark.NativeInflate"
    try:
        if spark.sparkContext.master.startswith("local"):
            ni = driver_jvm(spark).logjamrelay.spark.NativeInflate
            return str(ni.status()), int(ni.answered())
        row = spark.range(1).selectExpr(f"reflect('{cls}', 'status')",
                                        f"reflect('{cls}', 'answered')").first()
        return str(row[0]), int(row[1])
    except Exception:                   # noqa: BLE001 -- no reader, no gateway: not known
        return None


def zlib_path_line(spark) -> str | None:
    """:func:`zlib_path` in one line for the run's log (with what to do when the native
    path is not in use)."""
    got = zlib_path(spark)
    if got is None or not got[0]:
        return None
    status, n = got
    if status.startswith("libdeflate"):
        return f"zlib bodies: {status}, {n:,} inflated by it (the rest by Inflater)"
    hint = ""
    if "no libdeflate" in status:
        hint = " -- install libdeflate0 (Debian, Ubuntu) or libdeflate for the faster path"
    elif "not in the jar" in status:
        hint = " -- the _jinflate extension was not built with this package"
    return f"zlib bodies: {status}{hint}"


def _key(jars: list[str]) -> str:
    h = hashlib.sha256()
    native = native_library()
    for p in sources() + [os.path.join(SOURCE_DIR, SERVICES)] + ([native] if native else []):
        h.update(os.path.relpath(p, SOURCE_DIR).encode() + b"\0")
        with open(p, "rb") as f:
            h.update(f.read())
    for j in jars:                      # the Spark version (and Janino's) by jar names
        h.update(os.path.basename(j).encode() + b"\0")
    return h.hexdigest()[:16]


def build(dest: str, jars: list[str] | None = None, java: str | None = None) -> str:
    """Compile the sources into the jar ``dest`` (atomically); BuildError on failure."""
    jars = spark_jars() if jars is None else jars
    java = java or find_java()
    compiler = [j for j in jars if os.path.basename(j).startswith(("janino-", "commons-compiler-"))]
    if java is None:
        raise BuildError("no java found")
    if len(compiler) != 2:
        raise BuildError("Spark's jars have no Janino compiler (janino-*.jar, commons-compiler-*.jar)")
    srcs = sources()
    with tempfile.TemporaryDirectory(prefix="logjam-reader-") as tmp:
        classes = os.path.join(tmp, "classes")
        os.mkdir(classes)
        cmd = [java, "-cp", os.pathsep.join(compiler), _COMPILER, "-d", classes,
               "-classpath", os.pathsep.join(jars), *srcs]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BuildError(f"the Java compiler did not run: {e}") from None
        out = (r.stdout + r.stderr).strip()
        if r.returncode != 0 or "CompileException" in out:
            raise BuildError(f"the Java compiler failed: {out[-2000:]}")
        # a `java` that is not one (a stub that exits 0) compiles nothing: such a jar,
        # kept in the cache, would hide the reader from every later run
        made = {f[:-6] for _root, _dirs, files in os.walk(classes) for f in files
                if f.endswith(".class")}
        missing = sorted({os.path.basename(p)[:-5] for p in srcs} - made)
        if missing:
            raise BuildError(f"the Java compiler ({java}) made no class for "
                             f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
                             f"{f': {out[-500:]}' if out else ''}")
        part = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.{os.getpid()}")
        with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
            z.write(os.path.join(SOURCE_DIR, SERVICES), SERVICES)
            native = native_library()
            if native:
                z.write(native, NATIVE_RESOURCE)
            for root, _dirs, files in os.walk(classes):
                for f in sorted(files):
                    p = os.path.join(root, f)
                    z.write(p, os.path.relpath(p, classes))
        os.replace(part, dest)
    return dest


def build_jar(cache_dir: str | None = None) -> str:
    """The reader's jar in the cache (built when missing); BuildError when it cannot be."""
    try:
        jars = spark_jars()
        d = cache_dir or default_dir()
        if d is None or not _writable(d):
            d = os.path.join(tempfile.gettempdir(), f"logjam-relay-{os.getuid()}", "jvm")
            if not _writable(d):
                raise BuildError(f"no writable directory for it ({cache_dir or default_dir()}, {d})")
        path = os.path.join(d, f"logjam-reader-{_key(jars)}.jar")
        if os.path.isfile(path):
            problem = jar_problem(path)
            if problem is None:
                _touch(path)
                return path
            log.warning("the JVM reader's jar %s is damaged (%s): built again", path, problem)
        build(path, jars)
        # Another installed version may be using its own jar right now (a session opens
        # it by path whenever it looks a data source up): only jars unused for a while go
        cutoff = time.time() - OLD_JAR_SECONDS
        for old in glob.glob(os.path.join(d, "logjam-reader-*.jar")):
            try:
                if old != path and os.path.getmtime(old) < cutoff:
                    _remove(old)
            except OSError:
                pass
        remove_stale_parts(d, ".logjam-reader-*.jar.*")
        return path
    except OSError as e:
        raise BuildError(str(e)) from None


def jar_problem(path: str) -> str | None:
    """Why the jar at ``path`` is not a whole build of the reader (None: it is): not a zip,
    a damaged entry, or no provider class or service file (a build that compiled
    nothing, a file cut short)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = set(z.namelist())
            for need in (PROVIDER.replace(".", "/") + ".class", SERVICES):
                if need not in names:
                    return f"no {need}"
            bad = z.testzip()
            return f"{bad} is damaged" if bad else None
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
        return f"not a whole jar: {e}"


def ensure_jar(cache_dir: str | None = None) -> str | None:
    """:func:`build_jar`, or None (one log line) when it cannot be had."""
    try:
        return build_jar(cache_dir)
    except BuildError as e:
        log.warning("logjam JVM reader not available (%s); the Python data source reads "
                    "the archive", e)
        return None


def _writable(d: str) -> bool:
    try:
        os.makedirs(d, exist_ok=True)
    except OSError:
        return False
    return os.access(d, os.W_OK | os.X_OK)


def _touch(p: str) -> None:
    """Mark the jar as used (its age decides when another version's build removes it)."""
    try:
        os.utime(p)
    except OSError:
        pass


def _remove(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def loaded(spark) -> bool:
    """Whether this session's JVM can load the reader.  On Spark Connect: whether the
    server's can (it was started with the jar: ``--jars`` or ``spark.jars``), asked with
    one SQL ``reflect`` call."""
    if type(spark).__module__.startswith("pyspark.sql.connect"):
        try:
            r = spark.sql("SELECT reflect('org.apache.spark.util.Utils', 'classIsLoadable', "
                          f"'{PROVIDER}') AS ok").collect()
            return r[0]["ok"] == "true"
        except Exception:               # reflect refused by the server: the Python source
            return False
    try:
        jvm = driver_jvm(spark)
        if jvm is None:
            return False
        return bool(jvm.org.apache.spark.util.Utils.classIsLoadable(PROVIDER))
    except Exception:                   # no py4j gateway (Spark Connect), a stopped JVM
        return False


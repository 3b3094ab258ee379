"""``pipeline stats --remote sc://HOST:PORT``: the batch pipeline through Spark Connect.

Under Spark Connect the process running the command is a thin gRPC client: no JVM, no
``SparkContext``, and its file system is not the cluster's.  Everything that touches the
archive therefore runs in Spark tasks on the server's side:

* **planning** (:func:`plan`): one small job lists the archive's segments with their
  record counts (from the seal records) in a task, and counts the job's tasks (the
  server's default parallelism); the client cuts the segments into slices as
  :func:`.partial.plan_slices` does;
* **the request, exception and topic tables**: the same partial aggregation as a local
  run (:mod:`.partial` in ``mapInArrow`` tasks, merged by :func:`.stats.merge_partials`);
* **the origin walk** (:func:`origin_index`: each event counted once, the loss tables,
  :mod:`.origin`): a local run walks the archives in a driver thread, which under Connect
  would be the client.  Here one task on the server walks them with the same
  :class:`.originindex.OriginIndex` and hands it back (runs and the copies to leave out: small);
  the partial aggregation then leaves those copies out.

Paths (``--input``, ``--output``) are the server's: a relative path is resolved against
the Connect server's working directory (the directory it was started from), never the
client's.  The server's Python workers need ``logjam_relay``; ``--ship-package auto``
uploads the package's Python files (``SparkSession.addArtifacts``) when the first task
finds it missing.  ``--stream`` does not run through Connect (:data:`STREAM_REFUSED`).
"""

from __future__ import annotations

import os

from .stats import DEFAULT_APDEX_MS, merge_partials, split_merged, summary_of_merged

#: why ``--stream --remote`` is refused (the streaming run's bookkeeping is local files)
STREAM_REFUSED = (
    "--stream does not run through Spark Connect: the streaming run reads the file sink's "
    "commit log in OUTPUT/_records and keeps its loss state in OUTPUT on the machine "
    "running the command; run it there with --master, or run batch runs with --remote")

#: the longest the client keeps retrying a server that does not answer (default)
DEFAULT_RETRY_S = 60.0

_PLAN_DDL = "part int, path string, segno long, n long, error string"
#: what the planning task says when the server's Python workers lack the package
_NO_PACKAGE = "no-package"


class RemoteError(Exception):
    """A one-line reason the remote run cannot start or went wrong."""


def remote_url(arg: str | None, environ=os.environ) -> str | None:
    """The Connect URL: ``--remote``, else ``SPARK_REMOTE`` (PySpark's own variable)."""
    url = arg if arg is not None else environ.get("SPARK_REMOTE") or None
    if url is not None and not url.startswith("sc://"):
        raise RemoteError(f"--remote {url}: expected sc://HOST:PORT")
    return url


def is_remote(spark) -> bool:
    """Whether ``spark`` is a Spark Connect session."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def _policy(retry_s: float):
    """PySpark's default retry policy (exponential backoff), cut so that the waits add up
    to about ``retry_s`` seconds: its default keeps retrying an unreachable server for at
    least 10 minutes."""
    from pyspark.sql.connect.client.retries import DefaultPolicy
    initial_ms, mult, cap_ms = 50, 4.0, 5000
    total, wait, n = 0.0, float(initial_ms), 0
    while total + wait <= retry_s * 1000 and n < 1000:
        total += wait
        n += 1
        wait = min(wait * mult, cap_ms)
    return DefaultPolicy(max_retries=n, initial_backoff=initial_ms, backoff_multiplier=mult,
                         max_backoff=cap_ms, max_server_retry_delay=int(retry_s * 1000))


def remote_session(url: str, conf: dict, retry_s: float = DEFAULT_RETRY_S):
    """A Spark Connect session to ``url`` with ``conf`` set (runtime settings only: a
    static setting of the server raises :class:`RemoteError` naming it)."""
    try:
        import pyspark.sql.connect.session  # noqa: F401  (grpcio, pandas, ...: the extra)
        from pyspark.sql import SparkSession
    except ImportError as e:
        raise RemoteError(f"--remote needs the connect extra (pip install "
                          f"'logjam-relay[connect]'): {e}") from None
    import warnings
    # PySpark warns on stderr when its retries run out, before raising: the error says it
    warnings.filterwarnings("ignore", message=r".*RETRIES_EXCEEDED")
    spark = SparkSession.builder.remote(url).create()
    spark.client.set_retry_policies([_policy(retry_s)])
    for k, v in conf.items():
        try:
            spark.conf.set(k, v)
        except Exception as e:
            if unreachable(e):
                raise
            raise RemoteError(f"--conf {k}={v}: {first_line(e)}") from None
    return spark


def ship(spark, zip_path: str) -> None:
    """Upload the zipped package (``cli.package_zip``) to the session: its Python workers
    import it from there (Python twins: the zip has no C extensions)."""
    spark.addArtifacts(zip_path, pyfile=True)


def server_cwd(spark) -> str:
    """The Connect server's working directory (where a relative path is resolved)."""
    r = spark.sql("SELECT reflect('java.lang.System', 'getProperty', 'user.dir') AS d")
    return r.collect()[0]["d"]


def server_path(spark, path: str, cwd: str | None = None) -> str:
    """``path`` as the server sees it (relative: against its working directory)."""
    if os.path.isabs(path) or "://" in path:
        return path
    return os.path.normpath(os.path.join(cwd or server_cwd(spark), path))


# ------------------------------------------------------------------ server-side work

def plan(spark, input_dir: str, min_records: int = 65536):
    """(slices, segments, parallelism) of an archive on the server's side, in one job:
    task 0 lists the segments with their record counts; every task reports itself, which
    counts the server's default parallelism.  ``None`` instead of the tuple when the
    server's Python workers cannot import ``logjam_relay``.  Raises :class:`RemoteError`
    when the input is not a directory there."""

    def task(batches):                  # by value: nothing from logjam_relay at pickling
        import pyarrow as pa
        from pyspark import TaskContext
        part = TaskContext.get().partitionId()
        for _ in batches:
            pass
        rows = {"part": [], "path": [], "segno": [], "n": [], "error": []}

        def row(path=None, segno=None, n=None, error=None):
            for k, v in (("part", part), ("path", path), ("segno", segno), ("n", n),
                         ("error", error)):
                rows[k].append(v)

        if part == 0:
            try:
                from logjam_relay.pipeline.decode import list_segments, record_count
            except ImportError:
                row(error=_NO_PACKAGE)
            else:
                if not os.path.isdir(input_dir):
                    row(error=f"input {input_dir} is not a directory on the Spark "
                              "Connect server")
                else:
                    for segno, path in list_segments(input_dir):
                        row(path, segno, record_count(path))
        if not rows["part"]:
            row()
        yield pa.RecordBatch.from_pydict(rows, schema=pa.schema([
            ("part", pa.int32()), ("path", pa.string()), ("segno", pa.int64()),
            ("n", pa.int64()), ("error", pa.string())]))

    got = spark.range(0, 1 << 12).mapInArrow(task, _PLAN_DDL).collect()
    parallelism = len({r["part"] for r in got})
    for r in got:
        if r["error"] == _NO_PACKAGE:
            return None
        if r["error"]:
            raise RemoteError(r["error"])
    segs = sorted((r["segno"], r["path"], r["n"]) for r in got if r["path"] is not None)
    return slices_of(segs, parallelism, min_records), segs, parallelism


def slices_of(segs, parallelism: int, min_records: int = 65536) -> list:
    """Slices ``(path, segno, start, stop)`` of ``(segno, path, records)`` segments: the
    cuts of :func:`.partial.plan_slices` (about four per core, at least ``min_records``)."""
    from .partial import cut_slices
    return cut_slices([(path, segno, n) for segno, path, n in segs], parallelism, min_records)


def partial_frame(spark, slices: list, apdex_ms: float = DEFAULT_APDEX_MS,
                  exclude: dict | None = None):
    """The partial rows (:mod:`.partial`) of planned slices: :func:`.stats.partial_frame`
    without the client-side listing; ``exclude``: segment path -> records left out."""
    from .partial import partial_schema
    t = float(apdex_ms)

    def read(batches):
        from logjam_relay.pipeline.partial import read_slices
        for b in batches:
            yield from read_slices(slices, b.column(0).to_pylist(), t, exclude=exclude)

    n = max(1, len(slices))
    return spark.range(0, len(slices), 1, numPartitions=n).mapInArrow(read, partial_schema())


def origin_index(spark, input_dirs: list[str]):
    """The :class:`.originindex.OriginIndex` of the archives (server paths), made by one task
    on the server's side and handed back pickled (its runs and the copies to leave out)."""
    import pickle
    dirs = list(input_dirs)

    def task(batches):
        import pickle as pk

        import pyarrow as pa

        from logjam_relay.pipeline.originindex import OriginIndex
        for _ in batches:
            pass
        idx = OriginIndex().add_archives(dirs)
        yield pa.RecordBatch.from_pydict({"blob": [pk.dumps(idx)]},
                                         schema=pa.schema([("blob", pa.binary())]))

    got = spark.range(0, 1, 1, numPartitions=1).mapInArrow(task, "blob binary").collect()
    return pickle.loads(got[0]["blob"])


def _planned(spark, input_dir: str, ship_zip):
    planned = plan(spark, input_dir)
    if planned is None:
        if ship_zip is None:
            raise RemoteError("the Spark Connect server's Python workers cannot import "
                              "logjam_relay: install it there, or leave --ship-package "
                              "at auto")
        ship(spark, ship_zip())
        planned = plan(spark, input_dir)
        if planned is None:
            raise RemoteError("the Spark Connect server's Python workers cannot import "
                              "logjam_relay, even from the uploaded package")
    return planned


def compute_tables(spark, input_dir, apdex_ms: float = DEFAULT_APDEX_MS, ship_zip=None):
    """(tables, summary, agg) as :func:`.stats.compute_tables`, with every read of the
    archive in Spark tasks (the hook of :func:`.stats.run_batch`); ``input_dir``: one
    server path or a list.  ``ship_zip``: a callable returning the zipped package, uploaded
    when the server's Python workers lack ``logjam_relay`` (None: report that instead)."""
    from .stats import archive_dirs, finish_tables
    dirs = archive_dirs(input_dir)
    segs, parallelism = [], 1
    for d in dirs:
        _slices, s, parallelism = _planned(spark, d, ship_zip)
        segs += s
    slices = slices_of(segs, parallelism)
    index = origin_index(spark, dirs)
    agg = merge_partials(partial_frame(spark, slices, apdex_ms,
                                       dict(index.exclude) if index.excluded else None)
                         ).persist()
    summary = summary_of_merged(agg)
    # the python engine's reading (Python tasks on the server's workers decode and group,
    # Spark merges): the one a remote run has (no JVM reader on the client's side)
    summary["engine"] = "python"
    tables = split_merged(agg)
    finish_tables(spark, tables, summary, index)
    return tables, summary, agg


# ------------------------------------------------------------------ errors

def first_line(e: BaseException) -> str:
    """The gist of ``e`` in one line: for an exception from a Python worker, the last line
    of its traceback (``ModuleNotFoundError: ...``), else the first line."""
    s = str(e).strip() or type(e).__name__
    lines = s.split("JVM stacktrace:")[0].splitlines()
    if "Traceback (most recent call last)" in s:
        tail = [x for x in lines if x.strip() and not x[0].isspace()
                and not x.startswith(("Traceback", "SQLSTATE"))]
        if len(tail) > 1:
            return f"{lines[0].split(':')[0]}: {tail[-1].strip()}"
    return lines[0]


def unreachable(e: BaseException) -> bool:
    """Whether ``e`` says the server cannot be reached (refused, gone, retries used up)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        if type(e).__name__ == "RetriesExceeded" or "StatusCode.UNAVAILABLE" in text or \
                "RETRIES_EXCEEDED" in text:
            return True
        code = getattr(e, "code", None)
        if callable(code):              # a grpc.RpcError
            try:
                if getattr(code(), "name", "") == "UNAVAILABLE":
                    return True
            except Exception:
                pass
        e = e.__cause__ or e.__context__
    return False


def grpc_detail(e: BaseException) -> str:
    """The gRPC status and details of ``e`` (or its causes), short."""
    import re
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e)
        m = re.search(r"status = (StatusCode\.\w+)", text)
        d = re.search(r'details = "([^"]*)"', text)
        if m:
            return f"{m.group(1).split('.')[-1]}: {d.group(1) if d else ''}".strip(": ")
        e = e.__cause__ or e.__context__
    return ""


def error_line(e: BaseException, url: str) -> str:
    """One line for an exception of a remote run."""
    if isinstance(e, RemoteError):
        return str(e)
    if unreachable(e):
        detail = grpc_detail(e)
        return (f"the Spark Connect server {url} cannot be reached or went away"
                f"{f' ({detail})' if detail else ''}")
    return f"remote run failed: {first_line(e)}"

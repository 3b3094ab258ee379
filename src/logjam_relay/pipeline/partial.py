"""Partial aggregation in the data source reader (aggregate pushdown for ``pipeline stats``).

The batch pipeline does not ship one row per record from the Python workers to the JVM: the
Python task (``mapInArrow`` over slices of the archive's segments, :func:`plan_slices`,
:func:`read_slices`) decodes a slice and groups each decoded Arrow batch itself (Arrow's C++ hash aggregation, no Python per
record) and hands Spark one *partial* row per group, which Spark merges across batches,
partitions and executors (:func:`logjam_relay.pipeline.stats.merge_partials`).  This is the
map-side combine that Spark's own aggregation does after the scan, moved in front of the
Python -> JVM transfer, which is where the scan spends most of its time.

Partial rows (:data:`PARTIAL_DDL`) have a ``kind``:

* ``K_REQUEST`` (0) -- one ``logs`` request group (minute, app, env, action): counts, sums,
  the max, apdex and code/severity counts; a second row of the same key carries the group's
  non-null ``total_time`` values (``tt_values``) for the exact percentiles;
* ``K_EXCEPTION`` (1) -- one (minute, app, env, action, exception) count;
* ``K_TOPIC`` (2) -- one (minute, app, env, topic) count for the other topics;
* ``K_OTHER`` (3) -- per batch: the input summary counters (rows, undecodable, corrupt,
  bodies not JSON);
* ``K_UNDECIDED`` (4) -- only from the JVM reader's partial rows (the ``jvm`` engine,
  ``Partials.java``, the same rows made on the JVM): ``count`` = the logs bodies whose
  fields it leaves to Python's JSON rules (then the python engine reads the archive).

The definitions are those of :func:`logjam_relay.pipeline.stats.aggregate` (the DataFrame
version the streaming mode runs over ``_records``), figure for figure; the tests compare
both with :func:`logjam_relay.pipeline.reference.reference_tables`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .minutes import minutes_of, request_times

K_REQUEST, K_EXCEPTION, K_TOPIC, K_OTHER, K_UNDECIDED = 0, 1, 2, 3, 4

#: the columns the partial aggregation needs from the decoder (no body)
SCAN_COLUMNS = ("app", "env", "topic", "created_ms", "error", "action", "started_ms",
                "total_time", "code", "severity", "exceptions", "bad_json")

_COUNTS = ("count", "tt_n", "apdex_s", "apdex_t", "http_2xx", "http_3xx", "http_4xx",
           "http_5xx", "severity_0", "severity_1", "severity_2", "severity_3", "severity_4",
           "severity_5", "rows", "bad", "corrupt", "bad_json")
_KEYS = ("kind", "minute_ms", "app", "env", "name", "exception")

PARTIAL_SCHEMA = pa.schema(
    [("kind", pa.int32()), ("minute_ms", pa.int64()), ("app", pa.string()),
     ("env", pa.string()), ("name", pa.string()), ("exception", pa.string()),
     ("tt_sum", pa.float64()), ("tt_max", pa.float64()),
     ("tt_values", pa.list_(pa.float64()))]
    + [(c, pa.int64()) for c in _COUNTS])
PARTIAL_DDL = ("kind int, minute_ms long, app string, env string, name string, "
               "exception string, tt_sum double, tt_max double, tt_values array<double>, "
               + ", ".join(f"{c} long" for c in _COUNTS))
PARTIAL_COLUMNS = tuple(PARTIAL_SCHEMA.names)


def partial_schema():
    """:data:`PARTIAL_DDL` as a Spark StructType whose ``tt_values`` hold no nulls."""
    from pyspark.sql.types import ArrayType, DoubleType, StructField, StructType
    s = StructType.fromDDL(PARTIAL_DDL)
    return StructType([StructField(f.name, ArrayType(DoubleType(), False), True)
                       if f.name == "tt_values" else f for f in s.fields])


_GROUP = ["minute_ms", "app", "env", "name"]


def _minute(ms: pa.Array) -> pa.Array:
    """:func:`~logjam_relay.pipeline.minutes.minute_of` of each (nulls stay null)."""
    v = pc.fill_null(ms, 0).to_numpy(zero_copy_only=False)
    mask = pc.is_null(ms).to_numpy(zero_copy_only=False) if ms.null_count else None
    return pa.array(minutes_of(v), pa.int64(), mask=mask)


def _as_int(mask) -> pa.Array:
    return pc.cast(mask, pa.int64())


def partial_batch(b: pa.RecordBatch, apdex_ms: float) -> pa.Table | None:
    """The partial rows of one decoded batch (columns :data:`SCAN_COLUMNS`)."""
    n = b.num_rows
    if n == 0:
        return None
    col = b.column
    topic, app, env = col("topic"), col("app"), col("env")
    error, created = col("error"), col("created_ms")
    is_logs = pc.fill_null(pc.starts_with(topic, "logs"), False)
    bad_json = pc.fill_null(col("bad_json"), False)
    valid = pc.and_(pc.and_(is_logs, pc.is_null(error)), pc.invert(bad_json))
    heartbeat = pc.and_kleene(pc.equal(app, "heartbeat"), pc.equal(env, ""))
    is_topic = pc.and_(pc.and_(pc.is_valid(topic), pc.invert(is_logs)),
                       pc.and_(pc.is_valid(created),
                               pc.fill_null(pc.invert(heartbeat), False)))
    parts = []

    # ------------------------------------------------------------------ requests
    nvalid = pc.sum(_as_int(valid)).as_py() or 0
    if nvalid:
        r = b.filter(valid)
        tt = r.column("total_time")
        code = r.column("code")
        sev = r.column("severity")
        t = float(apdex_ms)
        cols = {
            "minute_ms": _minute(request_times(r.column("started_ms"), r.column("created_ms"))),
            "app": r.column("app"), "env": r.column("env"),
            "name": pc.coalesce(r.column("action"), pa.scalar("unknown")),
            "tt": tt,
            "apdex_s": _as_int(pc.fill_null(pc.less_equal(tt, t), False)),
            "apdex_t": _as_int(pc.fill_null(pc.and_(pc.greater(tt, t),
                                                    pc.less_equal(tt, 4 * t)), False)),
        }
        for k in (2, 3, 4, 5):
            cols[f"http_{k}xx"] = _as_int(pc.fill_null(pc.and_(
                pc.greater_equal(code, k * 100), pc.less(code, k * 100 + 100)), False))
        for k in range(6):
            cols[f"severity_{k}"] = _as_int(pc.fill_null(pc.equal(sev, k), False))
        rt = pa.table(cols)
        g = rt.group_by(_GROUP, use_threads=False).aggregate(
            [([], "count_all"), ("tt", "count"), ("tt", "sum"), ("tt", "max")]
            + [(c, "sum") for c in ("apdex_s", "apdex_t", *(f"http_{k}xx" for k in (2, 3, 4, 5)),
                                    *(f"severity_{k}" for k in range(6)))])
        g = g.rename_columns([
            {"count_all": "count", "tt_count": "tt_n", "tt_sum": "tt_sum",
             "tt_max": "tt_max"}.get(c, c.removesuffix("_sum")) for c in g.column_names])
        parts.append(_fill(g, K_REQUEST))
        # the non-null total_time values of each group, for the exact percentiles
        has_tt = pc.is_valid(tt)
        if tt.null_count < len(tt):
            vt = rt.select([*_GROUP, "tt"]).filter(has_tt)
            v = vt.group_by(_GROUP, use_threads=False).aggregate([("tt", "list")])
            parts.append(_fill(v.rename_columns([*_GROUP, "tt_values"]), K_REQUEST))
        # exceptions: every string entry of every request's list, counted
        exc = r.column("exceptions")
        if exc.null_count < len(exc):
            flat = pc.list_flatten(exc)
            if len(flat):
                idx = pc.list_parent_indices(exc)
                et = rt.select(_GROUP).take(idx).append_column("exception", flat)
                et = et.filter(pc.is_valid(flat))
                if et.num_rows:
                    e = et.group_by([*_GROUP, "exception"], use_threads=False) \
                        .aggregate([([], "count_all")])
                    parts.append(_fill(e.rename_columns([*_GROUP, "exception", "count"]),
                                       K_EXCEPTION))

    # ------------------------------------------------------------------ topics
    ntopic = pc.sum(_as_int(is_topic)).as_py() or 0
    if ntopic:
        tb = b.filter(is_topic)
        tt_ = pa.table({"minute_ms": _minute(tb.column("created_ms")),
                        "app": tb.column("app"), "env": tb.column("env"),
                        "name": tb.column("topic")})
        g = tt_.group_by(_GROUP, use_threads=False).aggregate([([], "count_all")])
        parts.append(_fill(g.rename_columns([*_GROUP, "count"]), K_TOPIC))

    # ------------------------------------------------------------------ summary
    parts.append(_fill(pa.table({
        "rows": pa.array([n], pa.int64()),
        "bad": pa.array([n - pc.sum(_as_int(pc.is_null(error))).as_py()], pa.int64()),
        "corrupt": pa.array([pc.sum(_as_int(pc.fill_null(
            pc.starts_with(error, "corrupt"), False))).as_py() or 0], pa.int64()),
        "bad_json": pa.array([pc.sum(_as_int(bad_json)).as_py() or 0], pa.int64()),
    }), K_OTHER))
    return pa.concat_tables(parts)


def _fill(t: pa.Table, kind: int) -> pa.Table:
    """``t`` widened to :data:`PARTIAL_SCHEMA` (absent counts 0, other columns null)."""
    n = t.num_rows
    out = []
    for f in PARTIAL_SCHEMA:
        if f.name == "kind":
            out.append(pa.array(np.full(n, kind, np.int32)))
        elif f.name in t.column_names:
            c = t.column(f.name)
            out.append(c if c.type == f.type else pc.cast(c, f.type))
        elif f.type == pa.int64() and f.name in _COUNTS:
            out.append(pa.array(np.zeros(n, np.int64)))
        else:
            out.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(out, schema=PARTIAL_SCHEMA)


def partial_batches(batches, apdex_ms: float) -> Iterator[pa.RecordBatch]:
    """Partial rows of decoded batches (one output batch per input batch)."""
    for b in batches:
        t = partial_batch(b, apdex_ms)
        if t is not None:
            yield from t.combine_chunks().to_batches()


#: a slice of the archive: (segment path, segment number, first record, end record)
Slice = tuple[str, int, int, int]


def plan_slices(input_dir: str, parallelism: int, min_records: int = 65536) -> list[Slice]:
    """The archive's sealed segments cut into slices of about equal record counts (from the
    seal records: no scan), about four per core, so that the cores finish together; a
    segment without a seal is one slice (its reader reports what is wrong with it)."""
    return cut_slices(plan_segments(input_dir), parallelism, min_records)


def plan_segments(input_dir: str) -> list[tuple[str, int, int]]:
    """``(path, segno, records)`` of the archive's sealed segments (:func:`cut_slices`)."""
    from .decode import list_segments, record_count
    return [(p, s, record_count(p)) for s, p in list_segments(input_dir)]


def cut_slices(segs, parallelism: int, min_records: int = 65536) -> list[Slice]:
    """Slices of ``(path, segno, records)`` segments, about four per core and at least
    ``min_records`` each (:func:`plan_slices`; Spark Connect counts the records on the
    server's side, :func:`.connect.slices_of`)."""
    total = sum(n for _, _, n in segs)
    per = max(min_records, -(-total // max(1, 4 * parallelism)))
    out: list[Slice] = []
    for path, segno, n in segs:
        k = max(1, round(n / per))
        cuts = [n * i // k for i in range(k + 1)]
        out.extend((path, segno, a, z) for a, z in zip(cuts, cuts[1:], strict=False))
        if n == 0:
            out.append((path, segno, 0, 0))
    return out


def read_slices(slices: list[Slice], ids, apdex_ms: float,
                batch_rows: int | None = None, exclude: dict | None = None
                ) -> Iterator[pa.RecordBatch]:
    """Partial rows of the slices numbered ``ids`` (what one Spark task reads);
    ``exclude``: segment path -> record indices left out (:mod:`.origin`)."""
    from .decode import DEFAULT_BATCH_ROWS, decode_slice
    for i in ids:
        path, segno, a, z = slices[i]
        skip = exclude.get(path) if exclude else None
        if skip is None or not len(skip):
            yield from partial_batches(decode_slice(path, segno, a, z, batch_rows or
                                                    DEFAULT_BATCH_ROWS, SCAN_COLUMNS),
                                       apdex_ms)
            continue
        yield from partial_batches(_without(decode_slice(
            path, segno, a, z, batch_rows or DEFAULT_BATCH_ROWS, SCAN_COLUMNS + ("record",)),
            skip), apdex_ms)


def _without(batches, skip) -> Iterator[pa.RecordBatch]:
    """Batches (whose last column is ``record``) without the records of ``skip``, and
    without that column."""
    from .origin import keep_mask
    for b in batches:
        keep = keep_mask(b.column(b.num_columns - 1).to_numpy(zero_copy_only=False), skip)
        if keep is not None:
            b = b.filter(pa.array(keep))
        yield b.drop_columns(["record"])

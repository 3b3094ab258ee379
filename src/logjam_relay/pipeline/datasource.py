"""PySpark Python Data Source ``logjam``: archived spool segments as a DataFrame.

::

    from logjam_relay.pipeline.datasource import register
    register(spark)
    df = spark.read.format("logjam").load("/var/lib/logjam-relay/archive")
    sdf = spark.readStream.format("logjam").load("/var/lib/logjam-relay/archive")

Input: a directory of sealed segment files ``NNNNNNNNNNNNNNNNNNNN.seg`` as written by
:class:`logjam_relay.outputs.archive.Archive` (format: ``docs/spool-format.md``).  Other
names (temporary files, ``.open`` segments) are ignored.  See ``docs/pipeline.md``.

One row per logjam record (spool record kind 0; other kinds are skipped), columns
:data:`SCHEMA_DDL`.  A record that cannot be decoded (broken meta frame, body that does not
decompress, body that is not UTF-8) still gives a row -- with ``body`` null and ``error``
naming the reason -- so the loss report sees its sequence number and the pipeline can
count it.  A record whose CRC or structure is wrong makes the rest of its segment
unreadable (there is no resynchronisation, as in the spool): the reader emits one row with
``error = "corrupt:<reason>"`` (``record`` = its index, ``body`` = a small JSON text with
the offset and how many records were lost when the seal record says so) and goes on with the
next segment.  Nothing here raises on bad data.

Column pruning: a schema given with ``.schema(...)`` may name any subset of the columns
and of the request fields extracted from ``logs`` bodies (:data:`ALL_FIELDS`); only those
are built, and bodies are not decompressed when no body-derived column is asked for.
Partitions: one per segment, or slices of ``recordsPerPartition`` records (option).  The
decoding itself (no Spark) is :mod:`.decode` and :mod:`.extract`.

Streaming offsets are ``{"segment": S, "record": R, "below": K}``: everything before record
``R`` of segment ``S`` (and all of lower-numbered segments) has been read; ``K`` segments
numbered below ``S`` existed then.  Segments are immutable and must appear in ascending
number order (the archive links them when they are sealed), so offsets are replayable:
exactly-once into a checkpointed file sink; a segment that appears below the position is
refused (:class:`LateSegment`), not silently skipped.  Options
``maxRecordsPerTrigger`` / ``maxSegmentsPerTrigger`` bound a micro-batch;
``Trigger.AvailableNow`` is supported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxFiles,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from .decode import (  # noqa: F401  (re-exported: the decoder's public names)
    ALL_FIELDS,
    ARROW_SCHEMA,
    BASE_COLUMNS,
    DEFAULT_BATCH_ROWS,
    SCHEMA_DDL,
    DecodeStats,
    decode_segment,
    decode_segment_py,
    decode_slice,
    list_segments,
    record_count,
)
from .extract import EXTRACT_DDL  # noqa: F401
from .origin import ORIGIN_DDL, keep_mask, parse_exclusions

NAME = "logjam"
PYTHON_NAME = "logjam_python"        # when the JVM reader is "logjam" (jvmreader.py)


class LateSegment(RuntimeError):
    """A segment appeared below the stream's position: it would never be read."""
    MARK = "late segment:"

#: column -> Spark type (simpleString) of every column the reader can produce
_SPARK_TYPES = dict(
    (c.split()[0], c.split()[1].replace("long", "bigint"))
    for c in (SCHEMA_DDL + ", " + EXTRACT_DDL + ", " + ORIGIN_DDL).split(", "))


def _read_partition(part: SegmentSlice, batch_rows: int,
                    columns=None) -> Iterator[pa.RecordBatch]:
    if part.exclude is None or not len(part.exclude):
        return decode_slice(part.path, part.segno, part.start, part.stop, batch_rows, columns)
    return _without(part, batch_rows, columns)


def _without(part: SegmentSlice, batch_rows: int, columns) -> Iterator[pa.RecordBatch]:
    """The slice's batches without the records of ``part.exclude`` (option ``exclude``:
    the copies of an event that arrived more than once, :mod:`.origin`)."""
    cols = tuple(columns) if columns is not None else BASE_COLUMNS
    need = cols if "record" in cols else cols + ("record",)
    for b in decode_slice(part.path, part.segno, part.start, part.stop, batch_rows, need):
        keep = keep_mask(b.column(need.index("record")).to_numpy(zero_copy_only=False),
                         part.exclude)
        if keep is not None:
            b = b.filter(pa.array(keep))
        if need is not cols:
            b = b.select(list(cols))
        if b.num_rows:
            yield b


def _schema_columns(schema) -> tuple[str, ...] | None:
    """Column pruning: the columns of a schema given with ``.schema(...)`` (any subset of
    :data:`ALL_FIELDS`, in any order; types must match); None for the default schema."""
    if schema is None or isinstance(schema, str):
        return None
    names = tuple(f.name for f in schema.fields)
    if names == BASE_COLUMNS:
        return None
    for f in schema.fields:
        want = ALL_FIELDS.get(f.name)
        if want is None:
            raise ValueError(f"logjam data source: unknown column {f.name!r} in the schema; "
                             f"known: {', '.join(ALL_FIELDS)}")
        if _SPARK_TYPES[f.name] != f.dataType.simpleString():
            raise ValueError(f"logjam data source: column {f.name} must be "
                             f"{_SPARK_TYPES[f.name]}, not {f.dataType.simpleString()}")
    return names


# ============================================================================ Spark API

@dataclass
class SegmentSlice(InputPartition):
    """Records ``[start, stop)`` of one segment (``stop`` None = to the end)."""

    path: str
    segno: int
    start: int = 0
    stop: int | None = None
    #: record indices of this segment left out (option ``exclude``), or None
    exclude: object = None

    def __post_init__(self):
        InputPartition.__init__(self, (self.segno, self.start))


def _lower(options) -> dict:
    """Spark option names are case-insensitive."""
    return {str(k).lower(): v for k, v in dict(options).items()}


def _int_opt(options, name: str, default: int) -> int:
    v = options.get(name.lower())
    if v is None or v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"logjam data source: option {name} must be an integer, "
                         f"got {v!r}") from None
    if n < 0:
        raise ValueError(f"logjam data source: option {name} must be >= 0, got {n}")
    return n


def _path(options) -> str:
    p = options.get("path")
    if not p:
        raise ValueError("logjam data source: give the archive directory, "
                         "e.g. spark.read.format('logjam').load('/path/to/archive')")
    if p.startswith("file://"):
        p = p[len("file://"):]
    return p


def _slices(path: str, segno: int, start: int, stop: int, per: int) -> list[SegmentSlice]:
    if per <= 0 or stop - start <= per:
        return [SegmentSlice(path, segno, start, stop)]
    return [SegmentSlice(path, segno, a, min(a + per, stop)) for a in range(start, stop, per)]


class LogjamDataSource(DataSource):
    """``spark.read.format("logjam").load(dir)`` / ``spark.readStream...``.

    Options: ``recordsPerPartition`` (0 = one partition per segment), ``batchRows``
    (records per Arrow batch, default 32768), ``exclude`` (batch: records to leave out,
    ``SEGNO:A-B,C;...``, what :meth:`.originindex.OriginIndex.exclusions_of` gives for the
    directory), streaming: ``maxRecordsPerTrigger``,
    ``maxSegmentsPerTrigger``, ``startingOffsets`` (``earliest`` default, or ``latest``).
    """

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self):
        return SCHEMA_DDL

    def reader(self, schema) -> LogjamBatchReader:
        return LogjamBatchReader(_lower(self.options), _schema_columns(schema))

    def streamReader(self, schema) -> LogjamStreamReader:
        return LogjamStreamReader(_lower(self.options), _schema_columns(schema))


class LogjamBatchReader(DataSourceReader):
    def __init__(self, options: dict, columns=None):
        self.columns = columns
        self.path = _path(options)
        self.per = _int_opt(options, "recordsPerPartition", 0)
        self.batch_rows = _int_opt(options, "batchRows", DEFAULT_BATCH_ROWS) or \
            DEFAULT_BATCH_ROWS
        self.exclude = parse_exclusions(options.get("exclude"))
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"logjam data source: {self.path} is not a directory")

    def partitions(self):
        parts: list[SegmentSlice] = []
        for segno, p in list_segments(self.path):
            if self.per:
                parts.extend(_slices(p, segno, 0, record_count(p), self.per))
            else:
                parts.append(SegmentSlice(p, segno))
        for part in parts:
            ex = self.exclude.get(part.segno)
            if ex is not None:
                part.exclude = ex
        return parts

    def read(self, partition):
        return _read_partition(partition, self.batch_rows, self.columns)


class LogjamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"segment": S, "record": R}``: the next record to read is record R of
    the first segment numbered >= S."""

    def __init__(self, options: dict, columns=None):
        self.columns = columns
        self.path = _path(options)
        self.per = _int_opt(options, "recordsPerPartition", 0)
        self.batch_rows = _int_opt(options, "batchRows", DEFAULT_BATCH_ROWS) or \
            DEFAULT_BATCH_ROWS
        self.max_records = _int_opt(options, "maxRecordsPerTrigger", 0)
        self.max_segments = _int_opt(options, "maxSegmentsPerTrigger", 0)
        self.starting = (options.get("startingoffsets") or "earliest").lower()
        if self.starting not in ("earliest", "latest"):
            raise ValueError("logjam data source: startingOffsets must be earliest or latest")
        self._counts: dict[int, int] = {}
        self._target: dict | None = None          # Trigger.AvailableNow bound

    # -- helpers ----------------------------------------------------------------
    def _segments(self) -> list[tuple[int, str, int]]:
        out = []
        for segno, p in list_segments(self.path):
            c = self._counts.get(segno)
            if c is None:
                c = self._counts[segno] = record_count(p)
            out.append((segno, p, c))
        return out

    def _end_of_all(self) -> dict:
        segs = self._segments()
        if not segs:
            return {"segment": 0, "record": 0, "below": 0}
        segno, _, c = segs[-1]
        return {"segment": segno, "record": c, "below": len(segs) - 1}

    @staticmethod
    def _key(off: dict) -> tuple[int, int]:
        return int(off["segment"]), int(off["record"])

    # -- Spark API --------------------------------------------------------------
    def _below(self, segno: int) -> int:
        return sum(1 for s, _, _ in self._segments() if s < segno)

    def _check_late(self, start: dict) -> None:
        """Refuse segments that appeared below the stream's position (two relays archiving
        into one directory, a late copy, catch_up after newer segments): the offsets say
        how many segments were below ``start`` when it was reached."""
        seen = start.get("below")
        if seen is None:
            return
        s_seg = int(start["segment"])
        late = [s for s, _, _ in self._segments() if s < s_seg]
        if len(late) > int(seen):
            raise LateSegment(
                f"{LateSegment.MARK} {len(late) - int(seen)} segment(s) numbered below "
                f"{s_seg} appeared in {self.path} after the stream had passed that number "
                f"(two relays archiving into one directory, or a late copy); they would "
                f"never be read. Give every relay its own archive directory (one stream "
                f"each), or start over with a new checkpoint and output to read everything.")

    def initialOffset(self) -> dict:
        if self.starting == "latest":
            return self._end_of_all()
        return {"segment": 0, "record": 0, "below": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_records:
            return ReadMaxRows(self.max_records)
        if self.max_segments:
            return ReadMaxFiles(self.max_segments)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._end_of_all()

    def latestOffset(self, start: dict | None = None, limit: ReadLimit | None = None) -> dict:
        if start is None:                       # pre-4.2 call signature
            start = self.initialOffset()
        self._check_late(start)
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        max_files = limit.max_files if isinstance(limit, ReadMaxFiles) else None
        s_seg, s_rec = self._key(start)
        bound = self._key(self._target) if self._target is not None else None
        end_seg, end_rec = s_seg, s_rec
        rows = 0
        files = 0
        for segno, _p, c in self._segments():
            if segno < s_seg:
                continue
            if bound is not None and segno > bound[0]:
                break
            first = s_rec if segno == s_seg else 0
            last = c
            if bound is not None and segno == bound[0]:
                last = min(last, bound[1])
            if last <= first:
                continue
            if max_files is not None and files >= max_files:
                break
            if max_rows is not None:
                room = max_rows - rows
                if room <= 0:
                    break
                if last - first > room:
                    last = first + room
            rows += last - first
            files += 1
            end_seg, end_rec = segno, last
        if (end_seg, end_rec) == (s_seg, s_rec):
            return dict(start)
        return {"segment": end_seg, "record": end_rec, "below": self._below(end_seg)}

    def reportLatestOffset(self):
        return self._end_of_all()

    def partitions(self, start: dict, end: dict):
        s_seg, s_rec = self._key(start)
        e_seg, e_rec = self._key(end)
        parts: list[SegmentSlice] = []
        if (e_seg, e_rec) <= (s_seg, s_rec):
            return parts
        for segno, p, c in self._segments():
            if segno < s_seg:
                continue
            if segno > e_seg:
                break
            first = s_rec if segno == s_seg else 0
            last = e_rec if segno == e_seg else c
            if last > first:
                parts.extend(_slices(p, segno, first, last, self.per))
        return parts

    def read(self, partition):
        return _read_partition(partition, self.batch_rows, self.columns)

    def commit(self, end: dict) -> None:
        pass                    # the archive's retention decides when files go

    def stop(self) -> None:
        pass


class LogjamPythonDataSource(LogjamDataSource):
    """This source under the name the JVM reader hands its other reads to (streaming,
    extracted fields): see :mod:`.jvmreader`."""

    @classmethod
    def name(cls) -> str:
        return PYTHON_NAME


def register(spark) -> None:
    """Register the ``logjam`` format with a SparkSession: when the session's JVM has the
    JVM reader (:mod:`.jvmreader`, added by ``make_session``), it is ``logjam`` and this
    source is registered as ``logjam_python`` for what it hands over; else this source is
    ``logjam``."""
    from .jvmreader import loaded
    if loaded(spark):
        spark.dataSource.register(LogjamPythonDataSource)
    else:
        spark.dataSource.register(LogjamDataSource)

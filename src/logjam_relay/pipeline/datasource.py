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
:data:`SCHEMA`.  A record that cannot be decoded (broken meta frame, body that does not
decompress, body that is not UTF-8) still gives a row -- with ``body`` null and ``error``
naming the reason -- so the loss report sees its sequence number and the pipeline can
count it.  A record whose CRC or structure is wrong makes the rest of its segment
unreadable (there is no resynchronisation, as in the spool): the reader emits one row with
``error = "corrupt:<reason>"`` (``record`` = its index, ``body`` = a small JSON text with
the offset and how many records were lost when the seal record says so) and goes on with the
next segment.  Nothing here raises on bad data.

Partitions: one per segment, or slices of ``recordsPerPartition`` records (option).  The
reader parses one ``bytes`` object per file with ``struct``, verifies every record CRC,
decompresses bodies and builds Arrow arrays from bulk buffers (numpy gathers for the meta
fields, one joined buffer plus offsets for the bodies).

Streaming offsets are ``{"segment": S, "record": R}``: everything before record ``R`` of
segment ``S`` (and all of lower-numbered segments) has been read.  Segments are immutable
and appear in ascending number order (the archive links them when they are sealed), so
offsets are replayable: exactly-once into a checkpointed file sink.  Options
``maxRecordsPerTrigger`` / ``maxSegmentsPerTrigger`` bound a micro-batch;
``Trigger.AvailableNow`` is supported.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import lz4.block
import numpy as np
import pyarrow as pa
import snappy
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

from ..protocols.logjam import COMPRESSION_NAMES, MAX_DECOMPRESSED
from ..spool import segment as fmt

log = logging.getLogger("logjam_relay.pipeline.datasource")

NAME = "logjam"

SCHEMA_DDL = ("app string, env string, topic string, device long, sequence long, "
              "created_ms long, compression string, body string, error string, "
              "segment long, record int")

ARROW_SCHEMA = pa.schema([
    ("app", pa.string()), ("env", pa.string()), ("topic", pa.string()),
    ("device", pa.int64()), ("sequence", pa.int64()), ("created_ms", pa.int64()),
    ("compression", pa.string()), ("body", pa.string()), ("error", pa.string()),
    ("segment", pa.int64()), ("record", pa.int32()),
])

_META_DT = np.dtype([("tag", ">u2"), ("comp", "u1"), ("ver", "u1"), ("device", ">u4"),
                     ("created", ">u8"), ("seq", ">u8")])
_META_IDX = np.arange(24, dtype=np.int64)
_COMP_NAMES = pa.array([COMPRESSION_NAMES.get(i, f"unknown-{i}") for i in range(256)],
                       pa.string())
_FULL4 = struct.Struct("<IIBBHQIIII")
_FULL_HEAD = struct.Struct("<IIBBHQ")
_LEN_BE = struct.Struct(">I")
_crc32 = zlib.crc32
from .. import _native

_segscan = _native.load("logjam_relay.spool._segscan")
try:
    import cramjam  # what python-snappy calls; skips a Python wrapper
    _snappy_raw = cramjam.snappy.decompress_raw
except (ImportError, AttributeError):  # pragma: no cover
    _snappy_raw = snappy.uncompress
# meta frame bytes 0..3 (tag, compression, version) -> compression, for acceptable metas
_META_COMP = {bytes((t0, t1, c, 1)): c for (t0, t1) in ((0xCA, 0xBD), (0xBD, 0xCA))
              for c in range(256)}
DEFAULT_BATCH_ROWS = 32768
MAX_BODY = fmt.MAX_BODY
KIND_SEAL = fmt.KIND_SEAL


# ============================================================================ files

list_segments = fmt.sealed_segments


def record_count(path: str) -> int:
    """Data records in a segment: from the seal record (cheap), else by a full scan
    (a damaged or incomplete file: only its valid records count)."""
    seal = fmt.read_seal(path)
    if seal is not None:
        return seal[0]
    try:
        res = fmt.scan_segment(path)
    except OSError:
        return 0
    # not properly sealed: one extra "record" slot for the reader's error row
    return res.records + 1


# ============================================================================ decoding

@dataclass
class DecodeStats:
    records: int = 0          # rows produced (records + error rows)
    bad_records: int = 0      # rows with error set
    corrupt: int = 0          # corrupt segment regions
    skipped_kinds: int = 0    # non-logjam records


class _Cols:
    """Column accumulators for one Arrow batch."""

    __slots__ = ("pair", "meta_off", "bodies", "errors", "first", "n")

    def __init__(self, first: int):
        self.pair: list[int] = []                 # index into the (app_env, topic) table
        self.meta_off: list[int] = []             # offset of the meta frame (0: bad meta)
        self.bodies: list[bytes | None] = []
        self.errors: dict[int, str] = {}          # row -> reason (sparse)
        self.first = first                        # record index of the first row
        self.n = 0


def decode_segment(path: str, segno: int, start: int = 0, stop: int | None = None,
                   batch_rows: int = DEFAULT_BATCH_ROWS,
                   stats: DecodeStats | None = None) -> Iterator[pa.RecordBatch]:
    """Arrow batches (:data:`ARROW_SCHEMA`) for records ``start`` (inclusive) to ``stop``
    (exclusive; ``None`` = to the end) of the segment file ``path``.  Never raises on bad
    data; ``OSError`` for an unreadable file propagates (callers turn it into a row).
    Uses the C record walk (``spool/_segscan.c``) when it is built, else
    :func:`decode_segment_py`; both give the same batches."""
    if _segscan is None:
        return decode_segment_py(path, segno, start, stop, batch_rows, stats)
    return _decode_segment_c(path, segno, start, stop, batch_rows, stats)


def _decode_segment_c(path: str, segno: int, start: int, stop: int | None,
                      batch_rows: int, stats: DecodeStats | None) -> Iterator[pa.RecordBatch]:
    st = stats if stats is not None else DecodeStats()
    with open(path, "rb", buffering=0) as f:
        buf = f.read()
    try:
        fmt.decode_header(buf[:fmt.HEADER_LEN])
    except fmt.SegmentError as e:
        yield _error_batch(segno, start, f"corrupt:{e.reason}",
                           {"offset": 0, "message": str(e)}, st)
        return
    stop_ = (1 << 62) if stop is None else stop
    rows_b, pair_offs, pos, idx, status, skipped = _segscan.scan(buf, fmt.HEADER_LEN,
                                                                  start, stop_)
    st.skipped_kinds += skipped
    rows = np.frombuffer(rows_b, dtype=np.int64).reshape(-1, 5)
    pairs = [(buf[o:o + la], buf[o + la:o + la + lt]) for o, la, lt in pair_offs]
    npbuf = np.frombuffer(buf, dtype=np.uint8)
    mv = memoryview(buf)
    body_of = _decompress_body
    try:
        for first in range(0, len(rows), batch_rows):
            block = rows[first:first + batch_rows]
            cols = _Cols(start + first)
            cols.n = n = len(block)
            cols.pair = block[:, 0]
            cols.meta_off = block[:, 2]
            codes = block[:, 1].tolist()
            body_off = block[:, 3].tolist()
            body_len = block[:, 4].tolist()
            errors = cols.errors
            bodies: list = [None] * n
            for i in range(n):
                comp = codes[i]
                r = body_off[i]
                lb = body_len[i]
                if comp == 0:
                    bodies[i] = buf[r:r + lb]
                elif comp == -1:
                    errors[i] = "meta"
                elif comp == -2:
                    errors[i] = "frames"
                else:
                    try:
                        bodies[i] = body_of(buf, mv, r, r + lb, comp)
                    except Exception:
                        errors[i] = "decompress"
            cols.bodies = bodies
            yield _build(cols, pairs, npbuf, segno, st)
    finally:
        mv.release()
    if status not in ("stop", "seal") and start <= idx < stop_:
        info = {"offset": pos}
        seal = fmt.read_seal(path)
        if seal is not None:
            info["records_lost"] = max(0, seal[0] - idx)
        elif status == "no_seal":
            info["message"] = "segment has no valid seal record (incomplete copy?)"
        st.corrupt += 1
        yield _error_batch(segno, idx, f"corrupt:{status}", info, st)


def decode_segment_py(path: str, segno: int, start: int = 0, stop: int | None = None,
                      batch_rows: int = DEFAULT_BATCH_ROWS,
                      stats: DecodeStats | None = None) -> Iterator[pa.RecordBatch]:
    """:func:`decode_segment` in Python alone (the reference for the C walk)."""
    st = stats if stats is not None else DecodeStats()
    with open(path, "rb", buffering=0) as f:
        buf = f.read()
    size = len(buf)
    npbuf = np.frombuffer(buf, dtype=np.uint8)
    # (app_env + topic) bytes -> pair index; pairs[k] = (app_env, topic)
    pair_index: dict = {}
    pairs: list[tuple[bytes, bytes]] = []
    pair_la: list[int] = []                        # len(pairs[k][0])
    pair_get = pair_index.get
    stop = (1 << 62) if stop is None else stop

    try:
        fmt.decode_header(buf[:fmt.HEADER_LEN])
    except fmt.SegmentError as e:
        yield _error_batch(segno, start, f"corrupt:{e.reason}",
                           {"offset": 0, "message": str(e)}, st)
        return

    mv = memoryview(buf)
    unpack4 = _FULL4.unpack_from
    unpack_head = _FULL_HEAD.unpack_from
    crc32 = _crc32
    meta_comp = _META_COMP.get
    body_of = _decompress_body
    pos = fmt.HEADER_LEN
    idx = 0                       # index of the record at pos (logjam records only)
    cols = _Cols(start)
    ap_pair, ap_meta, ap_body = cols.pair.append, cols.meta_off.append, cols.bodies.append
    errors = cols.errors
    i = 0                         # row in the current batch
    corrupt: tuple[str, int] | None = None
    try:
        while idx < stop:
            if size - pos >= 36:
                body_len, crc, kind, _fl, n, _seq, la, lt, lb, lm = unpack4(buf, pos)
            elif size - pos >= fmt.MIN_RECORD:
                body_len, crc, kind, _fl, n, _seq = unpack_head(buf, pos)
                la = lt = lb = lm = 0
            else:
                corrupt = ("torn" if pos != size else "no_seal", pos)
                break
            rend = pos + 8 + body_len
            if body_len < 12 + 4 * n or body_len > MAX_BODY:
                corrupt = ("bad_length", pos)
                break
            if rend > size:
                corrupt = ("torn", pos)
                break
            if crc32(mv[pos + 8:rend]) != crc:
                corrupt = ("crc", pos)
                break
            if kind:
                if kind == KIND_SEAL:
                    break
                st.skipped_kinds += 1          # not a logjam record: no row, no index
                pos = rend
                continue
            if idx < start:
                idx += 1
                pos = rend
                continue
            if n == 4:
                p = pos + 36
                r = p + la + lt
                s = r + lb
                if s + lm != rend:
                    corrupt = ("frame_lengths", pos)
                    break
                key = buf[p:r]
                k = pair_get(key)
                if k is None or pair_la[k] != la:
                    k = _intern_pair(pair_index, pairs, pair_la, key, la)
                ap_pair(k)
                comp = meta_comp(buf[s:s + 4]) if lm == 24 else None
                if comp == 0:
                    ap_meta(s)
                    ap_body(buf[r:s])
                elif comp is None:
                    ap_meta(0)
                    ap_body(None)
                    errors[i] = "meta"
                else:
                    ap_meta(s)
                    try:
                        ap_body(body_of(buf, mv, r, s, comp))
                    except Exception:
                        ap_body(None)
                        errors[i] = "decompress"
            else:
                # a logjam record must have 4 frames; keep it as an error row
                lens = struct.unpack_from(f"<{n}I", buf, pos + 20)
                p = pos + 20 + 4 * n
                if p + sum(lens) != rend:
                    corrupt = ("frame_lengths", pos)
                    break
                first = buf[p:p + lens[0]] if n else b""
                ap_pair(_intern_pair(pair_index, pairs, pair_la, first, len(first)))
                ap_meta(0)
                ap_body(None)
                errors[i] = "frames"
            i += 1
            idx += 1
            pos = rend
            if i >= batch_rows:
                cols.n = i
                yield _build(cols, pairs, npbuf, segno, st)
                cols = _Cols(idx)
                ap_pair, ap_meta, ap_body = (cols.pair.append, cols.meta_off.append,
                                             cols.bodies.append)
                errors = cols.errors
                i = 0
        cols.n = i
    finally:
        mv.release()
    if cols.n:
        yield _build(cols, pairs, npbuf, segno, st)
    if corrupt is not None and start <= idx < stop:
        reason, off = corrupt
        seal = fmt.read_seal(path)
        info = {"offset": off}
        if seal is not None:
            info["records_lost"] = max(0, seal[0] - idx)
        elif reason == "no_seal":
            info["message"] = "segment has no valid seal record (incomplete copy?)"
        st.corrupt += 1
        yield _error_batch(segno, idx, f"corrupt:{reason}", info, st)


def _intern_pair(pair_index: dict, pairs: list, pair_la: list, key: bytes, la: int) -> int:
    """Index of (key[:la], key[la:]); the combined key is ambiguous only in theory
    (same concatenation, different split): such a pair is stored under a tuple key."""
    k = pair_index.get(key)
    if k is not None and pair_la[k] == la:
        return k
    alt = (key, la)
    k = pair_index.get(alt)
    if k is not None:
        return k
    k = len(pairs)
    pairs.append((key[:la], key[la:]))
    pair_la.append(la)
    if key in pair_index:
        pair_index[alt] = k
    else:
        pair_index[key] = k
    return k


_SMALL_ZLIB = MAX_DECOMPRESSED // 1100          # zlib expands at most ~1032x
_SMALL_SNAPPY = MAX_DECOMPRESSED // 64


def _decompress_body(buf: bytes, mv: memoryview, r: int, s: int, comp: int) -> bytes:
    """The body ``buf[r:s]`` compressed with ``comp`` (1 zlib, 2 snappy, 3 lz4), inflated
    within :data:`MAX_DECOMPRESSED`; raises on anything undecodable."""
    lb = s - r
    if comp == 1:
        return zlib.decompress(mv[r:s]) if lb < _SMALL_ZLIB else _zlib_bounded(mv[r:s])
    if comp == 2:
        if lb > _SMALL_SNAPPY:
            _snappy_check(buf[r:r + 5])
        return _snappy_raw(mv[r:s])
    if comp == 3:
        (m,) = _LEN_BE.unpack_from(buf, r)
        if m > MAX_DECOMPRESSED:
            raise ValueError("lz4 length too large")
        b = lz4.block.decompress(mv[r + 4:s], uncompressed_size=m)
        if len(b) != m:
            raise ValueError("lz4 length mismatch")
        return b
    raise ValueError(f"unknown compression {comp}")


def _snappy_check(b: bytes) -> None:
    n = shift = 0
    for i in range(min(len(b), 5)):         # the varint length prefix of a raw block
        c = b[i]
        n |= (c & 0x7F) << shift
        if not c & 0x80:
            break
        shift += 7
    if n > MAX_DECOMPRESSED:
        raise ValueError("snappy length too large")


def _zlib_bounded(b: bytes) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(b, MAX_DECOMPRESSED)
    if d.unconsumed_tail or not d.eof:
        raise ValueError("zlib body truncated or too large")
    return out


def _pair_columns(pairs: list[tuple[bytes, bytes]]) -> tuple[pa.Array, pa.Array, pa.Array]:
    """Arrow arrays (app, env, topic) indexed like ``pairs``: app and env split at the
    last ``-`` of the app-env frame."""
    apps, envs, topics = [], [], []
    for ae, t in pairs:
        s = ae.decode("utf-8", "replace")
        a, sep, e = s.rpartition("-")
        if not sep:
            a, e = s, ""
        apps.append(a)
        envs.append(e)
        topics.append(t.decode("utf-8", "replace"))
    return (pa.array(apps, pa.string()), pa.array(envs, pa.string()),
            pa.array(topics, pa.string()))


def _build(cols: _Cols, pairs, npbuf, segno: int, st: DecodeStats) -> pa.RecordBatch:
    n = cols.n
    apps, envs, topics = _pair_columns(pairs)
    pidx = pa.array(np.asarray(cols.pair, dtype=np.int32))
    app_col = apps.take(pidx)
    env_col = envs.take(pidx)
    topic_col = topics.take(pidx)

    offs = np.asarray(cols.meta_off, dtype=np.int64)
    metas = npbuf[offs[:, None] + _META_IDX].view(_META_DT).reshape(n)
    bad = None
    if cols.errors:
        bad_rows = [i for i, e in cols.errors.items() if e in ("meta", "frames")]
        if bad_rows:
            bad = np.zeros(n, dtype=bool)
            bad[bad_rows] = True
    device = pa.array(metas["device"].astype(np.int64), mask=bad)
    seq = pa.array(metas["seq"].astype(np.int64), mask=bad)
    created = pa.array(metas["created"].astype(np.int64), mask=bad)
    comp_col = _COMP_NAMES.take(pa.array(metas["comp"], mask=bad))

    body_col = _string_array(cols.bodies, cols.errors)
    if cols.errors:
        errs: list[str | None] = [None] * n
        for i, e in cols.errors.items():
            errs[i] = e
        err_col = pa.array(errs, pa.string())
    else:
        err_col = pa.nulls(n, pa.string())
    st.records += n
    st.bad_records += len(cols.errors)
    seg_col = pa.array(np.full(n, segno, dtype=np.int64))
    rec_col = pa.array(np.arange(cols.first, cols.first + n, dtype=np.int32))
    return pa.RecordBatch.from_arrays(
        [app_col, env_col, topic_col, device, seq, created, comp_col, body_col, err_col,
         seg_col, rec_col], schema=ARROW_SCHEMA)


def _string_array(bodies: list[bytes | None], errors: dict[int, str]) -> pa.Array:
    """A UTF-8 string array from bytes objects via one joined buffer; invalid UTF-8
    becomes null with ``errors[i] = "utf8"``."""
    n = len(bodies)
    if errors:
        valid = np.ones(n, dtype=bool)
        for i in errors:
            if bodies[i] is None:
                valid[i] = False
        filled = [b if b is not None else b"" for b in bodies]
    else:
        valid = None
        filled = bodies
    lens = np.fromiter(map(len, filled), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    data = b"".join(filled)
    if offsets[-1] < (1 << 31) - 1:
        offs_buf = pa.py_buffer(offsets.astype(np.int32))
    else:  # > 2 GiB of text in one batch: cannot happen with batch_rows * 64 MiB bound
        raise ValueError("batch too large for a string column")
    validity = None if valid is None else pa.array(valid).buffers()[1]
    arr = pa.Array.from_buffers(pa.string(), n, [validity, offs_buf, pa.py_buffer(data)],
                                null_count=-1 if valid is not None else 0)
    try:
        arr.validate(full=True)
        return arr
    except pa.ArrowInvalid:
        pass
    out: list[str | None] = []
    for i, b in enumerate(bodies):
        if b is None:
            out.append(None)
            continue
        try:
            out.append(bytes(b).decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
            errors[i] = "utf8"
    return pa.array(out, pa.string())


def _error_batch(segno: int, record: int, error: str, info: dict,
                 st: DecodeStats) -> pa.RecordBatch:
    st.records += 1
    st.bad_records += 1
    row = {"app": None, "env": None, "topic": None, "device": None, "sequence": None,
           "created_ms": None, "compression": None, "body": json.dumps(info), "error": error,
           "segment": segno, "record": record}
    return pa.RecordBatch.from_pylist([row], schema=ARROW_SCHEMA)


def _read_partition(part: SegmentSlice, batch_rows: int) -> Iterator[pa.RecordBatch]:
    try:
        yield from decode_segment(part.path, part.segno, part.start, part.stop, batch_rows)
    except OSError as e:
        yield _error_batch(part.segno, part.start, "unreadable",
                           {"path": part.path, "message": str(e)}, DecodeStats())


# ============================================================================ Spark API

@dataclass
class SegmentSlice(InputPartition):
    """Records ``[start, stop)`` of one segment (``stop`` None = to the end)."""

    path: str
    segno: int
    start: int = 0
    stop: int | None = None

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
    (records per Arrow batch, default 32768), streaming: ``maxRecordsPerTrigger``,
    ``maxSegmentsPerTrigger``, ``startingOffsets`` (``earliest`` default, or ``latest``).
    """

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self):
        return SCHEMA_DDL

    def reader(self, schema) -> LogjamBatchReader:
        return LogjamBatchReader(_lower(self.options))

    def streamReader(self, schema) -> LogjamStreamReader:
        return LogjamStreamReader(_lower(self.options))


class LogjamBatchReader(DataSourceReader):
    def __init__(self, options: dict):
        self.path = _path(options)
        self.per = _int_opt(options, "recordsPerPartition", 0)
        self.batch_rows = _int_opt(options, "batchRows", DEFAULT_BATCH_ROWS) or \
            DEFAULT_BATCH_ROWS
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"logjam data source: {self.path} is not a directory")

    def partitions(self):
        parts: list[SegmentSlice] = []
        for segno, p in list_segments(self.path):
            if self.per:
                parts.extend(_slices(p, segno, 0, record_count(p), self.per))
            else:
                parts.append(SegmentSlice(p, segno))
        return parts

    def read(self, partition):
        return _read_partition(partition, self.batch_rows)


class LogjamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"segment": S, "record": R}``: the next record to read is record R of
    the first segment numbered >= S."""

    def __init__(self, options: dict):
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
            return {"segment": 0, "record": 0}
        segno, _, c = segs[-1]
        return {"segment": segno, "record": c}

    @staticmethod
    def _key(off: dict) -> tuple[int, int]:
        return int(off["segment"]), int(off["record"])

    # -- Spark API --------------------------------------------------------------
    def initialOffset(self) -> dict:
        if self.starting == "latest":
            return self._end_of_all()
        return {"segment": 0, "record": 0}

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
        return {"segment": end_seg, "record": end_rec}

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
        return _read_partition(partition, self.batch_rows)

    def commit(self, end: dict) -> None:
        pass                    # the archive's retention decides when files go

    def stop(self) -> None:
        pass


def register(spark) -> None:
    """Register the ``logjam`` format with a SparkSession."""
    spark.dataSource.register(LogjamDataSource)

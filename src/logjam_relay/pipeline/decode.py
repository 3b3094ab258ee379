"""Decoding archived spool segments into Arrow batches (no Spark needed here).

The walk of a segment file (CRC check, frame lengths, (app-env, topic) interning) is
``spool/_segscan.c`` when built, else :func:`decode_segment_py`; after the C walk, a batch's
bodies are decompressed and UTF-8 checked in C too (``pipeline/_bodies.c``, see
:mod:`.bodies`), else in Python; Arrow arrays are built in bulk.  ``columns`` selects which columns are built
(column pruning: a query that does not need bodies skips decompression altogether), and
the request fields of ``logs`` bodies can be extracted straight into typed columns
(:mod:`.extract`).  The Spark side is :mod:`.datasource`; see ``docs/pipeline.md``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .. import _native
from ..protocols.logjam import COMPRESSION_NAMES
from ..spool import segment as fmt
from .bodies import BATCH_BODIES_IN_C, batch_bodies, string_array
from .bodies import decompress_body as _decompress_body
from .extract import EXTRACT_FIELDS, extract_fields
from .origin import ORIGIN_FIELDS, ORIGIN_NAMES, origin_columns

log = logging.getLogger("logjam_relay.pipeline.decode")

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
BASE_COLUMNS = tuple(ARROW_SCHEMA.names)
#: every column the reader can produce: the default schema plus the request fields
#: extracted from ``logs`` bodies (only built when a query's schema asks for them)
ALL_FIELDS = {f.name: f for f in ARROW_SCHEMA} | {f.name: f for f in EXTRACT_FIELDS} | \
    {f.name: f for f in ORIGIN_FIELDS}
_NEED_BODIES = {"body", "error"} | {f.name for f in EXTRACT_FIELDS}
_META_COLS = {"device", "sequence", "created_ms", "compression"}
_EXTRACTED = {f.name for f in EXTRACT_FIELDS}


def arrow_schema(columns) -> pa.Schema:
    """The Arrow schema of a column selection (names from :data:`ALL_FIELDS`)."""
    return pa.schema([ALL_FIELDS[c] for c in columns])

_META_DT = np.dtype([("tag", ">u2"), ("comp", "u1"), ("ver", "u1"), ("device", ">u4"),
                     ("created", ">u8"), ("seq", ">u8")])
_META_IDX = np.arange(24, dtype=np.int64)
_COMP_NAMES = pa.array([COMPRESSION_NAMES.get(i, f"unknown-{i}") for i in range(256)],
                       pa.string())
_FULL4 = struct.Struct("<IIBBHQIIII")
_FULL_HEAD = struct.Struct("<IIBBHQ")
_crc32 = zlib.crc32
_segscan = _native.load("logjam_relay.spool._segscan")
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
    try:
        seal = fmt.read_seal(path)
        if seal is not None:
            return seal[0]
        res = fmt.scan_segment(path)
    except OSError:         # unreadable: one slice, which gives the "unreadable" row
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

    __slots__ = ("pair", "meta_off", "bodies", "body_col", "errors", "first", "n")

    def __init__(self, first: int):
        self.pair: list[int] = []                 # index into the (app_env, topic) table
        self.meta_off: list[int] = []             # offset of the meta frame (0: bad meta)
        self.bodies: list[bytes | None] = []
        self.body_col: pa.Array | None = None     # built in C (_bodies.c) instead
        self.errors: dict[int, str] = {}          # row -> reason (sparse)
        self.first = first                        # record index of the first row
        self.n = 0


def decode_segment(path: str, segno: int, start: int = 0, stop: int | None = None,
                   batch_rows: int = DEFAULT_BATCH_ROWS,
                   stats: DecodeStats | None = None,
                   columns=None) -> Iterator[pa.RecordBatch]:
    """Arrow batches (:data:`ARROW_SCHEMA`, or the ``columns`` named, in that order, from
    :data:`ALL_FIELDS`) for records ``start`` (inclusive) to ``stop`` (exclusive; ``None``
    = to the end) of the segment file ``path``.  Never raises on bad data; ``OSError`` for
    an unreadable file propagates (callers turn it into a row).  Bodies are decompressed
    only when ``body``, ``error`` or an extracted field is asked for.
    Uses the C record walk (``spool/_segscan.c``) when it is built, else
    :func:`decode_segment_py`; both give the same batches."""
    if columns is not None and not set(ORIGIN_NAMES).isdisjoint(columns):
        return _with_origins(path, segno, start, stop, batch_rows, stats, _columns(columns))
    if _segscan is None:
        return decode_segment_py(path, segno, start, stop, batch_rows, stats, columns)
    return _decode_segment_c(path, segno, start, stop, batch_rows, stats, columns)


def _with_origins(path, segno, start, stop, batch_rows, stats, columns):
    """:func:`decode_segment` of a selection with origin columns (:mod:`.origin`): they
    are made from the app, env and body columns, which are dropped unless asked for."""
    base = tuple(c for c in columns if c not in ORIGIN_NAMES)
    need = base + tuple(c for c in ("app", "env", "body") if c not in base)
    for b in decode_segment(path, segno, start, stop, batch_rows, stats, need):
        o = origin_columns(b.column(need.index("app")), b.column(need.index("env")),
                           b.column(need.index("body")))
        yield pa.RecordBatch.from_arrays(
            [o[c] if c in o else b.column(need.index(c)) for c in columns],
            schema=arrow_schema(columns))


def decode_slice(path: str, segno: int, start: int = 0, stop: int | None = None,
                 batch_rows: int = DEFAULT_BATCH_ROWS,
                 columns=None) -> Iterator[pa.RecordBatch]:
    """:func:`decode_segment`, with an unreadable file as one ``unreadable`` error row
    instead of ``OSError`` (what the Spark readers emit)."""
    try:
        yield from decode_segment(path, segno, start, stop, batch_rows, columns=columns)
    except OSError as e:
        yield _error_batch(segno, start, "unreadable", {"path": path, "message": str(e)},
                           DecodeStats(), columns or BASE_COLUMNS)


def _columns(columns) -> tuple[str, ...]:
    if columns is None:
        return BASE_COLUMNS
    cols = tuple(columns)
    unknown = [c for c in cols if c not in ALL_FIELDS]
    if unknown:
        raise ValueError(f"logjam data source: unknown column(s) {', '.join(unknown)}; "
                         f"known: {', '.join(ALL_FIELDS)}")
    return cols


def _decode_segment_c(path: str, segno: int, start: int, stop: int | None,
                      batch_rows: int, stats: DecodeStats | None,
                      columns=None) -> Iterator[pa.RecordBatch]:
    st = stats if stats is not None else DecodeStats()
    columns = _columns(columns)
    decode = not _NEED_BODIES.isdisjoint(columns)
    with open(path, "rb", buffering=0) as f:
        buf = f.read()
    try:
        fmt.decode_header(buf[:fmt.HEADER_LEN])
    except fmt.SegmentError as e:
        if start == 0:          # one row for the file, from its first slice
            yield _error_batch(segno, start, f"corrupt:{e.reason}",
                               {"offset": 0, "message": str(e)}, st, columns)
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
            errors = cols.errors
            if not decode:                  # pruned: no body, no decompression
                codes_np = block[:, 1]
                for i in np.flatnonzero(codes_np < 0).tolist():
                    errors[i] = "meta" if codes_np[i] == -1 else "frames"
                yield _build(cols, pairs, npbuf, segno, st, columns, False)
                continue
            if BATCH_BODIES_IN_C:           # decompression + UTF-8 check in C
                cols.body_col = batch_bodies(buf, rows_b, first, n, errors)
                yield _build(cols, pairs, npbuf, segno, st, columns)
                continue
            codes = block[:, 1].tolist()
            body_off = block[:, 3].tolist()
            body_len = block[:, 4].tolist()
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
            yield _build(cols, pairs, npbuf, segno, st, columns)
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
        yield _error_batch(segno, idx, f"corrupt:{status}", info, st, columns)


def decode_segment_py(path: str, segno: int, start: int = 0, stop: int | None = None,
                      batch_rows: int = DEFAULT_BATCH_ROWS,
                      stats: DecodeStats | None = None,
                      columns=None) -> Iterator[pa.RecordBatch]:
    """:func:`decode_segment` in Python alone (the reference for the C walk)."""
    st = stats if stats is not None else DecodeStats()
    columns = _columns(columns)
    decode = not _NEED_BODIES.isdisjoint(columns)
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
        if start == 0:          # one row for the file, from its first slice
            yield _error_batch(segno, start, f"corrupt:{e.reason}",
                               {"offset": 0, "message": str(e)}, st, columns)
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
            if n == 4:
                bad = pos + 36 + la + lt + lb + lm != rend
            else:
                lens = struct.unpack_from(f"<{n}I", buf, pos + 20)
                bad = pos + 20 + 4 * n + sum(lens) != rend
            if bad:                 # checked before a slice skips the record, too
                corrupt = ("frame_lengths", pos)
                break
            if idx < start:
                idx += 1
                pos = rend
                continue
            if n == 4:
                p = pos + 36
                r = p + la + lt
                s = r + lb
                key = buf[p:r]
                k = pair_get(key)
                if k is None or pair_la[k] != la:
                    k = _intern_pair(pair_index, pairs, pair_la, key, la)
                ap_pair(k)
                comp = meta_comp(buf[s:s + 4]) if lm == 24 else None
                if comp == 0 or (comp is not None and not decode):
                    ap_meta(s)
                    ap_body(buf[r:s] if decode else None)
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
                p = pos + 20 + 4 * n
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
                yield _build(cols, pairs, npbuf, segno, st, columns, decode)
                cols = _Cols(idx)
                ap_pair, ap_meta, ap_body = (cols.pair.append, cols.meta_off.append,
                                             cols.bodies.append)
                errors = cols.errors
                i = 0
        cols.n = i
    finally:
        mv.release()
    if cols.n:
        yield _build(cols, pairs, npbuf, segno, st, columns, decode)
    if corrupt is not None and start <= idx < stop:
        reason, off = corrupt
        seal = fmt.read_seal(path)
        info = {"offset": off}
        if seal is not None:
            info["records_lost"] = max(0, seal[0] - idx)
        elif reason == "no_seal":
            info["message"] = "segment has no valid seal record (incomplete copy?)"
        st.corrupt += 1
        yield _error_batch(segno, idx, f"corrupt:{reason}", info, st, columns)


# ============================================================================ meta walk

#: the loss table's walk (:func:`meta_arrays`) is ``_segscan.scan_meta`` (C)
META_WALK_IN_C = _segscan is not None and hasattr(_segscan, "scan_meta")
_META_ONLY = ("device", "sequence", "created_ms")
_E64 = np.empty(0, dtype=np.int64)


def meta_arrays(path: str, stats: DecodeStats | None = None,
                chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(device, sequence, created_ms)``, int64 arrays of the records of segment file
    ``path`` that have a valid meta frame, in record order: exactly the rows of
    :func:`decode_segment` (columns ``device, sequence, created_ms``) whose device and
    created_ms are not null, with the same counters added to ``stats``.  ``OSError`` for
    an unreadable file propagates.  The C walk (``_segscan.scan_meta``: it reads the file
    ``chunk`` bytes at a time into one small buffer, no copy of the whole file and no
    Python object per record) when it is built, else :func:`meta_arrays_py`."""
    if not META_WALK_IN_C:
        return meta_arrays_py(path, stats)
    st = stats if stats is not None else DecodeStats()
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        try:
            fmt.decode_header(os.pread(fd, fmt.HEADER_LEN, 0))
        except fmt.SegmentError:
            st.records += 1             # decode_segment's one error row for the file
            st.bad_records += 1
            return _E64, _E64, _E64
        dev, seq, created, bad, _pos, idx, status, skipped = _segscan.scan_meta(
            fd, fmt.HEADER_LEN, size, chunk)
    st.skipped_kinds += skipped
    st.records += idx
    st.bad_records += bad
    if status != "seal":                # a corrupt reason: decode_segment's error row
        st.corrupt += 1
        st.records += 1
        st.bad_records += 1
    return (np.frombuffer(dev, dtype=np.int64), np.frombuffer(seq, dtype=np.int64),
            np.frombuffer(created, dtype=np.int64))


def meta_arrays_py(path: str, stats: DecodeStats | None = None,
                   decode=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`meta_arrays` from the decoded batches of ``decode`` (default
    :func:`decode_segment`; the tests use :func:`decode_segment_py`, the reference)."""
    decode = decode_segment if decode is None else decode
    parts: list[tuple[np.ndarray, ...]] = []
    for b in decode(path, 0, batch_rows=1 << 20, stats=stats, columns=_META_ONLY):
        dev, seq, created = (b.column(i) for i in range(3))
        ok = np.asarray(dev.is_valid()) & np.asarray(created.is_valid())
        if not ok.all():
            dev, seq, created = (c.filter(ok) for c in (dev, seq, created))
        parts.append(tuple(np.asarray(c.to_numpy(), dtype=np.int64)
                           for c in (dev, seq, created)))
    if not parts:
        return _E64, _E64, _E64
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate(cols) for cols in zip(*parts, strict=True))


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


def _build(cols: _Cols, pairs, npbuf, segno: int, st: DecodeStats,
           columns=BASE_COLUMNS, decoded: bool = True) -> pa.RecordBatch:
    """One batch with the ``columns`` asked for; ``cols.bodies`` is ignored when the
    bodies were not decoded (``decoded`` False: no body/error/extracted column asked)."""
    n = cols.n
    want = set(columns)
    out: dict[str, pa.Array] = {}
    pidx = None
    if want & {"app", "env", "topic"} or want & _NEED_BODIES:
        apps, envs, topics = _pair_columns(pairs)
        pidx = pa.array(np.asarray(cols.pair, dtype=np.int32))
        for name, arr in (("app", apps), ("env", envs), ("topic", topics)):
            if name in want:
                out[name] = arr.take(pidx)

    if want & _META_COLS:
        offs = np.asarray(cols.meta_off, dtype=np.int64)
        metas = npbuf[offs[:, None] + _META_IDX].view(_META_DT).reshape(n)
        bad = None
        if cols.errors:
            bad_rows = [i for i, e in cols.errors.items() if e in ("meta", "frames")]
            if bad_rows:
                bad = np.zeros(n, dtype=bool)
                bad[bad_rows] = True
        if "device" in want:
            out["device"] = pa.array(metas["device"].astype(np.int64), mask=bad)
        if "sequence" in want:
            out["sequence"] = pa.array(metas["seq"].astype(np.int64), mask=bad)
        if "created_ms" in want:
            out["created_ms"] = pa.array(metas["created"].astype(np.int64), mask=bad)
        if "compression" in want:
            out["compression"] = _COMP_NAMES.take(pa.array(metas["comp"], mask=bad))

    if decoded:
        body_col = cols.body_col
        if body_col is None:
            body_col = string_array(cols.bodies, cols.errors)
        if "body" in want:
            out["body"] = body_col
        extracted = [c for c in columns if c in _EXTRACTED]
        if extracted:
            # request fields of logs bodies (valid UTF-8, no error)
            is_logs = np.fromiter((t.startswith(b"logs") for _, t in pairs), dtype=bool,
                                  count=len(pairs))
            rows = is_logs[np.asarray(cols.pair, dtype=np.int64)]
            if cols.errors:
                rows = rows.copy()
                rows[list(cols.errors)] = False
            out.update(extract_fields(body_col, rows, extracted))
    if "error" in want:
        if cols.errors:
            errs: list[str | None] = [None] * n
            for i, e in cols.errors.items():
                errs[i] = e
            out["error"] = pa.array(errs, pa.string())
        else:
            out["error"] = pa.nulls(n, pa.string())
    st.records += n
    st.bad_records += len(cols.errors)
    if "segment" in want:
        out["segment"] = pa.array(np.full(n, segno, dtype=np.int64))
    if "record" in want:
        out["record"] = pa.array(np.arange(cols.first, cols.first + n, dtype=np.int32))
    return pa.RecordBatch.from_arrays([out[c] for c in columns],
                                      schema=arrow_schema(columns))


def _error_batch(segno: int, record: int, error: str, info: dict,
                 st: DecodeStats, columns=BASE_COLUMNS) -> pa.RecordBatch:
    st.records += 1
    st.bad_records += 1
    row = dict.fromkeys(ALL_FIELDS)
    row.update(body=json.dumps(info), error=error, segment=segno, record=record,
               bad_json=False)
    schema = arrow_schema(columns)
    return pa.RecordBatch.from_pylist([{c: row[c] for c in columns}], schema=schema)

"""The request fields of ``logs`` bodies, extracted straight into typed Arrow columns.

The stats pipeline needs six fields of a logjam request body; asking the data source for
these columns (``spark.read.format("logjam").schema("... action string, total_time
double ...")``) makes Spark skip JSON parsing and the body column entirely.

=============  =================  ==============================================
column         type               value (null when absent or ill-typed)
=============  =================  ==============================================
action         string             ``action`` when it is a string
started_ms     long               ``started_ms`` when an integer, else ``started_at``
                                  (ISO-8601, naive = UTC) in epoch ms
total_time     double             ``total_time`` when a number
code           int                ``code`` when an integer (int32)
severity       int                ``severity`` when an integer (int32)
exceptions     array<string>      the strings of the ``exceptions`` list
bad_json       boolean            a ``logs`` body that is not a JSON object
=============  =================  ==============================================

The definitions are those of :func:`logjam_relay.pipeline.stats.reference_tables`
(``json.loads`` semantics: duplicate keys keep the last, ``true``/``false`` are not
numbers).  Rows not asked for (other topics, undecodable bodies) get nulls and
``bad_json`` false.  :func:`extract_py` is the reference; the C twin
(``pipeline/_extract.c``) handles the common case and hands anything unusual (escapes in
the strings it returns, ``started_at``, huge numbers, ``NaN``) back to it row by row;
``tests/test_pipeline_extract.py`` compares them.
"""

from __future__ import annotations

import datetime as _dt
import json

import numpy as np
import pyarrow as pa

from .. import _native

_extract_c = _native.load("logjam_relay.pipeline._extract")

EXTRACT_FIELDS = [
    pa.field("action", pa.string()), pa.field("started_ms", pa.int64()),
    pa.field("total_time", pa.float64()), pa.field("code", pa.int32()),
    pa.field("severity", pa.int32()), pa.field("exceptions", pa.list_(pa.string())),
    pa.field("bad_json", pa.bool_()),
]
EXTRACT_DDL = ("action string, started_ms long, total_time double, code int, severity int, "
               "exceptions array<string>, bad_json boolean")
_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def iso_ms(s) -> int | None:
    """``started_at`` (ISO-8601; naive = UTC) in epoch ms, or None."""
    if not isinstance(s, str):
        return None
    try:
        t = _dt.datetime.fromisoformat(s)
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    return int(round(t.timestamp() * 1000))


def fields_of(body: bytes) -> tuple | None:
    """(action, started_ms, total_time, code, severity, exceptions) of one body, or None
    when it is not a JSON object (``json.loads`` semantics)."""
    try:
        j = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(j, dict):
        return None
    started = j.get("started_ms")
    if _is_int(started):
        sm = started if _I64[0] <= started <= _I64[1] else None
    else:
        sm = iso_ms(j.get("started_at"))
    action = j.get("action")
    action = action if isinstance(action, str) else None
    tt = j.get("total_time")
    try:
        tt = float(tt) if (_is_int(tt) or isinstance(tt, float)) else None
    except OverflowError:         # an integer beyond a double's range
        tt = None
    code = j.get("code")
    code = code if _is_int(code) and _I32[0] <= code <= _I32[1] else None
    sev = j.get("severity")
    sev = sev if _is_int(sev) and _I32[0] <= sev <= _I32[1] else None
    exs = j.get("exceptions")
    exs = [e for e in exs if isinstance(e, str)] if isinstance(exs, list) else None
    return action, sm, tt, code, sev, exs


def _body_buffers(body_col: pa.Array) -> tuple[memoryview | bytes, np.ndarray]:
    offs = np.frombuffer(body_col.buffers()[1], dtype=np.int32,
                         count=len(body_col) + 1, offset=body_col.offset * 4)
    data = body_col.buffers()[2]
    return (memoryview(data) if data is not None else b""), offs      # no copy


def extract_py(body_col: pa.Array, rows: np.ndarray, names=None) -> dict[str, pa.Array]:
    """The extracted columns (``names``, default all) for the rows where ``rows`` is true
    (others null, ``bad_json`` false); ``body_col`` is the batch's body string array."""
    n = len(body_col)
    data, offs = _body_buffers(body_col)
    cols: list[list] = [[None] * n for _ in range(6)]
    bad = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(rows).tolist():
        f = fields_of(bytes(data[offs[i]:offs[i + 1]]))
        if f is None:
            bad[i] = True
            continue
        for k in range(6):
            cols[k][i] = f[k]
    return _arrays(cols, bad, names)


def _arrays(cols: list[list], bad: np.ndarray, names) -> dict[str, pa.Array]:
    names = [f.name for f in EXTRACT_FIELDS] if names is None else list(names)
    out = {}
    for k, f in enumerate(EXTRACT_FIELDS[:6]):
        if f.name in names:
            out[f.name] = pa.array(cols[k], f.type)
    if "bad_json" in names:
        out["bad_json"] = pa.array(bad)
    return out


def extract_fields(body_col: pa.Array, rows: np.ndarray, names=None) -> dict[str, pa.Array]:
    """:func:`extract_py`, in C when ``pipeline/_extract.c`` is built."""
    if _extract_c is None:
        return extract_py(body_col, rows, names)
    return extract_c(body_col, rows, names)


def extract_c(body_col: pa.Array, rows: np.ndarray, names=None) -> dict[str, pa.Array]:
    """:func:`extract_py` with the C walk (``pipeline/_extract.c``); the rows it leaves
    undecided (flag 128) go through :func:`fields_of`."""
    n = len(body_col)
    data, offs = _body_buffers(body_col)
    (started, tt, code, sev, flags, a_offs, a_data, l_offs, e_offs,
     e_data) = _extract_c.extract(data, np.ascontiguousarray(offs),
                                  np.ascontiguousarray(rows, dtype=np.uint8))
    fl = np.frombuffer(flags, dtype=np.uint8)
    names = [f.name for f in EXTRACT_FIELDS] if names is None else list(names)
    fb = np.flatnonzero(fl & 128)
    if len(fb):
        # rare: escapes, other ISO forms, huge numbers -> the Python definitions, patched in
        return _patched(body_col, data, offs, fl, fb, started, tt, code, sev, a_offs, a_data,
                        l_offs, e_offs, e_data, names)
    out = {}
    for name, buf, typ, bit in (("started_ms", started, pa.int64(), 1),
                                ("total_time", tt, pa.float64(), 2),
                                ("code", code, pa.int32(), 4), ("severity", sev, pa.int32(), 8)):
        if name in names:
            out[name] = pa.Array.from_buffers(typ, n, [_validity(fl, bit), pa.py_buffer(buf)])
    if "action" in names:
        out["action"] = pa.Array.from_buffers(pa.string(), n, [
            _validity(fl, 16), pa.py_buffer(a_offs), pa.py_buffer(a_data)])
    if "exceptions" in names:
        m = len(e_offs) // 4 - 1
        strings = pa.Array.from_buffers(pa.string(), m, [None, pa.py_buffer(e_offs),
                                                         pa.py_buffer(e_data)])
        out["exceptions"] = pa.Array.from_buffers(pa.list_(pa.string()), n, [
            _validity(fl, 32), pa.py_buffer(l_offs)], children=[strings])
    if "bad_json" in names:
        out["bad_json"] = pa.array((fl & 64).astype(bool))
    return out


def _validity(fl: np.ndarray, bit: int):
    return pa.py_buffer(np.packbits((fl & bit).astype(bool), bitorder="little"))


def _patched(body_col, data, offs, fl, fb, started, tt, code, sev, a_offs, a_data, l_offs,
             e_offs, e_data, names) -> dict[str, pa.Array]:
    n = len(fl)
    cols: list[list] = [[None] * n for _ in range(6)]
    st = np.frombuffer(started, dtype=np.int64)
    t = np.frombuffer(tt, dtype=np.float64)
    c = np.frombuffer(code, dtype=np.int32)
    s = np.frombuffer(sev, dtype=np.int32)
    ao = np.frombuffer(a_offs, dtype=np.int32)
    lo = np.frombuffer(l_offs, dtype=np.int32)
    eo = np.frombuffer(e_offs, dtype=np.int32)
    for i in np.flatnonzero(fl & 63).tolist():
        f = int(fl[i])
        if f & 16:
            cols[0][i] = a_data[ao[i]:ao[i + 1]].decode("utf-8")
        if f & 1:
            cols[1][i] = int(st[i])
        if f & 2:
            cols[2][i] = float(t[i])
        if f & 4:
            cols[3][i] = int(c[i])
        if f & 8:
            cols[4][i] = int(s[i])
        if f & 32:
            cols[5][i] = [e_data[eo[k]:eo[k + 1]].decode("utf-8")
                          for k in range(lo[i], lo[i + 1])]
    bad = (fl & 64).astype(bool)
    for i in fb.tolist():
        r = fields_of(bytes(data[offs[i]:offs[i + 1]]))
        if r is None:
            bad[i] = True
            continue
        for k in range(6):
            cols[k][i] = r[k]
    return _arrays(cols, bad, names)

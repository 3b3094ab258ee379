"""What identifies an event across a fleet of chained relays: its origin (pure parsing).

An event is identified by its **origin**: the device and sequence number that the first
relay it reached stamped on it (``docs/fleet.md``).

* A record that arrived over ZeroMQ at the relay whose archive is read is its own origin:
  the device and sequence of its meta frame.
* A record that came in through an input (an edge relay's Lumberjack or Courier output
  into this relay, ``docs/inputs.md``) carries the first hop's numbers as the first key of
  its body: ``{"logjam_origin":{"device":7,"sequence":42,"created_ms":...,"host":"edge-1",
  "input":"lj"}, ...}``.  Its meta frame holds the last hop's numbers.

Two relays with the same device number are told apart by the origin ``host`` (the edge's
``fqdn``): the origin key is ``(host, device, sequence)``.  A heartbeat whose body declares
``{"restart":{"skipped_from":A,"skipped_to":B}}`` is a relay's restart marker (numbers it
reserved and never used).

This module reads those from decoded columns (:func:`origin_columns`, the data source's
origin columns) and reads and writes the data sources' option ``exclude``;
:mod:`.originindex` walks archives with it.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: what an origin body starts with (``inputs/mapping.py`` writes exactly this)
ORIGIN_PREFIX = '{"logjam_origin":{"device":'
_D = "[0-9]{1,20}"
ORIGIN_RE = (r'^\{"logjam_origin":\{"device":(?P<device>' + _D + r'),"sequence":(?P<sequence>'
             + _D + r'),"created_ms":(?P<created>-?' + _D + r'),"host":"(?P<host>(?:[^"\\]|\\.)*)"')
RESTART_RE = (r'"restart":\{"skipped_from":(?P<a>' + _D + r'),"skipped_to":(?P<b>' + _D
              + r')\}')
#: the head of a body searched for the origin and the restart marker
HEAD_CHARS = 4096

#: the origin columns the data source adds (``decode.ALL_FIELDS``)
ORIGIN_FIELDS = (pa.field("origin_host", pa.string()), pa.field("origin_device", pa.int64()),
                 pa.field("origin_sequence", pa.int64()),
                 pa.field("skipped_from", pa.int64()), pa.field("skipped_to", pa.int64()))
ORIGIN_DDL = ("origin_host string, origin_device long, origin_sequence long, "
              "skipped_from long, skipped_to long")
ORIGIN_NAMES = tuple(f.name for f in ORIGIN_FIELDS)

_E = np.empty(0, dtype=np.int64)


def _ints(strings: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(values, ok) of decimal digit strings (null: not ok); a number beyond int64 is not
    ok (sequence numbers are below 2**63 in practice; such a body is not an origin)."""
    out = np.zeros(len(strings), dtype=np.int64)
    ok = np.asarray(strings.is_valid(), dtype=bool).copy()
    if not ok.any():
        return out, ok
    try:
        return pc.cast(pc.fill_null(strings, "0"), pa.int64()).to_numpy(), ok
    except (pa.ArrowInvalid, OverflowError):
        pass
    for i, s in enumerate(strings.to_pylist()):
        if s is None or not s.isdigit():
            ok[i] = False
            continue
        n = int(s)
        if -(1 << 63) <= n < (1 << 63):
            out[i] = n
        else:
            ok[i] = False
    return out, ok


def _unescape(hosts: list) -> list:
    return [h if h is None or "\\" not in h else _json_str(h) for h in hosts]


def _json_str(h: str) -> str:
    try:
        return json.loads('"' + h + '"')
    except ValueError:
        return h


def origin_columns(app: pa.Array, env: pa.Array, body: pa.Array) -> dict[str, pa.Array]:
    """The origin columns (:data:`ORIGIN_FIELDS`) of decoded rows: ``origin_*`` from a body
    that starts with the origin (null elsewhere); ``skipped_*`` from a heartbeat
    (app ``heartbeat``, env empty) whose body declares a restart's skipped numbers."""
    n = len(body)
    if n == 0:
        return {f.name: pa.array([], f.type) for f in ORIGIN_FIELDS}
    if isinstance(body, pa.ChunkedArray):
        body = body.combine_chunks()
    head = pc.utf8_slice_codeunits(body, 0, HEAD_CHARS)
    has = pc.fill_null(pc.starts_with(head, ORIGIN_PREFIX), False)
    host = pa.nulls(n, pa.string())
    dev = seq = pa.nulls(n, pa.int64())
    if pc.any(has).as_py():
        m = pc.extract_regex(pc.if_else(has, head, pa.scalar(None, pa.string())), ORIGIN_RE)
        d, d_ok = _ints(pc.struct_field(m, "device"))
        s, s_ok = _ints(pc.struct_field(m, "sequence"))
        valid = np.asarray(m.is_valid(), dtype=bool) & d_ok & s_ok
        mask = ~valid
        hosts = pc.struct_field(m, "host")
        if pc.any(pc.fill_null(pc.match_substring(hosts, "\\"), False)).as_py():
            hosts = pa.array(_unescape(hosts.to_pylist()), pa.string())
        host = pc.if_else(pa.array(valid), hosts, pa.scalar(None, pa.string()))
        dev = pa.array(d, pa.int64(), mask=mask)
        seq = pa.array(s, pa.int64(), mask=mask)
    hb = pc.fill_null(pc.and_(pc.equal(app, "heartbeat"), pc.equal(env, "")), False)
    sk_from = sk_to = pa.nulls(n, pa.int64())
    if pc.any(hb).as_py():
        cand = pc.and_(hb, pc.fill_null(pc.match_substring(head, '"restart":'), False))
        if pc.any(cand).as_py():
            m = pc.extract_regex(pc.if_else(cand, head, pa.scalar(None, pa.string())),
                                 RESTART_RE)
            a, a_ok = _ints(pc.struct_field(m, "a"))
            b, b_ok = _ints(pc.struct_field(m, "b"))
            valid = np.asarray(m.is_valid(), dtype=bool) & a_ok & b_ok
            sk_from = pa.array(a, pa.int64(), mask=~valid)
            sk_to = pa.array(b, pa.int64(), mask=~valid)
    return {"origin_host": host, "origin_device": dev, "origin_sequence": seq,
            "skipped_from": sk_from, "skipped_to": sk_to}


def encode_ranges(recs: np.ndarray) -> str:
    """Sorted distinct integers as ``A-B,C,...`` (runs of consecutive numbers joined)."""
    if len(recs) == 0:
        return ""
    recs = np.asarray(recs, dtype=np.int64)
    brk = np.flatnonzero(np.diff(recs) != 1) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [len(recs)])) - 1
    return ",".join(f"{recs[a]}" if a == z else f"{recs[a]}-{recs[z]}"
                    for a, z in zip(starts.tolist(), ends.tolist(), strict=True))


def parse_exclusions(text: str | None) -> dict[int, np.ndarray]:
    """The ``exclude`` option (:meth:`.originindex.OriginIndex.exclusions_of`): segment number -> sorted
    record indices.  A malformed option raises ValueError naming it."""
    out: dict[int, np.ndarray] = {}
    if not text:
        return out
    try:
        for part in text.split(";"):
            if not part:
                continue
            seg, _, ranges = part.partition(":")
            recs = []
            for r in ranges.split(","):
                if not r:
                    continue
                a, _, z = r.partition("-")
                a = int(a)
                z = int(z) if z else a
                if z < a or a < 0:
                    raise ValueError(r)
                recs.append(np.arange(a, z + 1, dtype=np.int64))
            out[int(seg)] = np.unique(np.concatenate(recs)) if recs else _E
    except ValueError:
        raise ValueError(f"logjam data source: option exclude is malformed: {text[:80]!r}") \
            from None
    return out


def keep_mask(record: np.ndarray, excluded: np.ndarray | None) -> np.ndarray | None:
    """The rows whose record index is not in ``excluded`` (None: keep all)."""
    if excluded is None or len(excluded) == 0:
        return None
    keep = ~np.isin(np.asarray(record, dtype=np.int64), excluded)
    return None if keep.all() else keep

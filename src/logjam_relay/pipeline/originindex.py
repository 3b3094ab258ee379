"""Each event counted once, and loss per origin device: the walk of a fleet's archives.

:class:`OriginIndex` walks archives segment by segment in arrival order (archives in the
order given, segments in number order, records in record order), each record's origin
read by :mod:`.origin`, and gives:

* ``exclude``: per segment file, the records that repeat an origin key seen before (an edge
  resent a window after a restart, or failed over to another central relay): the tables
  leave them out, so every origin counts once, the first copy that arrived;
* ``origin``: the loss state per origin ``(host, device)`` of the records that carry an
  origin (:class:`.loss.DeviceLoss`: received, missing, duplicates, out of order, skipped,
  and the missing ranges);
* ``last``: the last hop's own loss state, per meta device (the ``loss`` table).

A relay's sequence numbers are shared by its data messages and its heartbeats, and after a
crash it continues after a reserved block of numbers.  An edge's output forwards its
heartbeats (``heartbeats=on``) and the relay writes a restart marker into its spool; the
numbers a marker declares are counted as ``skipped``, not missing
(:meth:`.loss.DeviceLoss.declare`).  See ``docs/fleet.md``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .loss import DeviceLoss, LossState, read_state, state_arrays, write_npz
from .minutes import minutes_of
from .origin import ORIGIN_NAMES, encode_ranges, origin_columns

OUT_SCHEMA = pa.schema([
    ("host", pa.string()), ("device", pa.int64()), ("minute_ms", pa.int64()),
    ("received", pa.int64()), ("missing", pa.int64()), ("duplicates", pa.int64()),
    ("out_of_order", pa.int64()), ("first_sequence", pa.int64()),
    ("last_sequence", pa.int64()), ("skipped", pa.int64()),
])
GAPS_SCHEMA = pa.schema([
    ("hop", pa.string()), ("host", pa.string()), ("device", pa.int64()),
    ("first_missing", pa.int64()), ("last_missing", pa.int64()), ("count", pa.int64()),
    ("minute_ms", pa.int64()),
])
_E = np.empty(0, dtype=np.int64)


_WALK_COLUMNS = ("app", "env", "device", "sequence", "created_ms", "body", "record")


@dataclass
class SegmentOrigins:
    """One segment's records with a valid meta frame, in record order (the rows of
    :func:`.decode.meta_arrays`), with their origins."""

    record: np.ndarray
    device: np.ndarray
    sequence: np.ndarray
    minute: np.ndarray
    has_origin: np.ndarray           # bool
    host: list                       # origin host per row (None without an origin)
    odev: np.ndarray
    oseq: np.ndarray
    skips: list = field(default_factory=list)   # (row, skipped_from, skipped_to)


def segment_origins(path: str, segno: int = 0, stats=None) -> SegmentOrigins:
    """:class:`SegmentOrigins` of a segment file (``OSError`` if it cannot be read)."""
    from .decode import decode_segment
    parts = []
    for b in decode_segment(path, segno, batch_rows=1 << 16, stats=stats,
                            columns=_WALK_COLUMNS):
        dev, created = b.column(2), b.column(4)
        ok = pc.and_(dev.is_valid(), created.is_valid())
        if not pc.all(ok).as_py():
            b = b.filter(ok)
        if b.num_rows == 0:
            continue
        o = origin_columns(b.column(0), b.column(1), b.column(5))
        parts.append((b, o))
    if not parts:
        return SegmentOrigins(_E, _E, _E, _E, np.zeros(0, bool), [], _E, _E)

    def cat(get, dtype=np.int64):
        return np.concatenate([np.asarray(get(b, o).to_numpy(zero_copy_only=False),
                                          dtype=dtype) for b, o in parts])
    record = cat(lambda b, o: b.column(6))
    device = cat(lambda b, o: b.column(2))
    sequence = cat(lambda b, o: b.column(3))
    created = cat(lambda b, o: b.column(4))
    has = np.concatenate([np.asarray(o["origin_device"].is_valid(), dtype=bool)
                          for _b, o in parts])
    odev = cat(lambda b, o: pc.fill_null(o["origin_device"], 0))
    oseq = cat(lambda b, o: pc.fill_null(o["origin_sequence"], 0))
    host = [h for _b, o in parts for h in o["origin_host"].to_pylist()]
    skips = []
    at = 0
    for b, o in parts:
        sf = o["skipped_from"]
        if sf.null_count < len(sf):
            st = o["skipped_to"].to_pylist()
            for i, a in enumerate(sf.to_pylist()):
                if a is not None:
                    skips.append((at + i, a, st[i]))
        at += b.num_rows
    return SegmentOrigins(record, device, sequence, minutes_of(created), has, host, odev,
                          oseq, skips)


def origins_of(t: pa.Table) -> SegmentOrigins:
    """:class:`SegmentOrigins` of one segment's walk rows (columns of
    :func:`spark_walk_frame`, in record order, valid meta only)."""
    return _origins_from(t, origin_columns(t["app"], t["env"], t["head"]))


def _origins_from(t: pa.Table, o) -> SegmentOrigins:
    """:class:`SegmentOrigins` of rows in arrival order (``record, device, sequence,
    created_ms``) and their origin columns ``o`` (:data:`.origin.ORIGIN_NAMES`)."""
    sf = o["skipped_from"]
    skips = []
    if sf.null_count < len(sf):
        st = o["skipped_to"].to_pylist()
        skips = [(i, a, st[i]) for i, a in enumerate(sf.to_pylist())
                 if a is not None and st[i] is not None]

    def ints(c):
        return np.asarray(c.to_numpy(zero_copy_only=False), dtype=np.int64)
    return SegmentOrigins(
        ints(t["record"]), ints(t["device"]), ints(t["sequence"]),
        minutes_of(ints(t["created_ms"])),
        np.asarray(o["origin_device"].is_valid(), dtype=bool), o["origin_host"].to_pylist(),
        ints(pc.fill_null(o["origin_device"], 0)), ints(pc.fill_null(o["origin_sequence"], 0)),
        skips)


def _java_regex(python_re: str) -> str:
    return python_re.replace("(?P<", "(?<")


def spark_walk_frame(spark, uri: str):
    """The rows the origin walk needs of an archive, read by the JVM reader on the
    executors: ``segment, record, app, env, device, sequence, created_ms`` of each record
    with a valid meta frame, and ``head``: the body's origin prefix (what
    :data:`.origin.ORIGIN_RE` matches at its start), a space, and a heartbeat's restart
    marker (what :data:`.origin.RESTART_RE` finds), each empty when absent, both searched
    in the first :data:`.origin.HEAD_CHARS` characters as :func:`.origin.origin_columns`
    does.  :func:`.origin.origin_columns` of ``head`` equals that of the body."""
    from pyspark.sql import functions as F

    from .origin import HEAD_CHARS, ORIGIN_PREFIX, ORIGIN_RE, RESTART_RE
    df = spark.read.format("logjam").load(uri)
    body = F.substring(F.col("body"), 1, HEAD_CHARS)
    o = F.when(F.col("body").startswith(ORIGIN_PREFIX),
               F.regexp_extract(body, _java_regex(ORIGIN_RE), 0))
    hb = (F.col("app") == "heartbeat") & (F.col("env") == "") \
        & F.col("body").contains('"restart":')
    r = F.when(hb, F.regexp_extract(body, _java_regex(RESTART_RE), 0))
    head = F.concat(F.coalesce(o, F.lit("")), F.lit(" "), F.coalesce(r, F.lit("")))
    return df.where(F.col("device").isNotNull() & F.col("created_ms").isNotNull()) \
        .select("segment", "record", "app", "env", "device", "sequence", "created_ms",
                head.alias("head"))


class OriginIndex:
    """What :mod:`.stats` needs before it aggregates: the copies to leave out and the loss
    state of every origin device and of the last hop (see the module's docstring)."""

    def __init__(self):
        self.last = LossState()
        self.origin: dict[tuple[str, int], DeviceLoss] = {}
        #: segment path -> sorted record indices left out of the tables
        self.exclude: dict[str, np.ndarray] = {}
        self.excluded = 0
        #: device -> the origin hosts seen with it (more than one: a collision)
        self.hosts: dict[int, set[str]] = {}
        #: meta device -> the archives (indices of the inputs) it was seen in
        self.archives: dict[int, set[int]] = {}
        self.segments = 0
        self.records = 0

    # ------------------------------------------------------------------ the walk
    def add_archives(self, input_dirs: Iterable[str], threads: int = 2,
                     spark=None) -> OriginIndex:
        """Walk every sealed segment of the archives (in the order given, segments in
        number order).  A local directory is read here, up to ``threads`` segments
        ahead; a URI (:mod:`.archives`) by a Spark job through Hadoop
        (:meth:`add_archive_spark`, ``spark`` needed)."""
        from .archives import is_uri
        dirs = list(input_dirs)
        run: list[str] = []
        for k, d in enumerate(dirs):
            if not is_uri(d):
                run.append(d)
                continue
            self._add_local(run, k - len(run), threads)
            run = []
            if spark is None:
                raise ValueError(f"{d}: a URI is read by a Spark job (no session given)")
            self.add_archive_spark(spark, k, d)
        self._add_local(run, len(dirs) - len(run), threads)
        return self

    def _add_local(self, input_dirs: list[str], first: int, threads: int) -> None:
        """Local archives ``first``, ``first + 1``, ... read here."""
        from .decode import list_segments
        todo = [(first + k, segno, path) for k, d in enumerate(input_dirs)
                for segno, path in list_segments(d)]

        def read(item):
            _k, segno, path = item
            try:
                return segment_origins(path, segno)
            except OSError:
                return None             # vanished/unreadable: the scan reports it as a row
        with ThreadPoolExecutor(max_workers=max(1, threads),
                                thread_name_prefix="origin-walk") as ex:
            window = []
            it = iter(todo)
            for item in it:
                window.append((item, ex.submit(read, item)))
                if len(window) > threads:
                    (k, _s, p), fut = window.pop(0)
                    self.add_segment(k, p, fut.result())
            for (k, _s, p), fut in window:
                self.add_segment(k, p, fut.result())

    def add_archive_spark(self, spark, archive: int, uri: str) -> None:
        """Walk one archive given as a URI with a Spark job: the JVM reader lists and
        reads its segments through Hadoop on the executors, which send back per record
        only the meta numbers and the part of the body an origin or a restart marker is
        read from (:func:`spark_walk_frame`); the walk itself then runs here, in arrival
        order, as for a local archive.  The driver holds these columns of the whole
        archive at once (about 60 bytes per record, plus about 100 per forwarded one)."""
        from ..spool import segment as fmt
        from .archives import segment_key
        t = spark_walk_frame(spark, uri).toArrow()
        if t.num_rows == 0:
            return
        seg = t["segment"].to_numpy(zero_copy_only=False).astype(np.int64)
        rec = t["record"].to_numpy(zero_copy_only=False).astype(np.int64)
        order = np.lexsort((rec, seg))
        t = t.take(pa.array(order))
        seg = seg[order]
        bounds = np.flatnonzero(np.diff(seg)) + 1
        for a, z in zip(np.concatenate(([0], bounds)).tolist(),
                        np.concatenate((bounds, [len(seg)])).tolist(), strict=True):
            part = t.slice(a, z - a)
            segno = int(seg[a])
            so = origins_of(part.combine_chunks())
            self.add_segment(archive, segment_key(uri, fmt.segment_name(segno, True)), so)

    def add_segment(self, archive: int, path: str | None, so: SegmentOrigins | None,
                    last: bool = True) -> None:
        """One segment's records, in arrival order after everything added before
        (``last``: into the last hop's loss state too; ``path`` None: no exclusions
        kept, the streaming run drops the copies itself)."""
        if so is None or len(so.record) == 0:
            return
        self.segments += 1
        self.records += len(so.record)
        for dev in np.unique(so.device).tolist():
            self.archives.setdefault(dev, set()).add(archive)
        if last:
            self.last.add_ordered(so.device, so.sequence, so.minute)
        has = so.has_origin
        skips_by_row = {row: (a, b) for row, a, b in so.skips}
        if has.any():
            rows = np.flatnonzero(has)
            hosts = [so.host[i] for i in rows.tolist()]
            # group by (host, device), keeping the arrival order inside each group
            keys: dict[tuple[str, int], list[int]] = {}
            for i, h, d in zip(rows.tolist(), hosts, so.odev[rows].tolist(), strict=True):
                keys.setdefault((h, d), []).append(i)
            dup_rows = []
            for key, idx in keys.items():
                self.hosts.setdefault(key[1], set()).add(key[0])
                sel = np.array(idx, dtype=np.int64)
                dl = self.origin.get(key)
                if dl is None:
                    dl = self.origin[key] = DeviceLoss()
                dups: list = []
                dl.update(so.oseq[sel], so.minute[sel], False, dups)
                if dups[0].any():
                    dup_rows.append(sel[dups[0]])
                for i in idx:
                    sk = skips_by_row.get(i)
                    if sk is not None:
                        dl.declare(sk[0], sk[1], int(so.minute[i]))
            if dup_rows and path is not None:
                recs = np.sort(so.record[np.concatenate(dup_rows)])
                prev = self.exclude.get(path)
                self.exclude[path] = recs if prev is None else np.union1d(prev, recs)
                self.excluded += len(recs)
        for row, (a, b) in skips_by_row.items():
            if last and not has[row]:   # the archiving relay's own restart marker
                dev = int(so.device[row])
                self.last.devices.setdefault(dev, DeviceLoss()).declare(
                    a, b, int(so.minute[row]))

    # ------------------------------------------------------------------ streaming
    def add_rows(self, t: pa.Table) -> None:
        """Records of a committed micro-batch (the streaming run's ``_records`` columns
        ``archive, segment, record, device, sequence, created_ms, app, env`` and the origin
        columns), in any order: sorted here by arrival; origin state only."""
        if t.num_rows == 0:
            return
        ok = pc.and_(pc.is_valid(t["device"]), pc.is_valid(t["created_ms"]))
        t = t.filter(ok)
        if t.num_rows == 0:
            return
        arch = t["archive"].to_numpy(zero_copy_only=False).astype(np.int64)
        seg = t["segment"].to_numpy(zero_copy_only=False).astype(np.int64)
        rec = t["record"].to_numpy(zero_copy_only=False).astype(np.int64)
        t = t.take(pa.array(np.lexsort((rec, seg, arch))))
        so = _origins_from(t, {name: t[name] for name in ORIGIN_NAMES})
        self.add_segment(0, None, so, last=False)

    def save(self, path: str, batch: int) -> None:
        """The origin state (runs and rows of every origin) in one ``.npz`` file."""
        keys = sorted(self.origin)
        arrays = {"batch": np.array([batch], dtype=np.int64),
                  "keys": np.array([json.dumps([[h, d] for h, d in keys])])}
        for i, k in enumerate(keys):
            arrays.update(state_arrays(self.origin[k], str(i)))
        write_npz(path, arrays)

    @classmethod
    def load(cls, path: str) -> tuple[OriginIndex, int]:
        """(state, last batch included); an empty state and -1 when there is none."""
        idx = cls()
        try:
            z = np.load(path)
        except FileNotFoundError:
            return idx, -1
        with z:
            batch = int(z["batch"][0])
            for i, (h, dev) in enumerate(json.loads(str(z["keys"][0]))):
                idx.origin[(h, int(dev))] = read_state(z, str(i))
                idx.hosts.setdefault(int(dev), set()).add(h)
        return idx, batch

    # ------------------------------------------------------------------ results
    @property
    def collisions(self) -> dict[int, list[str]]:
        """Device numbers seen from more than one origin host (kept apart, never merged)."""
        return {d: sorted(h) for d, h in sorted(self.hosts.items()) if len(h) > 1}

    @property
    def shared_devices(self) -> dict[int, list[int]]:
        """Meta devices found in more than one of the archives read (two relays with one
        device number: their records are kept, their loss rows are not meaningful)."""
        return {d: sorted(a) for d, a in sorted(self.archives.items()) if len(a) > 1}

    def origin_table(self) -> pa.Table:
        parts = []
        for (host, dev), d in sorted(self.origin.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            t = d.table(dev)
            t["host"] = [host] * len(t["device"])
            parts.append(pa.table({f.name: t[f.name] for f in OUT_SCHEMA}, schema=OUT_SCHEMA))
        return pa.concat_tables(parts) if parts else OUT_SCHEMA.empty_table()

    def gaps_table(self) -> pa.Table:
        cols: dict[str, list] = {f.name: [] for f in GAPS_SCHEMA}

        def add(hop, host, dev, d):
            a, z, m = d.gaps()
            cols["hop"] += [hop] * len(a)
            cols["host"] += [host] * len(a)
            cols["device"] += [dev] * len(a)
            cols["first_missing"] += a.tolist()
            cols["last_missing"] += z.tolist()
            cols["count"] += (z - a + 1).tolist()
            cols["minute_ms"] += m.tolist()
        for (host, dev), d in sorted(self.origin.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            add("origin", host, dev, d)
        for dev, d in sorted(self.last.devices.items()):
            add("last", "", dev, d)
        return pa.table(cols, schema=GAPS_SCHEMA)

    def exclusions_of(self, input_dir: str) -> str:
        """The ``exclude`` option of the data source for one archive directory (the
        records of its segments to leave out): ``SEGNO:A-B,C,...;SEGNO:...``."""
        import os

        from ..spool import segment as fmt
        from .archives import dir_key, is_uri
        out = []
        d = dir_key(input_dir)
        for path, recs in sorted(self.exclude.items()):
            home, name = path.rsplit("/", 1) if is_uri(path) else \
                (os.path.dirname(os.path.abspath(path)), os.path.basename(path))
            if home != d:
                continue
            parsed = fmt.parse_segment_name(name)
            if parsed is None:
                continue
            out.append(f"{parsed[0]}:{encode_ranges(recs)}")
        return ";".join(out)

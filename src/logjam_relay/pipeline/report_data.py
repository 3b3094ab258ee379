"""The figures of ``logjam-relay pipeline report``, read from the stats tables with pyarrow.

No Spark and no JVM: the four Parquet tables that ``pipeline stats`` writes
(``request_stats``, ``exceptions``, ``loss``, ``topics``, partitioned by ``date``) are read
with ``pyarrow.dataset`` and shaped into small lists of plain rows (JSON-ready: minutes as
epoch milliseconds, UTC) for :mod:`.report`.  Every figure is a sum, a min/max or a row of
the tables; nothing is re-estimated.  Percentiles and apdex are exact per (minute, app,
env, action) and cannot be combined across actions, so they are shown per action (the
busiest ``series`` actions), never averaged.

Sequence ranges of the gaps: the loss table has one row per device and minute (what was
received, the lowest and highest number of the minute, and how many numbers are missing
after runs that end in that minute), so from the tables alone a gap is known to the
minute: "3 missing, among 1,201–1,420".  With the archive (``archive=``, or the
``_loss_state.npz`` a streaming run keeps in the output directory) the exact missing
numbers are listed: the runs of distinct numbers of :class:`.loss.LossState`, walked from
the archive's meta frames (no decompression, no Spark).
"""

from __future__ import annotations

import datetime as _dt
import os
import time

TABLES = ("request_stats", "exceptions", "loss", "topics")
#: how many (app-env, action) series the latency/apdex chart offers (the busiest)
SERIES = 20
#: rows of the worst-minutes table
WORST = 10
#: minutes later than this beyond the present are a producer's clock far off (a time anyone
#: may write, docs/pipeline.md "Times out of range"): off the time axis, counted in the
#: summary, and not where ``--last``'s window ends
FUTURE_SLACK_MS = 86_400_000


def minute_label(ms: int) -> str:
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC).strftime("%Y-%m-%d %H:%M")


def parse_time(s: str) -> int:
    """An ISO-8601 time (``2026-11-24T14:05``, ``2026-11-24 14:05:00Z``, a date) -> epoch
    ms; no offset means UTC."""
    t = _dt.datetime.fromisoformat(s.strip().replace(" ", "T").replace("Z", "+00:00"))
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    return int(t.timestamp() * 1000)


def read_table(tables_dir: str, name: str, start_ms: int | None = None,
               end_ms: int | None = None):
    """One table as a pyarrow Table with ``minute_ms`` (int64, epoch ms) instead of
    ``minute``, rows with ``start_ms <= minute_ms < end_ms``; None when the directory has no
    such table (an empty table when it has no rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    path = os.path.join(tables_dir, name)
    if not os.path.isdir(path):
        return None
    # INT96 read as milliseconds: pyarrow's default (nanoseconds) wraps a time after 2262
    # round (a minute in year 9999, which the tables hold for a producer's clock far off:
    # docs/pipeline.md "Times out of range") and the cast below then fails
    fmt = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(
        coerce_int96_timestamp_unit="ms"))
    d = ds.dataset(path, format=fmt, partitioning="hive", ignore_prefixes=[".", "_"])
    t = d.to_table()
    if "minute" not in t.column_names:          # no data file at all (an empty write)
        return None
    # Spark writes INT96 (naive, UTC) or TIMESTAMP_MICROS (UTC): both are UTC instants
    m = t["minute"]
    if pa.types.is_timestamp(m.type):
        m = pc.cast(pc.cast(m, pa.timestamp("ms", m.type.tz)), pa.int64())
    t = t.drop_columns([c for c in ("minute", "date") if c in t.column_names])
    t = t.append_column("minute_ms", m)
    if start_ms is not None:
        t = t.filter(pc.greater_equal(t["minute_ms"], start_ms))
    if end_ms is not None:
        t = t.filter(pc.less(t["minute_ms"], end_ms))
    return t


def _rows(t) -> list[dict]:
    return t.to_pylist() if t is not None else []


def _app_env(app, env) -> str:
    return f"{app}-{env}" if env else f"{app}"


def _sum(t, col) -> int:
    import pyarrow.compute as pc
    if t is None or t.num_rows == 0:
        return 0
    v = pc.sum(t[col]).as_py()
    return v or 0


def _group(t, keys, aggs, sort=None):
    if t is None or t.num_rows == 0:
        return []
    g = t.group_by(keys, use_threads=False).aggregate(aggs)
    if sort:
        g = g.sort_by(sort)
    return g.to_pylist()


# ------------------------------------------------------------------------------- gaps

def zero_filled(requests: list[dict], first: int | None, last: int | None) -> list[dict]:
    """``requests`` (minute, app-env, requests, 5xx) with the minutes of each app-env that
    have no row filled in as 0 requests between ``first`` and ``last`` (the time axis), so
    that its line drops to zero where its traffic stopped instead of joining the minutes
    on either side.  Only the minutes at the edges of each run of absent minutes get a row
    (the line between two zeros is flat at zero): at most two rows per gap, whatever its
    length."""
    if first is None or not requests:
        return requests
    by_app: dict[str, list[int]] = {}
    for r in requests:
        if first <= r["minute_ms"] <= last:
            by_app.setdefault(r["app_env"], []).append(r["minute_ms"])
    filled = []
    for app, minutes in by_app.items():
        edges = [first - 60_000, *sorted(minutes), last + 60_000]
        for a, b in zip(edges, edges[1:], strict=False):
            if b - a > 60_000:
                filled.extend({"minute_ms": m, "app_env": app, "requests": 0, "http_5xx": 0}
                              for m in sorted({a + 60_000, b - 60_000}))
    if not filled:
        return requests
    return sorted(requests + filled, key=lambda r: (r["minute_ms"], r["app_env"]))


def broken_at_gaps(latency: list[dict]) -> list[dict]:
    """``latency`` (sorted by series and minute) with a row of no value (null percentiles
    and apdex, 0 requests) in the first absent minute after each of a series' minutes: the
    chart's line breaks there instead of joining two minutes that are far apart."""
    out = []
    for k, r in enumerate(latency):
        out.append(r)
        nxt = latency[k + 1] if k + 1 < len(latency) else None
        if nxt is not None and nxt["series"] == r["series"] and \
                nxt["minute_ms"] > r["minute_ms"] + 60_000:
            out.append({"series": r["series"], "minute_ms": r["minute_ms"] + 60_000,
                        "requests": 0, "p50": None, "p95": None, "p99": None, "apdex": None})
    return out


# ------------------------------------------------------------------------------- loss

def exact_gaps(state, start_ms=None, end_ms=None) -> list[dict]:
    """The missing sequence numbers of a :class:`.loss.LossState`, one row per gap:
    device, first and last missing number, how many, and the minute it is counted at (the
    first arrival of the number below it, as in the loss table)."""
    out = []
    for dev, d in sorted(state.devices.items()):
        lo, hi, hm = d.lo.tolist(), d.hi.tolist(), d.hm.tolist()
        for k in range(len(lo) - 1):
            m = hm[k]
            if (start_ms is not None and m < start_ms) or (end_ms is not None and m >= end_ms):
                continue
            out.append({"device": dev, "minute_ms": m, "from_sequence": hi[k] + 1,
                        "to_sequence": lo[k + 1] - 1, "missing": lo[k + 1] - hi[k] - 1})
    return out


def origin_loss_of(tables_dir: str, start_ms=None, end_ms=None) -> tuple[list, list]:
    """(origin devices, their exact gaps) from the origin_loss and gaps tables
    (``pipeline/origin.py``): per origin host and device what was received, missing,
    duplicated, out of order and skipped; ([], []) for tables made without them."""
    ol = read_table(tables_dir, "origin_loss", start_ms, end_ms)
    devices = [{"host": r["host"], "device": r["device"], "received": r["received_sum"],
                "missing": r["missing_sum"], "duplicates": r["duplicates_sum"],
                "out_of_order": r["out_of_order_sum"], "skipped": r["skipped_sum"],
                "first_sequence": r["first_sequence_min"],
                "last_sequence": r["last_sequence_max"],
                "first_minute_ms": r["minute_ms_min"], "last_minute_ms": r["minute_ms_max"]}
               for r in _group(ol, ["device", "host"],
                               [("received", "sum"), ("missing", "sum"),
                                ("duplicates", "sum"), ("out_of_order", "sum"),
                                ("skipped", "sum"), ("first_sequence", "min"),
                                ("last_sequence", "max"), ("minute_ms", "min"),
                                ("minute_ms", "max")],
                               [("device", "ascending"), ("host", "ascending")])]
    g = read_table(tables_dir, "gaps", start_ms, end_ms)
    gaps = sorted(({"host": r["host"], "device": r["device"], "minute_ms": r["minute_ms"],
                    "from_sequence": r["first_missing"], "to_sequence": r["last_missing"],
                    "missing": r["count"]} for r in _rows(g) if r["hop"] == "origin"),
                  key=lambda r: (r["device"], r["host"], r["from_sequence"]))
    return devices, gaps


def loss_state_of(tables_dir: str, archive: str | None):
    """(state, source) for the exact gaps: the archive walked now, else the streaming
    run's ``_loss_state.npz``; (None, None) without either."""
    from .loss import LossState
    if archive:
        st = LossState()
        st.add_archive(archive)
        return st, f"archive {archive}"
    npz = os.path.join(tables_dir, "_loss_state.npz")
    if os.path.exists(npz):
        st, _ = LossState.load(npz)
        return st, f"streaming state {npz}"
    return None, None


# ------------------------------------------------------------------------------- all

def collect(tables_dir: str, start_ms: int | None = None, end_ms: int | None = None,
            last_ms: int | None = None, archive: str | None = None,
            series: int = SERIES, worst: int = WORST, now_ms: int | None = None) -> dict:
    """Everything the report shows, as plain rows.  ``last_ms``: only the last ``last_ms``
    of the tables' time range, ending at their latest minute that is not more than
    :data:`FUTURE_SLACK_MS` after ``now_ms`` (default: the clock), so that one record
    dated in year 9999 does not make the window; when every minute is that far ahead, at
    the latest minute."""
    import pyarrow.compute as pc
    missing_tables = [n for n in TABLES if not os.path.isdir(os.path.join(tables_dir, n))]
    if len(missing_tables) == len(TABLES):
        raise FileNotFoundError(f"{tables_dir}: no stats tables (request_stats, exceptions, "
                                "loss, topics); run `logjam-relay pipeline stats` first")
    tables = [read_table(tables_dir, n, start_ms, end_ms) for n in TABLES]
    horizon = (int(time.time() * 1000) if now_ms is None else now_ms) + FUTURE_SLACK_MS
    if last_ms is not None:
        present = [t["minute_ms"] for t in tables if t is not None and t.num_rows]
        ends = [m for m in (pc.max(c.filter(pc.less_equal(c, horizon))).as_py()
                            for c in present) if m is not None] \
            or [pc.max(c).as_py() for c in present]
        if ends:
            end = max(ends) + 60_000
            start_ms = max(start_ms or 0, end - last_ms)
            tables = [t.filter(pc.and_(pc.greater_equal(t["minute_ms"], start_ms),
                                       pc.less(t["minute_ms"], end)))
                      if t is not None else None for t in tables]
    req, exc, loss, top = tables

    # minute 0 (1970-01-01 00:00 UTC) holds the records with no usable time (a clock never
    # set, a time out of range: docs/pipeline.md, "Times out of range"), and minutes more
    # than a day ahead of the clock (up to 9999-12-30) those of a producer's clock far off:
    # when other minutes exist, the time range and the charts leave both out (one such
    # record would stretch the time axis over fifty years, or eight thousand) and the
    # summary counts them; the tables keep them
    present = [t for t in (req, exc, loss, top) if t is not None and t.num_rows]
    dated = [t.filter(pc.and_(pc.not_equal(t["minute_ms"], 0),
                              pc.less_equal(t["minute_ms"], horizon))) for t in present]
    minutes = [pc.min_max(t["minute_ms"]).as_py() for t in (dated if any(
        t.num_rows for t in dated) else present) if t.num_rows]
    first = min(m["min"] for m in minutes) if minutes else None
    last = max(m["max"] for m in minutes) if minutes else None

    def off_axis(t, col, cond):
        if t is None or t.num_rows == 0:
            return 0
        return _sum(t.filter(cond(t["minute_ms"])), col)

    def counts(cond, applies: bool) -> dict:
        """The off-axis rows' sums (all 0 where nothing is left off the axis)."""
        return {k: off_axis(t, col, cond) if applies else 0
                for k, t, col in (("requests", req, "count"), ("topic_messages", top, "count"),
                                  ("received", loss, "received"), ("missing", loss, "missing"))}
    undated = counts(lambda m: pc.equal(m, 0), first not in (None, 0))
    ahead = counts(lambda m: pc.greater(m, horizon), last is not None and last <= horizon)
    ahead_until = max((pc.max(t["minute_ms"]).as_py() for t in present), default=None) \
        if any(ahead.values()) else None

    # requests and HTTP errors per minute and app-env (exact sums)
    per_app = _group(req, ["minute_ms", "app", "env"],
                     [("count", "sum"), ("http_5xx", "sum")],
                     [("minute_ms", "ascending"), ("app", "ascending"), ("env", "ascending")])
    requests = [{"minute_ms": r["minute_ms"], "app_env": _app_env(r["app"], r["env"]),
                 "requests": r["count_sum"], "http_5xx": r["http_5xx_sum"]}
                for r in per_app]
    requests = zero_filled(requests, first, last)

    # the busiest (app, env, action) series, with their per-minute percentiles and apdex;
    # what is off the time axis is neither counted nor offered (its chart would be empty)
    charted = req.filter(pc.and_(pc.greater_equal(req["minute_ms"], first),
                                 pc.less_equal(req["minute_ms"], last))) \
        if req is not None and first is not None else req
    totals = _group(charted, ["app", "env", "action"], [("count", "sum")],
                    [("count_sum", "descending"), ("app", "ascending"), ("env", "ascending"),
                     ("action", "ascending")])[:series]
    series_names = [f"{_app_env(r['app'], r['env'])} · {r['action']}" for r in totals]
    latency = []
    if totals:
        keys = {(r["app"], r["env"], r["action"]): n for r, n in
                zip(totals, series_names, strict=True)}
        for r in charted.select(["minute_ms", "app", "env", "action", "count", "total_time_p50",
                             "total_time_p95", "total_time_p99", "apdex"]
                            ).to_pylist():
            name = keys.get((r["app"], r["env"], r["action"]))
            if name is not None:
                latency.append({"series": name, "minute_ms": r["minute_ms"],
                                "requests": r["count"], "p50": r["total_time_p50"],
                                "p95": r["total_time_p95"], "p99": r["total_time_p99"],
                                "apdex": r["apdex"]})
        order = {n: i for i, n in enumerate(series_names)}
        latency.sort(key=lambda r: (order[r["series"]], r["minute_ms"]))
        latency = broken_at_gaps(latency)

    exceptions = [{"minute_ms": r["minute_ms"], "exception": r["exception"],
                   "count": r["count_sum"]} for r in
                  _group(exc, ["minute_ms", "exception"], [("count", "sum")],
                         [("minute_ms", "ascending"), ("exception", "ascending")])]

    # the loss report
    loss_rows = sorted(_rows(loss), key=lambda r: (r["device"], r["minute_ms"]))
    devices = [{"device": r["device"], "received": r["received_sum"],
                "missing": r["missing_sum"], "duplicates": r["duplicates_sum"],
                "out_of_order": r["out_of_order_sum"],
                "first_sequence": r["first_sequence_min"],
                "last_sequence": r["last_sequence_max"],
                "first_minute_ms": r["minute_ms_min"], "last_minute_ms": r["minute_ms_max"]}
               for r in _group(loss, ["device"],
                               [("received", "sum"), ("missing", "sum"),
                                ("duplicates", "sum"), ("out_of_order", "sum"),
                                ("first_sequence", "min"), ("last_sequence", "max"),
                                ("minute_ms", "min"), ("minute_ms", "max")],
                               [("device", "ascending")])]
    gap_minutes = [{k: r[k] for k in ("device", "minute_ms", "missing", "received",
                                      "first_sequence", "last_sequence")}
                   for r in loss_rows if r["missing"]]
    state, gaps_source = loss_state_of(tables_dir, archive)
    gaps = exact_gaps(state, start_ms, end_ms) if state is not None else None
    gaps_note = None
    if gaps is not None:
        in_tables = sum(r["missing"] for r in gap_minutes)
        in_state = sum(g["missing"] for g in gaps)
        if in_tables != in_state:
            gaps_note = (f"the tables count {in_tables:,} missing, the {gaps_source} "
                         f"{in_state:,}: the archive changed after the tables were written")

    origin_devices, origin_gaps = origin_loss_of(tables_dir, start_ms, end_ms)

    # per minute: the worst p99 of any action, and the minute's totals
    worst_rows = []
    if req is not None and req.num_rows:
        withp = req.filter(pc.is_valid(req["total_time_p99"]))
        top_p99 = {r["minute_ms"]: r for r in _group(
            withp.sort_by([("minute_ms", "ascending"), ("total_time_p99", "descending"),
                           ("count", "descending")]),
            ["minute_ms"], [("total_time_p99", "first"), ("app", "first"), ("env", "first"),
                            ("action", "first"), ("count", "first")])}
        reqs = {r["minute_ms"]: r for r in _group(req, ["minute_ms"],
                                                  [("count", "sum"), ("http_5xx", "sum")])}
        excs = {r["minute_ms"]: r["count_sum"] for r in
                _group(exc, ["minute_ms"], [("count", "sum")])}
        miss = {r["minute_ms"]: r["missing_sum"] for r in
                _group(loss, ["minute_ms"], [("missing", "sum")])}
        for m, r in top_p99.items():
            worst_rows.append({
                "minute_ms": m, "p99": r["total_time_p99_first"],
                "app_env": _app_env(r["app_first"], r["env_first"]),
                "action": r["action_first"], "action_requests": r["count_first"],
                "requests": reqs[m]["count_sum"], "http_5xx": reqs[m]["http_5xx_sum"],
                "exceptions": excs.get(m, 0), "missing": miss.get(m, 0)})
        worst_rows.sort(key=lambda r: (-r["p99"], -r["action_requests"], r["minute_ms"]))
        worst_rows = worst_rows[:worst]

    apps = [] if req is None else [a for a in pc.unique(req["app"]).to_pylist() if a is not None]
    app_envs = sorted({r["app_env"] for r in requests})
    missing_total = sum(d["missing"] for d in devices) + \
        sum(d["missing"] for d in origin_devices)
    summary = {
        "first_minute_ms": first, "last_minute_ms": last,
        "minutes": (last - first) // 60_000 + 1 if first is not None else 0,
        "requests": _sum(req, "count"), "apps": len(apps), "app_envs": len(app_envs),
        "http_5xx": _sum(req, "http_5xx"), "exceptions": _sum(exc, "count"),
        "topic_messages": _sum(top, "count"),
        "worst_p99": worst_rows[0] if worst_rows else None,
        "loss": missing_total > 0, "missing": missing_total,
        "devices": len(devices) + len(origin_devices),
        "devices_with_loss": sum(1 for d in devices + origin_devices if d["missing"]),
        "origins": len(origin_devices),
        "duplicates": sum(d["duplicates"] for d in devices),
        "out_of_order": sum(d["out_of_order"] for d in devices),
        "undated": undated, "ahead": ahead, "ahead_until_ms": ahead_until,
    }
    return {"tables_dir": os.path.abspath(tables_dir), "missing_tables": missing_tables,
            "summary": summary, "requests": requests, "series": series_names,
            "latency": latency, "exceptions": exceptions, "loss": loss_rows,
            "devices": devices, "gap_minutes": gap_minutes, "gaps": gaps,
            "origin_devices": origin_devices, "origin_gaps": origin_gaps,
            "gaps_source": gaps_source, "gaps_note": gaps_note, "worst": worst_rows,
            "range": {"from_ms": start_ms, "to_ms": end_ms}}

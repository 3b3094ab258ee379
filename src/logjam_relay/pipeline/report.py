"""``logjam-relay pipeline report OUT.html``: one self-contained HTML file from the stats
tables (no Spark, no JVM; ``pipeline stats --report OUT.html`` writes it after the tables).

The page works offline: the charts are Vega-Lite specifications with their data inline,
drawn by vega, vega-lite and vega-embed, whose JavaScript (vl-convert-python's bundle, ~0.9
MB) is inlined in the page; a Content-Security-Policy forbids the page any connection, so
nothing is fetched even where a network is.  What it shows, top to bottom (the figures come
from :mod:`.report_data`):

1. the summary line: time range, requests, apps, the worst p99, loss yes/no;
2. requests per minute per app-env;
3. latency (p50, p95, p99 of ``total_time``) and apdex per minute of one action (a menu of
   the busiest actions: exact percentiles cannot be combined across actions);
4. HTTP 5xx per minute per app-env, and exceptions per minute by name;
5. the loss report: missing numbers per minute and device, each device's figures, and the
   gaps with their sequence ranges (exact with the archive);
6. the worst minutes: the highest p99 of any action, with that minute's totals.

The numbers are in the page as text and as ``data-v`` attributes (exact values) of the
tables and the summary; the charts' data sets are named (``view.data(name)``).
"""

from __future__ import annotations

import html
import json
import os
import sys
import time

from .report_data import collect, minute_label

VEGA_LITE_SCHEMA = "https://vega.github.io/schema/vega-lite/v6.json"
#: the page may not connect anywhere (no CDN, no fonts, no beacons): scripts and styles are
#: inline; vega compiles its expressions with Function() (unsafe-eval)
CSP = ("default-src 'none'; script-src 'unsafe-inline' 'unsafe-eval'; "
       "style-src 'unsafe-inline'; img-src data:; font-src data:")
#: rows of the gaps tables shown at most (the rest is counted)
MAX_TABLE_ROWS = 500
#: draw a point per value only up to this many values in a chart
MAX_POINTS = 3000


class ReportError(Exception):
    """Why no report could be written: one line for the user."""


def javascript_bundle() -> str:
    """vega + vega-lite + vega-embed as one classic script (``window.vegaEmbed``)."""
    try:
        import vl_convert
    except ImportError as e:
        raise ReportError("the report needs vl-convert-python and pyarrow: "
                          "pip install 'logjam-relay[report]'") from e
    js = vl_convert.javascript_bundle()
    if "</script" in js.lower():        # would end the inline script early
        raise ReportError("vl-convert-python's bundle cannot be inlined (it contains "
                          "'</script')")
    return js


# ------------------------------------------------------------------------------ charts

#: the steps of the time axis' ticks, finest first: (Vega time unit, step, minutes); the
#: names are vega-time's units ("minutes", "date": the day of the month)
_TICK_STEPS = [("minutes", n, n) for n in (1, 2, 5, 10, 15, 30)] + \
    [("hours", n, 60 * n) for n in (1, 2, 3, 6, 12)] + \
    [("date", 1, 1440), ("date", 2, 2880), ("week", 1, 10080), ("month", 1, 43200),
     ("month", 3, 129600), ("year", 1, 525600)]
#: at most this many ticks on the time axis (a label "00:00" is ~30 px of ~1,100)
MAX_TICKS = 16


def time_ticks(span_ms: int) -> dict:
    """The time axis' ``tickCount``: whole minutes (the tables' resolution), at the
    finest step that gives at most :data:`MAX_TICKS` ticks over ``span_ms``.  Left to
    Vega, a span of a few minutes got a tick every 30 s, each labelled with its minute
    ("23:57 23:57 23:58 ..."), and the first labels overlapped."""
    minutes = max(1, span_ms // 60_000)
    for interval, step, m in _TICK_STEPS:
        if minutes / m <= MAX_TICKS:
            return {"interval": interval, "step": step}
    return {"interval": "year", "step": max(1, int(minutes / 525600 / MAX_TICKS) + 1)}


def _x(fmt: str, first_ms: int | None = None, last_ms: int | None = None) -> dict:
    """The time axis: UTC, labels on a 24-hour clock (``fmt``), ticks on whole minutes
    (:func:`time_ticks`); with ``first_ms`` and ``last_ms``, every chart spans the
    report's whole time range (a series that stopped ends before the axis does)."""
    scale = {"type": "utc"}
    axis = {"format": fmt, "labelOverlap": True, "labelFlush": True}
    if first_ms is not None and last_ms is not None:
        scale["domain"] = [first_ms, last_ms]
        axis["tickCount"] = time_ticks(last_ms - first_ms)
    return {"field": "minute_ms", "type": "temporal", "title": "minute (UTC)",
            "scale": scale, "axis": axis}


def _tooltip(*fields) -> list[dict]:
    out = [{"field": "minute", "title": "minute (UTC)"}]
    for f in fields:
        out.append(f if isinstance(f, dict) else {"field": f, "type": "quantitative",
                                                  "format": ","})
    return out


#: the minute as a person reads it, for the tooltips (computed in the page: no copy of it
#: in the data)
_MINUTE = {"calculate": "utcFormat(datum.minute_ms, '%Y-%m-%d %H:%M')", "as": "minute"}


#: the time axis zooms (mouse wheel) and pans (drag); a double click resets it
_ZOOM = {"name": "zoom", "select": {"type": "interval", "encodings": ["x"]}, "bind": "scales"}


def _spec(name: str, height: int, params=(), **kw) -> dict:
    """A single-view spec whose data set ``name`` the page fills in (:func:`pack`)."""
    return {"$schema": VEGA_LITE_SCHEMA, "width": "container", "height": height,
            "data": {"name": name}, "params": [*params, _ZOOM], **kw}


def _line(x: dict, name: str, n: int, y: dict, color: dict, tooltip, height=220):
    return _spec(name, height, transform=[_MINUTE],
                 mark={"type": "line", "point": n <= MAX_POINTS, "strokeWidth": 1.5},
                 encoding={"x": x, "y": y, "color": color, "tooltip": tooltip})


def _bars(x: dict, name: str, y: str, title: str, color: dict, tooltip, height=180,
          transform=()):
    return _spec(name, height, transform=[_MINUTE, *transform], mark={"type": "bar"},
                 encoding={"x": {**x, "timeUnit": "utcyearmonthdatehoursminutes"},
                           "y": {"field": y, "type": "quantitative", "title": title,
                                 "stack": "zero"},
                           "color": color, "tooltip": tooltip})


def chart_specs(d: dict) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    """(name -> Vega-Lite spec, name -> its rows) of every chart with data; the name is
    also the data set's (``view.data(name)`` in the page)."""
    specs, data = {}, {}
    legend = {"orient": "top", "title": None, "labelLimit": 320}
    s = d["summary"]
    if any(s["undated"].values()) or any(s["ahead"].values()):
        # minute 0 and minutes far ahead are not on the time axis (the summary says)
        lo, hi = s["first_minute_ms"], s["last_minute_ms"]
        d = {**d, **{k: [r for r in d[k] if lo <= r["minute_ms"] <= hi]
                     for k in ("requests", "latency", "exceptions", "gap_minutes")}}
    long = s["first_minute_ms"] is not None and \
        s["last_minute_ms"] - s["first_minute_ms"] >= 86_400_000
    x = _x("%b %d %H:%M" if long else "%H:%M", s["first_minute_ms"], s["last_minute_ms"])
    if d["requests"]:
        data["requests"] = d["requests"]
        specs["requests"] = _line(
            x, "requests", len(d["requests"]),
            {"field": "requests", "type": "quantitative", "title": "requests per minute"},
            {"field": "app_env", "type": "nominal", "legend": legend},
            _tooltip({"field": "app_env", "title": "app-env"}, "requests", "http_5xx"))
    if d["latency"]:
        first = d["series"][0]
        data["latency"] = data["apdex"] = d["latency"]
        specs["latency"] = _spec(
            "latency", 240, params=[{"name": "series", "value": first}],
            transform=[{"filter": "datum.series == series"}, _MINUTE,
                       {"fold": ["p50", "p95", "p99"], "as": ["percentile", "ms"]}],
            mark={"type": "line", "point": True, "strokeWidth": 1.5},
            encoding={
                "x": x, "y": {"field": "ms", "type": "quantitative",
                              "title": "total_time (ms)"},
                "color": {"field": "percentile", "type": "nominal", "legend": legend,
                          "scale": {"domain": ["p50", "p95", "p99"],
                                    "range": ["#4c78a8", "#f58518", "#e45756"]}},
                "tooltip": _tooltip({"field": "percentile"},
                                    {"field": "ms", "type": "quantitative",
                                     "format": ",.1f", "title": "ms"}, "requests")})
        specs["apdex"] = _spec(
            "apdex", 130, params=[{"name": "series", "value": first}],
            # a null apdex (a minute without total_time, or the row after which the
            # series has no minute: report_data.broken_at_gaps) breaks the line
            transform=[{"filter": "datum.series == series"}, _MINUTE],
            mark={"type": "line", "point": True, "strokeWidth": 1.5, "color": "#54a24b"},
            encoding={"x": x, "y": {"field": "apdex", "type": "quantitative",
                                    "scale": {"domain": [0, 1]}, "title": "apdex"},
                      "tooltip": _tooltip({"field": "apdex", "type": "quantitative",
                                           "format": ".3f"}, "requests")})
    errors = [r for r in d["requests"] if r["http_5xx"]]
    if errors:
        data["http_5xx"] = errors
        specs["http_5xx"] = _bars(
            x, "http_5xx", "http_5xx", "HTTP 5xx per minute",
            {"field": "app_env", "type": "nominal", "legend": legend},
            _tooltip({"field": "app_env", "title": "app-env"}, "http_5xx", "requests"))
    if d["exceptions"]:
        data["exceptions"] = d["exceptions"]
        specs["exceptions"] = _bars(
            x, "exceptions", "count", "exceptions per minute",
            {"field": "exception", "type": "nominal", "legend": legend},
            _tooltip({"field": "exception"}, "count"))
    if d["gap_minutes"]:
        data["loss"] = d["gap_minutes"]
        specs["loss"] = _bars(
            x, "loss", "missing", "missing sequence numbers",
            {"field": "device_name", "type": "nominal", "legend": legend},
            _tooltip({"field": "device_name", "title": "device"}, "missing", "received",
                     {"field": "first_sequence", "title": "lowest number"},
                     {"field": "last_sequence", "title": "highest number"}),
            transform=[{"calculate": "'device ' + datum.device", "as": "device_name"}])
    return specs, data


def pack(rows: list[dict]) -> dict:
    """Rows as columns of the page's data (the page rebuilds the rows): the keys once, and
    each string column as indexes into its distinct values."""
    cols = list(rows[0]) if rows else []
    dicts: dict[str, list] = {}
    index: dict[str, dict] = {}
    for c in cols:
        vals = {r[c] for r in rows}
        if all(isinstance(v, str) for v in vals):
            dicts[c] = sorted(vals)
            index[c] = {v: i for i, v in enumerate(dicts[c])}
    return {"columns": cols, "dicts": dicts,
            "rows": [[index[c][r[c]] if c in index else r[c] for c in cols] for r in rows]}


# ------------------------------------------------------------------------------ HTML

def _e(x) -> str:
    return html.escape(str(x), quote=True)


def _num(v, digits: int | None = None) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{1 if digits is None else digits}f}"
    return f"{v:,}"


def _cell(v, text: str | None = None, cls: str = "") -> str:
    """A table cell: the shown text, and the exact value in ``data-v``."""
    raw = "" if v is None else (repr(v) if isinstance(v, float) else str(v))
    c = f' class="{cls}"' if cls else ""
    return f'<td data-v="{_e(raw)}"{c}>{_e(_num(v) if text is None else text)}</td>'


def _table(name: str, head: list[str], rows: list[list[str]], total: int | None = None) -> str:
    out = [f'<table data-table="{_e(name)}"><thead><tr>'
           + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    out += ["<tr>" + "".join(r) + "</tr>" for r in rows]
    out.append("</tbody></table>")
    if total is not None and total > len(rows):
        out.append(f'<p class="note">{total - len(rows):,} more rows not shown.</p>')
    return "".join(out)


def _seq_range(a: int, b: int) -> str:
    return f"{a:,}" if a == b else f"{a:,}–{b:,}"


def summary_html(d: dict) -> str:
    s = d["summary"]
    if s["first_minute_ms"] is None:
        return ('<section id="summary" data-empty="1"><p class="headline">No data: the '
                f'tables in {_e(d["tables_dir"])} have no rows in this range.</p></section>')
    w = s["worst_p99"]
    attrs = {"first-minute": minute_label(s["first_minute_ms"]),
             "last-minute": minute_label(s["last_minute_ms"]), "minutes": s["minutes"],
             "requests": s["requests"], "apps": s["apps"], "app-envs": s["app_envs"],
             "worst-p99": repr(w["p99"]) if w else "", "loss": "yes" if s["loss"] else "no",
             "missing": s["missing"], "http5xx": s["http_5xx"],
             "exceptions": s["exceptions"]}
    a = " ".join(f'data-{k}="{_e(v)}"' for k, v in attrs.items())
    loss = (f'<b class="bad">loss: yes</b>, {s["missing"]:,} sequence numbers missing on '
            f'{s["devices_with_loss"]} of {s["devices"]} device'
            f'{"s" if s["devices"] != 1 else ""}' if s["loss"] else
            f'<b class="good">loss: no</b> ({s["devices"]} device'
            f'{"s" if s["devices"] != 1 else ""}, no number missing)')
    p99 = f'worst p99 <b>{_num(w["p99"])} ms</b>' if w else "no request with a total_time"
    head = (f'<b>{_e(attrs["first-minute"])} → {_e(attrs["last-minute"])} UTC</b> '
            f'({s["minutes"]:,} min) · <b>{s["requests"]:,}</b> requests · '
            f'<b>{s["apps"]}</b> app{"s" if s["apps"] != 1 else ""} · {p99} · {loss}')
    more = []
    if w:
        more.append(f'worst p99: {_e(w["app_env"])} {_e(w["action"])} at '
                    f'{_e(minute_label(w["minute_ms"]))} ({w["action_requests"]:,} '
                    f'request{"s" if w["action_requests"] != 1 else ""})')
    more.append(f'{s["http_5xx"]:,} HTTP 5xx')
    more.append(f'{s["exceptions"]:,} exceptions')
    if s["duplicates"] or s["out_of_order"]:
        more.append(f'{s["duplicates"]:,} duplicate and {s["out_of_order"]:,} out-of-order '
                    "sequence numbers")
    if s["topic_messages"]:
        more.append(f'{s["topic_messages"]:,} messages of other topics')
    # what is off the time axis (minute 0; minutes far ahead of the clock), one line each
    for key, what in (("undated", "no usable time (counted at 1970-01-01 00:00 UTC"),
                      ("ahead", "dated more than a day ahead of the clock (up to "
                       f'{minute_label(s["ahead_until_ms"]) if s["ahead_until_ms"] else ""} '
                       "UTC")):
        u = s[key]
        if any(u.values()):
            missing = f', {u["missing"]:,} missing' if u["missing"] else ""
            more.append(
                f'<span class="bad" id="{key}">{_e(what)}, not in the charts): '
                f'{u["requests"]:,} requests, {u["topic_messages"]:,} messages of other '
                f'topics, {u["received"]:,} sequence numbers received{missing}</span>')
    return (f'<section id="summary" {a}><p class="headline">{head}</p>'
            f'<p class="more">{" · ".join(more)}</p></section>')


def origin_html(d: dict) -> str:
    """The origin devices (the first relay each event reached, docs/fleet.md), first."""
    od = d.get("origin_devices") or []
    if not od:
        return ""
    parts = ['<h3>Origin devices (first hop)</h3><p class="note">Per relay that first '
             "stamped the events (host and device): every number of its sequence that "
             "reached these archives, across every hop. Skipped: numbers the relay "
             "declared it never used (a restart after a crash).</p>",
             _table("origin_devices", ["host", "device", "received", "missing",
                                       "duplicates", "out of order", "skipped",
                                       "lowest number", "highest number"],
                    [[_cell(r["host"], r["host"]), _cell(r["device"]), _cell(r["received"]),
                      _cell(r["missing"], cls="bad" if r["missing"] else ""),
                      _cell(r["duplicates"]), _cell(r["out_of_order"]), _cell(r["skipped"]),
                      _cell(r["first_sequence"]), _cell(r["last_sequence"])]
                     for r in od])]
    gaps = d.get("origin_gaps") or []
    if gaps:
        parts.append("<h3>Missing numbers of the origin devices (exact)</h3>")
        parts.append('<div class="scroll">' + _table(
            "origin_gaps", ["host", "device", "minute (UTC)", "missing numbers", "missing"],
            [[_cell(g["host"], g["host"]), _cell(g["device"]),
              _cell(g["minute_ms"], minute_label(g["minute_ms"])),
              f'<td data-from="{g["from_sequence"]}" data-to="{g["to_sequence"]}">'
              f'{_seq_range(g["from_sequence"], g["to_sequence"])}</td>',
              _cell(g["missing"], cls="bad")] for g in gaps[:MAX_TABLE_ROWS]],
            len(gaps)) + "</div>")
    parts.append("<h3>Last hop (the relays whose archives were read)</h3>")
    return "".join(parts)


def loss_html(d: dict) -> str:
    s = d["summary"]
    parts = [origin_html(d)]
    if not d["devices"]:
        return "".join(parts) + '<p class="note">The loss table has no rows in this range.</p>'
    parts.append(_table("devices", ["device", "received", "missing", "duplicates",
                                    "out of order", "lowest number", "highest number",
                                    "first minute", "last minute"],
                        [[_cell(r["device"]), _cell(r["received"]),
                          _cell(r["missing"], cls="bad" if r["missing"] else ""),
                          _cell(r["duplicates"]), _cell(r["out_of_order"]),
                          _cell(r["first_sequence"]), _cell(r["last_sequence"]),
                          _cell(r["first_minute_ms"], minute_label(r["first_minute_ms"])),
                          _cell(r["last_minute_ms"], minute_label(r["last_minute_ms"]))]
                         for r in d["devices"]]))
    if not any(r["missing"] for r in d["devices"]):
        parts.append('<p class="good">No sequence number is missing: every device\'s '
                     "numbers are contiguous.</p>" if not s["loss"] else
                     '<p class="good">No sequence number of the last hop is missing.</p>')
        return "".join(parts)
    if d["gaps"] is not None:
        parts.append(f'<h3>Gaps (exact, from the {_e(d["gaps_source"])})</h3>')
        if d["gaps_note"]:
            parts.append(f'<p class="bad">{_e(d["gaps_note"])}</p>')
        gaps = d["gaps"]
        parts.append('<div class="scroll">' + _table("gaps", ["device", "minute (UTC)", "missing numbers", "missing"],
                            [[_cell(g["device"]),
                              _cell(g["minute_ms"], minute_label(g["minute_ms"])),
                              f'<td data-from="{g["from_sequence"]}" '
                              f'data-to="{g["to_sequence"]}">'
                              f'{_seq_range(g["from_sequence"], g["to_sequence"])}</td>',
                              _cell(g["missing"])] for g in gaps[:MAX_TABLE_ROWS]],
                            len(gaps)) + "</div>")
    parts.append("<h3>Minutes with gaps</h3><p class=\"note\">From the loss table: per "
                 "device and minute, how many numbers are missing after the numbers "
                 "received in that minute, among the minute's lowest to highest number. "
                 + ("" if d["gaps"] is not None else
                    "Give <code>--archive DIR</code> to list the exact missing numbers.")
                 + "</p>")
    gm = d["gap_minutes"]
    parts.append('<div class="scroll">' + _table("gap_minutes", ["device", "minute (UTC)", "missing", "received",
                                        "numbers of the minute"],
                        [[_cell(r["device"]), _cell(r["minute_ms"],
                                                    minute_label(r["minute_ms"])),
                          _cell(r["missing"], cls="bad"), _cell(r["received"]),
                          f'<td data-from="{r["first_sequence"]}" '
                          f'data-to="{r["last_sequence"]}">'
                          f'{_seq_range(r["first_sequence"], r["last_sequence"])}</td>']
                         for r in gm[:MAX_TABLE_ROWS]], len(gm)) + "</div>")
    return "".join(parts)


def worst_html(d: dict) -> str:
    if not d["worst"]:
        return '<p class="note">No request with a total_time in this range.</p>'
    return _table("worst", ["minute (UTC)", "p99 (ms)", "app-env", "action",
                            "its requests", "all requests", "HTTP 5xx", "exceptions",
                            "missing"],
                  [[_cell(r["minute_ms"], minute_label(r["minute_ms"])),
                    _cell(r["p99"]), _cell(r["app_env"], r["app_env"]),
                    _cell(r["action"], r["action"]), _cell(r["action_requests"]),
                    _cell(r["requests"]), _cell(r["http_5xx"]), _cell(r["exceptions"]),
                    _cell(r["missing"], cls="bad" if r["missing"] else "")]
                   for r in d["worst"]])


STYLE = """
:root{--fg:#1d2330;--muted:#5b6475;--line:#dde2ea;--bad:#c62828;--good:#2e7d32;--bg:#fff}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
color:var(--fg);background:#f4f6f9}
header{background:#1d2330;color:#fff;padding:14px 28px}
header h1{font-size:18px;margin:0;font-weight:600}
header p{margin:2px 0 0;color:#b8c0cf;font-size:12px}
main{max-width:1280px;margin:0 auto;padding:16px 28px 40px}
section{background:var(--bg);border:1px solid var(--line);border-radius:6px;padding:14px 18px;
margin:0 0 16px}
#summary{border-left:5px solid #4c78a8}
#summary .headline{font-size:18px;margin:0 0 4px}
#summary .more{margin:0;color:var(--muted)}
h2{font-size:15px;margin:0 0 8px}
h3{font-size:14px;margin:14px 0 6px}
.chart{width:100%;min-height:60px}
.bad{color:var(--bad)} .good{color:var(--good)}
.note{color:var(--muted);font-size:12px;margin:4px 0}
.scroll{max-height:420px;overflow:auto;display:inline-block;border:1px solid var(--line)}
table{border-collapse:collapse;font-variant-numeric:tabular-nums;font-size:13px;margin:4px 0}
th,td{padding:3px 10px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th{color:var(--muted);font-weight:600;background:#f8f9fb}
th:first-child,td:first-child{text-align:left}
label{color:var(--muted)} select{font:inherit;max-width:100%}
nav a{color:#b8c0cf;margin-right:14px;font-size:12px}
"""

SCRIPT = """
(function () {
  const specs = JSON.parse(document.getElementById("specs").textContent);
  const data = JSON.parse(document.getElementById("data").textContent);
  function unpack(p) {
    return p.rows.map(function (r) {
      const o = {};
      p.columns.forEach(function (c, i) { const d = p.dicts[c]; o[c] = d ? d[r[i]] : r[i]; });
      return o;
    });
  }
  Object.keys(specs).forEach(function (name) {
    const p = data[name];
    specs[name].data.values = unpack(p.same ? data[p.same] : p);
  });
  const opts = {renderer: "svg", actions: false};
  window.reportViews = {};
  const jobs = Object.keys(specs).map(function (name) {
    return vegaEmbed("#chart-" + name, specs[name], opts).then(function (r) {
      window.reportViews[name] = r.view;
    });
  });
  Promise.all(jobs).then(function () {
    document.body.dataset.rendered = String(jobs.length);
  }, function (e) {
    document.body.dataset.rendered = "error";
    console.error("chart failed: " + e);
  });
  const sel = document.getElementById("series");
  if (sel) sel.addEventListener("change", function () {
    ["latency", "apdex"].forEach(function (n) {
      const v = window.reportViews[n];
      if (v) v.signal("series", sel.value).runAsync();
    });
  });
})();
"""


def _chart(name: str, specs: dict, empty: str) -> str:
    if name in specs:
        return f'<div class="chart" id="chart-{name}"></div>'
    return f'<p class="note" data-nochart="{name}">{_e(empty)}</p>'


def render(d: dict, bundle: str, generated: str | None = None) -> str:
    """The whole page."""
    specs, data = chart_specs(d)
    s = d["summary"]
    span = (f"{minute_label(s['first_minute_ms'])} → {minute_label(s['last_minute_ms'])} UTC"
            if s["first_minute_ms"] is not None else "no data")
    generated = generated or time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    def js(x) -> str:
        return json.dumps(x, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")

    packed, seen = {}, {}
    for name, rows in data.items():     # latency and apdex share their rows: once
        packed[name] = {"same": seen[id(rows)]} if id(rows) in seen else pack(rows)
        seen.setdefault(id(rows), name)
    options = "".join(f'<option value="{_e(n)}">{_e(n)}</option>' for n in d["series"])
    missing = (f'<p class="note">Not in {_e(d["tables_dir"])}: '
               f'{_e(", ".join(d["missing_tables"]))}.</p>' if d["missing_tables"] else "")
    body = f"""
<header><h1>logjam-relay report · {_e(span)}</h1>
<p>tables {_e(d["tables_dir"])} · generated {_e(generated)} ·
<nav style="display:inline"><a href="#requests">requests</a><a href="#latency">latency</a><a
href="#errors">errors</a><a href="#worst">worst minutes</a><a href="#loss">loss</a></nav></p>
</header>
<main>
{summary_html(d)}{missing}
<section id="requests"><h2>Requests per minute, per app-env</h2>
{_chart("requests", specs, "No requests in this range.")}</section>
<section id="latency"><h2>Latency and apdex per minute, one action</h2>
<p class="note">Exact percentiles of total_time per app-env, action and minute (they cannot
be combined across actions); apdex with the threshold the stats were computed with. The menu
lists the {len(d["series"])} busiest actions.</p>
{f'<label>action <select id="series">{options}</select></label>' if options else ""}
{_chart("latency", specs, "No request with a total_time in this range.")}
{_chart("apdex", specs, "")}</section>
<section id="errors"><h2>Errors: HTTP 5xx and exceptions per minute</h2>
{_chart("http_5xx", specs, "No HTTP 5xx in this range.")}
{_chart("exceptions", specs, "No exceptions in this range.")}</section>
<section id="worst"><h2>Worst minutes</h2>
<p class="note">The {len(d["worst"])} minutes with the highest p99 of any action, with that
minute's totals over all app-envs.</p>{worst_html(d)}</section>
<section id="loss"><h2>Loss: missing sequence numbers per device</h2>
{_chart("loss", specs, "")}{loss_html(d)}</section>
</main>"""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>logjam-relay report · {_e(span)}</title>
<style>{STYLE}</style>
<script>{bundle}</script>
</head><body>{body}
<script type="application/json" id="specs">{js(specs)}</script>
<script type="application/json" id="data">{js(packed)}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write_report(tables_dir: str, out_path: str, *, archive: str | None = None,
                 start_ms: int | None = None, end_ms: int | None = None,
                 last_ms: int | None = None) -> dict:
    """Write the report; returns its summary figures plus ``bytes`` and ``path``."""
    bundle = javascript_bundle()
    try:
        d = collect(tables_dir, start_ms, end_ms, last_ms, archive=archive)
    except ImportError as e:
        raise ReportError(f"the report needs pyarrow ({e}): "
                          "pip install 'logjam-relay[report]'") from e
    except FileNotFoundError as e:
        raise ReportError(str(e)) from e
    page = render(d, bundle)
    tmp = f"{out_path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(page)
    os.replace(tmp, out_path)
    return {**d["summary"], "bytes": len(page.encode()), "path": out_path}


def summary_line(s: dict) -> str:
    """The report's summary as one line of text (what the command prints)."""
    if s["first_minute_ms"] is None:
        return f"report: {s['path']} ({s['bytes']:,} bytes): no data in this range"
    w = s["worst_p99"]
    return (f"report: {s['path']} ({s['bytes']:,} bytes): "
            f"{minute_label(s['first_minute_ms'])} → {minute_label(s['last_minute_ms'])} UTC, "
            f"{s['requests']:,} requests, {s['apps']} apps, worst p99 "
            + (f"{w['p99']:,.1f} ms" if w else "-")
            + (f", loss: yes ({s['missing']:,} missing)" if s["loss"] else ", loss: no"))


def main(args) -> int:
    """``pipeline report`` (argparse namespace from :mod:`.cli`)."""
    from .report_data import parse_time
    try:
        start = parse_time(args.start) if args.start else None
        end = parse_time(args.end) if args.end else None
    except ValueError as e:
        print(f"logjam-relay pipeline report: --from/--to: {e}", file=sys.stderr)
        return 2
    last = None
    if args.last:
        from ..units import duration
        try:
            last = int(duration(args.last) * 1000)
        except ValueError as e:
            print(f"logjam-relay pipeline report: --last: {e}", file=sys.stderr)
            return 2
    if not os.path.isdir(args.tables):
        print(f"logjam-relay pipeline report: {args.tables} is not a directory",
              file=sys.stderr)
        return 2
    try:
        s = write_report(args.tables, args.html, archive=args.archive, start_ms=start,
                         end_ms=end, last_ms=last)
    except (ReportError, OSError) as e:
        print(f"logjam-relay pipeline report: {e}", file=sys.stderr)
        return 2
    print(summary_line(s), flush=True)
    return 0

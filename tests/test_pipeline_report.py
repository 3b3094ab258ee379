"""`logjam-relay pipeline report` and `pipeline stats --report`, through the real commands,
in a real browser (Debian's headless Chromium over the DevTools protocol, tests/cdp.py).

One small sample archive; `pipeline stats --report` runs once piped (the tables and a
report) and once with standard error on a terminal (its progress line).  The browser loads
the report from a file:// URL and the test asserts: every chart drew its marks (one SVG
mark per value), no console error, no request but the file itself; every number of the
charts' data, the tables and the summary equals the Parquet tables (read here with
pyarrow, aggregated here in plain Python) and the archive's sequence numbers.  The
screenshot goes to $LOGJAM_RELAY_TEST_REPORT_SCREENSHOT (else the test's temporary directory).

Without Chromium the browser tests skip (one line); under CI=true they fail (.ci/run
installs it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

CI = bool(os.environ.get("CI"))


def _need(module: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        msg = f"{module} is not installed (the 'spark' extra)"
        if CI:
            pytest.fail(msg + ": CI installs it", pytrace=False)
        pytest.skip(msg, allow_module_level=True)


pa = _need("pyarrow")
_need("pyspark")
_need("vl_convert")

from cdp import Browser, chromium_binary  # noqa: E402
from logjam_relay.pipeline import sample  # noqa: E402
from logjam_relay.progress import ERASE  # noqa: E402
from terminal import run_on_terminal  # noqa: E402

CMD = [sys.executable, "-m", "logjam_relay", "pipeline"]
N_MSGS = 3000
SPREAD_MS = 20 * 60_000
#: the charts the sample's report has (it has every kind of figure)
CHARTS = ("requests", "latency", "apdex", "http_5xx", "exceptions", "loss")
#: the app-env that stops sending: none of its traffic in these minutes of the sample (from
#: its first), and none from STOPPED_FROM on (what it would have sent, another app-env does)
STOPPED_APP, OUTAGE, STOPPED_FROM = b"billing-preview", range(5, 10), 15


def with_outage(msgs):
    """The sample with :data:`STOPPED_APP` silent in the :data:`OUTAGE` minutes and from
    :data:`STOPPED_FROM` on: its messages there go to shop-production instead (same
    devices and numbers, so the loss report stays that of the sample)."""
    base = msgs[0].created_ms - msgs[0].created_ms % 60_000
    for m in msgs:
        k = (m.created_ms - base) // 60_000
        if m.app_env == STOPPED_APP and (k in OUTAGE or k >= STOPPED_FROM):
            m.app_env = b"shop-production"
            if m.topic.startswith(b"logs."):
                m.topic = b"logs.shop.production"
    return msgs


def stats_cmd(archive, out, *extra):
    return CMD + ["stats", "--input", str(archive), "--output", str(out),
                  "--master", "local[2]", "--jvm-cache", "off",
                  "--conf", "spark.default.parallelism=2", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    msgs = with_outage(sample.make_messages(N_MSGS, seed=11, spread_ms=SPREAD_MS))
    sample.write_archive(d / "spool", d / "archive", msgs, segment_bytes=128 << 10)
    r = subprocess.run(stats_cmd(d / "archive", d / "out", "--report", d / "stats.html"),
                       capture_output=True, timeout=900)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    return {"dir": d, "msgs": msgs, "archive": d / "archive", "out": d / "out",
            "stats_html": d / "stats.html", "piped": r}


@pytest.fixture(scope="module")
def report(data):
    """The report of the standalone command (with the archive: exact gaps)."""
    path = data["dir"] / "report.html"
    r = subprocess.run(CMD + ["report", "--tables", str(data["out"]), "--archive",
                              str(data["archive"]), str(path)], capture_output=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stderr == b""
    return path, r.stdout.decode()


@pytest.fixture(scope="module")
def browser():
    binary = chromium_binary()
    if binary is None:
        msg = "chromium is not installed (Debian packages chromium, chromium-driver)"
        if CI:
            pytest.fail(msg + ": .ci/run installs them", pytrace=False)
        pytest.skip(msg)
    b = Browser(binary)
    yield b
    b.close()


@pytest.fixture(scope="module")
def page(browser, report):
    p = browser.open(report[0].as_uri())
    rendered = p.wait_for("document.body.dataset.rendered", timeout=120)
    assert rendered == str(len(CHARTS)), (rendered, p.console_errors())
    return p


# ------------------------------------------------------------------ the tables, read here

def table(out, name) -> list[dict]:
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    t = ds.dataset(str(out / name), format="parquet", partitioning="hive",
                   ignore_prefixes=[".", "_"]).to_table()
    ms = pc.cast(pc.cast(t["minute"], pa.timestamp("ms")), pa.int64())
    t = t.drop_columns(["minute", "date"]).append_column("minute_ms", ms)
    return t.to_pylist()


def app_env(r) -> str:
    return f"{r['app']}-{r['env']}" if r["env"] else r["app"]


@pytest.fixture(scope="module")
def tables(data):
    return {n: table(data["out"], n) for n in ("request_stats", "exceptions", "loss", "topics")}


def expected_gaps(msgs) -> list[dict]:
    """The missing numbers of the archive, from the messages written (arrival order)."""
    first_minute: dict[tuple, int] = {}
    for m in msgs:
        first_minute.setdefault((m.device, m.sequence), m.created_ms - m.created_ms % 60000)
    out = []
    for dev in sorted({m.device for m in msgs}):
        seqs = sorted({s for d, s in first_minute if d == dev})
        for a, b in zip(seqs, seqs[1:], strict=False):
            if b > a + 1:
                out.append({"device": dev, "minute_ms": first_minute[(dev, a)],
                            "from_sequence": a + 1, "to_sequence": b - 1,
                            "missing": b - a - 1})
    return out


def dom_tables(page) -> dict[str, list[list[dict]]]:
    """Every report table: rows of cells {text, v (data-v), from, to}."""
    return page.evaluate("""(() => {
        const out = {};
        for (const t of document.querySelectorAll('table[data-table]')) {
            out[t.dataset.table] = [...t.querySelectorAll('tbody tr')].map(r =>
                [...r.cells].map(c => ({text: c.textContent, v: c.dataset.v ?? null,
                                        from: c.dataset.from ?? null,
                                        to: c.dataset.to ?? null})));
        }
        return out;
    })()""")


def marks(page, chart: str, kind: str) -> list[str]:
    """The ``d`` of every data mark (not legend symbols) of one kind in a chart's SVG."""
    return page.evaluate(
        f"[...document.querySelectorAll('#chart-{chart} svg g.mark-{kind}.role-mark path')]"
        ".map(p => p.getAttribute('d') || '')")


def view_data(page, chart: str) -> list[dict]:
    return page.evaluate(f"window.reportViews[{json.dumps(chart)}].data({json.dumps(chart)})"
                         ".map(r => Object.assign({}, r))")


# ------------------------------------------------------------------ the commands

def test_stats_piped_stays_quiet_and_writes_the_report(data):
    r = data["piped"]
    err = r.stderr.decode()
    assert "\r" not in err and "\x1b[" not in err and "[Stage" not in err, err[-2000:]
    assert "pipeline stats:" not in err
    out = r.stdout.decode().splitlines()
    # a line at once, before Spark's imports and JVM (a pipe shows no progress line)
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] pipeline stats: \S+ -> \S+", out[0]), out[:3]
    assert "starting Spark" in "\n".join(out[1:4]), out[:4]
    assert "engine " in out[-2], out[-2]
    assert out[-2].startswith(f"summary: rows in {N_MSGS + 1}")      # +1: the duplicate
    assert out[-1].startswith(f"report: {data['stats_html']} (") and "loss: yes" in out[-1]


def test_sample_writes_an_archive_of_realistic_traffic(tmp_path):
    """`pipeline sample` (no Spark): an archive of the last minutes' made-up traffic --
    several app-envs, actions, latencies, exceptions, every compression, two devices with
    a few numbers missing -- that `pipeline stats` reads; it refuses a directory that is
    not empty (one line, exit 2)."""
    import time as _t

    from logjam_relay.pipeline.decode import decode_segment
    out = tmp_path / "sample"
    t0 = int(_t.time() * 1000)
    r = subprocess.run(CMD + ["sample", "--output", str(out), "--records", "3000",
                              "--minutes", "30"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sample: 3,000 records (4 app-envs, 2 devices, ") and \
        str(out) in lines[0], lines
    assert lines[1] == (f"next: logjam-relay pipeline stats --input {out} --output OUT "
                        "--report OUT/report.html"), lines
    segs = sorted(out.glob("*.seg"))
    assert segs and not list(tmp_path.glob(".sample-spool-*"))      # the spool is gone
    cols = ("app", "env", "topic", "device", "sequence", "created_ms", "compression",
            "error", "action", "total_time", "exceptions")
    rows = [row for n, p in enumerate(segs)
            for b in decode_segment(str(p), n, columns=cols) for row in b.to_pylist()]
    assert len(rows) == 3000
    logs = [x for x in rows if x["topic"].startswith("logs.") and x["action"]]
    assert len({(x["app"], x["env"]) for x in rows}) == 4
    assert len({x["action"] for x in logs}) >= 5
    assert len({x["compression"] for x in rows}) >= 4
    assert sum(1 for x in logs if x["exceptions"]) > 0.05 * len(logs)
    tt = sorted(x["total_time"] for x in logs if x["total_time"] is not None)
    assert tt[len(tt) // 2] < tt[int(len(tt) * 0.99)] / 3          # a long tail
    assert 0 < sum(1 for x in rows if x["error"]) < 20              # a few undecodable
    assert t0 - 31 * 60_000 <= min(x["created_ms"] for x in rows) and \
        max(x["created_ms"] for x in rows) <= int(_t.time() * 1000) + 60_000
    for dev in (1, 2):
        seqs = sorted({x["sequence"] for x in rows if x["device"] == dev})
        assert seqs[-1] - seqs[0] + 1 > len(seqs)                   # some loss to report
    r = subprocess.run(CMD + ["sample", "--output", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"logjam-relay pipeline sample: {out} exists and is not an empty " \
        "directory\n"


def test_report_is_one_self_contained_file(report, data):
    path, stdout = report
    page = path.read_text(encoding="utf-8")
    # nothing to fetch: no external script, style, font or image in the markup (the
    # scripts' text aside), and a policy forbidding the page any connection (the browser
    # test below sees no request but the file)
    markup = re.sub(r"(?s)(<script[^>]*>).*?</script>", r"\1</script>", page)
    assert markup.count("<script") == 4                      # bundle, specs, data, start-up
    assert not re.search(r"<(script|link|img|iframe|object|embed)[^>]*\s(src|href)=",
                         markup, re.I)
    assert "@import" not in markup and "url(" not in markup
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "window.vegaEmbed=" in page                      # the bundle, inline
    assert path.stat().st_size < 2_000_000, path.stat().st_size
    assert stdout.startswith(f"report: {path} (") and "loss: yes" in stdout
    # `stats --report` wrote the same page (it passes the archive too), but for its time
    def strip(s):
        return re.sub(r"generated [0-9: -]+UTC", "", s).replace(str(data["out"]), "")
    assert strip(page) == strip(data["stats_html"].read_text(encoding="utf-8"))


def test_report_needs_no_spark(data, tmp_path):
    """A pyspark that cannot be imported: `pipeline report` still writes the report."""
    fake = tmp_path / "fake"
    (fake / "pyspark").mkdir(parents=True)
    (fake / "pyspark" / "__init__.py").write_text("raise ImportError('no Spark here')\n")
    env = dict(os.environ, PYTHONPATH=str(fake))
    r = subprocess.run(CMD + ["report", "--tables", str(data["out"]),
                              str(tmp_path / "r.html")], capture_output=True, env=env)
    assert r.returncode == 0, r.stderr.decode()
    assert (tmp_path / "r.html").stat().st_size > 100_000


def test_report_errors_are_one_line(data, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "vl_convert.py").write_text("raise ImportError('not installed')\n")
    env = dict(os.environ, PYTHONPATH=str(fake))
    cases = [
        (["report", "--tables", str(data["out"]), str(tmp_path / "a.html")], env,
         "needs vl-convert-python"),
        (["report", "--tables", str(tmp_path), str(tmp_path / "b.html")], None,
         "no stats tables"),
        (["report", "--tables", str(tmp_path / "nope"), str(tmp_path / "c.html")], None,
         "is not a directory"),
        (["report", "--tables", str(data["out"]), "--from", "yesterday",
          str(tmp_path / "d.html")], None, "--from/--to"),
        # before Spark starts: the extra is missing
        (["stats", "--input", str(data["archive"]), "--output", str(tmp_path / "o"),
          "--report", str(tmp_path / "e.html")], env, "needs vl-convert-python"),
    ]
    for args, e, want in cases:
        r = subprocess.run(CMD + args, capture_output=True, env=e, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 2 and want in err and len(err.splitlines()) == 1, (args, err)
    assert not list(tmp_path.glob("*.html")) and not (tmp_path / "o").exists()


def test_report_time_range(data, tables, tmp_path):
    minutes = sorted({r["minute_ms"] for r in tables["request_stats"]})
    lo, hi = minutes[5], minutes[9]
    fmt = "%Y-%m-%dT%H:%M"
    import time as _t
    path = tmp_path / "part.html"
    r = subprocess.run(CMD + ["report", "--tables", str(data["out"]),
                              "--from", _t.strftime(fmt, _t.gmtime(lo / 1000)),
                              "--to", _t.strftime(fmt, _t.gmtime(hi / 1000)), str(path)],
                       capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    page = path.read_text(encoding="utf-8")
    want = sum(x["count"] for x in tables["request_stats"] if lo <= x["minute_ms"] < hi)
    assert f'data-requests="{want}"' in page
    assert f'data-first-minute="{_t.strftime("%Y-%m-%d %H:%M", _t.gmtime(lo / 1000))}"' in page
    r = subprocess.run(CMD + ["report", "--tables", str(data["out"]), "--last", "3m",
                              str(path)], capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    last = max(x["minute_ms"] for t in tables.values() for x in t)
    want = sum(x["count"] for x in tables["request_stats"] if x["minute_ms"] > last - 180_000)
    assert f'data-requests="{want}"' in path.read_text(encoding="utf-8")


def test_report_last_is_not_moved_by_a_record_from_year_9999(data, tables, tmp_path):
    """A time anyone may write (a producer's clock far off, in range: 9999-12-30) is read
    as written (Spark's INT96, which pyarrow reads as nanoseconds by default: year 9999
    wrapped to 1816 and the report failed), stays off the time axis as minute 0 does
    (counted in the summary), and does not make `--last`'s window: it ends at the latest minute not more than a day ahead of the
    clock, and the far-future rows stay out of it; when every minute is that far ahead, the
    window ends at the latest one (as before)."""
    import shutil

    import pyarrow.parquet as pq

    from logjam_relay.pipeline import report_data
    from logjam_relay.pipeline.minutes import MAX_MS
    far = MAX_MS - 59_999                              # 9999-12-30, the last minute
    out = tmp_path / "out"
    shutil.copytree(data["out"], out)
    for name in ("request_stats", "exceptions", "loss", "topics"):
        row = pq.read_table(next((out / name).rglob("*.parquet")),
                            coerce_int96_timestamp_unit="ms").slice(0, 1)
        i = row.schema.get_field_index("minute")
        row = row.set_column(i, "minute", pa.array([far], type=pa.timestamp("ms")))
        if name == "request_stats":
            i = row.schema.get_field_index("count")
            row = row.set_column(i, "count", pa.array([777], type=row.schema.field(i).type))
        (out / name / "date=9999-12-30").mkdir()
        # as Spark writes it (INT96), which pyarrow reads as nanoseconds unless told
        pq.write_table(row, out / name / "date=9999-12-30" / "part-far.parquet",
                       use_deprecated_int96_timestamps=True)
    last = max(x["minute_ms"] for t in tables.values() for x in t)
    # the whole report: the time range and the charts are those without the far rows, the
    # totals keep them, and the summary says so in one line
    from logjam_relay.pipeline import report as rep
    before = report_data.collect(str(data["out"]))
    after = report_data.collect(str(out))
    sb, sa = before["summary"], after["summary"]
    assert (sa["first_minute_ms"], sa["last_minute_ms"], sa["minutes"]) == \
        (sb["first_minute_ms"], sb["last_minute_ms"], sb["minutes"])
    assert sa["requests"] == sb["requests"] + 777 and sa["ahead"]["requests"] == 777
    assert sa["ahead_until_ms"] == far and not any(sb["ahead"].values())
    assert after["series"] == before["series"]
    assert rep.chart_specs(after)[1] == rep.chart_specs(before)[1]
    html = rep.summary_html(after)
    assert 'id="ahead"' in html and "up to 9999-12-30 23:59 UTC" in html and \
        "777 requests" in html and 'id="ahead"' not in rep.summary_html(before)
    # --last
    want = sum(x["count"] for x in tables["request_stats"] if x["minute_ms"] > last - 180_000)
    got = report_data.collect(str(out), last_ms=180_000)["summary"]
    assert (got["requests"], got["last_minute_ms"]) == (want, last)
    # every minute far ahead of the clock (here: the clock at 1970): the latest one
    got = report_data.collect(str(out), last_ms=180_000, now_ms=0)["summary"]
    assert (got["requests"], got["last_minute_ms"]) == (777, far)
    r = subprocess.run(CMD + ["report", "--tables", str(out), "--last", "3m",
                              str(tmp_path / "r.html")], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert f'data-requests="{want}"' in (tmp_path / "r.html").read_text(encoding="utf-8")


def test_stats_progress_on_a_terminal(data, tmp_path):
    rc, out, term = run_on_terminal(stats_cmd(data["archive"], tmp_path / "out"),
                                    timeout=900)
    text = term.decode("utf-8", "replace")
    assert rc == 0, text[-3000:]
    assert ERASE + "pipeline stats: " in text                     # drawn, in place
    last = text.rsplit(ERASE + "pipeline stats: ", 1)[1]
    assert ERASE in last                                         # and erased at the end
    assert "[Stage" not in text                                  # Spark's bar stays off
    o = out.decode()
    assert "\r" not in o and "\x1b[" not in o                    # stdout stays clean
    assert f"summary: rows in {N_MSGS + 1}" in o


# ------------------------------------------------------------------ in the browser

def test_report_renders_in_chromium(page, report, tmp_path):
    assert page.console_errors() == []
    assert page.requests() == [report[0].as_uri()]               # nothing but the file
    assert page.evaluate("Object.keys(window.reportViews).sort()") == sorted(CHARTS)
    for chart in CHARTS:
        n = page.evaluate(f"document.querySelectorAll('#chart-{chart} svg').length")
        assert n == 1, chart
        kinds = {"requests": "symbol", "latency": "symbol", "apdex": "symbol"}
        d = marks(page, chart, kinds.get(chart, "rect"))
        assert d and all(x for x in d), chart                   # marks, with a shape
    shot = os.environ.get("LOGJAM_RELAY_TEST_REPORT_SCREENSHOT") or str(tmp_path / "report.png")
    w, h = page.screenshot(shot)
    png = open(shot, "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == w and int.from_bytes(png[20:24], "big") == h
    assert h > 2000 and len(png) > 100_000                      # a long page, not blank
    assert page.console_errors() == []


def test_chart_numbers_equal_the_tables(page, tables):
    req = tables["request_stats"]
    # requests per minute per app-env, with their 5xx
    want = defaultdict(lambda: [0, 0])
    for r in req:
        w = want[(r["minute_ms"], app_env(r))]
        w[0] += r["count"]
        w[1] += r["http_5xx"]
    rows = view_data(page, "requests")
    got = {(r["minute_ms"], r["app_env"]): [r["requests"], r["http_5xx"]]
           for r in rows if r["requests"]}          # (the 0 rows: the gaps, tested below)
    assert got == dict(want)
    assert len(marks(page, "requests", "symbol")) == len(rows)      # a point per value
    rows_5xx = {k for k, v in want.items() if v[1]}
    assert {(r["minute_ms"], r["app_env"]) for r in view_data(page, "http_5xx")} == rows_5xx
    assert len(marks(page, "http_5xx", "rect")) == len(rows_5xx)
    # exceptions per minute and name
    exc = defaultdict(int)
    for r in tables["exceptions"]:
        exc[(r["minute_ms"], r["exception"])] += r["count"]
    got = {(r["minute_ms"], r["exception"]): r["count"] for r in view_data(page, "exceptions")}
    assert got == dict(exc)
    assert len(marks(page, "exceptions", "rect")) == len(exc)
    # latency and apdex: the busiest action first (shown), its rows exactly
    totals = defaultdict(int)
    for r in req:
        totals[(app_env(r), r["action"])] += r["count"]
    busiest = sorted(totals, key=lambda k: (-totals[k], k))[0]
    rows = sorted((r for r in req if (app_env(r), r["action"]) == busiest),
                  key=lambda r: r["minute_ms"])
    shown = page.evaluate("document.getElementById('series').value")
    assert shown == f"{busiest[0]} · {busiest[1]}"
    got = [r for r in view_data(page, "latency") if r["series"] == shown
           and r["p50"] is not None]                # (no value: a gap, tested below)
    assert [(r["minute_ms"], r["p50"], r["p95"], r["p99"], r["apdex"], r["requests"])
            for r in got] == \
        [(r["minute_ms"], r["total_time_p50"], r["total_time_p95"], r["total_time_p99"],
          r["apdex"], r["count"]) for r in rows]
    assert len(marks(page, "latency", "symbol")) == 3 * len(rows)   # p50, p95, p99
    assert len(marks(page, "apdex", "symbol")) == len(rows)
    # loss: the minutes with missing numbers, per device
    lost = {(r["minute_ms"], r["device"]): r["missing"] for r in tables["loss"] if r["missing"]}
    got = {(r["minute_ms"], r["device"]): r["missing"] for r in view_data(page, "loss")}
    assert got == lost and lost
    assert len(marks(page, "loss", "rect")) == len(lost)


def test_menu_switches_the_action(page, tables):
    options = page.evaluate("[...document.getElementById('series').options].map(o => o.value)")
    second = options[1]
    n = sum(1 for r in tables["request_stats"]
            if f"{app_env(r)} · {r['action']}" == second)
    page.evaluate(f"(() => {{ const s = document.getElementById('series'); "
                  f"s.value = {json.dumps(second)}; "
                  "s.dispatchEvent(new Event('change')); return true; })()")
    page.wait_for(f"document.querySelectorAll('#chart-latency svg g.mark-symbol.role-mark "
                  f"path').length === {3 * n}")
    page.wait_for(f"document.querySelectorAll('#chart-apdex svg g.mark-symbol.role-mark "
                  f"path').length === {n}")
    page.evaluate(f"(() => {{ const s = document.getElementById('series'); "
                  f"s.value = {json.dumps(options[0])}; "
                  "s.dispatchEvent(new Event('change')); return true; })()")
    assert page.console_errors() == []


#: the line marks of a chart as drawn: per point its row, x and y (Vega's scenegraph)
LINE_POINTS = """((name) => {
    const out = [];
    const walk = (mark) => {
        if (!mark || !mark.items) return;
        if (mark.marktype === 'line') {
            mark.items.forEach(it => out.push(Object.assign({}, it.datum, {x: it.x, y: it.y})));
            return;
        }
        mark.items.forEach(it => (it.items || []).forEach(walk));
    };
    walk(window.reportViews[name].scenegraph().root);
    return out;
})"""


def runs(minutes: list[int]) -> list[tuple[int, int]]:
    """The runs of consecutive minutes: [(first, last), ...]."""
    out = []
    for m in sorted(set(minutes)):
        if out and m == out[-1][1] + 60_000:
            out[-1] = (out[-1][0], m)
        else:
            out.append((m, m))
    return out


def test_a_stopped_app_env_drops_to_zero_and_its_latency_line_breaks(page, tables):
    """An app-env that stops sending (for five minutes, then for good) shows as a line at
    zero in those minutes, not as a line joining the minutes on either side; the latency
    line of its actions breaks there."""
    app = STOPPED_APP.decode()
    req = tables["request_stats"]
    everything = [r["minute_ms"] for t in tables.values() for r in t]
    first, last = min(everything), max(everything)
    sent = sorted({r["minute_ms"] for r in req if app_env(r) == app})
    gaps = [(a, b) for a, b in zip([first - 60_000, *sent], [*sent, last + 60_000], strict=True)
            if b - a > 60_000]
    assert len(gaps) >= 2, gaps                     # the outage, and the stop
    silent = [m for a, b in gaps for m in range(a + 60_000, b, 60_000)]
    points = [p for p in page.evaluate(f"{LINE_POINTS}('requests')") if p["app_env"] == app]
    y0 = page.evaluate("window.reportViews.requests.scale('y')(0)")
    x = page.evaluate(f"{json.dumps(silent)}.map(m => window.reportViews.requests"
                      ".scale('x')(m))")
    drawn = {p["minute_ms"]: p for p in points}
    # the line is at zero at both ends of each gap (between them it is flat at zero),
    # and where it sent, at what it sent
    edges = {m for a, b in gaps for m in (a + 60_000, b - 60_000)}
    assert {m for m, p in drawn.items() if p["requests"] == 0} == edges
    assert all(abs(drawn[m]["y"] - y0) < 0.5 for m in edges)
    assert set(drawn) == edges | set(sent)
    # every silent minute lies between two zero points of the line
    pts = sorted((p["x"], p["y"]) for p in points)
    for xm in x:
        left = max((p for p in pts if p[0] <= xm + 0.5), default=None)
        right = min((p for p in pts if p[0] >= xm - 0.5), default=None)
        assert left and right and abs(left[1] - y0) < 0.5 and abs(right[1] - y0) < 0.5, xm

    # its busiest action's latency: one stretch of line per run of minutes with data
    totals = defaultdict(int)
    for r in req:
        if app_env(r) == app:
            totals[r["action"]] += r["count"]
    action = sorted(totals, key=lambda k: (-totals[k], k))[0]
    series = f"{app} · {action}"
    page.evaluate(f"(() => {{ const s = document.getElementById('series'); "
                  f"s.value = {json.dumps(series)}; s.dispatchEvent(new Event('change')); "
                  "return true; })()")
    minutes = [r["minute_ms"] for r in req if app_env(r) == app and r["action"] == action]
    want = len(runs(minutes))
    assert want >= 2
    paths = page.wait_for(
        "(() => { const d = [...document.querySelectorAll('#chart-latency svg "
        "g.mark-line.role-mark path')].map(p => p.getAttribute('d') || ''); "
        f"return d.length === 3 && d.every(x => (x.match(/M/g) || []).length === {want}) "
        "&& d; })()", timeout=30)
    assert len(paths) == 3                          # p50, p95, p99, each in `want` pieces
    assert page.console_errors() == []


def test_time_axis_labels_are_whole_minutes_and_do_not_overlap(page):
    """Every chart's time axis: distinct labels (a tick per whole minute or more, never
    two ticks labelled with the same minute) whose boxes do not overlap, the first ones
    included."""
    for chart in CHARTS:
        boxes = page.evaluate(
            f"[...document.querySelectorAll('#chart-{chart} svg .role-axis-label text')]"
            ".filter(t => /^\\d\\d:\\d\\d$/.test(t.textContent) && "
            "t.getAttribute('opacity') !== '0')"
            ".map(t => { const r = t.getBoundingClientRect(); "
            "return [t.textContent, r.left, r.right]; })")
        labels = [b[0] for b in boxes]
        assert len(labels) >= 5 and len(set(labels)) == len(labels), (chart, labels)
        spans = sorted((b[1], b[2]) for b in boxes)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), (chart, boxes)


def test_time_axis_zooms_with_the_wheel(page):
    """The mouse wheel over a chart zooms its time axis (a double click resets it)."""
    page.evaluate("document.getElementById('chart-requests').scrollIntoView(); true")
    box = page.evaluate("(() => { const r = document.querySelector('#chart-requests svg')"
                        ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()")
    before = page.evaluate("window.reportViews.requests.scale('x').domain().map(Number)")
    x, y = box[0] + box[2] / 2, box[1] + box[3] / 2
    page.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
    page.send("Input.dispatchMouseEvent", {"type": "mouseWheel", "x": x, "y": y,
                                           "deltaX": 0, "deltaY": -400})
    after = page.wait_for("(() => { const d = window.reportViews.requests.scale('x').domain()"
                          f".map(Number); return d[1] - d[0] < {before[1] - before[0]} && d; }})()")
    assert before[0] <= after[0] < after[1] <= before[1]
    page.send("Input.dispatchMouseEvent", {"type": "mousePressed", "x": x, "y": y,
                                           "button": "left", "clickCount": 2})
    page.send("Input.dispatchMouseEvent", {"type": "mouseReleased", "x": x, "y": y,
                                           "button": "left", "clickCount": 2})
    page.wait_for("(() => { const d = window.reportViews.requests.scale('x').domain()"
                  f".map(Number); return d[0] === {before[0]} && d[1] === {before[1]}; }})()")
    assert page.console_errors() == []


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def test_table_numbers_equal_the_tables_and_the_archive(page, tables, data):
    t = dom_tables(page)
    # every shown number is its exact value, rounded for display
    for name, rows in t.items():
        for row in rows:
            for c in row:
                if c["v"] and re.fullmatch(r"-?[0-9.e+-]+", c["v"]) and \
                        re.fullmatch(r"-?[0-9,]+(\.[0-9])?", c["text"]):
                    assert abs(_num(c["text"]) - float(c["v"])) <= 0.05, (name, c)
    # devices
    loss = tables["loss"]
    devs = sorted({r["device"] for r in loss})
    want = [[d, sum(r["received"] for r in loss if r["device"] == d),
             sum(r["missing"] for r in loss if r["device"] == d),
             sum(r["duplicates"] for r in loss if r["device"] == d),
             sum(r["out_of_order"] for r in loss if r["device"] == d),
             min(r["first_sequence"] for r in loss if r["device"] == d),
             max(r["last_sequence"] for r in loss if r["device"] == d)] for d in devs]
    assert [[int(c["v"]) for c in row[:7]] for row in t["devices"]] == want
    # the exact gaps, from the archive's numbers; they add up to the tables' missing
    gaps = expected_gaps(data["msgs"])
    assert [[int(row[0]["v"]), int(row[1]["v"]), int(row[2]["from"]), int(row[2]["to"]),
             int(row[3]["v"])] for row in t["gaps"]] == \
        [[g["device"], g["minute_ms"], g["from_sequence"], g["to_sequence"], g["missing"]]
         for g in gaps]
    for d in devs:
        assert sum(g["missing"] for g in gaps if g["device"] == d) == \
            sum(r["missing"] for r in loss if r["device"] == d)
    # minutes with gaps, from the loss table
    assert [[int(row[0]["v"]), int(row[1]["v"]), int(row[2]["v"]), int(row[3]["v"]),
             int(row[4]["from"]), int(row[4]["to"])] for row in t["gap_minutes"]] == \
        [[r["device"], r["minute_ms"], r["missing"], r["received"], r["first_sequence"],
          r["last_sequence"]]
         for r in sorted(loss, key=lambda r: (r["device"], r["minute_ms"])) if r["missing"]]
    # the worst minutes: the highest p99 of any action per minute
    req = tables["request_stats"]
    best: dict[int, dict] = {}
    for r in req:
        if r["total_time_p99"] is None:
            continue
        b = best.get(r["minute_ms"])
        if b is None or (r["total_time_p99"], r["count"]) > (b["total_time_p99"], b["count"]):
            best[r["minute_ms"]] = r
    worst = sorted(best.values(), key=lambda r: (-r["total_time_p99"], -r["count"],
                                                 r["minute_ms"]))[:10]

    def minute_sum(rows, col, m):
        return sum(x[col] for x in rows if x["minute_ms"] == m)

    assert [[int(row[0]["v"]), float(row[1]["v"]), row[2]["v"], row[3]["v"],
             int(row[4]["v"]), int(row[5]["v"]), int(row[6]["v"]), int(row[7]["v"]),
             int(row[8]["v"])] for row in t["worst"]] == \
        [[r["minute_ms"], r["total_time_p99"], app_env(r), r["action"], r["count"],
          minute_sum(req, "count", r["minute_ms"]), minute_sum(req, "http_5xx", r["minute_ms"]),
          minute_sum(tables["exceptions"], "count", r["minute_ms"]),
          minute_sum(loss, "missing", r["minute_ms"])] for r in worst]


def test_summary_equals_the_tables(page, tables):
    import time as _t
    s = page.evaluate("Object.assign({}, document.getElementById('summary').dataset)")
    allm = [r["minute_ms"] for t in tables.values() for r in t]
    req = tables["request_stats"]

    def label(ms):
        return _t.strftime("%Y-%m-%d %H:%M", _t.gmtime(ms / 1000))

    missing = sum(r["missing"] for r in tables["loss"])
    assert s == {
        "firstMinute": label(min(allm)), "lastMinute": label(max(allm)),
        "minutes": str((max(allm) - min(allm)) // 60_000 + 1),
        "requests": str(sum(r["count"] for r in req)),
        "apps": str(len({r["app"] for r in req})),
        "appEnvs": str(len({app_env(r) for r in req})),
        "worstP99": repr(max(r["total_time_p99"] for r in req
                             if r["total_time_p99"] is not None)),
        "loss": "yes" if missing else "no", "missing": str(missing),
        "http5xx": str(sum(r["http_5xx"] for r in req)),
        "exceptions": str(sum(r["count"] for r in tables["exceptions"]))}
    assert missing > 0
    # what a person reads first: the headline
    head = page.evaluate("document.querySelector('#summary .headline').textContent")
    assert head.startswith(f"{label(min(allm))} → {label(max(allm))} UTC")
    assert f"{sum(r['count'] for r in req):,} requests" in head and "loss: yes" in head


def test_no_usable_time_stays_off_the_time_axis(data, tmp_path):
    """Rows at minute 0 (1970-01-01 00:00 UTC: records with no usable time, docs/pipeline.md
    "Times out of range") do not stretch the report's time range and charts over fifty
    years: the time range and every chart are those of the same tables without them, the
    totals and the devices keep them, and the summary counts them in one line."""
    import shutil

    import pyarrow.parquet as pq

    from logjam_relay.pipeline import report as rep
    from logjam_relay.pipeline import report_data
    out = tmp_path / "out"
    shutil.copytree(data["out"], out)
    added = {}
    for name in ("request_stats", "exceptions", "loss", "topics"):
        row = pq.read_table(next((out / name).rglob("*.parquet"))).slice(0, 1)
        i = row.schema.get_field_index("minute")
        row = row.set_column(i, "minute", pa.array([0], type=row.schema.field(i).type))
        if name == "request_stats":
            i = row.schema.get_field_index("action")
            row = row.set_column(i, "action", pa.array(["T#undated"]))
            i = row.schema.get_field_index("count")
            # the busiest action of all, were minute 0 counted in the latency menu
            row = row.set_column(i, "count", pa.array([10 ** 9],
                                                      type=row.schema.field(i).type))
        (out / name / "date=1970-01-01").mkdir()
        pq.write_table(row, out / name / "date=1970-01-01" / "part-undated.parquet")
        added[name] = row.to_pylist()[0]
    before = report_data.collect(str(data["out"]))
    after = report_data.collect(str(out))
    sb, sa = before["summary"], after["summary"]
    assert sa["first_minute_ms"] == sb["first_minute_ms"] > 0
    assert (sa["last_minute_ms"], sa["minutes"]) == (sb["last_minute_ms"], sb["minutes"])
    assert set(sb["undated"].values()) == {0}
    assert sa["undated"] == {"requests": 10 ** 9, "topic_messages": added["topics"]["count"],
                             "received": added["loss"]["received"],
                             "missing": added["loss"]["missing"]}
    assert sa["requests"] == sb["requests"] + 10 ** 9
    # the latency menu offers the same actions (none whose only requests are undated)
    assert after["series"] == before["series"]
    assert sa["topic_messages"] == sb["topic_messages"] + added["topics"]["count"]
    assert sum(d["received"] for d in after["devices"]) == \
        sum(d["received"] for d in before["devices"]) + added["loss"]["received"]
    assert rep.chart_specs(after)[1] == rep.chart_specs(before)[1]
    assert 'id="undated"' not in rep.summary_html(before)
    html = rep.summary_html(after)
    assert 'id="undated"' in html and "1,000,000,000 requests" in html and \
        f'{added["loss"]["received"]:,} sequence numbers received' in html
    # the command writes the report of such tables (the time axis as without them)
    r = subprocess.run(CMD + ["report", "--tables", str(out), str(tmp_path / "r.html")],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert 'id="undated"' in page and 'data-first-minute="1970' not in page

"""The metrics docs tell the truth: docs/operations.md's "Metrics" tables against /metrics.

Two relays run as the real command: one with a spool (``spool_fsync=batch``: the group
commit's families), a Lumberjack output (its receiver down), a Lumberjack input and a samwise endpoint, after a little traffic (valid, invalid,
broken-meta messages, pings, a malformed samwise request, garbage on the input) so the
labelled families have samples; one with CURVE on (its families only exist then).  Then:

* every family either relay exposes is a row of the tables, with its type, and with its
  label names where the scrape has samples (``device`` on every one but prometheus-cpp's
  ``exposer_*``, the others in the Labels column);
* every row names a family a relay exposes, and for the families with a fixed set of
  label values (``ENUMERATED``) its Meaning names each value exposed;
* every metric name mentioned anywhere in docs/*.md, README.md and deploy/relay.toml
  (``logjam:...`` or ``logjam_relay_...``, sample names such as ``_sum`` included) is
  one a relay exposes.
"""

from __future__ import annotations

import re
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import zmq

from conftest import free_port
from logjam_relay.io.curve import keygen
from relay_harness import meta, relay_settings, start_process, stop_process

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"
MENTION_FILES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md",
                                                        ROOT / "deploy" / "relay.toml"]

#: Families the test relays expose without samples (so their label names cannot be read
#: from the scrape), with the reason.  The test fails if one of them does get samples.
UNSAMPLED = {
    "logjam_relay_samwise_publishes_total": "needs a broker that confirms a publish",
    "logjam_relay_samwise_amqp_errors_total": "needs a broker sending malformed AMQP",
}

#: Known wrong metric names in the docs, each listed until its doc is corrected:
#: (file, word) -> the fix.  Explicit so the rest is checked meanwhile; an entry whose
#: word is gone from the file fails the test (remove it then).
NOT_METRICS: dict[tuple[str, str], str] = {}

#: Families whose label takes a fixed set of values, all exposed from the start (zeros
#: included): the row's Meaning must name each value the relay exposes, in backticks.
ENUMERATED = {
    "logjam_relay_messages_total": "outcome",
    "logjam_relay_input_messages_total": "socket",
    "logjam_relay_replies_total": "status",
    "logjam_relay_http_connections_total": "outcome",
    "logjam_relay_subscriptions": "socket",
    "logjam_relay_spool_lost_records_total": "reason",
    "logjam_relay_dead_letters_total": "reason",
    "logjam_relay_curve_refused_total": "reason",
    "logjam_relay_fd_refused_connections_total": "reason",
}

NAME = r"logjam(?::[a-z_]+)+|logjam_relay_[a-z0-9_]+"

#: prometheus-cpp's own families, unlabelled as logjam-device serves them.
NO_DEVICE_LABEL = {"exposer_scrapes_total", "exposer_transferred_bytes_total",
                   "exposer_request_latencies"}


# ------------------------------------------------------------------ parsing

def parse_exposition(text: str) -> dict[str, dict]:
    """family -> {"type", "labels" (set, None without samples), "samples" (names),
    "values" (label -> values seen)}."""
    fams: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            fams[name] = {"type": kind.strip(), "labels": None, "samples": set()}
        elif line and not line.startswith("#"):
            m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? ", line)
            name = m.group(1)
            fam = next((f for f in (name, re.sub(r"_(sum|count|bucket)$", "", name))
                        if f in fams), None)
            assert fam is not None, f"sample without a TYPE line: {line!r}"
            pairs = re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"',
                               m.group(2) or "")
            labels = {k for k, _ in pairs} - {"quantile", "le"}
            fams[fam]["labels"] = (fams[fam]["labels"] or set()) | labels
            fams[fam]["samples"].add(name)
            for k, v in pairs:
                fams[fam].setdefault("values", {}).setdefault(k, set()).add(v)
    return fams


def metrics_section(text: str) -> str:
    start = text.index("\n## Metrics\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def documented(section: str) -> dict[str, dict]:
    """The rows ``| `name` | type | labels | meaning |`` of the section's tables."""
    rows: dict[str, dict] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            name, kind, labels = m.group(1), m.group(2), m.group(3)
            assert name not in rows, f"{name} documented twice"
            meaning = line[m.end():]
            rows[name] = {"type": kind,
                          "labels": {x.strip() for x in labels.split(",") if x.strip()},
                          "words": set(re.findall(r"`([^`]+)`", meaning))}
    return rows


def mentions(root: Path, files: list[Path]) -> set[tuple[str, str]]:
    """(file, name) of every metric name mentioned; ``logjam:device:*`` style prefixes
    (followed by ``*`` or ``:``+``*``) are not names."""
    out = set()
    for f in files:
        for m in re.finditer(NAME, f.read_text()):
            name = m.group(0).rstrip("_:")
            after = f.read_text()[m.end():m.end() + 2]
            if after.startswith("*") or after.startswith(":*") or m.group(0).endswith("_"):
                continue
            out.add((str(f.relative_to(root)), name))
    return out


def compare(exposed: dict[str, dict], docs: dict[str, dict]) -> list[str]:
    """Every difference between the scrape and the tables, one line each."""
    problems = []
    for name, fam in sorted(exposed.items()):
        row = docs.get(name)
        if row is None:
            problems.append(f"{name} ({fam['type']}) is exposed but not documented")
            continue
        if row["type"] != fam["type"]:
            problems.append(f"{name}: documented as {row['type']}, exposed as {fam['type']}")
        if fam["labels"] is not None:
            if "device" not in fam["labels"] and name not in NO_DEVICE_LABEL:
                problems.append(f"{name}: exposed without the device label")
            if row["labels"] != fam["labels"] - {"device"}:
                problems.append(f"{name}: documented labels {sorted(row['labels'])}, "
                                f"exposed {sorted(fam['labels'] - {'device'})}")
        label = ENUMERATED.get(name)
        if label is not None:
            values = fam.get("values", {}).get(label, set())
            if not values:
                problems.append(f"{name}: no {label} values exposed")
            elif values - row["words"]:
                problems.append(f"{name}: {label} values {sorted(values - row['words'])} "
                                f"not named in the docs")
    for name in sorted(set(docs) - set(exposed)):
        problems.append(f"{name} is documented but not exposed")
    return problems


def test_checker_finds_each_kind_of_difference():
    exposed = parse_exposition(
        "# TYPE logjam_relay_a_total counter\nlogjam_relay_a_total{device=\"0\",x=\"1\"} 1.0\n"
        "# TYPE logjam_relay_b gauge\nlogjam_relay_b{device=\"0\"} 2.0\n"
        "# TYPE logjam_relay_s summary\nlogjam_relay_s_sum{device=\"0\"} 1.0\n"
        "logjam_relay_s_count{device=\"0\"} 1.0\n# TYPE logjam_relay_e_total counter\n")
    assert exposed["logjam_relay_s"]["samples"] == {"logjam_relay_s_sum", "logjam_relay_s_count"}
    assert exposed["logjam_relay_e_total"]["labels"] is None
    docs = documented("\n## Metrics\n| Metric | Type | Labels | Meaning |\n|---|---|---|---|\n"
                      "| `logjam_relay_a_total` | counter | y | a |\n"
                      "| `logjam_relay_b` | counter | | b |\n"
                      "| `logjam_relay_s` | summary | | s |\n"
                      "| `logjam_relay_gone` | gauge | | gone |\n")
    lost = parse_exposition(
        "# TYPE logjam_relay_spool_lost_records_total counter\n"
        + "".join(f'logjam_relay_spool_lost_records_total{{device="0",output="o",'
                  f'reason="{r}"}} 0.0\n' for r in ("dropped", "corrupt")))
    assert lost["logjam_relay_spool_lost_records_total"]["values"]["reason"] == {
        "dropped", "corrupt"}
    lost_doc = documented("| `logjam_relay_spool_lost_records_total` | counter | output, "
                          "reason | lost: `dropped` |")
    assert compare(lost, lost_doc) == [
        "logjam_relay_spool_lost_records_total: reason values ['corrupt'] not named in the docs"]
    assert compare(exposed, docs) == [
        "logjam_relay_a_total: documented labels ['y'], exposed ['x']",
        "logjam_relay_b: documented as counter, exposed as gauge",
        "logjam_relay_e_total (counter) is exposed but not documented",
        "logjam_relay_gone is documented but not exposed",
    ]


def test_mentions_skip_prefixes(tmp_path):
    f = tmp_path / "x.md"
    f.write_text("`logjam:device:*`, `logjam_relay_*`, `logjam_relay_x_total{reason}`, "
                 "logjam:msgbus:sequence.")
    assert mentions(tmp_path, [f]) == {("x.md", "logjam_relay_x_total"),
                                       ("x.md", "logjam:msgbus:sequence")}


# ------------------------------------------------------------------ the relays

def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def traffic(settings, samwise_port: int, input_port: int) -> None:
    """A little of everything that creates labelled samples."""
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10000)
        dealer.connect(f"tcp://127.0.0.1:{settings.router_port}")
        for frames in ([b"", b"docs-test", b"logs.docs", b'{"a":1}', meta()],
                       [b"", b"docs-test", b"foo.bar", b"{}", meta()],       # invalid topic
                       [b"", b"ping", b"docs-test", b"{}", meta()],
                       [b"", b"docs-test", b"logs.docs", b"{}", b"short"]):  # broken meta
            dealer.send_multipart(frames)
            dealer.recv_multipart()
        sam = ctx.socket(zmq.DEALER)
        sam.setsockopt(zmq.LINGER, 0)
        sam.setsockopt(zmq.RCVTIMEO, 10000)
        sam.connect(f"tcp://127.0.0.1:{samwise_port}")
        sam.send_multipart([b"", b"120", b"publish"])                     # malformed
        sam.recv_multipart()
    finally:
        ctx.destroy(linger=0)
    with socket.create_connection(("127.0.0.1", input_port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        while s.recv(4096):                 # closed for bad_version
            pass


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("metrics-docs")
    main = relay_settings(tmp / "main")
    curve = relay_settings(tmp / "curve", device_id=1)
    _, secret = keygen(str(tmp / "keys"), "relay")
    (tmp / "allow").mkdir()
    samwise_port, input_port = free_port(), free_port()
    procs = []
    try:
        procs.append(start_process(main, [
            "--output", f"lumberjack://127.0.0.1:{free_port()}?tls=off&name=out",
            "--input", f"lumberjack://127.0.0.1:{input_port}?tls=off&name=lj",
            "--samwise", f"tcp://127.0.0.1:{samwise_port}",
            "--amqp-broker", f"main=amqp://guest:guest@127.0.0.1:{free_port()}/%2F",
            "--spool-fsync", "batch"],
            log_path=tmp / "main.log"))
        procs.append(start_process(curve, [
            "--curve-secret-key", secret, "--curve-allow-dir", str(tmp / "allow")],
            log_path=tmp / "curve.log"))
        traffic(main, samwise_port, input_port)
        text = scrape(main.metrics_port)
        fams = parse_exposition(text)
        for name, fam in parse_exposition(scrape(curve.metrics_port)).items():
            fams.setdefault(name, fam)
    finally:
        for p in procs:
            try:
                stop_process(p)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return fams


def test_every_exposed_family_is_documented_and_every_documented_one_exposed(exposed):
    docs = documented(metrics_section(OPERATIONS.read_text()))
    assert len(docs) >= 90 and len(exposed) >= 90, (len(docs), len(exposed))
    unsampled = {n for n, f in exposed.items() if f["labels"] is None}
    assert unsampled == set(UNSAMPLED), (
        "families without samples (labels unchecked) differ from UNSAMPLED: "
        f"{sorted(unsampled ^ set(UNSAMPLED))}")
    problems = compare(exposed, docs)
    assert not problems, "docs/operations.md \"Metrics\" vs /metrics:\n" + "\n".join(problems)


def test_every_metric_name_mentioned_in_the_docs_is_exposed(exposed):
    samples = set(exposed) | {s for f in exposed.values() for s in f["samples"]}
    found = mentions(ROOT, MENTION_FILES)
    wrong = sorted(f"{f}: {n}" for f, n in found - set(NOT_METRICS) if n not in samples)
    assert not wrong, "metric names in the docs that no relay exposes:\n" + "\n".join(wrong)
    stale = sorted(f"{f}: {n}" for f, n in set(NOT_METRICS) - found)
    assert not stale, f"NOT_METRICS entries no longer in the docs (remove them): {stale}"

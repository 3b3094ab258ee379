"""/metrics as logjam-device serves it: every family, label set and counting rule.

``DEVICE_METRICS`` is the scrape of logjam-device 0.21.4 (prometheus-cpp 1.0.1, ``-d 7``)
after the reference probe, copied verbatim from shared/specs/reference/logjam-device.md
(``test_the_copy_is_the_reference`` keeps the two equal where that file is at hand).

* ``test_probe_metrics_as_logjam_device`` runs the real command (``-d 7``), scrapes it
  once, replays the probe, waits until the relay has published every accepted message and
  two stats ticks went by, scrapes again and compares: every family of the device with
  its type and help text, every label set (``cpu_seconds_total``: the device's threads,
  plus only the relay's documented extra ones), and every value that the input
  determines.  The reference gives the probe as "every ROUTER/PULL case of the table
  above plus 20,000 PULL messages" and its counts; those counts fix the input but for
  two broken-meta data messages: every case would give 19 invalid and 6 broken metas,
  the device counted 17 and 4.  The replay leaves out the two messages of the ROUTER
  row "meta[:23] / version 2" (the per-case rules, that row's included, are checked
  one by one in ``CASES``).  The reference also gives the bytes received only as a
  total: the 20,000 bodies are sized to give it.
* ``CASES``: what each message of the reference tables (and a few more the device's
  source decides: async pings, a broken meta with a bad stream name) adds to the
  device's counters, through each ingest path (C and Python, PULL and ROUTER).
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import trio
import zmq

from conftest import require_native
from logjam_relay.health.cpu import ThreadCpu, stat_cpu
from logjam_relay.health.http import ScrapeStats
from logjam_relay.relay import compressors as compressors_mod
from logjam_relay.relay import stamping
from logjam_relay.relay.stamping import Pipeline
from relay_harness import meta, relay_settings, running_relay, send, start_process, stop_process
from test_relay_reference import BODY, META_OK, ROUTER_TABLE

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "specs" / "reference" / "logjam-device.md"

DEVICE_METRICS = """\
# HELP exposer_transferred_bytes_total Transferred bytes to metrics services
# TYPE exposer_transferred_bytes_total counter
exposer_transferred_bytes_total 3706
# HELP exposer_scrapes_total Number of times metrics were scraped
# TYPE exposer_scrapes_total counter
exposer_scrapes_total 1
# HELP exposer_request_latencies Latencies of serving scrape requests, in microseconds
# TYPE exposer_request_latencies summary
exposer_request_latencies_count 1
exposer_request_latencies_sum 617
exposer_request_latencies{quantile="0.5"} 617
exposer_request_latencies{quantile="0.9"} 617
exposer_request_latencies{quantile="0.99"} 617
# HELP logjam:device:msgs_received_total How many logjam messages has this device received
# TYPE logjam:device:msgs_received_total counter
logjam:device:msgs_received_total{device="7"} 20008
# HELP logjam:device:msgs_invalid_total How many broken logjam messages have reached this device
# TYPE logjam:device:msgs_invalid_total counter
logjam:device:msgs_invalid_total{device="7"} 17
# HELP logjam:device:msgs_received_bytes_total How many bytes of logjam messages has this device received
# TYPE logjam:device:msgs_received_bytes_total counter
logjam:device:msgs_received_bytes_total{device="7"} 1060379
# HELP logjam:device:msgs_compressed_total How many logjam messages has this device compressed
# TYPE logjam:device:msgs_compressed_total counter
logjam:device:msgs_compressed_total{device="7"} 0
# HELP logjam:device:msgs_compressed_bytes_total How many bytes of logjam messages has this device compressed
# TYPE logjam:device:msgs_compressed_bytes_total counter
logjam:device:msgs_compressed_bytes_total{device="7"} 0
# HELP logjam:device:cpu_seconds_total Sum of user and system CPU usage per thread
# TYPE logjam:device:cpu_seconds_total counter
logjam:device:cpu_seconds_total{device="7",thread="compressor3"} 0.001037
logjam:device:cpu_seconds_total{device="7",thread="compressor2"} 0.000791
logjam:device:cpu_seconds_total{device="7",thread="compressor1"} 0.0009300000000000001
logjam:device:cpu_seconds_total{device="7",thread="compressor0"} 0.001003
logjam:device:cpu_seconds_total{device="7",thread="main"} 0.089838
# HELP logjam:device:ping_count_total How many ping requests this device has processed
# TYPE logjam:device:ping_count_total counter
logjam:device:ping_count_total{device="7"} 4
# HELP logjam:device:ping_count_by_stream_total How many ping requests this device has processed for a given stream
# TYPE logjam:device:ping_count_by_stream_total counter
logjam:device:ping_count_by_stream_total{device="7",stream="probe-test"} 3
# HELP logjam:device:broken_meta_count_total How many requests with broken meta information this device has processed
# TYPE logjam:device:broken_meta_count_total counter
logjam:device:broken_meta_count_total{device="7"} 4
# HELP logjam:device:broken_meta_count_by_stream_total How many requests with broken meta information this device has processed for a given stream
# TYPE logjam:device:broken_meta_count_by_stream_total counter
logjam:device:broken_meta_count_by_stream_total{device="7",stream="probe-test"} 3
logjam:device:broken_meta_count_by_stream_total{device="7",stream="ping"} 1
# HELP logjam:device:app_start_time Timestamp when the device started
# TYPE logjam:device:app_start_time gauge
logjam:device:app_start_time{device="7"} 1795666279
# HELP logjam:msgbus:sequence Current sequence number for the given logjam device
# TYPE logjam:msgbus:sequence gauge
logjam:msgbus:sequence{device="7",app="logjam-device"} 20012
# HELP logjam:device:msgs_received_max_bytes Size of the largest messge recived by this device
# TYPE logjam:device:msgs_received_max_bytes gauge
logjam:device:msgs_received_max_bytes{device="7"} 0
"""

#: Families whose value the input does not determine (time, CPU, this very exposition's
#: size, the heartbeats sent meanwhile): checked on their own below.
NOT_DETERMINED = {"exposer_transferred_bytes_total", "exposer_request_latencies",
                  "logjam:device:cpu_seconds_total", "logjam:device:app_start_time",
                  "logjam:msgbus:sequence"}

#: cpu_seconds_total's threads the relay has beyond the device's (docs/operations.md).
EXTRA_THREADS = re.compile(r"other|metrics_http|zmq_io\d+|output:.+")


# ------------------------------------------------------------------ exposition

def parse(text: str) -> dict[str, dict]:
    """family -> {"type", "help", "samples": {(sample name, frozenset(labels)): value}}."""
    fams: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            fams.setdefault(name, {"samples": {}})["help"] = doc
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split()
            fams.setdefault(name, {"samples": {}})["type"] = kind
        elif line and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
            assert m, line
            name, labels, value = m.groups()
            fam = name if name in fams else re.sub(r"_(sum|count)$", "", name)
            pairs = frozenset(re.findall(r'([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"', labels or ""))
            fams[fam]["samples"][(name, pairs)] = float(value)
    return fams


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def value(fams, family, name=None, **labels):
    key = (name or family, frozenset(labels.items()))
    return fams[family]["samples"][key]


def test_the_copy_is_the_reference():
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} is not here (the logjam-device measurements that "
                    "DEVICE_METRICS was copied from; not part of this repository): the copy "
                    "is not compared with them")
    text = REFERENCE.read_text()
    start = text.index("## /metrics after the reference probe")
    block = text[text.index("```\n", start) + 4:]
    assert block[:block.index("```\n")] == DEVICE_METRICS


def test_parser_reads_the_device_scrape():
    dev = parse(DEVICE_METRICS)
    assert len(dev) == 16
    assert value(dev, "logjam:msgbus:sequence", device="7", app="logjam-device") == 20012
    assert value(dev, "exposer_request_latencies", "exposer_request_latencies_count") == 1
    assert value(dev, "exposer_request_latencies", quantile="0.99") == 617


# ------------------------------------------------------------------ the probe, end to end

#: ROUTER rows of the reference table in the replay: all but "meta[:23] / version 2" (see
#: the module docstring); the two async rows first, each followed by a request, whose
#: reply then tells that the relay has read them (one connection: read in order).
PROBE_ROUTER = [row for row in ROUTER_TABLE if row[0][-1] not in (META_OK[:23], meta(ver=2))]
PROBE_ROUTER.sort(key=lambda row: row[1] is not None)

PULL_ACCEPTED = [
    [b"probe-test", b"logs.probe", b"x" * 81, meta(dev=99, seq=42)],
    [b"probe-test", b"logs.probe", b"{}", meta(created=0)],
    [b"probe-test", b"logs.probe", b"garbage", meta(comp=3)],
    [b"probe-test", b"logs.probe", b"{}", meta(tag=0xBDCA)],
    [b"probe-test", b"logs.probe", b"{}"],
    [b"probe-test", b"logsfoo", b"{}", META_OK],
]
PULL_DROPPED = [
    [b"probe-test", b"logs.probe"],
    [b"probe-test", b"logs.probe", b"{}", META_OK, b"x"],
    [b"probe-test", b"logs.probe", b"{}", META_OK[:23]],
    [b"probe-test", b"logs.probe", b"{}", meta(tag=0x1234)],
    [b"probe-test", b"logs.probe", b"{}", meta(ver=2)],
    [b"probetest", b"logs.probe", b"{}", META_OK],
    [b"probe-test", b"foo.bar", b"{}", META_OK],
]
BULK = 20_000


def bulk_bodies(device_bytes: int, other_bytes: int) -> list[bytes]:
    """20,000 bodies of 53 bytes, the first few 54, summing to what the device received
    less ``other_bytes``."""
    extra = int(device_bytes) - other_bytes - 53 * BULK
    assert 0 <= extra < BULK
    bodies = [b'{"n":%05d,"action":"Bulk#index","code":200,"p":"%s"}'
              % (i, b"x" * (2 + (i < extra))) for i in range(BULK)]
    assert {len(b) for b in bodies[extra:]} == {53}
    return bodies


def replay_probe(settings) -> tuple[str, list[bytes]]:
    """The probe against a running relay: the first scrape, the replay, the last scrape
    once everything is published and two stats ticks went by.  Returns the first
    scrape's text, and the bodies of the accepted messages."""
    ctx = zmq.Context()
    try:
        sub, stats = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
        for s, port in ((sub, settings.pub_port), (stats, settings.stats_port)):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.RCVTIMEO, 30_000)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{port}")
        while sub.recv_multipart()[0] != b"heartbeat":     # subscribed
            pass
        first = scrape(settings.metrics_port)
        accepted = []
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 30_000)
        dealer.connect(f"tcp://127.0.0.1:{settings.router_port}")
        for sent, reply, published in PROBE_ROUTER:
            dealer.send_multipart(sent)
            if reply is not None:
                assert dealer.recv_multipart() == reply, sent
            if published:
                accepted.append(sent[-2])
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(f"tcp://127.0.0.1:{settings.pull_port}")
        for frames in PULL_ACCEPTED + PULL_DROPPED:
            push.send_multipart(frames)
        accepted += [f[2] for f in PULL_ACCEPTED]
        dev = parse(DEVICE_METRICS)
        bodies = bulk_bodies(value(dev, "logjam:device:msgs_received_bytes_total",
                                   device="7"), sum(map(len, accepted)))
        for body in bodies:
            push.send_multipart([b"probe-test", b"logs.probe", body, META_OK])
        accepted += bodies
        # every accepted message published: the relay has read everything sent before
        seen, last_seq = 0, 0
        while seen < len(accepted):
            m = sub.recv_multipart()
            if m[0] != b"heartbeat":
                seen += 1
                last_seq = max(last_seq, int.from_bytes(m[3][16:], "big"))
        # a stats tick after the last message (its number proves it), then one more: that
        # one closed a tick without a message (msgs_received_max_bytes is 0 then)
        while int(stats.recv_multipart()[2]) < last_seq:
            pass
        stats.recv_multipart()
        return first, accepted
    finally:
        ctx.destroy(linger=0)


def test_probe_metrics_as_logjam_device(tmp_path):
    settings = relay_settings(tmp_path, device_id=7, heartbeat_interval=1.0)
    t0 = int(time.time())
    proc = start_process(settings, log_path=tmp_path / "relay.log")
    try:
        t1 = time.time()
        first, accepted = replay_probe(settings)
        last = scrape(settings.metrics_port)
    finally:
        stop_process(proc)
    dev, got = parse(DEVICE_METRICS), parse(last)
    # every family of the device, its type and help text, its label sets
    for family, want in dev.items():
        assert family in got, f"{family} missing"
        assert (got[family]["type"], got[family]["help"]) == (want["type"], want["help"])
        keys, want_keys = set(got[family]["samples"]), set(want["samples"])
        if family == "logjam:device:cpu_seconds_total":
            extra = {dict(k[1])["thread"] for k in keys - want_keys}
            assert want_keys <= keys and all(EXTRA_THREADS.fullmatch(t) for t in extra), \
                sorted(extra)
            assert all(v >= 0 for v in got[family]["samples"].values())
        else:
            assert keys == want_keys, family
        if family not in NOT_DETERMINED:
            assert got[family]["samples"] == want["samples"], family
    assert value(got, "logjam:device:msgs_received_bytes_total", device="7") == \
        sum(map(len, accepted))
    # what the input does not determine, against what determines it
    assert value(got, "exposer_transferred_bytes_total") == len(first.encode())
    lat = value(got, "exposer_request_latencies", "exposer_request_latencies_sum")
    for q in ("0.5", "0.9", "0.99"):
        assert value(got, "exposer_request_latencies", quantile=q) == lat > 0
    assert value(got, "logjam:msgbus:sequence", device="7", app="logjam-device") == \
        len(accepted) + value(got, "logjam_relay_heartbeats_total", device="7")
    start = value(got, "logjam:device:app_start_time", device="7")
    assert start == int(start) and t0 - 1 <= start <= t1
    assert value(got, "logjam:device:cpu_seconds_total", device="7", thread="main") > 0
    # the first scrape had the device's families too (nothing counted yet but the relay's
    # own startup)
    early = parse(first)
    assert value(early, "exposer_scrapes_total") == 0
    assert math.isnan(value(early, "exposer_request_latencies", quantile="0.5"))
    assert set(dev) <= set(early)


# ------------------------------------------------------------------ counting, case by case

def _c(invalid=0, broken=None, pings=0, ping_streams=None, received=0):
    return {"invalid": invalid, "broken": Counter(broken or {}), "pings": pings,
            "ping_streams": Counter(ping_streams or {}), "received": received}


#: (socket, frames as the client sends them, what the device counts for it)
CASES = [
    # ROUTER, the reference table (frames after the routing id)
    ("router", [b"", b"probe-test", b"logs.probe", BODY, META_OK], _c(received=1)),
    ("router", [b"probe-test", b"logs.probe", BODY, META_OK], _c(received=1)),
    ("router", [b"", b"ping", b"probe-test", b"{}", META_OK],
     _c(pings=1, ping_streams={"probe-test": 1})),
    ("router", [b"", b"ping", b"probe-test", b"{}", meta(tag=0x1234)],
     _c(invalid=1, broken={"ping": 1}, pings=1, ping_streams={"probe-test": 1})),
    ("router", [b"", b"ping", b"probe-test"],
     _c(invalid=1, pings=1, ping_streams={"probe-test": 1})),
    ("router", [b"", b"ping"], _c(invalid=1, pings=1)),
    ("router", [b"", b"probe-test", b"logs.probe"], _c(invalid=1)),
    ("router", [b"", b"probe-test", b"logs.probe", BODY], _c(invalid=1)),
    ("router", [b"", b"probe-test", b"logs.probe", BODY, META_OK[:23]],
     _c(invalid=1, broken={"probe-test": 1})),
    ("router", [b"", b"probe-test", b"logs.probe", BODY, meta(ver=2)],
     _c(invalid=1, broken={"probe-test": 1})),
    ("router", [b"", b"probetest", b"logs.probe", BODY, META_OK], _c(invalid=1)),
    ("router", [b"", b"probe-test", b"foo.bar", BODY, META_OK], _c(invalid=1)),
    ("router", [b"", b"probe-test", b"logs.probe", BODY, META_OK, b"extra"], _c(invalid=1)),
    ("router", [b""], _c(invalid=1)),
    ("router", [b"probe-test", b"foo.bar", BODY, META_OK], _c(invalid=1)),
    # ROUTER, as the device's source decides: a ping without the empty frame is no ping
    # (nobody to answer), but its broken meta counts; the meta is checked before the name
    ("router", [b"ping", b"probe-test", b"{}", META_OK], _c()),
    ("router", [b"ping", b"probe-test", b"{}", meta(tag=0x1234)],
     _c(invalid=1, broken={"ping": 1})),
    ("router", [b"ping", b"probe-test"], _c(invalid=1)),
    ("router", [b"", b"probetest", b"logs.probe", BODY, meta(ver=2)],
     _c(invalid=1, broken={"probetest": 1})),
    # the device names the stream of a ping with an empty stream frame after the routing
    # id's earlier messages; the relay says unknown-unknown (docs/operations.md)
    ("router", [b"", b"ping", b"", b"{}", META_OK],
     _c(pings=1, ping_streams={"unknown-unknown": 1})),
    # PULL, the reference cases
    *[("pull", f, _c(received=1)) for f in PULL_ACCEPTED],
    ("pull", PULL_DROPPED[0], _c(invalid=1)),
    ("pull", PULL_DROPPED[1], _c(invalid=1)),
    *[("pull", f, _c(invalid=1, broken={"probe-test": 1})) for f in PULL_DROPPED[2:5]],
    ("pull", PULL_DROPPED[5], _c(invalid=1)),
    ("pull", PULL_DROPPED[6], _c(invalid=1)),
    ("pull", [b"probetest", b"logs.probe", b"{}", meta(ver=2)],
     _c(invalid=1, broken={"probetest": 1})),
    ("pull", [b"ping", b"probe-test", b"{}", META_OK], _c(invalid=1)),
]

#: allow_invalid_meta: the device counts the broken meta (invalid, broken) and goes on
ALLOWED = [
    ("pull", [b"probe-test", b"logs.probe", b"{}", meta(tag=0x1234)],
     _c(invalid=1, broken={"probe-test": 1}, received=1)),
    ("pull", [b"probetest", b"logs.probe", b"{}", meta(ver=2)],
     _c(invalid=2, broken={"probetest": 1})),
    ("router", [b"", b"probe-test", b"logs.probe", BODY, META_OK[:23]],
     _c(invalid=1, broken={"probe-test": 1}, received=1)),
    ("router", [b"", b"ping", b"probe-test", b"{}", meta(ver=2)],
     _c(invalid=1, broken={"ping": 1}, pings=1, ping_streams={"probe-test": 1})),
]

PATHS = {"pull": ("stamp_pull", "prepare_pull", "prepare_pull_py"),
         "router": ("prepare_router", "prepare_router_py")}


def counted(socket: str, frames: list[bytes], path: str, allow: bool = False) -> dict:
    p = Pipeline(7, 1, lambda recs: None, fqdn=b"vm", allow_invalid_meta=allow)
    if path.startswith("prepare_pull"):
        acc = getattr(p, path)([frames])
    elif path == "stamp_pull":
        acc = p.stamp_pull([frames], 1_750_000_000_000)
    else:
        acc = getattr(p, path)([[b"client-1", *frames]], [])
    if acc and path != "stamp_pull":
        p.commit(acc, 1_750_000_000_000)
    c = p.counters
    assert sum(c.invalid_by_reason.values()) == c.invalid
    assert sum(c.broken_meta_by_stream.values()) == c.broken_meta
    assert sum(c.pings_by_stream.values()) <= c.pings
    return {"invalid": c.invalid, "broken": Counter(c.broken_meta_by_stream),
            "pings": c.pings, "ping_streams": Counter(c.pings_by_stream),
            "received": c.received}


@pytest.mark.parametrize("allow", [False, True])
@pytest.mark.parametrize("native", [True, False])
def test_each_message_counts_as_the_device_counts_it(monkeypatch, native, allow):
    if native:
        require_native(stamping._stamp, "logjam_relay.relay._stamp")
    else:
        monkeypatch.setattr(stamping, "_stamp", None)
    allowed = {tuple(f) for _, f, _ in ALLOWED}
    cases = list(ALLOWED if allow else CASES)
    if allow:       # the others count the same either way
        cases += [c for c in CASES if tuple(c[1]) not in allowed and
                  not any(m in c[1] for m in (META_OK[:23], meta(tag=0x1234), meta(ver=2)))]
    wrong = []
    for socket, frames, want in cases:
        for path in PATHS[socket]:
            got = counted(socket, frames, path, allow)
            if got != want:
                wrong.append(f"{path} {frames!r}: {got} != {want}")
    assert not wrong, "\n".join(wrong)


def test_the_probe_cases_give_the_reference_totals():
    """The replayed probe's messages, case by case, sum to the device's figures."""
    dev = parse(DEVICE_METRICS)
    table = {tuple(f): want for _, f, want in CASES}
    total = _c()
    for frames in [row[0] for row in PROBE_ROUTER] + PULL_ACCEPTED + PULL_DROPPED:
        for k, v in table[tuple(frames)].items():
            total[k] += v
    assert total["invalid"] == value(dev, "logjam:device:msgs_invalid_total", device="7")
    assert total["pings"] == value(dev, "logjam:device:ping_count_total", device="7")
    assert dict(total["broken"]) == {
        dict(k[1])["stream"]: v
        for k, v in dev["logjam:device:broken_meta_count_by_stream_total"]["samples"].items()}
    assert dict(total["ping_streams"]) == {"probe-test": 3}
    assert total["received"] + BULK == 20008


# ------------------------------------------------------------------ the largest message

def test_largest_body_is_the_last_ticks():
    p = Pipeline(7, 1, lambda recs: None, fqdn=b"vm")
    c = p.counters
    p.prepare_pull_py([[b"a-b", b"logs", b"x" * 300, META_OK], [b"a-b", b"logs", b"x" * 20]])
    assert (c.received_max_bytes, c.max_bytes_last_second) == (300, 0)
    c.roll_max()
    assert (c.received_max_bytes, c.max_bytes_last_second) == (0, 300)
    c.roll_max()
    assert c.max_bytes_last_second == 0          # a tick without messages


async def test_the_stats_tick_rolls_the_largest_body(tmp_path, monkeypatch):
    """The relay's stats tick rolls the gauge: the tick after a message shows its body,
    the next one (no message meanwhile) 0."""
    rolled = []
    real = stamping.Counters.roll_max

    def roll(self):
        real(self)
        rolled.append(self.max_bytes_last_second)
    monkeypatch.setattr(stamping.Counters, "roll_max", roll)
    async with running_relay(tmp_path, stats_interval=0.05) as (relay, cl):
        push = cl.push()
        await send(push, [b"big-test", b"logs", b"x" * 777, META_OK])
        with trio.fail_after(10):
            while 777 not in rolled or rolled[-1] != 0:
                await trio.sleep(0.01)
        text = await trio.to_thread.run_sync(scrape, cl.settings.metrics_port)
    assert set(rolled) == {0, 777} and rolled.count(777) == 1
    assert rolled[rolled.index(777) + 1] == 0
    assert 'logjam:device:msgs_received_max_bytes{device="0"} 0.0' in text


# ------------------------------------------------------------------ exposer_*

def test_scrape_stats_as_prometheus_cpp():
    now = [100.0]
    st = ScrapeStats(window=60, clock=lambda: now[0])
    snap = st.snapshot()
    assert (snap["scrapes"], snap["bytes"], snap["latency_count"]) == (0, 0, 0)
    assert all(math.isnan(v) for v in snap["quantiles"].values())
    for micros in range(1, 101):
        st.observe(1000, micros)
    snap = st.snapshot()
    assert (snap["scrapes"], snap["bytes"], snap["latency_sum"]) == (100, 100_000, 5050)
    assert snap["quantiles"] == {0.5: 50.0, 0.9: 90.0, 0.99: 99.0}
    now[0] += 61                                 # the window moved on; the totals stay
    st.observe(10, 7)
    snap = st.snapshot()
    assert snap["quantiles"] == {0.5: 7.0, 0.9: 7.0, 0.99: 7.0}
    assert (snap["scrapes"], snap["latency_count"]) == (101, 101)


async def test_only_answered_get_metrics_count_as_scrapes(tmp_path):
    async with running_relay(tmp_path) as (relay, cl):
        port = cl.settings.metrics_port

        def fetch(path, method="GET"):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.read()
            except urllib.error.HTTPError as e:
                return e.read()
        sizes = [len(await trio.to_thread.run_sync(fetch, "/metrics")) for _ in range(2)]
        for path, method in (("/healthz", "GET"), ("/metrics", "HEAD"), ("/nope", "GET")):
            await trio.to_thread.run_sync(fetch, path, method)
        text = (await trio.to_thread.run_sync(fetch, "/metrics")).decode()
    fams = parse(text)
    assert value(fams, "exposer_scrapes_total") == 2
    assert value(fams, "exposer_transferred_bytes_total") == sum(sizes)
    assert value(fams, "exposer_request_latencies", "exposer_request_latencies_count") == 2


# ------------------------------------------------------------------ CPU by thread

def _task(root: Path, tid: int, comm: str, utime: int, stime: int) -> None:
    d = root / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    rest = " ".join(["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30)
    (d / "stat").write_text(f"{tid} ({comm}) {rest}\n")


def test_stat_cpu_reads_utime_and_stime(tmp_path):
    _task(tmp_path, 5, "odd) name (x", 250, 50)
    comm, cpu = stat_cpu(str(tmp_path / "5" / "stat"))
    assert comm == "odd) name (x" and cpu == pytest.approx(300 / os.sysconf("SC_CLK_TCK"))
    assert stat_cpu(str(tmp_path / "missing")) is None
    me = stat_cpu(f"/proc/self/task/{threading.get_native_id()}/stat")
    assert me is not None and me[1] >= 0


def test_thread_cpu_labels_and_stays_monotonic(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    cpu = ThreadCpu(str(tmp_path))
    named = {10: "main", 11: "compressor0", 12: "metrics_http"}
    _task(tmp_path, 10, "logjam-relay", 100, 0)
    _task(tmp_path, 11, "compressor0", 20, 0)
    _task(tmp_path, 13, "ZMQbg/IO/0", 5, 5)
    _task(tmp_path, 14, "Trio thread 3", 7, 0)
    got = cpu.sample(named, {}, total=200 / tick)
    assert got == pytest.approx({"main": 1.0 * 100 / tick, "compressor0": 20 / tick,
                                 "metrics_http": 0.0, "zmq_io0": 10 / tick,
                                 "other": 70 / tick})
    # compressor0 ends (its time stays in its series), the ZMQ thread goes on
    (tmp_path / "11" / "stat").unlink()
    (tmp_path / "11").rmdir()
    _task(tmp_path, 13, "ZMQbg/IO/0", 10, 5)
    got2 = cpu.sample(named, {}, total=230 / tick)
    assert got2["compressor0"] == pytest.approx(20 / tick)
    assert got2["zmq_io0"] == pytest.approx(15 / tick)
    assert all(got2[k] >= got[k] for k in got)
    # rounding in the total never takes "other" back
    assert cpu.sample(named, {}, total=1 / tick)["other"] == got2["other"]


def test_thread_cpu_out_of_descriptors_repeats_the_last_values(tmp_path, monkeypatch):
    """A scrape that cannot open /proc files takes no live thread for ended (which would
    count its time twice once it can read it again)."""
    from logjam_relay.health import cpu as cpu_mod
    tick = os.sysconf("SC_CLK_TCK")
    cpu = ThreadCpu(str(tmp_path))
    _task(tmp_path, 10, "logjam-relay", 100, 0)
    _task(tmp_path, 11, "compressor0", 20, 0)
    named = {10: "main", 11: "compressor0"}
    before = cpu.sample(named, {}, total=150 / tick)
    real = cpu_mod.stat_cpu

    def emfile(path):
        if path.endswith("/11/stat"):
            raise OSError(24, "Too many open files")
        return real(path)
    monkeypatch.setattr(cpu_mod, "stat_cpu", emfile)
    assert cpu.sample(named, {}, total=160 / tick) == before
    monkeypatch.setattr(cpu_mod, "stat_cpu", real)
    _task(tmp_path, 11, "compressor0", 25, 0)
    assert cpu.sample(named, {}, total=170 / tick)["compressor0"] == pytest.approx(25 / tick)


def test_thread_cpu_of_output_workers_survives_restarts(tmp_path):
    cpu = ThreadCpu(str(tmp_path))
    me = stat_cpu(f"/proc/{os.getpid()}/stat")[1]
    first = cpu.sample({}, {"out": os.getpid()}, total=0.0)["output:out"]
    assert first == pytest.approx(me, abs=0.5)
    # a restarted worker (another pid): the old one's time stays, the new one's is added
    parent = stat_cpu(f"/proc/{os.getppid()}/stat")[1]
    after = cpu.sample({}, {"out": os.getppid()}, total=0.0)["output:out"]
    assert after == pytest.approx(first + parent, abs=0.5) and after >= first
    gone = cpu.sample({}, {"out": 0}, total=0.0)["output:out"]
    assert gone >= after


async def test_compression_runs_in_threads_named_compressor_n(tmp_path, monkeypatch):
    """-x: the chunks run in the pool's threads, which the OS knows as compressorN and
    whose CPU the metric reads; without -x there are none and the series read 0."""
    ran = set()
    real = Pipeline.compress_in_place

    def spy(self, *args):
        ran.add(threading.get_native_id())
        return real(self, *args)
    monkeypatch.setattr(Pipeline, "compress_in_place", spy)
    async with running_relay(tmp_path, compress="zlib", compressors=3,
                             batch_size=2048) as (relay, cl):
        pool = relay.compressors
        assert pool.started and all(pool.tids)
        if compressors_mod.set_os_thread_name is not None:
            assert [stat_cpu(f"/proc/self/task/{t}/stat")[0] for t in pool.tids] == \
                ["compressor0", "compressor1", "compressor2"]
        push = cl.push()
        for _ in range(3000):
            await send(push, [b"zip-test", b"logs", b"x" * 300, meta(comp=0)])
        with trio.fail_after(20):
            while relay.pipeline.counters.compressed < 3000:
                await trio.sleep(0.01)
        assert ran and ran <= set(pool.tids)
        text = await trio.to_thread.run_sync(scrape, cl.settings.metrics_port)
        threads = {dict(k[1])["thread"] for k in
                   parse(text)["logjam:device:cpu_seconds_total"]["samples"]}
        assert {"main", "compressor0", "compressor1", "compressor2"} <= threads
    assert not pool.started and not any(pool.tids)      # stopped with the relay
    async with running_relay(tmp_path / "plain") as (relay, cl):
        assert not relay.compressors.started
        text = await trio.to_thread.run_sync(scrape, cl.settings.metrics_port)
        fams = parse(text)
        for i in range(4):
            assert value(fams, "logjam:device:cpu_seconds_total", device="0",
                         thread=f"compressor{i}") == 0
